// graphed for libtorch: streams and pools. The long-lived work stream the
// passes run on, joined to graphed's stream; PyTorch's caching allocator
// routed into the session's private graph pool during each capture (as
// at::cuda::CUDAGraph does); and graphed's clone allocator over PyTorch's
// caching allocator, so that cloned grads are ordinary PyTorch memory.
#include "internal.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>

#include <map>

namespace graphed_torch {

// One stream per device for every session's warmup and capture, so that
// libraries that cache per-stream state (cuBLAS workspaces) keep one.
c10::cuda::CUDAStream default_work_stream(c10::DeviceIndex device) {
    static std::mutex mu;
    static std::map<c10::DeviceIndex, c10::cuda::CUDAStream> streams;
    std::lock_guard<std::mutex> lock(mu);
    auto it = streams.find(device);
    if (it == streams.end()) {
        // Its own stream (not one of PyTorch's pooled ones, which other code
        // may share), kept for the life of the process.
        c10::cuda::CUDAGuard guard(device);
        cudaStream_t raw = nullptr;
        cuda_check(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
        it = streams.emplace(device, c10::cuda::getStreamFromExternal(raw, device)).first;
    }
    return it->second;
}

namespace {

struct Watch {
    std::atomic<bool> on{false};
    std::mutex mu;
    const void* owner = nullptr;
    c10::DeviceIndex device = 0;
    std::vector<Watched> seen;
};

Watch& the_watch() {
    static Watch w;
    return w;
}

// Called by the allocator with its lock held: takes only the watch's lock.
template <class Entry>
void on_trace(const Entry& te) {
    Watch& w = the_watch();
    if (!w.on.load(std::memory_order_acquire)) return;
    using Action = typename Entry::Action;
    const bool alloc = te.action_ == Action::ALLOC;
    if (!alloc && te.action_ != Action::FREE_REQUESTED && te.action_ != Action::FREE_COMPLETED) return;
    std::lock_guard<std::mutex> lock(w.mu);
    if (w.on && te.device_ == w.device) w.seen.push_back(Watched{uintptr_t(te.addr_), size_t(te.size_), alloc});
}

}  // namespace

bool watch_allocations(const void* owner, c10::DeviceIndex device) {
    // Only PyTorch's own allocator reports its blocks (not cudaMallocAsync
    // or a pluggable one): elsewhere nothing is watched, and every grad
    // counts as shared. Trackers cannot be detached: one for the process,
    // idle when off.
    static const bool native = c10::cuda::CUDACachingAllocator::name() == "native";
    if (!native) return false;
    static std::once_flag attached;
    std::call_once(attached, [] {
        c10::cuda::CUDACachingAllocator::attachAllocatorTraceTracker([](const auto& te) { on_trace(te); });
    });
    Watch& w = the_watch();
    std::lock_guard<std::mutex> lock(w.mu);
    if (w.on) return false;
    w.owner = owner;
    w.device = device;
    w.seen.clear();
    w.on.store(true, std::memory_order_release);
    return true;
}

std::vector<Watched> watched_allocations(const void* owner) {
    Watch& w = the_watch();
    std::lock_guard<std::mutex> lock(w.mu);
    if (!w.on || w.owner != owner) return {};
    w.on.store(false, std::memory_order_release);
    w.owner = nullptr;
    return std::move(w.seen);
}

bool alone(const std::vector<Watched>& seen, const void* p, size_t bytes) {
    const uintptr_t lo = reinterpret_cast<uintptr_t>(p), hi = lo + bytes;
    int own = 0;
    for (const Watched& b : seen) {
        if (b.addr >= hi || b.addr + b.size <= lo) continue;
        // Its own allocation: handed out once during the pass, at its
        // address, of its size. Anything else there (a block freed in the
        // pass, one handed out before it, a larger block it is part of) was
        // another tensor's; a grad not handed out during the pass is not
        // known to be alone.
        if (b.alloc && b.addr == lo && b.size == bytes && ++own == 1) continue;
        return false;
    }
    return own == 1;
}

void Shared::begin_routing() {
    // The work stream, and while a step's graph is captured the stream its
    // callbacks run on (a looped step's body is captured on its own).
    c10::cuda::CUDACachingAllocator::beginAllocateToPool(device, route.pool, [this, s = route.work.stream()](cudaStream_t st) {
        return st == s || (step && st == step->stream.load());
    });
    ++route.pool_refs;
    route.routing = true;
}

void Shared::end_routing() {
    if (route.routing) {
        c10::cuda::CUDACachingAllocator::endAllocateToPool(device, route.pool);
        route.routing = false;
    }
}

void Shared::on_work_stream(graphed_stream ext, const std::function<void()>& fn) {
    auto s = static_cast<cudaStream_t>(ext);
    cuda_check(cudaEventRecord(route.ev_fork, s), "cudaEventRecord");
    cuda_check(cudaStreamWaitEvent(route.work.stream(), route.ev_fork, 0), "cudaStreamWaitEvent");
    struct Join {
        Shared* sh;
        cudaStream_t s;
        ~Join() {
            if (cudaEventRecord(sh->route.ev_join, sh->route.work.stream()) == cudaSuccess) cudaStreamWaitEvent(s, sh->route.ev_join, 0);
        }
    } join{this, s};
    c10::cuda::CUDAStreamGuard guard(route.work);
    fn();
}

int32_t torch_alloc(void* ctx, size_t bytes, graphed_stream, void** out) {
    try {
        // On the caller's current stream, where the grads are used: graphed
        // may write them on a side stream, which the caller's stream joins.
        // (Called during replays only, while the session lives.)
        const c10::DeviceIndex device = static_cast<Shared*>(ctx)->device;
        *out = c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(bytes,
                                                                      c10::cuda::getCurrentCUDAStream(device).stream());
        return *out ? 0 : 1;
    } catch (...) {
        return 1;
    }
}

void torch_free(void*, void* ptr, size_t, graphed_stream) { c10::cuda::CUDACachingAllocator::raw_delete(ptr); }

}  // namespace graphed_torch
