// A callable whose parameter grads are returned COPY_INTO and
// ACCUMULATE_INTO, in f32, f16 or bf16, with the results they must give
// computed on the host: y_k = x * p_k (k = 0, 1); backward writes
// gp_k = gy_k * x. Param 0 is returned COPY_INTO, param 1 ACCUMULATE_INTO.
#pragma once

#include "support.hpp"

#include <cstdint>
#include <vector>

class ScaleRig {
  public:
    // A captured session (from `config`) over `n` elements of `dtype`, with
    // random x, parameters and grad-outputs.
    ScaleRig(kit::Device& dev, graphed_session_config config, uint32_t dtype, size_t n)
        : dev_(dev), dtype_(dtype), n_(n), bytes_(n * graphed::dtype_size(dtype)), x_(random(1)), g0_(random(4)),
          g1_(random(5)), dx_(upload(x_)), dp0_(upload(random(2))), dp1_(upload(random(3))), dg0_(upload(g0_)),
          dg1_(upload(g1_)), session_(config) {
        graphed::Callable c;
        c.name = "scale";
        c.inputs = {graphed::tensor_desc(bytes_, dtype, false, dx_.get())};
        c.outputs = {graphed::tensor_desc(bytes_, dtype, true), graphed::tensor_desc(bytes_, dtype, true)};
        c.params = {graphed::param_desc(dp0_.get(), bytes_, dtype, GRAPHED_GRAD_POLICY_COPY_INTO),
                    graphed::param_desc(dp1_.get(), bytes_, dtype, GRAPHED_GRAD_POLICY_ACCUMULATE_INTO)};
        c.forward = &ScaleRig::forward;
        c.backward = &ScaleRig::backward;
        c.user_data = this;
        session_.add_callable(c);
        session_.capture();
    }
    ScaleRig(const ScaleRig&) = delete;
    ScaleRig& operator=(const ScaleRig&) = delete;

    graphed::Session& session() { return session_; }
    size_t bytes() const { return bytes_; }
    // Random elements of the dtype, as raw bytes.
    std::vector<uint8_t> random(uint32_t seed) const {
        return kit::to_dtype(kit::random_floats(n_, seed, 2.0f), dtype_);
    }

    // One forward replay, then a backward replay with the grad-outputs and
    // param destinations `dsts` (NULL array: none).
    graphed::Grads step(void* const* dsts) {
        graphed::Replay r;
        r.stream(dev_.stream());
        session_.forward(r);
        const void* gos[2] = {dg0_.get(), dg1_.get()};
        r.data(gos, 2);
        if (dsts) r.param_dsts(dsts, 2);
        return session_.backward(r);
    }

    // What COPY_INTO must deliver: round(g0 * x), bit for bit.
    std::vector<uint8_t> copied() const {
        std::vector<float> x = kit::from_dtype(x_, dtype_), g = kit::from_dtype(g0_, dtype_), out(n_);
        for (size_t i = 0; i < n_; ++i) out[i] = g[i] * x[i];
        return kit::to_dtype(out, dtype_);
    }
    // What ACCUMULATE_INTO must leave after `times` backward replays into a
    // destination that held `start`: each adds round(g1 * x) in f32 and
    // rounds to nearest even.
    std::vector<uint8_t> accumulated(const std::vector<uint8_t>& start, int times) const {
        std::vector<float> x = kit::from_dtype(x_, dtype_), g = kit::from_dtype(g1_, dtype_), prod(n_);
        for (size_t i = 0; i < n_; ++i) prod[i] = g[i] * x[i];
        prod = kit::from_dtype(kit::to_dtype(prod, dtype_), dtype_);
        std::vector<uint8_t> acc = start;
        for (int t = 0; t < times; ++t) {
            std::vector<float> a = kit::from_dtype(acc, dtype_);
            for (size_t i = 0; i < n_; ++i) a[i] += prod[i];
            acc = kit::to_dtype(a, dtype_);
        }
        return acc;
    }

  private:
    kit::Buffer upload(const std::vector<uint8_t>& v) {
        kit::Buffer b(dev_, v.size());
        dev_.upload(b.get(), v.data(), v.size());
        return b;
    }
    static int32_t forward(const graphed_pass_ctx* c, void* self) {
        auto* r = static_cast<ScaleRig*>(self);
        for (int k = 0; k < 2; ++k)
            if (int e = r->dev_.mul(c->stream, r->dtype_, c->inputs[0], c->params[k], c->outputs[k], r->n_)) return e;
        return 0;
    }
    static int32_t backward(const graphed_pass_ctx* c, void* self) {
        auto* r = static_cast<ScaleRig*>(self);
        for (int k = 0; k < 2; ++k)
            if (int e = r->dev_.mul(c->stream, r->dtype_, c->grad_outputs[k], c->inputs[0], c->param_grads[k], r->n_))
                return e;
        return 0;
    }

    kit::Device& dev_;
    uint32_t dtype_;
    size_t n_, bytes_;
    std::vector<uint8_t> x_, g0_, g1_;
    kit::Buffer dx_, dp0_, dp1_, dg0_, dg1_;
    graphed::Session session_;
};
