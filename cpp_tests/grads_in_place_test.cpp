// Suite GradsInPlace: COPY_INTO parameter grads registered with
// GRAPHED_PARAM_FLAGS_REBIND_GRAD, written by the backward graph straight
// into the destination each replay gives (a framework hands fresh memory of
// its allocator to every backward, and keeps the grads it returns). On
// CUDA, capture verifies the grad pass can be pointed elsewhere, and every
// replay into new destinations gives the grads of the same kernels
// launched directly, bit for bit; the grads' own buffers are not written;
// destinations handed out before are never written again; a destination
// less aligned than the grad's buffer is copied into instead. Registration
// refuses the flag without COPY_INTO. The host backend's tasks are opaque:
// capture refuses every grad there (saying why) and replays copy, exactly.
//
// Instances: the kit's CUDA kernels; cuBLAS GEMMs (where the build has
// cuBLAS); the host backend.
#include "kernels.hpp"
#include "layers.hpp"
#include "support.hpp"
#include "tools.hpp"

#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

namespace {

using kit::Buffer;

using graphed_test_kernels::Kernels;
using graphed_test_kernels::kernels_name;
using graphed_test_kernels::KernelsName;

class GradsInPlace : public graphed_test_kernels::KernelsTest {
  protected:
    static constexpr int B = 8, IN = 32, OUT = 16;
    static constexpr size_t NW = size_t(OUT) * IN, NB = OUT;

    void SetUp() override {
        graphed_test_kernels::KernelsTest::SetUp();
        if (!dev) return;
        for (int i = 0; i < 4; ++i) {
            x[i] = Buffer(*dev, size_t(B) * IN * 4);
            gy[i] = Buffer(*dev, size_t(B) * OUT * 4);
            up(x[i], kit::random_floats(size_t(B) * IN, 100 + i));
            up(gy[i], kit::random_floats(size_t(B) * OUT, 200 + i));
        }
        w = Buffer(*dev, NW * 4);
        b = Buffer(*dev, NB * 4);
        up(w, kit::random_floats(NW, 1, 0.5f));
        up(b, kit::random_floats(NB, 2, 0.5f));
        layer.dev = dev.get();
        layer.batch = B;
        layer.in = IN;
        layer.out = OUT;
        layer.relu = true;
        layer.param_policy = GRAPHED_GRAD_POLICY_COPY_INTO;
        layer.param_flags = GRAPHED_PARAM_FLAGS_REBIND_GRAD;
        layer.w = w.get();
        layer.b = b.get();
        layer.name = "fc";
    }

    // Whether capture can verify a grad written elsewhere (CUDA graphs; the
    // host backend's tasks are opaque).
    bool cuda() const { return GetParam() != Kernels::Host; }

    void up(const Buffer& buf, const std::vector<float>& v) { dev->upload(buf.get(), v.data(), v.size() * 4); }
    void up(void* p, const std::vector<float>& v) { dev->upload(p, v.data(), v.size() * 4); }
    std::vector<float> fetch(const void* p, size_t floats) { return kit::fetch<float>(*dev, p, floats); }

    graphed::Session captured() {
        graphed::Session s(graphed::session_config(dev->graphed_kind()));
        EXPECT_EQ(0u, s.add_callable(layer.callable(x[0].get(), true)));
        s.capture();
        return s;
    }

    // The eager weight and bias grads of the layer's kernels on x[i], gy[i].
    std::pair<std::vector<float>, std::vector<float>> eager(int i) {
        const size_t act = size_t(B) * OUT * 4;
        Buffer z(*dev, act), y(*dev, act), gz(*dev, act), gx(*dev, size_t(B) * IN * 4), gw(*dev, NW * 4),
            gb(*dev, NB * 4);
        EXPECT_EQ(0, layer.eager_forward(dev->stream(), x[i].get(), z.get(), y.get()));
        EXPECT_EQ(0, layer.eager_backward(dev->stream(), x[i].get(), z.get(), gy[i].get(), gz.get(), gx.get(),
                                          gw.get(), gb.get()));
        return {fetch(gw.get(), NW), fetch(gb.get(), NB)};
    }

    // A forward then a backward of x[i], gy[i] whose grads go into (dw, db).
    void replay(graphed::Session& s, int i, void* dw, void* db) {
        graphed::Replay r;
        r.stream(dev->stream());
        s.forward(r.data(x[i].get()));
        const std::vector<void*> dsts = {dw, db};
        graphed::Grads g = s.backward(r.data(gy[i].get()).param_dsts(dsts));
        ASSERT_EQ(2u, g.params.size());
        EXPECT_EQ(GRAPHED_REF_KIND_COPY_INTO, g.params[0].kind());
        EXPECT_EQ(dw, g.params[0].ptr());
        EXPECT_EQ(db, g.params[1].ptr());
        dev->sync();
    }

    Buffer x[4], gy[4], w, b;
    kit::LinearLayer layer;
};

// (a) Capture verifies every grad on CUDA, refuses every grad on the host
// backend, and says which in the stats and the plan.
TEST_P(GradsInPlace, CaptureVerifiesOrRefusesEachGrad) {
    graphed::Session s = captured();
    const graphed_session_stats st = s.stats();
    const std::string plan = s.plan_dump();
    EXPECT_EQ(2u, st.grads_in_place + st.grads_in_place_refused) << plan;
    if (GetParam() == Kernels::Cuda) {
        EXPECT_EQ(2u, st.grads_in_place) << plan;
        EXPECT_NE(std::string::npos, plan.find("the grad of param 0 of fc (microbatch 0): written straight into"))
            << plan;
    }
    if (!cuda()) {
        EXPECT_EQ(2u, st.grads_in_place_refused) << plan;
        EXPECT_NE(std::string::npos, plan.find("copied into its destination: the graph runs host tasks")) << plan;
    }
}

// (b) Four replays, each into new destinations: each equals eager bit for
// bit; the destinations of earlier replays keep their grads; the grads' own
// buffers, filled with NaN, are not written by a grad written in place.
TEST_P(GradsInPlace, EachReplayWritesItsOwnDestinationsExactly) {
    graphed::Session s = captured();
    const bool in_place = s.stats().grads_in_place == 2;
    const std::vector<void*> own = s.buffers(0, 0, GRAPHED_BUFFER_ROLE_PARAM_GRADS);
    ASSERT_EQ(2u, own.size());
    const float nan = std::numeric_limits<float>::quiet_NaN();
    up(own[0], std::vector<float>(NW, nan));
    up(own[1], std::vector<float>(NB, nan));
    std::vector<Buffer> dw, db;
    std::vector<std::pair<std::vector<float>, std::vector<float>>> want;
    for (int i = 0; i < 4; ++i) {
        SCOPED_TRACE(testing::Message() << "replay " << i);
        dw.emplace_back(*dev, NW * 4);
        db.emplace_back(*dev, NB * 4);
        up(dw.back(), std::vector<float>(NW, -7.0f));
        up(db.back(), std::vector<float>(NB, -7.0f));
        want.push_back(eager(i));
        replay(s, i, dw.back().get(), db.back().get());
        for (int k = 0; k <= i; ++k) {
            EXPECT_EQ(want[k].first, fetch(dw[k].get(), NW)) << "weight grad of replay " << k;
            EXPECT_EQ(want[k].second, fetch(db[k].get(), NB)) << "bias grad of replay " << k;
        }
        if (in_place) {
            const std::vector<float> gw = fetch(own[0], NW);
            EXPECT_TRUE(std::isnan(gw[0]) && std::isnan(gw[NW - 1])) << "the weight grad's own buffer was written";
        }
    }
    EXPECT_EQ(0u, s.stats().clone_bytes_outstanding);
}

// (c) A destination aligned to 4 bytes only: copied into, exactly.
TEST_P(GradsInPlace, ALessAlignedDestinationIsCopiedInto) {
    graphed::Session s = captured();
    Buffer big(*dev, NW * 4 + 256), db(*dev, NB * 4);
    void* odd = static_cast<char*>(big.get()) + 4;
    const auto want = eager(1);
    replay(s, 1, odd, db.get());
    EXPECT_EQ(want.first, fetch(odd, NW));
    EXPECT_EQ(want.second, fetch(db.get(), NB));
    // And straight into an aligned one again.
    Buffer dw(*dev, NW * 4);
    const auto again = eager(2);
    replay(s, 2, dw.get(), db.get());
    EXPECT_EQ(again.first, fetch(dw.get(), NW));
    EXPECT_EQ(want.first, fetch(odd, NW)) << "the earlier destination was written";
}

// (d) The flag needs COPY_INTO; unknown bits are refused.
TEST_P(GradsInPlace, RegistrationRefusesTheFlagWithoutCopyInto) {
    graphed::Session s(graphed::session_config(dev->graphed_kind()));
    kit::LinearLayer L = layer;
    L.param_policy = GRAPHED_GRAD_POLICY_DEFAULT;
    EXPECT_TRUE(throws(
        GRAPHED_STATUS_INVALID_ARGUMENT, [&] { s.add_callable(L.callable(x[0].get(), true)); },
        std::vector<std::string>{"REBIND_GRAD", "GRAPHED_GRAD_POLICY_COPY_INTO"}));
    L.param_policy = GRAPHED_GRAD_POLICY_COPY_INTO;
    L.param_flags = 16u;
    EXPECT_TRUE(throws(
        GRAPHED_STATUS_INVALID_ARGUMENT, [&] { s.add_callable(L.callable(x[0].get(), true)); }, std::string("unknown bits 0x10")));
}

INSTANTIATE_TEST_SUITE_P(Kernels, GradsInPlace, ::testing::Values(Kernels::Host, Kernels::Cuda, Kernels::Cublas),
                         KernelsName());

}  // namespace
