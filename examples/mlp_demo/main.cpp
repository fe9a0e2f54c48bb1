// graphed demo: an MLP trained with graphed layers next to the same MLP run
// eagerly (weights and grads identical), the aliasing hazard that graphed's
// default prevents, and a strict-lease error. Runs on the GPU when there is
// one, else on the host backend, and says which. Exits non-zero if any
// check fails.
#include "half.hpp"
#include "layers.hpp"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

int failures = 0;

void verdict(bool ok, const char* what) {
    std::printf("   %-58s %s\n", what, ok ? "yes" : "NO  <-- unexpected");
    if (!ok) ++failures;
}

double rel_error(const std::vector<float>& got, const std::vector<float>& want) {
    double num = 0, den = 0;
    for (size_t i = 0; i < got.size(); ++i) {
        num += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
        den += double(want[i]) * want[i];
    }
    return std::sqrt(num / den);
}

graphed::Session session(kit::Device& dev, bool clones, bool strict) {
    graphed_session_config c = graphed::session_config(dev.graphed_kind());
    c.clone_param_grads_on_return = clones;
    c.strict_leases = strict;
    return graphed::Session(c);
}

void train(kit::Device& dev) {
    const int layers = 8, batch = 32, width = dev.backend() == kit::Backend::Cuda ? 512 : 64, steps = 5;
    std::printf("1. Training an MLP: %d layers of width %d, batch %d, %d SGD steps, eager vs graphed\n", layers,
                width, batch, steps);
    kit::Mlp eager(dev, layers, batch, width, 11), graphed(dev, layers, batch, width, 11);
    kit::Buffer x(dev, batch * width * 4), t(dev, batch * width * 4);
    graphed::Session s = session(dev, true, false);
    graphed.register_layers(s, x.f32());
    s.capture();
    bool grads_equal = true;
    for (int step = 0; step < steps; ++step) {
        auto xs = kit::random_floats(batch * width, 50 + step), ts = kit::random_floats(batch * width, 90 + step);
        dev.upload(x.get(), xs.data(), x.bytes());
        dev.upload(t.get(), ts.data(), t.bytes());
        kit::StepGrads e = eager.eager_step(x.f32(), t.f32(), 0.05f);
        double eloss = eager.last_loss();
        kit::StepGrads g = graphed.graphed_step(s, x.f32(), t.f32(), 0.05f);
        double gloss = graphed.last_loss();
        bool same = e.w == g.w && e.b == g.b;
        grads_equal = grads_equal && same;
        std::printf("   step %d: loss eager %.6f, graphed %.6f; all %d grads bit-identical: %s\n", step + 1, eloss,
                    gloss, 2 * layers, same ? "yes" : "NO");
    }
    bool weights_equal = true;
    for (int i = 0; i < layers; ++i)
        weights_equal = weights_equal && eager.weights(i) == graphed.weights(i) && eager.biases(i) == graphed.biases(i);
    verdict(grads_equal, "every grad of every step identical to eager:");
    verdict(weights_equal, "final weights identical to eager:");
    graphed_session_stats st = s.stats();
    std::printf("   %u graphs; static buffers %.2f MiB, scratch %.2f MiB, clones outstanding %llu bytes\n",
                st.graph_count, st.static_bytes / 1048576.0, st.scratch_bytes / 1048576.0,
                static_cast<unsigned long long>(st.clone_bytes_outstanding));
}

// One graphed linear layer; two backward passes accumulated without zeroing,
// as autograd's AccumulateGrad does (the first grad becomes param.grad, the
// second is added into it).
struct Hazard {
    kit::Device& dev;
    kit::Buffer w, b, x[2], gy[2];
    kit::LinearLayer layer;
    explicit Hazard(kit::Device& d) : dev(d) {
        w = kit::Buffer(d, 64 * 32 * 4);
        b = kit::Buffer(d, 64 * 4);
        auto up = [&](kit::Buffer& buf, size_t n, uint32_t seed) {
            buf = kit::Buffer(d, n * 4);
            auto v = kit::random_floats(n, seed);
            d.upload(buf.get(), v.data(), n * 4);
        };
        up(w, 64 * 32, 1);
        up(b, 64, 2);
        for (int i = 0; i < 2; ++i) {
            up(x[i], 8 * 32, 10 + i);
            up(gy[i], 8 * 64, 20 + i);
        }
        layer.dev = &d;
        layer.batch = 8;
        layer.in = 32;
        layer.out = 64;
        layer.w = w.f32();
        layer.b = b.f32();
        layer.name = "fc";
    }
    // One forward and backward replay with x[i] and gy[i]; returns the
    // parameter grads (the output and input grad, and their leases, go).
    std::vector<graphed::Ref> step(graphed::Session& s, int i) {
        graphed::Replay r;
        r.stream(dev.stream());
        s.forward(r.data(x[i].get()));
        return s.backward(r.data(gy[i].get())).params;
    }
    graphed::Session captured(bool clones, bool strict) {
        graphed::Session s = session(dev, clones, strict);
        s.add_callable(layer.callable(x[0].get(), true));
        s.capture();
        return s;
    }
    std::vector<float> eager_wgrad(int i) {
        kit::Buffer z(dev, 8 * 64 * 4), y(dev, 8 * 64 * 4), gz(dev, 8 * 64 * 4), gx(dev, 8 * 32 * 4),
            gw(dev, 64 * 32 * 4), gb(dev, 64 * 4);
        layer.eager_forward(dev.stream(), x[i].f32(), z.f32(), y.f32());
        layer.eager_backward(dev.stream(), x[i].f32(), z.f32(), gy[i].f32(), gz.f32(), gx.f32(), gw.f32(), gb.f32());
        return kit::fetch<float>(dev, gw.get(), 64 * 32);
    }
    // Returns (kept grad intact?, relative error of the accumulated grad).
    std::pair<bool, double> accumulate(bool clones) {
        graphed::Session s = captured(clones, false);
        std::vector<graphed::Ref> g1 = step(s, 0);
        auto kept = kit::fetch<float>(dev, g1[0].ptr(), 64 * 32);
        std::vector<graphed::Ref> g2 = step(s, 1);
        bool intact = kit::fetch<float>(dev, g1[0].ptr(), 64 * 32) == kept;
        dev.add(dev.stream(), g1[0].as<float>(), g2[0].as<const float>(), 64 * 32);
        auto acc = kit::fetch<float>(dev, g1[0].ptr(), 64 * 32);
        auto e1 = eager_wgrad(0), e2 = eager_wgrad(1);
        for (size_t i = 0; i < e1.size(); ++i) e1[i] += e2[i];
        return {intact, rel_error(acc, e1)};
    }
};

void hazard(kit::Device& dev) {
    std::printf("\n2. The aliasing hazard (PyTorch issue 181723): a grad kept across the next backward replay,\n"
                "   and two backward passes accumulated without zeroing, as autograd does\n");
    Hazard h(dev);
    auto [alias_intact, alias_err] = h.accumulate(false);
    auto [clone_intact, clone_err] = h.accumulate(true);
    std::printf("   opt-out (clone_param_grads_on_return = false, grads alias static buffers):\n");
    std::printf("      kept grad intact after the next replay: %s; accumulated grad rel. error %.3f (holds 2*g2)\n",
                alias_intact ? "yes" : "no", alias_err);
    std::printf("   default (grads returned as owned clones):\n");
    std::printf("      kept grad intact after the next replay: %s; accumulated grad rel. error %.3g\n",
                clone_intact ? "yes" : "no", clone_err);
    verdict(!alias_intact && alias_err > 0.5, "opt-out corrupts the kept and accumulated grads:");
    verdict(clone_intact && clone_err == 0.0, "default keeps them exact:");

    std::printf("\n3. Strict leases: keep an aliased grad and replay backward again\n");
    graphed::Session s = h.captured(false, true);
    std::vector<graphed::Ref> g1 = h.step(s, 0);
    graphed_status st = GRAPHED_STATUS_OK;
    try {
        h.step(s, 1);
    } catch (const graphed::Error& e) {
        st = e.status();
        std::printf("   second backward -> %s:\n   \"%s\"\n", graphed::status_name(st), e.message().c_str());
    }
    verdict(st == GRAPHED_STATUS_ALIAS_HELD, "the held alias is reported instead of overwritten:");
    g1.clear();  // releases the leases
    bool ran = true;
    try {
        h.step(s, 1);
    } catch (const graphed::Error& e) {
        std::printf("   %s\n", e.what());
        ran = false;
    }
    verdict(ran, "after releasing the leases the replay runs:");
}

}  // namespace

int main() {
    std::string why;
    std::unique_ptr<kit::Device> dev = kit::make_cuda_device(&why);
    std::printf("graphed %s demo\n", graphed_version());
    if (dev) {
        std::printf("backend: CUDA (GPU found)\n\n");
    } else {
        std::printf("backend: host — no usable GPU here (%s).\n"
                    "The host backend emulates CUDA graphs on the CPU with the same static-buffer semantics;\n"
                    "it is for tests and CI, not a substitute for a GPU.\n\n",
                    why.c_str());
        dev = kit::make_host_device();
    }
    try {
        train(*dev);
        hazard(*dev);
    } catch (const std::exception& e) {
        std::printf("error: %s\n", e.what());
        return 2;
    }
    std::printf("\n%s\n", failures ? "SOME CHECKS FAILED" : "all checks passed");
    return failures ? 1 : 0;
}
