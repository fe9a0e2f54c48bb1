// graphed for libtorch: what a session lets go of, and when. The caller's
// functions once capture is over; one callable at its release (its graphs,
// graphed's buffers only it uses, the tensors kept for it) while the others
// replay; everything at reset and when the last reference goes. And what it
// holds meanwhile: the registry of live sessions and the memory report.
#include "internal.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <unordered_set>

namespace graphed_torch {

namespace {

// Every session this adapter made that is still alive (memory_report).
std::mutex registry_mu;
std::vector<std::weak_ptr<Shared>>& registry() {
    static std::vector<std::weak_ptr<Shared>> sessions;
    return sessions;
}

}  // namespace

void enroll(const std::shared_ptr<Shared>& s) {
    std::lock_guard<std::mutex> lock(registry_mu);
    auto& v = registry();
    v.erase(std::remove_if(v.begin(), v.end(), [](const std::weak_ptr<Shared>& w) { return w.expired(); }), v.end());
    v.push_back(s);
}

namespace {

// Bytes of the distinct storages of `ts` not yet in `seen`.
uint64_t storage_bytes(const std::vector<at::Tensor>& ts, std::unordered_set<const void*>& seen) {
    uint64_t n = 0;
    for (const at::Tensor& t : ts)
        if (t.defined() && t.has_storage() && seen.insert(t.storage().unsafeGetStorageImpl()).second)
            n += t.storage().nbytes();
    return n;
}

}  // namespace

void Callable::let_go() {
    end_watch();
    // Every instance's tensors, the parameters' addresses with them (a
    // released callable is never replayed).
    per_mb.clear();
    end_pass();
    caller.samples.clear();
    // What it holds of the caller's objects (a module's parameter dicts)
    // goes now, not with the last graphed callable.
    caller.param_source = nullptr;
}

void Shared::check_live(const Callable& c) const {
    if (is_reset) throw std::runtime_error("graphed callable '" + c.name + "': its session was reset");
    if (c.released)
        throw std::runtime_error("graphed callable '" + c.name +
                                 "' was released (its graphs and memory are freed): call the function it graphed, or "
                                 "make it again");
}

void Shared::release_callable(size_t index) {
    std::lock_guard<std::recursive_mutex> lock(teardown_mu);
    Callable& c = *callables.at(index);
    if (is_reset || c.released) return;
    c10::cuda::CUDAGuard guard(device);
    // graphed waits for the device work of its graphs, destroys them (and
    // the steps that include it) and frees its own static buffers; then the
    // tensors its graphs wrote may go.
    session->release_callable(uint32_t(index));
    c.released = true;
    for_each_pass_key(index, [&](size_t key) {
        if (key < rng.passes.size()) rng.passes[key] = RngStates::PassDraws();
    });
    c.let_go();
    // A step includes every callable: its graphs went with this one.
    if (step) {
        step->data.clear();
        step->losses = at::Tensor();
    }
    for (const auto& other : callables)
        if (!other->released) return;
    reset();
}

SessionMemory Shared::memory() {
    std::lock_guard<std::recursive_mutex> lock(teardown_mu);
    SessionMemory m;
    m.reset = is_reset;
    bool live = session && !is_reset;
    // graphed's figures, unless a call is inside the session right now (a
    // replay on another thread): then the adapter's alone, marked busy.
    try {
        if (live) {
            const graphed_session_stats st = session->stats();
            m.static_bytes = st.static_bytes;
            m.scratch_bytes = st.scratch_bytes;
            m.pool_bytes = st.pool_bytes;
            m.graphs = st.graph_count + st.slot_graphs + st.step_graphs;
        }
    } catch (const graphed::Error& e) {
        if (e.status() != GRAPHED_STATUS_BUSY) throw;
        m.busy = true;
        live = false;
    }
    std::unordered_set<const void*> seen;
    for (size_t i = 0; i < callables.size(); ++i) {
        const Callable& c = *callables[i];
        CallableMemory cm;
        cm.name = c.name;
        cm.released = c.released;
        graphed_callable_memory g = graphed_callable_memory_default();
        const graphed_status st = live ? graphed_session_callable_memory(session->get(), uint32_t(i), &g)
                                       : GRAPHED_STATUS_OK;
        if (st == GRAPHED_STATUS_BUSY) {
            m.busy = true;
            live = false;
        } else if (live) {
            graphed::check(st);
            cm.own_static_bytes = g.own_static_bytes;
            cm.shared_static_bytes = g.shared_static_bytes;
            cm.graphs = g.graphs;
            cm.step_graphs = g.step_graphs;
            cm.clone_bytes_outstanding = g.clone_bytes_outstanding;
            cm.clone_bytes_cached = g.clone_bytes_cached;
        }
        for (const Instance& in : c.per_mb)
            for (const auto* ts : {&in.ext_out, &in.ext_gin, &in.ext_pgrad, &in.bucket_pgrad})
                cm.torch_bytes += storage_bytes(*ts, seen);
        for_each_pass_key(i, [&](size_t key) {
            if (key < rng.passes.size()) cm.torch_bytes += storage_bytes({rng.passes[key].device}, seen);
        });
        m.callables.push_back(std::move(cm));
    }
    // Only PyTorch's own allocator gives its segments.
    if (route.pool_refs > 0 && c10::cuda::CUDACachingAllocator::name() == "native") {
        const auto snap = c10::cuda::CUDACachingAllocator::snapshot();
        for (const auto& seg : snap.segments)
            if (seg.device == device && seg.owner_private_pool_id == route.pool) {
                m.torch_pool_reserved += seg.total_size;
                m.torch_pool_allocated += seg.allocated_size;
            }
    }
    return m;
}

MemoryReport memory_report() {
    std::vector<std::shared_ptr<Shared>> live;
    {
        std::lock_guard<std::mutex> lock(registry_mu);
        for (const auto& w : registry())
            if (auto s = w.lock()) live.push_back(std::move(s));
    }
    MemoryReport r;
    for (const auto& s : live) r.sessions.push_back(s->memory());
    r.graphed = graphed_memory_stats_default();
    graphed::check(graphed_memory_stats_get(&r.graphed));
    return r;
}

std::string export_dot() {
    std::vector<std::shared_ptr<Shared>> live;
    {
        std::lock_guard<std::mutex> lock(registry_mu);
        for (const auto& w : registry())
            if (auto s = w.lock()) live.push_back(std::move(s));
    }
    std::string out;
    for (const auto& s : live) {
        std::lock_guard<std::recursive_mutex> lock(s->teardown_mu);
        if (s->is_reset || !s->session) continue;
        try {
            out += s->session->export_dot();
            out += "\n";
        } catch (const graphed::Error& e) {
            if (e.status() != GRAPHED_STATUS_BUSY) throw;
            out += "// a session busy with a call on another thread was left out\n";
        }
    }
    return out;
}

void Shared::drop_callbacks() {
    for (auto& c : callables) {
        c->caller.forward = nullptr;
        c->caller.hook = nullptr;
    }
    opts.pre_warmup_hook = nullptr;
    opts.post_warmup_hook = nullptr;
    if (step) step->opts.destination = nullptr;
}

void Shared::reset() {
    std::lock_guard<std::recursive_mutex> lock(teardown_mu);
    if (is_reset) return;
    is_reset = true;
    // Every stage runs, also when an earlier one raised (a CUDA call on a
    // stream whose capture failed): the graphs, the tensors and the private
    // pool go in any case. The first error is raised once all are done.
    FirstError first;
    first.run([&] { end_routing(); });
    first.run([&] { rng.abandon(); });
    // Waits for the device and destroys the graphs; then the tensors they
    // used may go, and the private pool with them. A session another call
    // still uses is destroyed once that call returns.
    if (session) {
        try {
            session->destroy();
        } catch (const graphed::Error&) {
        }
        session.reset();
    }
    for (auto& c : callables) first.run([&] { c->let_go(); });
    first.run([&] { drop_callbacks(); });
    rng.passes.clear();
    if (step) {
        step->data.clear();
        step->losses = at::Tensor();
        step->dsts.clear();
        step->outs.clear();
        step->gins.clear();
    }
    for (; route.pool_refs > 0; --route.pool_refs)
        first.run([&] { c10::cuda::CUDACachingAllocator::releasePool(device, route.pool); });
    if (!first.what.empty()) throw std::runtime_error("graphed: releasing the session: " + first.what);
}

Shared::~Shared() {
    try {
        reset();
    } catch (...) {
    }
    if (route.ev_fork) cudaEventDestroy(route.ev_fork);
    if (route.ev_join) cudaEventDestroy(route.ev_join);
    if (route.ev_replay) cudaEventDestroy(route.ev_replay);
    if (step && step->done) cudaEventDestroy(step->done);
}

}  // namespace graphed_torch
