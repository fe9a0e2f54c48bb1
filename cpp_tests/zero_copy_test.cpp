// Suite ZeroCopy: the paths that copy less must train exactly like eager
// (and like the copying path): chained layers, clone slots (default on),
// held grads falling back to copies, a whole training step as one graph,
// and an input rebound to the caller's data instead of copied. On CUDA
// the rebound input must really be rebound (the kit's kernels take their
// pointers as arguments); on the host it is refused with its reason
// (host tasks are opaque) and copied.
#include "layers.hpp"
#include "support.hpp"

namespace {

class ZeroCopy : public BackendTest {
  protected:
    static constexpr int kLayers = 6, kBatch = 16, kWidth = 64, kSteps = 4;
    static constexpr float kLr = 0.05f;

    // Fresh input and target of step `i`.
    void data(int i, kit::Buffer& x, kit::Buffer& t) {
        auto xs = kit::random_floats(size_t(kBatch) * kWidth, 2000 + i);
        auto ts = kit::random_floats(size_t(kBatch) * kWidth, 3000 + i);
        dev->upload(x.get(), xs.data(), x.bytes());
        dev->upload(t.get(), ts.data(), t.bytes());
    }

    static void same(const kit::StepGrads& e, const kit::StepGrads& g) {
        ASSERT_EQ(e.w.size(), g.w.size());
        for (size_t i = 0; i < e.w.size(); ++i) {
            ASSERT_EQ(e.w[i], g.w[i]) << "weight grad of layer " << i;
            ASSERT_EQ(e.b[i], g.b[i]) << "bias grad of layer " << i;
        }
    }

    static void same_weights(kit::Mlp& a, kit::Mlp& b) {
        for (int i = 0; i < a.layers(); ++i) {
            EXPECT_EQ(a.weights(i), b.weights(i)) << "final weights of layer " << i;
            EXPECT_EQ(a.biases(i), b.biases(i)) << "final biases of layer " << i;
        }
    }
};

TEST_P(ZeroCopy, ChainedLayersTrainLikeEagerWithFewerStaticBytes) {
    kit::Mlp eager(*dev, kLayers, kBatch, kWidth, 7), chained(*dev, kLayers, kBatch, kWidth, 7),
        copied(*dev, kLayers, kBatch, kWidth, 7);
    kit::Buffer x(*dev, size_t(kBatch) * kWidth * 4), t(*dev, x.bytes());
    graphed::Session a(config()), b(config());
    copied.register_layers(a, x.get());
    chained.register_layers(b, x.get(), kit::Wiring{true, false, false});
    a.capture();
    b.capture();
    for (int step = 0; step < kSteps; ++step) {
        SCOPED_TRACE(testing::Message() << "step " << step);
        data(step, x, t);
        kit::StepGrads e = eager.eager_step(x.get(), t.get(), kLr);
        same(e, copied.graphed_step(a, x.get(), t.get(), kLr));
        same(e, chained.graphed_step(b, x.get(), t.get(), kLr, step % 2 == 1));
    }
    same_weights(eager, chained);
    // Each chained layer saves its input and that input's grad buffer.
    const uint64_t act = uint64_t(kBatch) * kWidth * 4;
    EXPECT_EQ(a.stats().static_bytes - b.stats().static_bytes, 2u * (kLayers - 1) * act);
    EXPECT_EQ(b.buffers(1, 0, GRAPHED_BUFFER_ROLE_INPUT)[0], b.buffers(0, 0, GRAPHED_BUFFER_ROLE_OUTPUT)[0]);
}

TEST_P(ZeroCopy, HeldGradsFallBackToCopiesAndStayIntact) {
    kit::Mlp eager(*dev, 2, kBatch, kWidth, 11), graphed(*dev, 2, kBatch, kWidth, 11);
    kit::Buffer x(*dev, size_t(kBatch) * kWidth * 4), t(*dev, x.bytes());
    graphed::Session s(config());
    graphed.register_layers(s, x.get());
    s.capture();
    EXPECT_EQ(2u * 2u, s.stats().slot_graphs) << "two clone slots per layer by default";
    data(0, x, t);
    // One step (lr 0: the weights stay) so that the layers' saved
    // activations hold data: else every weight grad below is zero.
    graphed.graphed_step(s, x.get(), t.get(), 0.0f);
    // Three backwards of the last layer without releasing, each with another
    // grad-output: two clone slots, then a copy into a block of its own.
    // Each keeps what its backward returned.
    std::vector<graphed::Grads> held(3);
    std::vector<std::vector<float>> snap;
    auto grad_of = [&](int k) {
        return kit::fetch<float>(*dev, held[k].params[0].ptr(), held[k].params[0].bytes() / 4);
    };
    kit::Buffer gy(*dev, x.bytes());
    for (int k = 0; k < 3; ++k) {
        auto g = kit::random_floats(size_t(kBatch) * kWidth, 4000 + k);
        dev->upload(gy.get(), g.data(), gy.bytes());
        graphed::Replay r;
        r.stream(dev->stream()).callable(1).data(gy.get());
        s.backward(r, held[k]);
        ASSERT_EQ(GRAPHED_REF_KIND_CLONE, held[k].params[0].kind());
        for (int j = 0; j < k; ++j) EXPECT_NE(held[j].params[0].ptr(), held[k].params[0].ptr());
        dev->sync();
        snap.push_back(grad_of(k));
        if (k > 0) ASSERT_NE(snap[k - 1], snap[k]) << "the rounds' grads must differ, else an overwrite is invisible";
    }
    for (int k = 0; k < 3; ++k) EXPECT_EQ(snap[k], grad_of(k)) << "held grad " << k << " changed";
    EXPECT_EQ(3u, s.stats().clone_blocks_outstanding);
    held.clear();
    EXPECT_EQ(0u, s.stats().clone_blocks_outstanding);
    // And training still matches eager.
    for (int step = 0; step < kSteps; ++step) {
        data(step + 1, x, t);
        same(eager.eager_step(x.get(), t.get(), kLr), graphed.graphed_step(s, x.get(), t.get(), kLr));
    }
}

TEST_P(ZeroCopy, AStepGraphTrainsLikeEager) {
    kit::Mlp eager(*dev, kLayers, kBatch, kWidth, 13), graphed(*dev, kLayers, kBatch, kWidth, 13);
    kit::Buffer x(*dev, size_t(kBatch) * kWidth * 4), t(*dev, x.bytes());
    graphed::Session s(config());
    graphed.register_layers(s, x.get(), kit::Wiring{true, false, true});
    std::vector<uint32_t> all;
    for (uint32_t i = 0; i <= uint32_t(kLayers); ++i) all.push_back(i);
    const uint32_t step_index = s.add_step(all);
    s.capture();
    EXPECT_EQ(2u, s.stats().step_graphs) << "one per clone slot";
    for (int step = 0; step < kSteps; ++step) {
        SCOPED_TRACE(testing::Message() << "step " << step);
        data(step, x, t);
        same(eager.eager_step(x.get(), t.get(), kLr), graphed.step_graph_step(s, step_index, x.get(), t.get(), kLr));
        EXPECT_EQ(eager.last_loss(), graphed.last_loss());
    }
    same_weights(eager, graphed);
    EXPECT_EQ(0u, s.stats().clone_blocks_outstanding);
}

TEST_P(ZeroCopy, AStepAccumulatesIntoFixedDestinations) {
    kit::Mlp eager(*dev, 3, kBatch, kWidth, 17), graphed(*dev, 3, kBatch, kWidth, 17);
    kit::Buffer x(*dev, size_t(kBatch) * kWidth * 4), t(*dev, x.bytes());
    for (int i = 0; i < 3; ++i) graphed.layer(i).param_policy = GRAPHED_GRAD_POLICY_ACCUMULATE_INTO;
    graphed::Session s(config());
    graphed.register_layers(s, x.get(), kit::Wiring{true, false, true});
    std::vector<kit::Buffer> dst;
    std::vector<void*> dsts;
    for (int i = 0; i < 3; ++i) {
        dst.emplace_back(*dev, size_t(kWidth) * kWidth * 4);
        dst.emplace_back(*dev, size_t(kWidth) * 4);
    }
    for (auto& d : dst) dsts.push_back(d.get());
    const uint32_t step_index = s.add_step({0, 1, 2, 3}, dsts);
    s.capture();
    EXPECT_EQ(1u, s.stats().step_graphs) << "no CLONE grads: one graph";
    data(0, x, t);
    kit::StepGrads e = eager.eager_step(x.get(), t.get(), 0.0f);
    for (auto& d : dst) {
        std::vector<float> zero(d.bytes() / 4, 0.0f);
        dev->upload(d.get(), zero.data(), d.bytes());
    }
    // Twice, with lr 0: the destinations hold twice the step's grads.
    graphed.step_graph_step(s, step_index, x.get(), t.get(), 0.0f, false);
    graphed.step_graph_step(s, step_index, x.get(), t.get(), 0.0f, false);
    dev->sync();
    for (int i = 0; i < 3; ++i) {
        auto w = kit::fetch<float>(*dev, dst[2 * i].get(), dst[2 * i].bytes() / 4);
        for (size_t k = 0; k < w.size(); ++k) ASSERT_EQ(e.w[i][k] + e.w[i][k], w[k]) << "layer " << i << " [" << k << "]";
        auto b = kit::fetch<float>(*dev, dst[2 * i + 1].get(), dst[2 * i + 1].bytes() / 4);
        for (size_t k = 0; k < b.size(); ++k)
            ASSERT_EQ(e.b[i][k] + e.b[i][k], b[k]) << "bias of layer " << i << " [" << k << "]";
    }
}

TEST_P(ZeroCopy, AReboundInputAndGradOutputTrainLikeEager) {
    kit::Mlp eager(*dev, kLayers, kBatch, kWidth, 19), graphed(*dev, kLayers, kBatch, kWidth, 19);
    const size_t act = size_t(kBatch) * kWidth * 4;
    // Two input buffers used in turn (the graphs follow), and a third at an
    // address that is not 256-byte aligned (copied instead).
    kit::Buffer xa(*dev, act), xb(*dev, act), xc(*dev, act + 256), t(*dev, act);
    graphed::Session s(config());
    graphed.register_layers(s, xa.get(), kit::Wiring{true, true, false, true});
    s.capture();
    const graphed_session_stats st = s.stats();
    const std::string plan = s.plan_dump();
    // Layer 0's input and the last layer's grad-output.
    const bool cuda = GetParam() == kit::Backend::Cuda;
    EXPECT_EQ(std::vector<bool>{cuda}, s.rebound(0, 0, GRAPHED_BUFFER_ROLE_INPUT)) << plan;
    EXPECT_EQ(std::vector<bool>{false}, s.rebound(1, 0, GRAPHED_BUFFER_ROLE_INPUT)) << "not asked for";
    EXPECT_EQ(std::vector<bool>{cuda}, s.rebound(kLayers - 1, 0, GRAPHED_BUFFER_ROLE_GRAD_OUTPUT)) << plan;
    EXPECT_EQ(std::vector<bool>{false}, s.rebound(0, 0, GRAPHED_BUFFER_ROLE_GRAD_OUTPUT)) << "not asked for";
    if (cuda) {
        EXPECT_EQ(2u, st.inputs_rebound) << plan;
        EXPECT_GT(st.rebind_nodes, 1u) << plan;
        EXPECT_NE(std::string::npos, plan.find("input 0 of fc0 (microbatch 0): rebound at replay")) << plan;
        EXPECT_NE(std::string::npos, plan.find("grad-output 0 of fc" + std::to_string(kLayers - 1) +
                                               " (microbatch 0): rebound at replay"))
            << plan;
    } else {
        EXPECT_EQ(2u, st.inputs_rebind_refused) << plan;
        EXPECT_NE(std::string::npos, plan.find("opaque")) << plan;
    }
    for (int step = 0; step < kSteps + 2; ++step) {
        SCOPED_TRACE(testing::Message() << "step " << step);
        kit::Buffer& holder = step % 3 == 0 ? xa : step % 3 == 1 ? xb : xc;
        void* x = step % 3 == 2 ? static_cast<char*>(xc.get()) + 4 : holder.get();
        auto xs = kit::random_floats(size_t(kBatch) * kWidth, 4000 + step);
        auto ts = kit::random_floats(size_t(kBatch) * kWidth, 5000 + step);
        dev->upload(x, xs.data(), act);
        dev->upload(t.get(), ts.data(), act);
        same(eager.eager_step(x, t.get(), kLr), graphed.graphed_step(s, x, t.get(), kLr));
    }
    same_weights(eager, graphed);
}

// One layer whose input and grad-output are both rebound: its weight-grad
// kernel reads both, so rebinding one must keep the other's current address
// (a plan that set the node's captured arguments pointed the kernel back at
// the static input).
TEST_P(ZeroCopy, AReboundInputAndGradOutputOfOneLayerTrainLikeEager) {
    kit::Mlp eager(*dev, 1, kBatch, kWidth, 23), graphed(*dev, 1, kBatch, kWidth, 23);
    const size_t act = size_t(kBatch) * kWidth * 4;
    kit::Buffer xa(*dev, act), xb(*dev, act), t(*dev, act);
    graphed::Session s(config());
    graphed.register_layers(s, xa.get(), kit::Wiring{false, true, false, true});
    s.capture();
    const std::string plan = s.plan_dump();
    if (GetParam() == kit::Backend::Cuda) EXPECT_EQ(2u, s.stats().inputs_rebound) << plan;
    for (int step = 0; step < kSteps; ++step) {
        SCOPED_TRACE(testing::Message() << "step " << step);
        kit::Buffer& x = step % 2 == 0 ? xa : xb;
        auto xs = kit::random_floats(size_t(kBatch) * kWidth, 6000 + step);
        auto ts = kit::random_floats(size_t(kBatch) * kWidth, 7000 + step);
        dev->upload(x.get(), xs.data(), act);
        dev->upload(t.get(), ts.data(), act);
        same(eager.eager_step(x.get(), t.get(), kLr), graphed.graphed_step(s, x.get(), t.get(), kLr));
    }
    same_weights(eager, graphed);
}

INSTANTIATE_TEST_SUITE_P(Backends, ZeroCopy, backends(), BackendName());

}  // namespace
