// Suite GradLifetime: what replay hands back and for how long, on both
// backends. One fully connected layer (x [4x8] -> y [4x16]) is graphed; its
// parameter grads come back per policy, and each test checks the lifetime
// rule that policy promises, against eager results computed with the same
// kernels (so comparisons are exact).
#include "layers.hpp"
#include "half.hpp"
#include "support.hpp"

#include <cstring>
#include <string>
#include <tuple>
#include <vector>

namespace {

using kit::Buffer;
using kit::fetch;

constexpr int B = 4, IN = 8, OUT = 16;

class GradLifetime : public BackendTest {
  protected:
    void SetUp() override {
        BackendTest::SetUp();
        if (IsSkipped()) return;
        w = Buffer(*dev, OUT * IN * 4);
        b = Buffer(*dev, OUT * 4);
        for (int i = 0; i < 2; ++i) {
            x[i] = Buffer(*dev, B * IN * 4);
            gy[i] = Buffer(*dev, B * OUT * 4);
            up(x[i], kit::random_floats(B * IN, 100 + i));
            up(gy[i], kit::random_floats(B * OUT, 200 + i));
        }
        up(w, kit::random_floats(OUT * IN, 1, 0.5f));
        up(b, kit::random_floats(OUT, 2, 0.5f));
        layer.dev = dev.get();
        layer.batch = B;
        layer.in = IN;
        layer.out = OUT;
        layer.relu = true;
        layer.w = w.f32();
        layer.b = b.f32();
        layer.name = "fc";
    }

    void up(Buffer& buf, const std::vector<float>& v) { dev->upload(buf.get(), v.data(), v.size() * 4); }

    // Registers the layer and captures.
    SessionPtr captured(graphed_session_config c) {
        SessionPtr s = create(c);
        if (!s) return s;
        graphed_callable_desc d = layer.describe(x[0].get(), true);
        uint32_t index = 99;
        EXPECT_EQ(GRAPHED_STATUS_OK, graphed_session_add_callable(s.get(), &d, &index)) << last_error();
        EXPECT_EQ(0u, index);
        EXPECT_EQ(GRAPHED_STATUS_OK, graphed_session_capture(s.get())) << last_error();
        return s;
    }

    struct Step {
        graphed_ref out{}, gin{}, gp[2]{};
    };

    // One forward + backward replay with x[i] and gy[i].
    graphed_status step(graphed_session* s, int i, Step* st, const void* const* dsts = nullptr) {
        graphed_replay_args a = graphed_replay_args_default();
        a.stream = dev->stream();
        const void* in = x[i].get();
        a.data = &in;
        a.num_data = 1;
        if (graphed_status r = graphed_forward(s, &a, &st->out, 1)) return r;
        const void* g = gy[i].get();
        a.data = &g;
        if (dsts) {
            a.param_dsts = const_cast<void* const*>(dsts);
            a.num_param_dsts = 2;
        }
        return graphed_backward(s, &a, &st->gin, 1, st->gp, 2);
    }

    // The same math eagerly: the parameter grads for x[i], gy[i].
    std::vector<float> eager_wgrad(int i, Buffer* into = nullptr) {
        Buffer z(*dev, B * OUT * 4), y(*dev, B * OUT * 4), gz(*dev, B * OUT * 4), gx(*dev, B * IN * 4);
        Buffer gw(*dev, OUT * IN * 4), gb(*dev, OUT * 4);
        EXPECT_EQ(0, layer.eager_forward(dev->stream(), x[i].f32(), z.f32(), y.f32()));
        EXPECT_EQ(0, layer.eager_backward(dev->stream(), x[i].f32(), z.f32(), gy[i].f32(), gz.f32(), gx.f32(),
                                          gw.f32(), gb.f32()));
        auto v = fetch<float>(*dev, gw.get(), OUT * IN);
        if (into) *into = std::move(gw);
        return v;
    }

    std::vector<float> read(const graphed_ref& r) { return fetch<float>(*dev, r.ptr, r.bytes / 4); }

    void release(Step& st) {
        for (auto& g : st.gp) EXPECT_EQ(GRAPHED_STATUS_OK, graphed_buffer_release(g.owner)) << last_error();
    }

    Buffer w, b, x[2], gy[2];
    kit::LinearLayer layer;
};

TEST_P(GradLifetime, ReturnsOwnedParamGrads) {
    SessionPtr s = captured(config());
    ASSERT_TRUE(s);
    Step s1, s2;
    GRAPHED_ASSERT_OK(step(s.get(), 0, &s1));
    ASSERT_EQ(GRAPHED_REF_KIND_CLONE, s1.gp[0].kind);
    ASSERT_EQ(GRAPHED_REF_KIND_CLONE, s1.gp[1].kind);
    ASSERT_NE(nullptr, s1.gp[0].owner);
    const std::vector<float> g1 = read(s1.gp[0]);
    EXPECT_EQ(eager_wgrad(0), g1) << "the first grad must be the eager grad";

    GRAPHED_ASSERT_OK(step(s.get(), 1, &s2));
    EXPECT_NE(s1.gp[0].ptr, s2.gp[0].ptr) << "each backward returns a fresh buffer";
    EXPECT_EQ(g1, read(s1.gp[0])) << "the grad kept from replay 1 must be intact after replay 2";
    EXPECT_NE(g1, read(s2.gp[0])) << "the inputs differ, so the grads must differ (else the test proves nothing)";
    EXPECT_EQ(eager_wgrad(1), read(s2.gp[0]));
    release(s1);
    release(s2);
    EXPECT_EQ(0u, stats(s.get()).clone_bytes_outstanding);
}

TEST_P(GradLifetime, AccumulatesOwnedParamGrads) {
    SessionPtr s = captured(config());
    ASSERT_TRUE(s);
    // As autograd's AccumulateGrad does: the first grad becomes param.grad
    // itself, the second is added into it.
    Step s1, s2;
    GRAPHED_ASSERT_OK(step(s.get(), 0, &s1));
    GRAPHED_ASSERT_OK(step(s.get(), 1, &s2));
    ASSERT_EQ(0, dev->add(dev->stream(), static_cast<float*>(s1.gp[0].ptr), static_cast<const float*>(s2.gp[0].ptr),
                          OUT * IN));
    const std::vector<float> accumulated = read(s1.gp[0]);

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
    SessionPtr s = captured(config());
    ASSERT_TRUE(s);
    void* slots[2] = {};
    GRAPHED_ASSERT_OK(graphed_session_buffers(s.get(), 0, 0, GRAPHED_BUFFER_ROLE_PARAM_GRADS, slots, 2));
    Step s1, s2;
    GRAPHED_ASSERT_OK(step(s.get(), 0, &s1));
    GRAPHED_ASSERT_OK(step(s.get(), 1, &s2));
    for (int p = 0; p < 2; ++p) {
        EXPECT_EQ(GRAPHED_REF_KIND_ALIAS, s1.gp[p].kind);
        EXPECT_EQ(nullptr, s1.gp[p].owner);
        EXPECT_EQ(slots[p], s1.gp[p].ptr) << "the alias is the static slot";
        EXPECT_EQ(s1.gp[p].ptr, s2.gp[p].ptr) << "same address across replays";
    }
    EXPECT_EQ(eager_wgrad(1), read(s2.gp[0]));
}

TEST_P(GradLifetime, DelayedWgradGraphReturnsParamGrads) {
    layer.split_wgrad = true;
    layer.param_flags = GRAPHED_PARAM_FLAGS_DELAYED_WGRAD;
    SessionPtr s = captured(config());
    ASSERT_TRUE(s);
    EXPECT_EQ(3u, stats(s.get()).graph_count) << "forward, backward and weight-grad graphs";
    Step st;
    GRAPHED_ASSERT_OK(step(s.get(), 1, &st));
    EXPECT_EQ(GRAPHED_REF_KIND_NONE, st.gp[0].kind) << "backward leaves parameter grads to the weight-grad replay";
    EXPECT_EQ(GRAPHED_REF_KIND_ALIAS, st.gin.kind);
    graphed_replay_args a = graphed_replay_args_default();
    a.stream = dev->stream();
    graphed_ref gp[2];
    GRAPHED_ASSERT_OK(graphed_backward_wgrad(s.get(), &a, gp, 2));
    EXPECT_EQ(GRAPHED_REF_KIND_ALIAS, gp[0].kind);
    EXPECT_EQ(eager_wgrad(1), read(gp[0]));
}

TEST_P(GradLifetime, OptOutReturnsAlias) {
    graphed_session_config c = config();
    c.clone_param_grads_on_return = false;
    SessionPtr s = captured(c);
    ASSERT_TRUE(s);
    Step s1, s2;
    GRAPHED_ASSERT_OK(step(s.get(), 0, &s1));
    ASSERT_EQ(GRAPHED_REF_KIND_ALIAS, s1.gp[0].kind);
    const std::vector<float> g1 = read(s1.gp[0]);
    GRAPHED_ASSERT_OK(step(s.get(), 1, &s2));
    EXPECT_EQ(s1.gp[0].ptr, s2.gp[0].ptr);
    const std::vector<float> g2 = read(s2.gp[0]);
    ASSERT_NE(g1, g2);
    EXPECT_EQ(g2, read(s1.gp[0])) << "the documented hazard: a kept alias now holds the next replay's grad";
    // Accumulating as autograd would gives 2 * g2, not g1 + g2.
    ASSERT_EQ(0, dev->add(dev->stream(), static_cast<float*>(s1.gp[0].ptr), static_cast<const float*>(s2.gp[0].ptr),
                          OUT * IN));
    std::vector<float> twice = g2;
    for (float& v : twice) v *= 2.0f;
    EXPECT_EQ(twice, read(s1.gp[0]));
}

TEST_P(GradLifetime, PolicySnapshotAtCapture) {
    SessionPtr s = create(config());
    ASSERT_TRUE(s);
    graphed_callable_desc d = layer.describe(x[0].get(), true);
    uint32_t a = 0, b2 = 0;
    GRAPHED_ASSERT_OK(graphed_session_add_callable(s.get(), &d, &a));
    kit::LinearLayer second = layer;
    second.name = "fc_b";
    graphed_callable_desc d2 = second.describe(x[0].get(), true);
    GRAPHED_ASSERT_OK(graphed_session_add_callable(s.get(), &d2, &b2));
    // Before capture, flags may change, and they count.
    GRAPHED_ASSERT_OK(graphed_session_set_param_flags(s.get(), b2, 0, GRAPHED_PARAM_FLAGS_DELAYED_WGRAD));
    GRAPHED_ASSERT_OK(graphed_session_capture(s.get()));

    // After capture: the caller's descriptor arrays and the flags API change nothing.
    layer.params[0].flags = GRAPHED_PARAM_FLAGS_DELAYED_WGRAD;
    layer.params[1].policy = GRAPHED_GRAD_POLICY_ALIAS;
    GRAPHED_EXPECT_STATUS(GRAPHED_STATUS_WRONG_STATE,
                          graphed_session_set_param_flags(s.get(), a, 0, GRAPHED_PARAM_FLAGS_DELAYED_WGRAD));
    EXPECT_NE(std::string::npos, last_error().find("frozen")) << last_error();

    uint32_t pa[2] = {}, pb[2] = {};
    GRAPHED_ASSERT_OK(graphed_session_param_policies(s.get(), a, pa, 2));
    GRAPHED_ASSERT_OK(graphed_session_param_policies(s.get(), b2, pb, 2));
    EXPECT_EQ(GRAPHED_GRAD_POLICY_CLONE, pa[0]);
    EXPECT_EQ(GRAPHED_GRAD_POLICY_CLONE, pa[1]);
    EXPECT_EQ(GRAPHED_GRAD_POLICY_ALIAS, pb[0]);
    EXPECT_EQ(GRAPHED_GRAD_POLICY_CLONE, pb[1]);

    Step st;
    GRAPHED_ASSERT_OK(step(s.get(), 0, &st));
    EXPECT_EQ(GRAPHED_REF_KIND_CLONE, st.gp[0].kind);
    EXPECT_EQ(GRAPHED_REF_KIND_CLONE, st.gp[1].kind);
    release(st);
}

TEST_P(GradLifetime, StrictLeaseDetectsHeldAlias) {
    graphed_session_config c = config();
    c.clone_param_grads_on_return = false;
    c.strict_leases = true;
    SessionPtr s = captured(c);
    ASSERT_TRUE(s);
    Step s1;
    GRAPHED_ASSERT_OK(step(s.get(), 0, &s1));
    ASSERT_EQ(GRAPHED_REF_KIND_ALIAS, s1.gp[0].kind);
    ASSERT_NE(0u, s1.gp[0].lease);
    ASSERT_NE(0u, s1.out.lease);
    // Done with everything but the weight grad.
    GRAPHED_ASSERT_OK(graphed_lease_release(s.get(), s1.out.lease));
    GRAPHED_ASSERT_OK(graphed_lease_release(s.get(), s1.gin.lease));
    GRAPHED_ASSERT_OK(graphed_lease_release(s.get(), s1.gp[1].lease));
    EXPECT_EQ(1u, stats(s.get()).leases_held);
    const std::vector<float> held = read(s1.gp[0]);

    Step s2;
    GRAPHED_EXPECT_STATUS(GRAPHED_STATUS_ALIAS_HELD, step(s.get(), 1, &s2));
    const std::string msg = last_error();
    EXPECT_NE(std::string::npos, msg.find("the grad of param 0 of callable 'fc'")) << msg;
    EXPECT_NE(std::string::npos, msg.find("backward replay")) << msg;
    EXPECT_EQ(held, read(s1.gp[0])) << "nothing was replayed: the held alias is intact";

    // A held output blocks the next forward the same way.
    GRAPHED_EXPECT_STATUS(GRAPHED_STATUS_ALIAS_HELD, step(s.get(), 1, &s2));
    EXPECT_NE(std::string::npos, last_error().find("output 0 of callable 'fc'")) << last_error();
    GRAPHED_ASSERT_OK(graphed_lease_release(s.get(), s2.out.lease));

    GRAPHED_ASSERT_OK(graphed_lease_release(s.get(), s1.gp[0].lease));
    GRAPHED_EXPECT_STATUS(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_lease_release(s.get(), s1.gp[0].lease));
    graphed_replay_args a = graphed_replay_args_default();
    a.stream = dev->stream();
    const void* g = gy[1].get();
    a.data = &g;
    a.num_data = 1;
    GRAPHED_ASSERT_OK(graphed_backward(s.get(), &a, &s2.gin, 1, s2.gp, 2));
    EXPECT_NE(held, read(s2.gp[0]));
}

// A callable y_k = x * p_k (k = 0, 1) in one dtype; backward writes
// gp_k = gy_k * x. Param 0 is returned COPY_INTO, param 1 ACCUMULATE_INTO.
struct ScaleLayer {
    kit::Device* dev;
    uint32_t dtype;
    size_t n;
    static int32_t forward(const graphed_pass_ctx* c, void* self) {
        auto* L = static_cast<ScaleLayer*>(self);
        for (int k = 0; k < 2; ++k)
            if (int e = L->dev->mul(c->stream, L->dtype, c->inputs[0], c->params[k], c->outputs[k], L->n)) return e;
        return 0;
    }
    static int32_t backward(const graphed_pass_ctx* c, void* self) {
        auto* L = static_cast<ScaleLayer*>(self);
        for (int k = 0; k < 2; ++k)
            if (int e = L->dev->mul(c->stream, L->dtype, c->grad_outputs[k], c->inputs[0], c->param_grads[k], L->n))
                return e;
        return 0;
    }
};

class DtypeBits {
  public:
    explicit DtypeBits(uint32_t dtype) : dtype_(dtype) {}
    // Random values of the dtype, as raw bytes.
    std::vector<uint8_t> random(size_t n, uint32_t seed) const {
        auto f = kit::random_floats(n, seed, 2.0f);
        std::vector<uint8_t> out(n * kit::dtype_size(dtype_));
        for (size_t i = 0; i < n; ++i) set(out, i, f[i]);
        return out;
    }
    float get(const std::vector<uint8_t>& v, size_t i) const {
        if (dtype_ == GRAPHED_DTYPE_F32) {
            float f;
            std::memcpy(&f, &v[i * 4], 4);
            return f;
        }
        uint16_t h;
        std::memcpy(&h, &v[i * 2], 2);
        return dtype_ == GRAPHED_DTYPE_F16 ? kit::half_to_float(h) : kit::bf16_to_float(h);
    }
    void set(std::vector<uint8_t>& v, size_t i, float f) const {
        if (dtype_ == GRAPHED_DTYPE_F32) {
            std::memcpy(&v[i * 4], &f, 4);
            return;
        }
        uint16_t h = dtype_ == GRAPHED_DTYPE_F16 ? kit::float_to_half(f) : kit::float_to_bf16(f);
        std::memcpy(&v[i * 2], &h, 2);
    }

  private:
    uint32_t dtype_;
};

TEST_P(GradLifetime, CopyIntoAndAccumulateInto) {
    for (uint32_t dtype : {GRAPHED_DTYPE_F32, GRAPHED_DTYPE_F16, GRAPHED_DTYPE_BF16}) {
        for (size_t misalign : {size_t(0), size_t(1)}) {
            SCOPED_TRACE(testing::Message() << "dtype " << dtype << ", destination offset " << misalign);
            const size_t n = 1003;  // not a multiple of any vector width
            const size_t es = kit::dtype_size(dtype), bytes = n * es;
            DtypeBits bits(dtype);
            ScaleLayer L{dev.get(), dtype, n};
            Buffer xin(*dev, bytes), p0(*dev, bytes), p1(*dev, bytes), g0(*dev, bytes), g1(*dev, bytes);
            Buffer dst0(*dev, bytes + 16), dst1(*dev, bytes + 16);
            auto hx = bits.random(n, 1), hp0 = bits.random(n, 2), hp1 = bits.random(n, 3);
            auto hg0 = bits.random(n, 4), hg1 = bits.random(n, 5), hd1 = bits.random(n, 6);
            dev->upload(xin.get(), hx.data(), bytes);
            dev->upload(p0.get(), hp0.data(), bytes);
            dev->upload(p1.get(), hp1.data(), bytes);
            dev->upload(g0.get(), hg0.data(), bytes);
            dev->upload(g1.get(), hg1.data(), bytes);
            void* d0 = static_cast<uint8_t*>(dst0.get()) + misalign * es;
            void* d1 = static_cast<uint8_t*>(dst1.get()) + misalign * es;
            dev->upload(d1, hd1.data(), bytes);

            graphed_tensor_desc in{bytes, dtype, 0, nullptr, false, xin.get()};
            graphed_tensor_desc outs[2] = {{bytes, dtype, 0, nullptr, true, nullptr},
                                           {bytes, dtype, 0, nullptr, true, nullptr}};
            graphed_param_desc ps[2] = {{p0.get(), bytes, dtype, 0, GRAPHED_GRAD_POLICY_COPY_INTO, true},
                                        {p1.get(), bytes, dtype, 0, GRAPHED_GRAD_POLICY_ACCUMULATE_INTO, true}};
            graphed_callable_desc d = graphed_callable_desc_default();
            d.name = "scale";
            d.num_inputs = 1;
            d.inputs = &in;
            d.num_outputs = 2;
            d.outputs = outs;
            d.num_params = 2;
            d.params = ps;
            d.forward = &ScaleLayer::forward;
            d.backward = &ScaleLayer::backward;
            d.user_data = &L;
            SessionPtr s = create(config());
            ASSERT_TRUE(s);
            uint32_t idx = 0;
            GRAPHED_ASSERT_OK(graphed_session_add_callable(s.get(), &d, &idx));
            GRAPHED_ASSERT_OK(graphed_session_capture(s.get()));

            graphed_replay_args a = graphed_replay_args_default();
            a.stream = dev->stream();
            graphed_ref out[2], gin, gp[2];
            GRAPHED_ASSERT_OK(graphed_forward(s.get(), &a, out, 2));
            const void* gos[2] = {g0.get(), g1.get()};
            a.data = gos;
            a.num_data = 2;
            // Without destinations, COPY_INTO / ACCUMULATE_INTO slots are refused.
            GRAPHED_EXPECT_STATUS(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_backward(s.get(), &a, &gin, 1, gp, 2));
            void* dsts[2] = {d0, d1};
            a.param_dsts = dsts;
            a.num_param_dsts = 2;
            GRAPHED_ASSERT_OK(graphed_backward(s.get(), &a, &gin, 1, gp, 2));
            EXPECT_EQ(GRAPHED_REF_KIND_COPY_INTO, gp[0].kind);
            EXPECT_EQ(d0, gp[0].ptr);
            EXPECT_EQ(GRAPHED_REF_KIND_ACCUMULATE_INTO, gp[1].kind);
            EXPECT_EQ(GRAPHED_REF_KIND_NONE, gin.kind);
            GRAPHED_ASSERT_OK(graphed_backward(s.get(), &a, &gin, 1, gp, 2));  // accumulate twice

            std::vector<uint8_t> got0(bytes), got1(bytes);
            dev->download(got0.data(), d0, bytes);
            dev->download(got1.data(), d1, bytes);
            std::vector<uint8_t> want0(bytes), want1 = hd1;
            for (size_t i = 0; i < n; ++i) {
                std::vector<uint8_t> one(es);
                bits.set(one, 0, bits.get(hg0, i) * bits.get(hx, i));
                std::memcpy(&want0[i * es], one.data(), es);
                bits.set(one, 0, bits.get(hg1, i) * bits.get(hx, i));
                const float g = bits.get(one, 0);
                for (int rep = 0; rep < 2; ++rep) bits.set(want1, i, bits.get(want1, i) + g);
            }
            EXPECT_EQ(want0, got0) << "COPY_INTO must deliver the grad bit for bit";
            EXPECT_EQ(want1, got1) << "ACCUMULATE_INTO must add in f32 and round to nearest even";
        }
    }
}

TEST_P(GradLifetime, ResetThenReplayFails) {
    SessionPtr s = captured(config());
    ASSERT_TRUE(s);
    Step st;
    GRAPHED_ASSERT_OK(step(s.get(), 0, &st));
    const std::vector<float> kept = read(st.gp[0]);
    EXPECT_GT(stats(s.get()).static_bytes, 0u);
    GRAPHED_ASSERT_OK(graphed_session_reset(s.get()));
    Step again;
    GRAPHED_EXPECT_STATUS(GRAPHED_STATUS_SESSION_RESET, step(s.get(), 0, &again));
    EXPECT_NE(std::string::npos, last_error().find("graphed_session_reset")) << last_error();
    GRAPHED_EXPECT_STATUS(GRAPHED_STATUS_SESSION_RESET, graphed_session_capture(s.get()));
    graphed_session_stats st2 = stats(s.get());
    EXPECT_EQ(0u, st2.static_bytes);
    EXPECT_EQ(0u, st2.scratch_bytes);
    EXPECT_EQ(0u, st2.graph_count);
    EXPECT_EQ(kept, read(st.gp[0])) << "clones returned before the reset stay valid";
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
    static int32_t backward(const graphed_pass_ctx* c, void* self) {
        return kit::LinearLayer::backward(c, static_cast<Faulty*>(self)->layer);
    }
};

class GradLifetimeFaults : public GradLifetime {
  protected:
    SessionPtr faulty_session(Faulty* f) {
        SessionPtr s = create(config());
        graphed_callable_desc d = layer.describe(x[0].get(), true);
        d.forward = &Faulty::forward;
        d.backward = &Faulty::backward;
        d.user_data = f;
        uint32_t idx = 0;
        EXPECT_EQ(GRAPHED_STATUS_OK, graphed_session_add_callable(s.get(), &d, &idx)) << last_error();
        return s;
    }
    void expect_nothing_held(graphed_session* s) {
        graphed_session_stats st = stats(s);
        EXPECT_FALSE(st.captured);
        EXPECT_EQ(0u, st.static_bytes);
        EXPECT_EQ(0u, st.scratch_bytes);
        EXPECT_EQ(0u, st.pool_bytes);
        EXPECT_EQ(0u, st.graph_count);
    }
    // After a failed capture, the fixed callable captures and replays right.
    void expect_recapture_works(graphed_session* s, Faulty* f) {
        f->fail_phase = -1;
        GRAPHED_ASSERT_OK(graphed_session_capture(s));
        Step st;
        GRAPHED_ASSERT_OK(step(s, 1, &st));
        EXPECT_EQ(eager_wgrad(1), read(st.gp[0]));
        release(st);
    }
};

TEST_P(GradLifetimeFaults, CallbackErrorAbortsCapture) {
    Faulty f{&layer};
    SessionPtr s = faulty_session(&f);
    ASSERT_TRUE(s);
    f.fail_phase = GRAPHED_PHASE_CAPTURE;
    GRAPHED_EXPECT_STATUS(GRAPHED_STATUS_CALLBACK_FAILED, graphed_session_capture(s.get()));
    std::string msg = last_error();
    for (const char* part : {"forward callback", "'fc'", "returned 42", "capture"})
        EXPECT_NE(std::string::npos, msg.find(part)) << part << " missing from: " << msg;
    expect_nothing_held(s.get());

    f.fail_phase = GRAPHED_PHASE_WARMUP;
    f.code = -7;
    GRAPHED_EXPECT_STATUS(GRAPHED_STATUS_CALLBACK_FAILED, graphed_session_capture(s.get()));
    msg = last_error();
    EXPECT_NE(std::string::npos, msg.find("returned -7 during warmup")) << msg;
    expect_nothing_held(s.get());
    expect_recapture_works(s.get(), &f);
}

TEST_P(GradLifetimeFaults, IllegalCallUnderCaptureIsReported) {
    Faulty f{&layer};
    f.illegal = true;
    f.fail_phase = GRAPHED_PHASE_CAPTURE;
    SessionPtr s = faulty_session(&f);
    ASSERT_TRUE(s);
    GRAPHED_EXPECT_STATUS(GRAPHED_STATUS_CAPTURE_INVALIDATED, graphed_session_capture(s.get()));
    const std::string msg = last_error();
    EXPECT_NE(std::string::npos, msg.find("forward pass of callable 'fc'")) << msg;
    expect_nothing_held(s.get());
    expect_recapture_works(s.get(), &f);
}

TEST_P(GradLifetimeFaults, ScratchMustBeMeasuredInWarmup) {
    graphed_session_config c = config();
    c.warmup_iterations = 0;
    graphed_session* raw = nullptr;
    GRAPHED_ASSERT_OK(graphed_session_create(&c, &raw));
    SessionPtr s(raw);
    graphed_callable_desc d = layer.describe(x[0].get(), true);
    uint32_t idx = 0;
    GRAPHED_ASSERT_OK(graphed_session_add_callable(s.get(), &d, &idx));
    // The layer saves its pre-activation in scratch: with no warmup there is
    // no measured arena, and capture says so (not just the callback's code).
    GRAPHED_EXPECT_STATUS(GRAPHED_STATUS_SCRATCH_EXHAUSTED, graphed_session_capture(s.get()));
    EXPECT_NE(std::string::npos, last_error().find("warmup")) << last_error();
    expect_nothing_held(s.get());
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
        SessionPtr s = create(config());
        graphed_callable_desc d = big.describe(bx.get(), true);
        uint32_t idx = 0;
        GRAPHED_ASSERT_OK(graphed_session_add_callable(s.get(), &d, &idx));
        GRAPHED_ASSERT_OK(graphed_session_capture(s.get()));
        graphed_replay_args a = graphed_replay_args_default();
        a.stream = dev->stream();
        for (int i = 0; i < 3; ++i) {
            graphed_ref out, gin, gp[2];
            GRAPHED_ASSERT_OK(graphed_forward(s.get(), &a, &out, 1));
            GRAPHED_ASSERT_OK(graphed_backward(s.get(), &a, &gin, 1, gp, 2));
            for (auto& g : gp) GRAPHED_ASSERT_OK(graphed_buffer_release(g.owner));
        }
        dev->sync();
        graphed_session_stats st = stats(s.get());
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
        GRAPHED_ASSERT_OK(graphed_session_reset(s.get()));
        st = stats(s.get());
        EXPECT_EQ(0u, st.static_bytes);
        EXPECT_EQ(0u, st.scratch_bytes);
        EXPECT_EQ(0u, st.pool_bytes);
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
        auto* a = static_cast<CountingAllocator*>(ctx);
        *out = a->dev->alloc(bytes);
        ++a->allocs;
        a->last_bytes = bytes;
        return 0;
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
    SessionPtr s = captured(c);
    ASSERT_TRUE(s);
    Step st;
    GRAPHED_ASSERT_OK(step(s.get(), 0, &st));
    EXPECT_EQ(1, alloc.allocs) << "one block for both CLONE grads";
    EXPECT_GE(alloc.last_bytes, size_t(OUT * IN * 4 + OUT * 4));
    EXPECT_EQ(st.gp[0].owner, st.gp[1].owner);
    EXPECT_EQ(alloc.last_bytes, stats(s.get()).clone_bytes_outstanding);
    EXPECT_EQ(eager_wgrad(0), read(st.gp[0]));
    GRAPHED_ASSERT_OK(graphed_buffer_release(st.gp[0].owner));
    EXPECT_EQ(0, alloc.frees) << "the block lives while a grad references it";
    GRAPHED_ASSERT_OK(graphed_buffer_release(st.gp[1].owner));
    EXPECT_EQ(1, alloc.frees);
    EXPECT_EQ(0u, stats(s.get()).clone_bytes_outstanding);
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
    SessionPtr s = create(c);
    ASSERT_TRUE(s);
    graphed_callable_desc d = layer.describe(x[0].get(), true);
    d.pre_hook = &HookLog::pre;
    d.post_hook = &HookLog::post;
    d.hook_data = &log;
    uint32_t idx = 0;
    GRAPHED_ASSERT_OK(graphed_session_add_callable(s.get(), &d, &idx));
    GRAPHED_ASSERT_OK(graphed_session_capture(s.get()));
    const std::vector<std::string> want = {
        "before warmup",
        "pre fwd warmup", "post fwd warmup", "pre bwd warmup", "post bwd warmup",
        "pre fwd warmup", "post fwd warmup", "pre bwd warmup", "post bwd warmup",
        "after warmup",
        "pre fwd capture", "post fwd capture", "pre bwd capture", "post bwd capture"};
    EXPECT_EQ(want, log.events);
    Step st;
    log.events.clear();
    GRAPHED_ASSERT_OK(step(s.get(), 0, &st));
    EXPECT_TRUE(log.events.empty()) << "replays never call hooks";
    release(st);
}

// Sessions sharing a pool share scratch: the second capture reuses the
// first one's arena instead of allocating its own.
TEST_P(GradLifetime, SharedPoolReusesScratch) {
    SessionPtr a = captured(config());
    ASSERT_TRUE(a);
    graphed_session_config c = config();
    c.share_pool_with = a.get();
    SessionPtr b = captured(c);
    ASSERT_TRUE(b);
    graphed_session_stats sa = stats(a.get()), sb = stats(b.get());
    EXPECT_GT(sa.scratch_bytes, 0u);
    EXPECT_EQ(sa.pool_bytes, sb.pool_bytes) << "one pool";
    EXPECT_EQ(sa.scratch_bytes, sa.pool_bytes) << "and one arena in it, used by both";
    // Replayed in capture order, both are right.
    Step s1, s2;
    GRAPHED_ASSERT_OK(step(a.get(), 0, &s1));
    GRAPHED_ASSERT_OK(step(b.get(), 1, &s2));
    EXPECT_EQ(eager_wgrad(0), read(s1.gp[0]));
    EXPECT_EQ(eager_wgrad(1), read(s2.gp[0]));
    release(s1);
    release(s2);
    a.reset();  // the pool lives on with b
    Step s3;
    GRAPHED_ASSERT_OK(step(b.get(), 0, &s3));
    EXPECT_EQ(eager_wgrad(0), read(s3.gp[0]));
    release(s3);
    graphed_session_config bad = config();
    bad.share_pool_with = reinterpret_cast<graphed_session*>(&bad);
    graphed_session* out = nullptr;
    GRAPHED_EXPECT_STATUS(GRAPHED_STATUS_USE_AFTER_DESTROY, graphed_session_create(&bad, &out));
}

// Writing straight into the static input and passing it back as data
// skips the copy; the replay reads what was written.
TEST_P(GradLifetime, StaticInputPassedBackIsUsedInPlace) {
    SessionPtr s = captured(config());
    ASSERT_TRUE(s);
    void* in = nullptr;
    GRAPHED_ASSERT_OK(graphed_session_buffers(s.get(), 0, 0, GRAPHED_BUFFER_ROLE_INPUT, &in, 1));
    auto hx = fetch<float>(*dev, x[1].get(), B * IN);
    dev->upload(in, hx.data(), hx.size() * 4);
    graphed_replay_args a = graphed_replay_args_default();
    a.stream = dev->stream();
    const void* data = in;
    a.data = &data;
    a.num_data = 1;
    Step st;
    GRAPHED_ASSERT_OK(graphed_forward(s.get(), &a, &st.out, 1));
    const void* g = gy[1].get();
    a.data = &g;
    GRAPHED_ASSERT_OK(graphed_backward(s.get(), &a, &st.gin, 1, st.gp, 2));
    EXPECT_EQ(eager_wgrad(1), read(st.gp[0]));
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
        auto* e = static_cast<ExternalLayer*>(self);
        if (c->outputs[0] != nullptr) return 900;  // nothing placed for an external output
        void* z = nullptr;
        if (graphed_scratch_alloc(c->scratch, e->L->act_bytes(e->L->out), &z) != GRAPHED_STATUS_OK) return 901;
        *c->tape = z;
        if (int r = e->L->eager_forward(c->stream, c->inputs[0], z, e->y.get())) return r;
        if (c->phase == GRAPHED_PHASE_WARMUP) {
            e->in_warmup = graphed_pass_set_buffer(c, GRAPHED_BUFFER_ROLE_OUTPUT, 0, e->y.get());
        } else if (e->provide) {
            e->wrong_role = graphed_pass_set_buffer(c, GRAPHED_BUFFER_ROLE_GRAD_OUTPUT, 0, e->y.get());
            return static_cast<int32_t>(graphed_pass_set_buffer(c, GRAPHED_BUFFER_ROLE_OUTPUT, 0, e->y.get()));
        }
        return 0;
    }
    static int32_t backward(const graphed_pass_ctx* c, void* self) {
        auto* e = static_cast<ExternalLayer*>(self);
        if (c->grad_inputs[0] != nullptr || c->param_grads[0] != nullptr) return 902;
        void* z = *c->tape;
        void* gz = nullptr;
        if (graphed_scratch_alloc(c->scratch, e->L->act_bytes(e->L->out), &gz) != GRAPHED_STATUS_OK) return 903;
        if (int r = e->L->eager_backward(c->stream, c->inputs[0], z, c->grad_outputs[0], gz, e->gx.get(), e->gw.get(),
                                         e->gb.get()))
            return r;
        graphed_scratch_free(c->scratch, gz);
        graphed_scratch_free(c->scratch, z);
        if (c->phase != GRAPHED_PHASE_CAPTURE) return 0;
        for (auto [role, index, ptr] : {std::tuple{GRAPHED_BUFFER_ROLE_GRAD_INPUT, 0, e->gx.get()},
                                        std::tuple{GRAPHED_BUFFER_ROLE_PARAM_GRADS, 0, e->gw.get()},
                                        std::tuple{GRAPHED_BUFFER_ROLE_PARAM_GRADS, 1, e->gb.get()}})
            if (graphed_status st = graphed_pass_set_buffer(c, role, index, ptr)) return static_cast<int32_t>(st);
        return 0;
    }
};

TEST_P(GradLifetime, ExternalBuffersProvidedAtCapture) {
    ExternalLayer e{&layer, Buffer(*dev, B * OUT * 4), Buffer(*dev, B * IN * 4), Buffer(*dev, OUT * IN * 4),
                    Buffer(*dev, OUT * 4)};
    auto session = [&](bool external) {
        SessionPtr s = create(config());
        graphed_callable_desc d = layer.describe(x[0].get(), true);
        if (external) {
            layer.input.flags = layer.output.flags = GRAPHED_TENSOR_FLAGS_EXTERNAL;
            layer.params[0].flags = layer.params[1].flags = GRAPHED_PARAM_FLAGS_EXTERNAL_GRAD;
            d.forward = &ExternalLayer::forward;
            d.backward = &ExternalLayer::backward;
            d.user_data = &e;
        }
        uint32_t idx;
        EXPECT_EQ(GRAPHED_STATUS_OK, graphed_session_add_callable(s.get(), &d, &idx)) << last_error();
        return s;
    };
    SessionPtr plain = session(false);
    GRAPHED_ASSERT_OK(graphed_session_capture(plain.get()));
    SessionPtr s = session(true);
    GRAPHED_ASSERT_OK(graphed_session_capture(s.get()));
    EXPECT_EQ(GRAPHED_STATUS_WRONG_STATE, e.in_warmup) << "buffers are provided under capture only";
    EXPECT_EQ(GRAPHED_STATUS_INVALID_ARGUMENT, e.wrong_role) << "only external buffers of this pass";
    EXPECT_LT(stats(s.get()).static_bytes, stats(plain.get()).static_bytes) << "nothing placed for external buffers";
    void* slots[2] = {};
    GRAPHED_ASSERT_OK(graphed_session_buffers(s.get(), 0, 0, GRAPHED_BUFFER_ROLE_PARAM_GRADS, slots, 2));
    EXPECT_EQ(e.gw.get(), slots[0]);
    EXPECT_EQ(e.gb.get(), slots[1]);

    Step s1, s2;
    GRAPHED_ASSERT_OK(step(s.get(), 0, &s1));
    EXPECT_EQ(e.y.get(), s1.out.ptr) << "replays return the provided output";
    EXPECT_EQ(e.gx.get(), s1.gin.ptr);
    ASSERT_EQ(GRAPHED_REF_KIND_CLONE, s1.gp[0].kind);
    EXPECT_NE(e.gw.get(), s1.gp[0].ptr) << "CLONE grads are copied out of the provided memory";
    const std::vector<float> g1 = read(s1.gp[0]);
    EXPECT_EQ(eager_wgrad(0), g1);
    GRAPHED_ASSERT_OK(step(s.get(), 1, &s2));
    EXPECT_EQ(g1, read(s1.gp[0])) << "the clone from replay 1 is intact after replay 2";
    EXPECT_EQ(eager_wgrad(1), read(s2.gp[0]));
    EXPECT_EQ(fetch<float>(*dev, e.gb.get(), OUT), read(s2.gp[1]));
    release(s1);
    release(s2);

    // A callback that does not provide its external buffer fails capture.
    e.provide = false;
    SessionPtr missing = session(true);
    GRAPHED_EXPECT_STATUS(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_session_capture(missing.get()));
    EXPECT_NE(std::string::npos, last_error().find("declared output 0 external but did not provide it")) << last_error();
    EXPECT_EQ(0u, stats(missing.get()).graph_count);
}

GRAPHED_BACKENDS(GradLifetime);
GRAPHED_BACKENDS(GradLifetimeFaults);

}  // namespace
