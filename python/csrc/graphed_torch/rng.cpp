// graphed for libtorch: PyTorch's CUDA generators, made graph-safe around
// graphed's captures and replays (RngStates).
//
// Under stream capture, CUDAGeneratorImpl::philox_cuda_state hands kernels
// pointers to a seed and an offset in device memory plus an offset inside
// the graph, and adds each op's increment to that intra-graph offset.
// torch's CUDAGraph sets these up around its own captures and, at each
// replay, writes the generator's current seed and offset to that memory and
// advances the offset by the graph's total. graphed captures with its own
// stream capture, which no torch CUDAGraph owns, so the adapter does the
// same around graphed's captures and replays, with device memory of its own
// per captured pass. No public API reaches a capture that torch's CUDAGraph
// does not own, so the adapter sets the generator state's public fields
// (its methods are not exported from libtorch_cuda). Their shape changed once:
//   torch 2.11:  one capture at a time, in the state itself (capturing_,
//                seed_extragraph_, offset_extragraph_, offset_intragraph_):
//                set before the capture, put back after it.
//   torch 2.12+: a CUDAGeneratorCaptureState per capture id in the state's
//                capture_states_ (without one, torch looks for the CUDAGraph
//                that owns the capture and fails): entered under the
//                capture's id once it has begun (enter()), removed after it.
// The generator keeps its state object in a private member, and no public
// accessor returns it; the explicit instantiation below is the
// standard-conforming way to name it.
#include "internal.h"

#include <c10/cuda/CUDAFunctions.h>

#include <algorithm>

namespace graphed_torch {

namespace {

template <typename Tag, typename Tag::type M>
struct Expose {
    friend typename Tag::type member(Tag) { return M; }
};
struct GeneratorStateMember {
    using type = c10::intrusive_ptr<at::CUDAGeneratorState> at::CUDAGeneratorImpl::*;
    friend type member(GeneratorStateMember);
};
template struct Expose<GeneratorStateMember, &at::CUDAGeneratorImpl::state_>;

c10::intrusive_ptr<at::CUDAGeneratorState> state_of(const at::Generator& g) {
    return g.get<at::CUDAGeneratorImpl>()->*member(GeneratorStateMember{});
}

}  // namespace

void RngStates::add(const at::Generator& g, c10::DeviceIndex device) {
    if (!g.defined()) return;
    if (g.device().type() != at::kCUDA)
        throw std::invalid_argument("generators: " + g.device().str() + " is not a CUDA generator");
    // A generator made for "cuda" has no index: it is the current device's.
    const c10::DeviceIndex index = g.device().has_index() ? g.device().index() : c10::cuda::current_device();
    if (index != device)
        throw std::invalid_argument("generators: a generator of cuda:" + std::to_string(index) +
                                    " cannot draw inside graphs of cuda:" + std::to_string(device));
    auto s = state_of(g);
    for (const Entry& e : entries)
        if (e.state.get() == s.get()) return;
    entries.push_back({g, std::move(s)});
}

void RngStates::begin(c10::DeviceIndex device) {
    if (entries.empty() || open) return;
    open_device = at::empty({int64_t(2 * entries.size())}, options_of(at::kLong, device));
#if GRAPHED_TORCH_CAPTURE_IDS
    drawing.clear();
    for (size_t i = 0; i < entries.size(); ++i) {
        auto d = c10::make_intrusive<at::CUDAGeneratorCaptureState>();
        d->rng_state_seed_extragraph_ = open_device.narrow(0, int64_t(2 * i), 1);
        d->rng_state_offset_extragraph_ = open_device.narrow(0, int64_t(2 * i + 1), 1);
        d->offset_intragraph_ = 0;
        drawing.push_back(std::move(d));
    }
    entered = false;
#else
    saved.clear();
    for (size_t i = 0; i < entries.size(); ++i) {
        at::CUDAGeneratorState* s = entries[i].state.get();
        saved.push_back({s->capturing_, uint64_t(s->offset_intragraph_), s->seed_extragraph_, s->offset_extragraph_});
        s->seed_extragraph_ = open_device.narrow(0, int64_t(2 * i), 1);
        s->offset_extragraph_ = open_device.narrow(0, int64_t(2 * i + 1), 1);
        s->offset_intragraph_ = 0;
        s->capturing_ = true;
    }
#endif
    open = true;
}

void RngStates::enter(cudaStream_t stream) {
#if GRAPHED_TORCH_CAPTURE_IDS
    if (!open || entered) return;
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    unsigned long long id = 0;
    cuda_check(cudaStreamGetCaptureInfo(stream, &status, &id), "cudaStreamGetCaptureInfo");
    if (status != cudaStreamCaptureStatusActive)
        throw std::runtime_error(std::string("graphed: the pass's stream is ") +
                                 (status == cudaStreamCaptureStatusInvalidated ? "in an invalidated capture"
                                                                               : "not capturing") +
                                 " where its generators were to draw");
    const auto key = at::CaptureId_t(id);
    // Set first: whatever this loop entered, restore() (or abandon())
    // removes, also when it stops halfway.
    capture_id = id;
    entered = true;
    for (size_t i = 0; i < entries.size(); ++i) {
        at::CUDAGeneratorState* s = entries[i].state.get();
        std::lock_guard<std::mutex> lock(s->capture_states_mutex_);
        if (s->capture_states_.count(key))
            // Drawn under this id by another owner already (a torch
            // CUDAGraph capturing the same stream).
            throw std::runtime_error("graphed: a generator already draws for capture " + std::to_string(id) +
                                     " (is torch.cuda.graph capturing the same stream?)");
        s->capture_states_[key] = drawing[i];
    }
#else
    (void)stream;  // begin() set the fields
#endif
}

// Puts the states back as they were before begin(); returns what each drew.
std::vector<uint64_t> RngStates::restore() {
    std::vector<uint64_t> drawn;
    for (size_t i = 0; i < entries.size(); ++i) {
        at::CUDAGeneratorState* s = entries[i].state.get();
#if GRAPHED_TORCH_CAPTURE_IDS
        drawn.push_back(uint64_t(drawing[i]->offset_intragraph_));
        if (entered) {
            std::lock_guard<std::mutex> lock(s->capture_states_mutex_);
            auto it = s->capture_states_.find(at::CaptureId_t(capture_id));
            if (it != s->capture_states_.end() && it->second.get() == drawing[i].get()) s->capture_states_.erase(it);
        }
#else
        drawn.push_back(uint64_t(s->offset_intragraph_));
        s->capturing_ = saved[i].capturing;
        s->offset_intragraph_ = saved[i].intragraph;
        s->seed_extragraph_ = saved[i].seed;
        s->offset_extragraph_ = saved[i].offset;
#endif
    }
#if GRAPHED_TORCH_CAPTURE_IDS
    drawing.clear();
    entered = false;
#endif
    open = false;
    return drawn;
}

void RngStates::end(size_t key) {
    if (!open) return;
    PassDraws d;
    d.increments = restore();
    bool draws = std::any_of(d.increments.begin(), d.increments.end(), [](uint64_t x) { return x != 0; });
    if (draws) {
        d.device = open_device;
        if (passes.size() <= key) passes.resize(key + 1);
        passes[key] = std::move(d);
    }
    open_device = at::Tensor();
}

// The seed and offset each state has now go to the pass's memory, and the
// states advance by what the pass draws, so every replay draws fresh
// numbers, in the order eager execution would.
void RngStates::prologue(size_t key, cudaStream_t stream, uint32_t times, bool looped) {
    if (key >= passes.size() || !passes[key].device.defined()) return;
    PassDraws& d = passes[key];
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    cuda_check(cudaStreamIsCapturing(stream, &capturing), "cudaStreamIsCapturing");
    if (capturing != cudaStreamCaptureStatusNone)
        throw std::runtime_error(
            "graphed: a graph that draws random numbers cannot be replayed on a stream that is being captured "
            "(its generator state is written before each replay)");
    c10::SmallVector<int64_t, 8> host(2 * entries.size());
    for (size_t i = 0; i < entries.size(); ++i) {
        std::lock_guard<std::mutex> lock(entries[i].generator.mutex());
        at::CUDAGeneratorState* s = entries[i].state.get();
#if GRAPHED_TORCH_CAPTURE_IDS
        // torch's own graph replays update the offset under this one.
        std::lock_guard<std::mutex> states(s->capture_states_mutex_);
#endif
        host[2 * i] = int64_t(s->seed_);
        // Looped: each iteration adds one pass's draws before it draws.
        host[2 * i + 1] = int64_t(s->philox_offset_per_thread_) - (looped ? int64_t(d.increments[i]) : 0);
        s->philox_offset_per_thread_ += uint64_t(times) * d.increments[i];
    }
    // Pageable source: the driver stages it before returning.
    cuda_check(cudaMemcpyAsync(d.device.data_ptr(), host.data(), host.size() * sizeof(int64_t), cudaMemcpyHostToDevice,
                               stream),
               "cudaMemcpyAsync (generator state)");
}

void RngStates::unwind(size_t key, uint32_t times) {
    if (key >= passes.size() || !passes[key].device.defined()) return;
    const PassDraws& d = passes[key];
    for (size_t i = 0; i < entries.size(); ++i) {
        std::lock_guard<std::mutex> lock(entries[i].generator.mutex());
#if GRAPHED_TORCH_CAPTURE_IDS
        std::lock_guard<std::mutex> states(entries[i].state->capture_states_mutex_);
#endif
        entries[i].state->philox_offset_per_thread_ -= uint64_t(times) * d.increments[i];
    }
}

void RngStates::abandon() {
    if (open) restore();
    open_device = at::Tensor();
}

}  // namespace graphed_torch
