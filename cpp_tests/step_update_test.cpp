// Suite StepUpdate: a C++ trainer's whole iteration in one launch. A step
// over the kit's MLP and loss, with 1 or 4 microbatches, declares an update
// stage: the kit's own optimizer kernels (SGD with momentum, its learning
// rate and momentum in the step's device scalar block, set by each replay)
// captured into the step's graph after the last backward, and a check that
// flags non-finite grads so that an IF node skips the update on the device,
// as a loss scaler does. Over 100 iterations the weights and the momentum
// equal the same kernels run eagerly, bit for bit, on the host and on CUDA;
// iterations whose data overflow are exactly those skipped
// (graphed_step_skipped), and the flag is read only when asked.
#include "expect.hpp"
#include "layers.hpp"
#include "optimizer.hpp"
#include "support.hpp"

#include <array>
#include <cstring>
#include <limits>
#include <stdexcept>

namespace {

// The trainer's optimizer (the kit's: one momentum buffer per parameter,
// the kit's kernels enqueued by the step's update callbacks) and the
// step's scalar block.
using Optimizer = kit::SgdMomentum;
using Scalars = kit::SgdScalars;

class StepUpdate : public BackendTest {
  protected:
    static constexpr int kLayers = 2, kBatch = 8, kWidth = 32, kIterations = 100;
    static constexpr size_t kAct = size_t(kBatch) * kWidth * 4;

    // Iteration `it`'s inputs and targets for `n` microbatches; with
    // `overflow`, one input of the last microbatch is infinite.
    void data(uint32_t n, int it, bool overflow, kit::Buffer& xs, kit::Buffer& ts) {
        auto x = kit::random_floats(size_t(kBatch) * kWidth * n, 1000 + uint32_t(it));
        auto t = kit::random_floats(size_t(kBatch) * kWidth * n, 5000 + uint32_t(it));
        if (overflow) x[x.size() - 5] = std::numeric_limits<float>::infinity();
        dev->upload(xs.get(), x.data(), xs.bytes());
        dev->upload(ts.get(), t.data(), ts.bytes());
    }

    static const void* at(const kit::Buffer& b, uint32_t i) { return static_cast<const char*>(b.get()) + i * kAct; }

    // Momentum buffers (zeroed) for every parameter of `m`.
    void momentum(kit::Mlp& m, Optimizer& o) {
        o.dev = dev.get();
        for (int l = 0; l < m.layers(); ++l) {
            for (size_t bytes : {size_t(kWidth) * kWidth * 4, size_t(kWidth) * 4}) {
                o.momentum.emplace_back(*dev, bytes);
                std::vector<float> zero(bytes / 4, 0.0f);
                dev->upload(o.momentum.back().get(), zero.data(), bytes);
                o.m.push_back(o.momentum.back().f32());
            }
        }
    }

    // The parameters' device pointers, in step order (w, b per layer).
    static std::vector<float*> params(kit::Mlp& m) {
        std::vector<float*> p;
        for (int l = 0; l < m.layers(); ++l) {
            p.push_back(static_cast<float*>(m.layer(l).w));
            p.push_back(static_cast<float*>(m.layer(l).b));
        }
        return p;
    }

    // The eager iteration: each microbatch's grads (lr 0), summed in order
    // on the host as graphed sums them, then the same check and update
    // kernels on the device; an overflowing iteration's weights are put
    // back (the lr-0 SGD of eager_step multiplies 0 by a non-finite grad).
    // Returns whether the update was skipped.
    bool eager_iteration(kit::Mlp& eager, Optimizer& opt, uint32_t n, const kit::Buffer& xs, const kit::Buffer& ts,
                         const kit::Buffer& scalars, std::vector<kit::Buffer>& grads, kit::Buffer& flag) {
        kit::StepGrads sum;
        std::vector<std::vector<float>> before;
        for (int l = 0; l < eager.layers(); ++l) {
            before.push_back(eager.weights(l));
            before.push_back(eager.biases(l));
        }
        for (uint32_t i = 0; i < n; ++i) {
            kit::StepGrads g = eager.eager_step(at(xs, i), at(ts, i), 0.0f, true, i);
            if (sum.w.empty()) {
                sum = g;
                continue;
            }
            for (size_t l = 0; l < g.w.size(); ++l) {
                for (size_t k = 0; k < g.w[l].size(); ++k) sum.w[l][k] += g.w[l][k];
                for (size_t k = 0; k < g.b[l].size(); ++k) sum.b[l][k] += g.b[l][k];
            }
        }
        // The weights before the lr-0 SGD (bit for bit, for finite grads).
        const auto ps = params(eager);
        for (size_t p = 0; p < ps.size(); ++p) dev->upload(ps[p], before[p].data(), before[p].size() * 4);
        for (int l = 0; l < eager.layers(); ++l) {
            dev->upload(grads[2 * size_t(l)].get(), sum.w[size_t(l)].data(), grads[2 * size_t(l)].bytes());
            dev->upload(grads[2 * size_t(l) + 1].get(), sum.b[size_t(l)].data(), grads[2 * size_t(l) + 1].bytes());
        }
        const uint32_t zero = 0;
        dev->upload(flag.get(), &zero, 4);
        graphed_stream s = dev->stream();
        auto* f = static_cast<uint32_t*>(flag.get());
        for (size_t p = 0; p < ps.size(); ++p)
            EXPECT_EQ(0, dev->flag_nonfinite(s, grads[p].f32(), grads[p].bytes() / 4, f));
        uint32_t skipped = 0;
        dev->download(&skipped, flag.get(), 4);
        if (skipped) return true;
        for (size_t p = 0; p < ps.size(); ++p)
            EXPECT_EQ(0, dev->sgd_momentum(s, ps[p], grads[p].f32(), opt.m[p],
                                           static_cast<const float*>(scalars.get()), grads[p].bytes() / 4));
        dev->sync();
        return false;
    }

    // 100 iterations of a graphed trainer against the eager one.
    void train(uint32_t n, uint32_t loop_mode) {
        kit::Mlp eager(*dev, kLayers, kBatch, kWidth, 71), graphed(*dev, kLayers, kBatch, kWidth, 71);
        for (int i = 0; i < kLayers; ++i) graphed.layer(i).param_policy = GRAPHED_GRAD_POLICY_COPY_INTO;
        kit::Buffer xs(*dev, kAct * n), ts(*dev, kAct * n);
        data(n, 0, false, xs, ts);
        Optimizer gopt, eopt;
        momentum(graphed, gopt);
        momentum(eager, eopt);
        // Grad destinations of the step, and the eager run's grads.
        std::vector<kit::Buffer> dst, egrads;
        std::vector<void*> dsts;
        for (int l = 0; l < kLayers; ++l) {
            for (size_t bytes : {size_t(kWidth) * kWidth * 4, size_t(kWidth) * 4}) {
                dst.emplace_back(*dev, bytes);
                egrads.emplace_back(*dev, bytes);
            }
        }
        for (auto& d : dst) dsts.push_back(d.get());
        kit::Buffer escalars(*dev, sizeof(Scalars)), eflag(*dev, 4);
        // Load the kernels once, eagerly, before they are captured.
        {
            kit::Buffer w(*dev, 4), g(*dev, 4), m(*dev, 4);
            const Scalars none{0.0f, 0.0f};
            dev->upload(escalars.get(), &none, sizeof none);
            ASSERT_EQ(0, dev->sgd_momentum(dev->stream(), w.f32(), g.f32(), m.f32(), escalars.f32(), 1));
            ASSERT_EQ(0, dev->flag_nonfinite(dev->stream(), g.f32(), 1, static_cast<uint32_t*>(eflag.get())));
            dev->sync();
        }
        graphed::Session s(config());
        graphed.register_layers(s, xs.get(), kit::Wiring{true, false, true});
        std::vector<uint32_t> all;
        for (uint32_t i = 0; i <= uint32_t(kLayers); ++i) all.push_back(i);
        const std::vector<graphed_step_io> io = {
            graphed::Session::step_io(0, GRAPHED_BUFFER_ROLE_INPUT, 0, xs.get(), kAct),
            graphed::Session::step_io(kLayers, GRAPHED_BUFFER_ROLE_INPUT, 1, ts.get(), kAct),
        };
        graphed::StepUpdate update;
        update.check = &Optimizer::check;
        update.apply = &Optimizer::apply;
        update.data = &gopt;
        update.scalar_bytes = sizeof(Scalars);
        const uint32_t step = s.add_step(all, dsts, n, io, loop_mode, nullptr, nullptr, update);
        s.capture();
        EXPECT_EQ(1u, s.stats().step_graphs) << "COPY_INTO grads: one graph";
        std::vector<graphed::Ref> grads;
        uint64_t skips = 0;
        for (int it = 0; it < kIterations; ++it) {
            SCOPED_TRACE(testing::Message() << "iteration " << it);
            const bool overflow = it % 9 == 4;
            data(n, it, overflow, xs, ts);
            const Scalars sc{0.002f * float(1 + it % 4), 0.9f};
            dev->upload(escalars.get(), &sc, sizeof sc);
            const bool eager_skipped = eager_iteration(eager, eopt, n, xs, ts, escalars, egrads, eflag);
            ASSERT_EQ(overflow, eager_skipped);
            s.step_with(step, dev->stream(), grads, sc);
            const graphed::Skipped sk = s.skipped(step);
            skips += overflow;
            ASSERT_EQ(overflow, sk.last);
            ASSERT_EQ(skips, sk.total);
            for (int l = 0; l < kLayers; ++l) {
                ASSERT_EQ(eager.weights(l), graphed.weights(l)) << "weights of layer " << l;
                ASSERT_EQ(eager.biases(l), graphed.biases(l)) << "biases of layer " << l;
            }
        }
        for (size_t p = 0; p < eopt.m.size(); ++p) {
            const size_t count = eopt.momentum[p].bytes() / 4;
            EXPECT_EQ(kit::fetch<float>(*dev, eopt.m[p], count), kit::fetch<float>(*dev, gopt.m[p], count))
                << "momentum of parameter " << p;
        }
        EXPECT_EQ(uint64_t((kIterations + 4) / 9), skips);
    }
};

TEST_P(StepUpdate, OneMicrobatchTrainsAsEagerBitForBitAndSkipsTheOverflows) { train(1, GRAPHED_STEP_LOOP_UNROLLED); }

TEST_P(StepUpdate, FourMicrobatchesTrainAsEagerBitForBitAndSkipTheOverflows) { train(4, GRAPHED_STEP_LOOP_UNROLLED); }

TEST_P(StepUpdate, FourMicrobatchesInAWhileLoopTrainAsEagerBitForBit) { train(4, GRAPHED_STEP_LOOP_WHILE); }

// Refusals through the C++ layer: scalars of another size, and a step
// without a check asked for its flag; a failing update fails the capture
// with its message and leaves the session open.
TEST_P(StepUpdate, RefusalsAndAFailingUpdate) {
    kit::Mlp graphed(*dev, kLayers, kBatch, kWidth, 73);
    for (int i = 0; i < kLayers; ++i) graphed.layer(i).param_policy = GRAPHED_GRAD_POLICY_COPY_INTO;
    kit::Buffer xs(*dev, kAct), ts(*dev, kAct);
    data(1, 0, false, xs, ts);
    Optimizer opt;
    momentum(graphed, opt);
    std::vector<kit::Buffer> dst;
    std::vector<void*> dsts;
    for (int l = 0; l < kLayers; ++l)
        for (size_t bytes : {size_t(kWidth) * kWidth * 4, size_t(kWidth) * 4}) dst.emplace_back(*dev, bytes);
    for (auto& d : dst) dsts.push_back(d.get());
    graphed::Session s(config());
    graphed.register_layers(s, xs.get(), kit::Wiring{true, false, true});
    std::vector<uint32_t> all;
    for (uint32_t i = 0; i <= uint32_t(kLayers); ++i) all.push_back(i);
    const std::vector<graphed_step_io> io = {
        graphed::Session::step_io(0, GRAPHED_BUFFER_ROLE_INPUT, 0, xs.get(), kAct),
        graphed::Session::step_io(kLayers, GRAPHED_BUFFER_ROLE_INPUT, 1, ts.get(), kAct),
    };
    graphed::StepUpdate failing;
    failing.apply = [](const graphed_update_ctx*, void*) -> int32_t {
        return graphed::guard([]() -> int { throw std::runtime_error("no optimizer state"); });
    };
    failing.scalar_bytes = sizeof(Scalars);
    s.add_step(all, dsts, 1, io, GRAPHED_STEP_LOOP_UNROLLED, nullptr, nullptr, failing);
    EXPECT_TRUE(throws(GRAPHED_STATUS_CALLBACK_FAILED, [&] { s.capture(); },
                       "the update's apply callback of step 0 returned -1 during capture: no optimizer state"));
    EXPECT_EQ(0u, s.stats().graph_count) << "nothing kept";
    // The session stays open: a second step without a check captures.
    graphed::StepUpdate plain;
    plain.apply = &Optimizer::apply;
    plain.data = &opt;
    plain.scalar_bytes = sizeof(Scalars);
    graphed::Session t(config());
    kit::Mlp other(*dev, kLayers, kBatch, kWidth, 73);
    for (int i = 0; i < kLayers; ++i) other.layer(i).param_policy = GRAPHED_GRAD_POLICY_COPY_INTO;
    other.register_layers(t, xs.get(), kit::Wiring{true, false, true});
    const uint32_t step = t.add_step(all, dsts, 1, io, GRAPHED_STEP_LOOP_UNROLLED, nullptr, nullptr, plain);
    t.capture();
    std::vector<graphed::Ref> grads;
    const std::array<float, 3> three{0.1f, 0.9f, 0.0f};
    EXPECT_TRUE(throws(GRAPHED_STATUS_INVALID_ARGUMENT,
                       [&] { t.step(step, dev->stream(), grads, {}, 0, three.data(), sizeof three); },
                       "scalar block is 8 bytes"));
    EXPECT_TRUE(throws(GRAPHED_STATUS_INVALID_ARGUMENT, [&] { t.skipped(step); }, "has no update_check"));
    const auto w0 = other.weights(0);
    t.step_with(step, dev->stream(), grads, Scalars{0.5f, 0.0f});
    dev->sync();
    EXPECT_NE(w0, other.weights(0)) << "the update ran in the step's graph";
}

INSTANTIATE_TEST_SUITE_P(Backends, StepUpdate, backends(), BackendName());

}  // namespace
