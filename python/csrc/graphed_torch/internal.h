// graphed for libtorch, inside: the types and functions the adapter's
// source files share. Private to the adapter (its API is graphed_torch.h);
// every call into graphed goes through graphed.hpp (graphed::Session,
// graphed::Ref, graphed::check), whose errors carry the library's message.
//
// The adapter's files, one concept each:
//   rng.cpp        PyTorch's CUDA generators, made graph-safe around captures and replays
//   streams.cpp    the work stream, the private pool routing, clones from PyTorch's allocator
//   tensors.cpp    tensor facts (Meta), tensors over static buffers and returned refs, fresh grads, leases
//   schedule.cpp   the pass order, shape and releases of buffer reuse (from graphed)
//   callbacks.cpp  graphed's callbacks and hooks: the forward and backward bodies
//   make.cpp       session setup, discovery, registration, capture
//   teardown.cpp   what a session lets go of (release of one callable, reset), the memory report
//   autograd.cpp   replays: GraphedCallable and its autograd node, GraphedBackward
//   step.cpp       a chain of callables with its loss as one step graph: its capture and replay
// What the files declare here: the tools (tools.h), the data model
// (model.h), and below, the functions one file defines for the others.
#pragma once

#include "model.h"

namespace graphed_torch {

// ---- what broke a callback (failure.cpp) -----------------------------------------------------

// While it lives, notes the torch operators an exception unwinds (on any
// thread; one watch at a time in the process: a watch made while another
// lives notes nothing); `report` names the innermost, where the caller's
// code issued it (set_failure_site) and the exception's first line.
class OperatorWatch {
  public:
    OperatorWatch();
    ~OperatorWatch();
    OperatorWatch(const OperatorWatch&) = delete;
    OperatorWatch& operator=(const OperatorWatch&) = delete;
    std::string report(const std::exception_ptr& e, const char* what) const;

  private:
    void* unwound_ = nullptr;
    uint64_t handle_ = 0;
};

// ---- graphed's callbacks (callbacks.cpp) -----------------------------------------------------

// `body` for a callback of `c`: an exception becomes a non-zero return, its
// message is kept for the capture error, and what broke it (the torch
// operator, the caller's line, the exception's first line) goes to graphed
// (graphed_callback_fail_message), which names it in the capture error.
int32_t guarded(Callable* c, const std::function<void()>& body);
int32_t pre_hook(const graphed_pass_ctx* ctx, void* self);
int32_t post_hook(const graphed_pass_ctx* ctx, void* self);
int32_t forward_cb(const graphed_pass_ctx* ctx, void* self);
int32_t backward_cb(const graphed_pass_ctx* ctx, void* self);
int32_t wgrad_cb(const graphed_pass_ctx* ctx, void* self);
int32_t session_hook(uint32_t when, void* self);

// ---- the step (step.cpp) ---------------------------------------------------------------------

// The forward and backward callbacks while the step's graph is captured
// (StepState::capturing): the chain carried from callable to callable.
int32_t step_forward(const graphed_pass_ctx* ctx, Callable* c);
int32_t step_backward(const graphed_pass_ctx* ctx, Callable* c);

// ---- session setup (make.cpp) ------------------------------------------------------------------

// Enters a session made and captured in the registry of live sessions
// (memory_report; teardown.cpp).
void enroll(const std::shared_ptr<Shared>& s);

// Sets up the session, discovers, registers and captures `specs`;
// `declare` runs between registration and capture (a step's declaration)
// and `captured` after a successful capture. Throws std::runtime_error
// with graphed's message and the callbacks' errors, the session reset.
std::shared_ptr<Shared> make_session(std::vector<CallableSpec> specs, const Options& o,
                                     const std::function<void(Shared&)>& declare,
                                     const std::function<void(Shared&)>& captured);

// The parameters of `c` where they are now, checked (check_params;
// autograd.cpp): `to` holds every parameter's address, for the replay of
// microbatch `mb` to give graphed, which points its graphs at those that
// moved; false when `c` has none. One the graphs cannot read as it is
// throws ParamMoved naming it.
bool params_now(const Shared& s, Callable& c, uint32_t mb, std::vector<const void*>& to);
// The parameters of `c` refreshed from the caller and checked against what
// its graphs read (shape, dtype, device, layout), their addresses aside:
// one that changed throws ParamMoved naming it.
void check_params(const Shared& s, Callable& c, uint32_t mb);

}  // namespace graphed_torch
