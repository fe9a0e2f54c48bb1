// The fixture of the suites over one graphed layer: a fully connected layer
// (x [4x8] -> y [4x16], ReLU) on the backend under test, two inputs and two
// grad-outputs, one forward + backward replay at a time, and the eager
// results of the same kernels (so comparisons are exact).
#pragma once

#include "layers.hpp"
#include "support.hpp"

#include <utility>
#include <vector>

class LayerTest : public BackendTest {
  protected:
    static constexpr int B = 4, IN = 8, OUT = 16;

    void SetUp() override {
        BackendTest::SetUp();
        if (IsSkipped()) return;
        w = kit::Buffer(*dev, OUT * IN * 4);
        b = kit::Buffer(*dev, OUT * 4);
        for (int i = 0; i < 2; ++i) {
            x[i] = kit::Buffer(*dev, B * IN * 4);
            gy[i] = kit::Buffer(*dev, B * OUT * 4);
            up(x[i], kit::random_floats(B * IN, 100 + i));
            up(gy[i], kit::random_floats(B * OUT, 200 + i));
        }
        up(w, kit::random_floats(OUT * IN, 1, 0.5f));
        up(b, kit::random_floats(OUT, 2, 0.5f));
        layer.dev = dev.get();
        layer.batch = B;
        layer.in = IN;
        layer.out = OUT;
        layer.relu = true;
        layer.w = w.f32();
        layer.b = b.f32();
        layer.name = "fc";
    }

    void up(kit::Buffer& buf, const std::vector<float>& v) { dev->upload(buf.get(), v.data(), v.size() * 4); }

    // Registers the layer and captures.
    graphed::Session captured(const graphed_session_config& c) {
        graphed::Session s(c);
        EXPECT_EQ(0u, s.add_callable(layer.callable(x[0].get(), true)));
        s.capture();
        return s;
    }

    // The layer as a callable whose forward is `w`'s: W holds the
    // `kit::LinearLayer* layer` it wraps and a static `forward` (which ends
    // in the layer's); backward is the layer's.
    template <class W>
    graphed::Callable wrapped(W* w) {
        graphed::Callable c = layer.callable(x[0].get(), true);
        c.forward = &W::forward;
        c.backward = [](const graphed_pass_ctx* ctx, void* self) -> int32_t {
            return kit::LinearLayer::backward(ctx, static_cast<W*>(self)->layer);
        };
        c.user_data = w;
        return c;
    }

    // What one forward + backward replay returned.
    struct Step {
        std::vector<graphed::Ref> out;
        graphed::Grads g;
    };

    // A replay on the device's stream.
    graphed::Replay replay() const {
        graphed::Replay r;
        r.stream(dev->stream());
        return r;
    }

    // One forward + backward replay with x[i] and gy[i].
    Step step(graphed::Session& s, int i) {
        Step st;
        st.out = s.forward(replay().data(x[i].get()));
        st.g = s.backward(replay().data(gy[i].get()));
        return st;
    }

    // The same math eagerly: the parameter grads for x[i], gy[i].
    std::vector<float> eager_wgrad(int i, kit::Buffer* into = nullptr) {
        kit::Buffer z(*dev, B * OUT * 4), y(*dev, B * OUT * 4), gz(*dev, B * OUT * 4), gx(*dev, B * IN * 4);
        kit::Buffer gw(*dev, OUT * IN * 4), gb(*dev, OUT * 4);
        EXPECT_EQ(0, layer.eager_forward(dev->stream(), x[i].f32(), z.f32(), y.f32()));
        EXPECT_EQ(0, layer.eager_backward(dev->stream(), x[i].f32(), z.f32(), gy[i].f32(), gz.f32(), gx.f32(),
                                          gw.f32(), gb.f32()));
        auto v = kit::fetch<float>(*dev, gw.get(), OUT * IN);
        if (into) *into = std::move(gw);
        return v;
    }

    std::vector<float> read(const graphed::Ref& r) { return kit::fetch<float>(*dev, r.ptr(), r.bytes() / 4); }

    // Gives the parameter grads back, checking each release.
    static void release(Step& st) {
        for (auto& g : st.g.params) g.release();
    }

    // After a failed capture: the session holds nothing.
    static void expect_nothing_held(const graphed::Session& s) {
        graphed_session_stats st = s.stats();
        EXPECT_EQ(0u, st.captured);
        EXPECT_EQ(0u, st.static_bytes);
        EXPECT_EQ(0u, st.scratch_bytes);
        EXPECT_EQ(0u, st.pool_bytes);
        EXPECT_EQ(0u, st.graph_count);
    }

    kit::Buffer w, b, x[2], gy[2];
    kit::LinearLayer layer;
};
