// Suite RefusedCalls: a refused replay changes nothing the caller can see,
// through the public header alone, on the host backend. The callables
// record no work, so that a parameter registered with
// GRAPHED_PARAM_FLAGS_REBIND moves there (no graph reads it): what a replay
// did with the addresses it was given shows in
// graphed_session_stats.param_moves, and a step replay given no address
// runs where the last successful step replay had the parameters.
#include "expect.hpp"

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>

namespace {

constexpr size_t kFloats = 16, kBytes = kFloats * 4;

int32_t nothing(const graphed_pass_ctx*, void*) { return 0; }

// Host memory for a parameter, aligned to 256 bytes (as a rebound
// parameter's new address must be, at least as its registered one).
struct Aligned {
    std::unique_ptr<unsigned char[]> raw{new unsigned char[kBytes + 256]()};
    void* get() const {
        auto p = reinterpret_cast<uintptr_t>(raw.get());
        return reinterpret_cast<void*>((p + 255) & ~uintptr_t(255));
    }
};

graphed_session_config host(uint32_t clone_slots, graphed_session* share = nullptr) {
    graphed_session_config c = graphed::session_config(GRAPHED_BACKEND_HOST);
    c.warmup_iterations = 1;
    c.clone_slots = clone_slots;
    c.share_pool_with = share;
    return c;
}

// One input, one output, the parameters at `params` (REBIND, `policy`).
graphed::Callable idle(const std::vector<void*>& params, uint32_t policy) {
    graphed::Callable c;
    c.name = "idle";
    c.inputs = {graphed::tensor_desc(kBytes, GRAPHED_DTYPE_F32, true)};
    c.outputs = {graphed::tensor_desc(kBytes, GRAPHED_DTYPE_F32, true)};
    for (void* p : params)
        c.params.push_back(graphed::param_desc(p, kBytes, GRAPHED_DTYPE_F32, policy, GRAPHED_PARAM_FLAGS_REBIND));
    c.forward = &nothing;
    c.backward = &nothing;
    return c;
}

uint64_t moves(const graphed::Session& s) { return s.stats().param_moves; }

// The defect's reproduction: a step over two microbatches with CLONE grads
// and one clone slot, whose slot a kept grad holds, is refused with
// ALIAS_HELD when given the parameter elsewhere; the move must not be kept.
TEST(RefusedCalls, AStepRefusedForItsHeldSlotKeepsNoParameterMove) {
    Aligned w, to;
    graphed::Session s(host(1));
    s.add_callable(idle({w.get()}, GRAPHED_GRAD_POLICY_CLONE));
    s.add_step({0}, {}, 2);
    s.capture();
    ASSERT_EQ(s.params_movable(0), std::vector<bool>{true}) << "the premise: the parameter can move";

    std::vector<graphed::Ref> held, grads;
    s.step(0, nullptr, held);
    ASSERT_EQ(held[0].kind(), GRAPHED_REF_KIND_CLONE);
    EXPECT_TRUE(throws(GRAPHED_STATUS_ALIAS_HELD, [&] { s.step(0, nullptr, grads, {to.get()}); }, "all 1 are held"));
    EXPECT_EQ(moves(s), 0u) << "the refused step replay counted a move";

    // Given no address, the step runs where the last successful step
    // replay had the parameter: at it again, nothing moves.
    held.clear();
    s.step(0, nullptr, grads);
    grads.clear();
    s.step(0, nullptr, grads, {w.get()});
    grads.clear();
    EXPECT_EQ(moves(s), 0u) << "the step ran at the refused call's address after it";
    // A move that succeeds is followed and counted.
    s.step(0, nullptr, grads, {to.get()});
    EXPECT_EQ(moves(s), 1u);
}

// The same step, one microbatch: with its slot held it replays pass by
// pass. Refused by the session it shares its pool with (in the middle of
// its iteration), it keeps the addresses of its last successful replay.
TEST(RefusedCalls, AStepReplayedPassByPassRefusedByItsPoolKeepsItsAddresses) {
    Aligned w, to;
    graphed::Session a(host(2));
    a.add_callable(idle({}, GRAPHED_GRAD_POLICY_DEFAULT));
    graphed::Session b(host(1, a.get()));
    b.add_callable(idle({w.get()}, GRAPHED_GRAD_POLICY_CLONE));
    b.add_step({0});
    a.capture();
    b.capture();

    std::vector<graphed::Ref> held, grads;
    b.step(0, nullptr, held);
    a.forward(graphed::Replay(0));
    EXPECT_TRUE(throws(GRAPHED_STATUS_WRONG_STATE, [&] { b.step(0, nullptr, grads, {to.get()}); },
                       "in the middle of its iteration"));
    EXPECT_EQ(moves(b), 0u) << "the refused step replay counted a move";
    a.backward(graphed::Replay(0));
    b.step(0, nullptr, grads);
    grads.clear();
    held.clear();
    b.step(0, nullptr, grads, {w.get()});
    grads.clear();
    EXPECT_EQ(moves(b), 0u) << "the step ran at the refused call's address after it";
}

}  // namespace
