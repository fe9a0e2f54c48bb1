// graphed for libtorch, inside: the tools the adapter's steps share — the
// torch versions it builds against, tensor facts and wrapping
// (tensors.cpp), graph-safe CUDA generators (rng.cpp), the work stream and
// the private pool (streams.cpp), the schedule's plan (schedule.cpp).
// Private to the adapter; included through internal.h.
#pragma once


#include "graphed_torch.h"

#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <cuda_runtime_api.h>
#include <graphed.hpp>
#include <torch/headeronly/version.h>

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

// ---- the PyTorch versions built against ------------------------------------------------------
//
// The adapter builds on torch 2.11 through 2.15 (python/README.md). Where a
// part of libtorch it needs changed shape between them and no public API
// covers both, the code picks by version, with these names only:
//   GRAPHED_TORCH_CAPTURE_IDS  torch >= 2.12: a CUDA generator keeps the
//                              fields of each capture under that capture's id
//   GRAPHED_TORCH_INTRUSIVE_NODES  torch >= 2.13: autograd nodes are held by
//                              c10::intrusive_ptr (before: std::shared_ptr
//                              with torch::autograd::deleteNode)
#define GRAPHED_TORCH_AT_LEAST(major, minor) \
    (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))
#if !GRAPHED_TORCH_AT_LEAST(2, 11)
#error "graphed.torch builds on torch 2.11 or newer (python/README.md)"
#endif
#define GRAPHED_TORCH_CAPTURE_IDS GRAPHED_TORCH_AT_LEAST(2, 12)
#define GRAPHED_TORCH_INTRUSIVE_NODES GRAPHED_TORCH_AT_LEAST(2, 13)

namespace graphed_torch {

inline void cuda_check(cudaError_t e, const char* what) {
    if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

// ---- undoing in stages ----------------------------------------------------------------------

// Runs stages of an undo, each also when an earlier one raised, keeping the
// first error (`what`, empty: none): a failed capture leaves CUDA calls on
// its stream failing, and what follows must still be returned.
struct FirstError {
    std::string what;
    void run(const std::function<void()>& stage) {
        try {
            stage();
        } catch (const std::exception& e) {
            if (what.empty()) what = e.what();
        }
    }
};

// ---- tensors (tensors.cpp) ---------------------------------------------------------------

struct Meta {
    std::vector<int64_t> sizes;
    at::ScalarType dtype = at::kFloat;
    bool requires_grad = false;
    // Outputs keep the layout eager gave them (a transposed attention
    // output, channels_last), so that *_like and strided kernels see what
    // eager code sees; empty: contiguous. Always dense: numel elements.
    std::vector<int64_t> strides;
    size_t bytes() const {
        size_t n = 1;
        for (int64_t d : sizes) n *= size_t(d);
        return n * c10::elementSize(dtype);
    }
};

Meta meta_of(const at::Tensor& t);
// An output's meta: its strides too when it is dense but not contiguous.
Meta layout_of(const at::Tensor& t);
// `t` in the layout of `m` (itself when it already is, else a copy).
at::Tensor in_layout(const at::Tensor& t, const Meta& m);
// A tensor of layout `m` over memory graphed owns; `deleter` runs when it dies.
at::Tensor over(void* ptr, const Meta& m, const at::TensorOptions& options,
                std::function<void(void*)> deleter = [](void*) {});
at::TensorOptions options_of(at::ScalarType dtype, c10::DeviceIndex device);
// "shape [2, 3], Float, cuda:0, requires_grad=False", for messages.
std::string describe(at::IntArrayRef sizes, at::ScalarType dtype, const std::string& device, bool requires_grad);
std::string describe(const at::Tensor& t);
// graphed's dtype code; types graphed has no code for travel as bytes (U8,
// no shape): graphed only copies them. `*exact` says which.
uint32_t dtype_code(at::ScalarType t, bool* exact);
// Tensors over the static buffers a callback receives (undefined where a
// pointer is NULL), requiring grad per `metas` when `with_grad`.
std::vector<at::Tensor> wrap_static(void* const* ptrs, const std::vector<Meta>& metas, c10::DeviceIndex device,
                                    bool with_grad);
// A tensor over one CLONE grad a replay returned (of a parameter of
// meta `m`); it holds the clone block's reference (taken from `r`) until
// it dies.
at::Tensor wrap_clone(graphed::Ref& r, const Meta& m, c10::DeviceIndex device);
// "0x7f3a...", as graphed writes addresses in its messages.
std::string hex(const void* p);
// "shape [2, 3], Float, cuda:0, contiguous" (or "strides [...]"), for messages.
std::string layout_text(const at::Tensor& t);
std::string layout_text(const Meta& m, const std::string& device);

// ---- PyTorch's CUDA generators, made graph-safe (rng.cpp) -------------------------------------

struct RngStates {
    struct Entry {
        at::Generator generator;
        c10::intrusive_ptr<at::CUDAGeneratorState> state;
    };
    std::vector<Entry> entries;

    // What one captured pass draws: per state, the increment, and the device
    // memory its kernels read seed and offset from ([seed, offset] per state).
    struct PassDraws {
        at::Tensor device;
        std::vector<uint64_t> increments;
    };
    std::vector<PassDraws> passes;  // by pass key; empty device: draws nothing

    // What begin() changed, put back by restore(). torch up to 2.11 keeps one
    // capture's fields in the state itself (saved here and set); torch 2.12
    // and later key a capture's fields by its capture id (`drawing`, entered
    // under that id once the capture has begun, then removed).
    struct Saved {
        bool capturing;
        uint64_t intragraph;
        at::TensorBase seed, offset;
    };
    std::vector<Saved> saved;
#if GRAPHED_TORCH_CAPTURE_IDS
    std::vector<c10::intrusive_ptr<at::CUDAGeneratorCaptureState>> drawing;
#endif
    unsigned long long capture_id = 0;
    bool entered = false;
    at::Tensor open_device;
    bool open = false;

    // Draws graph-safely from `g` too (a CUDA generator of `device`).
    void add(const at::Generator& g, c10::DeviceIndex device);
    // Before a capture (outside it): every state draws from this pass's memory.
    void begin(c10::DeviceIndex device);
    // Inside the capture on `stream`, before the pass's first op (where the
    // state is keyed by capture id, the id is known only now). Idempotent.
    void enter(cudaStream_t stream);
    // After the capture: records what pass `key` drew and restores the states.
    void end(size_t key);
    // Before a replay of pass `key` on `stream`: the generators' seeds and
    // offsets go to the pass's memory and the generators advance by what it
    // draws, so that every replay draws fresh numbers. A graph that runs
    // the captured pass `times` times in a loop whose every iteration first
    // moves the offsets in that memory on by one pass's draws (`looped`):
    // the offsets written are one pass's draws back, and the generators
    // advance by `times` passes' draws.
    void prologue(size_t key, cudaStream_t stream, uint32_t times = 1, bool looped = false);
    // Undoes the advance of prologue(key, ..., times) for a replay refused
    // before it enqueued anything (the state memory it wrote is read by
    // nothing).
    void unwind(size_t key, uint32_t times = 1);
    // Restores every state left open by a failed capture.
    void abandon();

  private:
    std::vector<uint64_t> restore();
};

// The key of one captured pass of one (callable, microbatch) instance.
inline size_t pass_key(size_t instance, Pass p) { return instance * 3 + uint32_t(p); }

// ---- streams and pools (streams.cpp) ---------------------------------------------------------

// One stream per device for every session's warmup and capture.
c10::cuda::CUDAStream default_work_stream(c10::DeviceIndex device);

// The blocks PyTorch's caching allocator hands out and frees on one device
// while a grad pass is captured. A grad whose memory none of them overlaps
// but its own allocation is the grad's alone during the pass: the pass's
// graph can be pointed elsewhere for it (GRAPHED_PARAM_FLAGS_REBIND_GRAD)
// without taking another tensor's references (a temporary the pool gave
// the same memory earlier in the pass) along.
struct Watched {
    uintptr_t addr;
    size_t size;
    bool alloc;  // handed out (else freed)
};
// Starts recording for `owner` on `device`; false when another capture
// records (then nothing is, and every grad counts as shared).
bool watch_allocations(const void* owner, c10::DeviceIndex device);
// Stops `owner`'s recording (if it is the one) and returns what it saw.
std::vector<Watched> watched_allocations(const void* owner);
// Whether [p, p + bytes) overlaps nothing in `seen` but its own allocation
// of exactly those bytes, handed out once while `seen` was recorded.
bool alone(const std::vector<Watched>& seen, const void* p, size_t bytes);
// graphed's clone allocator over PyTorch's caching allocator (ctx: the Shared).
int32_t torch_alloc(void* ctx, size_t bytes, graphed_stream, void** out);
void torch_free(void*, void* ptr, size_t, graphed_stream);

// ---- the schedule (schedule.cpp) -------------------------------------------------------------

// What make_graphed_callables needs of a schedule, from graphed: the passes
// in warmup and capture order, the microbatch count, which callables have a
// weight-grad pass (those graphed gives one), and the shape (empty without
// a schedule).
struct SchedulePlan {
    std::vector<PassRef> order;
    uint32_t microbatches = 1;
    std::vector<uint32_t> has_wgrad;  // per callable, 0 or 1
    graphed::ScheduleShape shape;
};
// Throws std::invalid_argument with graphed's message for a schedule that
// breaks one of its rules.
SchedulePlan plan_schedule(size_t num_callables, const std::vector<graphed_schedule_step>& schedule,
                           const std::vector<uint32_t>& layers_per_chunk);

}  // namespace graphed_torch
