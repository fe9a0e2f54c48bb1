// A capture that names what broke (docs/c-api.md, "When a capture fails"):
// faults injected into the callbacks of a session under capture, of every
// kind a callback meets (a failing code, a code with a message naming the
// operation, a host synchronisation, an allocation outside the graph's
// pool, work on a stream the capture does not know, a CUDA call that cannot
// be captured), in every place (forward, backward, a second callable, a
// microbatch of a schedule, a bucket, a clone slot's capture, a step's
// capture, warmup). Each message must name the session, the callable (name
// and index), the pass, the microbatch or bucket and the operation; after
// each failure the session holds nothing (its stats, the process's memory
// figures and, on a GPU, the driver's free memory) and captures again.
// Only the public header and the kit; host and CUDA instances.
#include "layer_fixture.hpp"

#include <string>
#include <vector>

namespace {

using kit::Buffer;

// What a fault does, in the pass and capture it strikes.
enum class Kind { Code, CodeWithMessage, Sync, AllocOutsidePool, UnjoinedWork, UncapturableCall };

// The layer's callbacks with one fault: in `pass`, in the `nth` call of
// `phase` (counted from 1) of microbatch `mb` (any: -1).
struct Fault {
    kit::LinearLayer* layer;
    Kind kind = Kind::Code;
    uint32_t pass = GRAPHED_PASS_FORWARD;
    uint32_t phase = GRAPHED_PHASE_CAPTURE;
    int nth = 1;
    int mb = -1;
    int seen = 0;

    int32_t strike(const graphed_pass_ctx* c) {
        if (c->pass != pass || c->phase != phase || (mb >= 0 && int(c->microbatch) != mb) || ++seen != nth) return 0;
        kit::Device& d = *layer->dev;
        switch (kind) {
            case Kind::Code: return 42;
            case Kind::CodeWithMessage:
                (void)graphed_callback_fail_message("cublasSgemm returned CUBLAS_STATUS_NOT_SUPPORTED");
                return 13;
            case Kind::Sync: return d.illegal(c->stream);
            case Kind::AllocOutsidePool: return d.alloc_outside_pool(c->stream);
            case Kind::UnjoinedWork: return d.unjoined_work(c->stream);
            case Kind::UncapturableCall: return d.uncapturable_call(c->stream);
        }
        return 0;
    }
    static int32_t forward(const graphed_pass_ctx* c, void* self) {
        auto* f = static_cast<Fault*>(self);
        if (int32_t e = f->strike(c)) return e;
        return kit::LinearLayer::forward(c, f->layer);
    }
    static int32_t backward(const graphed_pass_ctx* c, void* self) {
        auto* f = static_cast<Fault*>(self);
        if (int32_t e = f->strike(c)) return e;
        return kit::LinearLayer::backward(c, f->layer);
    }
};

class CaptureFailures : public LayerTest {
  protected:
    graphed_session_config named() const {
        graphed_session_config c = config();
        c.name = "faults";
        return c;
    }

    graphed::Callable faulty(Fault* f) {
        graphed::Callable c = layer.callable(x[0].get(), true);
        c.forward = &Fault::forward;
        c.backward = &Fault::backward;
        c.user_data = f;
        return c;
    }

    // The process's and the device's memory figures before a capture.
    struct Held {
        graphed_memory_stats mem;
        size_t free;
    };
    Held held() const {
        Held h{graphed_memory_stats_default(), dev->free_memory()};
        EXPECT_EQ(GRAPHED_STATUS_OK, graphed_memory_stats_get(&h.mem));
        return h;
    }

    // Captures `s`, expecting `status` (CUDA may answer one of two) and a
    // message holding every part; then the session must hold nothing of
    // the capture and the process be back where it was.
    void expect_failure(graphed::Session& s, std::vector<graphed_status> statuses,
                        const std::vector<std::string>& parts) {
        const Held before = held();
        const graphed_status got = graphed_session_capture(s.get());
        const std::string msg = last_error();
        bool known = false;
        for (graphed_status st : statuses) known = known || st == got;
        EXPECT_TRUE(known) << graphed::status_name(got) << ": " << msg;
        for (const std::string& part : parts)
            EXPECT_NE(std::string::npos, msg.find(part)) << "\"" << part << "\" missing from: " << msg;
        expect_nothing_held(s);
        const Held after = held();
        EXPECT_EQ(before.mem.device_bytes, after.mem.device_bytes) << "the capture's memory went back";
        EXPECT_EQ(before.mem.allocations, after.mem.allocations);
        EXPECT_EQ(before.mem.graphs, after.mem.graphs) << "no graph of the failed capture lives";
        if (dev->backend() == kit::Backend::Cuda) {
            // The driver's figure: every allocation of the capture freed
            // (within 2 MiB of page rounding and the driver's own caches).
            EXPECT_LE(before.free, after.free + (size_t(2) << 20)) << "device memory leaked by a failed capture";
        }
    }

    // The session captures and replays right once the fault is gone.
    void expect_recapture(graphed::Session& s, Fault& f) {
        f.kind = Kind::Code;
        f.pass = 99;  // never strikes
        s.capture();
        Step st = step(s, 1);
        EXPECT_EQ(eager_wgrad(1), read(st.g.params[0]));
        release(st);
    }

    bool cuda() const { return dev->backend() == kit::Backend::Cuda; }

    // The parts every message of a fault in the forward of 'fc' names.
    static std::vector<std::string> place(const char* pass, const char* callable = "callable 'fc' (index 0)") {
        return {std::string(pass), std::string(callable) + " in session 'faults'", "microbatch 0", "no buckets"};
    }
    static std::vector<std::string> with(std::vector<std::string> v, const std::vector<std::string>& more) {
        v.insert(v.end(), more.begin(), more.end());
        return v;
    }
};

TEST_P(CaptureFailures, CallbackCodeNamesThePlace) {
    Fault f{&layer};
    graphed::Session s(named());
    s.add_callable(faulty(&f));
    expect_failure(s, {GRAPHED_STATUS_CALLBACK_FAILED},
                   with(place("the forward callback of"), {"returned 42 during capture"}));
    expect_recapture(s, f);
}

TEST_P(CaptureFailures, CallbackMessageNamesTheOperation) {
    Fault f{&layer};
    f.kind = Kind::CodeWithMessage;
    f.pass = GRAPHED_PASS_BACKWARD;
    graphed::Session s(named());
    s.add_callable(faulty(&f));
    expect_failure(s, {GRAPHED_STATUS_CALLBACK_FAILED},
                   with(place("the backward callback of"),
                        {"returned 13 during capture: cublasSgemm returned CUBLAS_STATUS_NOT_SUPPORTED"}));
    expect_recapture(s, f);
}

TEST_P(CaptureFailures, HostSynchronisationInvalidatesAndIsNamed) {
    Fault f{&layer};
    f.kind = Kind::Sync;
    graphed::Session s(named());
    s.add_callable(faulty(&f));
    const char* op = cuda() ? "cuStreamEndCapture returned CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"
                            : "graphed_host_synchronize(host stream";
    expect_failure(s, {GRAPHED_STATUS_CAPTURE_INVALIDATED},
                   with(place("capture of the forward pass of"),
                        {"was invalidated", "not allowed under capture (a host synchronisation", op}));
    expect_recapture(s, f);
}

TEST_P(CaptureFailures, SynchronisationInBackwardIsNamed) {
    Fault f{&layer};
    f.kind = Kind::Sync;
    f.pass = GRAPHED_PASS_BACKWARD;
    graphed::Session s(named());
    s.add_callable(faulty(&f));
    expect_failure(s, {GRAPHED_STATUS_CAPTURE_INVALIDATED},
                   with(place("capture of the backward pass of"), {"not allowed under capture"}));
    expect_recapture(s, f);
}

TEST_P(CaptureFailures, AllocationOutsideThePoolIsNamed) {
    Fault f{&layer};
    f.kind = Kind::AllocOutsidePool;
    graphed::Session s(named());
    s.add_callable(faulty(&f));
    // CUDA refuses the call (and may invalidate the capture with it).
    expect_failure(s, {GRAPHED_STATUS_CAPTURE_INVALIDATED, GRAPHED_STATUS_CALLBACK_FAILED},
                   with(place("forward"), {"cudaMalloc (an allocation outside the graph's pool)"}));
    expect_recapture(s, f);
}

TEST_P(CaptureFailures, WorkOnAStreamTheCaptureDoesNotKnowIsNamed) {
    Fault f{&layer};
    f.kind = Kind::UnjoinedWork;
    graphed::Session s(named());
    s.add_callable(faulty(&f));
    const std::vector<std::string> op =
        cuda() ? std::vector<std::string>{"CUDA_ERROR_STREAM_CAPTURE_UNJOINED", "was not joined back"}
               : std::vector<std::string>{"work on a stream the capture does not know"};
    expect_failure(s, {GRAPHED_STATUS_CAPTURE_INVALIDATED}, with(place("capture of the forward pass of"), op));
    expect_recapture(s, f);
}

TEST_P(CaptureFailures, UncapturableLibraryCallIsNamed) {
    Fault f{&layer};
    f.kind = Kind::UncapturableCall;
    f.pass = GRAPHED_PASS_BACKWARD;
    graphed::Session s(named());
    s.add_callable(faulty(&f));
    expect_failure(s, {GRAPHED_STATUS_CAPTURE_INVALIDATED, GRAPHED_STATUS_CALLBACK_FAILED},
                   with(place("backward"), {"cudaMemcpy (a CUDA library call that cannot be captured)"}));
    expect_recapture(s, f);
}

TEST_P(CaptureFailures, TheSecondCallableIsNamedByIndex) {
    Fault f{&layer};
    kit::LinearLayer second = layer;
    second.name = "second";
    Fault g{&second};
    g.kind = Kind::Sync;
    g.pass = GRAPHED_PASS_BACKWARD;
    f.pass = 99;
    graphed::Session s(named());
    s.add_callable(faulty(&f));
    graphed::Callable c = faulty(&g);
    c.name = "second";
    s.add_callable(c);
    expect_failure(s, {GRAPHED_STATUS_CAPTURE_INVALIDATED},
                   with(place("capture of the backward pass of", "callable 'second' (index 1)"), {}));
}

TEST_P(CaptureFailures, TheMicrobatchOfAScheduleIsNamed) {
    // One chunk, two microbatches: F F B B.
    const std::vector<graphed_schedule_step> steps = {{GRAPHED_PASS_FORWARD, 0},
                                                      {GRAPHED_PASS_FORWARD, 0},
                                                      {GRAPHED_PASS_BACKWARD, 0},
                                                      {GRAPHED_PASS_BACKWARD, 0}};
    graphed_session_config c = named();
    c.schedule = steps.data();
    c.num_schedule_steps = steps.size();
    Fault f{&layer};
    f.mb = 1;
    graphed::Session s(c);
    s.add_callable(faulty(&f));
    expect_failure(s, {GRAPHED_STATUS_CALLBACK_FAILED},
                   {"the forward callback of callable 'fc' (index 0) in session 'faults', microbatch 1, no buckets",
                    "returned 42 during capture"});
}

TEST_P(CaptureFailures, AWarmupFailureIsNamed) {
    Fault f{&layer};
    f.phase = GRAPHED_PHASE_WARMUP;
    f.nth = 2;
    f.kind = Kind::CodeWithMessage;
    graphed::Session s(named());
    s.add_callable(faulty(&f));
    expect_failure(s, {GRAPHED_STATUS_CALLBACK_FAILED},
                   with(place("the forward callback of"), {"returned 13 during warmup: cublasSgemm"}));
    expect_recapture(s, f);
}

TEST_P(CaptureFailures, ACloneSlotCaptureIsNamed) {
    graphed_session_config c = named();
    c.clone_slots = 2;
    Fault f{&layer};
    f.kind = Kind::Sync;
    f.pass = GRAPHED_PASS_BACKWARD;
    f.nth = 3;  // the pass's own capture, slot 0's, then slot 1's
    graphed::Session s(c);
    s.add_callable(faulty(&f));
    expect_failure(s, {GRAPHED_STATUS_CAPTURE_INVALIDATED},
                   with(place("capture of the backward pass of"), {"no buckets, clone slot 1 was invalidated"}));
    expect_recapture(s, f);
}

TEST_P(CaptureFailures, AStepCaptureIsNamed) {
    Fault f{&layer};
    f.nth = 2;  // the pass's own capture, then the step's
    graphed::Session s(named());
    s.add_callable(faulty(&f));
    s.add_step({0}, {}, 2);
    // The step's first microbatch runs the forward: the fault strikes there.
    expect_failure(s, {GRAPHED_STATUS_CALLBACK_FAILED},
                   with(place("the forward callback of"),
                        {"in the capture of step 0 (its microbatch 0)", "returned 42 during capture"}));
}

// A bucketed probe: forward copies its input rows to its output.
struct Rows {
    kit::Device* dev = nullptr;
    int fail_bucket = -1;
    int64_t shape[2] = {16, 4};
    graphed::Callable callable() {
        graphed::Callable c;
        c.name = "rows";
        c.inputs = {graphed::tensor_desc(16 * 16)};
        c.outputs = {graphed::tensor_desc(16 * 16)};
        for (graphed_tensor_desc* t : {&c.inputs[0], &c.outputs[0]}) {
            t->ndim = 2;
            t->shape = shape;
            t->flags = GRAPHED_TENSOR_FLAGS_DYNAMIC;
        }
        c.forward = &Rows::forward;
        c.backward = [](const graphed_pass_ctx*, void*) -> int32_t { return 0; };
        c.user_data = this;
        c.buckets = {8, 16};
        return c;
    }
    static int32_t forward(const graphed_pass_ctx* ctx, void* self) {
        auto* r = static_cast<Rows*>(self);
        if (ctx->phase == GRAPHED_PHASE_CAPTURE && int(ctx->bucket) == r->fail_bucket)
            return r->dev->illegal(ctx->stream);
        return r->dev->copy(ctx->stream, ctx->outputs[0], ctx->inputs[0], size_t(ctx->bucket_size) * 16);
    }
};

TEST_P(CaptureFailures, TheBucketIsNamed) {
    Rows r{dev.get(), 1};
    graphed::Session s(named());
    s.add_callable(r.callable());
    expect_failure(s, {GRAPHED_STATUS_CAPTURE_INVALIDATED},
                   {"capture of the forward pass of callable 'rows' (index 0) in session 'faults', microbatch 0, "
                    "bucket 1 (16 rows) was invalidated",
                    "not allowed under capture"});
    r.fail_bucket = -1;
    s.capture();
    EXPECT_EQ(4u, s.stats().graph_count) << "two passes in two buckets";
}

TEST_P(CaptureFailures, TheCxxLayerThrowsTheSameMessage) {
    Fault f{&layer};
    f.kind = Kind::Sync;
    graphed::Session s(named());
    s.add_callable(faulty(&f));
    EXPECT_TRUE(throws(GRAPHED_STATUS_CAPTURE_INVALIDATED, [&] { s.capture(); },
                       with(place("capture of the forward pass of"), {"graphed_session_capture: "})));
    expect_nothing_held(s);
}

INSTANTIATE_TEST_SUITE_P(Backends, CaptureFailures, backends(), BackendName());

}  // namespace
