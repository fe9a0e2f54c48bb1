// Suite StepCollectiveNccl: NCCL with one rank recorded inside a step's
// graph, on the CUDA backend, through graphed.hpp. A step over the kit's
// MLP and loss (4 microbatches, unrolled, or looping on the device with the
// last microbatch after the loop) whose collective callback enqueues
// ncclAllReduce (sum, in place) on each accumulated grad, on the capturing
// stream, and declares it with graphed_collective_record. Each replay's
// grads equal, bit for bit, the same step captured without a collective
// whose grads are then all-reduced eagerly with NCCL, and (one rank: a sum
// is the identity) the plain step's grads and the eager sum of the
// microbatches; 100 replays, of 1..4 microbatches when looped. Teardown in
// both orders (the session before ncclCommDestroy, and the communicator
// first) leaves no CUDA error and gives the device memory back.
//
// Built with NCCL where CMake found it (GRAPHED_TEST_NCCL, see
// cpp_tests/CMakeLists.txt); elsewhere every test skips with the reason.
#include "expect.hpp"
#include "layers.hpp"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>

#ifdef GRAPHED_TEST_NCCL
#include <cuda_runtime.h>
#include <nccl.h>
#endif

namespace {

#ifndef GRAPHED_TEST_NCCL

#ifndef GRAPHED_TEST_NCCL_WHY
#define GRAPHED_TEST_NCCL_WHY "NCCL not found"
#endif

TEST(StepCollectiveNccl, NotBuilt) {
    GTEST_SKIP() << "NCCL not found at configure time: set NCCL_HOME (" GRAPHED_TEST_NCCL_WHY ")";
}

#else

constexpr int kLayers = 2, kBatch = 8, kWidth = 32, kReplays = 100;
constexpr uint32_t kMicrobatches = 4;
constexpr size_t kAct = size_t(kBatch) * kWidth * 4;

size_t param_bytes(size_t p) { return p % 2 == 0 ? size_t(kWidth) * kWidth * 4 : size_t(kWidth) * 4; }

std::string nccl_said(ncclResult_t r) { return std::string(ncclGetErrorString(r)); }

#define NCCL_OK(call)                                                                          \
    do {                                                                                       \
        const ncclResult_t r_ = (call);                                                        \
        ASSERT_EQ(ncclSuccess, r_) << #call << ": " << nccl_said(r_);                          \
    } while (0)

// The collective stage: ncclAllReduce in place on each grad.
struct NcclStage {
    ncclComm_t comm = nullptr;
    uint64_t id = 0;  // the communicator's id in the manifest
    int calls = 0;

    static int32_t record(const graphed_collective_ctx* ctx, void* self) {
        return graphed::guard([&]() -> int {
            auto* st = static_cast<NcclStage*>(self);
            ++st->calls;
            for (size_t k = 0; k < ctx->num_params; ++k) {
                void* g = ctx->grads[k];
                if (!g) continue;
                if (ctx->dtypes[k] != GRAPHED_DTYPE_F32) throw std::runtime_error("f32 grads only");
                const ncclResult_t r = ncclAllReduce(g, g, ctx->bytes[k] / 4, ncclFloat, ncclSum, st->comm,
                                                     static_cast<cudaStream_t>(ctx->stream));
                if (r != ncclSuccess) throw std::runtime_error("ncclAllReduce: " + nccl_said(r));
                graphed::check(graphed_collective_record(ctx, st->id, GRAPHED_COLLECTIVE_OP_ALL_REDUCE, ctx->bytes[k],
                                                         ctx->dtypes[k]));
            }
            return 0;
        });
    }
};

class StepCollectiveNccl : public ::testing::Test {
  protected:
    void SetUp() override {
        std::string why;
        dev = kit::make_cuda_device(&why);
        if (!dev) {
            const char* require = std::getenv("GRAPHED_REQUIRE_CUDA");
            if (require && std::string(require) == "1")
                FAIL() << "GRAPHED_REQUIRE_CUDA=1, but the cuda backend is not available: " << why;
            GTEST_SKIP() << "the cuda backend is not available: " << why;
        }
        ASSERT_EQ(cudaSuccess, cudaSetDevice(0));
        // NCCL's one-time initialisation and the kit kernels, before any
        // memory is measured or anything captured.
        ncclComm_t c = nullptr;
        ASSERT_NO_FATAL_FAILURE(init(&c, nullptr));
        kit::Buffer b(*dev, 64);
        ASSERT_EQ(ncclSuccess, ncclAllReduce(b.get(), b.get(), 16, ncclFloat, ncclSum, c, stream()));
        dev->sync();
        NCCL_OK(ncclCommDestroy(c));
    }

    cudaStream_t stream() { return static_cast<cudaStream_t>(dev->stream()); }

    // A one-rank communicator on device 0; its id for the manifest.
    void init(ncclComm_t* comm, uint64_t* id) {
        ncclUniqueId uid;
        NCCL_OK(ncclGetUniqueId(&uid));
        NCCL_OK(ncclCommInitRank(comm, 1, uid, 0));
        if (id) std::memcpy(id, uid.internal, sizeof *id);
    }

    static void data(kit::Device& d, int it, kit::Buffer& xs, kit::Buffer& ts) {
        auto x = kit::random_floats(size_t(kBatch) * kWidth * kMicrobatches, 1000 + uint32_t(it));
        auto t = kit::random_floats(size_t(kBatch) * kWidth * kMicrobatches, 5000 + uint32_t(it));
        d.upload(xs.get(), x.data(), xs.bytes());
        d.upload(ts.get(), t.data(), ts.bytes());
    }

    // A model with COPY_INTO grads into `dst`, its session and step (with
    // the NCCL stage when `stage` is given), captured.
    struct Rig {
        kit::Mlp model;
        std::vector<kit::Buffer> dst;
        std::vector<void*> dsts;
        std::unique_ptr<graphed::Session> s;
        uint32_t step = 0;
        Rig(kit::Device& d, const kit::Buffer& xs, const kit::Buffer& ts, uint32_t loop_mode, NcclStage* stage)
            : model(d, kLayers, kBatch, kWidth, 71) {
            for (int i = 0; i < kLayers; ++i) model.layer(i).param_policy = GRAPHED_GRAD_POLICY_COPY_INTO;
            for (size_t p = 0; p < 2 * size_t(kLayers); ++p) dst.emplace_back(d, param_bytes(p));
            for (auto& b : dst) dsts.push_back(b.get());
            s = std::make_unique<graphed::Session>(graphed::session_config(GRAPHED_BACKEND_CUDA));
            model.register_layers(*s, xs.get(), kit::Wiring{true, false, true});
            const std::vector<graphed_step_io> io = {
                graphed::Session::step_io(0, GRAPHED_BUFFER_ROLE_INPUT, 0, xs.get(), kAct),
                graphed::Session::step_io(kLayers, GRAPHED_BUFFER_ROLE_INPUT, 1, ts.get(), kAct),
            };
            graphed::StepCollective c;
            if (stage) {
                c.record = &NcclStage::record;
                c.data = stage;
            }
            step = s->add_step({0, 1, 2}, dsts, kMicrobatches, io, loop_mode, nullptr, nullptr, {}, c);
            s->capture();
        }
    };

    // The eager grads of the first `n` microbatches, summed in order.
    static std::vector<std::vector<float>> eager_sum(kit::Mlp& eager, uint32_t n, const kit::Buffer& xs,
                                                     const kit::Buffer& ts) {
        std::vector<std::vector<float>> sum;
        for (uint32_t i = 0; i < n; ++i) {
            kit::StepGrads g = eager.eager_step(static_cast<const char*>(xs.get()) + i * kAct,
                                                static_cast<const char*>(ts.get()) + i * kAct, 0.0f, true, i);
            std::vector<std::vector<float>> flat;
            for (size_t l = 0; l < g.w.size(); ++l) {
                flat.push_back(g.w[l]);
                flat.push_back(g.b[l]);
            }
            if (sum.empty()) {
                sum = flat;
                continue;
            }
            for (size_t p = 0; p < flat.size(); ++p)
                for (size_t k = 0; k < flat[p].size(); ++k) sum[p][k] += flat[p][k];
        }
        return sum;
    }

    // kReplays replays of a step with the NCCL stage against the plain
    // step plus an eager ncclAllReduce, the plain step, and the eager sum.
    void train(uint32_t loop_mode) {
        ncclComm_t comm = nullptr;
        NcclStage stage;
        ASSERT_NO_FATAL_FAILURE(init(&comm, &stage.id));
        stage.comm = comm;
        {
            kit::Buffer xs(*dev, kAct * kMicrobatches), ts(*dev, kAct * kMicrobatches);
            data(*dev, 0, xs, ts);
            kit::Mlp eager(*dev, kLayers, kBatch, kWidth, 71);
            Rig with(*dev, xs, ts, loop_mode, &stage), plain(*dev, xs, ts, loop_mode, nullptr);
            EXPECT_EQ(1, stage.calls) << "called once, under capture";
            const auto m = with.s->collectives(with.step);
            ASSERT_EQ(4u, m.size());
            for (size_t k = 0; k < m.size(); ++k) {
                EXPECT_EQ(stage.id, m[k].communicator);
                EXPECT_EQ(uint32_t(GRAPHED_COLLECTIVE_OP_ALL_REDUCE), m[k].op);
                EXPECT_EQ(param_bytes(k), m[k].bytes);
                EXPECT_EQ(GRAPHED_COLLECTIVE_ALL_CALLABLES, m[k].callable);
            }
            std::vector<kit::Buffer> reduced;
            for (size_t p = 0; p < with.dst.size(); ++p) reduced.emplace_back(*dev, param_bytes(p));
            std::vector<graphed::Ref> g1, g2;
            for (int it = 0; it < kReplays; ++it) {
                const uint32_t count = loop_mode == GRAPHED_STEP_LOOP_WHILE ? 1 + uint32_t(it) % kMicrobatches : 0;
                const uint32_t n = count ? count : kMicrobatches;
                SCOPED_TRACE(testing::Message() << "replay " << it << ", " << n << " microbatches");
                data(*dev, it, xs, ts);
                with.s->step(with.step, dev->stream(), g1, {}, count);
                plain.s->step(plain.step, dev->stream(), g2, {}, count);
                for (size_t p = 0; p < plain.dst.size(); ++p) {
                    ASSERT_EQ(0, dev->copy(dev->stream(), reduced[p].get(), plain.dst[p].get(), param_bytes(p)));
                    NCCL_OK(ncclAllReduce(reduced[p].get(), reduced[p].get(), param_bytes(p) / 4, ncclFloat, ncclSum,
                                          comm, stream()));
                }
                dev->sync();
                ASSERT_EQ(cudaSuccess, cudaGetLastError());
                // The eager sum every 10th replay (it is slow), each size.
                const bool full = it % 10 == 0 || it < int(kMicrobatches);
                const auto sum = full ? eager_sum(eager, n, xs, ts) : std::vector<std::vector<float>>{};
                for (size_t p = 0; p < with.dst.size(); ++p) {
                    const size_t count_p = param_bytes(p) / 4;
                    const auto got = kit::fetch<float>(*dev, with.dst[p].get(), count_p);
                    ASSERT_EQ(kit::fetch<float>(*dev, reduced[p].get(), count_p), got)
                        << "parameter " << p << ": the plain step's grad all-reduced eagerly";
                    ASSERT_EQ(kit::fetch<float>(*dev, plain.dst[p].get(), count_p), got)
                        << "parameter " << p << ": one rank's sum is the identity";
                    if (full) ASSERT_EQ(sum[p], got) << "parameter " << p << ": the eager sum of the microbatches";
                }
            }
            EXPECT_EQ(1, stage.calls) << "replays never call the callback";
        }
        NCCL_OK(ncclCommDestroy(comm));
    }

    // A captured and replayed step with the NCCL stage, then the session
    // and the communicator destroyed in the given order: no CUDA error, and
    // the device's free memory is back (within a small tolerance).
    void teardown(bool session_first) {
        const size_t before = dev->free_memory();
        {
            kit::Buffer xs(*dev, kAct * kMicrobatches), ts(*dev, kAct * kMicrobatches);
            for (uint32_t loop_mode : {GRAPHED_STEP_LOOP_UNROLLED, GRAPHED_STEP_LOOP_WHILE}) {
                SCOPED_TRACE(testing::Message() << (loop_mode ? "WHILE" : "unrolled"));
                ncclComm_t comm = nullptr;
                NcclStage stage;
                ASSERT_NO_FATAL_FAILURE(init(&comm, &stage.id));
                stage.comm = comm;
                auto rig = std::make_unique<Rig>(*dev, xs, ts, loop_mode, &stage);
                std::vector<graphed::Ref> g;
                for (int it = 0; it < 3; ++it) {
                    data(*dev, it, xs, ts);
                    rig->s->step(rig->step, dev->stream(), g, {}, 0);
                }
                dev->sync();
                g.clear();
                if (session_first) {
                    rig.reset();
                    NCCL_OK(ncclCommDestroy(comm));
                } else {
                    // The communicator goes first, while its graphs exist.
                    NCCL_OK(ncclCommDestroy(comm));
                    rig.reset();
                }
                ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
                ASSERT_EQ(cudaSuccess, cudaGetLastError());
            }
        }
        const size_t after = dev->free_memory();
        const size_t tolerance = size_t(8) << 20;
        EXPECT_LE(before, after + tolerance) << "free device memory " << before << " B before, " << after << " B after";
        std::printf("free device memory: %zu B before, %zu B after (%s first)\n", before, after,
                    session_first ? "session" : "communicator");
    }

    std::unique_ptr<kit::Device> dev;
};

TEST_F(StepCollectiveNccl, UnrolledAllReduceInTheGraphEqualsEagerAllReduce) { train(GRAPHED_STEP_LOOP_UNROLLED); }

TEST_F(StepCollectiveNccl, LoopedLastMicrobatchAfterTheLoopEqualsEagerAllReduceAtEveryCount) {
    train(GRAPHED_STEP_LOOP_WHILE);
}

TEST_F(StepCollectiveNccl, TeardownSessionFirstThenCommunicator) { teardown(true); }

TEST_F(StepCollectiveNccl, TeardownCommunicatorFirstThenSession) { teardown(false); }

#endif

}  // namespace
