// Suite SessionAnswers: what a framework's adapter asks the library instead
// of re-deriving it. Each callback's context names its pass's position in
// the capture order (graphed_pass_ctx.capture_position: the index into
// graphed_schedule_passes's list, in warmup and capture) and its instance
// (graphed_pass_ctx.instance: the number graphed_session_instance_of
// answers after capture, dense); graphed_session_bucket_of names the bucket
// a forward of a size runs, which is the one that runs. On the host and on
// CUDA. (Where the graphs read each parameter after a move is in
// MovedParams, whose CUDA instances move them.)
#include "expect.hpp"
#include "layers.hpp"
#include "support.hpp"

#include <cstdint>
#include <set>
#include <tuple>
#include <vector>

namespace {

// One call of a callback, as its context said.
struct Seen {
    uint32_t callable, microbatch, bucket, pass, phase, position, instance;
};

Seen seen(const graphed_pass_ctx* ctx) {
    return Seen{ctx->callable, ctx->microbatch, ctx->bucket,           ctx->pass,
                ctx->phase,    ctx->capture_position, ctx->instance};
}

// A linear layer of the kit whose callbacks record their context first.
struct Recorded {
    kit::LinearLayer layer;
    std::vector<Seen>* calls = nullptr;

    graphed::Callable callable(const void* sample) {
        graphed::Callable c = layer.callable(sample, true);
        c.forward = &Recorded::forward;
        c.backward = &Recorded::backward;
        c.user_data = this;
        return c;
    }
    static int32_t forward(const graphed_pass_ctx* ctx, void* self) {
        auto* r = static_cast<Recorded*>(self);
        r->calls->push_back(seen(ctx));
        return kit::LinearLayer::forward(ctx, &r->layer);
    }
    static int32_t backward(const graphed_pass_ctx* ctx, void* self) {
        auto* r = static_cast<Recorded*>(self);
        r->calls->push_back(seen(ctx));
        return kit::LinearLayer::backward(ctx, &r->layer);
    }
};

// A bucketed probe: its forward copies the bucket's rows of its input to
// its first output and, into its second, the number of the bucket it
// records (from a device buffer per bucket), so that a replay tells which
// bucket ran.
struct BucketProbe {
    static constexpr int64_t kMaxRows = 16;
    kit::Device* dev = nullptr;
    std::vector<kit::Buffer> numbers;  // per bucket: its number, a uint64_t
    std::vector<Seen> calls;
    int64_t shape[2] = {kMaxRows, 4};

    graphed::Callable callable(const std::vector<uint64_t>& sizes) {
        for (uint64_t b = 0; b < sizes.size(); ++b) {
            numbers.emplace_back(*dev, 8);
            dev->upload(numbers.back().get(), &b, 8);
        }
        graphed::Callable c;
        c.name = "probe";
        c.inputs = {graphed::tensor_desc(size_t(kMaxRows) * 16)};
        c.outputs = {graphed::tensor_desc(size_t(kMaxRows) * 16), graphed::tensor_desc(8)};
        for (graphed_tensor_desc* t : {&c.inputs[0], &c.outputs[0]}) {
            t->ndim = 2;
            t->shape = shape;
            t->flags = GRAPHED_TENSOR_FLAGS_DYNAMIC;
        }
        c.forward = &BucketProbe::forward;
        c.backward = &BucketProbe::backward;
        c.user_data = this;
        c.buckets = sizes;
        return c;
    }
    static int32_t forward(const graphed_pass_ctx* ctx, void* self) {
        auto* p = static_cast<BucketProbe*>(self);
        p->calls.push_back(seen(ctx));
        if (int e = p->dev->copy(ctx->stream, ctx->outputs[0], ctx->inputs[0], size_t(ctx->bucket_size) * 16)) return e;
        return p->dev->copy(ctx->stream, ctx->outputs[1], p->numbers.at(ctx->bucket).get(), 8);
    }
    static int32_t backward(const graphed_pass_ctx* ctx, void* self) {
        static_cast<BucketProbe*>(self)->calls.push_back(seen(ctx));
        return 0;
    }
};

class SessionAnswers : public BackendTest {};

// Transformer Engine's interleaved order (2 chunks of one layer, 3
// microbatches): in both warmup iterations and in every capture, each
// pass's position indexes graphed_schedule_passes's list, and its instance
// is graphed_session_instance_of's answer, dense over the session.
TEST_P(SessionAnswers, PositionsIndexTheSchedulesPassesAndInstancesAreTheLibrarys) {
    const std::vector<graphed_schedule_step> steps =
        graphed::schedule_from_te_order({1, 2, 1, 2, -2, -1, 1, 2, -2, -1, -2, -1});
    const std::vector<graphed_pass_ref> passes = graphed::schedule_passes(steps, 2);
    ASSERT_EQ(12u, passes.size());
    constexpr int kBatch = 4, kWidth = 8;
    kit::Buffer x(*dev, size_t(kBatch) * kWidth * 4);
    const std::vector<float> xs = kit::random_floats(size_t(kBatch) * kWidth, 5);
    dev->upload(x.get(), xs.data(), xs.size() * 4);
    std::vector<Seen> calls;
    Recorded layers[2];
    std::vector<kit::Buffer> params;
    for (int l = 0; l < 2; ++l) {
        kit::LinearLayer& L = layers[l].layer;
        L.dev = dev.get();
        L.batch = kBatch;
        L.in = L.out = kWidth;
        L.name = "layer" + std::to_string(l);
        params.emplace_back(*dev, size_t(kWidth) * kWidth * 4);
        params.emplace_back(*dev, size_t(kWidth) * 4);
        L.w = params[params.size() - 2].get();
        L.b = params.back().get();
        layers[l].calls = &calls;
    }
    graphed_session_config cfg = config();
    cfg.schedule = steps.data();
    cfg.num_schedule_steps = steps.size();
    cfg.warmup_iterations = 2;
    graphed::Session s(cfg);
    for (Recorded& r : layers) s.add_callable(r.callable(x.get()));
    s.capture();

    ASSERT_GE(calls.size(), 3 * passes.size()) << "two warmup iterations and the capture";
    std::set<uint32_t> instances;
    for (size_t k = 0; k < calls.size(); ++k) {
        const Seen& c = calls[k];
        SCOPED_TRACE(testing::Message() << "call " << k << ": callable " << c.callable << ", microbatch "
                                        << c.microbatch << ", pass " << c.pass << ", phase " << c.phase);
        ASSERT_LT(c.position, passes.size());
        const graphed_pass_ref& p = passes[c.position];
        EXPECT_EQ(std::make_tuple(p.callable, p.microbatch, p.pass), std::make_tuple(c.callable, c.microbatch, c.pass));
        if (k < 2 * passes.size()) EXPECT_EQ(k % passes.size(), c.position) << "warmup runs the passes in that order";
        EXPECT_EQ(s.instance_of(c.callable, c.microbatch), c.instance);
        EXPECT_EQ(0u, c.bucket);
        instances.insert(c.instance);
    }
    EXPECT_EQ((std::set<uint32_t>{0, 1, 2, 3, 4, 5}), instances);
    EXPECT_EQ(6u, s.stats().instances);
    EXPECT_TRUE(throws(GRAPHED_STATUS_INVALID_ARGUMENT, [&] { s.instance_of(0, 3); }, "microbatch 3 does not exist"));
    EXPECT_TRUE(throws(GRAPHED_STATUS_INVALID_ARGUMENT, [&] { s.instance_of(0, 0, 1); }, "bucket 1 does not exist"));
}

// The bucket graphed_session_bucket_of names for each size is the bucket a
// forward of that size runs (before capture too); each bucket's passes are
// one instance of their own and take their positions round by round.
TEST_P(SessionAnswers, BucketOfIsTheBucketAForwardRuns) {
    const std::vector<uint64_t> sizes = {4, 8, 16};
    BucketProbe probe;
    probe.dev = dev.get();
    graphed::Session s(config());
    s.add_callable(probe.callable(sizes));
    EXPECT_EQ(1u, s.bucket_of(0, 5).index) << "answered before capture";
    s.capture();
    for (const Seen& c : probe.calls) {
        EXPECT_EQ(c.bucket, c.instance) << "one callable: its buckets are instances 0 to 2";
        EXPECT_EQ(2 * c.bucket + (c.pass == GRAPHED_PASS_BACKWARD ? 1u : 0u), c.position)
            << "round by round: bucket " << c.bucket << ", pass " << c.pass;
        EXPECT_EQ(s.instance_of(0, 0, c.bucket), c.instance);
    }
    kit::Buffer in(*dev, size_t(BucketProbe::kMaxRows) * 16);
    graphed::Replay r;
    r.stream(dev->stream());
    for (uint64_t n = 1; n <= 16; ++n) {
        SCOPED_TRACE(testing::Message() << n << " rows");
        const graphed::Bucket b = s.bucket_of(0, n);
        ASSERT_LT(b.index, sizes.size());
        EXPECT_EQ(sizes[b.index], b.size);
        EXPECT_GE(b.size, n);
        if (b.index > 0) EXPECT_LT(sizes[b.index - 1], n) << "the smallest bucket holding n rows";
        std::vector<graphed::Ref> outs = s.forward(r.size(n).data(in.get()));
        dev->sync();
        EXPECT_EQ(uint64_t(b.index), kit::fetch<uint64_t>(*dev, outs[1].ptr(), 1)[0]) << "the bucket that ran";
    }
    EXPECT_TRUE(throws(GRAPHED_STATUS_INVALID_ARGUMENT, [&] { s.bucket_of(0, 17); },
                       std::vector<std::string>{"size 17 is above the largest bucket", "'probe'"}));
    EXPECT_TRUE(throws(GRAPHED_STATUS_INVALID_ARGUMENT, [&] { s.bucket_of(0, 0); }, "names its actual size"));
    EXPECT_TRUE(throws(GRAPHED_STATUS_INVALID_ARGUMENT, [&] { s.bucket_of(1, 4); }, "callable 1 does not exist"));
    s.reset();
    EXPECT_TRUE(throws(GRAPHED_STATUS_SESSION_RESET, [&] { s.bucket_of(0, 4); }, "reset"));
}

INSTANTIATE_TEST_SUITE_P(Backends, SessionAnswers, backends(), BackendName());

}  // namespace
