// graphed for libtorch: make_graphed_callables for functions of tensors (a
// module's forward), shared by the Python package (graphed.torch) and by
// libtorch programs. The adapter's sources are graphed_torch/*.cpp (its
// private header, graphed_torch/internal.h, says what lives where); they
// call graphed's C API through graphed.hpp.
//
// Forward and backward run as libtorch ops inside graphed's callbacks, on one
// long-lived work stream joined to graphed's capture stream, with PyTorch's
// caching allocator routed into a private pool during each capture (as
// at::cuda::CUDAGraph does) and PyTorch's CUDA generators made graph-safe
// around each capture and replay. Outputs and grads stay PyTorch tensors
// (graphed's external buffers); replays plug into autograd through a custom
// node, so `loss.backward()` and `param.grad` accumulation behave as in eager
// PyTorch. Parameter grads are owned clones unless the caller opts out.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/Generator.h>
#include <c10/cuda/CUDAStream.h>
#include <graphed.h>

#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace graphed_torch {

// A function of tensors to graph: a module's forward, flattened.
using ForwardFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

// Where a callable's parameters are now, asked at every call before the
// replay: it updates `params` (one per parameter, in registration order) to
// the tensors the module holds now, replacing an entry only where it is
// another tensor object (a parameter replaced, as load_state_dict(assign=True)
// does). Without one, the tensors registered stay the parameters (their
// data may still move: `p.data = t` keeps the object).
using ParamSource = std::function<void(std::vector<at::Tensor>& params)>;

enum class Pass : uint32_t { Forward = GRAPHED_PASS_FORWARD, Backward = GRAPHED_PASS_BACKWARD, Wgrad = GRAPHED_PASS_WGRAD };

// What a hook sees. Hooks run outside capture, before (`before`) and after
// every pass of warmup and capture, never during replay. Pointers are valid
// during the call only; NULL where the pass has no such tensors.
struct HookEvent {
    bool before = true;
    Pass pass = Pass::Forward;
    bool capture = false;  // false: an eager warmup pass
    uint32_t microbatch = 0;
    // Forward: the inputs the forward receives (before and after).
    const std::vector<at::Tensor>* inputs = nullptr;
    // Forward, after: what it returned.
    const std::vector<at::Tensor>* outputs = nullptr;
    // Backward (before and after): the grads of the outputs (undefined for
    // outputs without grad).
    const std::vector<at::Tensor>* grad_outputs = nullptr;
    // Backward, after: the grads of the inputs, then of the parameters
    // (undefined where none).
    const std::vector<at::Tensor>* grads = nullptr;
};
using Hook = std::function<void(const HookEvent&)>;

struct CallableSpec {
    std::string name;
    ForwardFn forward;
    // Sample inputs (shape, dtype, device, requires_grad, and the data warmup uses).
    std::vector<at::Tensor> sample_inputs;
    // Names used in messages ("input 0" when empty).
    std::vector<std::string> input_names;
    // The parameters the forward uses; those with requires_grad that get a
    // grad in the first warmup iteration get grads.
    std::vector<at::Tensor> params;
    std::vector<std::string> param_names;
    // graphed_param_flags per parameter (DELAYED_WGRAD for Transformer
    // Engine's skip_backward_post_hook); empty: none. Read once, here.
    std::vector<uint32_t> param_flags;
    // Optional: where the parameters are now (see ParamSource).
    ParamSource param_source;
    // Optional hook around every pass of this callable (Transformer
    // Engine's capture_time_hooks).
    Hook hook;
    // Buckets (optional): the sizes of the first dimension of the inputs
    // marked in `dynamic_inputs` (or of the dimension `dynamic_dims` names),
    // strictly ascending, the last one the samples'
    // (graphed_callable_desc.bucket_sizes). Each bucket is captured; a
    // call whose dynamic inputs have n rows (the same n for all) replays
    // the smallest bucket holding n, on the actual rows with the rest
    // zeroed, and returns n rows of each dynamic output (an output whose
    // dimension follows the bucket: capture learns which by running the
    // forward at a smaller size too). Inputs are copied (rebind_inputs
    // does not apply); outputs and grads are PyTorch tensors.
    std::vector<int64_t> bucket_sizes;
    std::vector<bool> dynamic_inputs;  // per sample input; empty: none
    // A grid (optional; graphed_callable_desc.bucket_sizes2): the sizes of
    // a second dimension; every pair (bucket_sizes[i], bucket_sizes2[j])
    // is a bucket, and a call runs the smallest of each holding its sizes.
    std::vector<int64_t> bucket_sizes2;
    // Per sample input (empty: 0 for the inputs marked in dynamic_inputs,
    // none for the others): the dimension that follows bucket_sizes, -1
    // for none (graphed_tensor_desc.dynamic_dim); and the one that follows
    // bucket_sizes2 (empty: none; dynamic_dim2). An input with either is
    // dynamic. Outputs and input grads of another dimension than the
    // first come back as strided views of the bucket's buffer (the
    // actual sizes, the bucket's pitch).
    std::vector<int64_t> dynamic_dims, dynamic_dims2;
};

struct Options {
    // Eager iterations before capture. The first one is run by the adapter
    // itself, to learn the outputs and which inputs and parameters get
    // grads; one runs even when this is 0.
    int num_warmup_iters = 3;
    // False: graph forwards only (modules in eval mode): no grads.
    bool training = true;
    // False: an input that requires grad but gets none is an error.
    bool allow_unused_input = false;
    // Keep the autograd graph of each capture's forward after its backward.
    bool retain_graph_in_backward = false;
    // Parameter grads as owned clones (the default) or aliases of static
    // buffers that the next backward replay overwrites (opt-out).
    bool clone_param_grads_on_return = true;
    // Clones from PyTorch's caching allocator (counted by
    // torch.cuda.memory_allocated) instead of graphed's own pool.
    bool clones_from_torch_allocator = true;
    // With clone_param_grads_on_return: every replay of the pass that
    // writes the parameter grads writes them straight into fresh memory of
    // PyTorch's caching allocator (GRAPHED_PARAM_FLAGS_REBIND_GRAD, where
    // capture verified it; graphed copies them there where it did not), and
    // autograd gets those tensors: owned grads without a copy, never
    // written by a later replay and never moved. On by default; False:
    // graphed copies every grad into a clone at every backward. In force
    // in training with clones from PyTorch's allocator, where grads go to
    // autograd (not with accumulate_into, nor in a step) and without
    // buffer reuse; elsewhere grads are copied at every backward.
    bool lazy_clones = true;
    // A replay that would overwrite an alias still held (an output, an input
    // grad, an aliased parameter grad) throws AliasHeld instead.
    bool strict_leases = false;
    // Debug mode (graphed_session_config.debug; also on with GRAPHED_DEBUG=1
    // in the environment): every replay runs pass by pass, checking for a
    // device error after each, so that an error names the callable and
    // pass that surfaced it. Slower; off by default.
    bool debug = false;
    // On by default: inputs and incoming grads read where they are instead of copied into
    // static buffers, where capture verifies that the graphs can be pointed
    // at them (GRAPHED_TENSOR_FLAGS_REBIND); not for callables with a
    // delayed weight-grad pass. A rebound input is kept alive until the
    // backward, and modifying it in place before then is an error.
    bool rebind_inputs = true;
    // On by default: parameters are registered with
    // GRAPHED_PARAM_FLAGS_REBIND, so that capture verifies that the graphs
    // can be pointed elsewhere, and a call that finds a parameter at
    // another address (same shape, dtype, device and layout) points them
    // there. Off, or where capture refused it, a moved parameter throws
    // ParamMoved. Either way every call compares each parameter's address,
    // shape, dtype, device and layout with what the graphs read, and a
    // parameter the graphs cannot read as it is throws ParamMoved.
    bool rebind_params = true;
    // Optional interleaved pipeline schedule (docs/pipeline.md), and the
    // layers of each chunk (empty: split evenly). The callables are the
    // layers, in chunk order. Chunks with weight-grad steps get delayed
    // weight-gradient graphs (backward_dw).
    std::vector<graphed_schedule_step> schedule;
    std::vector<uint32_t> layers_per_chunk;
    // Share memory between buffers whose lifetimes do not overlap (needs a
    // schedule): graphed's own static buffers by its planner, and outputs,
    // input grads and cloned parameter grads released once consumed, when
    // graphed says (reuse_releases).
    bool reuse_buffers = false;
    // Non-empty: parameter grads are added by the backward (or weight-grad)
    // graph into the tensor that attribute of each parameter holds ("grad",
    // or "main_grad" as Megatron names it), looked up at every forward
    // (GRAPHED_GRAD_POLICY_ACCUMULATE_INTO), and autograd gets none.
    std::string accumulate_into;
    // With accumulate_into: the grads replace what the attribute holds
    // (GRAPHED_GRAD_POLICY_COPY_INTO) instead of being added to it.
    bool copy_into = false;
    // PyTorch graph memory pool to capture into (shared with other captures
    // that name it); default: a new one.
    std::optional<c10::MempoolId_t> pool;
    // Stream the passes run on during warmup and capture (default: one per
    // device for the process, so cuBLAS keeps one workspace for it).
    std::optional<c10::cuda::CUDAStream> capture_stream;
    // CUDA generators, besides the device's default one, whose random
    // numbers are drawn graph-safely (fresh at every replay).
    std::vector<at::Generator> generators;
    // Called once before the first warmup iteration and once after the last.
    std::function<void()> pre_warmup_hook;
    std::function<void()> post_warmup_hook;
};

// A replay would overwrite an alias still held (strict leases). The message
// names the callable, the slot and the tensors of it still alive.
class AliasHeld : public std::runtime_error {
  public:
    using std::runtime_error::runtime_error;
};

// A parameter is no longer where or what the graphs read: it moved where
// they cannot follow (rebind_params off, refused at capture, or less
// aligned), or it changed shape, dtype, device or layout, or it is gone.
// The message names the callable, the parameter (its qualified name) and,
// for a move, both addresses. Nothing was replayed.
class ParamMoved : public std::runtime_error {
  public:
    using std::runtime_error::runtime_error;
};

// Where a replay runs. Default: the current stream. With `stream` (another
// stream), the replay runs there after it waited for the current stream; the
// current stream then waits for the whole replay, or, for a forward given
// `join_event`, only for that event (Transformer Engine's cuda_graph_stream
// and cuda_graph_event).
struct ReplayOn {
    std::optional<c10::cuda::CUDAStream> stream;
    cudaEvent_t join_event = nullptr;
    // With Options::accumulate_into: the tensor parameter `p`'s grad is
    // added into (the attribute of `p` that option names, created where
    // that is how it works), looked up at every forward. Called for the
    // parameters whose grads graphed accumulates, the current ones.
    std::function<at::Tensor(const at::Tensor& p)> accumulate_dst;
};

struct Shared;

// One graphed callable (one microbatch of it, with a schedule): call it like
// the function it replaces.
class GraphedCallable {
  public:
    GraphedCallable(std::shared_ptr<Shared> shared, size_t index, uint32_t microbatch = 0)
        : shared_(std::move(shared)), index_(index), microbatch_(microbatch) {}
    // Checks `inputs` against the samples (count, shape, dtype, device,
    // requires_grad: std::invalid_argument naming the input and both values;
    // with buckets, the first dimension of the dynamic inputs is the call's
    // size, 1 to the largest bucket, the same for all of them)
    // and the parameters against what the graphs read (ParamMoved; a moved
    // one is followed where capture verified it can be), replays the
    // forward graph and returns the outputs (aliases of static buffers),
    // wired into autograd with the current parameters as its inputs.
    std::vector<at::Tensor> operator()(const std::vector<at::Tensor>& inputs, const ReplayOn& on = {}) const;
    // Replays the delayed weight-gradient graph of this microbatch and
    // accumulates the parameter grads into `param.grad`; a no-op for
    // callables without one.
    void backward_dw() const;
    bool has_backward_dw() const;
    // Frees the session's graphs and buffers (every callable of the same
    // make_graphed_callables call). Idempotent; replays then throw.
    void reset() const;
    bool is_reset() const;
    // Releases this callable alone (every microbatch of it), as Transformer
    // Engine's reset() of one callable does: its graphs, graphed's static
    // buffers only it uses, and the PyTorch tensors the adapter keeps for
    // it are freed, while the other callables keep replaying. Its calls
    // then throw; owned grads it returned stay valid, outputs and input
    // grads it returned must no longer be used. Idempotent. The last
    // callable released resets the session.
    void release() const;
    bool is_released() const;
    // The parameters as the last call found them.
    const std::vector<at::Tensor>& params() const;
    // Options::accumulate_into of its session ("" when grads are returned).
    const std::string& accumulate_into() const;
    // Per parameter: whether a call may find it at another address (its
    // graphs follow it) or would throw ParamMoved (graphed_session_params_movable).
    std::vector<bool> params_movable() const;
    // The name of input i in messages.
    std::string input_name(size_t i) const;
    // Its bucket sizes (empty: one shape), and a grid's second sizes
    // (empty: none).
    const std::vector<int64_t>& bucket_sizes() const;
    const std::vector<int64_t>& bucket_sizes2() const;
    // The same callable's graphs for another microbatch of the schedule.
    GraphedCallable for_microbatch(uint32_t microbatch) const;
    uint32_t microbatches() const;
    // The session's memory and graph figures (graphed's accounting).
    graphed_session_stats stats() const;
    // graphed's plan of the session's static buffers and inputs, as text.
    std::string plan() const;
    // The session's captured graphs as Graphviz DOT text
    // (graphed_session_export_dot): a cluster per graph, labelled by
    // callable, pass, microbatch and bucket, its nodes by kind and kernel.
    // Empty after a reset.
    std::string export_dot() const;
    // Whether the session's owned grads are written into fresh memory at
    // each replay (Options::lazy_clones in force); stats() counts those
    // written there straight (grads_in_place) and those copied there
    // (grads_in_place_refused).
    bool lazy_clones() const;

  private:
    std::shared_ptr<Shared> shared_;
    size_t index_;
    uint32_t microbatch_;
};

// What graphed holds for one callable (graphed_session_callable_memory),
// and the PyTorch tensors the adapter keeps for it.
struct CallableMemory {
    std::string name;
    bool released = false;
    // graphed's static buffers: its own allocation, and its share of the
    // allocation callables share (chained and reused buffers).
    uint64_t own_static_bytes = 0, shared_static_bytes = 0;
    // Graph executables of its instances, and of the steps that include it.
    uint32_t graphs = 0, step_graphs = 0;
    // Returned clone blocks of graphed's memory not yet released, and
    // released ones kept for reuse.
    uint64_t clone_bytes_outstanding = 0, clone_bytes_cached = 0;
    // PyTorch tensors its graphs write that the adapter keeps while they
    // exist: outputs, input and parameter grads provided at capture, and
    // the memory its passes' random numbers are drawn from (not what a
    // forward saves for its backward, which lives in the private pool
    // unseen: torch_pool_allocated counts it).
    uint64_t torch_bytes = 0;
};

// One session (a make_graphed_callables or make_graphed_step call).
struct SessionMemory {
    bool reset = false;
    // A call was inside the session when asked (a replay on another
    // thread): graphed's figures are left at 0.
    bool busy = false;
    std::vector<CallableMemory> callables;
    // graphed_session_stats: static buffers, scratch, the scratch pool.
    uint64_t static_bytes = 0, scratch_bytes = 0, pool_bytes = 0;
    uint32_t graphs = 0;
    // PyTorch's private pool the session captured into: its segments
    // (reserved from the driver) and the blocks in use in them. Shared
    // with other captures when the caller gave a pool.
    uint64_t torch_pool_reserved = 0, torch_pool_allocated = 0;
};

// What graphed holds in this process: every live session this adapter
// made, and graphed's own process-wide accounting (graphed_memory_stats:
// device bytes it allocated, allocations, sessions, graph executables).
struct MemoryReport {
    std::vector<SessionMemory> sessions;
    graphed_memory_stats graphed;
};
MemoryReport memory_report();
// Every live session's graphs as DOT text (GraphedCallable::export_dot),
// one digraph per session, in the order they were made; sessions busy
// with a call on another thread, or reset, are left out (a comment says so).
std::string export_dot();

// What broke a callback, for capture errors (docs/pytorch.md, "When a
// capture fails"): every callback runs under a watch of torch's operators,
// and an exception it raises reaches graphed as "torch operator
// aten::_local_scalar_dense (called by aten::item) at model.py:12 in
// forward: y.item(): CUDA error: ...", which graphed's message carries
// after the callable, pass, microbatch and bucket. `FailureSite` finds
// where the caller's code issued what raised `e` ("file:line in function:
// source"; "" when unknown): the Python extension sets one that reads the
// traceback. failure_report runs `body` under the same watch and returns
// the report of the exception it raised ("" when it returned).
using FailureSite = std::string (*)(const std::exception_ptr& e);
void set_failure_site(FailureSite finder);
std::string failure_report(const std::function<void()>& body);

// Warms up and captures every callable into one graphed session sharing one
// private memory pool; throws std::runtime_error with graphed's message (and
// the callbacks' errors). Returns the callables' graphs for microbatch 0
// (for_microbatch gives the others).
std::vector<GraphedCallable> make_graphed_callables(std::vector<CallableSpec> specs, const Options& options = {});

// ---- a training step in one launch ---------------------------------------------------------
//
// A chain of callables with its loss captured as one graph (graphed's
// step): callable k+1's first inputs are callable k's outputs, all of
// them, in order; the last callable is the loss (one output, its backward
// seeded with ones). Every other input is data, copied in per microbatch.
// One replay runs the forward and backward of every microbatch in turn
// and adds each parameter's grad into the tensor Options::accumulate_into
// (with Options::copy_into: sets it to the step's sum of grads)
// names (required), as eager accumulation would.
// What a step's update callback receives, under the step's capture.
struct StepUpdateView {
    uint32_t slot = 0;  // the clone slot whose graph is captured (0: the step's one graph)
    // Per parameter of the step's callables, in order: its grad (summed
    // over the microbatches) where the step put it; undefined for a
    // parameter without a grad.
    std::vector<at::Tensor> grads;
    // The scalar block (uint8, StepOptions::scalar_bytes), where the update
    // reads what each replay copied in; undefined without one.
    at::Tensor scalars;
    // The check phase: the skip flag (int32, one element, zeroed before the
    // check at each replay); non-zero skips the apply phase on the device.
    at::Tensor skip_flag;
};

// What GraphedStep::skipped answers.
struct StepSkipped {
    bool last = false;    // the last replay skipped its update
    uint64_t total = 0;   // replays that did, since capture
};

struct StepOptions {
    // Microbatches per replay (at most GRAPHED_STEP_MAX_MICROBATCHES).
    uint32_t microbatches = 1;
    // False: every microbatch captured (unrolled); true: one microbatch in
    // a conditional WHILE node, a replay running 1 to `microbatches` (each
    // iteration drawing its own random numbers, as eager's microbatches:
    // it first moves the generators' offsets on by one microbatch's draws).
    bool loop = false;
    // Where parameter p's grad is added (the attribute accumulate_into
    // names), asked once per parameter at capture: the step's graph adds
    // into that tensor at every replay.
    std::function<at::Tensor(const at::Tensor& p)> destination;
    // The update stage (optional; graphed's update_check and update_apply):
    // the optimizer, run once per phase under the step's capture, after the
    // last microbatch's backward, never eagerly; replays run what it
    // enqueued. It runs on the capturing stream (current for PyTorch, its
    // allocations routed to the private pool), and may enqueue kernels only
    // (no synchronisation; the apply phase of a step with a check is the
    // body of a conditional IF node). `update_check`, optional, writes the
    // skip flag; `update_apply` updates the parameters.
    std::function<void(const StepUpdateView&)> update_check, update_apply;
    // Bytes of the step's device scalar block (learning rates) the update
    // reads (StepUpdateView::scalars); each replay may give new values.
    size_t scalar_bytes = 0;
    // What the loss's backward is seeded with (a loss scale: a one-element
    // tensor on the device, read when the graph runs); undefined: ones.
    at::Tensor loss_seed;
};

class GraphedStep {
  public:
    explicit GraphedStep(std::shared_ptr<Shared> shared) : shared_(std::move(shared)) {}
    // Runs `n` microbatches (0: all the step holds; a looped step any count
    // from 1 to that, an unrolled one only its own): `data` holds each data
    // input (callable order, the chained ones left out) as one tensor of
    // shape [n, *sample shape] (or the sample's shape when the step holds
    // one microbatch), of the sample's dtype, on its device. Returns each
    // microbatch's loss, shape [n] (a copy). Parameters that moved are
    // followed where capture verified it, else ParamMoved; nothing is
    // enqueued when a check fails.
    // `scalars` (host memory, StepOptions::scalar_bytes of it; NULL: keep
    // what the block holds): the update's scalars for this replay.
    at::Tensor operator()(const std::vector<at::Tensor>& data, uint32_t n = 0, const void* scalars = nullptr,
                          size_t scalar_bytes = 0) const;
    // With an update check: whether the last replay skipped its update, and
    // how many replays did since capture (waits for the last replay).
    StepSkipped skipped() const;
    // The grad destinations, one per parameter of the step's callables in
    // order (undefined for parameters without a grad).
    std::vector<at::Tensor> destinations() const;
    uint32_t microbatches() const;

  private:
    std::shared_ptr<Shared> shared_;
};

// make_graphed_callables for a step: the callables are captured as usual
// (each still callable on its own) and, once more, as one step.
std::pair<std::vector<GraphedCallable>, GraphedStep> make_graphed_step(std::vector<CallableSpec> specs,
                                                                        const Options& options,
                                                                        const StepOptions& step);

// The passes of one iteration in warmup and capture order: (callable,
// microbatch, pass), as graphed derives them (graphed_schedule_passes); the
// callables of chunks with weight-grad steps have weight-grad passes.
// Throws std::invalid_argument with graphed's message for a schedule that
// breaks one of its rules.
struct PassRef {
    uint32_t callable;
    uint32_t microbatch;
    Pass pass;
};
std::vector<PassRef> pass_order(size_t num_callables, const std::vector<graphed_schedule_step>& schedule,
                                const std::vector<uint32_t>& layers_per_chunk);

// With buffer reuse: what each captured pass lets go of, as graphed says
// (graphed_schedule_releases, Transformer Engine's reuse rules): after a
// backward, its outputs and its cloned parameter grads (after the
// weight-grad pass instead, when there is one); an input grad once the
// layer before it took it, a chunk's first layer's once the next backward
// step has run and the previous chunk took it.
struct Release {
    uint32_t callable;
    uint32_t microbatch;
    uint32_t role;  // GRAPHED_BUFFER_ROLE_OUTPUT, _GRAD_INPUT or _PARAM_GRADS (those a replay copies out)
};
// One list per entry of pass_order(num_callables, schedule, layers_per_chunk).
std::vector<std::vector<Release>> reuse_releases(size_t num_callables, const std::vector<graphed_schedule_step>& schedule,
                                                 const std::vector<uint32_t>& layers_per_chunk);

// A pipeline schedule in Transformer Engine's `_order` notation (c: the
// forward of chunk c, counted from 1; -c: its backward; -c - 0.5: its
// weight-grad), as graphed reads it for `num_callables` callables split
// over the chunks per `layers_per_chunk` (empty: evenly): its steps, its
// microbatches and the layers of each chunk (graphed_schedule_from_te_order,
// graphed_schedule_shape). Throws std::invalid_argument with graphed's
// message for a schedule that breaks one of its rules.
struct Schedule {
    std::vector<graphed_schedule_step> steps;
    uint32_t microbatches = 0;
    std::vector<uint32_t> layers_per_chunk;  // per chunk
    std::vector<uint32_t> chunk_first;       // the first callable of each chunk
};
Schedule schedule_from_te_order(const std::vector<double>& order, size_t num_callables,
                                const std::vector<uint32_t>& layers_per_chunk = {});

// The loaded graphed library's version, and the header's.
std::string library_version();
std::string header_version();

}  // namespace graphed_torch
