// graphed for libtorch: the schedule glue. Every rule of a schedule is
// graphed's: the steps from Transformer Engine's `_order` notation
// (graphed_schedule_from_te_order), the microbatches and the layers of each
// chunk (graphed_schedule_shape), the passes in warmup and capture order and
// which callables have a weight-grad pass (graphed_schedule_passes), and,
// with buffer reuse, what each pass lets go of (graphed_schedule_releases).
// Here: what each release lets go of among the PyTorch tensors the adapter
// hands to graphed.
#include "internal.h"

namespace graphed_torch {

namespace {

uint32_t callable_count(size_t n) {
    if (n > UINT32_MAX) throw std::invalid_argument(std::to_string(n) + " callables are more than graphed takes");
    return uint32_t(n);
}

// Runs `fn`, a call of graphed's schedule helpers; a schedule that breaks
// one of graphed's rules becomes std::invalid_argument with its message.
template <class F>
auto schedule_call(F&& fn) {
    try {
        return fn();
    } catch (const graphed::Error& e) {
        throw std::invalid_argument(e.what());
    }
}

}  // namespace

SchedulePlan plan_schedule(size_t n, const std::vector<graphed_schedule_step>& schedule,
                           const std::vector<uint32_t>& layers_per_chunk) {
    const uint32_t count = callable_count(n);
    return schedule_call([&] {
        SchedulePlan p;
        p.has_wgrad.assign(n, 0);
        if (!schedule.empty()) {
            p.shape = graphed::schedule_shape(schedule, count, layers_per_chunk);
            p.microbatches = p.shape.microbatches;
        }
        for (const graphed_pass_ref& r : graphed::schedule_passes(schedule, count, layers_per_chunk)) {
            p.order.push_back({r.callable, r.microbatch, Pass(r.pass)});
            if (r.pass == GRAPHED_PASS_WGRAD) p.has_wgrad.at(r.callable) = 1;
        }
        return p;
    });
}

std::vector<PassRef> pass_order(size_t n, const std::vector<graphed_schedule_step>& schedule,
                                const std::vector<uint32_t>& layers_per_chunk) {
    return plan_schedule(n, schedule, layers_per_chunk).order;
}

Schedule schedule_from_te_order(const std::vector<double>& order, size_t num_callables,
                                const std::vector<uint32_t>& layers_per_chunk) {
    const uint32_t count = callable_count(num_callables);
    return schedule_call([&] {
        Schedule s;
        s.steps = graphed::schedule_from_te_order(order);
        graphed::ScheduleShape shape = graphed::schedule_shape(s.steps, count, layers_per_chunk);
        s.microbatches = shape.microbatches;
        s.layers_per_chunk = std::move(shape.chunk_layers);
        s.chunk_first = std::move(shape.chunk_first);
        return s;
    });
}

// ---- buffer reuse ----------------------------------------------------------------------------

std::vector<std::vector<Release>> reuse_releases(size_t n, const std::vector<graphed_schedule_step>& schedule,
                                                 const std::vector<uint32_t>& layers_per_chunk) {
    if (schedule.empty()) throw std::invalid_argument("buffer reuse needs a schedule");
    const uint32_t count = callable_count(n);
    return schedule_call([&] {
        std::vector<std::vector<Release>> out(graphed::schedule_passes(schedule, count, layers_per_chunk).size());
        for (const graphed_release& r : graphed::schedule_releases(schedule, count, layers_per_chunk))
            out.at(r.after).push_back({r.callable, r.microbatch, r.role});
        return out;
    });
}

void Shared::release(const Release& r) {
    Callable& c = *callables.at(r.callable);
    switch (r.role) {
        case GRAPHED_BUFFER_ROLE_OUTPUT: c.per_mb[r.microbatch].ext_out.clear(); break;
        case GRAPHED_BUFFER_ROLE_GRAD_INPUT: c.per_mb[r.microbatch].ext_gin.clear(); break;
        default:
            // The grads a replay copies out: an ALIAS grad is the buffer it
            // returns (graphed_schedule_releases).
            for (size_t j = 0; j < c.per_mb[r.microbatch].ext_pgrad.size(); ++j)
                if (c.param_info[j].policy != GRAPHED_GRAD_POLICY_ALIAS)
                    c.per_mb[r.microbatch].ext_pgrad[j] = at::Tensor();
    }
}

}  // namespace graphed_torch
