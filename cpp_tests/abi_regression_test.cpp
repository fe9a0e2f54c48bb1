// Suite AbiRegression: the findings of the ABI review, each pinned by a test
// on both backends (the CUDA instances skip where there is no GPU). Every
// test asserts the status, a distinctive part of the message, and that
// nothing else changed: the sessions involved keep their figures and static
// buffers, and still replay bit-exact against eager.
//
//   ReplayOnACapturingStream...   a replay recorded into another capture
//   MisalignedAccumulate...        ACCUMULATE_INTO into a byte offset
//   KeptInCallbackHandles...       ctx->scratch / ctx->capture used after their call
//   ForgedHandles...               small integers and addresses as handles
//   UninitialisedStructs...        structs not set up by their _default()
//   Sizes...                       sizes past 2^48, sums that would wrap
//   SharedPoolOrder...             sessions sharing a pool, out of order
//   DestroyWhileInUse...           destroy racing a call, and from a callback
//   DefaultStreams...              CUDA's default streams as a capture stream
//   ReleaseOnAForeignStream...     a clone released on what is not a host stream
//   StepsWithIncompatible...       steps over a schedule (external buffers fine)
//   ScheduleCapacities...          output capacities whose bytes overflow
#include "layer_fixture.hpp"
#include "scale_layer.hpp"

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace {

using kit::Buffer;

// A status and the message that came with it.
struct Answer {
    graphed_status status;
    std::string message;
};

Answer answer(graphed_status s) { return {s, graphed_last_error_message()}; }

::testing::AssertionResult is(const Answer& a, graphed_status expected, const std::string& text) {
    if (a.status != expected)
        return ::testing::AssertionFailure() << "expected " << graphed::status_name(expected) << ", got "
                                             << graphed::status_name(a.status) << ": " << a.message;
    if (a.message.find(text) == std::string::npos)
        return ::testing::AssertionFailure() << "the message lacks \"" << text << "\": " << a.message;
    return ::testing::AssertionSuccess();
}

class AbiRegression : public LayerTest {
  protected:
    // The contents of a static buffer of callable 0.
    std::vector<float> contents(const graphed::Session& s, graphed_buffer_role role, size_t floats) {
        return kit::fetch<float>(*dev, s.buffers(0, 0, role).at(0), floats);
    }
    // A session that replays right: forward + backward with x[i], gy[i]
    // give the eager parameter grad.
    void expect_replays_right(graphed::Session& s, int i) {
        Step st = step(s, i);
        EXPECT_EQ(eager_wgrad(i), read(st.g.params[0]));
        release(st);
    }
};

// ---- (a) a replay on a stream that is capturing ---------------------------------

// The callable of session B: under capture, its forward callback replays
// session A on B's capturing stream (ctx->stream), as stream, then as side
// stream; it records the answers and then goes on, or fails with the status.
struct Intruder {
    kit::LinearLayer* layer;
    graphed_session* victim;
    const void* input;
    graphed_stream own_stream;  // a stream that is not capturing
    bool fail = false;
    std::vector<Answer> seen;
    graphed_ref out[1] = {};
    static int32_t forward(const graphed_pass_ctx* c, void* self) {
        auto* t = static_cast<Intruder*>(self);
        if (c->phase == GRAPHED_PHASE_CAPTURE) {
            graphed_replay_args a = graphed_replay_args_default();
            a.stream = c->stream;
            a.data = &t->input;
            a.num_data = 1;
            t->seen.push_back(answer(graphed_forward(t->victim, &a, t->out, 1)));
            graphed_ref gin[1] = {}, gp[2] = {};
            a.data = nullptr;
            a.num_data = 0;
            t->seen.push_back(answer(graphed_backward(t->victim, &a, gin, 1, gp, 2)));
            a.stream = t->own_stream;
            a.side_stream = c->stream;
            t->seen.push_back(answer(graphed_forward(t->victim, &a, t->out, 1)));
            if (t->fail) return static_cast<int32_t>(t->seen.back().status);
        }
        return kit::LinearLayer::forward(c, t->layer);
    }
};

TEST_P(AbiRegression, ReplayOnACapturingStreamIsRefused) {
    graphed_session_config ca = config();
    ca.name = "victim";
    graphed::Session a = captured(ca);
    Step first = step(a, 0);
    release(first);
    const std::string figures_a = figures(a.stats());
    const std::vector<float> in_a = contents(a, GRAPHED_BUFFER_ROLE_INPUT, B * IN);
    const std::vector<float> out_a = contents(a, GRAPHED_BUFFER_ROLE_OUTPUT, B * OUT);

    for (bool fail : {false, true}) {
        SCOPED_TRACE(fail ? "the callback fails with the refusal" : "the callback goes on");
        Intruder t{&layer, a.get(), x[1].get(), dev->stream()};
        t.fail = fail;
        graphed_session_config cb = config();
        cb.name = "intruder";
        graphed::Session b(cb);
        b.add_callable(wrapped(&t));
        if (fail) {
            EXPECT_TRUE(fails_with(GRAPHED_STATUS_CALLBACK_FAILED, graphed_session_capture(b.get()),
                                   "returned 19 during capture"));
            expect_nothing_held(b);
        } else {
            b.capture();
        }
        ASSERT_EQ(3u, t.seen.size());
        EXPECT_TRUE(is(t.seen[0], GRAPHED_STATUS_STREAM_CAPTURING, "args.stream is capturing a graph"));
        EXPECT_TRUE(is(t.seen[0], GRAPHED_STATUS_STREAM_CAPTURING, "the forward replay of callable 'fc'"));
        EXPECT_TRUE(is(t.seen[1], GRAPHED_STATUS_STREAM_CAPTURING, "the backward replay of callable 'fc'"));
        EXPECT_TRUE(is(t.seen[2], GRAPHED_STATUS_STREAM_CAPTURING, "args.side_stream is capturing a graph"));
        for (const Answer& s : t.seen) EXPECT_TRUE(is(s, GRAPHED_STATUS_STREAM_CAPTURING, "Nothing was enqueued"));
        EXPECT_EQ(nullptr, t.out[0].ptr) << "outputs are written only on success";

        // A is as it was: figures, static input (x[1] was not copied in), output.
        EXPECT_EQ(figures_a, figures(a.stats()));
        EXPECT_EQ(in_a, contents(a, GRAPHED_BUFFER_ROLE_INPUT, B * IN));
        EXPECT_EQ(out_a, contents(a, GRAPHED_BUFFER_ROLE_OUTPUT, B * OUT));
        if (!fail) {
            // B's capture went on without A's replay in it.
            EXPECT_EQ(2u, b.stats().graph_count);
            expect_replays_right(b, 1);
        }
    }
    // Both sessions' graphs are intact (ASan watches the host backend's memory).
    expect_replays_right(a, 1);
    expect_replays_right(a, 0);
}

// ---- (b) a misaligned ACCUMULATE_INTO destination ---------------------------------

TEST_P(AbiRegression, MisalignedAccumulateDestinationIsRefused) {
    for (uint32_t dtype : {GRAPHED_DTYPE_F32, GRAPHED_DTYPE_F16, GRAPHED_DTYPE_BF16}) {
        const size_t es = graphed::dtype_size(dtype), n = 1003;
        ScaleRig rig(*dev, config(), dtype, n);
        const size_t bytes = rig.bytes();
        Buffer dst0(*dev, bytes + 16), dst1(*dev, bytes + 16);
        for (size_t offset : {size_t(1), size_t(2), size_t(3), es, size_t(0)}) {
            SCOPED_TRACE(testing::Message() << "dtype " << dtype << ", ACCUMULATE_INTO destination at byte offset "
                                            << offset);
            void* d0 = dst0.get();
            void* d1 = static_cast<uint8_t*>(dst1.get()) + offset;
            const std::vector<uint8_t> start = rig.random(6), before0 = rig.random(7);
            dev->upload(d1, start.data(), bytes);
            dev->upload(d0, before0.data(), bytes);
            const std::string figures_before = figures(rig.session().stats());
            void* dsts[2] = {d0, d1};
            std::vector<uint8_t> got0(bytes), got1(bytes);
            if (offset % es != 0) {
                EXPECT_TRUE(throws(GRAPHED_STATUS_INVALID_ARGUMENT, [&] { rig.step(dsts); },
                                   "ACCUMULATE_INTO destinations must be element-aligned"));
                EXPECT_NE(std::string::npos, last_error().find("param_dsts[1] of callable 'scale'")) << last_error();
                dev->download(got0.data(), d0, bytes);
                dev->download(got1.data(), d1, bytes);
                EXPECT_EQ(before0, got0) << "nothing was replayed: the COPY_INTO destination is untouched";
                EXPECT_EQ(start, got1) << "nothing was added";
                EXPECT_EQ(figures_before, figures(rig.session().stats()));
            } else {
                graphed::Grads g = rig.step(dsts);
                EXPECT_EQ(GRAPHED_REF_KIND_ACCUMULATE_INTO, g.params[1].kind());
                EXPECT_EQ(d1, g.params[1].ptr());
                dev->download(got0.data(), d0, bytes);
                dev->download(got1.data(), d1, bytes);
                EXPECT_EQ(rig.copied(), got0) << "COPY_INTO bit for bit";
                EXPECT_EQ(rig.accumulated(start, 1), got1) << "ACCUMULATE_INTO bit for bit at an element-aligned offset";
            }
        }
    }
}

// ---- (c) in-callback handles kept past their call ---------------------------------

// Keeps the in-callback handles it is given; in session B it uses session
// A's kept ones from inside its own capture callback. Hooks record what they get.
struct Keeper {
    kit::LinearLayer* layer;
    const Keeper* other = nullptr;
    graphed_scratch* warmup0 = nullptr;
    graphed_scratch* scratch = nullptr;
    graphed_capture* capture = nullptr;
    std::vector<Answer> stale, own;
    int warmup_captures = 0;        // warmup calls with a non-NULL ctx->capture
    int hook_calls = 0, hook_handles = 0;  // hook calls, and those with a non-NULL scratch or capture
    void* p = nullptr;

    static int32_t forward(const graphed_pass_ctx* c, void* self) {
        auto* k = static_cast<Keeper*>(self);
        if (c->phase == GRAPHED_PHASE_WARMUP) {
            k->warmup_captures += c->capture != nullptr;
            if (c->iteration == 0) k->warmup0 = c->scratch;
            if (c->iteration == 1) {
                // The scratch handle of the previous iteration's call.
                k->stale.push_back(answer(graphed_scratch_alloc(k->warmup0, 64, &k->p)));
            }
        } else {
            k->scratch = c->scratch;
            k->capture = c->capture;
            if (k->other) {
                k->stale.push_back(answer(graphed_scratch_alloc(k->other->scratch, 64, &k->p)));
                k->stale.push_back(answer(graphed_pass_set_buffer(k->other->capture, GRAPHED_BUFFER_ROLE_OUTPUT, 0,
                                                                  c->outputs[0])));
                // This call's own handles work meanwhile.
                void* q = nullptr;
                k->own.push_back(answer(graphed_scratch_alloc(c->scratch, 64, &q)));
                k->own.push_back(answer(graphed_scratch_free(c->scratch, q)));
            }
        }
        return kit::LinearLayer::forward(c, k->layer);
    }
    static int32_t hook(const graphed_pass_ctx* c, void* self) {
        auto* k = static_cast<Keeper*>(self);
        ++k->hook_calls;
        k->hook_handles += c->scratch != nullptr || c->capture != nullptr;
        return 0;
    }
};

TEST_P(AbiRegression, KeptInCallbackHandlesAreReportedAfterTheCallback) {
    auto session = [&](Keeper* k) {
        graphed::Session s(config());
        graphed::Callable c = wrapped(k);
        c.pre_hook = c.post_hook = &Keeper::hook;
        c.hook_data = k;
        s.add_callable(c);
        s.capture();
        return s;
    };
    Keeper ka{&layer};
    graphed::Session a = session(&ka);
    ASSERT_EQ(1u, ka.stale.size());
    EXPECT_TRUE(is(ka.stale[0], GRAPHED_STATUS_USE_AFTER_DESTROY, "belonged to a callback that has returned"));
    EXPECT_EQ(0, ka.warmup_captures) << "ctx->capture is NULL in warmup";
    EXPECT_EQ(16, ka.hook_calls) << "pre and post, forward and backward, 3 warmup iterations and capture";
    EXPECT_EQ(0, ka.hook_handles) << "hooks get scratch = NULL and capture = NULL";
    ASSERT_NE(nullptr, ka.scratch);
    ASSERT_NE(nullptr, ka.capture);

    // After the callback returned.
    const std::string figures_a = figures(a.stats());
    void* p = reinterpret_cast<void*>(0x1);
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_USE_AFTER_DESTROY, graphed_scratch_alloc(ka.scratch, 64, &p),
                           "scratch allocator 0x"));
    EXPECT_NE(std::string::npos, last_error().find("belonged to a callback that has returned")) << last_error();
    EXPECT_EQ(reinterpret_cast<void*>(0x1), p) << "outputs are written only on success";
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_USE_AFTER_DESTROY, graphed_scratch_free(ka.scratch, p),
                           "belonged to a callback that has returned"));
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_USE_AFTER_DESTROY,
                           graphed_pass_set_buffer(ka.capture, GRAPHED_BUFFER_ROLE_OUTPUT, 0, x[1].get()),
                           "capture 0x"));
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT,
                           graphed_pass_set_buffer(reinterpret_cast<graphed_capture*>(ka.scratch),
                                                   GRAPHED_BUFFER_ROLE_OUTPUT, 0, x[1].get()),
                           "is a scratch allocator handle, not a capture"));

    // Even while a second session's callback runs, with handles of its own.
    Keeper kb{&layer};
    kb.other = &ka;
    graphed::Session b = session(&kb);
    ASSERT_EQ(3u, kb.stale.size());
    EXPECT_TRUE(is(kb.stale[1], GRAPHED_STATUS_USE_AFTER_DESTROY, "scratch allocator 0x"));
    EXPECT_TRUE(is(kb.stale[1], GRAPHED_STATUS_USE_AFTER_DESTROY, "belonged to a callback that has returned"));
    EXPECT_TRUE(is(kb.stale[2], GRAPHED_STATUS_USE_AFTER_DESTROY, "capture 0x"));
    ASSERT_EQ(2u, kb.own.size());
    for (const Answer& o : kb.own) EXPECT_EQ(GRAPHED_STATUS_OK, o.status) << o.message;
    EXPECT_EQ(0, kb.hook_handles);

    EXPECT_EQ(figures_a, figures(a.stats()));
    expect_replays_right(a, 1);
    expect_replays_right(b, 1);
}

// ---- (d) forged handles -------------------------------------------------------------

TEST_P(AbiRegression, ForgedHandlesAreRefusedNeverFollowed) {
    graphed::Session s = captured(config());
    Step st = step(s, 0);
    const std::string before = figures(s.stats());
    graphed_session_config c = config();
    const graphed::Callable callable = layer.callable(x[0].get(), true);
    const graphed_callable_desc d = callable.desc();
    const graphed_replay_args a = graphed_replay_args_default();
    graphed_ref refs[2] = {}, gin[1] = {};
    graphed_session_stats stats = graphed_session_stats_default();
    void* ptrs[2] = {};
    uint32_t policies[2] = {}, index = 77;
    size_t n = 0, f = 0, t = 0;
    void* p = nullptr;
    graphed_session* created = nullptr;
    int local = 0;

    for (uintptr_t forged : {uintptr_t(1), uintptr_t(2), uintptr_t(0x1000), reinterpret_cast<uintptr_t>(&local)}) {
        SCOPED_TRACE(testing::Message() << "handle 0x" << std::hex << forged);
        auto* fs = reinterpret_cast<graphed_session*>(forged);
        auto* fb = reinterpret_cast<graphed_buffer*>(forged);
        const std::string session = "is not a session handle graphed gave out";
        EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_buffer_release(fb),
                               "is not a clone buffer handle graphed gave out"));
        EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_buffer_retain(fb),
                               "is not a clone buffer handle graphed gave out"));
        EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_session_capture(fs), session));
        EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_session_reset(fs), session));
        EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_session_destroy(fs), session));
        EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_session_stats_get(fs, &stats), session));
        EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_session_add_callable(fs, &d, &index), session));
        EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_session_set_param_flags(fs, 0, 0, 0), session));
        EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_forward(fs, &a, refs, 1), session));
        EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_backward(fs, &a, gin, 1, refs, 2), session));
        EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_backward_wgrad(fs, &a, refs, 2), session));
        EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_lease_release(fs, 1), session));
        EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT,
                               graphed_session_buffers(fs, 0, 0, GRAPHED_BUFFER_ROLE_INPUT, ptrs, 1), session));
        EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_session_param_policies(fs, 0, policies, 2),
                               session));
        EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_session_plan_dump(fs, nullptr, 0, &n), session));
        EXPECT_TRUE(
            fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_session_device_memory(fs, &f, &t), session));
        c.share_pool_with = fs;
        EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_session_create(&c, &created), session));
        EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT,
                               graphed_scratch_alloc(reinterpret_cast<graphed_scratch*>(forged), 64, &p),
                               "is not a scratch allocator handle graphed gave out"));
        EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT,
                               graphed_pass_set_buffer(reinterpret_cast<graphed_capture*>(forged),
                                                       GRAPHED_BUFFER_ROLE_OUTPUT, 0, ptrs),
                               "is not a capture handle graphed gave out"));
    }
    EXPECT_EQ(nullptr, created);
    EXPECT_EQ(77u, index);
    EXPECT_EQ(nullptr, p);

    // Real handles of the wrong kind.
    graphed_buffer* owner = st.g.params[0].owner().get();
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_buffer_release(reinterpret_cast<graphed_buffer*>(s.get())),
                           "is a session handle, not a clone buffer"));
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT,
                           graphed_session_destroy(reinterpret_cast<graphed_session*>(owner)),
                           "is a clone buffer handle, not a session"));
    EXPECT_EQ(before, figures(s.stats())) << "nothing was released or destroyed";

    // A double release: both references of the block go, then one more.
    const graphed_ref r0 = st.g.params[0].detach(), r1 = st.g.params[1].detach();
    ASSERT_EQ(r0.owner, r1.owner);
    graphed::check(graphed_buffer_release(r0.owner));
    graphed::check(graphed_buffer_release(r1.owner));
    const std::string released = figures(s.stats());
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_USE_AFTER_DESTROY, graphed_buffer_release(r1.owner),
                           "was released: every reference to it is gone"));
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_USE_AFTER_DESTROY, graphed_buffer_retain(r0.owner), "was released"));
    EXPECT_EQ(released, figures(s.stats()));
    EXPECT_EQ(0u, s.stats().clone_blocks_outstanding);
    expect_replays_right(s, 1);
}

// ---- (e) structs not initialised by their _default() ----------------------------------

TEST_P(AbiRegression, UninitialisedStructsAreRefused) {
    graphed_session* out = nullptr;
    graphed_session_config c;
    std::memset(&c, 0xAB, sizeof c);
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_BAD_STRUCT, graphed_session_create(&c, &out),
                           "config is not an initialised graphed_session_config (its magic field is 0xabababab"));
    EXPECT_NE(std::string::npos, last_error().find("_default()")) << "the message says how to fix it";
    c = config();
    c.struct_size = 16;
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_BAD_STRUCT, graphed_session_create(&c, &out),
                           "config has struct_size 16; the smallest graphed_session_config is"));
    for (uint32_t graphed_session_config::*flag : {&graphed_session_config::clone_param_grads_on_return,
                                                   &graphed_session_config::strict_leases,
                                                   &graphed_session_config::reuse_buffers}) {
        c = config();
        c.*flag = 2;
        EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_session_create(&c, &out),
                               " is 2; it must be 0 or 1"));
    }
    EXPECT_EQ(nullptr, out) << "no session was created";

    graphed::Session s(config());
    uint32_t index = 77;
    auto refused = [&](graphed_status status, const graphed::Callable& callable, const std::string& text) {
        graphed_callable_desc d = callable.desc();
        return fails_with(status, graphed_session_add_callable(s.get(), &d, &index), text);
    };
    const graphed::Callable good = layer.callable(x[0].get(), true);
    {
        graphed_callable_desc d;
        std::memset(&d, 0xAB, sizeof d);
        EXPECT_TRUE(fails_with(GRAPHED_STATUS_BAD_STRUCT, graphed_session_add_callable(s.get(), &d, &index),
                               "desc is not an initialised graphed_callable_desc"));
        d = good.desc();
        d.struct_size = 8;
        EXPECT_TRUE(fails_with(GRAPHED_STATUS_BAD_STRUCT, graphed_session_add_callable(s.get(), &d, &index),
                               "desc has struct_size 8"));
    }
    struct Case {
        void (*spoil)(graphed::Callable&);
        graphed_status status;
        std::string message;
    };
    const std::string tensor_size = std::to_string(sizeof(graphed_tensor_desc));
    const Case cases[] = {
        {[](graphed::Callable& c) { std::memset(&c.inputs[0], 0xAB, sizeof c.inputs[0]); }, GRAPHED_STATUS_BAD_STRUCT,
         "desc.inputs[0] is not an initialised graphed_tensor_desc"},
        {[](graphed::Callable& c) { c.outputs[0].struct_size = 12; }, GRAPHED_STATUS_BAD_STRUCT,
         "desc.outputs[0] has struct_size 12"},
        {[](graphed::Callable& c) {
             c.inputs.push_back(c.inputs[0]);
             c.inputs[1].struct_size += 8;
         },
         GRAPHED_STATUS_BAD_STRUCT,
         "desc.inputs[1] has struct_size " + std::to_string(sizeof(graphed_tensor_desc) + 8) +
             " but desc.inputs[0] has " + tensor_size},
        {[](graphed::Callable& c) { std::memset(&c.params[1], 0xAB, sizeof c.params[1]); }, GRAPHED_STATUS_BAD_STRUCT,
         "desc.params[1] is not an initialised graphed_param_desc"},
        {[](graphed::Callable& c) { c.inputs[0].requires_grad = 2; }, GRAPHED_STATUS_INVALID_ARGUMENT,
         "desc.inputs[0].requires_grad is 2; it must be 0 or 1"},
        {[](graphed::Callable& c) { c.params[0].requires_grad = 2; }, GRAPHED_STATUS_INVALID_ARGUMENT,
         "desc.params[0].requires_grad is 2; it must be 0 or 1"},
    };
    for (const Case& k : cases) {
        graphed::Callable bad = good;
        k.spoil(bad);
        EXPECT_TRUE(refused(k.status, bad, k.message));
    }
    EXPECT_EQ(77u, index);
    EXPECT_EQ(0u, s.stats().callables) << "nothing was registered";

    // Replay arguments and the stats struct.
    s.add_callable(good);
    s.capture();
    const std::string figures_before = figures(s.stats());
    graphed_replay_args a;
    std::memset(&a, 0xAB, sizeof a);
    graphed_ref r[1] = {};
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_BAD_STRUCT, graphed_forward(s.get(), &a, r, 1),
                           "args is not an initialised graphed_replay_args"));
    a = graphed_replay_args_default();
    a.ref_size = 8;
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_forward(s.get(), &a, r, 1),
                           "the element size is 8 bytes"));
    EXPECT_EQ(nullptr, r[0].ptr) << "outputs are written only on success";
    graphed_session_stats st;
    std::memset(&st, 0xAB, sizeof st);
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_BAD_STRUCT, graphed_session_stats_get(s.get(), &st),
                           "stats is not an initialised graphed_session_stats"));
    EXPECT_EQ(0xABABABABu, st.callables) << "a refused stats struct is not written";
    EXPECT_EQ(figures_before, figures(s.stats()));
    expect_replays_right(s, 1);
}

// ---- (f) sizes ------------------------------------------------------------------------

// Asks the scratch allocator for an impossible size at one point of warmup or
// capture, records the answer, and then fails with it or goes on.
struct Greedy {
    kit::LinearLayer* layer;
    uint32_t phase;
    uint32_t iteration;  // warmup iteration (ignored under capture)
    bool fail = true;
    std::vector<Answer> seen;
    static int32_t forward(const graphed_pass_ctx* c, void* self) {
        auto* g = static_cast<Greedy*>(self);
        if (c->phase == g->phase && (c->phase == GRAPHED_PHASE_CAPTURE || c->iteration == g->iteration)) {
            void* p = nullptr;
            for (size_t bytes : {SIZE_MAX, SIZE_MAX - 255, (size_t(1) << 48) + 1})
                g->seen.push_back(answer(graphed_scratch_alloc(c->scratch, bytes, &p)));
            if (g->fail) return static_cast<int32_t>(g->seen.back().status);
        }
        return kit::LinearLayer::forward(c, g->layer);
    }
};

TEST_P(AbiRegression, SizesBeyondTheLimitAreRefused) {
    graphed::Session s(config());
    const graphed::Callable good = layer.callable(x[0].get(), true);
    auto refused = [&](const graphed::Callable& callable, const std::string& text) {
        uint32_t index = 77;
        graphed_callable_desc d = callable.desc();
        return fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_session_add_callable(s.get(), &d, &index), text);
    };
    // An input and an output of 2^63 bytes each: their sum wraps to 0.
    graphed::Callable huge = good;
    huge.inputs[0].ndim = huge.outputs[0].ndim = 0;
    huge.inputs[0].bytes = huge.outputs[0].bytes = size_t(1) << 63;
    EXPECT_TRUE(refused(huge, "inputs[0].bytes is 9223372036854775808 bytes; graphed accepts at most 2^48 bytes"));
    huge = good;
    huge.outputs[0].ndim = 0;
    huge.outputs[0].bytes = size_t(1) << 63;
    EXPECT_TRUE(refused(huge, "outputs[0].bytes is 9223372036854775808 bytes"));
    huge = good;
    huge.params[0].bytes = SIZE_MAX - 3;
    EXPECT_TRUE(refused(huge, "params[0].bytes is 18446744073709551612 bytes; graphed accepts at most 2^48 bytes"));
    huge = good;
    huge.params[1].bytes = (size_t(1) << 48) + 4;
    EXPECT_TRUE(refused(huge, "params[1].bytes is 281474976710660 bytes"));
    EXPECT_EQ(0u, s.stats().callables) << "nothing was registered";

    // Scratch requests past 2^48 bytes, in warmup iterations 0 and 1 and under capture.
    graphed::Session plain = captured(config());
    const uint64_t scratch = plain.stats().scratch_bytes;
    struct Point {
        uint32_t phase, iteration;
        const char* when;
    };
    for (Point at : {Point{GRAPHED_PHASE_WARMUP, 0, "during warmup"}, Point{GRAPHED_PHASE_WARMUP, 1, "during warmup"},
                     Point{GRAPHED_PHASE_CAPTURE, 0, "during capture"}}) {
        SCOPED_TRACE(testing::Message() << "phase " << at.phase << ", iteration " << at.iteration);
        Greedy g{&layer, at.phase, at.iteration};
        graphed::Session gs(config());
        gs.add_callable(wrapped(&g));
        EXPECT_TRUE(fails_with(GRAPHED_STATUS_CALLBACK_FAILED, graphed_session_capture(gs.get()),
                               std::string("returned 7 ") + at.when));
        ASSERT_EQ(3u, g.seen.size());
        for (const Answer& a : g.seen)
            EXPECT_TRUE(is(a, GRAPHED_STATUS_OUT_OF_MEMORY, "graphed places at most 2^48 bytes per allocation"));
        EXPECT_TRUE(is(g.seen[0], GRAPHED_STATUS_OUT_OF_MEMORY, "18446744073709551615 bytes of scratch"));
        expect_nothing_held(gs);
        // A callback that goes on after the refusal captures as if it had not asked.
        g.fail = false;
        g.seen.clear();
        gs.capture();
        EXPECT_EQ(3u, g.seen.size());
        EXPECT_EQ(scratch, gs.stats().scratch_bytes) << "the refused requests took no scratch";
        expect_replays_right(gs, 1);
    }
}

// ---- (g) sessions sharing a pool, replayed out of order --------------------------------

TEST_P(AbiRegression, SharedPoolOrderIsEnforced) {
    graphed_session_config ca = config(), cb = config();
    ca.name = "alpha";
    graphed::Session a = captured(ca);
    cb.name = "beta";
    cb.share_pool_with = a.get();
    graphed::Session b = captured(cb);
    const std::string figures_b = figures(b.stats());

    // alpha is mid-iteration: beta may not begin.
    std::vector<graphed::Ref> out_a = a.forward(replay().data(x[0].get()));
    const std::vector<float> in_b = contents(b, GRAPHED_BUFFER_ROLE_INPUT, B * IN);
    EXPECT_TRUE(throws(GRAPHED_STATUS_WRONG_STATE, [&] { b.forward(replay().data(x[1].get())); },
                       "session 'beta' cannot replay the forward of callable 'fc'"));
    EXPECT_NE(std::string::npos, last_error().find("it shares its scratch pool with session 'alpha', which is in the middle of its iteration"))
        << last_error();
    EXPECT_EQ(in_b, contents(b, GRAPHED_BUFFER_ROLE_INPUT, B * IN)) << "nothing was replayed";
    EXPECT_EQ(figures_b, figures(b.stats()));
    graphed::Grads g_a = a.backward(replay().data(gy[0].get()));
    EXPECT_EQ(eager_wgrad(0), read(g_a.params[0])) << "alpha's iteration goes on undisturbed";

    // alpha finished: beta must start with its first pass.
    EXPECT_TRUE(throws(GRAPHED_STATUS_WRONG_STATE, [&] { b.backward(replay().data(gy[1].get())); },
                       "session 'alpha', which shares its scratch pool, replayed last"));
    EXPECT_NE(std::string::npos, last_error().find("'beta' must start its iteration with its first pass"))
        << last_error();
    EXPECT_EQ(figures_b, figures(b.stats()));

    // In capture order, one whole iteration at a time: bit-exact.
    expect_replays_right(b, 1);
    expect_replays_right(a, 0);
    expect_replays_right(b, 0);
}

// ---- (h) destroy while a call is in progress -----------------------------------------

// Blocks the first warmup forward until the test says go; optionally tries
// to destroy its own session from inside the callback.
struct Blocker {
    kit::LinearLayer* layer;
    graphed_session* self_session = nullptr;  // destroyed from inside when set
    std::mutex m;
    std::condition_variable cv;
    bool block = true, inside = false, go = false;
    std::vector<Answer> own;
    static int32_t forward(const graphed_pass_ctx* c, void* self) {
        auto* b = static_cast<Blocker*>(self);
        if (c->phase == GRAPHED_PHASE_WARMUP && c->iteration == 0) {
            if (b->self_session) b->own.push_back(answer(graphed_session_destroy(b->self_session)));
            if (b->block) {
                std::unique_lock<std::mutex> lock(b->m);
                b->inside = true;
                b->cv.notify_all();
                if (!b->cv.wait_for(lock, std::chrono::seconds(60), [&] { return b->go; })) return 99;
            }
        }
        return kit::LinearLayer::forward(c, b->layer);
    }
};

TEST_P(AbiRegression, DestroyWhileInUseIsBusy) {
    Blocker bl{&layer};
    graphed::Session s(config());
    s.add_callable(wrapped(&bl));

    graphed_status captured_status = GRAPHED_STATUS_INTERNAL;
    std::thread capturer([&] { captured_status = graphed_session_capture(s.get()); });
    Answer destroy{}, stats{}, lease{}, cpp{GRAPHED_STATUS_OK, "not reached"};
    {
        std::unique_lock<std::mutex> lock(bl.m);
        const bool reached = bl.cv.wait_for(lock, std::chrono::seconds(60), [&] { return bl.inside; });
        lock.unlock();
        if (reached) {
            // The other thread is inside graphed_session_capture, in the callback.
            destroy = answer(graphed_session_destroy(s.get()));
            graphed_session_stats st = graphed_session_stats_default();
            stats = answer(graphed_session_stats_get(s.get(), &st));
            lease = answer(graphed_lease_release(s.get(), 12345));
            try {
                s.destroy();
                cpp.message = "Session::destroy did not throw";
            } catch (const graphed::Error& e) {
                cpp = {e.status(), e.message()};
            }
        }
        lock.lock();
        bl.go = true;
        bl.cv.notify_all();
    }
    capturer.join();
    ASSERT_TRUE(bl.inside) << "the callback was never reached";
    EXPECT_TRUE(is(destroy, GRAPHED_STATUS_BUSY, "the session is in use by another call"));
    EXPECT_TRUE(is(destroy, GRAPHED_STATUS_BUSY, "destroy it once that call has returned"));
    EXPECT_TRUE(is(stats, GRAPHED_STATUS_BUSY, "is in use by another call"));
    // graphed_lease_release never waits and is never BUSY: the token is
    // simply not one of this session's.
    EXPECT_TRUE(is(lease, GRAPHED_STATUS_INVALID_ARGUMENT, "was not issued"));
    EXPECT_TRUE(is(cpp, GRAPHED_STATUS_BUSY, "in use by another call")) << "Session::destroy reports BUSY";
    ASSERT_TRUE(s) << "a refused destroy leaves the session";

    // The call that was in progress finished, and the session is whole.
    EXPECT_EQ(GRAPHED_STATUS_OK, captured_status) << last_error();
    EXPECT_EQ(1u, s.stats().captured);
    expect_replays_right(s, 1);
    graphed_session* gone = s.get();
    s.destroy();
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_USE_AFTER_DESTROY, graphed_session_destroy(gone), "was destroyed"));

    // From inside its own callback.
    Blocker own{&layer};
    own.block = false;
    graphed::Session s2(config());
    own.self_session = s2.get();
    s2.add_callable(wrapped(&own));
    s2.capture();
    ASSERT_EQ(1u, own.own.size());
    EXPECT_TRUE(is(own.own[0], GRAPHED_STATUS_BUSY, "one of its own callbacks"));
    EXPECT_EQ(1u, s2.stats().captured);
    expect_replays_right(s2, 1);
    s2.destroy();
}

// ---- (i) boundary gaps ---------------------------------------------------------------

// The legacy and per-thread default streams are refused at create, by name,
// before any backend is opened: callbacks never receive a default stream,
// and CUDA cannot capture the legacy one.
TEST_P(AbiRegression, DefaultStreamsAreNoCaptureStream) {
    const std::pair<uintptr_t, const char*> defaults[] = {{1, "config.capture_stream is CU_STREAM_LEGACY"},
                                                          {2, "config.capture_stream is CU_STREAM_PER_THREAD"}};
    for (const auto& [raw, text] : defaults) {
        graphed_session_config c = config();
        c.capture_stream = reinterpret_cast<graphed_stream>(raw);
        graphed_session* s = nullptr;
        EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_session_create(&c, &s), text));
        EXPECT_EQ(nullptr, s);
    }
}

// On the host backend, graphed_buffer_release_on takes NULL or a host
// stream, as a replay does; anything else is refused and the reference kept.
TEST_P(AbiRegression, ReleaseOnAForeignStreamIsRefused) {
    if (GetParam() != kit::Backend::Host) GTEST_SKIP() << "host streams are the host backend's";
    graphed::Session s = captured(config());
    Step st = step(s, 0);
    graphed_buffer* owner = st.g.params[0].owner().get();
    ASSERT_NE(nullptr, owner);
    const uint64_t blocks = s.stats().clone_blocks_outstanding;
    int local = 0;
    for (uintptr_t bad : {uintptr_t(0x1234), reinterpret_cast<uintptr_t>(&local), reinterpret_cast<uintptr_t>(s.get())}) {
        SCOPED_TRACE(testing::Message() << "stream 0x" << std::hex << bad);
        auto* stream = reinterpret_cast<graphed_stream>(bad);
        EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_buffer_release_on(owner, stream),
                               "graphed_buffer_release_on: "));
        EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_buffer_release_on(owner, stream),
                               "not a stream of the host backend"));
        graphed_ref out[1] = {};
        graphed_replay_args a = graphed_replay_args_default();
        a.stream = stream;
        EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_forward(s.get(), &a, out, 1),
                               "not a stream of the host backend"));
    }
    EXPECT_EQ(blocks, s.stats().clone_blocks_outstanding) << "nothing was released";
    EXPECT_EQ(eager_wgrad(0), read(st.g.params[0])) << "the clone is intact";
    release(st);
    expect_replays_right(s, 1);
}

// A step over a scheduled session combines features that do not work
// together: GRAPHED_STATUS_INCOMPATIBLE, naming them. A step over a
// callable whose callbacks provide buffers is fine.
TEST_P(AbiRegression, StepsWithIncompatibleFeaturesAreRefused) {
    const graphed_schedule_step order[] = {{GRAPHED_PASS_FORWARD, 0}, {GRAPHED_PASS_BACKWARD, 0}};
    graphed_session_config c = config();
    c.schedule = order;
    c.num_schedule_steps = 2;
    graphed::Session scheduled(c);
    scheduled.add_callable(layer.callable(x[0].get(), true));
    graphed::Session external(config());
    external.add_callable(layer.callable(x[0].get(), true));
    external.set_param_flags(0, 0, GRAPHED_PARAM_FLAGS_EXTERNAL_GRAD);
    const uint32_t callables[] = {0};
    graphed_step_desc d = graphed_step_desc_default();
    d.callables = callables;
    d.num_callables = 1;
    uint32_t index = 77;
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_INCOMPATIBLE, graphed_session_add_step(scheduled.get(), &d, &index),
                           "pipeline schedule"));
    EXPECT_EQ(77u, index);
    EXPECT_EQ(GRAPHED_STATUS_OK, graphed_session_add_step(external.get(), &d, &index)) << last_error();
    EXPECT_EQ(0u, index);
    EXPECT_STREQ("GRAPHED_STATUS_INCOMPATIBLE", graphed_status_name(GRAPHED_STATUS_INCOMPATIBLE));
}

// The schedule helpers' output capacities are array lengths: one whose bytes
// overflow is refused as every other, and nothing is written.
TEST(AbiRegressionHelpers, ScheduleCapacitiesWhoseBytesOverflowAreRefused) {
    const graphed_schedule_step order[] = {{GRAPHED_PASS_FORWARD, 0}, {GRAPHED_PASS_BACKWARD, 0}};
    graphed_pass_ref passes[4] = {};
    size_t count = 7;
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT,
                           graphed_schedule_passes(order, 2, sizeof(graphed_schedule_step), nullptr, 0, nullptr, 1,
                                                   passes, SIZE_MAX, sizeof(graphed_pass_ref), &count),
                           "do not fit in memory"));
    EXPECT_EQ(7u, count);
    uint32_t chunks = 7, microbatches = 7, layers[4] = {7, 7, 7, 7}, first[4] = {7, 7, 7, 7};
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT,
                           graphed_schedule_shape(order, 2, sizeof(graphed_schedule_step), nullptr, 0, 1, &chunks,
                                                  &microbatches, layers, first, SIZE_MAX),
                           "do not fit in memory"));
    EXPECT_EQ(7u, chunks);
    EXPECT_EQ(7u, layers[0]);
    EXPECT_EQ(GRAPHED_STATUS_OK, graphed_schedule_passes(order, 2, sizeof(graphed_schedule_step), nullptr, 0, nullptr,
                                                         1, passes, 4, sizeof(graphed_pass_ref), &count));
    EXPECT_EQ(2u, count);
}

INSTANTIATE_TEST_SUITE_P(Backends, AbiRegression, backends(), BackendName());

}  // namespace
