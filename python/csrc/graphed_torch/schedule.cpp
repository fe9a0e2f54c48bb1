// graphed for libtorch: the schedule glue. Every rule of a schedule is
// graphed's: the steps from Transformer Engine's `_order` notation
// (graphed_schedule_from_te_order), the microbatches and the layers of each
// chunk (graphed_schedule_shape) and the passes in warmup and capture order
// (graphed_schedule_passes) come from the library. Derived here from that
// order: the releases of buffer reuse, Transformer Engine's rules for the
// buffers the adapter hands to graphed (PyTorch tensors graphed does not
// plan), and what each release lets go of.
#include "internal.h"

#include <algorithm>

namespace graphed_torch {

namespace {

// The passes graphed runs for `n` callables, in warmup and capture order
// (no schedule: every forward in order, then every backward in reverse).
std::vector<PassRef> passes(size_t n, const std::vector<graphed_schedule_step>& steps,
                            const std::vector<uint32_t>& layers_per_chunk, const std::vector<uint32_t>& has_wgrad) {
    auto call = [&](graphed_pass_ref* out, size_t capacity, size_t* count) {
        graphed::check(graphed_schedule_passes(
            steps.empty() ? nullptr : steps.data(), steps.size(), sizeof(graphed_schedule_step),
            layers_per_chunk.empty() ? nullptr : layers_per_chunk.data(), layers_per_chunk.size(),
            has_wgrad.empty() ? nullptr : has_wgrad.data(), uint32_t(n), out, capacity, sizeof(graphed_pass_ref),
            count));
    };
    size_t count = 0;
    call(nullptr, 0, &count);
    std::vector<graphed_pass_ref> raw(count);
    call(raw.data(), raw.size(), &count);
    std::vector<PassRef> order;
    order.reserve(count);
    for (const graphed_pass_ref& p : raw) order.push_back({p.callable, p.microbatch, Pass(p.pass)});
    return order;
}

uint32_t callable_count(size_t n) {
    if (n > UINT32_MAX) throw std::invalid_argument(std::to_string(n) + " callables are more than graphed takes");
    return uint32_t(n);
}

}  // namespace

SchedulePlan plan_schedule(size_t n, const std::vector<graphed_schedule_step>& schedule,
                           const std::vector<uint32_t>& layers_per_chunk) {
    SchedulePlan p;
    p.has_wgrad.assign(n, 0);
    try {
        if (schedule.empty()) {
            p.order = passes(callable_count(n), {}, {}, {});
            return p;
        }
        p.shape = graphed::schedule_shape(schedule, callable_count(n), layers_per_chunk);
        p.microbatches = p.shape.microbatches;
        // The callables of a chunk with weight-grad steps get a weight-grad pass.
        for (const graphed_schedule_step& st : schedule)
            if (st.pass == GRAPHED_PASS_WGRAD)
                for (uint32_t l = 0; l < p.shape.chunk_layers.at(st.chunk); ++l)
                    p.has_wgrad.at(p.shape.chunk_first[st.chunk] + l) = 1;
        p.order = passes(n, schedule, layers_per_chunk, p.has_wgrad);
    } catch (const graphed::Error& e) {
        throw std::invalid_argument(e.what());
    }
    return p;
}

std::vector<PassRef> pass_order(size_t n, const std::vector<graphed_schedule_step>& schedule,
                                const std::vector<uint32_t>& layers_per_chunk) {
    return plan_schedule(n, schedule, layers_per_chunk).order;
}

Schedule schedule_from_te_order(const std::vector<double>& order, size_t num_callables,
                                const std::vector<uint32_t>& layers_per_chunk) {
    Schedule s;
    try {
        s.steps = graphed::schedule_from_te_order(order);
        graphed::ScheduleShape shape = graphed::schedule_shape(s.steps, callable_count(num_callables), layers_per_chunk);
        s.microbatches = shape.microbatches;
        s.layers_per_chunk = std::move(shape.chunk_layers);
        s.chunk_first = std::move(shape.chunk_first);
    } catch (const graphed::Error& e) {
        throw std::invalid_argument(e.what());
    }
    return s;
}

// ---- buffer reuse ----------------------------------------------------------------------------

std::vector<std::vector<Release>> releases_of(const SchedulePlan& plan) {
    const std::vector<PassRef>& order = plan.order;
    const std::vector<uint32_t>& layers = plan.shape.chunk_layers;
    std::vector<uint32_t> chunk_of, layer_of;
    for (uint32_t c = 0; c < layers.size(); ++c)
        for (uint32_t l = 0; l < layers[c]; ++l) {
            chunk_of.push_back(c);
            layer_of.push_back(l);
        }
    std::vector<std::vector<Release>> out(order.size());
    // The input grad of a chunk's first layer is taken by the previous
    // chunk's backward of the same microbatch: it is let go no earlier than
    // that backward's capture.
    auto consumer = [&](size_t from, const PassRef& p) -> size_t {
        uint32_t c = chunk_of.at(p.callable);
        if (c == 0) return 0;
        for (size_t k = from + 1; k < order.size(); ++k)
            if (order[k].pass == Pass::Backward && chunk_of.at(order[k].callable) == c - 1 &&
                order[k].microbatch == p.microbatch)
                return k;
        return order.size();
    };
    std::optional<PassRef> prev_in_step, prev_step_first;
    std::optional<size_t> prev_step_first_at;
    for (size_t k = 0; k < order.size(); ++k) {
        const PassRef& p = order[k];
        if (p.pass == Pass::Wgrad) {
            out[k].push_back({p.callable, p.microbatch, GRAPHED_BUFFER_ROLE_PARAM_GRADS});
            continue;
        }
        if (p.pass != Pass::Backward) continue;
        out[k].push_back({p.callable, p.microbatch, GRAPHED_BUFFER_ROLE_OUTPUT});
        if (!plan.has_wgrad.at(p.callable))
            out[k].push_back({p.callable, p.microbatch, GRAPHED_BUFFER_ROLE_PARAM_GRADS});
        const uint32_t l = layer_of.at(p.callable), L = layers.at(chunk_of.at(p.callable));
        if (l == L - 1) prev_in_step.reset();
        if (prev_in_step) out[k].push_back({prev_in_step->callable, prev_in_step->microbatch, GRAPHED_BUFFER_ROLE_GRAD_INPUT});
        prev_in_step = p;
        if (l == 0) {
            if (prev_step_first) {
                size_t at = std::max(k, consumer(*prev_step_first_at, *prev_step_first));
                if (at < order.size())
                    out[at].push_back({prev_step_first->callable, prev_step_first->microbatch, GRAPHED_BUFFER_ROLE_GRAD_INPUT});
            }
            prev_step_first = p;
            prev_step_first_at = k;
        }
    }
    return out;
}

std::vector<std::vector<Release>> reuse_releases(size_t n, const std::vector<graphed_schedule_step>& schedule,
                                                 const std::vector<uint32_t>& layers_per_chunk) {
    if (schedule.empty()) throw std::invalid_argument("buffer reuse needs a schedule");
    return releases_of(plan_schedule(n, schedule, layers_per_chunk));
}

void Shared::release(const Release& r) {
    Callable& c = *callables.at(r.callable);
    switch (r.role) {
        case GRAPHED_BUFFER_ROLE_OUTPUT: c.ext_out[r.microbatch].clear(); break;
        case GRAPHED_BUFFER_ROLE_GRAD_INPUT: c.ext_gin[r.microbatch].clear(); break;
        default:
            // Cloned grads only: an aliased grad is what the replay returns.
            for (size_t j = 0; j < c.ext_pgrad[r.microbatch].size(); ++j)
                if (j < c.policies.size() && c.policies[j] == GRAPHED_GRAD_POLICY_CLONE)
                    c.ext_pgrad[r.microbatch][j] = at::Tensor();
    }
}

}  // namespace graphed_torch
