// Suites DebugReplay and ExportDot: where a replay faulted, and what the
// captured graphs hold. Debug mode (graphed_session_config.debug, or
// GRAPHED_DEBUG=1 when the session is created) gives the same results as
// without it, on the host and on CUDA; on the host, a host kernel
// (graphed_host_enqueue_kernel) that fails in one pass makes that pass's
// replay fail naming the callable, its index, the pass and the graph,
// while without debug mode the fault surfaces only at the next
// synchronize. graphed_session_export_dot gives one labelled cluster per
// graph, its kernels named (CUDA: by the driver, 12.3 and newer), and
// refuses, writing nothing, what it must.
#include "expect.hpp"
#include "layers.hpp"
#include "support.hpp"

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace {

size_t count(const std::string& text, const std::string& what) {
    size_t n = 0;
    for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
    return n;
}

// One linear layer of the kit, with its parameters, input and grad-output.
struct Net {
    kit::LinearLayer layer;
    kit::Buffer w, b, x, gy;

    Net(kit::Device& dev, uint32_t seed) {
        constexpr int kBatch = 4, kWidth = 8;
        layer.dev = &dev;
        layer.batch = kBatch;
        layer.in = layer.out = kWidth;
        layer.name = "fc";
        w = kit::Buffer(dev, size_t(kWidth) * kWidth * 4);
        b = kit::Buffer(dev, size_t(kWidth) * 4);
        x = kit::Buffer(dev, size_t(kBatch) * kWidth * 4);
        gy = kit::Buffer(dev, size_t(kBatch) * kWidth * 4);
        for (kit::Buffer* buf : {&w, &b, &x, &gy}) {
            const std::vector<float> v = kit::random_floats(buf->bytes() / 4, seed++);
            dev.upload(buf->get(), v.data(), buf->bytes());
        }
        layer.w = w.get();
        layer.b = b.get();
    }
};

// The bytes of `n` floats at `p` on `dev`.
std::vector<float> floats(kit::Device& dev, const void* p, size_t bytes) {
    return kit::fetch<float>(dev, p, bytes / 4);
}

class DebugReplay : public BackendTest {};

// Three forward and backward replays in debug mode give what they give
// without it, bit for bit: outputs, input grads and parameter grads.
TEST_P(DebugReplay, GivesTheSameResultsAsWithoutIt) {
    std::vector<std::vector<float>> seen[2];
    for (int debug = 0; debug < 2; ++debug) {
        Net net(*dev, 11);
        graphed_session_config cfg = config();
        cfg.debug = uint32_t(debug);
        graphed::Session s(cfg);
        s.add_callable(net.layer.callable(net.x.get(), true));
        s.capture();
        for (int it = 0; it < 3; ++it) {
            std::vector<graphed::Ref> out = s.forward(graphed::Replay(0).stream(dev->stream()).data(net.x.get()));
            graphed::Grads g = s.backward(graphed::Replay(0).stream(dev->stream()).data(net.gy.get()));
            dev->sync();
            seen[debug].push_back(floats(*dev, out[0].ptr(), out[0].bytes()));
            seen[debug].push_back(floats(*dev, g.inputs[0].ptr(), g.inputs[0].bytes()));
            for (const graphed::Ref& p : g.params) seen[debug].push_back(floats(*dev, p.ptr(), p.bytes()));
        }
    }
    ASSERT_EQ(seen[0].size(), seen[1].size());
    for (size_t k = 0; k < seen[0].size(); ++k)
        EXPECT_EQ(0, std::memcmp(seen[0][k].data(), seen[1][k].data(), seen[0][k].size() * 4)) << "result " << k;
}

INSTANTIATE_TEST_SUITE_P(Backends, DebugReplay, backends(), BackendName());

// A callable on the host backend whose passes each enqueue one host kernel
// named "<name>.<pass>", which returns 7 while its pass is armed.
struct Faulty {
    std::string name = "faulty";
    std::atomic<uint32_t> armed{0};
    std::vector<float> sample = std::vector<float>(16), param = std::vector<float>(4);
    struct Kernel {
        Faulty* self;
        uint32_t pass;
    };
    std::vector<std::unique_ptr<Kernel>> kernels;

    graphed::Callable callable() {
        graphed::Callable c;
        c.name = name;
        c.inputs = {graphed::tensor_desc(sample.size() * 4, GRAPHED_DTYPE_F32, true, sample.data())};
        c.outputs = {graphed::tensor_desc(sample.size() * 4, GRAPHED_DTYPE_F32, true)};
        c.params = {graphed::param_desc(param.data(), param.size() * 4)};
        c.forward = &Faulty::pass;
        c.backward = &Faulty::pass;
        c.user_data = this;
        return c;
    }
    static int32_t kernel(void* data) {
        auto* k = static_cast<Kernel*>(data);
        return (k->self->armed.load() >> k->pass) & 1 ? 7 : 0;
    }
    static int32_t pass(const graphed_pass_ctx* ctx, void* data) {
        auto* self = static_cast<Faulty*>(data);
        self->kernels.push_back(std::make_unique<Kernel>(Kernel{self, ctx->pass}));
        const std::string kname = self->name + (ctx->pass == GRAPHED_PASS_FORWARD ? ".forward" : ".backward");
        return static_cast<int32_t>(
            graphed_host_enqueue_kernel(ctx->stream, kname.c_str(), &Faulty::kernel, self->kernels.back().get()));
    }
};

graphed_session_config host_config(bool debug) {
    graphed_session_config c = graphed::session_config(GRAPHED_BACKEND_HOST);
    c.debug = debug ? 1 : 0;
    c.name = "net";
    return c;
}

// The backward of the second of two callables faults: its replay names the
// session, the callable and its index, the pass and the graph, and the
// kernel; the replays before it and, disarmed, after it succeed.
TEST(DebugReplayHost, AFaultIsNamedByItsCallablePassAndGraph) {
    Faulty a, b;
    a.name = "first";
    b.name = "second";
    graphed_session_config cfg = host_config(true);
    cfg.clone_slots = 0;
    graphed::Session s(cfg);
    s.add_callable(a.callable());
    s.add_callable(b.callable());
    s.capture();
    s.forward(graphed::Replay(0));
    s.forward(graphed::Replay(1));
    b.armed = 1u << GRAPHED_PASS_BACKWARD;
    EXPECT_TRUE(throws(GRAPHED_STATUS_CUDA_ERROR, [&] { s.backward(graphed::Replay(1)); },
                       std::vector<std::string>{"graphed_backward: debug check in session 'net'",
                                                "right after the backward pass of callable 'second' (index 1), "
                                                "microbatch 0, no buckets ran its main graph",
                                                "host kernel 'second.backward' returned 7"}));
    b.armed = 0;
    s.backward(graphed::Replay(1));
    s.backward(graphed::Replay(0));
    a.armed = 1u << GRAPHED_PASS_FORWARD;
    EXPECT_TRUE(throws(GRAPHED_STATUS_CUDA_ERROR, [&] { s.forward(graphed::Replay(0)); },
                       "the forward pass of callable 'first' (index 0)"));
    a.armed = 0;
}

// Without debug mode the replay succeeds (its work was enqueued) and the
// next synchronize reports the fault, naming the kernel, once.
TEST(DebugReplayHost, WithoutItTheFaultSurfacesAtTheNextSynchronize) {
    Faulty a;
    graphed::Session s(host_config(false));
    s.add_callable(a.callable());
    s.capture();
    a.armed = 1u << GRAPHED_PASS_FORWARD;
    s.forward(graphed::Replay(0));
    a.armed = 0;
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_CUDA_ERROR, graphed_host_synchronize(nullptr),
                           "host kernel 'faulty.forward' returned 7"));
    EXPECT_EQ(GRAPHED_STATUS_OK, graphed_host_synchronize(nullptr)) << "reported once";
}

// GRAPHED_DEBUG=1 when a session is created turns debug mode on for it;
// a value other than 0 or 1 refuses the session. (ctest runs each test in
// a process of its own; the variable is restored.)
TEST(DebugReplayHost, TheEnvironmentTurnsItOn) {
    Faulty a;
    ASSERT_EQ(0, setenv("GRAPHED_DEBUG", "1", 1));
    graphed::Session s(host_config(false));
    ASSERT_EQ(0, setenv("GRAPHED_DEBUG", "yes", 1));
    graphed_session* refused = nullptr;
    graphed_session_config cfg = host_config(false);
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_session_create(&cfg, &refused),
                           "GRAPHED_DEBUG is 'yes': set it to 1"));
    EXPECT_EQ(nullptr, refused);
    ASSERT_EQ(0, unsetenv("GRAPHED_DEBUG"));
    s.add_callable(a.callable());
    s.capture();
    a.armed = 1u << GRAPHED_PASS_FORWARD;
    EXPECT_TRUE(throws(GRAPHED_STATUS_CUDA_ERROR, [&] { s.forward(graphed::Replay(0)); },
                       "right after the forward pass of callable 'faulty' (index 0)"));
    a.armed = 0;
}

class ExportDot : public BackendTest {};

// One cluster per graph the session holds (its passes' graphs and its
// clone slots'), labelled; on CUDA each kernel node names the kit's
// kernel where the driver can name kernels (12.3 and newer).
TEST_P(ExportDot, OneLabelledClusterPerGraph) {
    Net net(*dev, 3);
    graphed_session_config cfg = config();
    cfg.name = "net";
    graphed::Session s(cfg);
    s.add_callable(net.layer.callable(net.x.get(), true));
    s.capture();
    const std::string dot = s.export_dot();
    const graphed_session_stats st = s.stats();
    EXPECT_EQ(size_t(st.graph_count + st.slot_graphs + st.step_graphs), count(dot, "subgraph cluster_")) << dot;
    EXPECT_EQ(0u, dot.find("// graphed ")) << dot;
    EXPECT_NE(std::string::npos, dot.find("digraph \"session 'net'\" {")) << dot;
    EXPECT_NE(std::string::npos,
              dot.find("label=\"callable 'fc' (index 0), forward, microbatch 0, no buckets, main graph\";"))
        << dot;
    EXPECT_NE(std::string::npos,
              dot.find("label=\"callable 'fc' (index 0), backward, microbatch 0, no buckets, clone slot 1 graph\";"))
        << dot;
    if (dev->backend() == kit::Backend::Cuda) {
        EXPECT_NE(std::string::npos, dot.find("[label=\"kernel\\n")) << dot;
        if (dot.find("cuFuncGetName") == std::string::npos)
            EXPECT_NE(std::string::npos, dot.find("k_linear_fwd")) << dot;
    } else {
        EXPECT_NE(std::string::npos, dot.find("[label=\"host task\", tooltip=\"callable 'fc' (index 0), forward"))
            << dot;
    }
    EXPECT_EQ(dot, s.export_dot()) << "the same text every time";
}

// Refusals write nothing: a NULL session, a NULL length, before capture,
// after a reset.
TEST_P(ExportDot, RefusalsWriteNothing) {
    Net net(*dev, 5);
    graphed::Session s(config());
    s.add_callable(net.layer.callable(net.x.get(), true));
    char buf[8];
    std::memset(buf, 0x55, sizeof buf);
    size_t len = 77;
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_NULL_POINTER, graphed_session_export_dot(nullptr, buf, sizeof buf, &len),
                           "graphed_session_export_dot: session"));
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_WRONG_STATE, graphed_session_export_dot(s.get(), buf, sizeof buf, &len),
                           "not captured yet"));
    s.capture();
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_NULL_POINTER,
                           graphed_session_export_dot(s.get(), buf, sizeof buf, nullptr), "length_out"));
    s.reset();
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_SESSION_RESET, graphed_session_export_dot(s.get(), buf, sizeof buf, &len),
                           "reset"));
    EXPECT_EQ(77u, len);
    for (char c : buf) EXPECT_EQ(0x55, c);
}

INSTANTIATE_TEST_SUITE_P(Backends, ExportDot, backends(), BackendName());

}  // namespace
