// Suite GraphedMlp: an 8-layer fp32 MLP trained for 5 SGD steps through a
// graphed session must match the same MLP trained eagerly bit for bit:
// every parameter grad of every step, and the final weights. The kernels are
// deterministic, so any difference is a bug in capture, replay or grad return.
#include "layers.hpp"
#include "support.hpp"

namespace {

class GraphedMlp : public BackendTest {};

TEST_P(GraphedMlp, MatchesEagerBitExact) {
    const int layers = 8, batch = 16, width = 64, steps = 5;
    const float lr = 0.05f;
    kit::Mlp eager(*dev, layers, batch, width, 7);
    kit::Mlp graphed(*dev, layers, batch, width, 7);

    kit::Buffer x(*dev, batch * width * 4), target(*dev, batch * width * 4);
    auto hx = kit::random_floats(batch * width, 1000);
    dev->upload(x.get(), hx.data(), x.bytes());
    graphed::Session s(config());
    graphed.register_layers(s, x.f32());
    s.capture();
    EXPECT_EQ(2u * layers, s.stats().graph_count);

    for (int step = 0; step < steps; ++step) {
        SCOPED_TRACE(testing::Message() << "step " << step);
        auto xs = kit::random_floats(batch * width, 2000 + step);
        auto ts = kit::random_floats(batch * width, 3000 + step);
        dev->upload(x.get(), xs.data(), x.bytes());
        dev->upload(target.get(), ts.data(), target.bytes());
        kit::StepGrads e = eager.eager_step(x.f32(), target.f32(), lr);
        // Odd steps replay on a side stream, synced back by events.
        kit::StepGrads g = graphed.graphed_step(s, x.f32(), target.f32(), lr, step % 2 == 1);
        for (int i = 0; i < layers; ++i) {
            ASSERT_EQ(e.w[i], g.w[i]) << "weight grad of layer " << i;
            ASSERT_EQ(e.b[i], g.b[i]) << "bias grad of layer " << i;
        }
    }
    for (int i = 0; i < layers; ++i) {
        EXPECT_EQ(eager.weights(i), graphed.weights(i)) << "final weights of layer " << i;
        EXPECT_EQ(eager.biases(i), graphed.biases(i)) << "final biases of layer " << i;
    }
    EXPECT_EQ(0u, s.stats().clone_bytes_outstanding);
}

INSTANTIATE_TEST_SUITE_P(Backends, GraphedMlp, backends(), BackendName());

}  // namespace
