// Suite MicrobatchStep: a step over N microbatches in one graph (gradient
// accumulation in one launch). Each microbatch's input and target are read
// from caller memory by the graph's own copies (graphed_step_io), and the
// parameter grads come back as the sum eager accumulation makes, bit for
// bit: f32 grads added in microbatch order, as autograd adds them into
// .grad. Checked for owned clones of the sum and for ACCUMULATE_INTO, on
// the host and on CUDA (the kit's kernels, or cuBLAS where built), and with
// dropout: each microbatch draws its own masks, as eager's would.
#include "expect.hpp"
#include "layers.hpp"
#include "support.hpp"

namespace {

class MicrobatchStep : public BackendTest {
  protected:
    static constexpr int kLayers = 4, kBatch = 16, kWidth = 64;
    static constexpr size_t kAct = size_t(kBatch) * kWidth * 4;

    // Fresh inputs and targets of `n` microbatches, back to back.
    void data(uint32_t n, uint32_t seed, kit::Buffer& xs, kit::Buffer& ts) {
        auto x = kit::random_floats(size_t(kBatch) * kWidth * n, seed);
        auto t = kit::random_floats(size_t(kBatch) * kWidth * n, seed + 1);
        dev->upload(xs.get(), x.data(), xs.bytes());
        dev->upload(ts.get(), t.data(), ts.bytes());
    }

    static const void* at(const kit::Buffer& b, uint32_t i) { return static_cast<const char*>(b.get()) + i * kAct; }

    // Eager accumulation over the `n` microbatches: each one's grads (lr
    // 0: the weights stay), added in order onto `sum` (empty: the first
    // microbatch's grads start it).
    // `same_masks`: every microbatch draws microbatch 0's dropout masks
    // (what a step that did not tell its callbacks apart would give).
    static void accumulate(kit::Mlp& eager, uint32_t n, const kit::Buffer& xs, const kit::Buffer& ts,
                           kit::StepGrads& sum, bool same_masks = false) {
        // (n microbatches from the start of xs and ts)
        for (uint32_t i = 0; i < n; ++i) {
            kit::StepGrads g = eager.eager_step(at(xs, i), at(ts, i), 0.0f, true, same_masks ? 0 : i);
            if (sum.w.empty()) {
                sum = g;
                continue;
            }
            for (size_t l = 0; l < g.w.size(); ++l) {
                for (size_t k = 0; k < g.w[l].size(); ++k) sum.w[l][k] += g.w[l][k];
                for (size_t k = 0; k < g.b[l].size(); ++k) sum.b[l][k] += g.b[l][k];
            }
        }
    }

    // A step's returned grads (weight and bias per layer, in order)
    // against `want`, bit for bit.
    void expect_grads(const kit::StepGrads& want, const std::vector<graphed::Ref>& grads) {
        for (int l = 0; l < kLayers; ++l) {
            const graphed::Ref& gw = grads[2 * size_t(l)];
            const graphed::Ref& gb = grads[2 * size_t(l) + 1];
            EXPECT_EQ(want.w[l], kit::fetch<float>(*dev, gw.ptr(), gw.bytes() / 4)) << "weight grad " << l;
            EXPECT_EQ(want.b[l], kit::fetch<float>(*dev, gb.ptr(), gb.bytes() / 4)) << "bias grad " << l;
        }
    }

    // Registers the layers (chained, with the loss) and declares the step
    // over all of them with `n` microbatches read from `xs` and `ts`.
    uint32_t build(graphed::Session& s, kit::Mlp& m, uint32_t n, kit::Buffer& xs, kit::Buffer& ts,
                   const std::vector<void*>& dsts = {}, uint32_t loop_mode = GRAPHED_STEP_LOOP_UNROLLED) {
        m.register_layers(s, xs.get(), kit::Wiring{true, false, true});
        std::vector<uint32_t> all;
        for (uint32_t i = 0; i <= uint32_t(kLayers); ++i) all.push_back(i);
        const std::vector<graphed_step_io> io = {
            graphed::Session::step_io(0, GRAPHED_BUFFER_ROLE_INPUT, 0, xs.get(), kAct),
            graphed::Session::step_io(kLayers, GRAPHED_BUFFER_ROLE_INPUT, 1, ts.get(), kAct),
        };
        return s.add_step(all, dsts, n, io, loop_mode);
    }
};

TEST_P(MicrobatchStep, CloneGradsAreEagerAccumulationBitForBit) {
    for (uint32_t n : {1u, 4u, 16u}) {
        SCOPED_TRACE(testing::Message() << n << " microbatches");
        kit::Mlp eager(*dev, kLayers, kBatch, kWidth, 31), graphed(*dev, kLayers, kBatch, kWidth, 31);
        kit::Buffer xs(*dev, kAct * n), ts(*dev, kAct * n);
        data(n, 100, xs, ts);
        graphed::Session s(config());
        const uint32_t step = build(s, graphed, n, xs, ts);
        s.capture();
        std::vector<graphed::Ref> grads;
        for (uint32_t round = 0; round < 3; ++round) {
            SCOPED_TRACE(testing::Message() << "replay " << round);
            data(n, 200 + 10 * round, xs, ts);
            kit::StepGrads want;
            accumulate(eager, n, xs, ts, want);
            s.step(step, dev->stream(), grads);
            dev->sync();
            ASSERT_EQ(grads.size(), size_t(2 * kLayers));
            expect_grads(want, grads);
            for (auto& g : grads) g.release();
        }
        EXPECT_EQ(0u, s.stats().clone_blocks_outstanding);
    }
}

TEST_P(MicrobatchStep, AccumulateIntoAddsEveryMicrobatch) {
    const uint32_t n = 6;
    kit::Mlp eager(*dev, kLayers, kBatch, kWidth, 37), graphed(*dev, kLayers, kBatch, kWidth, 37);
    for (int i = 0; i < kLayers; ++i) graphed.layer(i).param_policy = GRAPHED_GRAD_POLICY_ACCUMULATE_INTO;
    kit::Buffer xs(*dev, kAct * n), ts(*dev, kAct * n);
    std::vector<kit::Buffer> dst;
    std::vector<void*> dsts;
    kit::StepGrads start;
    for (int i = 0; i < kLayers; ++i) {
        start.w.push_back(kit::random_floats(size_t(kWidth) * kWidth, 40 + i));
        start.b.push_back(kit::random_floats(size_t(kWidth), 50 + i));
        dst.push_back(graphed.tensor(start.w.back()));
        dst.push_back(graphed.tensor(start.b.back()));
    }
    for (auto& d : dst) dsts.push_back(d.get());
    graphed::Session s(config());
    const uint32_t step = build(s, graphed, n, xs, ts, dsts);
    s.capture();
    EXPECT_EQ(1u, s.stats().step_graphs) << "no CLONE grads: one graph";
    // Capture ran the step (verification): start from the values again.
    for (int i = 0; i < kLayers; ++i) {
        dev->upload(dst[2 * i].get(), start.w[i].data(), dst[2 * i].bytes());
        dev->upload(dst[2 * i + 1].get(), start.b[i].data(), dst[2 * i + 1].bytes());
    }
    kit::StepGrads want = start;
    std::vector<graphed::Ref> grads;
    for (uint32_t round = 0; round < 2; ++round) {
        data(n, 300 + 10 * round, xs, ts);
        accumulate(eager, n, xs, ts, want);
        s.step(step, dev->stream(), grads);
    }
    dev->sync();
    for (int i = 0; i < kLayers; ++i) {
        EXPECT_EQ(want.w[i], kit::fetch<float>(*dev, dst[2 * i].get(), dst[2 * i].bytes() / 4)) << "layer " << i;
        EXPECT_EQ(want.b[i], kit::fetch<float>(*dev, dst[2 * i + 1].get(), dst[2 * i + 1].bytes() / 4))
            << "bias of layer " << i;
    }
}

TEST_P(MicrobatchStep, HeldSlotsAndBadDeclarationsAreRefused) {
    const uint32_t n = 3;
    kit::Mlp graphed(*dev, kLayers, kBatch, kWidth, 41);
    kit::Buffer xs(*dev, kAct * n), ts(*dev, kAct * n);
    data(n, 400, xs, ts);
    graphed::Session s(config());
    std::vector<uint32_t> all;
    for (uint32_t i = 0; i <= uint32_t(kLayers); ++i) all.push_back(i);
    graphed.register_layers(s, xs.get(), kit::Wiring{true, false, true});
    EXPECT_TRUE(throws(GRAPHED_STATUS_INVALID_ARGUMENT, [&] { s.add_step(all, {}, 0); }, "microbatches is 0"));
    const std::vector<graphed_step_io> overlapping = {
        graphed::Session::step_io(0, GRAPHED_BUFFER_ROLE_INPUT, 0, xs.get(), kAct / 2)};
    EXPECT_TRUE(throws(GRAPHED_STATUS_INVALID_ARGUMENT, [&] { s.add_step(all, {}, n, overlapping); },
                       "would overlap"));
    const std::vector<graphed_step_io> io = {
        graphed::Session::step_io(0, GRAPHED_BUFFER_ROLE_INPUT, 0, xs.get(), kAct),
        graphed::Session::step_io(kLayers, GRAPHED_BUFFER_ROLE_INPUT, 1, ts.get(), kAct)};
    const uint32_t step = s.add_step(all, {}, n, io);
    s.capture();
    std::vector<graphed::Ref> a, b, c;
    s.step(step, dev->stream(), a);
    s.step(step, dev->stream(), b);
    EXPECT_TRUE(throws(GRAPHED_STATUS_ALIAS_HELD, [&] { s.step(step, dev->stream(), c); }, "all 2 are held"));
    for (auto& g : a) g.release();
    s.step(step, dev->stream(), c);
    dev->sync();
}

// One microbatch captured as the body of a conditional WHILE node: each
// replay runs the count it names, counted on the device.
TEST_P(MicrobatchStep, ALoopOnTheDeviceRunsTheCountEachReplayNames) {
    const uint32_t n = 8;
    kit::Mlp eager(*dev, kLayers, kBatch, kWidth, 43), graphed(*dev, kLayers, kBatch, kWidth, 43);
    kit::Buffer xs(*dev, kAct * n), ts(*dev, kAct * n);
    data(n, 500, xs, ts);
    graphed::Session s(config());
    const uint32_t step = build(s, graphed, n, xs, ts, {}, GRAPHED_STEP_LOOP_WHILE);
    s.capture();
    EXPECT_EQ(2u, s.stats().step_graphs) << "one per clone slot";
    std::vector<graphed::Ref> grads;
    for (uint32_t count : {8u, 3u, 1u, 0u, 5u}) {
        SCOPED_TRACE(testing::Message() << count << " microbatches");
        data(n, 600 + count, xs, ts);
        kit::StepGrads want;
        accumulate(eager, count == 0 ? n : count, xs, ts, want);
        s.step(step, dev->stream(), grads, {}, count);
        dev->sync();
        expect_grads(want, grads);
        for (auto& g : grads) g.release();
    }
    EXPECT_TRUE(throws(GRAPHED_STATUS_INVALID_ARGUMENT, [&] { s.step(step, dev->stream(), grads, {}, n + 1); },
                       "declared with 8"));
}

TEST_P(MicrobatchStep, ALoopAccumulatesIntoDestinations) {
    const uint32_t n = 6;
    kit::Mlp eager(*dev, kLayers, kBatch, kWidth, 47), graphed(*dev, kLayers, kBatch, kWidth, 47);
    for (int i = 0; i < kLayers; ++i) graphed.layer(i).param_policy = GRAPHED_GRAD_POLICY_ACCUMULATE_INTO;
    kit::Buffer xs(*dev, kAct * n), ts(*dev, kAct * n);
    std::vector<kit::Buffer> dst;
    std::vector<void*> dsts;
    kit::StepGrads start;
    for (int i = 0; i < kLayers; ++i) {
        start.w.push_back(kit::random_floats(size_t(kWidth) * kWidth, 70 + i));
        start.b.push_back(kit::random_floats(size_t(kWidth), 80 + i));
        dst.push_back(graphed.tensor(start.w.back()));
        dst.push_back(graphed.tensor(start.b.back()));
    }
    for (auto& d : dst) dsts.push_back(d.get());
    graphed::Session s(config());
    const uint32_t step = build(s, graphed, n, xs, ts, dsts, GRAPHED_STEP_LOOP_WHILE);
    s.capture();
    for (int i = 0; i < kLayers; ++i) {
        dev->upload(dst[2 * i].get(), start.w[i].data(), dst[2 * i].bytes());
        dev->upload(dst[2 * i + 1].get(), start.b[i].data(), dst[2 * i + 1].bytes());
    }
    kit::StepGrads want = start;
    std::vector<graphed::Ref> grads;
    for (uint32_t count : {6u, 2u}) {
        data(n, 700 + count, xs, ts);
        accumulate(eager, count, xs, ts, want);
        s.step(step, dev->stream(), grads, {}, count);
    }
    dev->sync();
    for (int i = 0; i < kLayers; ++i) {
        EXPECT_EQ(want.w[i], kit::fetch<float>(*dev, dst[2 * i].get(), dst[2 * i].bytes() / 4)) << "layer " << i;
        EXPECT_EQ(want.b[i], kit::fetch<float>(*dev, dst[2 * i + 1].get(), dst[2 * i + 1].bytes() / 4))
            << "bias of layer " << i;
    }
}

// Dropout after every layer: the callbacks key their masks on the
// microbatch the step runs (graphed_pass_ctx.step_microbatch when unrolled,
// the device's running index, step_microbatch_index, in a WHILE loop), so
// each microbatch draws the mask eager accumulation draws for it, and the
// grads are eager's bit for bit. The masks differ per microbatch: the same
// sum with microbatch 0's masks everywhere is checked to differ.
TEST_P(MicrobatchStep, DropoutDrawsEachMicrobatchsOwnMasks) {
    const uint32_t n = 4;
    for (uint32_t mode : {uint32_t(GRAPHED_STEP_LOOP_UNROLLED), uint32_t(GRAPHED_STEP_LOOP_WHILE)}) {
        SCOPED_TRACE(mode == GRAPHED_STEP_LOOP_WHILE ? "while" : "unrolled");
        kit::Mlp eager(*dev, kLayers, kBatch, kWidth, 53), graphed(*dev, kLayers, kBatch, kWidth, 53);
        eager.set_dropout(0.25f, 0xD5);
        graphed.set_dropout(0.25f, 0xD5);
        kit::Buffer xs(*dev, kAct * n), ts(*dev, kAct * n);
        data(n, 900, xs, ts);
        graphed::Session s(config());
        const uint32_t step = build(s, graphed, n, xs, ts, {}, mode);
        s.capture();
        std::vector<graphed::Ref> grads;
        const std::vector<uint32_t> counts = mode == GRAPHED_STEP_LOOP_WHILE ? std::vector<uint32_t>{4, 3, 4}
                                                                             : std::vector<uint32_t>{0, 0};
        for (size_t round = 0; round < counts.size(); ++round) {
            const uint32_t count = counts[round] == 0 ? n : counts[round];
            SCOPED_TRACE(testing::Message() << "replay " << round << ", " << count << " microbatches");
            data(n, 910 + uint32_t(round), xs, ts);
            kit::StepGrads want, same;
            accumulate(eager, count, xs, ts, want);
            accumulate(eager, count, xs, ts, same, true);
            ASSERT_NE(want.w, same.w) << "the masks of different microbatches differ";
            s.step(step, dev->stream(), grads, {}, counts[round]);
            dev->sync();
            expect_grads(want, grads);
            for (auto& g : grads) g.release();
        }
    }
}

INSTANTIATE_TEST_SUITE_P(Backends, MicrobatchStep, backends(), BackendName());

}  // namespace
