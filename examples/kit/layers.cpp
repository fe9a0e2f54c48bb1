// Toy layers for graphed: see layers.hpp.
#include "layers.hpp"

#include <stdexcept>

namespace kit {

graphed::Callable LinearLayer::callable(const void* sample_input, bool input_requires_grad) {
    const size_t es = graphed::dtype_size(dtype);
    in_shape[0] = out_shape[0] = batch;
    in_shape[1] = in;
    out_shape[1] = out;
    graphed::Callable c;
    c.name = name;
    c.inputs = {graphed::tensor_desc(act_bytes(in), dtype, input_requires_grad, sample_input)};
    c.inputs[0].ndim = 2;
    c.inputs[0].shape = in_shape;
    c.outputs = {graphed::tensor_desc(act_bytes(out), dtype, true)};
    c.outputs[0].ndim = 2;
    c.outputs[0].shape = out_shape;
    c.params = {graphed::param_desc(w, size_t(out) * in * es, dtype, param_policy, param_flags),
                graphed::param_desc(b, size_t(out) * es, dtype, param_policy, param_flags)};
    c.forward = &LinearLayer::forward;
    c.backward = &LinearLayer::backward;
    c.wgrad = split_wgrad ? &LinearLayer::wgrad : nullptr;
    c.user_data = this;
    if (!buckets.empty()) {
        c.buckets = buckets;
        c.inputs[0].flags |= GRAPHED_TENSOR_FLAGS_DYNAMIC;
        c.outputs[0].flags |= GRAPHED_TENSOR_FLAGS_DYNAMIC;
    }
    return c;
}

int LinearLayer::eager_forward(graphed_stream s, const void* x, void* z, void* y, uint32_t mb,
                               const uint32_t* mb_at, int rows) const {
    const int batch = rows ? rows : this->batch;
    const size_t n = size_t(batch) * out;
    if (!relu) {
        if (int e = dev->linear_fwd(s, dtype, x, w, b, y, batch, in, out)) return e;
    } else {
        if (int e = dev->linear_fwd(s, dtype, x, w, b, z, batch, in, out)) return e;
        if (int e = dev->relu_fwd(s, dtype, z, y, n)) return e;
    }
    return dropout > 0.0f ? dev->dropout(s, dtype, y, y, n, dropout, dropout_seed, mb, mb_at) : 0;
}

int LinearLayer::eager_backward(graphed_stream s, const void* x, const void* z, const void* gy, void* gz, void* gx,
                                void* gw, void* gb, uint32_t mb, const uint32_t* mb_at, int rows) const {
    const int batch = rows ? rows : this->batch;
    const size_t n = size_t(batch) * out;
    const void* g = gy;
    if (dropout > 0.0f) {
        if (int e = dev->dropout(s, dtype, gy, gz, n, dropout, dropout_seed, mb, mb_at)) return e;
        g = gz;
    }
    if (relu) {
        if (int e = dev->relu_bwd(s, dtype, g, z, gz, n)) return e;
        g = gz;
    }
    if (gx)
        if (int e = dev->linear_bwd_input(s, dtype, g, w, gx, batch, in, out)) return e;
    return dev->linear_bwd_weight(s, dtype, g, x, gw, gb, batch, in, out);
}

int32_t LinearLayer::forward(const graphed_pass_ctx* ctx, void* self) {
    return graphed::guard([&] {
        auto* L = static_cast<LinearLayer*>(self);
        const int rows = LinearLayer::rows(ctx, L->batch);
        void* z = nullptr;
        if (L->relu) {
            z = graphed::scratch_alloc(*ctx, L->act_bytes(L->out, rows));
            *ctx->tape = z;
        }
        return L->eager_forward(ctx->stream, ctx->inputs[0], z, ctx->outputs[0], ctx->step_microbatch,
                                ctx->step_microbatch_index, rows);
    });
}

int32_t LinearLayer::backward(const graphed_pass_ctx* ctx, void* self) {
    return graphed::guard([&] {
        auto* L = static_cast<LinearLayer*>(self);
        const void* x = ctx->inputs[0];
        void* gx = ctx->grad_inputs[0];
        const int rows = LinearLayer::rows(ctx, L->batch);
        const size_t n = size_t(rows) * L->out;
        const void* g = ctx->grad_outputs[0];
        void* gz = nullptr;
        if (L->relu || L->dropout > 0.0f) gz = graphed::scratch_alloc(*ctx, L->act_bytes(L->out, rows));
        if (L->dropout > 0.0f) {
            if (int e = L->dev->dropout(ctx->stream, L->dtype, g, gz, n, L->dropout, L->dropout_seed,
                                        ctx->step_microbatch, ctx->step_microbatch_index))
                return e;
            g = gz;
        }
        if (L->relu) {
            void* z = *ctx->tape;
            if (int e = L->dev->relu_bwd(ctx->stream, L->dtype, g, z, gz, n)) return e;
            graphed::scratch_free(*ctx, z);
            g = gz;
        }
        if (gx)
            if (int e = L->dev->linear_bwd_input(ctx->stream, L->dtype, g, L->w, gx, rows, L->in, L->out))
                return e;
        if (L->split_wgrad) {
            *ctx->tape = gz;  // kept for the weight-grad pass (NULL without ReLU or dropout: it reads the grad-output)
            return 0;
        }
        if (int e = L->dev->linear_bwd_weight(ctx->stream, L->dtype, g, x, ctx->param_grads[0], ctx->param_grads[1],
                                              rows, L->in, L->out))
            return e;
        if (gz) graphed::scratch_free(*ctx, gz);
        return 0;
    });
}

int32_t LinearLayer::wgrad(const graphed_pass_ctx* ctx, void* self) {
    return graphed::guard([&] {
        auto* L = static_cast<LinearLayer*>(self);
        void* gz = *ctx->tape;
        const void* g = gz ? gz : ctx->grad_outputs[0];
        if (int e = L->dev->linear_bwd_weight(ctx->stream, L->dtype, g, ctx->inputs[0], ctx->param_grads[0],
                                              ctx->param_grads[1], LinearLayer::rows(ctx, L->batch), L->in, L->out))
            return e;
        if (gz) graphed::scratch_free(*ctx, gz);
        return 0;
    });
}

graphed::Callable LossLayer::callable(uint32_t producer) {
    shape[0] = batch;
    shape[1] = width;
    graphed::Callable c;
    c.name = "loss";
    graphed_tensor_desc y = graphed::tensor_desc(bytes(), dtype, true);
    y.flags = GRAPHED_TENSOR_FLAGS_CHAINED;
    y.chain_callable = producer;
    y.chain_output = 0;
    graphed_tensor_desc target = graphed::tensor_desc(bytes(), dtype, false);
    graphed_tensor_desc d = graphed::tensor_desc(bytes(), dtype, false);
    for (graphed_tensor_desc* t : {&y, &target, &d}) {
        t->ndim = 2;
        t->shape = shape;
    }
    c.inputs = {y, target};
    c.outputs = {d};
    c.forward = &LossLayer::forward;
    c.backward = &LossLayer::backward;
    c.user_data = this;
    return c;
}

int32_t LossLayer::forward(const graphed_pass_ctx* ctx, void* self) {
    auto* L = static_cast<LossLayer*>(self);
    return L->dev->sub(ctx->stream, L->dtype, ctx->inputs[0], ctx->inputs[1], ctx->outputs[0],
                       size_t(L->batch) * L->width);
}

int32_t LossLayer::backward(const graphed_pass_ctx* ctx, void* self) {
    auto* L = static_cast<LossLayer*>(self);
    return L->dev->copy(ctx->stream, ctx->grad_inputs[0], ctx->outputs[0], L->bytes());
}

Mlp::Mlp(Device& dev, int layers, int batch, int width, uint32_t seed, uint32_t dtype)
    : dev_(dev), batch_(batch), width_(width), dtype_(dtype), es_(graphed::dtype_size(dtype)) {
    layer_.resize(layers);
    size_t act = size_t(batch) * width * es_;
    for (int i = 0; i < layers; ++i) {
        w_.push_back(tensor(random_floats(size_t(width) * width, seed + 17 * i, 1.0f / width)));
        b_.push_back(tensor(random_floats(width, seed + 17 * i + 1, 0.1f)));
        LinearLayer& L = layer_[i];
        L.dev = &dev;
        L.batch = batch;
        L.in = width;
        L.out = width;
        L.relu = i + 1 < layers;
        L.dtype = dtype;
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

Buffer Mlp::tensor(const std::vector<float>& values) {
    auto raw = to_dtype(values, dtype_);
    Buffer b(dev_, raw.size());
    dev_.upload(b.get(), raw.data(), raw.size());
    return b;
}

std::vector<float> Mlp::values(const void* p, size_t bytes) {
    std::vector<uint8_t> raw(bytes);
    dev_.download(raw.data(), p, bytes);
    return from_dtype(raw, dtype_);
}

void Mlp::set_dropout(float p, uint64_t seed) {
    for (auto& L : layer_) {
        L.dropout = p;
        L.dropout_seed = seed;
    }
}

StepGrads Mlp::eager_step(const void* x, const void* target, float lr, bool keep, uint32_t microbatch) {
    graphed_stream s = dev_.stream();
    eager_pass(s, x, target, microbatch);
    StepGrads out;
    for (int i = 0; i < layers(); ++i) {
        if (keep) {
            out.w.push_back(values(gw_[i].get(), gw_[i].bytes()));
            out.b.push_back(values(gb_[i].get(), gb_[i].bytes()));
        }
        dev_.sgd(s, dtype_, w_[i].get(), gw_[i].get(), lr, gw_[i].bytes() / es_);
        dev_.sgd(s, dtype_, b_[i].get(), gb_[i].get(), lr, gb_[i].bytes() / es_);
    }
    if (keep) dev_.sync();
    return out;
}

void Mlp::eager_pass(graphed_stream s, const void* x, const void* target, uint32_t microbatch) {
    size_t act = size_t(batch_) * width_;
    const void* in = x;
    for (int i = 0; i < layers(); ++i) {
        if (layer_[i].eager_forward(s, in, z_[i].get(), y_[i].get(), microbatch) != 0)
            throw std::runtime_error("eager forward failed");
        in = y_[i].get();
    }
    dev_.sub(s, dtype_, y_.back().get(), target, gy_.get(), act);
    const void* g = gy_.get();
    for (int i = layers() - 1; i >= 0; --i) {
        const void* xi = i == 0 ? x : y_[i - 1].get();
        void* gx = i == 0 ? nullptr : gx_[i].get();
        if (layer_[i].eager_backward(s, xi, z_[i].get(), g, gz_[i].get(), gx, gw_[i].get(), gb_[i].get(),
                                     microbatch) != 0)
            throw std::runtime_error("eager backward failed");
        g = gx;
    }
}

double Mlp::last_loss() {
    auto d = values(gy_.get(), gy_.bytes());
    double sum = 0.0;
    for (float v : d) sum += 0.5 * double(v) * double(v);
    return sum;
}

void Mlp::register_layers(graphed::Session& session, const void* sample_x, const Wiring& wiring) {
    for (int i = 0; i < layers(); ++i) {
        if (!wiring.buckets.empty() && wiring.loss)
            throw std::runtime_error("buckets are registered without the loss layer");
        layer_[i].buckets = wiring.buckets;
        graphed::Callable c = layer_[i].callable(sample_x, i > 0);
        if (i > 0 && wiring.chain) {
            c.inputs[0].flags = GRAPHED_TENSOR_FLAGS_CHAINED;
            c.inputs[0].chain_callable = static_cast<uint32_t>(i - 1);
            c.inputs[0].chain_output = 0;
        }
        if (i == 0 && wiring.rebind_input) c.inputs[0].flags |= GRAPHED_TENSOR_FLAGS_REBIND;
        if (i + 1 == layers() && wiring.rebind_grad_output) c.outputs[0].flags |= GRAPHED_TENSOR_FLAGS_REBIND;
        if (session.add_callable(c) != static_cast<uint32_t>(i)) throw std::runtime_error("unexpected callable index");
    }
    if (wiring.loss) {
        loss_.dev = &dev_;
        loss_.batch = batch_;
        loss_.width = width_;
        loss_.dtype = dtype_;
        session.add_callable(loss_.callable(static_cast<uint32_t>(layers() - 1)));
    }
}

StepGrads Mlp::step_graph_step(graphed::Session& session, uint32_t step, const void* x, const void* target, float lr,
                               bool keep, bool sgd) {
    graphed_stream s = dev_.stream();
    const uint32_t loss = static_cast<uint32_t>(layers());
    const size_t act = size_t(batch_) * width_ * es_;
    dev_.copy(s, session.buffers(0, 0, GRAPHED_BUFFER_ROLE_INPUT)[0], x, act);
    dev_.copy(s, session.buffers(loss, 0, GRAPHED_BUFFER_ROLE_INPUT)[1], target, act);
    session.step(step, s, step_grads_);
    // The loss of the last step, where eager keeps it.
    dev_.copy(s, gy_.get(), session.buffers(loss, 0, GRAPHED_BUFFER_ROLE_OUTPUT)[0], act);
    StepGrads out;
    for (int i = 0; i < layers(); ++i) {
        const graphed::Ref& gw = step_grads_[2 * size_t(i)];
        const graphed::Ref& gb = step_grads_[2 * size_t(i) + 1];
        if (keep) {
            out.w.push_back(values(gw.ptr(), gw.bytes()));
            out.b.push_back(values(gb.ptr(), gb.bytes()));
        }
        if (sgd) {
            dev_.sgd(s, dtype_, w_[i].get(), gw.ptr(), lr, gw.bytes() / es_);
            dev_.sgd(s, dtype_, b_[i].get(), gb.ptr(), lr, gb.bytes() / es_);
        }
    }
    for (auto& g : step_grads_) g.release();
    if (keep) dev_.sync();
    return out;
}

StepGrads Mlp::graphed_step(graphed::Session& session, const void* x, const void* target, float lr, bool side,
                            bool keep, bool sgd) {
    graphed_stream s = dev_.stream();
    size_t act = size_t(batch_) * width_;
    graphed::Replay r;
    r.stream(s).side_stream(side ? dev_.side_stream() : nullptr);
    const void* in = x;
    for (int i = 0; i < layers(); ++i) {
        session.forward(r.callable(static_cast<uint32_t>(i)).data(in), outs_);
        in = outs_[0].ptr();
    }
    dev_.sub(s, dtype_, in, target, gy_.get(), act);
    const void* g = gy_.get();
    grads_.resize(layers());
    for (int i = layers() - 1; i >= 0; --i) {
        session.backward(r.callable(static_cast<uint32_t>(i)).data(g), grads_[i]);
        g = grads_[i].inputs[0].ptr();
    }
    StepGrads out;
    for (int i = 0; i < layers(); ++i) {
        const graphed::Ref& gw = grads_[i].params[0];
        const graphed::Ref& gb = grads_[i].params[1];
        if (keep) {
            out.w.push_back(values(gw.ptr(), gw.bytes()));
            out.b.push_back(values(gb.ptr(), gb.bytes()));
        }
        if (sgd) {
            dev_.sgd(s, dtype_, w_[i].get(), gw.ptr(), lr, gw.bytes() / es_);
            dev_.sgd(s, dtype_, b_[i].get(), gb.ptr(), lr, gb.bytes() / es_);
        }
    }
    // Clones go back once the SGD steps that read them are enqueued.
    for (auto& gr : grads_)
        for (auto& p : gr.params) p.release();
    if (keep) dev_.sync();
    return out;
}

}  // namespace kit
