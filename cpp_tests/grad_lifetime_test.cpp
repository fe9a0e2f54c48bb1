// Suite GradLifetime: what replay hands back and for how long, on both
// backends. One fully connected layer (x [4x8] -> y [4x16]) is graphed; its
// parameter grads come back per policy, and each test checks the lifetime
// rule that policy promises, against eager results computed with the same
// kernels (so comparisons are exact).
#include "layer_fixture.hpp"
#include "scale_layer.hpp"

#include <cstdint>
#include <string>
#include <vector>

namespace {

using kit::Buffer;
using kit::fetch;

class GradLifetime : public LayerTest {};

TEST_P(GradLifetime, ReturnsOwnedParamGrads) {
    graphed::Session s = captured(config());
    Step s1 = step(s, 0);
    ASSERT_EQ(GRAPHED_REF_KIND_CLONE, s1.g.params[0].kind());
    ASSERT_EQ(GRAPHED_REF_KIND_CLONE, s1.g.params[1].kind());
    ASSERT_TRUE(s1.g.params[0].owner());
    const std::vector<float> g1 = read(s1.g.params[0]);
    EXPECT_EQ(eager_wgrad(0), g1) << "the first grad must be the eager grad";

    Step s2 = step(s, 1);
    EXPECT_NE(s1.g.params[0].ptr(), s2.g.params[0].ptr()) << "each backward returns a fresh buffer";
    EXPECT_EQ(g1, read(s1.g.params[0])) << "the grad kept from replay 1 must be intact after replay 2";
    EXPECT_NE(g1, read(s2.g.params[0])) << "the inputs differ, so the grads must differ (else the test proves nothing)";
    EXPECT_EQ(eager_wgrad(1), read(s2.g.params[0]));
    release(s1);
    release(s2);
    EXPECT_EQ(0u, s.stats().clone_bytes_outstanding);
}

TEST_P(GradLifetime, AccumulatesOwnedParamGrads) {
    graphed::Session s = captured(config());
    // As autograd's AccumulateGrad does: the first grad becomes param.grad
    // itself, the second is added into it.
    Step s1 = step(s, 0);
    Step s2 = step(s, 1);
    ASSERT_EQ(0, dev->add(dev->stream(), s1.g.params[0].as<float>(), s2.g.params[0].as<const float>(), OUT * IN));
    const std::vector<float> accumulated = read(s1.g.params[0]);

    Buffer e1, e2;
    eager_wgrad(0, &e1);
    eager_wgrad(1, &e2);
    ASSERT_EQ(0, dev->add(dev->stream(), e1.f32(), e2.f32(), OUT * IN));
    EXPECT_EQ(fetch<float>(*dev, e1.get(), OUT * IN), accumulated) << "g1 + g2 must equal the eager sum exactly";
    release(s1);
    release(s2);
}

TEST_P(GradLifetime, DelayedWgradParamKeepsAlias) {
    layer.param_flags = GRAPHED_PARAM_FLAGS_DELAYED_WGRAD;
    graphed::Session s = captured(config());
    const std::vector<void*> slots = s.buffers(0, 0, GRAPHED_BUFFER_ROLE_PARAM_GRADS);
    Step s1 = step(s, 0);
    Step s2 = step(s, 1);
    for (int p = 0; p < 2; ++p) {
        EXPECT_EQ(GRAPHED_REF_KIND_ALIAS, s1.g.params[p].kind());
        EXPECT_FALSE(s1.g.params[p].owner());
        EXPECT_EQ(slots[p], s1.g.params[p].ptr()) << "the alias is the static slot";
        EXPECT_EQ(s1.g.params[p].ptr(), s2.g.params[p].ptr()) << "same address across replays";
    }
    EXPECT_EQ(eager_wgrad(1), read(s2.g.params[0]));
}

TEST_P(GradLifetime, DelayedWgradGraphReturnsParamGrads) {
    layer.split_wgrad = true;
    layer.param_flags = GRAPHED_PARAM_FLAGS_DELAYED_WGRAD;
    graphed::Session s = captured(config());
    EXPECT_EQ(3u, s.stats().graph_count) << "forward, backward and weight-grad graphs";
    Step st = step(s, 1);
    EXPECT_EQ(GRAPHED_REF_KIND_NONE, st.g.params[0].kind()) << "backward leaves parameter grads to the weight-grad replay";
    EXPECT_EQ(GRAPHED_REF_KIND_ALIAS, st.g.inputs[0].kind());
    std::vector<graphed::Ref> gp = s.wgrad(replay());
    EXPECT_EQ(GRAPHED_REF_KIND_ALIAS, gp[0].kind());
    EXPECT_EQ(eager_wgrad(1), read(gp[0]));
}

TEST_P(GradLifetime, OptOutReturnsAlias) {
    graphed_session_config c = config();
    c.clone_param_grads_on_return = 0;
    graphed::Session s = captured(c);
    Step s1 = step(s, 0);
    ASSERT_EQ(GRAPHED_REF_KIND_ALIAS, s1.g.params[0].kind());
    const std::vector<float> g1 = read(s1.g.params[0]);
    Step s2 = step(s, 1);
    EXPECT_EQ(s1.g.params[0].ptr(), s2.g.params[0].ptr());
    const std::vector<float> g2 = read(s2.g.params[0]);
    ASSERT_NE(g1, g2);
    EXPECT_EQ(g2, read(s1.g.params[0])) << "the documented hazard: a kept alias now holds the next replay's grad";
    // Accumulating as autograd would gives 2 * g2, not g1 + g2.
    ASSERT_EQ(0, dev->add(dev->stream(), s1.g.params[0].as<float>(), s2.g.params[0].as<const float>(), OUT * IN));
    std::vector<float> twice = g2;
    for (float& v : twice) v *= 2.0f;
    EXPECT_EQ(twice, read(s1.g.params[0]));
}

TEST_P(GradLifetime, PolicySnapshotAtCapture) {
    graphed::Session s(config());
    graphed::Callable first = layer.callable(x[0].get(), true);
    const uint32_t a = s.add_callable(first);
    kit::LinearLayer second = layer;
    second.name = "fc_b";
    const uint32_t b2 = s.add_callable(second.callable(x[0].get(), true));
    // Before capture, flags may change, and they count.
    s.set_param_flags(b2, 0, GRAPHED_PARAM_FLAGS_DELAYED_WGRAD);
    s.capture();

    // After capture: the caller's descriptors and the flags API change nothing.
    first.params[0].flags = GRAPHED_PARAM_FLAGS_DELAYED_WGRAD;
    first.params[1].policy = GRAPHED_GRAD_POLICY_ALIAS;
    EXPECT_TRUE(throws(GRAPHED_STATUS_WRONG_STATE,
                       [&] { s.set_param_flags(a, 0, GRAPHED_PARAM_FLAGS_DELAYED_WGRAD); }, "frozen"));

    const std::vector<graphed_grad_policy> pa = s.param_policies(a), pb = s.param_policies(b2);
    EXPECT_EQ(GRAPHED_GRAD_POLICY_CLONE, pa[0]);
    EXPECT_EQ(GRAPHED_GRAD_POLICY_CLONE, pa[1]);
    EXPECT_EQ(GRAPHED_GRAD_POLICY_ALIAS, pb[0]);
    EXPECT_EQ(GRAPHED_GRAD_POLICY_CLONE, pb[1]);

    Step st = step(s, 0);
    EXPECT_EQ(GRAPHED_REF_KIND_CLONE, st.g.params[0].kind());
    EXPECT_EQ(GRAPHED_REF_KIND_CLONE, st.g.params[1].kind());
    release(st);
}

TEST_P(GradLifetime, StrictLeaseDetectsHeldAlias) {
    graphed_session_config c = config();
    c.clone_param_grads_on_return = 0;
    c.strict_leases = 1;
    graphed::Session s = captured(c);
    Step s1 = step(s, 0);
    ASSERT_EQ(GRAPHED_REF_KIND_ALIAS, s1.g.params[0].kind());
    ASSERT_TRUE(s1.g.params[0].lease());
    ASSERT_TRUE(s1.out[0].lease());
    // Done with everything but the weight grad.
    s1.out[0].lease().release();
    s1.g.inputs[0].lease().release();
    s1.g.params[1].lease().release();
    EXPECT_EQ(1u, s.stats().leases_held);
    const std::vector<float> held = read(s1.g.params[0]);

    std::vector<graphed::Ref> out2 = s.forward(replay().data(x[1].get()));
    const graphed::Replay back = replay().data(gy[1].get());
    EXPECT_TRUE(throws(GRAPHED_STATUS_ALIAS_HELD, [&] { s.backward(back); }, "the grad of param 0 of callable 'fc'"));
    EXPECT_NE(std::string::npos, last_error().find("backward replay")) << last_error();
    EXPECT_EQ(held, read(s1.g.params[0])) << "nothing was replayed: the held alias is intact";

    // A held output blocks the next forward the same way.
    EXPECT_TRUE(throws(GRAPHED_STATUS_ALIAS_HELD, [&] { s.forward(replay().data(x[1].get())); },
                       "output 0 of callable 'fc'"));
    out2.clear();  // releases its lease

    const uint64_t lease = s1.g.params[0].lease().id();
    s1.g.params[0].lease().release();
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_lease_release(s.get(), lease), "already released"));
    Step s2;
    s2.g = s.backward(back);
    EXPECT_NE(held, read(s2.g.params[0]));
}

TEST_P(GradLifetime, CopyIntoAndAccumulateInto) {
    for (uint32_t dtype : {GRAPHED_DTYPE_F32, GRAPHED_DTYPE_F16, GRAPHED_DTYPE_BF16}) {
        for (size_t misalign : {size_t(0), size_t(1)}) {
            SCOPED_TRACE(testing::Message() << "dtype " << dtype << ", destination offset " << misalign);
            const size_t n = 1003;  // not a multiple of any vector width
            const size_t es = graphed::dtype_size(dtype);
            ScaleRig rig(*dev, config(), dtype, n);
            const size_t bytes = rig.bytes();
            Buffer dst0(*dev, bytes + 16), dst1(*dev, bytes + 16);
            void* d0 = static_cast<uint8_t*>(dst0.get()) + misalign * es;
            void* d1 = static_cast<uint8_t*>(dst1.get()) + misalign * es;
            const std::vector<uint8_t> start = rig.random(6);
            dev->upload(d1, start.data(), bytes);

            // Without destinations, COPY_INTO / ACCUMULATE_INTO slots are refused.
            EXPECT_TRUE(throws(GRAPHED_STATUS_INVALID_ARGUMENT, [&] { rig.step(nullptr); }, "pass param_dsts"));
            void* dsts[2] = {d0, d1};
            graphed::Grads g = rig.step(dsts);
            EXPECT_EQ(GRAPHED_REF_KIND_COPY_INTO, g.params[0].kind());
            EXPECT_EQ(d0, g.params[0].ptr());
            EXPECT_EQ(GRAPHED_REF_KIND_ACCUMULATE_INTO, g.params[1].kind());
            EXPECT_EQ(GRAPHED_REF_KIND_NONE, g.inputs[0].kind());
            rig.step(dsts);  // accumulate twice

            std::vector<uint8_t> got0(bytes), got1(bytes);
            dev->download(got0.data(), d0, bytes);
            dev->download(got1.data(), d1, bytes);
            EXPECT_EQ(rig.copied(), got0) << "COPY_INTO must deliver the grad bit for bit";
            EXPECT_EQ(rig.accumulated(start, 2), got1) << "ACCUMULATE_INTO must add in f32 and round to nearest even";
        }
    }
}

TEST_P(GradLifetime, ResetThenReplayFails) {
    graphed::Session s = captured(config());
    Step st = step(s, 0);
    const std::vector<float> kept = read(st.g.params[0]);
    EXPECT_GT(s.stats().static_bytes, 0u);
    s.reset();
    EXPECT_TRUE(throws(GRAPHED_STATUS_SESSION_RESET, [&] { step(s, 0); }, "released by its reset"));
    EXPECT_TRUE(throws(GRAPHED_STATUS_SESSION_RESET, [&] { s.capture(); }, "reset"));
    graphed_session_stats st2 = s.stats();
    EXPECT_EQ(0u, st2.static_bytes);
    EXPECT_EQ(0u, st2.scratch_bytes);
    EXPECT_EQ(0u, st2.graph_count);
    EXPECT_EQ(kept, read(st.g.params[0])) << "clones returned before the reset stay valid";
    release(st);
}

// Wraps the layer's callbacks with failure injection.
struct Faulty {
    kit::LinearLayer* layer;
    int fail_phase = -1;  // a graphed_phase, or -1
    int32_t code = 42;
    bool illegal = false;  // do something illegal instead of failing
    static int32_t forward(const graphed_pass_ctx* c, void* self) {
        auto* f = static_cast<Faulty*>(self);
        if (static_cast<int>(c->phase) == f->fail_phase) {
            if (!f->illegal) return f->code;
            f->layer->dev->illegal(c->stream);
        }
        return kit::LinearLayer::forward(c, f->layer);
    }
};

class GradLifetimeFaults : public GradLifetime {
  protected:
    graphed::Session faulty_session(Faulty* f) {
        graphed::Session s(config());
        s.add_callable(wrapped(f));
        return s;
    }
    // After a failed capture, the fixed callable captures and replays right.
    void expect_recapture_works(graphed::Session& s, Faulty* f) {
        f->fail_phase = -1;
        s.capture();
        Step st = step(s, 1);
        EXPECT_EQ(eager_wgrad(1), read(st.g.params[0]));
        release(st);
    }
};

TEST_P(GradLifetimeFaults, CallbackErrorAbortsCapture) {
    Faulty f{&layer};
    graphed::Session s = faulty_session(&f);
    f.fail_phase = GRAPHED_PHASE_CAPTURE;
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_CALLBACK_FAILED, graphed_session_capture(s.get()), "returned 42"));
    std::string msg = last_error();
    for (const char* part : {"forward callback", "'fc'", "returned 42", "capture"})
        EXPECT_NE(std::string::npos, msg.find(part)) << part << " missing from: " << msg;
    expect_nothing_held(s);

    f.fail_phase = GRAPHED_PHASE_WARMUP;
    f.code = -7;
    EXPECT_TRUE(
        fails_with(GRAPHED_STATUS_CALLBACK_FAILED, graphed_session_capture(s.get()), "returned -7 during warmup"));
    expect_nothing_held(s);
    expect_recapture_works(s, &f);
}

TEST_P(GradLifetimeFaults, IllegalCallUnderCaptureIsReported) {
    Faulty f{&layer};
    f.illegal = true;
    f.fail_phase = GRAPHED_PHASE_CAPTURE;
    graphed::Session s = faulty_session(&f);
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_CAPTURE_INVALIDATED, graphed_session_capture(s.get()),
                           "forward pass of callable 'fc'"));
    expect_nothing_held(s);
    expect_recapture_works(s, &f);
}

TEST_P(GradLifetimeFaults, ScratchMustBeMeasuredInWarmup) {
    graphed_session_config c = config();
    c.warmup_iterations = 0;
    graphed::Session s(c);
    s.add_callable(layer.callable(x[0].get(), true));
    // The layer saves its pre-activation in scratch: with no warmup there is
    // no measured arena, and capture says so (not just the callback's code).
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_SCRATCH_EXHAUSTED, graphed_session_capture(s.get()), "warmup"));
    expect_nothing_held(s);
}

TEST_P(GradLifetime, DestroyReleasesDeviceMemory) {
    // Megabytes on the GPU; smaller on the host, where the math is naive loops.
    const int width = dev->backend() == kit::Backend::Cuda ? 1024 : 128;
    const int batch = dev->backend() == kit::Backend::Cuda ? 256 : 32;
    const size_t wbytes = size_t(width) * width * 4, act = size_t(batch) * width * 4;
    kit::LinearLayer big = layer;
    Buffer bw(*dev, wbytes), bb(*dev, width * 4), bx(*dev, act);
    big.in = big.out = width;
    big.batch = batch;
    big.w = bw.f32();
    big.b = bb.f32();
    size_t before = 0;
    auto run = [&](bool check_figures) {
        graphed::Session s(config());
        s.add_callable(big.callable(bx.get(), true));
        s.capture();
        for (int i = 0; i < 3; ++i) {
            s.forward(replay());
            s.backward(replay());  // the CLONE grads go back as the result goes
        }
        dev->sync();
        graphed_session_stats st = s.stats();
        if (check_figures) {
            // x, y, gy, gx, and the weight + bias grad slab.
            EXPECT_GE(st.static_bytes, 4 * act + wbytes + width * 4);
            EXPECT_GE(st.scratch_bytes, act);
            EXPECT_EQ(0u, st.clone_bytes_outstanding);
            EXPECT_EQ(0u, st.clone_blocks_outstanding);
            if (dev->backend() == kit::Backend::Cuda) {
                EXPECT_LT(dev->free_memory() + st.static_bytes, before + 1)
                    << "the driver must see the session's memory in use";
            }
        }
        s.reset();
        st = s.stats();
        EXPECT_EQ(0u, st.static_bytes);
        EXPECT_EQ(0u, st.scratch_bytes);
        EXPECT_EQ(0u, st.pool_bytes);
        EXPECT_EQ(0u, st.clone_bytes_cached) << "reset gives the clone ring back too";
    };
    run(false);  // the first session loads what the driver keeps for the process
    before = dev->free_memory();
    run(true);
    const size_t after = dev->free_memory();
    if (dev->backend() == kit::Backend::Cuda) {
        EXPECT_EQ(before, after) << "device memory must be back where it started (driver figure: " << before
                                 << " free before, " << after << " after)";
    }
}

// The caller's allocator (PyTorch's caching allocator, say) supplies the
// clone blocks: one allocation per backward for all CLONE grads.
struct CountingAllocator {
    kit::Device* dev;
    int allocs = 0, frees = 0;
    size_t last_bytes = 0;
    static int32_t alloc(void* ctx, size_t bytes, graphed_stream, void** out) {
        return graphed::guard([&] {
            auto* a = static_cast<CountingAllocator*>(ctx);
            *out = a->dev->alloc(bytes);
            ++a->allocs;
            a->last_bytes = bytes;
            return 0;
        });
    }
    static void free(void* ctx, void* p, size_t, graphed_stream) {
        auto* a = static_cast<CountingAllocator*>(ctx);
        a->dev->release(p);
        ++a->frees;
    }
};

TEST_P(GradLifetime, ClonesComeFromTheCallersAllocator) {
    CountingAllocator alloc{dev.get()};
    graphed_session_config c = config();
    c.clone_alloc = &CountingAllocator::alloc;
    c.clone_free = &CountingAllocator::free;
    c.allocator_ctx = &alloc;
    graphed::Session s = captured(c);
    Step st = step(s, 0);
    EXPECT_EQ(1, alloc.allocs) << "one block for both CLONE grads";
    EXPECT_GE(alloc.last_bytes, size_t(OUT * IN * 4 + OUT * 4));
    EXPECT_EQ(st.g.params[0].owner().get(), st.g.params[1].owner().get());
    EXPECT_EQ(alloc.last_bytes, s.stats().clone_bytes_outstanding);
    EXPECT_EQ(eager_wgrad(0), read(st.g.params[0]));
    st.g.params[0].release();
    EXPECT_EQ(0, alloc.frees) << "the block lives while a grad references it";
    st.g.params[1].release();
    EXPECT_EQ(1, alloc.frees);
    EXPECT_EQ(0u, s.stats().clone_bytes_outstanding);
}

// Hooks run around every callback, outside capture: each one synchronizes
// its stream, which would invalidate a capture it ran inside.
struct HookLog {
    kit::Device* dev;
    std::vector<std::string> events;
    static int32_t pre(const graphed_pass_ctx* c, void* self) { return record(c, self, "pre"); }
    static int32_t post(const graphed_pass_ctx* c, void* self) { return record(c, self, "post"); }
    static int32_t record(const graphed_pass_ctx* c, void* self, const char* when) {
        auto* h = static_cast<HookLog*>(self);
        h->dev->illegal(c->stream);
        h->events.push_back(std::string(when) + (c->pass == GRAPHED_PASS_FORWARD ? " fwd " : " bwd ") +
                            (c->phase == GRAPHED_PHASE_WARMUP ? "warmup" : "capture"));
        return 0;
    }
    static int32_t warmup(uint32_t when, void* self) {
        static_cast<HookLog*>(self)->events.push_back(when == 0 ? "before warmup" : "after warmup");
        return 0;
    }
};

TEST_P(GradLifetime, HooksRunAroundCallbacksOutsideCapture) {
    HookLog log{dev.get()};
    graphed_session_config c = config();
    c.warmup_iterations = 2;
    c.warmup_hook = &HookLog::warmup;
    c.warmup_hook_data = &log;
    graphed::Session s(c);
    graphed::Callable d = layer.callable(x[0].get(), true);
    d.pre_hook = &HookLog::pre;
    d.post_hook = &HookLog::post;
    d.hook_data = &log;
    s.add_callable(d);
    s.capture();
    const std::vector<std::string> want = {
        "before warmup",
        "pre fwd warmup", "post fwd warmup", "pre bwd warmup", "post bwd warmup",
        "pre fwd warmup", "post fwd warmup", "pre bwd warmup", "post bwd warmup",
        "after warmup",
        "pre fwd capture", "post fwd capture", "pre bwd capture", "post bwd capture"};
    EXPECT_EQ(want, log.events);
    log.events.clear();
    Step st = step(s, 0);
    EXPECT_TRUE(log.events.empty()) << "replays never call hooks";
    release(st);
}

// Sessions sharing a pool share scratch: the second capture reuses the
// first one's arena instead of allocating its own.
TEST_P(GradLifetime, SharedPoolReusesScratch) {
    graphed::Session a = captured(config());
    graphed_session_config c = config();
    c.share_pool_with = a.get();
    graphed::Session b = captured(c);
    graphed_session_stats sa = a.stats(), sb = b.stats();
    EXPECT_GT(sa.scratch_bytes, 0u);
    EXPECT_EQ(sa.pool_bytes, sb.pool_bytes) << "one pool";
    EXPECT_EQ(sa.scratch_bytes, sa.pool_bytes) << "and one arena in it, used by both";
    // Replayed in capture order, both are right.
    Step s1 = step(a, 0);
    Step s2 = step(b, 1);
    EXPECT_EQ(eager_wgrad(0), read(s1.g.params[0]));
    EXPECT_EQ(eager_wgrad(1), read(s2.g.params[0]));
    release(s1);
    release(s2);
    graphed_session* gone = a.get();
    a.destroy();  // the pool lives on with b
    Step s3 = step(b, 0);
    EXPECT_EQ(eager_wgrad(0), read(s3.g.params[0]));
    release(s3);
    graphed_session_config bad = config();
    graphed_session* out = nullptr;
    bad.share_pool_with = gone;
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_USE_AFTER_DESTROY, graphed_session_create(&bad, &out), "was destroyed"));
    bad.share_pool_with = reinterpret_cast<graphed_session*>(&bad);
    EXPECT_TRUE(
        fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_session_create(&bad, &out), "not a session handle"));
    EXPECT_EQ(nullptr, out);
}

// Writing straight into the static input and passing it back as data
// skips the copy; the replay reads what was written.
TEST_P(GradLifetime, StaticInputPassedBackIsUsedInPlace) {
    graphed::Session s = captured(config());
    void* in = s.buffers(0, 0, GRAPHED_BUFFER_ROLE_INPUT).at(0);
    auto hx = fetch<float>(*dev, x[1].get(), B * IN);
    dev->upload(in, hx.data(), hx.size() * 4);
    Step st;
    st.out = s.forward(replay().data(in));
    st.g = s.backward(replay().data(gy[1].get()));
    EXPECT_EQ(eager_wgrad(1), read(st.g.params[0]));
    release(st);
}

// A layer whose output, input grad and parameter grads live in its own
// memory (as a framework's tensors would), handed over at capture.
struct ExternalLayer {
    kit::LinearLayer* L;
    Buffer y, gx, gw, gb;
    bool provide = true;
    graphed_status in_warmup = GRAPHED_STATUS_OK, wrong_role = GRAPHED_STATUS_OK;
    static int32_t forward(const graphed_pass_ctx* c, void* self) {
        return graphed::guard([&] {
            auto* e = static_cast<ExternalLayer*>(self);
            if (c->outputs[0] != nullptr) return 900;  // nothing placed for an external output
            void* z = graphed::scratch_alloc(*c, e->L->act_bytes(e->L->out));
            *c->tape = z;
            if (int r = e->L->eager_forward(c->stream, c->inputs[0], z, e->y.get())) return r;
            if (c->phase == GRAPHED_PHASE_WARMUP) {
                e->in_warmup = graphed_pass_set_buffer(c->capture, GRAPHED_BUFFER_ROLE_OUTPUT, 0, e->y.get());
            } else if (e->provide) {
                e->wrong_role = graphed_pass_set_buffer(c->capture, GRAPHED_BUFFER_ROLE_GRAD_OUTPUT, 0, e->y.get());
                graphed::set_buffer(*c, GRAPHED_BUFFER_ROLE_OUTPUT, 0, e->y.get());
            }
            return 0;
        });
    }
    static int32_t backward(const graphed_pass_ctx* c, void* self) {
        return graphed::guard([&] {
            auto* e = static_cast<ExternalLayer*>(self);
            if (c->grad_inputs[0] != nullptr || c->param_grads[0] != nullptr) return 902;
            void* z = *c->tape;
            void* gz = graphed::scratch_alloc(*c, e->L->act_bytes(e->L->out));
            if (int r = e->L->eager_backward(c->stream, c->inputs[0], z, c->grad_outputs[0], gz, e->gx.get(),
                                             e->gw.get(), e->gb.get()))
                return r;
            graphed::scratch_free(*c, gz);
            graphed::scratch_free(*c, z);
            if (c->phase != GRAPHED_PHASE_CAPTURE) return 0;
            graphed::set_buffer(*c, GRAPHED_BUFFER_ROLE_GRAD_INPUT, 0, e->gx.get());
            graphed::set_buffer(*c, GRAPHED_BUFFER_ROLE_PARAM_GRADS, 0, e->gw.get());
            graphed::set_buffer(*c, GRAPHED_BUFFER_ROLE_PARAM_GRADS, 1, e->gb.get());
            return 0;
        });
    }
};

TEST_P(GradLifetime, ExternalBuffersProvidedAtCapture) {
    ExternalLayer e{&layer, Buffer(*dev, B * OUT * 4), Buffer(*dev, B * IN * 4), Buffer(*dev, OUT * IN * 4),
                    Buffer(*dev, OUT * 4)};
    auto session = [&](bool external) {
        graphed::Session s(config());
        graphed::Callable c = layer.callable(x[0].get(), true);
        if (external) {
            c.inputs[0].flags = c.outputs[0].flags = GRAPHED_TENSOR_FLAGS_EXTERNAL;
            c.params[0].flags = c.params[1].flags = GRAPHED_PARAM_FLAGS_EXTERNAL_GRAD;
            c.forward = &ExternalLayer::forward;
            c.backward = &ExternalLayer::backward;
            c.user_data = &e;
        }
        s.add_callable(c);
        return s;
    };
    graphed::Session plain = session(false);
    plain.capture();
    graphed::Session s = session(true);
    s.capture();
    EXPECT_EQ(GRAPHED_STATUS_WRONG_STATE, e.in_warmup) << "buffers are provided under capture only";
    EXPECT_EQ(GRAPHED_STATUS_INVALID_ARGUMENT, e.wrong_role) << "only external buffers of this pass";
    EXPECT_LT(s.stats().static_bytes, plain.stats().static_bytes) << "nothing placed for external buffers";
    const std::vector<void*> slots = s.buffers(0, 0, GRAPHED_BUFFER_ROLE_PARAM_GRADS);
    EXPECT_EQ(e.gw.get(), slots[0]);
    EXPECT_EQ(e.gb.get(), slots[1]);

    Step s1 = step(s, 0);
    EXPECT_EQ(e.y.get(), s1.out[0].ptr()) << "replays return the provided output";
    EXPECT_EQ(e.gx.get(), s1.g.inputs[0].ptr());
    ASSERT_EQ(GRAPHED_REF_KIND_CLONE, s1.g.params[0].kind());
    EXPECT_NE(e.gw.get(), s1.g.params[0].ptr()) << "CLONE grads are copied out of the provided memory";
    const std::vector<float> g1 = read(s1.g.params[0]);
    EXPECT_EQ(eager_wgrad(0), g1);
    Step s2 = step(s, 1);
    EXPECT_EQ(g1, read(s1.g.params[0])) << "the clone from replay 1 is intact after replay 2";
    EXPECT_EQ(eager_wgrad(1), read(s2.g.params[0]));
    EXPECT_EQ(fetch<float>(*dev, e.gb.get(), OUT), read(s2.g.params[1]));
    release(s1);
    release(s2);

    // A callback that does not provide its external buffer fails capture.
    e.provide = false;
    graphed::Session missing = session(true);
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_session_capture(missing.get()),
                           "declared output 0 external but did not provide its buffer during capture"));
    EXPECT_EQ(0u, missing.stats().graph_count);
}

// ExternalLayer as a step finds it: its own captures provide its memory;
// the step's captures hand those addresses over in ctx (outputs,
// grad_inputs, param_grads), and it writes there. Counts how many step
// calls found its own memory there, and keeps what providing the output
// again in a step's capture answered.
struct StepExternal {
    kit::LinearLayer* L;
    Buffer y, gx, gw, gb;
    int handed = 0;
    graphed_status again = GRAPHED_STATUS_OK;
    std::string again_said;
    // Where to write: the address ctx holds, or (not handed yet) `mine`.
    static void* at(void* given, Buffer& mine) { return given != nullptr ? given : mine.get(); }
    static int32_t forward(const graphed_pass_ctx* c, void* self) {
        return graphed::guard([&] {
            auto* e = static_cast<StepExternal*>(self);
            void* z = graphed::scratch_alloc(*c, e->L->act_bytes(e->L->out));
            *c->tape = z;
            void* y = at(c->outputs[0], e->y);
            if (int r = e->L->eager_forward(c->stream, c->inputs[0], z, y)) return r;
            if (c->phase != GRAPHED_PHASE_CAPTURE) return 0;
            if (c->outputs[0] == nullptr) {
                graphed::set_buffer(*c, GRAPHED_BUFFER_ROLE_OUTPUT, 0, y);
                return 0;
            }
            e->handed += y == e->y.get();
            e->again = graphed_pass_set_buffer(c->capture, GRAPHED_BUFFER_ROLE_OUTPUT, 0, y);
            e->again_said = graphed_last_error_message();
            return 0;
        });
    }
    static int32_t backward(const graphed_pass_ctx* c, void* self) {
        return graphed::guard([&] {
            auto* e = static_cast<StepExternal*>(self);
            void* z = *c->tape;
            void* gz = graphed::scratch_alloc(*c, e->L->act_bytes(e->L->out));
            void* gx = at(c->grad_inputs[0], e->gx);
            void* gw = at(c->param_grads[0], e->gw);
            void* gb = at(c->param_grads[1], e->gb);
            if (int r = e->L->eager_backward(c->stream, c->inputs[0], z, c->grad_outputs[0], gz, gx, gw, gb)) return r;
            graphed::scratch_free(*c, gz);
            graphed::scratch_free(*c, z);
            if (c->phase != GRAPHED_PHASE_CAPTURE) return 0;
            if (c->grad_inputs[0] != nullptr) {
                e->handed += gx == e->gx.get() && gw == e->gw.get() && gb == e->gb.get();
                return 0;
            }
            graphed::set_buffer(*c, GRAPHED_BUFFER_ROLE_GRAD_INPUT, 0, gx);
            graphed::set_buffer(*c, GRAPHED_BUFFER_ROLE_PARAM_GRADS, 0, gw);
            graphed::set_buffer(*c, GRAPHED_BUFFER_ROLE_PARAM_GRADS, 1, gb);
            return 0;
        });
    }
};

// A step over a callable with an external output, input grad and parameter
// grads (COPY_INTO), unrolled and looped: its graph writes them where the
// callable's own capture provided them, its io copies read them there, and
// everything equals eager.
TEST_P(GradLifetime, ExternalBuffersInAStepEqualEager) {
    // Eager, for x[1] and gy[1].
    Buffer z(*dev, B * OUT * 4), y(*dev, B * OUT * 4), gz(*dev, B * OUT * 4), gx(*dev, B * IN * 4);
    Buffer gw(*dev, OUT * IN * 4), gb(*dev, OUT * 4);
    ASSERT_EQ(0, layer.eager_forward(dev->stream(), x[1].f32(), z.f32(), y.f32()));
    ASSERT_EQ(0, layer.eager_backward(dev->stream(), x[1].f32(), z.f32(), gy[1].f32(), gz.f32(), gx.f32(), gw.f32(),
                                      gb.f32()));
    for (uint32_t mode : {GRAPHED_STEP_LOOP_UNROLLED, GRAPHED_STEP_LOOP_WHILE}) {
        SCOPED_TRACE(mode == GRAPHED_STEP_LOOP_WHILE ? "looped" : "unrolled");
        StepExternal e{&layer, Buffer(*dev, B * OUT * 4), Buffer(*dev, B * IN * 4), Buffer(*dev, OUT * IN * 4),
                       Buffer(*dev, OUT * 4)};
        graphed::Session s(config());
        graphed::Callable c = layer.callable(x[0].get(), true);
        c.inputs[0].flags = c.outputs[0].flags = GRAPHED_TENSOR_FLAGS_EXTERNAL;
        for (auto& p : c.params) {
            p.flags = GRAPHED_PARAM_FLAGS_EXTERNAL_GRAD;
            p.policy = GRAPHED_GRAD_POLICY_COPY_INTO;
        }
        c.forward = &StepExternal::forward;
        c.backward = &StepExternal::backward;
        c.user_data = &e;
        s.add_callable(c);
        Buffer yo(*dev, B * OUT * 4), gxo(*dev, B * IN * 4), dgw(*dev, OUT * IN * 4), dgb(*dev, OUT * 4);
        using S = graphed::Session;
        const std::vector<graphed_step_io> io = {
            S::step_io(0, GRAPHED_BUFFER_ROLE_INPUT, 0, x[1].get(), B * IN * 4),
            S::step_io(0, GRAPHED_BUFFER_ROLE_OUTPUT, 0, yo.get(), B * OUT * 4),
            S::step_io(0, GRAPHED_BUFFER_ROLE_GRAD_OUTPUT, 0, gy[1].get(), B * OUT * 4),
            S::step_io(0, GRAPHED_BUFFER_ROLE_GRAD_INPUT, 0, gxo.get(), B * IN * 4),
        };
        const uint32_t step = s.add_step({0}, {dgw.get(), dgb.get()}, 1, io, mode);
        s.capture();
        EXPECT_EQ(1u, s.stats().step_graphs) << "no CLONE grads: one graph";
        EXPECT_EQ(2, e.handed) << "the step's forward and backward found the provided memory";
        EXPECT_EQ(GRAPHED_STATUS_WRONG_STATE, e.again) << e.again_said;
        EXPECT_NE(std::string::npos, e.again_said.find("in the capture of step 0")) << e.again_said;
        EXPECT_NE(std::string::npos, e.again_said.find("write the results there")) << e.again_said;
        std::vector<graphed::Ref> grads;
        s.step(step, dev->stream(), grads);
        dev->sync();
        ASSERT_EQ(2u, grads.size());
        EXPECT_EQ(GRAPHED_REF_KIND_COPY_INTO, grads[0].kind());
        EXPECT_EQ(fetch<float>(*dev, gw.get(), OUT * IN), fetch<float>(*dev, dgw.get(), OUT * IN));
        EXPECT_EQ(fetch<float>(*dev, gb.get(), OUT), fetch<float>(*dev, dgb.get(), OUT));
        EXPECT_EQ(fetch<float>(*dev, y.get(), B * OUT), fetch<float>(*dev, yo.get(), B * OUT)) << "io out of y";
        EXPECT_EQ(fetch<float>(*dev, gx.get(), B * IN), fetch<float>(*dev, gxo.get(), B * IN)) << "io out of gx";
        EXPECT_EQ(fetch<float>(*dev, gw.get(), OUT * IN), fetch<float>(*dev, e.gw.get(), OUT * IN))
            << "the provided memory holds the grad";
    }
}

// Records a step's capture hook calls; returns 7 at `fail` (-1: never).
struct StepHookLog {
    std::vector<uint32_t> calls;
    int fail = -1;
    static int32_t hook(uint32_t when, void* self) {
        auto* h = static_cast<StepHookLog*>(self);
        h->calls.push_back(when);
        return int(when) == h->fail ? 7 : 0;
    }
};

// The step's capture hook runs before (0) and after (1) each capture of the
// step's graph (here one per clone slot); a failing call fails the capture
// naming it, the session keeping nothing, and after a failed capture the
// after-call still comes, the capture's own error standing.
TEST_P(GradLifetime, StepCaptureHookRunsAroundEachGraphAndCanFail) {
    StepHookLog ok;
    graphed::Session s(config());
    s.add_callable(layer.callable(x[0].get(), true));
    s.add_step({0}, {}, 1, {}, GRAPHED_STEP_LOOP_UNROLLED, &StepHookLog::hook, &ok);
    s.capture();
    const uint32_t graphs = s.stats().step_graphs;
    EXPECT_EQ(2u, graphs) << "one per clone slot";
    std::vector<uint32_t> want;
    for (uint32_t k = 0; k < graphs; ++k) want.insert(want.end(), {0, 1});
    EXPECT_EQ(want, ok.calls);

    for (int fail : {0, 1}) {
        StepHookLog h;
        h.fail = fail;
        graphed::Session f(config());
        f.add_callable(layer.callable(x[0].get(), true));
        f.add_step({0}, {}, 1, {}, GRAPHED_STEP_LOOP_UNROLLED, &StepHookLog::hook, &h);
        const std::string words = fail == 0 ? "the capture hook before the capture of step 0 returned 7"
                                            : "the capture hook after the capture of step 0 returned 7";
        EXPECT_TRUE(fails_with(GRAPHED_STATUS_CALLBACK_FAILED, graphed_session_capture(f.get()), words));
        EXPECT_EQ((fail == 0 ? std::vector<uint32_t>{0} : std::vector<uint32_t>{0, 1}), h.calls);
        expect_nothing_held(f);
    }

    // A step capture that fails (its forward returns 5): the after-call
    // comes, and its failure does not replace the callback's.
    struct Failing {
        kit::LinearLayer* layer;
        int captures = 0;
        static int32_t forward(const graphed_pass_ctx* c, void* self) {
            auto* w = static_cast<Failing*>(self);
            if (c->phase == GRAPHED_PHASE_CAPTURE && ++w->captures > 1) return 5;
            return kit::LinearLayer::forward(c, w->layer);
        }
    } failing{&layer};
    StepHookLog h;
    h.fail = 1;
    graphed::Session f(config());
    f.add_callable(wrapped(&failing));
    f.add_step({0}, {}, 1, {}, GRAPHED_STEP_LOOP_UNROLLED, &StepHookLog::hook, &h);
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_CALLBACK_FAILED, graphed_session_capture(f.get()), "returned 5"));
    EXPECT_EQ((std::vector<uint32_t>{0, 1}), h.calls);
    expect_nothing_held(f);
}

INSTANTIATE_TEST_SUITE_P(Backends, GradLifetime, backends(), BackendName());
INSTANTIATE_TEST_SUITE_P(Backends, GradLifetimeFaults, backends(), BackendName());

}  // namespace
