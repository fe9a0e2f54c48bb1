// Suite MovedParams: parameters registered with GRAPHED_PARAM_FLAGS_REBIND
// that move between iterations (an optimizer or a framework that puts a
// weight in fresh memory). On CUDA, a forward replay given the parameters'
// new addresses (graphed_replay_args.params) points the instance's graphs
// there: outputs, input grads and parameter grads must equal, bit for bit,
// the same kernels launched directly on the new weights, with every grad
// policy, in a pipeline whose earlier microbatch still has its backward to
// run on the old weights, and in a step. The old memory is then not read:
// it is filled with other values, then freed (compute-sanitizer memcheck
// runs this suite's CUDA instances). Moves the graphs cannot follow (a less
// aligned address, a parameter registered without the flag, a backward at
// another address than its forward) are refused with their reason, enqueue
// nothing, and the next correct replay is exact.
//
// Instances: the kit's CUDA kernels; cuBLAS GEMMs for the linear layers
// (where the build has cuBLAS); the host backend, whose host tasks are
// opaque, so that every move there is refused (GRAPHED_STATUS_PARAM_MOVED)
// while replays at the registered addresses stay exact.
#include "kernels.hpp"
#include "layers.hpp"
#include "support.hpp"
#include "tools.hpp"

#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

namespace {

using kit::Buffer;

using graphed_test_kernels::Kernels;
using graphed_test_kernels::kernels_name;
using graphed_test_kernels::KernelsName;

// An address as the library's messages print it.
std::string hex(const void* p) {
    char b[32];
    std::snprintf(b, sizeof b, "0x%" PRIxPTR, reinterpret_cast<uintptr_t>(p));
    return b;
}

class MovedParams : public graphed_test_kernels::KernelsTest {
  protected:
    static constexpr int B = 8, IN = 32, OUT = 16;

    void SetUp() override {
        graphed_test_kernels::KernelsTest::SetUp();
        if (!dev) return;
        for (int i = 0; i < 3; ++i) {
            x[i] = Buffer(*dev, size_t(B) * IN * 4);
            gy[i] = Buffer(*dev, size_t(B) * OUT * 4);
            up(x[i], kit::random_floats(size_t(B) * IN, 100 + i));
            up(gy[i], kit::random_floats(size_t(B) * OUT, 200 + i));
        }
        reg = params(1);
        layer.dev = dev.get();
        layer.batch = B;
        layer.in = IN;
        layer.out = OUT;
        layer.relu = true;
        layer.param_flags = GRAPHED_PARAM_FLAGS_REBIND;
        layer.w = reg.w.get();
        layer.b = reg.b.get();
        layer.name = "fc";
    }

    // Whether the graphs can follow a move here (CUDA graphs; the host
    // backend's tasks are opaque).
    bool movable() const { return GetParam() != Kernels::Host; }

    graphed_session_config config() const { return graphed::session_config(dev->graphed_kind()); }

    void up(const Buffer& buf, const std::vector<float>& v) { dev->upload(buf.get(), v.data(), v.size() * 4); }
    void up(void* p, const std::vector<float>& v) { dev->upload(p, v.data(), v.size() * 4); }
    std::vector<float> fetch(const void* p, size_t floats) { return kit::fetch<float>(*dev, p, floats); }
    std::vector<float> fetch(const Buffer& b) { return fetch(b.get(), b.bytes() / 4); }
    std::vector<float> read(const graphed::Ref& r) { return fetch(r.ptr(), r.bytes() / 4); }

    // A linear layer's parameters in device memory of their own: w
    // [out x in], b [out], random values from `seed`.
    struct Params {
        Buffer w, b;
        std::vector<const void*> at() const { return {w.get(), b.get()}; }
    };
    Params params(uint32_t seed, int in = IN, int out = OUT) {
        Params p{Buffer(*dev, size_t(out) * in * 4), Buffer(*dev, size_t(out) * 4)};
        up(p.w, kit::random_floats(size_t(out) * in, seed, 0.5f));
        up(p.b, kit::random_floats(size_t(out), seed + 1, 0.5f));
        return p;
    }

    // What one forward + backward computes.
    struct Result {
        std::vector<float> y, gx, gw, gb;
    };

    // The input and parameter grads of a backward replay, read into `r`.
    void take(Result& r, const graphed::Grads& g) {
        r.gx = read(g.inputs[0]);
        r.gw = read(g.params[0]);
        r.gb = read(g.params[1]);
    }

    static void expect_same(const Result& e, const Result& g, const std::string& what) {
        EXPECT_EQ(e.y, g.y) << "output, " << what;
        EXPECT_EQ(e.gx, g.gx) << "input grad, " << what;
        EXPECT_EQ(e.gw, g.gw) << "weight grad, " << what;
        EXPECT_EQ(e.gb, g.gb) << "bias grad, " << what;
    }

    // The layer `like`'s kernels launched directly, its parameters at (w, b).
    Result eager(const kit::LinearLayer& like, const void* w, const void* b, const void* xin, const void* g) {
        kit::LinearLayer L = like;
        L.w = const_cast<void*>(w);
        L.b = const_cast<void*>(b);
        const size_t act = size_t(B) * L.out * 4;
        Buffer z(*dev, act), y(*dev, act), gz(*dev, act), gx(*dev, size_t(B) * L.in * 4),
            gw(*dev, size_t(L.out) * L.in * 4), gb(*dev, size_t(L.out) * 4);
        EXPECT_EQ(0, L.eager_forward(dev->stream(), xin, z.get(), y.get()));
        EXPECT_EQ(0, L.eager_backward(dev->stream(), xin, z.get(), g, gz.get(), gx.get(), gw.get(), gb.get()));
        return Result{fetch(y), fetch(gx), fetch(gw), fetch(gb)};
    }
    Result eager(const void* w, const void* b, int i) { return eager(layer, w, b, x[i].get(), gy[i].get()); }
    Result eager(const Params& p, int i) { return eager(p.w.get(), p.b.get(), i); }

    // A session over the layer (registered as callable 0), captured.
    graphed::Session captured(const graphed_session_config& c) {
        graphed::Session s(c);
        EXPECT_EQ(0u, s.add_callable(layer.callable(x[0].get(), true)));
        s.capture();
        return s;
    }

    // One forward + backward replay of (callable 0, microbatch `mb`) with
    // x[i], gy[i], the parameters at `at` (empty: no array), CLONE or
    // ALIAS grads.
    Result replayed(graphed::Session& s, int i, const std::vector<const void*>& at, uint32_t mb = 0) {
        graphed::Replay r(0, mb);
        r.stream(dev->stream());
        if (!at.empty()) r.params(at);
        Result got;
        got.y = read(s.forward(r.data(x[i].get()))[0]);
        graphed::Grads g = s.backward(r.data(gy[i].get()));
        take(got, g);
        return got;
    }

    Buffer x[3], gy[3];
    Params reg;  // where the layer's parameters are registered
    kit::LinearLayer layer;
};

// (a) Capture verifies the graphs can follow the parameters, reports it,
// and gives the parameters' bytes back; replays at unchanged addresses (the
// registered ones, NULL entries, no array) are exact and move nothing.
TEST_P(MovedParams, RegisteredWithTheFlagTheyAreVerifiedMovable) {
    const std::vector<float> w_before = fetch(reg.w), b_before = fetch(reg.b);
    graphed::Session s = captured(config());
    const graphed_session_stats st = s.stats();
    const std::string plan = s.plan_dump();
    if (movable()) {
        EXPECT_EQ((std::vector<bool>{true, true}), s.params_movable(0)) << plan;
        EXPECT_EQ(2u, st.params_movable) << plan;
        EXPECT_EQ(0u, st.params_move_refused) << plan;
        EXPECT_NE(std::string::npos, plan.find("param 0 of fc (microbatch 0): movable")) << plan;
        EXPECT_NE(std::string::npos, plan.find("param 1 of fc (microbatch 0): movable")) << plan;
    } else {
        EXPECT_EQ((std::vector<bool>{false, false}), s.params_movable(0)) << plan;
        EXPECT_EQ(0u, st.params_movable) << plan;
        EXPECT_EQ(2u, st.params_move_refused) << plan;
        EXPECT_NE(std::string::npos, plan.find("param 0 of fc (microbatch 0): fixed at its registered address"))
            << plan;
    }
    EXPECT_EQ(0u, st.param_moves);
    EXPECT_EQ(w_before, fetch(reg.w)) << "capture's verification gives the parameter's bytes back";
    EXPECT_EQ(b_before, fetch(reg.b)) << "capture's verification gives the parameter's bytes back";

    expect_same(eager(reg, 0), replayed(s, 0, {}), "no address array");
    expect_same(eager(reg, 1), replayed(s, 1, reg.at()), "the registered addresses");
    expect_same(eager(reg, 2), replayed(s, 2, {nullptr, nullptr}), "NULL entries");
    EXPECT_EQ(0u, s.stats().param_moves);
    EXPECT_EQ(0u, s.stats().clone_bytes_outstanding);
}

// (b) Moved to fresh memory with other values, the replays compute with the
// new weights, bit for bit; the old memory, filled with other values and
// then freed, is not read again; back and forth, and one parameter alone.
TEST_P(MovedParams, ReplaysFollowMovedParamsBitForBit) {
    graphed::Session s = captured(config());
    Params moved[2] = {params(11), params(21)};
    ASSERT_NE(eager(reg, 0).y, eager(moved[0], 0).y) << "the moved weights must change the results";
    if (!movable()) {
        EXPECT_TRUE(throws(
            GRAPHED_STATUS_PARAM_MOVED, [&] { replayed(s, 0, moved[0].at()); },
            {"param 0 of callable 'fc' (microbatch 0) moved from " + hex(reg.w.get()) + " to " +
             hex(moved[0].w.get())}));
        expect_same(eager(reg, 0), replayed(s, 0, reg.at()), "after the refusal");
        EXPECT_EQ(0u, s.stats().param_moves);
        return;
    }
    uint64_t moves = 0;
    // To fresh memory.
    expect_same(eager(moved[0], 0), replayed(s, 0, moved[0].at()), "moved");
    moves += 2;
    EXPECT_EQ(moves, s.stats().param_moves);

    // The old memory holds other values now: the graphs do not read it.
    up(reg.w, kit::random_floats(size_t(OUT) * IN, 991, 4.0f));
    up(reg.b, kit::random_floats(OUT, 992, 4.0f));
    expect_same(eager(moved[0], 1), replayed(s, 1, moved[0].at()), "the old memory overwritten");
    // The old memory freed (memcheck: no read of it).
    reg.w.reset();
    reg.b.reset();
    expect_same(eager(moved[0], 2), replayed(s, 2, {}), "the old memory freed, no address array");
    expect_same(eager(moved[0], 0), replayed(s, 0, {nullptr, nullptr}), "the old memory freed, NULL entries");
    EXPECT_EQ(moves, s.stats().param_moves) << "replays at the current addresses move nothing";

    // Back and forth.
    for (int k = 0; k < 6; ++k) {
        SCOPED_TRACE(testing::Message() << "move " << k);
        const Params& p = moved[(k + 1) % 2];
        expect_same(eager(p, k % 3), replayed(s, k % 3, p.at()), "back and forth");
        moves += 2;
        EXPECT_EQ(moves, s.stats().param_moves);
    }
    // Now at moved[0] (k = 5). One parameter alone: the weight to moved[1],
    // the bias stays (a NULL entry).
    expect_same(eager(moved[1].w.get(), moved[0].b.get(), 1), replayed(s, 1, {moved[1].w.get(), nullptr}),
                "the weight alone");
    moves += 1;
    EXPECT_EQ(moves, s.stats().param_moves);
    expect_same(eager(moved[1].w.get(), moved[0].b.get(), 2), replayed(s, 2, {}), "where they are now");
    EXPECT_EQ(moves, s.stats().param_moves);
    EXPECT_EQ(0u, s.stats().clone_bytes_outstanding);
}

// (c) Every grad policy returns the grads of the moved weights.
TEST_P(MovedParams, EveryGradPolicyFollowsAMove) {
    struct Case {
        const char* what;
        uint32_t policy;
        uint32_t clones;  // clone_param_grads_on_return
        uint32_t slots;   // clone_slots
        bool wgrad;       // a weight-grad callback (delayed wgrad)
    };
    const Case cases[] = {
        {"CLONE (the default), clone slots", GRAPHED_GRAD_POLICY_DEFAULT, 1, 2, false},
        {"CLONE, copied into a block (no clone slots)", GRAPHED_GRAD_POLICY_CLONE, 1, 0, false},
        {"COPY_INTO", GRAPHED_GRAD_POLICY_COPY_INTO, 1, 2, false},
        {"ACCUMULATE_INTO", GRAPHED_GRAD_POLICY_ACCUMULATE_INTO, 1, 2, false},
        {"ALIAS", GRAPHED_GRAD_POLICY_ALIAS, 1, 2, false},
        {"ALIAS (the session opts out of clones)", GRAPHED_GRAD_POLICY_DEFAULT, 0, 2, false},
        {"a weight-grad callback", GRAPHED_GRAD_POLICY_DEFAULT, 1, 2, true},
    };
    Params moved[2] = {params(31), params(41)};
    const size_t nw = size_t(OUT) * IN, nb = OUT;
    for (const Case& k : cases) {
        SCOPED_TRACE(k.what);
        kit::LinearLayer L = layer;
        L.param_policy = k.policy;
        L.split_wgrad = k.wgrad;
        L.param_flags = GRAPHED_PARAM_FLAGS_REBIND | (k.wgrad ? GRAPHED_PARAM_FLAGS_DELAYED_WGRAD : 0u);
        graphed_session_config c = config();
        c.clone_param_grads_on_return = k.clones;
        c.clone_slots = k.slots;
        graphed::Session s(c);
        s.add_callable(L.callable(x[0].get(), true));
        s.capture();
        EXPECT_EQ(uint32_t(movable() ? 2 : 0), s.stats().params_movable) << s.plan_dump();
        const bool into =
            k.policy == GRAPHED_GRAD_POLICY_COPY_INTO || k.policy == GRAPHED_GRAD_POLICY_ACCUMULATE_INTO;
        const bool accumulate = k.policy == GRAPHED_GRAD_POLICY_ACCUMULATE_INTO;
        const bool clone = !into && !k.wgrad && k.policy != GRAPHED_GRAD_POLICY_ALIAS && k.clones;
        // Destinations for COPY_INTO and ACCUMULATE_INTO; what they must hold.
        Buffer dw(*dev, nw * 4), db(*dev, nb * 4);
        std::vector<float> acc_w = kit::random_floats(nw, 51), acc_b = kit::random_floats(nb, 52);
        up(dw, acc_w);
        up(db, acc_b);
        std::vector<void*> dsts = {dw.get(), db.get()};
        // CLONE grads are kept to the end: each must stay intact.
        std::vector<graphed::Grads> held;
        std::vector<Result> held_eager;
        const int rounds = movable() ? 4 : 1;
        for (int round = 0; round < rounds; ++round) {
            SCOPED_TRACE(testing::Message() << "round " << round);
            // On the host backend the registered addresses (moves are refused).
            const Params& p = movable() ? moved[round % 2] : reg;
            const std::vector<const void*> at = p.at();
            const Result e = eager(L, p.w.get(), p.b.get(), x[round % 3].get(), gy[round % 3].get());
            graphed::Replay r(0);
            r.stream(dev->stream()).params(at);
            Result got;
            got.y = read(s.forward(r.data(x[round % 3].get()))[0]);
            if (into) r.param_dsts(dsts);
            graphed::Grads g = s.backward(r.data(gy[round % 3].get()));
            got.gx = read(g.inputs[0]);
            if (k.wgrad) {
                EXPECT_EQ(GRAPHED_REF_KIND_NONE, g.params[0].kind()) << "the weight-grad replay returns them";
                std::vector<graphed::Ref> gp = s.wgrad(r.no_data());
                got.gw = read(gp[0]);
                got.gb = read(gp[1]);
            } else if (into) {
                got.gw = fetch(dw);
                got.gb = fetch(db);
            } else {
                got.gw = read(g.params[0]);
                got.gb = read(g.params[1]);
            }
            Result want = e;
            if (accumulate) {
                // What ACCUMULATE_INTO adds: the destination plus the grad, in f32.
                for (size_t i = 0; i < nw; ++i) acc_w[i] += e.gw[i];
                for (size_t i = 0; i < nb; ++i) acc_b[i] += e.gb[i];
                want.gw = acc_w;
                want.gb = acc_b;
            }
            expect_same(want, got, k.what);
            if (clone) {
                EXPECT_EQ(GRAPHED_REF_KIND_CLONE, g.params[0].kind());
                held.push_back(std::move(g));
                held_eager.push_back(e);
            }
        }
        for (size_t h = 0; h < held.size(); ++h) {
            EXPECT_EQ(held_eager[h].gw, read(held[h].params[0])) << "held weight grad " << h << " stays intact";
            EXPECT_EQ(held_eager[h].gb, read(held[h].params[1])) << "held bias grad " << h << " stays intact";
        }
        held.clear();
        const graphed_session_stats st = s.stats();
        EXPECT_EQ(uint64_t(movable() ? 2 * rounds : 0), st.param_moves);
        EXPECT_EQ(0u, st.clone_bytes_outstanding);
    }
}

// (d) A pipeline of 2 microbatches: microbatch 1's forward moves the
// weights while microbatch 0's backward has still to run. Each microbatch
// has graphs of its own: microbatch 0's backward reads the weights its
// forward read (the old ones, as autograd's saved tensors would), and
// microbatch 1's the new ones.
TEST_P(MovedParams, AMoveBetweenMicrobatchesLeavesThePendingBackwardOnTheOldWeights) {
    const std::vector<graphed_schedule_step> steps = graphed::schedule_from_te_order({1, 1, -1, -1});
    graphed_session_config c = config();
    c.schedule = steps.data();
    c.num_schedule_steps = steps.size();
    graphed::Session s = captured(c);
    EXPECT_EQ(2u, s.stats().microbatches);
    if (movable()) {
        EXPECT_EQ((std::vector<bool>{true, true}), s.params_movable(0, 0)) << s.plan_dump();
        EXPECT_EQ((std::vector<bool>{true, true}), s.params_movable(0, 1)) << s.plan_dump();
        EXPECT_EQ(4u, s.stats().params_movable);
    }
    Params next = params(61);
    graphed::Replay r0(0, 0), r1(0, 1);
    r0.stream(dev->stream());
    r1.stream(dev->stream());
    const std::vector<const void*> old_at = reg.at(), new_at = next.at();

    // Iteration 1: F0 (old weights), F1 (moved), B0, B1.
    Result e0 = eager(reg, 0), e1 = movable() ? eager(next, 1) : eager(reg, 1);
    ASSERT_NE(e0.gx, eager(next, 0).gx);
    Result g0, g1;
    g0.y = read(s.forward(r0.data(x[0].get()).params(old_at))[0]);
    if (!movable()) {
        EXPECT_TRUE(throws(
            GRAPHED_STATUS_PARAM_MOVED, [&] { s.forward(r1.data(x[1].get()).params(new_at)); },
            {"microbatch 1", hex(reg.w.get()), hex(next.w.get())}));
        r1.params(old_at);
    } else {
        r1.params(new_at);
    }
    g1.y = read(s.forward(r1.data(x[1].get()))[0]);
    if (movable()) {
        EXPECT_EQ(2u, s.stats().param_moves) << "microbatch 1's graphs only";
        // Microbatch 0's backward at the new addresses: its forward read the old.
        EXPECT_TRUE(throws(
            GRAPHED_STATUS_INVALID_ARGUMENT, [&] { s.backward(r0.data(gy[0].get()).params(new_at)); },
            {"its forward read it at " + hex(reg.w.get())}));
    }
    graphed::Grads b0 = s.backward(r0.data(gy[0].get()).params(old_at));
    take(g0, b0);
    graphed::Grads b1 = s.backward(r1.data(gy[1].get()));
    take(g1, b1);
    expect_same(e0, g0, "microbatch 0 (the old weights)");
    expect_same(e1, g1, "microbatch 1 (the moved weights)");
    if (!movable()) return;

    // Iteration 2: both at the new weights (microbatch 0's graphs move), then
    // the old memory freed before the backwards.
    Result f0, f1;
    f0.y = read(s.forward(r0.data(x[2].get()).params(new_at))[0]);
    f1.y = read(s.forward(r1.data(x[0].get()).params(new_at))[0]);
    EXPECT_EQ(4u, s.stats().param_moves);
    dev->sync();
    reg.w.reset();
    reg.b.reset();
    graphed::Grads c0 = s.backward(r0.data(gy[2].get()).params(new_at));
    take(f0, c0);
    graphed::Grads c1 = s.backward(r1.data(gy[0].get()));
    take(f1, c1);
    expect_same(eager(layer, next.w.get(), next.b.get(), x[2].get(), gy[2].get()), f0, "microbatch 0, moved");
    expect_same(eager(layer, next.w.get(), next.b.get(), x[0].get(), gy[0].get()), f1, "microbatch 1, moved");
    EXPECT_EQ(4u, s.stats().param_moves);
}

// (e) A step (graphed_session_add_step) over two layers and the loss,
// given its parameters' new addresses: its grads are those of the moved
// weights; given the registered ones again, those of the registered.
TEST_P(MovedParams, AStepFollowsMovedParams) {
    const int H = OUT;
    kit::LinearLayer l0 = layer, l1 = layer;
    l0.name = "fc0";
    l1.name = "fc1";
    l1.in = H;
    l1.out = H;
    l1.relu = false;
    Params p1 = params(71, H, H);
    l1.w = p1.w.get();
    l1.b = p1.b.get();
    kit::LossLayer loss;
    loss.dev = dev.get();
    loss.batch = B;
    loss.width = H;
    Buffer target(*dev, size_t(B) * H * 4);
    up(target, kit::random_floats(size_t(B) * H, 72));

    graphed::Session s(config());
    s.add_callable(l0.callable(x[0].get(), false));
    graphed::Callable c1 = l1.callable(nullptr, true);
    c1.inputs[0].flags = GRAPHED_TENSOR_FLAGS_CHAINED;
    c1.inputs[0].chain_callable = 0;
    c1.inputs[0].chain_output = 0;
    s.add_callable(c1);
    s.add_callable(loss.callable(1));
    const uint32_t step = s.add_step({0, 1, 2});
    s.capture();
    const std::vector<bool> all_movable(2, movable());
    EXPECT_EQ(all_movable, s.params_movable(0)) << s.plan_dump();
    EXPECT_EQ(all_movable, s.params_movable(1)) << s.plan_dump();
    // The step reads its data from the static buffers.
    dev->copy(dev->stream(), s.buffers(0, 0, GRAPHED_BUFFER_ROLE_INPUT)[0], x[1].get(), x[1].bytes());
    dev->copy(dev->stream(), s.buffers(2, 0, GRAPHED_BUFFER_ROLE_INPUT)[1], target.get(), target.bytes());

    // The same step eagerly: fc0, fc1, the loss grad, fc1's and fc0's backward.
    auto eager_step = [&](const Params& a, const Params& b) {
        kit::LinearLayer e0 = l0, e1 = l1;
        e0.w = a.w.get();
        e0.b = a.b.get();
        e1.w = b.w.get();
        e1.b = b.b.get();
        const size_t act = size_t(B) * H * 4;
        Buffer z0(*dev, act), y0(*dev, act), y1(*dev, act), d(*dev, act), gz0(*dev, act), gx1(*dev, act),
            gw0(*dev, size_t(H) * IN * 4), gb0(*dev, size_t(H) * 4), gw1(*dev, size_t(H) * H * 4),
            gb1(*dev, size_t(H) * 4);
        graphed_stream st = dev->stream();
        EXPECT_EQ(0, e0.eager_forward(st, x[1].get(), z0.get(), y0.get()));
        EXPECT_EQ(0, e1.eager_forward(st, y0.get(), nullptr, y1.get()));
        EXPECT_EQ(0, dev->sub(st, y1.f32(), target.f32(), d.f32(), size_t(B) * H));
        EXPECT_EQ(0, e1.eager_backward(st, y0.get(), nullptr, d.get(), nullptr, gx1.get(), gw1.get(), gb1.get()));
        EXPECT_EQ(0, e0.eager_backward(st, x[1].get(), z0.get(), gx1.get(), gz0.get(), nullptr, gw0.get(), gb0.get()));
        return std::vector<std::vector<float>>{fetch(gw0), fetch(gb0), fetch(gw1), fetch(gb1)};
    };
    auto grads_of = [&](std::vector<graphed::Ref>& refs) {
        std::vector<std::vector<float>> v;
        for (auto& r : refs) v.push_back(read(r));
        for (auto& r : refs) r.release();
        return v;
    };
    std::vector<graphed::Ref> refs;
    s.step(step, dev->stream(), refs);
    EXPECT_EQ(eager_step(reg, p1), grads_of(refs)) << "the registered addresses";

    Params n0 = params(81), n1 = params(91, H, H);
    const std::vector<const void*> moved = {n0.w.get(), n0.b.get(), n1.w.get(), n1.b.get()};
    const std::vector<const void*> registered = {reg.w.get(), reg.b.get(), p1.w.get(), p1.b.get()};
    if (!movable()) {
        EXPECT_TRUE(throws(
            GRAPHED_STATUS_PARAM_MOVED, [&] { s.step(step, dev->stream(), refs, moved); },
            {hex(reg.w.get()), hex(n0.w.get())}));
        s.step(step, dev->stream(), refs, registered);
        EXPECT_EQ(eager_step(reg, p1), grads_of(refs)) << "after the refusal";
        return;
    }
    const auto want = eager_step(n0, n1);
    ASSERT_NE(eager_step(reg, p1), want);
    for (int k = 0; k < 3; ++k) {
        SCOPED_TRACE(testing::Message() << "step replay " << k << " at the moved addresses");
        s.step(step, dev->stream(), refs, moved);
        EXPECT_EQ(want, grads_of(refs));
    }
    EXPECT_GE(s.stats().param_moves, 4u);
    s.step(step, dev->stream(), refs, registered);
    EXPECT_EQ(eager_step(reg, p1), grads_of(refs)) << "back at the registered addresses";
    s.step(step, dev->stream(), refs, moved);
    EXPECT_EQ(want, grads_of(refs)) << "moved again";
    EXPECT_EQ(0u, s.stats().clone_bytes_outstanding);
}

// (f) Refusals: a less aligned address, a parameter registered without the
// flag, a backward at another address than its forward, a wrong count.
// Each enqueues nothing (a refused forward does not even copy its input in),
// and the next correct replay is exact.
TEST_P(MovedParams, RefusedMovesEnqueueNothingAndTheNextReplayIsExact) {
    graphed::Callable c = layer.callable(x[0].get(), true);
    c.params[1].flags = GRAPHED_PARAM_FLAGS_NONE;  // the bias stays where it is registered
    graphed::Session s(config());
    s.add_callable(c);
    s.capture();
    const graphed_session_stats st = s.stats();
    const std::string plan = s.plan_dump();
    EXPECT_EQ((std::vector<bool>{movable(), false}), s.params_movable(0)) << plan;
    EXPECT_EQ(uint32_t(movable() ? 1 : 0), st.params_movable) << plan;
    EXPECT_EQ(uint32_t(movable() ? 0 : 1), st.params_move_refused) << "only the weight asked to move; " << plan;

    graphed::Replay r(0);
    r.stream(dev->stream());
    const size_t wbytes = size_t(OUT) * IN * 4;
    Buffer big(*dev, wbytes + 256);
    char* base = static_cast<char*>(big.get());

    // A forward at the registered addresses, then one refused: 4 bytes into
    // a larger buffer (the weight was registered 256-byte aligned). The
    // refused one copies nothing in: the backward is the first forward's.
    std::vector<const void*> at = reg.at();
    Result got;
    got.y = read(s.forward(r.data(x[0].get()).params(at))[0]);
    std::vector<const void*> misaligned = {base + 4, nullptr};
    EXPECT_TRUE(throws(
        GRAPHED_STATUS_PARAM_MOVED, [&] { s.forward(r.data(x[1].get()).params(misaligned)); },
        {"param 0 of callable 'fc' (microbatch 0)", hex(reg.w.get()), hex(base + 4)}));
    if (movable()) {
        EXPECT_TRUE(throws(
            GRAPHED_STATUS_PARAM_MOVED, [&] { s.forward(r.data(x[1].get()).params(misaligned)); },
            std::vector<std::string>{"aligned to 4 bytes", "256"}));
    }
    {
        graphed::Grads g = s.backward(r.data(gy[0].get()).params(at));
        take(got, g);
        expect_same(eager(reg, 0), got, "after a refused forward");
    }

    // 256 bytes into the larger buffer: aligned as registered, followed.
    Params other = params(101);
    std::vector<const void*> aligned = {base + 256, nullptr};
    up(base + 256, fetch(other.w));
    if (movable()) {
        expect_same(eager(base + 256, reg.b.get(), 1), replayed(s, 1, aligned), "256 bytes into a larger buffer");
        EXPECT_EQ(1u, s.stats().param_moves);
    } else {
        EXPECT_TRUE(throws(
            GRAPHED_STATUS_PARAM_MOVED, [&] { replayed(s, 1, aligned); }, {hex(reg.w.get()), hex(base + 256)}));
        expect_same(eager(reg, 1), replayed(s, 1, at), "after the refusal");
    }
    const void* w_now = movable() ? static_cast<const void*>(base + 256) : reg.w.get();

    // The bias, registered without the flag, cannot move.
    std::vector<const void*> bias_moved = {nullptr, other.b.get()};
    EXPECT_TRUE(throws(
        GRAPHED_STATUS_PARAM_MOVED, [&] { s.forward(r.data(x[2].get()).params(bias_moved)); },
        {"param 1 of callable 'fc' (microbatch 0)", hex(reg.b.get()), hex(other.b.get())}));
    expect_same(eager(w_now, reg.b.get(), 2), replayed(s, 2, {w_now, reg.b.get()}), "after the bias refusal");

    // A backward at another address than its forward read.
    const std::vector<const void*> w_at = {w_now, nullptr}, both_at = {w_now, reg.b.get()};
    got.y = read(s.forward(r.data(x[0].get()).params(w_at))[0]);
    std::vector<const void*> elsewhere = {other.w.get(), nullptr};
    EXPECT_TRUE(throws(
        GRAPHED_STATUS_INVALID_ARGUMENT, [&] { s.backward(r.data(gy[0].get()).params(elsewhere)); },
        {"its forward read it at " + hex(w_now)}));
    {
        graphed::Grads g = s.backward(r.data(gy[0].get()).params(both_at));
        take(got, g);
        expect_same(eager(w_now, reg.b.get(), 0), got, "after a refused backward");
    }

    // One address for two parameters.
    std::vector<const void*> one = {other.w.get()};
    EXPECT_TRUE(throws(
        GRAPHED_STATUS_INVALID_ARGUMENT, [&] { s.forward(r.data(x[1].get()).params(one)); },
        std::vector<std::string>{"1 parameter addresses were passed"}));
    expect_same(eager(w_now, reg.b.get(), 1), replayed(s, 1, {}), "after a wrong count");
    EXPECT_EQ(uint64_t(movable() ? 1 : 0), s.stats().param_moves) << "refused moves are not counted";
    EXPECT_EQ(0u, s.stats().clone_bytes_outstanding);
}

// (g) graphed_session_param_addresses says where the graphs read each
// parameter: where it was registered, then where each forward that moved
// it pointed them (a NULL entry keeps one where it is), never where a
// refused move asked; a backward moves nothing; a forward given no address
// computes with the parameters there. On the host every move is refused
// and the answer stays the registered addresses.
TEST_P(MovedParams, ParamAddressesSayWhereTheGraphsReadThem) {
    graphed::Session s = captured(config());
    const std::vector<void*> registered = {reg.w.get(), reg.b.get()};
    EXPECT_EQ(registered, s.param_addresses(0));
    Params moved = params(11);
    if (!movable()) {
        EXPECT_TRUE(throws(GRAPHED_STATUS_PARAM_MOVED, [&] { replayed(s, 0, moved.at()); }, "moved from"));
        EXPECT_EQ(registered, s.param_addresses(0)) << "after a refused move";
        return;
    }
    replayed(s, 0, moved.at());
    const std::vector<void*> both = {moved.w.get(), moved.b.get()};
    EXPECT_EQ(both, s.param_addresses(0));
    // The weight back, the bias where it is (a NULL entry).
    replayed(s, 1, {reg.w.get(), nullptr});
    const std::vector<void*> mixed = {reg.w.get(), moved.b.get()};
    EXPECT_EQ(mixed, s.param_addresses(0));
    // A less aligned address: refused, nothing moves.
    Buffer big(*dev, size_t(OUT) * IN * 4 + 256);
    const void* odd = static_cast<char*>(big.get()) + 4;
    EXPECT_TRUE(throws(GRAPHED_STATUS_PARAM_MOVED, [&] { replayed(s, 2, {odd, nullptr}); }, "aligned to 4 bytes"));
    EXPECT_EQ(mixed, s.param_addresses(0)) << "after a refused move";
    // Where it says, a forward given no address reads them.
    expect_same(eager(reg.w.get(), moved.b.get(), 2), replayed(s, 2, {}), "no address array");
    EXPECT_EQ(mixed, s.param_addresses(0));
    EXPECT_EQ(3u, s.stats().param_moves);
}

INSTANTIATE_TEST_SUITE_P(Kernels, MovedParams,
                         ::testing::Values(Kernels::Host, Kernels::Cuda, Kernels::Cublas), KernelsName());

}  // namespace
