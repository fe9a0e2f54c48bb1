// API contract tests that need no GPU: version, status names, the last-error
// message, invalid arguments, and the answer on machines without a driver.
// They call the C functions themselves (this is the C contract); the
// descriptors come from graphed.hpp's builders.
#include "expect.hpp"

#include <cstdint>
#include <string>
#include <thread>

namespace {

bool driver_present() {
    int32_t v = 0;
    return graphed_driver_version(&v) == GRAPHED_STATUS_OK;
}

TEST(Version, MatchesHeaderMacros) {
    const std::string expected = std::to_string(GRAPHED_VERSION_MAJOR) + "." +
                                 std::to_string(GRAPHED_VERSION_MINOR) + "." +
                                 std::to_string(GRAPHED_VERSION_PATCH);
    EXPECT_EQ(expected, graphed_version());
    EXPECT_STREQ(GRAPHED_VERSION_STRING, graphed_version());
}

TEST(Status, NamesAreDenseAndPrefixed) {
    for (uint32_t code = GRAPHED_STATUS_OK; code <= GRAPHED_STATUS_COLLECTIVE_MISMATCH; ++code) {
        const std::string name = graphed_status_name(code);
        EXPECT_EQ(0u, name.rfind("GRAPHED_STATUS_", 0)) << code;
        EXPECT_NE("GRAPHED_STATUS_UNKNOWN", name) << code;
    }
    EXPECT_STREQ("GRAPHED_STATUS_OK", graphed_status_name(GRAPHED_STATUS_OK));
    EXPECT_STREQ("GRAPHED_STATUS_NULL_POINTER", graphed_status_name(GRAPHED_STATUS_NULL_POINTER));
    EXPECT_STREQ("GRAPHED_STATUS_ALIAS_HELD", graphed_status_name(GRAPHED_STATUS_ALIAS_HELD));
    EXPECT_STREQ("GRAPHED_STATUS_BAD_STRUCT", graphed_status_name(GRAPHED_STATUS_BAD_STRUCT));
    EXPECT_STREQ("GRAPHED_STATUS_INTERNAL", graphed_status_name(GRAPHED_STATUS_INTERNAL));
    EXPECT_STREQ("GRAPHED_STATUS_STREAM_CAPTURING", graphed_status_name(GRAPHED_STATUS_STREAM_CAPTURING));
    EXPECT_STREQ("GRAPHED_STATUS_INCOMPATIBLE", graphed_status_name(GRAPHED_STATUS_INCOMPATIBLE));
    EXPECT_STREQ("GRAPHED_STATUS_PARAM_MOVED", graphed_status_name(GRAPHED_STATUS_PARAM_MOVED));
    EXPECT_EQ(21u, uint32_t(GRAPHED_STATUS_PARAM_MOVED)) << "status codes are stable";
    EXPECT_STREQ("GRAPHED_STATUS_CALLABLE_RELEASED", graphed_status_name(GRAPHED_STATUS_CALLABLE_RELEASED));
    EXPECT_EQ(22u, uint32_t(GRAPHED_STATUS_CALLABLE_RELEASED)) << "status codes are stable";
    EXPECT_STREQ("GRAPHED_STATUS_COLLECTIVE_MISMATCH", graphed_status_name(GRAPHED_STATUS_COLLECTIVE_MISMATCH));
    EXPECT_EQ(23u, uint32_t(GRAPHED_STATUS_COLLECTIVE_MISMATCH)) << "status codes are stable";
}

TEST(Status, UnknownCodesHaveAnAnswer) {
    EXPECT_STREQ("GRAPHED_STATUS_UNKNOWN", graphed_status_name(GRAPHED_STATUS_COLLECTIVE_MISMATCH + 1));
    EXPECT_STREQ("GRAPHED_STATUS_UNKNOWN", graphed_status_name(0xFFFFFFFFu));
}

TEST(Errors, NullOutputPointersAreRejectedWithAMessage) {
    EXPECT_EQ(GRAPHED_STATUS_NULL_POINTER, graphed_device_count(nullptr));
    EXPECT_NE(std::string::npos, last_error().find("graphed_device_count: count_out must not be NULL"))
        << last_error();
    EXPECT_EQ(GRAPHED_STATUS_NULL_POINTER, graphed_driver_version(nullptr));
    EXPECT_NE(std::string::npos, last_error().find("graphed_driver_version: version_out must not be NULL"))
        << last_error();
}

TEST(Errors, LastErrorIsPerThread) {
    EXPECT_EQ(GRAPHED_STATUS_NULL_POINTER, graphed_device_count(nullptr));
    ASSERT_FALSE(last_error().empty());
    std::string other;
    std::thread t([&] { other = graphed_last_error_message(); });
    t.join();
    EXPECT_EQ("", other) << "a fresh thread must not see another thread's message";
}

TEST(Device, NoDriverIsAClearAnswer) {
    if (driver_present()) {
        GTEST_SKIP() << "this machine has a CUDA driver; the no-driver answer is checked on machines without one";
    }
    uint32_t count = 12345;
    EXPECT_EQ(GRAPHED_STATUS_NO_DRIVER, graphed_device_count(&count));
    EXPECT_EQ(12345u, count) << "outputs are written only on success";
    EXPECT_NE(std::string::npos, last_error().find("libcuda")) << last_error();
    int32_t version = -7;
    EXPECT_EQ(GRAPHED_STATUS_NO_DRIVER, graphed_driver_version(&version));
    EXPECT_EQ(-7, version);
}

TEST(Device, CountOnAMachineWithADriver) {
    if (!driver_present()) {
        GTEST_SKIP() << "no CUDA driver on this machine: " << last_error();
    }
    uint32_t count = 0;
    graphed_status s = graphed_device_count(&count);
    if (s == GRAPHED_STATUS_NO_DEVICE) {
        EXPECT_FALSE(last_error().empty());
        GTEST_SKIP() << "driver present but no device: " << last_error();
    }
    ASSERT_EQ(GRAPHED_STATUS_OK, s) << last_error();
    EXPECT_GE(count, 1u);
}

// ---- the session API -----------------------------------------------------------
// A host session and a do-nothing callable with one input, one parameter and
// one output, for argument and state checks.

int32_t noop(const graphed_pass_ctx*, void*) { return 0; }

struct Tiny {
    float in[4] = {1, 2, 3, 4}, w[4] = {0}, out[4] = {0};
    graphed_tensor_desc input = graphed::tensor_desc(16, GRAPHED_DTYPE_F32, true, in);
    graphed_tensor_desc output = graphed::tensor_desc(16, GRAPHED_DTYPE_F32, true);
    graphed_param_desc param = graphed::param_desc(w, 16);
    graphed_callable_desc desc() {
        graphed_callable_desc d = graphed_callable_desc_default();
        d.name = "tiny";
        d.num_inputs = 1;
        d.inputs = &input;
        d.num_params = 1;
        d.params = &param;
        d.num_outputs = 1;
        d.outputs = &output;
        d.forward = noop;
        d.backward = noop;
        return d;
    }
};

graphed_session_config host_config() { return graphed::session_config(GRAPHED_BACKEND_HOST); }

graphed_session* host_session() {
    graphed_session_config c = host_config();
    graphed_session* s = nullptr;
    EXPECT_EQ(GRAPHED_STATUS_OK, graphed_session_create(&c, &s)) << last_error();
    return s;
}

uint32_t callables(graphed_session* s) {
    graphed_session_stats st = graphed_session_stats_default();
    EXPECT_EQ(GRAPHED_STATUS_OK, graphed_session_stats_get(s, &st));
    return st.callables;
}

TEST(SessionContract, ConfigDefaults) {
    graphed_session_config c = graphed_session_config_default();
    EXPECT_EQ(sizeof(graphed_session_config), c.struct_size);
    EXPECT_EQ(GRAPHED_BACKEND_CUDA, c.backend);
    EXPECT_EQ(uint32_t(GRAPHED_SESSION_CONFIG_MAGIC), c.magic);
    EXPECT_EQ(3u, c.warmup_iterations);
    EXPECT_EQ(1u, c.clone_param_grads_on_return);
    EXPECT_EQ(0u, c.strict_leases);
    EXPECT_EQ(0u, c.reuse_buffers);
    EXPECT_EQ(GRAPHED_CAPTURE_MODE_GLOBAL, c.capture_mode);
    EXPECT_EQ(GRAPHED_LOG_LEVEL_WARN, c.log_level);
    EXPECT_EQ(sizeof(graphed_schedule_step), c.schedule_step_size);
    EXPECT_EQ(sizeof(graphed_callable_desc), graphed_callable_desc_default().struct_size);
    EXPECT_EQ(uint32_t(GRAPHED_CALLABLE_DESC_MAGIC), graphed_callable_desc_default().magic);
    const graphed_tensor_desc t = graphed_tensor_desc_default();
    EXPECT_EQ(sizeof(graphed_tensor_desc), t.struct_size);
    EXPECT_EQ(uint32_t(GRAPHED_TENSOR_DESC_MAGIC), t.magic);
    EXPECT_EQ(GRAPHED_DTYPE_F32, t.dtype);
    EXPECT_EQ(0u, t.requires_grad);
    const graphed_param_desc p = graphed_param_desc_default();
    EXPECT_EQ(sizeof(graphed_param_desc), p.struct_size);
    EXPECT_EQ(uint32_t(GRAPHED_PARAM_DESC_MAGIC), p.magic);
    EXPECT_EQ(1u, p.requires_grad);
    EXPECT_EQ(GRAPHED_GRAD_POLICY_DEFAULT, p.policy);
    const graphed_replay_args a = graphed_replay_args_default();
    EXPECT_EQ(sizeof(graphed_replay_args), a.struct_size);
    EXPECT_EQ(uint32_t(GRAPHED_REPLAY_ARGS_MAGIC), a.magic);
    EXPECT_EQ(sizeof(graphed_ref), a.ref_size);
    const graphed_session_stats st = graphed_session_stats_default();
    EXPECT_EQ(sizeof(graphed_session_stats), st.struct_size);
    EXPECT_EQ(uint32_t(GRAPHED_SESSION_STATS_MAGIC), st.magic);
    EXPECT_EQ(GRAPHED_STATUS_OK, graphed_backend_available(GRAPHED_BACKEND_HOST));
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_backend_available(7), "not a graphed_backend"));
}

TEST(SessionContract, CreateRejectsBadConfigs) {
    graphed_session* s = reinterpret_cast<graphed_session*>(0x1);
    graphed_session_config c = host_config();
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_NULL_POINTER, graphed_session_create(&c, nullptr), "session_out"));
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_NULL_POINTER, graphed_session_create(nullptr, &s), "config"));
    c.struct_size = 8;
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_BAD_STRUCT, graphed_session_create(&c, &s), "config has struct_size 8"));
    c = host_config();
    c.backend = 9;
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_session_create(&c, &s), "backend: 9"));
    c = host_config();
    c.capture_mode = 5;
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_session_create(&c, &s), "capture_mode"));
    c = host_config();
    c.log_level = 4;
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_session_create(&c, &s), "log_level"));
    c = host_config();
    c.clone_alloc = [](void*, size_t, graphed_stream, void**) -> int32_t { return 0; };
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_session_create(&c, &s), "given together"));
    EXPECT_EQ(reinterpret_cast<graphed_session*>(0x1), s) << "outputs are written only on success";
    if (!driver_present()) {
        c = graphed_session_config_default();
        EXPECT_TRUE(fails_with(GRAPHED_STATUS_NO_DRIVER, graphed_session_create(&c, &s), "libcuda"));
    }
}

TEST(SessionContract, NewerCallersPassLargerStructs) {
    // A caller built against a newer header passes a larger config; the
    // fields this library does not know are ignored.
    struct Bigger {
        graphed_session_config c;
        uint64_t future[4];
    } big{};
    big.c = host_config();
    big.c.struct_size = sizeof(Bigger);
    big.future[0] = 0xFFFFFFFFFFFFFFFFull;
    graphed_session* s = nullptr;
    ASSERT_EQ(GRAPHED_STATUS_OK, graphed_session_create(&big.c, &s)) << last_error();
    EXPECT_EQ(GRAPHED_STATUS_OK, graphed_session_destroy(s));
}

TEST(SessionContract, DestroyIsSafe) {
    EXPECT_EQ(GRAPHED_STATUS_OK, graphed_session_destroy(nullptr));
    graphed_session* s = host_session();
    EXPECT_EQ(GRAPHED_STATUS_OK, graphed_session_destroy(s));
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_USE_AFTER_DESTROY, graphed_session_destroy(s), "was destroyed"));
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_USE_AFTER_DESTROY, graphed_session_capture(s), "destroyed"));
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_NULL_POINTER, graphed_session_capture(nullptr), "session must not be NULL"));
}

TEST(SessionContract, AddCallableRejectsBadDescriptors) {
    graphed_session* s = host_session();
    Tiny t;
    uint32_t index = 77;
    graphed_callable_desc d = t.desc();
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_NULL_POINTER, graphed_session_add_callable(s, nullptr, &index), "desc"));
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_NULL_POINTER, graphed_session_add_callable(s, &d, nullptr), "index_out"));
    d.forward = nullptr;
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_NULL_POINTER, graphed_session_add_callable(s, &d, &index), "desc.forward"));
    d = t.desc();
    d.struct_size = 0;
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_BAD_STRUCT, graphed_session_add_callable(s, &d, &index), "desc has struct_size 0"));
    d = t.desc();
    d.inputs = nullptr;
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_NULL_POINTER, graphed_session_add_callable(s, &d, &index), "desc.inputs"));
    d = t.desc();
    t.input.dtype = 99;
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_session_add_callable(s, &d, &index),
                      "desc.inputs[0].dtype: 99"));
    t.input.dtype = GRAPHED_DTYPE_F32;
    t.input.bytes = 0;
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_session_add_callable(s, &d, &index), "bytes is 0"));
    t.input.bytes = 18;
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_session_add_callable(s, &d, &index),
                      "not a multiple"));
    t.input.bytes = 16;
    int64_t shape[2] = {3, 2};
    t.output.ndim = 2;
    t.output.shape = shape;
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_session_add_callable(s, &d, &index),
                      "does not hold 16 bytes"));
    t.output.ndim = 0;
    t.param.data = nullptr;
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_NULL_POINTER, graphed_session_add_callable(s, &d, &index), "params[].data"));
    t.param.data = t.w;
    t.param.flags = 0x80;
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_session_add_callable(s, &d, &index), "unknown bits"));
    t.param.flags = 0;
    t.param.dtype = GRAPHED_DTYPE_I32;
    t.param.policy = GRAPHED_GRAD_POLICY_ACCUMULATE_INTO;
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_session_add_callable(s, &d, &index),
                      "ACCUMULATE_INTO supports f32, f16 and bf16"));
    t.param.policy = 17;
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_session_add_callable(s, &d, &index),
                      "not a graphed_grad_policy"));
    EXPECT_EQ(77u, index) << "outputs are written only on success";
    EXPECT_EQ(0u, callables(s)) << "a refused registration registers nothing";
    t.param.dtype = GRAPHED_DTYPE_F32;
    t.param.policy = GRAPHED_GRAD_POLICY_DEFAULT;
    EXPECT_EQ(GRAPHED_STATUS_OK, graphed_session_add_callable(s, &d, &index)) << last_error();
    EXPECT_EQ(0u, index);
    EXPECT_EQ(GRAPHED_STATUS_OK, graphed_session_destroy(s));
}

TEST(SessionContract, CallsInTheWrongOrder) {
    graphed_session* s = host_session();
    Tiny t;
    graphed_callable_desc d = t.desc();
    uint32_t index = 0;
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_WRONG_STATE, graphed_session_capture(s), "no callables"));
    ASSERT_EQ(GRAPHED_STATUS_OK, graphed_session_add_callable(s, &d, &index));
    graphed_replay_args a = graphed_replay_args_default();
    graphed_ref out{}, gin{}, gp{};
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_WRONG_STATE, graphed_forward(s, &a, &out, 1), "not captured yet"));
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_WRONG_STATE, graphed_backward(s, &a, &gin, 1, &gp, 1), "not captured yet"));
    ASSERT_EQ(GRAPHED_STATUS_OK, graphed_session_capture(s)) << last_error();
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_WRONG_STATE, graphed_session_capture(s), "already captured"));
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_WRONG_STATE, graphed_session_add_callable(s, &d, &index), "before capture"));
    ASSERT_EQ(GRAPHED_STATUS_OK, graphed_session_reset(s));
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_SESSION_RESET, graphed_forward(s, &a, &out, 1), "reset"));
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_SESSION_RESET, graphed_session_add_callable(s, &d, &index), "reset"));
    EXPECT_EQ(GRAPHED_STATUS_OK, graphed_session_reset(s)) << "reset is idempotent";
    EXPECT_EQ(GRAPHED_STATUS_OK, graphed_session_destroy(s));
}

TEST(SessionContract, ReplayRejectsBadArguments) {
    graphed_session* s = host_session();
    Tiny t;
    graphed_callable_desc d = t.desc();
    uint32_t index = 0;
    ASSERT_EQ(GRAPHED_STATUS_OK, graphed_session_add_callable(s, &d, &index));
    ASSERT_EQ(GRAPHED_STATUS_OK, graphed_session_capture(s)) << last_error();
    graphed_replay_args a = graphed_replay_args_default();
    graphed_ref out[2]{}, gin{}, gp{};
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_NULL_POINTER, graphed_forward(s, nullptr, out, 1), "args"));
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_forward(s, &a, out, 2), "room for 2 refs"));
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_NULL_POINTER, graphed_forward(s, &a, nullptr, 1), "outputs"));
    a.callable = 3;
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_forward(s, &a, out, 1), "callable 3 does not exist"));
    a.callable = 0;
    a.microbatch = 1;
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_forward(s, &a, out, 1), "microbatch 1"));
    a.microbatch = 0;
    a.num_data = 1;
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_forward(s, &a, out, 1), "args.data is NULL"));
    const void* none[1] = {nullptr};
    a.data = none;
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_forward(s, &a, out, 1), "inputs[0]"));
    const void* two[2] = {t.in, t.in};
    a.data = two;
    a.num_data = 2;
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_forward(s, &a, out, 1), "2 inputs were passed"));
    a = graphed_replay_args_default();
    a.struct_size = 4;
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_BAD_STRUCT, graphed_forward(s, &a, out, 1), "args has struct_size 4"));
    a = graphed_replay_args_default();
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_backward_wgrad(s, &a, &gp, 1),
                      "no weight-grad callback"));
    EXPECT_EQ(nullptr, out[0].ptr) << "outputs are written only on success";
    ASSERT_EQ(GRAPHED_STATUS_OK, graphed_forward(s, &a, out, 1)) << last_error();
    ASSERT_EQ(GRAPHED_STATUS_OK, graphed_backward(s, &a, &gin, 1, &gp, 1)) << last_error();
    EXPECT_EQ(GRAPHED_REF_KIND_CLONE, gp.kind);
    EXPECT_EQ(GRAPHED_STATUS_OK, graphed_buffer_release(gp.owner));
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_USE_AFTER_DESTROY, graphed_buffer_release(gp.owner), "was released"));
    EXPECT_EQ(GRAPHED_STATUS_OK, graphed_buffer_release(nullptr));
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_NULL_POINTER, graphed_buffer_retain(nullptr), "buffer"));
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_lease_release(s, 12345), "not issued"));
    void* ptrs[1];
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_session_buffers(s, 0, 0, 9, ptrs, 1), "role: 9"));
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT,
                      graphed_session_buffers(s, 0, 0, GRAPHED_BUFFER_ROLE_INPUT, ptrs, 3), "count is 3"));
    size_t f = 0, tot = 0;
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_UNSUPPORTED, graphed_session_device_memory(s, &f, &tot), "host backend"));
    EXPECT_EQ(GRAPHED_STATUS_OK, graphed_session_destroy(s));
}

// A callback that keeps its scratch handle and calls back into its session.
struct Reentrant {
    graphed_session* session = nullptr;
    graphed_scratch* kept = nullptr;
    graphed_status inner = GRAPHED_STATUS_OK;
    static int32_t forward(const graphed_pass_ctx* ctx, void* self) {
        auto* r = static_cast<Reentrant*>(self);
        r->kept = ctx->scratch;
        graphed_session_stats st = graphed_session_stats_default();
        r->inner = graphed_session_stats_get(r->session, &st);
        return 0;
    }
};

TEST(SessionContract, ReentrantCallsAndStaleScratchAreReported) {
    graphed_session* s = host_session();
    Tiny t;
    Reentrant r;
    r.session = s;
    graphed_callable_desc d = t.desc();
    d.forward = Reentrant::forward;
    d.user_data = &r;
    uint32_t index = 0;
    ASSERT_EQ(GRAPHED_STATUS_OK, graphed_session_add_callable(s, &d, &index));
    ASSERT_EQ(GRAPHED_STATUS_OK, graphed_session_capture(s)) << last_error();
    EXPECT_EQ(GRAPHED_STATUS_BUSY, r.inner) << "a callback calling into its own session gets BUSY, not a deadlock";
    void* p = nullptr;
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_USE_AFTER_DESTROY, graphed_scratch_alloc(r.kept, 64, &p),
                      "belonged to a callback that has returned"));
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_NULL_POINTER, graphed_scratch_alloc(nullptr, 64, &p), "scratch"));
    EXPECT_EQ(GRAPHED_STATUS_OK, graphed_session_destroy(s));
}

void count_log(void* ctx, uint32_t level, const char* msg) {
    if (level == GRAPHED_LOG_LEVEL_WARN && std::string(msg).find("clone_param_grads_on_return") != std::string::npos)
        ++*static_cast<int*>(ctx);
}

TEST(SessionContract, OptOutIsWarnedAbout) {
    int warnings = 0;
    graphed_session_config c = host_config();
    c.clone_param_grads_on_return = false;
    c.log = count_log;
    c.log_ctx = &warnings;
    graphed_session* s = nullptr;
    ASSERT_EQ(GRAPHED_STATUS_OK, graphed_session_create(&c, &s));
    Tiny t;
    graphed_callable_desc d = t.desc();
    uint32_t index = 0;
    ASSERT_EQ(GRAPHED_STATUS_OK, graphed_session_add_callable(s, &d, &index));
    ASSERT_EQ(GRAPHED_STATUS_OK, graphed_session_capture(s));
    EXPECT_EQ(2, warnings) << "one warning at creation, one naming the aliased slots at capture";
    EXPECT_EQ(GRAPHED_STATUS_OK, graphed_session_destroy(s));
}

TEST(HostBackend, EnqueueRejectsForeignStreams) {
    int x = 0;
    auto bump = [](void* p) { ++*static_cast<int*>(p); };
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT,
                      graphed_host_enqueue(reinterpret_cast<graphed_stream>(0x1234), bump, &x),
                      "not a stream of the host backend"));
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_NULL_POINTER, graphed_host_enqueue(nullptr, nullptr, &x), "task"));
    EXPECT_EQ(GRAPHED_STATUS_OK, graphed_host_enqueue(nullptr, bump, &x));
    EXPECT_EQ(1, x) << "NULL is the immediate stream";
    EXPECT_EQ(GRAPHED_STATUS_OK, graphed_host_synchronize(nullptr));
}

}  // namespace
