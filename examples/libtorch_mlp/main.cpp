// graphed from a libtorch program (no Python): a 4-layer MLP of
// torch::nn::Linear layers trained with SGD, each layer graphed through
// graphed_torch, next to the same MLP trained eagerly; then the gradient
// aliasing hazard with the opt-out against the default; then memory: graphs
// released one callable at a time, and graphs made, trained and dropped
// again and again, the device's memory coming back. Exits non-zero if a
// check fails.
#include "graphed_torch.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <cuda_runtime_api.h>
#include <torch/torch.h>

#include <cstdio>

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

// Graphs every layer of `m`; the sample input of layer 0 needs no grad.
std::vector<graphed_torch::GraphedCallable> graph(const Mlp& m, const torch::Tensor& x, bool clones) {
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
    graphed_torch::Options o;
    o.clone_param_grads_on_return = clones;
    return graphed_torch::make_graphed_callables(std::move(specs), o);
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
    } catch (const std::exception& e) {
        std::printf("error: %s\n", e.what());
        return 2;
    }
    std::printf("\n%s\n", failures ? "SOME CHECKS FAILED" : "all checks passed");
    return failures ? 1 : 0;
}
