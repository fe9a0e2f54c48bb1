// graphed from a libtorch program (no Python): a 4-layer MLP of
// torch::nn::Linear layers trained with SGD, each layer graphed through
// graphed_torch, next to the same MLP trained eagerly; then the gradient
// aliasing hazard with the opt-out against the default; then memory: graphs
// released one callable at a time, and graphs made, trained and dropped
// again and again, the device's memory coming back; then a C++ trainer's
// whole iteration (4 microbatches, the loss and its own optimizer) in one
// launch, with a learning-rate schedule and a loss scaler's skip on the
// device, against the same trainer run eagerly. Exits non-zero if a check
// fails.
#include "graphed_torch.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <cuda_runtime_api.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

namespace {

struct Mlp {
    std::vector<torch::nn::Linear> layers;
    Mlp(int64_t width, int depth) {
        for (int i = 0; i < depth; ++i) layers.emplace_back(torch::nn::LinearOptions(width, width));
    }
    std::vector<torch::Tensor> parameters() const {
        std::vector<torch::Tensor> p;
        for (auto l : layers)
            for (const auto& t : l->parameters()) p.push_back(t);
        return p;
    }
    void copy_from(const Mlp& o) {
        torch::NoGradGuard g;
        auto a = parameters(), b = o.parameters();
        for (size_t i = 0; i < a.size(); ++i) a[i].copy_(b[i]);
    }
};

torch::Tensor layer_forward(torch::nn::Linear l, const torch::Tensor& x, bool relu) {
    torch::Tensor y = l->forward(x);
    return relu ? torch::relu(y) : y;
}

int failures = 0;

void verdict(bool ok, const char* what) {
    std::printf("   %-60s %s\n", what, ok ? "yes" : "NO  <-- unexpected");
    if (!ok) ++failures;
}

// One callable per layer of `m`; the sample input of layer 0 needs no grad.
std::vector<graphed_torch::CallableSpec> layer_specs(const Mlp& m, const torch::Tensor& x) {
    std::vector<graphed_torch::CallableSpec> specs;
    for (size_t i = 0; i < m.layers.size(); ++i) {
        graphed_torch::CallableSpec s;
        s.name = "fc" + std::to_string(i);
        torch::nn::Linear l = m.layers[i];
        bool relu = i + 1 < m.layers.size();
        s.forward = [l, relu](const std::vector<at::Tensor>& in) {
            return std::vector<at::Tensor>{layer_forward(l, in[0], relu)};
        };
        s.sample_inputs = {i == 0 ? x : x.detach().clone().requires_grad_(true)};
        s.params = l->parameters();
        specs.push_back(std::move(s));
    }
    return specs;
}

// Graphs every layer of `m`.
std::vector<graphed_torch::GraphedCallable> graph(const Mlp& m, const torch::Tensor& x, bool clones) {
    graphed_torch::Options o;
    o.clone_param_grads_on_return = clones;
    return graphed_torch::make_graphed_callables(layer_specs(m, x), o);
}

// ---- 4. The whole iteration in one launch, with the trainer's own optimizer ----

// The trainer's optimizer, SGD with momentum (m = mu * m + g; w -= lr * m),
// written with libtorch ops that a CUDA graph can hold: in place on
// tensors made before capture (no allocation: with a check, the update is
// the body of a conditional node), no host synchronisation (no .item()),
// and the learning rate and momentum read from device memory when the
// kernels run (`lr_mu`, two floats: in the step, its scalar block), so
// that a schedule changes them between replays without a recapture. The
// eager trainer calls the same function: the same ops in the same order.
struct SgdMomentum {
    std::vector<torch::Tensor> params, momentum;
    explicit SgdMomentum(std::vector<torch::Tensor> p) : params(std::move(p)) {
        for (const auto& t : params) momentum.push_back(torch::zeros_like(t));
    }
    void step(const std::vector<torch::Tensor>& grads, const torch::Tensor& lr_mu) {
        torch::NoGradGuard no_grad;
        const torch::Tensor lr = lr_mu.narrow(0, 0, 1), mu = lr_mu.narrow(0, 1, 1);  // views, no copy
        for (size_t i = 0; i < params.size(); ++i) {
            momentum[i].mul_(mu).add_(grads[i]);
            params[i].addcmul_(momentum[i], lr, -1);
        }
    }
};

// What the step's scalar block holds (StepOptions::scalar_bytes); each
// replay copies new values in.
struct Scalars {
    float lr, mu;
};

// A loss scaler's check: sets `flag` (int32, one element) to 1 when a
// grad holds an inf or a NaN. In the step it runs before the update, and
// a flag set skips the update on the device.
void flag_nonfinite(const std::vector<torch::Tensor>& grads, const torch::Tensor& flag) {
    torch::NoGradGuard no_grad;
    std::vector<torch::Tensor> finite;
    for (const auto& g : grads) finite.push_back(torch::isfinite(g).all());
    flag.copy_(torch::stack(finite).all().logical_not().reshape({1}));
}

// Warm-up, then a cosine decay: the learning rate of iteration `it` of `n`.
float lr_at(int it, int n) {
    const float peak = 0.05f;
    if (it < 5) return peak * float(it + 1) / 5.0f;
    return 0.5f * peak * (1.0f + std::cos(3.14159265f * float(it - 5) / float(n - 5)));
}

// Trains two copies of `init` (depth layers, width `width`) for
// `iterations` iterations of `microbatches` microbatches (the loss
// torch::mse_loss), with SgdMomentum and lr_at's schedule: one copy
// graphed as one step (forward, backward, grad sum and update in one
// launch), the other eagerly. With `check`, the step checks the grads
// first (flag_nonfinite) and every fifth iteration's data holds an inf:
// those iterations must skip their update, in both.
void whole_iteration(const Mlp& init, int64_t batch, int64_t width, uint32_t microbatches, int iterations, bool check,
                     const torch::Device& dev) {
    const size_t depth = init.layers.size();
    Mlp eager(width, int(depth)), model(width, int(depth));
    for (auto& l : eager.layers) l->to(dev);
    for (auto& l : model.layers) l->to(dev);
    eager.copy_from(init);
    model.copy_from(init);
    SgdMomentum eager_opt(eager.parameters()), opt(model.parameters());

    // Every kernel of the update run once before capture (on copies), so
    // that none is loaded for the first time under capture.
    {
        std::vector<torch::Tensor> copies, zeros;
        for (const auto& p : model.parameters()) {
            copies.push_back(p.detach().clone());
            zeros.push_back(torch::zeros_like(p));
        }
        SgdMomentum(copies).step(zeros, torch::zeros({2}, dev));
        flag_nonfinite(zeros, torch::zeros({1}, torch::TensorOptions(dev).dtype(torch::kInt)));
    }

    // The step: the layers, then the loss (its last callable), each
    // parameter's grad summed over the microbatches into its .grad
    // (copy_into: set, not added), then the update.
    torch::Tensor sample = torch::zeros({batch, width}, dev);
    std::vector<graphed_torch::CallableSpec> specs = layer_specs(model, sample);
    graphed_torch::CallableSpec loss;
    loss.name = "loss";
    loss.forward = [](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{torch::mse_loss(in[0], in[1])}; };
    loss.sample_inputs = {sample.clone().requires_grad_(true), sample.clone()};
    specs.push_back(std::move(loss));
    for (auto& p : model.parameters()) p.mutable_grad() = torch::zeros_like(p);
    graphed_torch::Options o;
    o.accumulate_into = "grad";
    o.copy_into = true;
    graphed_torch::StepOptions so;
    so.microbatches = microbatches;
    so.destination = [](const at::Tensor& p) { return p.grad(); };
    so.scalar_bytes = sizeof(Scalars);
    so.update_apply = [&opt](const graphed_torch::StepUpdateView& v) { opt.step(v.grads, v.scalars.view(torch::kFloat)); };
    if (check) so.update_check = [](const graphed_torch::StepUpdateView& v) { flag_nonfinite(v.grads, v.skip_flag); };
    auto made = graphed_torch::make_graphed_step(std::move(specs), o, so);
    const graphed_torch::GraphedStep& step = made.second;

    torch::Tensor eager_lr_mu = torch::zeros({2}, dev), eager_flag = torch::zeros({1}, torch::TensorOptions(dev).dtype(torch::kInt));
    bool losses_equal = true, skips_equal = true;
    int skipped = 0;
    float lr_min = 1e9f, lr_max = 0.0f;
    for (int it = 0; it < iterations; ++it) {
        torch::Tensor xs = torch::randn({int64_t(microbatches), batch, width}, dev);
        torch::Tensor ts = 0.1 * torch::randn({int64_t(microbatches), batch, width}, dev);
        const bool overflow = check && it % 5 == 3;
        if (overflow) xs[int64_t(microbatches) - 1][0][0].fill_(std::numeric_limits<float>::infinity());
        const Scalars sc{lr_at(it, iterations), 0.9f};
        lr_min = std::min(lr_min, sc.lr);
        lr_max = std::max(lr_max, sc.lr);

        // Graphed: one launch, the scalars copied in on the way.
        torch::Tensor losses = step({xs, ts}, 0, &sc, sizeof sc);

        // Eager: the same microbatches, grads accumulated by autograd, the
        // same check and update.
        std::vector<torch::Tensor> eager_losses;
        for (auto& p : eager.parameters()) p.mutable_grad().reset();
        for (int64_t mb = 0; mb < int64_t(microbatches); ++mb) {
            torch::Tensor y = xs[mb];
            for (size_t i = 0; i < depth; ++i) y = layer_forward(eager.layers[i], y, i + 1 < depth);
            torch::Tensor l = torch::mse_loss(y, ts[mb]);
            l.backward();
            eager_losses.push_back(l.detach());
        }
        std::vector<torch::Tensor> grads;
        for (const auto& p : eager.parameters()) grads.push_back(p.grad());
        bool skip = false;
        if (check) {
            eager_flag.zero_();
            flag_nonfinite(grads, eager_flag);
            skip = eager_flag.item<int>() != 0;  // eager may synchronise; the step never does
        }
        if (!skip) {
            eager_lr_mu.copy_(torch::tensor({sc.lr, sc.mu}));
            eager_opt.step(grads, eager_lr_mu);
        }

        // Overflowing iterations have NaN losses: compared where finite.
        if (!overflow) losses_equal = losses_equal && torch::equal(losses, torch::stack(eager_losses));
        if (check) {
            // A trainer asks only when it logs (skipped() waits for the
            // replay); asked at every iteration here, to check each one.
            const graphed_torch::StepSkipped k = step.skipped();
            skips_equal = skips_equal && k.last == skip && skip == overflow;
            skipped += skip;
            if (it + 1 == iterations) skips_equal = skips_equal && k.total == uint64_t(skipped);
        }
    }
    bool weights_equal = true, momentum_equal = true;
    auto pe = eager.parameters(), pg = model.parameters();
    for (size_t k = 0; k < pe.size(); ++k) {
        weights_equal = weights_equal && torch::equal(pe[k], pg[k]);
        momentum_equal = momentum_equal && torch::equal(eager_opt.momentum[k], opt.momentum[k]);
    }
    std::printf("   %d iterations, lr from %.4f to %.4f, given to each replay in the scalar block (no recapture)\n",
                iterations, lr_min, lr_max);
    verdict(losses_equal, "every microbatch's loss equal to eager:");
    verdict(weights_equal, "final weights equal to eager, bit for bit:");
    verdict(momentum_equal, "final momentum buffers equal to eager, bit for bit:");
    verdict(!torch::equal(pg[0], init.parameters()[0]), "the weights did train:");
    if (check) {
        std::printf("   iterations with an inf in their data: %d of %d\n", skipped, iterations);
        verdict(skips_equal, "exactly those skipped their update (on the device), as eager:");
    }
}

}  // namespace

int main() {
    if (!torch::cuda::is_available()) {
        std::printf("no CUDA device: this example needs a GPU\n");
        return 2;
    }
    try {
        torch::manual_seed(0);
        const int64_t width = 512, batch = 64;
        const torch::Device dev(torch::kCUDA);
        Mlp eager(width, 4), graphed_model(width, 4);
        for (auto& l : eager.layers) l->to(dev);
        for (auto& l : graphed_model.layers) l->to(dev);
        graphed_model.copy_from(eager);
        torch::Tensor sample = torch::randn({batch, width}, dev);
        auto layers = graph(graphed_model, sample, true);

        std::printf("1. A 4-layer MLP (width %ld, batch %ld) trained for 5 SGD steps, eager vs graphed\n", width, batch);
        torch::optim::SGD oe(eager.parameters(), 0.05), og(graphed_model.parameters(), 0.05);
        bool grads_equal = true;
        for (int step = 0; step < 5; ++step) {
            torch::Tensor x = torch::randn({batch, width}, dev), t = torch::randn({batch, width}, dev);
            oe.zero_grad();
            og.zero_grad();
            torch::Tensor ye = x, yg = x;
            for (size_t i = 0; i < eager.layers.size(); ++i) {
                ye = layer_forward(eager.layers[i], ye, i + 1 < eager.layers.size());
                yg = layers[i]({yg})[0];
            }
            torch::mse_loss(ye, t).backward();
            torch::mse_loss(yg, t).backward();
            auto pe = eager.parameters(), pg = graphed_model.parameters();
            for (size_t k = 0; k < pe.size(); ++k) grads_equal = grads_equal && torch::equal(pe[k].grad(), pg[k].grad());
            oe.step();
            og.step();
        }
        bool weights_equal = true;
        auto pe = eager.parameters(), pg = graphed_model.parameters();
        for (size_t k = 0; k < pe.size(); ++k) weights_equal = weights_equal && torch::equal(pe[k], pg[k]);
        verdict(grads_equal, "every param.grad of every step equal to eager:");
        verdict(weights_equal, "final weights equal to eager:");

        std::printf("\n2. Two backward passes accumulated into param.grad without zeroing\n");
        for (bool clones : {false, true}) {
            Mlp m(width, 1);
            m.layers[0]->to(dev);
            m.copy_from(eager);
            Mlp ref(width, 1);
            ref.layers[0]->to(dev);
            ref.copy_from(eager);
            auto g = graph(m, sample, clones);
            torch::Tensor x1 = torch::randn({batch, width}, dev), x2 = torch::randn({batch, width}, dev);
            for (const torch::Tensor& x : {x1, x2}) {
                g[0]({x})[0].sum().backward();
                layer_forward(ref.layers[0], x, false).sum().backward();
            }
            torch::Tensor got = m.layers[0]->weight.grad(), want = ref.layers[0]->weight.grad();
            double err = ((got - want).norm() / want.norm()).item<double>();
            std::printf("   %s: weight.grad relative error against eager g1 + g2: %.3g\n",
                        clones ? "default (owned clones)" : "opt-out (aliases)", err);
            verdict(clones ? err == 0.0 : err > 0.5,
                    clones ? "default accumulates exactly:" : "opt-out is corrupted, as documented:");
        }

        std::printf("\n3. Memory: one callable released while the others replay; graphs dropped\n");
        {
            Mlp m(width, 4), ref(width, 4);
            for (auto& l : m.layers) l->to(dev);
            for (auto& l : ref.layers) l->to(dev);
            m.copy_from(eager);
            ref.copy_from(eager);
            auto g = graph(m, sample, true);
            g[0].release();
            const graphed_torch::MemoryReport r = graphed_torch::memory_report();
            const graphed_torch::CallableMemory& first = r.sessions.back().callables[0];
            verdict(first.released && first.graphs == 0 && first.own_static_bytes == 0 && first.torch_bytes == 0,
                    "the released callable holds no graph and no memory:");
            verdict(r.sessions.back().callables[1].graphs > 0, "the others keep theirs:");
            torch::Tensor x = torch::randn({batch, width}, dev);
            torch::Tensor y = layer_forward(m.layers[0], x, true), ye = layer_forward(ref.layers[0], x, true);
            for (size_t i = 1; i < m.layers.size(); ++i) {
                y = g[i]({y})[0];
                ye = layer_forward(ref.layers[i], ye, i + 1 < m.layers.size());
            }
            verdict(torch::equal(y, ye), "the others replay, equal to eager:");
            bool refused = false;
            try {
                g[0]({x});
            } catch (const std::runtime_error&) {
                refused = true;
            }
            verdict(refused, "a call of the released callable throws:");
        }
        auto cycle = [&] {
            Mlp m(width, 4);
            for (auto& l : m.layers) l->to(dev);
            m.copy_from(eager);
            auto g = graph(m, sample, true);
            torch::optim::SGD o(m.parameters(), 0.05);
            torch::Tensor y = torch::randn({batch, width}, dev), t = torch::randn({batch, width}, dev);
            for (auto& layer : g) y = layer({y})[0];
            torch::mse_loss(y, t).backward();
            o.step();
            o.zero_grad();
        };
        auto used = [] {
            torch::cuda::synchronize();
            c10::cuda::CUDACachingAllocator::emptyCache();
            size_t free = 0, total = 0;
            cudaMemGetInfo(&free, &total);
            return total - free;
        };
        cycle();  // the first loads kernels and workspaces
        const size_t base = used();
        const graphed_torch::MemoryReport before = graphed_torch::memory_report();
        for (int k = 0; k < 4; ++k) cycle();
        const size_t after = used();
        std::printf("   device memory in use after the first cycle %.1f MiB, after four more %.1f MiB\n",
                    base / 1048576.0, after / 1048576.0);
        verdict(after == base, "graphs made, trained and dropped four times give every byte back:");
        const graphed_torch::MemoryReport now = graphed_torch::memory_report();
        verdict(now.sessions.size() == before.sessions.size() &&
                    now.graphed.device_bytes == before.graphed.device_bytes &&
                    now.graphed.sessions == before.graphed.sessions && now.graphed.graphs == before.graphed.graphs,
                "graphed's own accounting is back where it was (every session dropped is gone):");
        std::printf("\n4. The whole iteration in one launch: 4 microbatches, the loss and the trainer's own\n"
                    "   SGD with momentum in one step graph, a learning-rate schedule, against eager\n");
        whole_iteration(eager, batch, width, 4, 20, false, dev);
        std::printf("   With a loss scaler's check (the update skipped on the device when a grad is not finite):\n");
        whole_iteration(eager, batch, width, 4, 20, true, dev);
    } catch (const std::exception& e) {
        std::printf("error: %s\n", e.what());
        return 2;
    }
    std::printf("\n%s\n", failures ? "SOME CHECKS FAILED" : "all checks passed");
    return failures ? 1 : 0;
}
