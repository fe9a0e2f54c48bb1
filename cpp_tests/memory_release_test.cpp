// Suite MemoryRelease: memory that has an owner, on both backends. A
// callable released from a captured session (graphed_session_release_callable)
// gives back exactly what graphed_session_callable_memory says it owns, in
// graphed's process-wide figure (graphed_memory_stats_get) and, on CUDA, in
// the driver's free memory (cuMemGetInfo through
// graphed_session_device_memory); the other callables keep replaying, its
// own replays and steps are refused naming it, and everything is back once
// the session is destroyed.
#include "support.hpp"

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {

// Forward y = x; backward gx = gy and the parameter's grad = the first
// `pbytes` of gy.
struct CopyLayer {
    kit::Device* dev = nullptr;
    size_t bytes = 0;
    size_t pbytes = 256;

    graphed::Callable callable(const char* name, void* param, bool chained_to_previous = false) {
        graphed::Callable c;
        c.name = name;
        graphed_tensor_desc in = graphed::tensor_desc(bytes, GRAPHED_DTYPE_F32, true);
        if (chained_to_previous) {
            in.flags = GRAPHED_TENSOR_FLAGS_CHAINED;
            in.chain_callable = 0;
            in.chain_output = 0;
        }
        c.inputs = {in};
        c.outputs = {graphed::tensor_desc(bytes, GRAPHED_DTYPE_F32, true)};
        c.params = {graphed::param_desc(param, pbytes)};
        c.forward = &CopyLayer::forward;
        c.backward = &CopyLayer::backward;
        c.user_data = this;
        return c;
    }

    static int32_t forward(const graphed_pass_ctx* c, void* self) {
        auto* l = static_cast<CopyLayer*>(self);
        return l->dev->copy(c->stream, c->outputs[0], c->inputs[0], l->bytes);
    }
    static int32_t backward(const graphed_pass_ctx* c, void* self) {
        auto* l = static_cast<CopyLayer*>(self);
        if (c->grad_inputs[0])
            if (int e = l->dev->copy(c->stream, c->grad_inputs[0], c->grad_outputs[0], l->bytes)) return e;
        return l->dev->copy(c->stream, c->param_grads[0], c->grad_outputs[0], l->pbytes);
    }
};

class MemoryRelease : public BackendTest {
  protected:
    bool cuda() const { return GetParam() == kit::Backend::Cuda; }

    // A device buffer of `bytes` holding the byte `v` everywhere.
    kit::Buffer filled(size_t bytes, uint8_t v) {
        kit::Buffer b(*dev, bytes);
        std::vector<uint8_t> h(bytes, v);
        dev->upload(b.get(), h.data(), bytes);
        return b;
    }

    // Whether the `bytes` at device address `p` all hold `v`.
    bool holds(const void* p, size_t bytes, uint8_t v) {
        dev->sync();
        const std::vector<uint8_t> h = kit::fetch<uint8_t>(*dev, p, bytes);
        for (uint8_t x : h)
            if (x != v) return false;
        return true;
    }

    // One forward and backward of `callable` with input and grad-output
    // buffers holding `vx` and `vg`: checks its output and parameter grad.
    void iterate(graphed::Session& s, uint32_t callable, const void* x, const void* gy, size_t bytes, uint8_t vx,
                 uint8_t vg) {
        graphed::Replay r(callable);
        r.stream(dev->stream()).data(x);
        std::vector<graphed::Ref> out = s.forward(r);
        EXPECT_TRUE(holds(out[0].ptr(), bytes, vx)) << "callable " << callable;
        graphed::Replay b(callable);
        b.stream(dev->stream()).data(gy);
        graphed::Grads g = s.backward(b);
        EXPECT_TRUE(holds(g.params[0].ptr(), 256, vg)) << "callable " << callable;
    }
};

// The memory of one large callable (four own buffers: input, output,
// grad-output, grad-input; 64 MiB on CUDA) comes back at its release.
TEST_P(MemoryRelease, ReleaseGivesBackTheCallablesOwnMemory) {
    const graphed_memory_stats start = graphed::memory_stats();
    const size_t big = cuda() ? size_t(16) << 20 : size_t(256) << 10;
    const size_t small = 1024;
    CopyLayer lbig{dev.get(), big}, lsmall{dev.get(), small};
    kit::Buffer pbig(*dev, 256), psmall(*dev, 256);
    kit::Buffer xb = filled(big, 1), gb = filled(big, 2), xs = filled(small, 3), gs = filled(small, 4);
    graphed::Session s(config());
    ASSERT_EQ(0u, s.add_callable(lbig.callable("big", pbig.get())));
    ASSERT_EQ(1u, s.add_callable(lsmall.callable("small", psmall.get())));
    s.capture();
    iterate(s, 0, xb.get(), gb.get(), big, 1, 2);
    iterate(s, 1, xs.get(), gs.get(), small, 3, 4);

    const graphed_callable_memory m = s.callable_memory(0);
    EXPECT_EQ(0u, m.released);
    EXPECT_EQ(4 * big + 256, m.own_static_bytes) << "four buffers and the slab, none shared";
    EXPECT_EQ(0u, m.shared_static_bytes);
    EXPECT_EQ(4u, m.graphs) << "forward, backward, two clone slots";
    EXPECT_EQ(0u, m.clone_bytes_outstanding) << "the iteration's grads were released";
    dev->sync();
    const graphed_memory_stats before = graphed::memory_stats();
    const size_t free_before = cuda() ? s.device_memory().free : 0;

    s.release_callable(0);

    const graphed_memory_stats after = graphed::memory_stats();
    EXPECT_EQ(m.own_static_bytes + m.clone_bytes_cached, before.device_bytes - after.device_bytes);
    EXPECT_EQ(uint64_t(m.graphs + m.step_graphs), before.graphs - after.graphs);
    EXPECT_EQ(before.sessions, after.sessions);
    if (cuda()) {
        // cuMemFree gives the static allocation back to the driver at once
        // (allocation granularity aside); clone blocks go back to graphed's
        // pool, which keeps them reserved.
        const size_t free_after = s.device_memory().free;
        const size_t slack = size_t(2) << 20;
        EXPECT_GE(free_after + slack, free_before + m.own_static_bytes)
            << "the driver's free memory went from " << free_before << " to " << free_after << " bytes; "
            << m.own_static_bytes << " were released";
    }
    const graphed_callable_memory gone = s.callable_memory(0);
    EXPECT_EQ(1u, gone.released);
    EXPECT_EQ(0u, gone.own_static_bytes + gone.graphs + gone.clone_bytes_cached);

    // Its replays are refused, naming it; the other callable replays.
    EXPECT_TRUE(throws(
        GRAPHED_STATUS_CALLABLE_RELEASED,
        [&] {
            graphed::Replay r(0);
            r.stream(dev->stream()).data(xb.get());
            s.forward(r);
        },
        "callable 'big' was released by graphed_session_release_callable"));
    EXPECT_TRUE(throws(
        GRAPHED_STATUS_CALLABLE_RELEASED, [&] { (void)s.buffers(0, 0, GRAPHED_BUFFER_ROLE_INPUT); }, "'big'"));
    EXPECT_EQ(before.graphs - m.graphs, graphed::memory_stats().graphs) << "a refusal changes nothing";
    kit::Buffer xs2 = filled(small, 7), gs2 = filled(small, 8);
    iterate(s, 1, xs2.get(), gs2.get(), small, 7, 8);
    s.release_callable(0);  // again: nothing happens

    s.destroy();
    const graphed_memory_stats end = graphed::memory_stats();
    EXPECT_EQ(start.device_bytes, end.device_bytes);
    EXPECT_EQ(start.allocations, end.allocations);
    EXPECT_EQ(start.graphs, end.graphs);
    EXPECT_EQ(start.sessions, end.sessions);
}

// Chained callables share their chained buffers: the shared allocation
// stays while one of them is captured, and goes with the last; a step over
// a released callable is refused; a clone returned before the release
// stays valid.
TEST_P(MemoryRelease, SharedBuffersGoWithTheirLastCallable) {
    const graphed_memory_stats start = graphed::memory_stats();
    const size_t bytes = 4096;
    CopyLayer l0{dev.get(), bytes}, l1{dev.get(), bytes};
    kit::Buffer p0(*dev, 256), p1(*dev, 256);
    kit::Buffer x = filled(bytes, 5), gy = filled(bytes, 6);
    graphed::Session s(config());
    s.add_callable(l0.callable("first", p0.get()));
    s.add_callable(l1.callable("second", p1.get(), true));
    const uint32_t step = s.add_step({0, 1});
    s.capture();
    const graphed_callable_memory m0 = s.callable_memory(0), m1 = s.callable_memory(1);
    EXPECT_EQ(m0.shared_static_bytes, m1.shared_static_bytes) << "the first's output and its grad";
    EXPECT_GT(m0.shared_static_bytes, 0u);
    EXPECT_GT(m0.step_graphs, 0u);
    EXPECT_EQ(s.stats().static_bytes, m0.own_static_bytes + m1.own_static_bytes + m0.shared_static_bytes);

    graphed::Replay f0(0), f1(1), b1(1), b0(0);
    f0.stream(dev->stream()).data(x.get());
    f1.stream(dev->stream());
    b1.stream(dev->stream()).data(gy.get());
    b0.stream(dev->stream());
    s.forward(f0);
    s.forward(f1);
    s.backward(b1);
    graphed::Grads kept = s.backward(b0);
    ASSERT_EQ(GRAPHED_REF_KIND_CLONE, kept.params[0].kind());
    EXPECT_TRUE(holds(kept.params[0].ptr(), 256, 6));

    dev->sync();
    const graphed_callable_memory now = s.callable_memory(0);
    EXPECT_EQ(256u, now.clone_bytes_outstanding) << "the clone held";
    const graphed_memory_stats before = graphed::memory_stats();
    s.release_callable(0);
    const graphed_memory_stats after = graphed::memory_stats();
    EXPECT_EQ(now.own_static_bytes + now.clone_bytes_cached, before.device_bytes - after.device_bytes)
        << "its own memory and its cached clones; the shared buffers stay";
    EXPECT_EQ(256u, s.callable_memory(0).clone_bytes_outstanding);
    EXPECT_EQ(m1.shared_static_bytes, s.callable_memory(1).shared_static_bytes);
    EXPECT_TRUE(holds(kept.params[0].ptr(), 256, 6)) << "a clone returned before the release stays valid";
    kept.params[0].release();
    std::vector<graphed::Ref> grads;
    EXPECT_TRUE(throws(GRAPHED_STATUS_CALLABLE_RELEASED, [&] { s.step(step, dev->stream(), grads); },
                       std::vector<std::string>{"callable 'first' was released", "step 0"}));
    // The second reads its (shared) input where the first wrote it; the
    // caller may fill it now.
    s.forward(f1);
    s.backward(b1);

    const graphed_session_stats st = s.stats();
    const graphed_memory_stats mid = graphed::memory_stats();
    s.release_callable(1);
    const graphed_memory_stats last = graphed::memory_stats();
    EXPECT_EQ(m1.own_static_bytes + m1.shared_static_bytes + st.scratch_bytes + st.clone_bytes_cached,
              mid.device_bytes - last.device_bytes)
        << "with the last callable, the shared buffers and the scratch arena go";
    const graphed_session_stats empty = s.stats();
    EXPECT_EQ(0u, empty.static_bytes + empty.scratch_bytes + empty.graph_count + empty.slot_graphs + empty.step_graphs);
    s.reset();
    s.destroy();
    const graphed_memory_stats end = graphed::memory_stats();
    EXPECT_EQ(start.device_bytes, end.device_bytes);
    EXPECT_EQ(start.allocations, end.allocations);
    EXPECT_EQ(start.graphs, end.graphs);
}

// Strict leases: a held alias of the callable refuses its release.
TEST_P(MemoryRelease, AHeldLeaseRefusesTheRelease) {
    const size_t bytes = 1024;
    CopyLayer l{dev.get(), bytes};
    kit::Buffer p(*dev, 256);
    kit::Buffer x = filled(bytes, 1);
    graphed_session_config c = config();
    c.strict_leases = 1;
    graphed::Session s(c);
    s.add_callable(l.callable("leased", p.get()));
    s.capture();
    graphed::Replay f(0);
    f.stream(dev->stream()).data(x.get());
    std::vector<graphed::Ref> out = s.forward(f);
    const graphed_memory_stats before = graphed::memory_stats();
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_ALIAS_HELD, graphed_session_release_callable(s.get(), 0),
                           "callable 'leased' cannot be released"));
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_ALIAS_HELD, graphed_session_release_callable(s.get(), 0),
                           "is still held (lease 0x"))
        << "the message reads as one sentence";
    EXPECT_EQ(before.device_bytes, graphed::memory_stats().device_bytes) << "nothing released";
    EXPECT_EQ(0u, s.callable_memory(0).released);
    out[0].release();
    s.release_callable(0);
    EXPECT_EQ(1u, s.callable_memory(0).released);
}

INSTANTIATE_TEST_SUITE_P(Backends, MemoryRelease, backends(), BackendName());

// The process-wide figure through the C header alone: checked arguments.
TEST(MemoryStats, RefusesWhatIsNotItsStruct) {
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_NULL_POINTER, graphed_memory_stats_get(nullptr), "out"));
    graphed_memory_stats m = graphed_memory_stats_default();
    m.magic = GRAPHED_SESSION_STATS_MAGIC;
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_BAD_STRUCT, graphed_memory_stats_get(&m), "graphed_memory_stats"));
    m = graphed_memory_stats_default();
    ASSERT_EQ(GRAPHED_STATUS_OK, graphed_memory_stats_get(&m));
    EXPECT_EQ(sizeof(graphed_memory_stats), m.struct_size);
    EXPECT_EQ(GRAPHED_MEMORY_STATS_MAGIC, m.magic);
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_NULL_POINTER, graphed_session_release_callable(nullptr, 0), "session"));
    graphed_callable_memory cm = graphed_callable_memory_default();
    EXPECT_TRUE(
        fails_with(GRAPHED_STATUS_NULL_POINTER, graphed_session_callable_memory(nullptr, 0, &cm), "session"));
    EXPECT_STREQ("GRAPHED_STATUS_CALLABLE_RELEASED", graphed_status_name(GRAPHED_STATUS_CALLABLE_RELEASED));
}

}  // namespace
