// Suite StepCollective: a step's collective stage through graphed.hpp, on
// the host and on CUDA. A step over the kit's MLP and loss (1 or 4
// microbatches, unrolled, or looping on the device with the last
// microbatch after the loop) declares a collective callback; its
// "collective" is the kit's own kernels (no NCCL here: see
// step_collective_nccl_test.cpp): it copies each accumulated grad aside
// (what a collective would read) and doubles it in place (what a sum over
// two identical ranks gives, exactly). At every replay, of every count,
// the copies are the eager sum of the microbatches' grads bit for bit and
// the grad destinations twice that; the callback is called under capture
// only, at its points (once after the last backward, or after each
// callable's grad pass in backward order); the manifest is what it
// declared; bad inputs and failing callbacks are refused with their
// message. StepCollectiveTwoRanks (host backend): two ranks as two threads
// whose collective is an in-process all-reduce recorded as host tasks and
// whose manifests go through an in-process all-gather: the reduced grads
// are the sum of both ranks' eager grads, and a mismatch fails both ranks
// naming both sides.
#include "expect.hpp"
#include "layers.hpp"
#include "support.hpp"

#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <stdexcept>
#include <thread>

namespace {

constexpr uint64_t kComm = 7;

// A collective callback's state: what it saw, and its "collective".
struct Recorder {
    kit::Device* dev = nullptr;
    // Each parameter's device pointer -> its copy of the grad it was given.
    std::map<const void*, size_t> index;
    std::vector<kit::Buffer> seen;
    struct Call {
        uint32_t callable;
        size_t num_params;
        uint32_t slot;
        bool operator==(const Call& o) const {
            return callable == o.callable && num_params == o.num_params && slot == o.slot;
        }
    };
    std::vector<Call> calls;
    // 0 works; 1 throws; 2 records an unknown op (returns what that
    // returned); 3 breaks the capture; 4 records 4 bytes more on its first.
    int mode = 0;

    static int32_t record(const graphed_collective_ctx* ctx, void* self) {
        return graphed::guard([&]() -> int {
            auto* r = static_cast<Recorder*>(self);
            r->calls.push_back({ctx->callable, ctx->num_params, ctx->slot});
            if (r->mode == 1) throw std::runtime_error("no communicator");
            if (r->mode == 3) return r->dev->illegal(ctx->stream);
            for (size_t k = 0; k < ctx->num_params; ++k) {
                void* g = ctx->grads[k];
                if (!g) continue;
                const uint32_t op = r->mode == 2 ? 99u : uint32_t(GRAPHED_COLLECTIVE_OP_ALL_REDUCE);
                const uint64_t extra = (r->mode == 4 && k == 0) ? 4 : 0;
                const graphed_status st = graphed_collective_record(ctx, kComm, op, ctx->bytes[k] + extra, ctx->dtypes[k]);
                if (st != GRAPHED_STATUS_OK) return 100 + int(st);
                auto it = r->index.find(ctx->params[k]);
                if (it == r->index.end()) throw std::runtime_error("a parameter the test does not know");
                if (int e = r->dev->copy(ctx->stream, r->seen[it->second].get(), g, ctx->bytes[k])) return e;
                if (int e = r->dev->add(ctx->stream, static_cast<float*>(g), static_cast<const float*>(g),
                                        ctx->bytes[k] / 4))
                    return e;
            }
            return 0;
        });
    }
};

class StepCollective : public BackendTest {
  protected:
    static constexpr int kLayers = 2, kBatch = 8, kWidth = 32, kIterations = 5;
    static constexpr size_t kAct = size_t(kBatch) * kWidth * 4;

    static size_t param_bytes(size_t p) { return p % 2 == 0 ? size_t(kWidth) * kWidth * 4 : size_t(kWidth) * 4; }

    static void data(kit::Device& d, uint32_t n, int it, uint32_t rank, kit::Buffer& xs, kit::Buffer& ts) {
        auto x = kit::random_floats(size_t(kBatch) * kWidth * n, 1000 + uint32_t(it) + 97 * rank);
        auto t = kit::random_floats(size_t(kBatch) * kWidth * n, 5000 + uint32_t(it) + 89 * rank);
        d.upload(xs.get(), x.data(), xs.bytes());
        d.upload(ts.get(), t.data(), ts.bytes());
    }

    static const void* at(const kit::Buffer& b, uint32_t i) { return static_cast<const char*>(b.get()) + i * kAct; }

    // The parameters' device pointers, in step order (w, b per layer).
    static std::vector<void*> params(kit::Mlp& m) {
        std::vector<void*> p;
        for (int l = 0; l < m.layers(); ++l) {
            p.push_back(m.layer(l).w);
            p.push_back(m.layer(l).b);
        }
        return p;
    }

    // The eager grads of the first `n` microbatches, summed on the host in
    // order as graphed sums them (w0, b0, w1, b1).
    static std::vector<std::vector<float>> eager_sum(kit::Mlp& eager, uint32_t n, const kit::Buffer& xs,
                                                     const kit::Buffer& ts) {
        kit::StepGrads sum;
        for (uint32_t i = 0; i < n; ++i) {
            kit::StepGrads g = eager.eager_step(at(xs, i), at(ts, i), 0.0f, true, i);
            if (sum.w.empty()) {
                sum = g;
                continue;
            }
            for (size_t l = 0; l < g.w.size(); ++l) {
                for (size_t k = 0; k < g.w[l].size(); ++k) sum.w[l][k] += g.w[l][k];
                for (size_t k = 0; k < g.b[l].size(); ++k) sum.b[l][k] += g.b[l][k];
            }
        }
        std::vector<std::vector<float>> out;
        for (size_t l = 0; l < sum.w.size(); ++l) {
            out.push_back(sum.w[l]);
            out.push_back(sum.b[l]);
        }
        return out;
    }

    // The model under test: its layers with COPY_INTO grads, their grad
    // destinations, the callback's copies; the session and its step.
    struct Rig {
        kit::Mlp model;
        kit::Buffer xs, ts;
        std::vector<kit::Buffer> dst;
        std::vector<void*> dsts;
        Recorder rec;
        std::unique_ptr<graphed::Session> s;
        uint32_t step = 0;
        Rig(kit::Device& d, uint32_t n)
            : model(d, kLayers, kBatch, kWidth, 71), xs(d, kAct * n), ts(d, kAct * n) {
            for (int i = 0; i < kLayers; ++i) model.layer(i).param_policy = GRAPHED_GRAD_POLICY_COPY_INTO;
            rec.dev = &d;
            const auto ps = params(model);
            for (size_t p = 0; p < ps.size(); ++p) {
                dst.emplace_back(d, param_bytes(p));
                rec.seen.emplace_back(d, param_bytes(p));
                rec.index[ps[p]] = p;
            }
            for (auto& b : dst) dsts.push_back(b.get());
        }
    };

    // Loads the kit kernels the callback records, eagerly, before capture.
    void load_kernels() {
        kit::Buffer a(*dev, 16), b(*dev, 16);
        ASSERT_EQ(0, dev->copy(dev->stream(), a.get(), b.get(), 16));
        ASSERT_EQ(0, dev->add(dev->stream(), a.f32(), a.f32(), 4));
        dev->sync();
    }

    // Builds the rig's session and step (not captured).
    void build(Rig& r, uint32_t n, uint32_t loop_mode, const graphed::StepCollective& c) {
        r.s = std::make_unique<graphed::Session>(config());
        r.model.register_layers(*r.s, r.xs.get(), kit::Wiring{true, false, true});
        std::vector<uint32_t> all;
        for (uint32_t i = 0; i <= uint32_t(kLayers); ++i) all.push_back(i);
        const std::vector<graphed_step_io> io = {
            graphed::Session::step_io(0, GRAPHED_BUFFER_ROLE_INPUT, 0, r.xs.get(), kAct),
            graphed::Session::step_io(kLayers, GRAPHED_BUFFER_ROLE_INPUT, 1, r.ts.get(), kAct),
        };
        r.step = r.s->add_step(all, r.dsts, n, io, loop_mode, nullptr, nullptr, {}, c);
    }

    static graphed::StepCollective collective(Recorder& rec, uint32_t at) {
        graphed::StepCollective c;
        c.record = &Recorder::record;
        c.data = &rec;
        c.at = at;
        return c;
    }

    // Captures a step of `n` microbatches and replays it kIterations times
    // for each count of `counts` (0: all): the callback's copies are the
    // eager sums, the destinations twice them.
    void run(uint32_t n, uint32_t loop_mode, uint32_t at, const std::vector<uint32_t>& counts) {
        SCOPED_TRACE(testing::Message() << n << " microbatches, " << (loop_mode ? "WHILE" : "unrolled") << ", "
                                        << (at ? "PER_CALLABLE" : "AFTER_BACKWARD"));
        load_kernels();
        kit::Mlp eager(*dev, kLayers, kBatch, kWidth, 71);
        Rig r(*dev, n);
        data(*dev, n, 0, 0, r.xs, r.ts);
        build(r, n, loop_mode, collective(r.rec, at));
        EXPECT_TRUE(r.rec.calls.empty()) << "never called eagerly";
        r.s->capture();
        // Called under capture only, at its points, in backward order.
        std::vector<Recorder::Call> want;
        if (at == GRAPHED_COLLECTIVE_AT_AFTER_BACKWARD)
            want = {{GRAPHED_COLLECTIVE_ALL_CALLABLES, 4, 0}};
        else
            want = {{uint32_t(kLayers), 0, 0}, {1, 2, 0}, {0, 2, 0}};
        EXPECT_EQ(want, r.rec.calls);
        // The manifest: one all-reduce per grad, in the order recorded.
        const auto m = r.s->collectives(r.step);
        const std::vector<size_t> order = at == GRAPHED_COLLECTIVE_AT_AFTER_BACKWARD ? std::vector<size_t>{0, 1, 2, 3}
                                                                                      : std::vector<size_t>{2, 3, 0, 1};
        ASSERT_EQ(4u, m.size());
        for (size_t k = 0; k < m.size(); ++k) {
            EXPECT_EQ(kComm, m[k].communicator);
            EXPECT_EQ(uint32_t(GRAPHED_COLLECTIVE_OP_ALL_REDUCE), m[k].op);
            EXPECT_EQ(param_bytes(order[k]), m[k].bytes);
            EXPECT_EQ(uint32_t(GRAPHED_DTYPE_F32), m[k].dtype);
            EXPECT_EQ(at == GRAPHED_COLLECTIVE_AT_AFTER_BACKWARD ? GRAPHED_COLLECTIVE_ALL_CALLABLES
                                                                 : uint32_t(order[k] / 2),
                      m[k].callable);
            EXPECT_EQ(0u, m[k].reserved);
        }
        const size_t calls = r.rec.calls.size();
        std::vector<graphed::Ref> grads;
        int it = 0;
        for (uint32_t count : counts) {
            for (int rep = 0; rep < kIterations; ++rep, ++it) {
                const uint32_t k = count ? count : n;
                SCOPED_TRACE(testing::Message() << "iteration " << it << ", " << k << " microbatches");
                data(*dev, n, it, 0, r.xs, r.ts);
                const auto sum = eager_sum(eager, k, r.xs, r.ts);
                r.s->step(r.step, dev->stream(), grads, {}, count);
                dev->sync();
                for (size_t p = 0; p < sum.size(); ++p) {
                    ASSERT_EQ(sum[p], kit::fetch<float>(*dev, r.rec.seen[p].get(), sum[p].size()))
                        << "the grad of parameter " << p << " the collective saw";
                    std::vector<float> twice(sum[p]);
                    for (float& v : twice) v = v + v;
                    ASSERT_EQ(twice, kit::fetch<float>(*dev, r.dst[p].get(), sum[p].size()))
                        << "the destination of parameter " << p << " holds the reduced grad";
                }
            }
        }
        EXPECT_EQ(calls, r.rec.calls.size()) << "replays never call the callback";
    }
};

TEST_P(StepCollective, AfterBackwardSeesEachAccumulatedGradOneMicrobatch) {
    run(1, GRAPHED_STEP_LOOP_UNROLLED, GRAPHED_COLLECTIVE_AT_AFTER_BACKWARD, {0});
}

TEST_P(StepCollective, AfterBackwardSeesEachAccumulatedGradFourMicrobatches) {
    run(4, GRAPHED_STEP_LOOP_UNROLLED, GRAPHED_COLLECTIVE_AT_AFTER_BACKWARD, {0});
}

TEST_P(StepCollective, PerCallableSeesEachCallablesGradsInBackwardOrder) {
    run(1, GRAPHED_STEP_LOOP_UNROLLED, GRAPHED_COLLECTIVE_AT_PER_CALLABLE, {0});
    run(4, GRAPHED_STEP_LOOP_UNROLLED, GRAPHED_COLLECTIVE_AT_PER_CALLABLE, {0});
}

TEST_P(StepCollective, LoopedTheLastMicrobatchFollowsTheLoopAtEveryCount) {
    for (uint32_t at : {GRAPHED_COLLECTIVE_AT_AFTER_BACKWARD, GRAPHED_COLLECTIVE_AT_PER_CALLABLE}) {
        run(4, GRAPHED_STEP_LOOP_WHILE, at, {0, 1, 2, 3, 4, 1});
        run(1, GRAPHED_STEP_LOOP_WHILE, at, {1});
    }
}

// The manifest through the C function: capacity 0 gives the count, a
// smaller capacity writes that many, a larger entry size strides, a
// too-small one and a step without collectives are refused, writing
// nothing.
TEST_P(StepCollective, ManifestQuery) {
    load_kernels();
    Rig r(*dev, 2);
    data(*dev, 2, 0, 0, r.xs, r.ts);
    build(r, 2, GRAPHED_STEP_LOOP_UNROLLED, collective(r.rec, GRAPHED_COLLECTIVE_AT_AFTER_BACKWARD));
    size_t n = 99;
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_WRONG_STATE,
                           graphed_step_collectives(r.s->get(), r.step, nullptr, 0, sizeof(graphed_collective_entry), &n),
                           "captur"));
    EXPECT_EQ(99u, n) << "a refusal writes nothing";
    r.s->capture();
    ASSERT_EQ(GRAPHED_STATUS_OK,
              graphed_step_collectives(r.s->get(), r.step, nullptr, 0, sizeof(graphed_collective_entry), &n));
    EXPECT_EQ(4u, n);
    graphed_collective_entry two[3];
    std::memset(two, 0xAB, sizeof two);
    ASSERT_EQ(GRAPHED_STATUS_OK, graphed_step_collectives(r.s->get(), r.step, two, 2, sizeof(graphed_collective_entry), &n));
    EXPECT_EQ(4u, n) << "the total, whatever the capacity";
    EXPECT_EQ(param_bytes(0), two[0].bytes);
    EXPECT_EQ(param_bytes(1), two[1].bytes);
    unsigned char untouched[sizeof(graphed_collective_entry)];
    std::memset(untouched, 0xAB, sizeof untouched);
    EXPECT_EQ(0, std::memcmp(untouched, &two[2], sizeof untouched)) << "nothing beyond the capacity";
    // A larger entry (a newer caller's): each entry at its stride.
    struct Wide {
        graphed_collective_entry e;
        uint64_t more;
    } wide[4];
    std::memset(wide, 0, sizeof wide);
    ASSERT_EQ(GRAPHED_STATUS_OK, graphed_step_collectives(r.s->get(), r.step, &wide[0].e, 4, sizeof(Wide), &n));
    for (size_t k = 0; k < 4; ++k) {
        EXPECT_EQ(param_bytes(k), wide[k].e.bytes);
        EXPECT_EQ(kComm, wide[k].e.communicator);
    }
    graphed_collective_entry e{};
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_step_collectives(r.s->get(), r.step, &e, 1, 8, &n),
                           "the element size is 8 bytes; the smallest is 32"));
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_NULL_POINTER,
                           graphed_step_collectives(r.s->get(), r.step, nullptr, 1, sizeof e, &n), "entries"));
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_NULL_POINTER,
                           graphed_step_collectives(r.s->get(), r.step, &e, 1, sizeof e, nullptr), "count_out"));
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT,
                           graphed_step_collectives(r.s->get(), r.step + 1, &e, 1, sizeof e, &n), "step 1"));
    // A step without a collective stage.
    Rig plain(*dev, 1);
    build(plain, 1, GRAPHED_STEP_LOOP_UNROLLED, {});
    plain.s->capture();
    EXPECT_TRUE(throws(GRAPHED_STATUS_INVALID_ARGUMENT, [&] { plain.s->collectives(plain.step); },
                       "step 0 has no collective stage"));
}

// Bad descriptors are refused at add_step; recording outside a callback
// is WRONG_STATE; a callback that fails, records a bad op or breaks the
// capture fails it naming the step and point, and nothing is kept.
TEST_P(StepCollective, RefusalsAndFailingCallbacks) {
    load_kernels();
    struct Case {
        graphed::StepCollective c;
        graphed_status want;
        const char* words;
    };
    Recorder dummy;
    graphed::StepCollective data_only;
    data_only.data = &dummy;
    graphed::StepCollective exchange_only;
    exchange_only.exchange = [](const void*, size_t, void*, void*) -> int32_t { return 0; };
    graphed::StepCollective bad_at = collective(dummy, 2);
    graphed::StepCollective bad_rank = collective(dummy, GRAPHED_COLLECTIVE_AT_AFTER_BACKWARD);
    bad_rank.rank = 1;
    graphed::StepCollective exchange_data_only = collective(dummy, GRAPHED_COLLECTIVE_AT_AFTER_BACKWARD);
    exchange_data_only.exchange_data = &dummy;
    const std::vector<Case> cases = {
        {data_only, GRAPHED_STATUS_INVALID_ARGUMENT, "desc.collective_data is set but desc.collective is NULL"},
        {exchange_only, GRAPHED_STATUS_INVALID_ARGUMENT, "desc.collective_exchange is set"},
        {bad_at, GRAPHED_STATUS_INVALID_ARGUMENT, "desc.collective_at: 2 is not a graphed_collective_at value"},
        {bad_rank, GRAPHED_STATUS_INVALID_ARGUMENT, "collective_rank is 1 and collective_ranks 1"},
        {exchange_data_only, GRAPHED_STATUS_INVALID_ARGUMENT,
         "desc.collective_exchange_data is set but desc.collective_exchange is NULL"},
    };
    for (const Case& c : cases) {
        Rig r(*dev, 1);
        EXPECT_TRUE(throws(c.want, [&] { build(r, 1, GRAPHED_STEP_LOOP_UNROLLED, c.c); }, c.words));
        EXPECT_EQ(0u, r.s->stats().graph_count);
    }
    // Outside a callback: WRONG_STATE; NULL: NULL_POINTER.
    graphed_collective_ctx fake{};
    EXPECT_TRUE(fails_with(GRAPHED_STATUS_WRONG_STATE,
                           graphed_collective_record(&fake, 1, GRAPHED_COLLECTIVE_OP_ALL_REDUCE, 4, GRAPHED_DTYPE_F32),
                           "only from a step's collective callback"));
    EXPECT_EQ(GRAPHED_STATUS_NULL_POINTER,
              graphed_collective_record(nullptr, 1, GRAPHED_COLLECTIVE_OP_ALL_REDUCE, 4, GRAPHED_DTYPE_F32));
    // Failing at capture, unrolled and looped.
    const struct {
        int mode;
        graphed_status want;
        const char* words;
    } failing[] = {
        {1, GRAPHED_STATUS_CALLBACK_FAILED,
         "the collective callback of step 0 after the last microbatch's backward returned -1 during capture: no "
         "communicator"},
        {2, GRAPHED_STATUS_CALLBACK_FAILED, "returned 101 during capture"},
        {3, GRAPHED_STATUS_CAPTURE_INVALIDATED,
         "the collective callback of step 0 after the last microbatch's backward invalidated the capture"},
    };
    for (const auto& f : failing) {
        for (uint32_t loop_mode : {GRAPHED_STEP_LOOP_UNROLLED, GRAPHED_STEP_LOOP_WHILE}) {
            SCOPED_TRACE(testing::Message() << "mode " << f.mode << ", loop " << loop_mode);
            Rig r(*dev, 2);
            data(*dev, 2, 0, 0, r.xs, r.ts);
            r.rec.mode = f.mode;
            build(r, 2, loop_mode, collective(r.rec, GRAPHED_COLLECTIVE_AT_AFTER_BACKWARD));
            EXPECT_TRUE(throws(f.want, [&] { r.s->capture(); }, f.words));
            EXPECT_EQ(0u, r.s->stats().graph_count) << "nothing kept";
            size_t n = 0;
            EXPECT_NE(GRAPHED_STATUS_OK, graphed_step_collectives(r.s->get(), r.step, nullptr, 0,
                                                                  sizeof(graphed_collective_entry), &n));
        }
    }
}

INSTANTIATE_TEST_SUITE_P(Backends, StepCollective, backends(), BackendName());

// ---- two ranks as two threads (host backend) ----------------------------------

// An in-process communicator of `ranks` threads: all_gather concatenates
// every rank's bytes in rank order (a reusable barrier).
class Comm {
  public:
    explicit Comm(size_t ranks) : ranks_(ranks), slots_(ranks) {}
    size_t ranks() const { return ranks_; }

    std::vector<std::vector<unsigned char>> all_gather(size_t rank, const void* mine, size_t bytes) {
        std::unique_lock<std::mutex> lock(mu_);
        // Wait until the previous round has been read by everyone.
        cv_.wait(lock, [&] { return !reading_; });
        const auto* p = static_cast<const unsigned char*>(mine);
        slots_[rank].assign(p, p + bytes);
        if (++arrived_ == ranks_) {
            reading_ = true;
            left_ = ranks_;
            ++round_;
            cv_.notify_all();
        } else {
            const uint64_t round = round_;
            cv_.wait(lock, [&] { return round_ != round; });
        }
        auto all = slots_;
        if (--left_ == 0) {
            reading_ = false;
            arrived_ = 0;
            cv_.notify_all();
        }
        return all;
    }

  private:
    size_t ranks_;
    std::vector<std::vector<unsigned char>> slots_;
    std::mutex mu_;
    std::condition_variable cv_;
    size_t arrived_ = 0, left_ = 0;
    uint64_t round_ = 0;
    bool reading_ = false;
};

// A rank's collective stage: each grad all-reduced (summed in rank order)
// by a host task recorded into the step's graph; the manifests through
// the same in-process all-gather.
struct Rank {
    Comm* comm = nullptr;
    size_t rank = 0;
    int mode = 0;  // 4: records 4 bytes more on its first collective
    struct Task {
        Rank* self;
        float* grad;
        size_t count;
    };
    std::deque<Task> tasks;

    static void all_reduce(void* data) {
        auto* t = static_cast<Task*>(data);
        const auto all = t->self->comm->all_gather(t->self->rank, t->grad, t->count * 4);
        for (size_t i = 0; i < t->count; ++i) {
            float sum = 0.0f;
            for (size_t r = 0; r < all.size(); ++r) {
                float v;
                std::memcpy(&v, all[r].data() + 4 * i, 4);
                sum = r == 0 ? v : sum + v;
            }
            t->grad[i] = sum;
        }
    }

    static int32_t record(const graphed_collective_ctx* ctx, void* self) {
        return graphed::guard([&]() -> int {
            auto* r = static_cast<Rank*>(self);
            for (size_t k = 0; k < ctx->num_params; ++k) {
                if (!ctx->grads[k]) continue;
                const uint64_t extra = (r->mode == 4 && k == 0) ? 4 : 0;
                graphed::check(graphed_collective_record(ctx, kComm, GRAPHED_COLLECTIVE_OP_ALL_REDUCE,
                                                         ctx->bytes[k] + extra, ctx->dtypes[k]));
                r->tasks.push_back({r, static_cast<float*>(ctx->grads[k]), ctx->bytes[k] / 4});
                graphed::check(graphed_host_enqueue(ctx->stream, &Rank::all_reduce, &r->tasks.back()));
            }
            return 0;
        });
    }

    static int32_t exchange(const void* mine, size_t bytes, void* all, void* self) {
        auto* r = static_cast<Rank*>(self);
        const auto got = r->comm->all_gather(r->rank, mine, bytes);
        for (size_t k = 0; k < got.size(); ++k) std::memcpy(static_cast<char*>(all) + k * bytes, got[k].data(), bytes);
        return 0;
    }
};

class StepCollectiveTwoRanks : public ::testing::Test {
  protected:
    static constexpr int kLayers = 2, kBatch = 8, kWidth = 32, kIterations = 4;
    static constexpr uint32_t kMicrobatches = 3;
    static constexpr size_t kAct = size_t(kBatch) * kWidth * 4;

    struct Outcome {
        graphed_status status = GRAPHED_STATUS_OK;
        std::string message;
        // Per iteration, each parameter's destination after the replay.
        std::vector<std::vector<std::vector<float>>> reduced;
    };

    static void data(kit::Device& d, int it, size_t rank, kit::Buffer& xs, kit::Buffer& ts) {
        auto x = kit::random_floats(size_t(kBatch) * kWidth * kMicrobatches, 1000 + uint32_t(it) + 97 * uint32_t(rank));
        auto t = kit::random_floats(size_t(kBatch) * kWidth * kMicrobatches, 5000 + uint32_t(it) + 89 * uint32_t(rank));
        d.upload(xs.get(), x.data(), xs.bytes());
        d.upload(ts.get(), t.data(), ts.bytes());
    }

    // One rank: its own host device, model (same weights on every rank),
    // data, session and step; captures and trains when the capture works.
    static Outcome rank_main(Comm& comm, size_t rank, int mode, uint32_t loop_mode) {
        Outcome out;
        auto dev = kit::make_host_device();
        kit::Mlp model(*dev, kLayers, kBatch, kWidth, 71);
        for (int i = 0; i < kLayers; ++i) model.layer(i).param_policy = GRAPHED_GRAD_POLICY_COPY_INTO;
        kit::Buffer xs(*dev, kAct * kMicrobatches), ts(*dev, kAct * kMicrobatches);
        data(*dev, 0, rank, xs, ts);
        std::vector<kit::Buffer> dst;
        std::vector<void*> dsts;
        for (int l = 0; l < kLayers; ++l)
            for (size_t bytes : {size_t(kWidth) * kWidth * 4, size_t(kWidth) * 4}) dst.emplace_back(*dev, bytes);
        for (auto& b : dst) dsts.push_back(b.get());
        Rank r;
        r.comm = &comm;
        r.rank = rank;
        r.mode = mode;
        try {
            graphed::Session s(graphed::session_config(GRAPHED_BACKEND_HOST));
            model.register_layers(s, xs.get(), kit::Wiring{true, false, true});
            const std::vector<graphed_step_io> io = {
                graphed::Session::step_io(0, GRAPHED_BUFFER_ROLE_INPUT, 0, xs.get(), kAct),
                graphed::Session::step_io(kLayers, GRAPHED_BUFFER_ROLE_INPUT, 1, ts.get(), kAct),
            };
            graphed::StepCollective c;
            c.record = &Rank::record;
            c.data = &r;
            c.exchange = &Rank::exchange;
            c.exchange_data = &r;
            c.rank = uint32_t(rank);
            c.ranks = uint32_t(comm.ranks());
            const uint32_t step = s.add_step({0, 1, 2}, dsts, kMicrobatches, io, loop_mode, nullptr, nullptr, {}, c);
            s.capture();
            std::vector<graphed::Ref> grads;
            for (int it = 0; it < kIterations; ++it) {
                data(*dev, it, rank, xs, ts);
                s.step(step, dev->stream(), grads);
                std::vector<std::vector<float>> got;
                for (auto& b : dst) got.push_back(kit::fetch<float>(*dev, b.get(), b.bytes() / 4));
                out.reduced.push_back(got);
            }
        } catch (const graphed::Error& e) {
            out.status = e.status();
            out.message = e.message();
        }
        return out;
    }

    static std::vector<Outcome> two_ranks(int mode0, int mode1, uint32_t loop_mode) {
        Comm comm(2);
        std::vector<Outcome> out(2);
        std::thread t0([&] { out[0] = rank_main(comm, 0, mode0, loop_mode); });
        std::thread t1([&] { out[1] = rank_main(comm, 1, mode1, loop_mode); });
        t0.join();
        t1.join();
        return out;
    }

    // Rank `rank`'s eager grads of iteration `it`, summed over the
    // microbatches in order (w0, b0, w1, b1).
    static std::vector<std::vector<float>> eager(int it, size_t rank) {
        auto dev = kit::make_host_device();
        kit::Mlp m(*dev, kLayers, kBatch, kWidth, 71);
        kit::Buffer xs(*dev, kAct * kMicrobatches), ts(*dev, kAct * kMicrobatches);
        data(*dev, it, rank, xs, ts);
        std::vector<std::vector<float>> sum;
        for (uint32_t i = 0; i < kMicrobatches; ++i) {
            kit::StepGrads g = m.eager_step(static_cast<const char*>(xs.get()) + i * kAct,
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
};

TEST_F(StepCollectiveTwoRanks, ExchangeManifestsAndReduceAsTheEagerSum) {
    for (uint32_t loop_mode : {GRAPHED_STEP_LOOP_UNROLLED, GRAPHED_STEP_LOOP_WHILE}) {
        SCOPED_TRACE(testing::Message() << "loop " << loop_mode);
        const auto out = two_ranks(0, 0, loop_mode);
        for (size_t r = 0; r < 2; ++r) {
            ASSERT_EQ(GRAPHED_STATUS_OK, out[r].status) << "rank " << r << ": " << out[r].message;
            ASSERT_EQ(size_t(kIterations), out[r].reduced.size());
        }
        for (int it = 0; it < kIterations; ++it) {
            const auto g0 = eager(it, 0), g1 = eager(it, 1);
            for (size_t p = 0; p < g0.size(); ++p) {
                std::vector<float> sum(g0[p].size());
                for (size_t k = 0; k < sum.size(); ++k) sum[k] = g0[p][k] + g1[p][k];
                EXPECT_NE(g0[p], g1[p]) << "the ranks' data differ";
                for (size_t r = 0; r < 2; ++r)
                    ASSERT_EQ(sum, out[r].reduced[size_t(it)][p])
                        << "rank " << r << ", iteration " << it << ", parameter " << p;
            }
        }
    }
}

TEST_F(StepCollectiveTwoRanks, AMismatchFailsBothRanksNamingBothSides) {
    const auto out = two_ranks(0, 4, GRAPHED_STEP_LOOP_UNROLLED);
    for (size_t r = 0; r < 2; ++r) {
        EXPECT_EQ(GRAPHED_STATUS_COLLECTIVE_MISMATCH, out[r].status) << "rank " << r << ": " << out[r].message;
        EXPECT_NE(std::string::npos,
                  out[r].message.find("rank 0 records all_reduce of 4096 bytes f32 on communicator 7 as collective 0 "
                                      "(after the last microbatch's backward); rank 1 records all_reduce of 4100 "
                                      "bytes f32"))
            << "rank " << r << ": " << out[r].message;
        EXPECT_TRUE(out[r].reduced.empty()) << "no replay after a mismatch";
    }
}

}  // namespace
