// graphed for libtorch: make_graphed_callables for functions of tensors
// (a module's forward), shared by the PyTorch extension and libtorch
// programs. Forward and backward run as libtorch ops inside graphed's
// callbacks, on graphed's capture stream, with PyTorch's caching allocator
// routed into a private pool during each capture (as at::cuda::CUDAGraph
// does); outputs and grads stay PyTorch tensors (graphed's external
// buffers), and replays plug into autograd through a custom Function, so
// `loss.backward()` and `param.grad` accumulation behave as in eager
// PyTorch. Parameter grads are returned as owned clones (memory from
// PyTorch's caching allocator) unless the caller opts out.
#pragma once

#include <ATen/ATen.h>
#include <graphed.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace graphed_torch {

// A function of tensors to graph: a module's forward.
using ForwardFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

struct CallableSpec {
    std::string name;
    ForwardFn forward;
    // Sample inputs (shape, dtype, requires_grad, and the data warmup uses).
    std::vector<at::Tensor> sample_inputs;
    // The parameters the forward uses; those with requires_grad get grads.
    std::vector<at::Tensor> params;
    // graphed_param_flags per parameter (e.g. DELAYED_WGRAD for
    // Transformer Engine's skip_backward_post_hook); empty: none.
    std::vector<uint32_t> param_flags;
};

struct Options {
    int num_warmup_iters = 3;
    // Parameter grads as owned clones (the default) or aliases of static
    // buffers that the next backward replay overwrites (opt-out).
    bool clone_param_grads_on_return = true;
    // Clones from PyTorch's caching allocator (counted by
    // torch.cuda.memory_allocated) instead of graphed's own pool.
    bool clones_from_torch_allocator = true;
    // Optional interleaved pipeline schedule (docs/pipeline.md): the steps
    // and the layers of each chunk (empty: split evenly). The callables are
    // the layers, in chunk order.
    std::vector<graphed_schedule_step> schedule;
    std::vector<uint32_t> layers_per_chunk;
    // Share memory between graphed's own static buffers (static inputs,
    // grad-outputs) whose lifetimes do not overlap; needs a schedule.
    bool reuse_buffers = false;
};

struct Shared;

// One graphed callable: call it like the function it replaces.
class GraphedCallable {
  public:
    GraphedCallable(std::shared_ptr<Shared> shared, size_t index, uint32_t microbatch = 0)
        : shared_(std::move(shared)), index_(index), microbatch_(microbatch) {}
    std::vector<at::Tensor> operator()(const std::vector<at::Tensor>& inputs) const;
    const std::vector<at::Tensor>& params() const;
    // The same callable's graphs for another microbatch of the schedule.
    GraphedCallable for_microbatch(uint32_t microbatch) const;
    uint32_t microbatches() const;
    // The session's memory and graph figures (graphed's accounting).
    graphed_session_stats stats() const;

  private:
    std::shared_ptr<Shared> shared_;
    size_t index_;
    uint32_t microbatch_;
};

// Warms up and captures every callable into one graphed session sharing
// one private memory pool; throws std::runtime_error with graphed's message.
// Returns the callables' graphs for microbatch 0 (for_microbatch gives the
// others).
std::vector<GraphedCallable> make_graphed_callables(std::vector<CallableSpec> specs, const Options& options = {});

}  // namespace graphed_torch
