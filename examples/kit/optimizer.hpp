// The kit's optimizer for a step's update stage: SGD with momentum on the
// kit's kernels (Device::sgd_momentum, Device::flag_nonfinite), one
// momentum buffer per parameter, its learning rate and momentum read from
// the step's device scalar block (SgdScalars) when the kernels run. The
// static callbacks are graphed_step_desc.update_check and update_apply
// (graphed::StepUpdate); `check_eager` and `apply_eager` enqueue the same
// kernels outside a graph. Shared by cpp_tests/step_update_test.cpp and
// benches/optimizer_bench.cpp.
#pragma once

#include "kit.hpp"

#include <vector>

namespace kit {

// What the step's scalar block holds.
struct SgdScalars {
    float lr, mu;
};

struct SgdMomentum {
    Device* dev = nullptr;
    std::vector<Buffer> momentum;
    std::vector<float*> m;

    SgdMomentum() = default;
    // Zeroed momentum buffers of `bytes` each (f32 parameters, in step order).
    SgdMomentum(Device& d, const std::vector<size_t>& bytes) : dev(&d) {
        for (size_t b : bytes) {
            momentum.emplace_back(d, b);
            std::vector<float> zero(b / 4, 0.0f);
            d.upload(momentum.back().get(), zero.data(), b);
            m.push_back(momentum.back().f32());
        }
    }

    // Sets *flag to 1 when a grad is not finite (a loss scaler's check).
    int check_eager(graphed_stream s, const std::vector<const float*>& grads, const std::vector<size_t>& counts,
                    uint32_t* flag) {
        for (size_t p = 0; p < grads.size(); ++p)
            if (int e = dev->flag_nonfinite(s, grads[p], counts[p], flag)) return e;
        return 0;
    }
    // m = mu * m + g, then w -= lr * m, per parameter.
    int apply_eager(graphed_stream s, const std::vector<float*>& params, const std::vector<const float*>& grads,
                    const std::vector<size_t>& counts, const float* scalars) {
        for (size_t p = 0; p < params.size(); ++p)
            if (int e = dev->sgd_momentum(s, params[p], grads[p], m[p], scalars, counts[p])) return e;
        return 0;
    }

    // graphed_step_desc.update_check: flags a non-finite grad.
    static int32_t check(const graphed_update_ctx* ctx, void* self) {
        return graphed::guard([&] {
            auto* o = static_cast<SgdMomentum*>(self);
            for (size_t p = 0; p < ctx->num_params; ++p) {
                const auto* g = static_cast<const float*>(ctx->grads[p]);
                if (int e = o->dev->flag_nonfinite(ctx->stream, g, ctx->bytes[p] / 4, ctx->skip_flag)) return e;
            }
            return 0;
        });
    }

    // graphed_step_desc.update_apply: SGD with momentum, lr and mu from the
    // step's scalar block.
    static int32_t apply(const graphed_update_ctx* ctx, void* self) {
        return graphed::guard([&] {
            auto* o = static_cast<SgdMomentum*>(self);
            if (ctx->num_params != o->m.size() || ctx->scalar_bytes != sizeof(SgdScalars)) return 90;
            const auto* scalars = static_cast<const float*>(ctx->scalars);
            for (size_t p = 0; p < ctx->num_params; ++p) {
                auto* w = static_cast<float*>(ctx->params[p]);
                const auto* g = static_cast<const float*>(ctx->grads[p]);
                if (int e = o->dev->sgd_momentum(ctx->stream, w, g, o->m[p], scalars, ctx->bytes[p] / 4)) return e;
            }
            return 0;
        });
    }
};

}  // namespace kit
