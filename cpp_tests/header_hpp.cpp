// The C++ layer alone: graphed.hpp included first (so it must bring all it
// needs) and twice (the include guard must hold), compiled with warnings as
// errors (strict ones too, for users who build that way), and used once end to
// end on the host backend, so that every inline function is instantiated and
// linked.
#include "graphed.hpp"
#include "graphed.hpp"

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace {

int failures = 0;

void expect(bool ok, const char* what) {
    if (!ok) {
        std::fprintf(stderr, "FAILED: %s\n", what);
        ++failures;
    }
}

// A callable y = x (4 floats) whose parameter grad is the grad-output: a host
// task per pass, written as C callbacks through graphed::guard.
struct Copy {
    static void copy16(void* p) {
        void** a = static_cast<void**>(p);
        std::memcpy(a[0], a[1], 16);
    }
    void* fwd[2] = {nullptr, nullptr};
    void* bwd[2] = {nullptr, nullptr};
    static int32_t forward(const graphed_pass_ctx* ctx, void* self) {
        return graphed::guard([&] {
            Copy* c = static_cast<Copy*>(self);
            c->fwd[0] = ctx->outputs[0];
            c->fwd[1] = ctx->inputs[0];
            return graphed_host_enqueue(ctx->stream, &Copy::copy16, c->fwd);
        });
    }
    static int32_t backward(const graphed_pass_ctx* ctx, void* self) {
        return graphed::guard([&] {
            Copy* c = static_cast<Copy*>(self);
            void* scratch = graphed::scratch_alloc(*ctx, 64);
            graphed::scratch_free(*ctx, scratch);
            c->bwd[0] = ctx->param_grads[0];
            c->bwd[1] = ctx->grad_outputs[0];
            return graphed_host_enqueue(ctx->stream, &Copy::copy16, c->bwd);
        });
    }
};

}  // namespace

int main() {
    expect(std::string(graphed::version()) == GRAPHED_VERSION_STRING, "library and header versions agree");
    expect(graphed::backend_available(GRAPHED_BACKEND_HOST), "the host backend is available");
    expect(graphed::guard([]() -> int { throw std::runtime_error("x"); }) == graphed::kCallbackException,
           "guard turns an exception into a code");
    try {
        graphed::check(graphed_device_count(nullptr));
        expect(false, "check throws");
    } catch (const graphed::Error& e) {
        expect(e.status() == GRAPHED_STATUS_NULL_POINTER, "Error carries the status");
        expect(e.message().find("count_out") != std::string::npos, "Error carries the message");
        expect(std::string(e.what()).rfind("GRAPHED_STATUS_NULL_POINTER: ", 0) == 0, "what() names the status");
    }

    float in[4] = {1, 2, 3, 4}, w[4] = {0, 0, 0, 0}, gy[4] = {5, 6, 7, 8};
    Copy cb;
    graphed::Callable c;
    c.name = "copy";
    c.inputs.push_back(graphed::tensor_desc(sizeof in, GRAPHED_DTYPE_F32, false, in));
    c.outputs.push_back(graphed::tensor_desc(sizeof in, GRAPHED_DTYPE_F32, true));
    c.params.push_back(graphed::param_desc(w, sizeof w));
    c.forward = &Copy::forward;
    c.backward = &Copy::backward;
    c.user_data = &cb;
    try {
        graphed::Session s(graphed::session_config(GRAPHED_BACKEND_HOST));
        expect(s.add_callable(c) == 0, "the first callable is 0");
        s.capture();
        std::vector<graphed::Ref> out = s.forward(graphed::Replay(0));
        expect(out.size() == 1 && out[0].as<float>()[3] == 4.0f, "forward returns the output");
        graphed::Grads g = s.backward(graphed::Replay(0).data(gy));
        expect(g.params.size() == 1 && g.params[0].kind() == GRAPHED_REF_KIND_CLONE, "a CLONE grad");
        expect(g.params[0].as<float>()[0] == 5.0f, "the grad is the grad-output");
        expect(s.stats().clone_blocks_outstanding == 1, "one block outstanding");
        graphed::Buffer extra = g.params[0].owner().share();
        g = graphed::Grads();
        expect(s.stats().clone_blocks_outstanding == 1, "a shared reference keeps the block");
        extra.release();
        expect(s.stats().clone_blocks_outstanding == 0, "the last reference gives it back");
        expect(s.buffers(0, 0, GRAPHED_BUFFER_ROLE_INPUT).size() == 1, "one static input");
        expect(s.buffer_count(0, 0, GRAPHED_BUFFER_ROLE_PARAM_GRADS) == 1, "one parameter-grad buffer");
        expect(s.rebound(0, 0, GRAPHED_BUFFER_ROLE_GRAD_OUTPUT).size() == 1, "one grad-output");
        expect(s.param_policies(0).at(0) == GRAPHED_GRAD_POLICY_CLONE, "the policy is CLONE");
        expect(!s.plan_dump().empty(), "a plan");
        const std::string dot = s.export_dot();
        expect(dot.find("label=\"callable 'copy' (index 0), forward, microbatch 0, no buckets, main graph\"") !=
                   std::string::npos,
               "the graphs as DOT");
        std::vector<graphed_schedule_step> steps = graphed::schedule_from_te_order({1, 2, -2, -2.5, -1, -1.5});
        graphed::ScheduleShape shape = graphed::schedule_shape(steps, 2);
        expect(shape.chunks == 2 && shape.microbatches == 1 && shape.chunk_first.at(1) == 1, "the schedule's shape");
        std::vector<graphed_pass_ref> passes = graphed::schedule_passes(steps, 2);
        expect(passes.size() == 6 && passes.at(3).pass == GRAPHED_PASS_WGRAD, "weight-grad passes as scheduled");
        std::vector<graphed_release> rel = graphed::schedule_releases(steps, 2);
        expect(!rel.empty() && rel.front().after == 2 && rel.front().role == GRAPHED_BUFFER_ROLE_OUTPUT,
               "the first release: an output after its backward");
        expect(graphed::dtype_size(GRAPHED_DTYPE_BF16) == 2, "bf16 takes 2 bytes");
        s.destroy();
        expect(!s, "destroyed");
    } catch (const graphed::Error& e) {
        std::fprintf(stderr, "unexpected error: %s\n", e.what());
        return 1;
    }
    std::printf("graphed %s (graphed.hpp, C++%ld): %s\n", graphed::version(), static_cast<long>(__cplusplus / 100 % 100),
                failures ? "FAILED" : "ok");
    return failures ? 1 : 0;
}
