// Toy layers for graphed: see layers.hpp.
#include "layers.hpp"

#include <stdexcept>

namespace kit {

graphed_callable_desc LinearLayer::describe(const void* sample_input, bool input_requires_grad) {
    const size_t es = dtype_size(dtype);
    in_shape[0] = batch;
    in_shape[1] = in;
    out_shape[0] = batch;
    out_shape[1] = out;
    input = {act_bytes(in), dtype, 2, in_shape, input_requires_grad, sample_input};
    output = {act_bytes(out), dtype, 2, out_shape, true, nullptr};
    params[0] = {w, size_t(out) * in * es, dtype, param_flags, param_policy, true};
    params[1] = {b, size_t(out) * es, dtype, param_flags, param_policy, true};
    graphed_callable_desc d = graphed_callable_desc_default();
    d.name = name.c_str();
    d.num_inputs = 1;
    d.inputs = &input;
    d.num_params = 2;
    d.params = params;
    d.num_outputs = 1;
    d.outputs = &output;
    d.forward = &LinearLayer::forward;
    d.backward = &LinearLayer::backward;
    d.wgrad = split_wgrad ? &LinearLayer::wgrad : nullptr;
    d.user_data = this;
    return d;
}

int LinearLayer::eager_forward(graphed_stream s, const void* x, void* z, void* y) const {
    if (!relu) return dev->linear_fwd(s, dtype, x, w, b, y, batch, in, out);
    if (int e = dev->linear_fwd(s, dtype, x, w, b, z, batch, in, out)) return e;
    return dev->relu_fwd(s, dtype, z, y, size_t(batch) * out);
}

int LinearLayer::eager_backward(graphed_stream s, const void* x, const void* z, const void* gy, void* gz, void* gx,
                                void* gw, void* gb) const {
    const void* g = gy;
    if (relu) {
        if (int e = dev->relu_bwd(s, dtype, gy, z, gz, size_t(batch) * out)) return e;
        g = gz;
    }
    if (gx)
        if (int e = dev->linear_bwd_input(s, dtype, g, w, gx, batch, in, out)) return e;
    return dev->linear_bwd_weight(s, dtype, g, x, gw, gb, batch, in, out);
}

int32_t LinearLayer::forward(const graphed_pass_ctx* ctx, void* self) {
    auto* L = static_cast<LinearLayer*>(self);
    void* z = nullptr;
    if (L->relu) {
        if (graphed_scratch_alloc(ctx->scratch, L->act_bytes(L->out), &z) != GRAPHED_STATUS_OK) return 100;
        *ctx->tape = z;
    }
    return L->eager_forward(ctx->stream, ctx->inputs[0], z, ctx->outputs[0]);
}

int32_t LinearLayer::backward(const graphed_pass_ctx* ctx, void* self) {
    auto* L = static_cast<LinearLayer*>(self);
    const void* x = ctx->inputs[0];
    void* gx = ctx->grad_inputs[0];
    const size_t n = size_t(L->batch) * L->out;
    const void* g = ctx->grad_outputs[0];
    void* gz = nullptr;
    if (L->relu) {
        void* z = *ctx->tape;
        if (graphed_scratch_alloc(ctx->scratch, L->act_bytes(L->out), &gz) != GRAPHED_STATUS_OK) return 101;
        if (int e = L->dev->relu_bwd(ctx->stream, L->dtype, g, z, gz, n)) return e;
        if (graphed_scratch_free(ctx->scratch, z) != GRAPHED_STATUS_OK) return 102;
        g = gz;
    }
    if (gx)
        if (int e = L->dev->linear_bwd_input(ctx->stream, L->dtype, g, L->w, gx, L->batch, L->in, L->out)) return e;
    if (L->split_wgrad) {
        *ctx->tape = gz;  // kept for the weight-grad pass (NULL without ReLU: it reads the grad-output)
        return 0;
    }
    if (int e = L->dev->linear_bwd_weight(ctx->stream, L->dtype, g, x, ctx->param_grads[0], ctx->param_grads[1],
                                          L->batch, L->in, L->out))
        return e;
    if (gz && graphed_scratch_free(ctx->scratch, gz) != GRAPHED_STATUS_OK) return 103;
    return 0;
}

int32_t LinearLayer::wgrad(const graphed_pass_ctx* ctx, void* self) {
    auto* L = static_cast<LinearLayer*>(self);
    void* gz = *ctx->tape;
    const void* g = gz ? gz : ctx->grad_outputs[0];
    if (int e = L->dev->linear_bwd_weight(ctx->stream, L->dtype, g, ctx->inputs[0], ctx->param_grads[0],
                                          ctx->param_grads[1], L->batch, L->in, L->out))
        return e;
    if (gz && graphed_scratch_free(ctx->scratch, gz) != GRAPHED_STATUS_OK) return 104;
    return 0;
}

Mlp::Mlp(Device& dev, int layers, int batch, int width, uint32_t seed) : dev_(dev), batch_(batch), width_(width) {
    layer_.resize(layers);
    size_t act = static_cast<size_t>(batch) * width * 4;
    for (int i = 0; i < layers; ++i) {
        w_.emplace_back(dev, static_cast<size_t>(width) * width * 4);
        b_.emplace_back(dev, static_cast<size_t>(width) * 4);
        auto wv = random_floats(static_cast<size_t>(width) * width, seed + 17 * i, 1.0f / width);
        auto bv = random_floats(width, seed + 17 * i + 1, 0.1f);
        dev.upload(w_[i].get(), wv.data(), w_[i].bytes());
        dev.upload(b_[i].get(), bv.data(), b_[i].bytes());
        LinearLayer& L = layer_[i];
        L.dev = &dev;
        L.batch = batch;
        L.in = width;
        L.out = width;
        L.relu = i + 1 < layers;
        L.w = w_[i].get();
        L.b = b_[i].get();
        L.name = "fc" + std::to_string(i);
        z_.emplace_back(dev, act);
        y_.emplace_back(dev, act);
        gz_.emplace_back(dev, act);
        gx_.emplace_back(dev, act);
        gw_.emplace_back(dev, w_[i].bytes());
        gb_.emplace_back(dev, b_[i].bytes());
    }
    gy_ = Buffer(dev, act);
}

StepGrads Mlp::eager_step(const float* x, const float* target, float lr) {
    graphed_stream s = dev_.stream();
    size_t act = static_cast<size_t>(batch_) * width_;
    const float* in = x;
    for (int i = 0; i < layers(); ++i) {
        check(layer_[i].eager_forward(s, in, z_[i].f32(), y_[i].f32()) == 0 ? GRAPHED_STATUS_OK
                                                                             : GRAPHED_STATUS_INTERNAL,
              "eager forward");
        in = y_[i].f32();
    }
    dev_.sub(s, y_.back().f32(), target, gy_.f32(), act);
    const float* g = gy_.f32();
    for (int i = layers() - 1; i >= 0; --i) {
        const float* xi = i == 0 ? x : y_[i - 1].f32();
        float* gx = i == 0 ? nullptr : gx_[i].f32();
        if (layer_[i].eager_backward(s, xi, z_[i].f32(), g, gz_[i].f32(), gx, gw_[i].f32(), gb_[i].f32()) != 0)
            throw std::runtime_error("eager backward failed");
        g = gx;
    }
    StepGrads out;
    for (int i = 0; i < layers(); ++i) {
        out.w.push_back(fetch<float>(dev_, gw_[i].get(), gw_[i].bytes() / 4));
        out.b.push_back(fetch<float>(dev_, gb_[i].get(), gb_[i].bytes() / 4));
        dev_.sgd(s, w_[i].f32(), gw_[i].f32(), lr, gw_[i].bytes() / 4);
        dev_.sgd(s, b_[i].f32(), gb_[i].f32(), lr, gb_[i].bytes() / 4);
    }
    dev_.sync();
    return out;
}

double Mlp::last_loss() {
    auto d = fetch<float>(dev_, gy_.get(), gy_.bytes() / 4);
    double sum = 0.0;
    for (float v : d) sum += 0.5 * double(v) * double(v);
    return sum;
}

void Mlp::register_layers(graphed_session* session, const float* sample_x) {
    for (int i = 0; i < layers(); ++i) {
        graphed_callable_desc d = layer_[i].describe(sample_x, i > 0);
        uint32_t index = 0;
        check(graphed_session_add_callable(session, &d, &index), "graphed_session_add_callable");
        if (index != static_cast<uint32_t>(i)) throw std::runtime_error("unexpected callable index");
    }
}

StepGrads Mlp::graphed_step(graphed_session* session, const float* x, const float* target, float lr, bool side) {
    graphed_stream s = dev_.stream();
    size_t act = static_cast<size_t>(batch_) * width_;
    graphed_replay_args args = graphed_replay_args_default();
    args.stream = s;
    args.side_stream = side ? dev_.side_stream() : nullptr;
    const void* in = x;
    for (int i = 0; i < layers(); ++i) {
        graphed_ref out{};
        args.callable = static_cast<uint32_t>(i);
        args.data = &in;
        args.num_data = 1;
        check(graphed_forward(session, &args, &out, 1), "graphed_forward");
        in = out.ptr;
    }
    dev_.sub(s, static_cast<const float*>(in), target, gy_.f32(), act);
    const void* g = gy_.get();
    std::vector<graphed_ref> grads(2 * layers());
    for (int i = layers() - 1; i >= 0; --i) {
        graphed_ref gin{};
        args.callable = static_cast<uint32_t>(i);
        args.data = &g;
        args.num_data = 1;
        check(graphed_backward(session, &args, &gin, 1, &grads[2 * i], 2), "graphed_backward");
        g = gin.ptr;
    }
    StepGrads out;
    for (int i = 0; i < layers(); ++i) {
        const graphed_ref& gw = grads[2 * i];
        const graphed_ref& gb = grads[2 * i + 1];
        out.w.push_back(fetch<float>(dev_, gw.ptr, gw.bytes / 4));
        out.b.push_back(fetch<float>(dev_, gb.ptr, gb.bytes / 4));
        dev_.sgd(s, w_[i].f32(), static_cast<const float*>(gw.ptr), lr, gw.bytes / 4);
        dev_.sgd(s, b_[i].f32(), static_cast<const float*>(gb.ptr), lr, gb.bytes / 4);
    }
    for (auto& r : grads) check(graphed_buffer_release(r.owner), "graphed_buffer_release");
    dev_.sync();
    return out;
}

}  // namespace kit
