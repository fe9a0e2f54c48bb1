// Toy layers for graphed: a fully connected layer (optionally with ReLU)
// whose callbacks run the kit's math, and an MLP of them that trains
// eagerly or through a graphed session, for exact comparisons.
#pragma once

#include "kit.hpp"

#include <string>
#include <vector>

namespace kit {

// y = relu?(x W^T + b), W [out x in], b [out]. Forward saves the
// pre-activation z in scratch (via the tape) for backward, which frees it.
// With `split_wgrad`, backward computes only the input grad and a separate
// weight-grad callback computes the parameter grads (delayed wgrad).
struct LinearLayer {
    Device* dev = nullptr;
    int batch = 0, in = 0, out = 0;
    bool relu = true;
    bool split_wgrad = false;
    uint32_t dtype = GRAPHED_DTYPE_F32;  // f32, f16 or bf16
    uint32_t param_flags = GRAPHED_PARAM_FLAGS_NONE;
    uint32_t param_policy = GRAPHED_GRAD_POLICY_DEFAULT;
    void* w = nullptr;
    void* b = nullptr;
    std::string name;
    // Dropout after the activation with this probability (0: none), its
    // mask drawn per microbatch (Device::dropout): under a step's capture
    // from graphed_pass_ctx's step_microbatch or step_microbatch_index.
    float dropout = 0.0f;
    uint64_t dropout_seed = 0;

    // Sizes of the batch dimension to capture (graphed_callable_desc
    // bucket_sizes; empty: one shape, `batch`). The largest is `batch`; the
    // callbacks take their rows from graphed_pass_ctx.bucket_size.
    std::vector<uint64_t> buckets;

    // Filled by callable(); its tensor descriptors point at them.
    int64_t in_shape[2] = {0, 0}, out_shape[2] = {0, 0};

    // The layer as a callable to register (x [batch x in] -> y [batch x out],
    // params w and b): valid while this layer lives.
    graphed::Callable callable(const void* sample_input, bool input_requires_grad);

    static int32_t forward(const graphed_pass_ctx* ctx, void* self);
    static int32_t backward(const graphed_pass_ctx* ctx, void* self);
    static int32_t wgrad(const graphed_pass_ctx* ctx, void* self);

    size_t act_bytes(int features, int rows = 0) const {
        return size_t(rows ? rows : batch) * features * graphed::dtype_size(dtype);
    }
    // The rows a callback works on: its bucket's, else `batch`.
    static int rows(const graphed_pass_ctx* ctx, int batch) {
        return ctx->num_buckets ? static_cast<int>(ctx->bucket_size) : batch;
    }

    // The same math eagerly, on explicit buffers, as microbatch `mb` (read
    // from device memory `mb_at` at run time when it is not NULL).
    // `rows`: the batch rows (0: `batch`).
    int eager_forward(graphed_stream s, const void* x, void* z, void* y, uint32_t mb = 0,
                      const uint32_t* mb_at = nullptr, int rows = 0) const;
    int eager_backward(graphed_stream s, const void* x, const void* z, const void* gy, void* gz, void* gx, void* gw,
                       void* gb, uint32_t mb = 0, const uint32_t* mb_at = nullptr, int rows = 0) const;
};

// The squared-error loss as a callable: inputs y (chained to a layer's
// output) and the target; output d = y - target; backward writes d as the
// grad of y (the grad of 0.5 * |y - target|^2) and ignores its grad-output.
// It puts the loss inside a step graph.
struct LossLayer {
    Device* dev = nullptr;
    int batch = 0, width = 0;
    uint32_t dtype = GRAPHED_DTYPE_F32;
    int64_t shape[2] = {0, 0};

    graphed::Callable callable(uint32_t producer);
    static int32_t forward(const graphed_pass_ctx* ctx, void* self);
    static int32_t backward(const graphed_pass_ctx* ctx, void* self);
    size_t bytes() const { return size_t(batch) * width * graphed::dtype_size(dtype); }
};

// How an Mlp registers its layers with a session.
struct Wiring {
    // Layer i > 0 reads layer i - 1's static output in place (and writes
    // its input grad into that layer's grad-output): nothing is copied
    // between layers.
    bool chain = false;
    // Layer 0's input is rebound to the data each replay passes.
    bool rebind_input = false;
    // A LossLayer after the last layer (chained), so that a step graph can
    // hold a whole training step; its index is layers().
    bool loss = false;
    // The last layer's grad-output is rebound to the data each backward
    // replay passes.
    bool rebind_grad_output = false;
    // Every layer captured in these batch sizes (LinearLayer::buckets; the
    // largest is the Mlp's batch; not with loss).
    std::vector<uint64_t> buckets;
};

// Grads of one training step, copied to the host.
struct StepGrads {
    std::vector<std::vector<float>> w, b;
};

// An MLP of `layers` LinearLayers of width `width` (ReLU on all but the
// last), trained with SGD on the squared error against a target, in f32,
// f16 or bf16.
class Mlp {
  public:
    Mlp(Device& dev, int layers, int batch, int width, uint32_t seed, uint32_t dtype = GRAPHED_DTYPE_F32);
    Mlp(const Mlp&) = delete;
    Mlp& operator=(const Mlp&) = delete;

    int layers() const { return static_cast<int>(layer_.size()); }
    LinearLayer& layer(int i) { return layer_[i]; }
    std::vector<float> weights(int i) { return values(w_[i].get(), w_[i].bytes()); }
    std::vector<float> biases(int i) { return values(b_[i].get(), b_[i].bytes()); }
    // Device memory of `values` in the model's dtype.
    Buffer tensor(const std::vector<float>& values);

    // Dropout with probability p after every layer (LinearLayer::dropout).
    void set_dropout(float p, uint64_t seed);

    // One eager step: forward, loss grad, backward, SGD. Returns the grads
    // (copied to the host only when `keep` is true; else the step is left
    // running on the device). `microbatch` picks the dropout masks.
    StepGrads eager_step(const void* x, const void* target, float lr, bool keep = true, uint32_t microbatch = 0);
    // The same step's forward, loss grad and backward on stream `s`, without
    // the SGD and without waiting (what a hand-captured step graph holds).
    void eager_pass(graphed_stream s, const void* x, const void* target, uint32_t microbatch = 0);

    // 0.5 * sum((y - target)^2) of the last step.
    double last_loss();
    // Where eager_pass writes layer i's weight and bias grads.
    void* grad_w(int i) { return gw_[i].get(); }
    void* grad_b(int i) { return gb_[i].get(); }

    // Registers every layer as a callable of `session` (before capture).
    void register_layers(graphed::Session& session, const void* sample_x, const Wiring& wiring = {});

    // One training step through the step graph `step` of a session wired
    // with a loss (all its callables): x and the target into their static
    // inputs, one step replay, SGD with the returned grads, release.
    StepGrads step_graph_step(graphed::Session& session, uint32_t step, const void* x, const void* target, float lr,
                              bool keep = true, bool sgd = true);
    // One graphed step through a captured session: replays, SGD with the
    // returned grads (whatever their policy), release of clones. With
    // `side` the replays run on the device's side stream.
    StepGrads graphed_step(graphed::Session& session, const void* x, const void* target, float lr, bool side = false,
                           bool keep = true, bool sgd = true);

  private:
    std::vector<float> values(const void* p, size_t bytes);

    Device& dev_;
    int batch_, width_;
    uint32_t dtype_;
    size_t es_;
    std::vector<LinearLayer> layer_;
    std::vector<Buffer> w_, b_;
    // Eager activations and grads.
    std::vector<Buffer> z_, y_, gz_, gx_, gw_, gb_;
    Buffer gy_;
    // What graphed_step's replays return, reused from step to step.
    std::vector<graphed::Ref> outs_;
    std::vector<graphed::Grads> grads_;
    std::vector<graphed::Ref> step_grads_;
    LossLayer loss_;
};

}  // namespace kit
