// graphed for libtorch: the schedule glue. The passes of one iteration in
// warmup and capture order (pass_order), and, with buffer reuse, what each
// captured pass lets go of (reuse_releases: Transformer Engine's rules for
// the buffers the adapter hands to graphed, PyTorch tensors graphed does
// not plan), and the release itself.
#include "internal.h"

#include <algorithm>

namespace graphed_torch {

namespace {

std::vector<uint32_t> resolve_layers(size_t num_callables, const std::vector<graphed_schedule_step>& schedule,
                                     const std::vector<uint32_t>& layers_per_chunk) {
    uint32_t chunks = 0;
    for (const auto& st : schedule) chunks = std::max(chunks, st.chunk + 1);
    if (!layers_per_chunk.empty()) {
        if (layers_per_chunk.size() != chunks)
            throw std::invalid_argument("layers_per_chunk has " + std::to_string(layers_per_chunk.size()) +
                                        " entries; the schedule has " + std::to_string(chunks) + " chunks");
        size_t total = 0;
        for (uint32_t l : layers_per_chunk) {
            if (l == 0) throw std::invalid_argument("layers_per_chunk: every chunk needs at least one layer");
            total += l;
        }
        if (total != num_callables)
            throw std::invalid_argument("the chunks hold " + std::to_string(total) + " layers in all but there are " +
                                        std::to_string(num_callables) + " callables; there must be one callable per layer");
        return layers_per_chunk;
    }
    if (chunks == 0 || num_callables % chunks != 0)
        throw std::invalid_argument(std::to_string(num_callables) + " callables cannot be split evenly into " +
                                    std::to_string(chunks) + " chunks; give layers_per_chunk");
    return std::vector<uint32_t>(chunks, uint32_t(num_callables / chunks));
}

}  // namespace

std::vector<PassRef> pass_order(size_t n, const std::vector<graphed_schedule_step>& schedule,
                                const std::vector<uint32_t>& layers_per_chunk) {
    std::vector<PassRef> order;
    if (schedule.empty()) {
        for (size_t i = 0; i < n; ++i) order.push_back({uint32_t(i), 0, Pass::Forward});
        for (size_t i = n; i-- > 0;) order.push_back({uint32_t(i), 0, Pass::Backward});
        return order;
    }
    std::vector<uint32_t> layers = resolve_layers(n, schedule, layers_per_chunk);
    std::vector<uint32_t> prefix(layers.size(), 0);
    for (size_t c = 1; c < layers.size(); ++c) prefix[c] = prefix[c - 1] + layers[c - 1];
    std::vector<std::vector<uint32_t>> seen(3, std::vector<uint32_t>(layers.size(), 0));
    for (const auto& st : schedule) {
        if (st.pass > GRAPHED_PASS_WGRAD) throw std::invalid_argument("schedule: unknown pass " + std::to_string(st.pass));
        const uint32_t mb = seen[st.pass][st.chunk]++;
        const uint32_t L = layers[st.chunk];
        for (uint32_t k = 0; k < L; ++k) {
            uint32_t l = st.pass == GRAPHED_PASS_FORWARD ? k : L - 1 - k;
            order.push_back({prefix[st.chunk] + l, mb, Pass(st.pass)});
        }
    }
    return order;
}

std::vector<std::vector<Release>> reuse_releases(size_t n, const std::vector<graphed_schedule_step>& schedule,
                                                 const std::vector<uint32_t>& layers_per_chunk) {
    if (schedule.empty()) throw std::invalid_argument("buffer reuse needs a schedule");
    const std::vector<PassRef> order = pass_order(n, schedule, layers_per_chunk);
    const std::vector<uint32_t> layers = resolve_layers(n, schedule, layers_per_chunk);
    std::vector<uint32_t> chunk_of, layer_of;
    for (uint32_t c = 0; c < layers.size(); ++c)
        for (uint32_t l = 0; l < layers[c]; ++l) {
            chunk_of.push_back(c);
            layer_of.push_back(l);
        }
    std::vector<bool> has_wgrad(chunk_of.size(), false);
    for (const PassRef& p : order)
        if (p.pass == Pass::Wgrad) has_wgrad.at(p.callable) = true;
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
        if (!has_wgrad[p.callable]) out[k].push_back({p.callable, p.microbatch, GRAPHED_BUFFER_ROLE_PARAM_GRADS});
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

bool Callable::clone_slot(size_t j) const {
    return shared->opts.clone_param_grads_on_return && !(flags[j] & GRAPHED_PARAM_FLAGS_DELAYED_WGRAD);
}

void Shared::release(const Release& r) {
    Callable& c = *callables.at(r.callable);
    switch (r.role) {
        case GRAPHED_BUFFER_ROLE_OUTPUT: c.ext_out[r.microbatch].clear(); break;
        case GRAPHED_BUFFER_ROLE_GRAD_INPUT: c.ext_gin[r.microbatch].clear(); break;
        default:
            for (size_t j = 0; j < c.ext_pgrad[r.microbatch].size(); ++j)
                if (c.clone_slot(j)) c.ext_pgrad[r.microbatch][j] = at::Tensor();
    }
}

}  // namespace graphed_torch
