// Suite Buckets: callables captured in several sizes of their batch
// dimension (graphed_callable_desc.bucket_sizes, GRAPHED_TENSOR_FLAGS_DYNAMIC),
// every bucket in the largest one's static memory. A forward names its
// actual size; the smallest bucket holding it runs on the actual rows with
// the rest zeroed, and the outputs come back as the actual rows. The MLP's
// kernels (the kit's: one thread per output element, sums in row order)
// are row-independent, so outputs, input grads and parameter grads equal
// an eager MLP of exactly that many rows, bit for bit. Also: memory (one
// bucket's), the actual size on the device, strict leases across buckets,
// EXTERNAL buffers per bucket, and every refusal. On the host and on CUDA.
#include "expect.hpp"
#include "layers.hpp"
#include "support.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace {

class Buckets : public BackendTest {
  protected:
    static constexpr int kLayers = 3, kWidth = 32, kMax = 32;
    const std::vector<uint64_t> kSizes = {8, 16, 32};

    kit::Buffer floats(size_t n, uint32_t seed) {
        auto v = kit::random_floats(n, seed);
        kit::Buffer b(*dev, n * 4);
        dev->upload(b.get(), v.data(), n * 4);
        return b;
    }

    // After a graphed step whose loss grad is in `gy` (`elems` values) and
    // whose grads are `grads`: the loss and every grad equal to `eager`'s
    // step (`want`), bit for bit; the grads are released.
    void expect_step(kit::Mlp& eager, const kit::StepGrads& want, const kit::Buffer& gy, size_t elems,
                     std::vector<graphed::Grads>& grads) {
        dev->sync();
        double loss = 0.0;
        for (float v : kit::fetch<float>(*dev, gy.get(), elems)) loss += 0.5 * double(v) * double(v);
        EXPECT_EQ(loss, eager.last_loss()) << "the outputs, through the loss";
        for (int i = 0; i < kLayers; ++i) {
            const graphed::Ref& gw = grads[size_t(i)].params[0];
            const graphed::Ref& gb = grads[size_t(i)].params[1];
            EXPECT_EQ(want.w[size_t(i)], kit::fetch<float>(*dev, gw.ptr(), gw.bytes() / 4)) << "weight grad " << i;
            EXPECT_EQ(want.b[size_t(i)], kit::fetch<float>(*dev, gb.ptr(), gb.bytes() / 4)) << "bias grad " << i;
        }
        for (auto& gr : grads) gr = graphed::Grads{};
    }

    // A captured session of an MLP of kLayers layers whose batch takes the
    // sizes kSizes (with `strict` leases).
    graphed::Session mlp_session(kit::Mlp& m, const kit::Buffer& sample, bool strict = false) {
        graphed_session_config cfg = config();
        cfg.strict_leases = strict ? 1 : 0;
        graphed::Session s(cfg);
        kit::Wiring w;
        w.buckets = kSizes;
        m.register_layers(s, sample.get(), w);
        s.capture();
        return s;
    }
};

// One probe: its forward copies the actual size the device holds into its
// second output and records what its context said in every call.
struct Probe {
    kit::Device* dev = nullptr;
    std::vector<std::pair<uint64_t, uint64_t>> seen;  // (bucket, bucket_size) per warmup forward
    int64_t in_shape[2] = {kMaxRows, 4}, out_shape[2] = {kMaxRows, 4};
    static constexpr int64_t kMaxRows = 24;

    graphed::Callable callable(const std::vector<uint64_t>& sizes) {
        graphed::Callable c;
        c.name = "probe";
        c.inputs = {graphed::tensor_desc(size_t(kMaxRows) * 16)};
        c.inputs[0].ndim = 2;
        c.inputs[0].shape = in_shape;
        c.inputs[0].flags = GRAPHED_TENSOR_FLAGS_DYNAMIC;
        c.outputs = {graphed::tensor_desc(size_t(kMaxRows) * 16), graphed::tensor_desc(8)};
        c.outputs[0].ndim = 2;
        c.outputs[0].shape = out_shape;
        c.outputs[0].flags = GRAPHED_TENSOR_FLAGS_DYNAMIC;
        c.forward = &Probe::forward;
        c.backward = &Probe::backward;
        c.user_data = this;
        c.buckets = sizes;
        return c;
    }
    static int32_t forward(const graphed_pass_ctx* ctx, void* self) {
        auto* p = static_cast<Probe*>(self);
        if (ctx->phase == GRAPHED_PHASE_WARMUP && ctx->iteration == 0) p->seen.emplace_back(ctx->bucket, ctx->bucket_size);
        if (ctx->num_buckets == 0 || ctx->actual_size == nullptr) return 7;
        // The whole bucket: the padding rows must arrive zeroed.
        if (int e = p->dev->copy(ctx->stream, ctx->outputs[0], ctx->inputs[0], size_t(ctx->bucket_size) * 16)) return e;
        return p->dev->copy(ctx->stream, ctx->outputs[1], ctx->actual_size, 8);
    }
    static int32_t backward(const graphed_pass_ctx*, void*) { return 0; }
};

TEST_P(Buckets, EveryActualSizeMatchesEagerOfThatSizeBitForBit) {
    kit::Buffer sample = floats(size_t(kMax) * kWidth, 3);
    kit::Mlp graphed(*dev, kLayers, kMax, kWidth, 41);
    graphed::Session s = mlp_session(graphed, sample);
    graphed::Replay r;
    r.stream(dev->stream());
    std::vector<graphed::Ref> outs;
    std::vector<graphed::Grads> grads(kLayers);
    // Every bucket, its edges, sizes between, a size again after a larger
    // one (its padding rows held that one's data), and sizes that shrink
    // and grow inside one bucket (the rows known zero change).
    for (uint64_t n : {5u, 8u, 13u, 16u, 32u, 1u, 9u, 13u, 10u, 12u, 16u}) {
        SCOPED_TRACE(testing::Message() << n << " rows");
        const size_t elems = size_t(n) * kWidth;
        kit::Buffer x = floats(elems, 100 + uint32_t(n)), t = floats(elems, 200 + uint32_t(n));
        kit::Mlp eager(*dev, kLayers, int(n), kWidth, 41);
        kit::StepGrads want = eager.eager_step(x.get(), t.get(), 0.0f);

        r.size(n);
        const void* in = x.get();
        for (int i = 0; i < kLayers; ++i) {
            s.forward(r.callable(uint32_t(i)).data(in), outs);
            ASSERT_EQ(outs[0].bytes(), elems * 4) << "the actual rows of layer " << i;
            in = outs[0].ptr();
        }
        kit::Buffer gy(*dev, elems * 4);
        dev->sub(dev->stream(), GRAPHED_DTYPE_F32, in, t.get(), gy.get(), elems);
        const void* g = gy.get();
        r.size(0);  // backward: the forward's bucket and size
        for (int i = kLayers - 1; i >= 0; --i) {
            s.backward(r.callable(uint32_t(i)).data(g), grads[i]);
            if (i > 0) {
                ASSERT_EQ(grads[i].inputs[0].bytes(), elems * 4);
                g = grads[i].inputs[0].ptr();
            }
        }
        expect_step(eager, want, gy, elems, grads);
    }
}

// Parameters that move before every replay, in buckets that change every
// replay, are followed by each bucket's graphs: the memory they were
// registered at and the previous replay's copy hold NaN, and the results
// are eager's of that size, bit for bit. On the host parameters stay (its
// graphs run host tasks, which cannot be pointed elsewhere).
TEST_P(Buckets, MovedParametersFollowBucketsThatChangeEveryReplay) {
    kit::Buffer sample = floats(size_t(kMax) * kWidth, 3);
    kit::Mlp graphed(*dev, kLayers, kMax, kWidth, 41);
    const bool cuda = GetParam() == kit::Backend::Cuda;
    if (cuda)
        for (int i = 0; i < kLayers; ++i) graphed.layer(i).param_flags = GRAPHED_PARAM_FLAGS_REBIND;
    graphed::Session s = mlp_session(graphed, sample);
    const graphed_session_stats st = s.stats();
    SCOPED_TRACE(figures(st));
    EXPECT_EQ(st.params_move_refused, 0u);
    if (cuda) EXPECT_EQ(st.params_movable, uint32_t(2 * kLayers * kSizes.size())) << "every bucket's instance";

    // Two homes per parameter, used in turn; the one not in use and the
    // registered memory hold NaN.
    std::vector<kit::Buffer> home[2];
    std::vector<size_t> bytes;
    for (int i = 0; i < kLayers; ++i) {
        bytes.push_back(size_t(kWidth) * kWidth * 4);
        bytes.push_back(size_t(kWidth) * 4);
    }
    for (auto& h : home)
        for (size_t b : bytes) h.emplace_back(*dev, b);
    auto poison = [&](void* p, size_t b) {
        std::vector<float> nan(b / 4, std::nanf(""));
        dev->upload(p, nan.data(), b);
    };
    kit::Mlp eager_weights(*dev, kLayers, kMax, kWidth, 41);
    for (int i = 0; i < kLayers && cuda; ++i) {
        poison(graphed.layer(i).w, bytes[2 * size_t(i)]);
        poison(graphed.layer(i).b, bytes[2 * size_t(i) + 1]);
    }
    std::vector<graphed::Ref> outs;
    std::vector<graphed::Grads> grads(kLayers);
    int turn = 0;
    for (uint64_t n : {5u, 32u, 13u, 8u, 32u, 1u, 16u, 9u}) {
        SCOPED_TRACE(testing::Message() << n << " rows");
        auto& use = home[turn % 2];
        auto& other = home[(turn + 1) % 2];
        ++turn;
        for (int i = 0; i < kLayers; ++i) {
            for (size_t j : {2 * size_t(i), 2 * size_t(i) + 1})
                ASSERT_EQ(0, dev->copy(dev->stream(), use[j].get(), j % 2 ? eager_weights.layer(i).b : eager_weights.layer(i).w,
                                       bytes[j]));
        }
        dev->sync();
        for (size_t j = 0; j < bytes.size() && cuda; ++j) poison(other[j].get(), bytes[j]);
        const size_t elems = size_t(n) * kWidth;
        kit::Buffer x = floats(elems, 100 + uint32_t(n)), t = floats(elems, 200 + uint32_t(n));
        kit::Mlp eager(*dev, kLayers, int(n), kWidth, 41);
        kit::StepGrads want = eager.eager_step(x.get(), t.get(), 0.0f);
        const void* in = x.get();
        for (int i = 0; i < kLayers; ++i) {
            graphed::Replay r;
            r.stream(dev->stream()).callable(uint32_t(i)).size(n);
            // Held until the forward returns: the replay keeps a pointer.
            const std::vector<const void*> at = {use[2 * size_t(i)].get(), use[2 * size_t(i) + 1].get()};
            if (cuda) r.params(at);
            s.forward(r.data(in), outs);
            ASSERT_EQ(outs[0].bytes(), elems * 4) << "the actual rows of layer " << i;
            in = outs[0].ptr();
        }
        kit::Buffer gy(*dev, elems * 4);
        dev->sub(dev->stream(), GRAPHED_DTYPE_F32, in, t.get(), gy.get(), elems);
        const void* g = gy.get();
        for (int i = kLayers - 1; i >= 0; --i) {
            graphed::Replay r;
            r.stream(dev->stream()).callable(uint32_t(i));
            s.backward(r.data(g), grads[i]);
            if (i > 0) g = grads[i].inputs[0].ptr();
        }
        expect_step(eager, want, gy, elems, grads);
    }
    if (cuda) EXPECT_GT(s.stats().param_moves, 0u);
}

// Layers chained in place (each reads the previous one's output buffer and
// writes its grad-output), in buckets: nothing is copied between them, the
// rows past the size in the chained buffers are the previous layer's (of
// zero inputs: finite), and their grads are zero, so the results are
// eager's on the actual rows, bit for bit.
TEST_P(Buckets, ChainedLayersMatchEagerOfThatSizeBitForBit) {
    kit::Buffer sample = floats(size_t(kMax) * kWidth, 3);
    kit::Mlp graphed(*dev, kLayers, kMax, kWidth, 41);
    graphed::Session s(config());
    kit::Wiring w;
    w.buckets = kSizes;
    w.chain = true;
    graphed.register_layers(s, sample.get(), w);
    s.capture();
    graphed::Replay r;
    r.stream(dev->stream());
    std::vector<graphed::Ref> outs;
    std::vector<graphed::Grads> grads(kLayers);
    for (uint64_t n : {5u, 32u, 13u, 16u, 1u}) {
        SCOPED_TRACE(testing::Message() << n << " rows, chained");
        const size_t elems = size_t(n) * kWidth;
        kit::Buffer x = floats(elems, 800 + uint32_t(n)), t = floats(elems, 900 + uint32_t(n));
        kit::Mlp eager(*dev, kLayers, int(n), kWidth, 41);
        kit::StepGrads want = eager.eager_step(x.get(), t.get(), 0.0f);
        r.size(n);
        for (int i = 0; i < kLayers; ++i) {
            // Layer 0 takes the data; the others read their producer in place.
            if (i == 0)
                r.data(x.get());
            else
                r.no_data();
            s.forward(r.callable(uint32_t(i)), outs);
            ASSERT_EQ(outs[0].bytes(), elems * 4);
        }
        kit::Buffer gy(*dev, elems * 4);
        dev->sub(dev->stream(), GRAPHED_DTYPE_F32, outs[0].ptr(), t.get(), gy.get(), elems);
        for (int i = kLayers - 1; i >= 0; --i) {
            if (i == kLayers - 1)
                r.data(gy.get());
            else
                r.no_data();
            s.backward(r.callable(uint32_t(i)).size(0), grads[size_t(i)]);
        }
        expect_step(eager, want, gy, elems, grads);
    }
    // A chained layer runs the rows its producer ran.
    kit::Buffer x = floats(size_t(kMax) * kWidth, 5);
    s.forward(r.callable(0).size(12).data(x.get()), outs);
    EXPECT_TRUE(throws(GRAPHED_STATUS_INVALID_ARGUMENT, [&] { s.forward(r.callable(1).size(13).no_data()); },
                       std::vector<std::string>{"chained to callable 'fc0'", "ran 12 rows"}));
    EXPECT_NO_THROW(s.forward(r.callable(1).size(12).no_data()));
}

// Two layers in different buckets between their forwards and backwards
// (a mixture of experts' layers with their own token counts): what one
// forward keeps in scratch for its backward must survive the other's
// forward and backward in another bucket.
TEST_P(Buckets, LayersInDifferentBucketsKeepTheirSavedScratch) {
    kit::Buffer sample = floats(size_t(kMax) * kWidth, 3);
    kit::Mlp m(*dev, kLayers, kMax, kWidth, 41);
    graphed::Session s = mlp_session(m, sample);
    const uint64_t rows[2] = {30, 5};  // buckets 32 and 8
    std::vector<kit::Buffer> xs, gys;
    for (int i = 0; i < 2; ++i) {
        xs.push_back(floats(size_t(rows[i]) * kWidth, 600 + uint32_t(i)));
        gys.push_back(floats(size_t(rows[i]) * kWidth, 700 + uint32_t(i)));
    }
    graphed::Replay r;
    r.stream(dev->stream());
    std::vector<graphed::Ref> outs;
    std::vector<graphed::Grads> grads(2);
    for (int i = 0; i < 2; ++i) s.forward(r.callable(uint32_t(i)).size(rows[i]).data(xs[i].get()), outs);
    for (int i = 1; i >= 0; --i) s.backward(r.callable(uint32_t(i)).size(0).data(gys[i].get()), grads[size_t(i)]);
    dev->sync();
    for (int i = 0; i < 2; ++i) {
        SCOPED_TRACE(testing::Message() << "layer " << i << ", " << rows[i] << " rows");
        const kit::LinearLayer& L = m.layer(i);
        const size_t act = size_t(rows[i]) * kWidth * 4;
        kit::Buffer z(*dev, act), y(*dev, act), gz(*dev, act), gw(*dev, size_t(kWidth) * kWidth * 4),
            gb(*dev, size_t(kWidth) * 4);
        ASSERT_EQ(L.eager_forward(dev->stream(), xs[i].get(), z.get(), y.get(), 0, nullptr, int(rows[i])), 0);
        ASSERT_EQ(L.eager_backward(dev->stream(), xs[i].get(), z.get(), gys[i].get(), gz.get(), nullptr, gw.get(),
                                   gb.get(), 0, nullptr, int(rows[i])),
                  0);
        dev->sync();
        EXPECT_EQ(kit::fetch<float>(*dev, gw.get(), size_t(kWidth) * kWidth),
                  kit::fetch<float>(*dev, grads[size_t(i)].params[0].ptr(), size_t(kWidth) * kWidth));
        EXPECT_EQ(kit::fetch<float>(*dev, gb.get(), size_t(kWidth)),
                  kit::fetch<float>(*dev, grads[size_t(i)].params[1].ptr(), size_t(kWidth)));
    }
}

TEST_P(Buckets, BucketsShareTheLargestBucketsMemory) {
    kit::Buffer sample = floats(size_t(kMax) * kWidth, 3);
    kit::Mlp a(*dev, kLayers, kMax, kWidth, 41), b(*dev, kLayers, kMax, kWidth, 41), c(*dev, kLayers, kMax, kWidth, 41);
    graphed::Session bucketed = mlp_session(a, sample);
    graphed::Session one(config());
    b.register_layers(one, sample.get());
    one.capture();
    // The largest bucket alone, as a bucket.
    graphed::Session largest(config());
    kit::Wiring w;
    w.buckets = {kMax};
    c.register_layers(largest, sample.get(), w);
    largest.capture();
    const graphed_session_stats sb = bucketed.stats(), so = one.stats(), sl = largest.stats();
    SCOPED_TRACE(figures(sb) + " | one shape: " + figures(so) + " | the largest bucket alone: " + figures(sl));
    // Every bucket in the largest one's buffers, plus one aligned block for
    // the callables' sizes and bucket tables.
    EXPECT_EQ(sb.static_bytes, so.static_bytes + 256);
    EXPECT_EQ(sb.static_bytes, sl.static_bytes);
    // Scratch: a region per callable, each its largest bucket's; more
    // buckets take nothing more. (A region per callable keeps more than one
    // shared arena of one shape, whose passes' temporaries share memory.)
    EXPECT_EQ(sb.scratch_bytes, sl.scratch_bytes);
    EXPECT_GE(sb.scratch_bytes, so.scratch_bytes);
    EXPECT_GT(so.clone_bytes_cached, 0u);
    EXPECT_EQ(sb.clone_bytes_cached, so.clone_bytes_cached) << "one set of clone slot blocks per layer";
    EXPECT_EQ(sb.instances, so.instances * kSizes.size());
    EXPECT_EQ(sb.graph_count, so.graph_count * kSizes.size());
    // The plan dump: one line per buffer, named by its layer.
    const std::string dump = bucketed.plan_dump();
    for (int i = 0; i < kLayers; ++i)
        EXPECT_NE(dump.find("\nfc" + std::to_string(i) + " "), std::string::npos) << "layer " << i << "\n" << dump;
}

TEST_P(Buckets, CallbacksSeeTheirBucketAndTheDeviceHoldsTheActualSize) {
    Probe probe;
    probe.dev = dev.get();
    graphed::Session s(config());
    s.add_callable(probe.callable({4, 10, 24}));
    s.capture();
    const std::vector<std::pair<uint64_t, uint64_t>> seen = {{0, 4}, {1, 10}, {2, 24}};
    EXPECT_EQ(probe.seen, seen);
    graphed::Replay r;
    r.stream(dev->stream());
    std::vector<graphed::Ref> outs;
    for (uint64_t n : {24u, 3u, 10u, 11u}) {
        SCOPED_TRACE(testing::Message() << n << " rows");
        std::vector<float> x(size_t(n) * 4);
        for (size_t i = 0; i < x.size(); ++i) x[i] = float(i + 1);
        kit::Buffer dx(*dev, x.size() * 4);
        dev->upload(dx.get(), x.data(), dx.bytes());
        s.forward(r.size(n).data({dx.get()}), outs);
        dev->sync();
        uint64_t actual = 0;
        dev->download(&actual, outs[1].ptr(), 8);
        EXPECT_EQ(actual, n);
        const uint64_t bucket = n <= 4 ? 4 : n <= 10 ? 10 : 24;
        auto whole = kit::fetch<float>(*dev, outs[0].ptr(), size_t(bucket) * 4);
        std::vector<float> want = x;
        want.resize(whole.size(), 0.0f);
        EXPECT_EQ(whole, want) << "the actual rows, then zeros up to the bucket";
        EXPECT_EQ(outs[0].bytes(), x.size() * 4);
    }
}

TEST_P(Buckets, AHeldAliasOfOneBucketRefusesTheOthers) {
    kit::Buffer sample = floats(size_t(kMax) * kWidth, 3);
    kit::Mlp m(*dev, kLayers, kMax, kWidth, 41);
    graphed::Session s = mlp_session(m, sample, true);
    kit::Buffer x = floats(size_t(kMax) * kWidth, 5);
    graphed::Replay r;
    r.stream(dev->stream()).callable(0).data(x.get());
    std::vector<graphed::Ref> held = s.forward(r.size(5));
    EXPECT_TRUE(throws(GRAPHED_STATUS_ALIAS_HELD, [&] { s.forward(r.size(20)); }, "output 0"))
        << "bucket 32 writes the memory bucket 8's output lives in";
    held.clear();
    held = s.forward(r.size(20));
    // And the other way: a bucket placed before the held one's.
    EXPECT_TRUE(throws(GRAPHED_STATUS_ALIAS_HELD, [&] { s.forward(r.size(5)); }, "output 0"))
        << "bucket 8 writes the memory bucket 32's output lives in";
    held.clear();
    EXPECT_NO_THROW(s.forward(r.size(5)));
}

TEST_P(Buckets, ReplaysOutsideTheBucketsAreRefusedAndEnqueueNothing) {
    kit::Buffer sample = floats(size_t(kMax) * kWidth, 3);
    kit::Mlp m(*dev, kLayers, kMax, kWidth, 41);
    graphed::Session s = mlp_session(m, sample);
    kit::Buffer x = floats(size_t(kMax) * kWidth, 5);
    graphed::Replay r;
    r.stream(dev->stream()).callable(1).data(x.get());
    EXPECT_TRUE(throws(GRAPHED_STATUS_WRONG_STATE, [&] { s.backward(r.size(0)); }, "no forward ran since capture"));
    EXPECT_TRUE(throws(GRAPHED_STATUS_INVALID_ARGUMENT, [&] { s.forward(r.size(33)); },
                       std::vector<std::string>{"args.size 33 is above the largest bucket", "(32;"}));
    EXPECT_TRUE(throws(GRAPHED_STATUS_INVALID_ARGUMENT, [&] { s.forward(r.size(0)); }, "names its actual size"));
    s.forward(r.size(12));
    EXPECT_TRUE(throws(GRAPHED_STATUS_INVALID_ARGUMENT, [&] { s.backward(r.size(13)); }, "pass 0 or 12"));
    EXPECT_NO_THROW(s.backward(r.size(12)));
    EXPECT_NO_THROW(s.backward(r.size(0)));
}

TEST_P(Buckets, RegistrationRefusesBucketsThatCannotWork) {
    kit::Buffer sample = floats(size_t(kMax) * kWidth, 3);
    kit::Mlp m(*dev, 1, kMax, kWidth, 41);
    auto refused = [&](std::vector<uint64_t> sizes, uint32_t in_flags, int64_t rows, const std::string& says) {
        graphed::Session s(config());
        kit::LinearLayer& L = m.layer(0);
        L.buckets = sizes;
        graphed::Callable c = L.callable(sample.get(), false);
        c.inputs[0].flags = in_flags;
        L.in_shape[0] = rows;
        return throws(GRAPHED_STATUS_INVALID_ARGUMENT, [&] { s.add_callable(c); }, says);
    };
    const uint32_t dyn = GRAPHED_TENSOR_FLAGS_DYNAMIC;
    EXPECT_TRUE(refused({16, 8, 32}, dyn, kMax, "strictly ascending"));
    EXPECT_TRUE(refused({8, 8, 32}, dyn, kMax, "strictly ascending"));
    EXPECT_TRUE(refused({0, 32}, dyn, kMax, "bucket sizes are 1 to"));
    EXPECT_TRUE(refused({8, 16}, dyn, kMax, "must be the largest bucket (16)"));
    EXPECT_TRUE(refused({8, 32}, dyn | GRAPHED_TENSOR_FLAGS_REBIND, kMax, "cannot also be"));
    {
        // DYNAMIC without buckets; buckets without DYNAMIC.
        graphed::Session s(config());
        kit::LinearLayer& L = m.layer(0);
        L.buckets = {};
        graphed::Callable c = L.callable(sample.get(), false);
        c.outputs[0].flags = dyn;
        EXPECT_TRUE(throws(GRAPHED_STATUS_INVALID_ARGUMENT, [&] { s.add_callable(c); }, "has no buckets"));
        c.outputs[0].flags = 0;
        c.buckets = {8, 32};
        EXPECT_TRUE(throws(GRAPHED_STATUS_INVALID_ARGUMENT, [&] { s.add_callable(c); }, "no DYNAMIC input or output"));
        graphed_callable_desc d = c.desc();
        d.num_buckets = 0;
        uint32_t index = 0;
        EXPECT_TRUE(fails_with(GRAPHED_STATUS_INVALID_ARGUMENT, graphed_session_add_callable(s.get(), &d, &index),
                               "num_buckets is 0"));
    }
    {
        // Chained to a producer with other buckets.
        graphed::Session s(config());
        kit::Mlp two(*dev, 2, kMax, kWidth, 41);
        two.layer(0).buckets = {8, 32};
        s.add_callable(two.layer(0).callable(sample.get(), false));
        two.layer(1).buckets = {16, 32};
        graphed::Callable c = two.layer(1).callable(sample.get(), true);
        c.inputs[0].flags = GRAPHED_TENSOR_FLAGS_CHAINED;
        c.inputs[0].chain_callable = 0;
        c.inputs[0].chain_output = 0;
        EXPECT_TRUE(throws(GRAPHED_STATUS_INVALID_ARGUMENT, [&] { s.add_callable(c); }, "has the same buckets"));
    }
    {
        // A step over a callable with buckets: refused at capture, the
        // session left open.
        graphed::Session s(config());
        kit::LinearLayer& L = m.layer(0);
        L.buckets = {8, 32};
        L.in_shape[0] = kMax;
        s.add_callable(L.callable(sample.get(), false));
        s.add_step({0});
        EXPECT_TRUE(throws(GRAPHED_STATUS_INVALID_ARGUMENT, [&] { s.capture(); }, "steps hold callables of one shape"));
    }
}

TEST_P(Buckets, ChosenOnTheDeviceMatchesEagerOfThatSizeBitForBit) {
    kit::Buffer sample = floats(size_t(kMax) * kWidth, 3);
    kit::Mlp graphed(*dev, kLayers, kMax, kWidth, 41);
    graphed_session_config cfg = config();
    cfg.bucket_choice_on_device = 1;
    graphed::Session s(cfg);
    kit::Wiring w;
    w.buckets = kSizes;
    // Movable where the host chooses; the device's choice reads them where
    // capture did.
    for (int i = 0; i < kLayers; ++i) graphed.layer(i).param_flags = GRAPHED_PARAM_FLAGS_REBIND;
    graphed.register_layers(s, sample.get(), w);
    s.capture();
    // Per layer: forward and backward per bucket, and the choosing graphs
    // of the forward, the backward and each of its 2 clone slots.
    EXPECT_EQ(s.stats().graph_count, kLayers * (2 * kSizes.size() + 4));
    kit::Buffer size(*dev, 8);
    graphed::Replay r;
    r.stream(dev->stream());
    std::vector<graphed::Ref> outs;
    std::vector<graphed::Grads> grads(kLayers);
    const size_t full = size_t(kMax) * kWidth;
    for (uint64_t n : {5u, 16u, 32u, 13u, 1u}) {
        SCOPED_TRACE(testing::Message() << n << " rows, chosen on the device");
        const size_t elems = size_t(n) * kWidth;
        // The caller's buffers hold the largest bucket's rows; past n they
        // hold data that must not reach the result.
        kit::Buffer x = floats(full, 300 + uint32_t(n)), t = floats(elems, 400 + uint32_t(n));
        kit::Mlp eager(*dev, kLayers, int(n), kWidth, 41);
        kit::StepGrads want = eager.eager_step(x.get(), t.get(), 0.0f);
        dev->upload(size.get(), &n, 8);

        r.size(0).device_size(static_cast<const uint64_t*>(size.get()));
        const void* in = x.get();
        for (int i = 0; i < kLayers; ++i) {
            s.forward(r.callable(uint32_t(i)).data(in), outs);
            ASSERT_EQ(outs[0].bytes(), full * 4) << "the host does not know the rows: the largest bucket's";
            in = outs[0].ptr();
        }
        kit::Buffer gy = floats(full, 500 + uint32_t(n));
        dev->sub(dev->stream(), GRAPHED_DTYPE_F32, in, t.get(), gy.get(), elems);
        const void* g = gy.get();
        r.device_size(nullptr);
        for (int i = kLayers - 1; i >= 0; --i) {
            s.backward(r.callable(uint32_t(i)).data(g), grads[i]);
            if (i > 0) g = grads[i].inputs[0].ptr();
        }
        expect_step(eager, want, gy, elems, grads);
    }
    EXPECT_EQ(s.stats().bucket_overflows, 0u);
    // Above the largest bucket: no bucket's graph runs, the pass writes
    // zeros, the device counts it, and the session goes on
    // (AboveTheLargestBucketOnTheDeviceWritesZeros has the whole iteration).
    const uint64_t above = kMax + 1;
    dev->upload(size.get(), &above, 8);
    kit::Buffer x = floats(full, 7);
    s.forward(r.callable(0).data(x.get()).device_size(static_cast<const uint64_t*>(size.get())), outs);
    dev->sync();
    EXPECT_EQ(s.stats().bucket_overflows, 1u);
    EXPECT_EQ(kit::fetch<float>(*dev, outs[0].ptr(), full), std::vector<float>(full, 0.0f)) << "zeros";
    // Refusals: both sizes; a backward given a size; a moved parameter.
    EXPECT_TRUE(throws(GRAPHED_STATUS_INVALID_ARGUMENT, [&] { s.forward(r.size(3)); }, "both set"));
    EXPECT_TRUE(throws(GRAPHED_STATUS_INVALID_ARGUMENT, [&] { s.backward(r.size(3).device_size(nullptr)); },
                       "chose its bucket on the device"));
    kit::Buffer other(*dev, size_t(kWidth) * kWidth * 4);
    const void* moved[2] = {other.get(), nullptr};
    EXPECT_TRUE(throws(GRAPHED_STATUS_PARAM_MOVED,
                       [&] { s.forward(r.size(0).device_size(static_cast<const uint64_t*>(size.get())).params(moved, 2)); },
                       "where capture did"));
}

// A size above the largest bucket, chosen on the device: the device cannot
// refuse it, so no bucket's graph runs and every pass writes zeros where it
// writes its results (the outputs, the input grads, the parameter grads:
// CLONE ones from a clone slot's graph, and copied from the slab when every
// slot is held), each pass counted in bucket_overflows; then an iteration
// in the buckets gives what it gave before, bit for bit.
TEST_P(Buckets, AboveTheLargestBucketOnTheDeviceWritesZeros) {
    kit::Buffer sample = floats(size_t(kMax) * kWidth, 3);
    kit::Mlp graphed(*dev, kLayers, kMax, kWidth, 41);
    graphed_session_config cfg = config();
    cfg.bucket_choice_on_device = 1;
    graphed::Session s(cfg);
    kit::Wiring w;
    w.buckets = kSizes;
    graphed.register_layers(s, sample.get(), w);
    s.capture();
    kit::Buffer size(*dev, 8);
    graphed::Replay r;
    r.stream(dev->stream());
    const size_t full = size_t(kMax) * kWidth;
    // What one iteration at `n` rows gives: every layer's output and input
    // grad (past the first layer), their first n rows (all of them above
    // the largest bucket), and its parameter grads, read back.
    auto iteration = [&](uint64_t n, std::vector<graphed::Grads>& grads) {
        std::vector<std::vector<float>> got;
        const size_t rows = size_t(std::min<uint64_t>(n, kMax)) * kWidth;
        auto first_rows = [&](const graphed::Ref& a) {
            EXPECT_EQ(a.bytes(), full * 4) << "the largest bucket's rows";
            return kit::fetch<float>(*dev, a.ptr(), n > uint64_t(kMax) ? full : rows);
        };
        dev->upload(size.get(), &n, 8);
        kit::Buffer x = floats(full, 21), gy = floats(full, 22);
        r.size(0).device_size(static_cast<const uint64_t*>(size.get()));
        const void* in = x.get();
        std::vector<graphed::Ref> outs;
        for (int i = 0; i < kLayers; ++i) {
            s.forward(r.callable(uint32_t(i)).data(in), outs);
            got.push_back(first_rows(outs[0]));
            in = outs[0].ptr();
        }
        r.device_size(nullptr);
        const void* g = gy.get();
        for (int i = kLayers - 1; i >= 0; --i) {
            s.backward(r.callable(uint32_t(i)).data(g), grads[size_t(i)]);
            const graphed::Grads& gr = grads[size_t(i)];
            if (i > 0) {
                g = gr.inputs[0].ptr();
                got.push_back(first_rows(gr.inputs[0]));
            }
            for (const graphed::Ref& p : gr.params) got.push_back(kit::fetch<float>(*dev, p.ptr(), p.bytes() / 4));
        }
        dev->sync();
        return got;
    };
    std::vector<graphed::Grads> grads(kLayers);
    const std::vector<std::vector<float>> in_bucket = iteration(13, grads);
    for (const auto& v : in_bucket) {
        ASSERT_FALSE(v.empty());
        EXPECT_NE(v, std::vector<float>(v.size(), 0.0f)) << "results worth comparing";
    }
    EXPECT_EQ(s.stats().bucket_overflows, 0u);
    // From the clone slots' graphs (2 per layer), then, every slot held by
    // the grads kept from those rounds, copied from the slab: zeros each
    // time.
    std::vector<std::vector<graphed::Grads>> kept;
    for (int round = 0; round < 3; ++round) {
        SCOPED_TRACE(testing::Message() << "above every bucket, round " << round);
        const std::vector<std::vector<float>> above = iteration(kMax + 1 + uint64_t(round), grads);
        ASSERT_EQ(above.size(), in_bucket.size());
        for (size_t k = 0; k < above.size(); ++k)
            EXPECT_EQ(above[k], std::vector<float>(above[k].size(), 0.0f)) << "result " << k << " is not zeros";
        EXPECT_EQ(s.stats().bucket_overflows, uint64_t(2 * kLayers * (round + 1))) << "every pass counted";
        kept.push_back(std::move(grads));
        grads = std::vector<graphed::Grads>(kLayers);
    }
    kept.clear();
    EXPECT_EQ(iteration(13, grads), in_bucket) << "the session goes on";
}

// A layer whose output, input grad and parameter grads are its own memory
// (EXTERNAL, as PyTorch's tensors are), one set per bucket: each bucket's
// capture hands over that bucket's buffers.
struct ExternalBuckets {
    kit::LinearLayer* L = nullptr;
    std::vector<uint64_t> sizes;
    std::vector<kit::Buffer> y, gx, gw, gb;  // per bucket

    ExternalBuckets(kit::Device& dev, kit::LinearLayer& layer, std::vector<uint64_t> s) : L(&layer), sizes(std::move(s)) {
        for (uint64_t n : sizes) {
            y.emplace_back(dev, L->act_bytes(L->out, int(n)));
            gx.emplace_back(dev, L->act_bytes(L->in, int(n)));
            gw.emplace_back(dev, size_t(L->out) * L->in * 4);
            gb.emplace_back(dev, size_t(L->out) * 4);
        }
    }
    graphed::Callable callable(const void* sample) {
        graphed::Callable c = L->callable(sample, true);
        const uint32_t ext = GRAPHED_TENSOR_FLAGS_EXTERNAL | GRAPHED_TENSOR_FLAGS_DYNAMIC;
        c.inputs[0].flags = c.outputs[0].flags = ext;
        c.params[0].flags = c.params[1].flags = GRAPHED_PARAM_FLAGS_EXTERNAL_GRAD;
        c.forward = &ExternalBuckets::forward;
        c.backward = &ExternalBuckets::backward;
        c.user_data = this;
        return c;
    }
    static int32_t forward(const graphed_pass_ctx* c, void* self) {
        return graphed::guard([&] {
            auto* e = static_cast<ExternalBuckets*>(self);
            if (c->outputs[0] != nullptr) return 900;  // nothing placed for an external output
            const int rows = int(c->bucket_size);
            void* z = graphed::scratch_alloc(*c, e->L->act_bytes(e->L->out, rows));
            *c->tape = z;
            void* y = e->y.at(c->bucket).get();
            if (int r = e->L->eager_forward(c->stream, c->inputs[0], z, y, 0, nullptr, rows)) return r;
            if (c->phase == GRAPHED_PHASE_CAPTURE) graphed::set_buffer(*c, GRAPHED_BUFFER_ROLE_OUTPUT, 0, y);
            return 0;
        });
    }
    static int32_t backward(const graphed_pass_ctx* c, void* self) {
        return graphed::guard([&] {
            auto* e = static_cast<ExternalBuckets*>(self);
            const int rows = int(c->bucket_size);
            const size_t b = c->bucket;
            void* z = *c->tape;
            void* gz = graphed::scratch_alloc(*c, e->L->act_bytes(e->L->out, rows));
            if (int r = e->L->eager_backward(c->stream, c->inputs[0], z, c->grad_outputs[0], gz, e->gx.at(b).get(),
                                             e->gw.at(b).get(), e->gb.at(b).get(), 0, nullptr, rows))
                return r;
            graphed::scratch_free(*c, gz);
            graphed::scratch_free(*c, z);
            if (c->phase != GRAPHED_PHASE_CAPTURE) return 0;
            graphed::set_buffer(*c, GRAPHED_BUFFER_ROLE_GRAD_INPUT, 0, e->gx[b].get());
            graphed::set_buffer(*c, GRAPHED_BUFFER_ROLE_PARAM_GRADS, 0, e->gw[b].get());
            graphed::set_buffer(*c, GRAPHED_BUFFER_ROLE_PARAM_GRADS, 1, e->gb[b].get());
            return 0;
        });
    }
};

// EXTERNAL and DYNAMIC together: a replay returns the actual rows of the
// buffers its bucket's capture provided, with the results of the same
// layer whose buffers the library placed, bit for bit; the device cannot
// choose among such buckets (refused at capture).
TEST_P(Buckets, ExternalBuffersAreEachBucketsOwn) {
    kit::Buffer sample = floats(size_t(kMax) * kWidth, 3);
    kit::Mlp placed(*dev, 1, kMax, kWidth, 41), own(*dev, 1, kMax, kWidth, 41);
    placed.layer(0).buckets = own.layer(0).buckets = kSizes;
    graphed::Session plain(config());
    plain.add_callable(placed.layer(0).callable(sample.get(), true));
    plain.capture();
    ExternalBuckets e(*dev, own.layer(0), kSizes);
    graphed::Session s(config());
    s.add_callable(e.callable(sample.get()));
    s.capture();
    graphed::Replay r;
    r.stream(dev->stream()).callable(0);
    for (uint64_t n : {5u, 8u, 13u, 32u, 3u}) {
        SCOPED_TRACE(testing::Message() << n << " rows");
        const size_t b = n <= 8 ? 0 : n <= 16 ? 1 : 2;
        kit::Buffer x = floats(size_t(n) * kWidth, 500 + uint32_t(n)), gy = floats(size_t(n) * kWidth, 600 + uint32_t(n));
        std::vector<graphed::Ref> want = plain.forward(r.size(n).data(x.get()));
        std::vector<graphed::Ref> got = s.forward(r.size(n).data(x.get()));
        ASSERT_EQ(got[0].ptr(), e.y[b].get()) << "the output its bucket's capture provided";
        ASSERT_EQ(got[0].bytes(), size_t(n) * kWidth * 4) << "its actual rows";
        dev->sync();
        EXPECT_EQ(kit::fetch<float>(*dev, want[0].ptr(), size_t(n) * kWidth),
                  kit::fetch<float>(*dev, got[0].ptr(), size_t(n) * kWidth));
        graphed::Grads gw = plain.backward(r.size(0).data(gy.get()));
        graphed::Grads gg = s.backward(r.size(0).data(gy.get()));
        ASSERT_EQ(gg.inputs[0].ptr(), e.gx[b].get());
        ASSERT_EQ(gg.inputs[0].bytes(), size_t(n) * kWidth * 4);
        ASSERT_EQ(GRAPHED_REF_KIND_CLONE, gg.params[0].kind()) << "CLONE grads copied out of the bucket's buffer";
        dev->sync();
        EXPECT_EQ(kit::fetch<float>(*dev, gw.inputs[0].ptr(), size_t(n) * kWidth),
                  kit::fetch<float>(*dev, gg.inputs[0].ptr(), size_t(n) * kWidth));
        for (size_t j = 0; j < 2; ++j)
            EXPECT_EQ(kit::fetch<float>(*dev, gw.params[j].ptr(), gw.params[j].bytes() / 4),
                      kit::fetch<float>(*dev, gg.params[j].ptr(), gg.params[j].bytes() / 4))
                << "param grad " << j;
    }
    graphed_session_config cfg = config();
    cfg.bucket_choice_on_device = 1;
    graphed::Session chosen(cfg);
    chosen.add_callable(e.callable(sample.get()));
    EXPECT_TRUE(throws(GRAPHED_STATUS_INVALID_ARGUMENT, [&] { chosen.capture(); },
                       std::vector<std::string>{"an external buffer (output 0)", "bucket_choice_on_device needs"}));
}

TEST_P(Buckets, DeviceSizeNeedsASessionThatChoosesOnTheDevice) {
    kit::Buffer sample = floats(size_t(kMax) * kWidth, 3);
    kit::Mlp m(*dev, kLayers, kMax, kWidth, 41);
    graphed::Session s = mlp_session(m, sample);
    kit::Buffer size(*dev, 8);
    graphed::Replay r;
    r.stream(dev->stream()).callable(0).data(sample.get());
    EXPECT_TRUE(throws(GRAPHED_STATUS_INVALID_ARGUMENT,
                       [&] { s.forward(r.device_size(static_cast<const uint64_t*>(size.get()))); },
                       "bucket_choice_on_device"));
}

// A per-token linear layer over [B, T, H] (y = x W^T + b, every row of H
// on its own: the kit's linear over B * T rows), registered with buckets
// on T (dynamic_dim 1) or on a grid of B and T (dynamic_dim 0 and
// dynamic_dim2 1). Its callbacks take B and T from their bucket.
struct TokenLinear {
    kit::Device* dev = nullptr;
    bool grid = false;
    int64_t b = 0, h = 0;
    int64_t shape[3] = {0, 0, 0};
    const void* w = nullptr;
    const void* bias = nullptr;

    int64_t rows(const graphed_pass_ctx* ctx) const {
        return grid ? int64_t(ctx->bucket_size) * int64_t(ctx->bucket_size2) : b * int64_t(ctx->bucket_size);
    }
    static int32_t forward(const graphed_pass_ctx* ctx, void* self) {
        auto* l = static_cast<TokenLinear*>(self);
        const int n = int(l->rows(ctx)), h = int(l->h);
        return l->dev->linear_fwd(ctx->stream, GRAPHED_DTYPE_F32, ctx->inputs[0], ctx->params[0], ctx->params[1],
                                  ctx->outputs[0], n, h, h);
    }
    static int32_t backward(const graphed_pass_ctx* ctx, void* self) {
        auto* l = static_cast<TokenLinear*>(self);
        const int n = int(l->rows(ctx)), h = int(l->h);
        if (int e = l->dev->linear_bwd_input(ctx->stream, GRAPHED_DTYPE_F32, ctx->grad_outputs[0], ctx->params[0],
                                             ctx->grad_inputs[0], n, h, h))
            return e;
        return l->dev->linear_bwd_weight(ctx->stream, GRAPHED_DTYPE_F32, ctx->grad_outputs[0], ctx->inputs[0],
                                         ctx->param_grads[0], ctx->param_grads[1], n, h, h);
    }

    // The callable: x and y [bmax, tmax, h], DYNAMIC on T (and on B in a grid).
    graphed::Callable callable(const std::vector<uint64_t>& ts, const std::vector<uint64_t>& bs, void* wp, void* bp) {
        grid = !bs.empty();
        const int64_t bmax = grid ? int64_t(bs.back()) : b, tmax = int64_t(ts.back());
        shape[0] = bmax;
        shape[1] = tmax;
        shape[2] = h;
        graphed::Callable c;
        c.name = grid ? "token linear (grid)" : "token linear";
        graphed_tensor_desc t = graphed::tensor_desc(size_t(bmax * tmax * h) * 4, GRAPHED_DTYPE_F32, true);
        t.ndim = 3;
        t.shape = shape;
        t.flags = GRAPHED_TENSOR_FLAGS_DYNAMIC;
        if (grid) {
            t.dynamic_dim2 = 1;  // T follows the second size; B (dimension 0) the first
            c.buckets = bs;
            c.buckets2 = ts;
        } else {
            t.dynamic_dim = 1;
            c.buckets = ts;
        }
        c.inputs = {t};
        c.outputs = {t};
        c.params = {graphed::param_desc(wp, size_t(h * h) * 4), graphed::param_desc(bp, size_t(h) * 4)};
        c.forward = &TokenLinear::forward;
        c.backward = &TokenLinear::backward;
        c.user_data = this;
        w = wp;
        bias = bp;
        return c;
    }
};

// A ref's data packed: its rows() blocks of row_bytes() every pitch().
std::vector<float> packed(kit::Device& dev, const graphed::Ref& r) {
    std::vector<float> out;
    EXPECT_EQ(r.rows() * r.row_bytes(), r.bytes());
    for (size_t i = 0; i < r.rows(); ++i) {
        auto row = kit::fetch<float>(dev, static_cast<const char*>(r.ptr()) + i * r.pitch(), r.row_bytes() / 4);
        out.insert(out.end(), row.begin(), row.end());
    }
    return out;
}

// Buckets on T of [B, T, H], and a grid of B and T: every output, input grad
// and parameter grad equals the layer run eagerly on the actual [b, t, H],
// bit for bit; outputs and input grads come back as b rows of t * H floats
// every T * H (graphed_ref.rows, row_bytes, pitch).
TEST_P(Buckets, TimeAndGridBucketsMatchEagerOfTheActualSizesBitForBit) {
    constexpr int64_t kB = 2, kH = 8;
    for (bool grid : {false, true}) {
        SCOPED_TRACE(grid ? "grid of B and T" : "buckets on T");
        const std::vector<uint64_t> ts = {4, 8, 16}, bs = grid ? std::vector<uint64_t>{1, 3} : std::vector<uint64_t>{};
        kit::Buffer w = floats(size_t(kH * kH), 5), bias = floats(size_t(kH), 6);
        TokenLinear l;
        l.dev = dev.get();
        l.b = kB;
        l.h = kH;
        graphed::Session s(config());
        graphed::Callable c = l.callable(ts, bs, w.get(), bias.get());
        s.add_callable(c);
        s.capture();
        std::vector<graphed::Ref> outs;
        graphed::Grads grads;
        const std::vector<std::pair<int64_t, int64_t>> sizes =
            grid ? std::vector<std::pair<int64_t, int64_t>>{{1, 3}, {2, 16}, {3, 9}, {1, 16}, {2, 1}, {3, 4}}
                 : std::vector<std::pair<int64_t, int64_t>>{{kB, 3}, {kB, 16}, {kB, 9}, {kB, 1}, {kB, 8}, {kB, 5}};
        for (auto [b, t] : sizes) {
            SCOPED_TRACE(testing::Message() << b << " x " << t);
            const size_t elems = size_t(b * t * kH);
            kit::Buffer x = floats(elems, uint32_t(10 * b + t)), gy = floats(elems, uint32_t(100 + 10 * b + t));
            // Eager on the actual sizes.
            kit::Buffer ey(*dev, elems * 4), egx(*dev, elems * 4), egw(*dev, size_t(kH * kH) * 4),
                egb(*dev, size_t(kH) * 4);
            const int n = int(b * t);
            ASSERT_EQ(0, dev->linear_fwd(dev->stream(), GRAPHED_DTYPE_F32, x.get(), w.get(), bias.get(), ey.get(), n,
                                         int(kH), int(kH)));
            ASSERT_EQ(0, dev->linear_bwd_input(dev->stream(), GRAPHED_DTYPE_F32, gy.get(), w.get(), egx.get(), n,
                                               int(kH), int(kH)));
            ASSERT_EQ(0, dev->linear_bwd_weight(dev->stream(), GRAPHED_DTYPE_F32, gy.get(), x.get(), egw.get(),
                                                egb.get(), n, int(kH), int(kH)));
            graphed::Replay r;
            r.stream(dev->stream()).size(grid ? uint64_t(b) : uint64_t(t)).size2(grid ? uint64_t(t) : 0);
            s.forward(r.data(x.get()), outs);
            graphed::Replay rb;
            rb.stream(dev->stream());
            s.backward(rb.data(gy.get()), grads);
            dev->sync();
            const uint64_t bucket_t = *std::find_if(ts.begin(), ts.end(), [&](uint64_t v) { return v >= uint64_t(t); });
            if (uint64_t(t) < bucket_t && b > 1) {  // one row of a bucket is contiguous
                EXPECT_EQ(outs[0].rows(), size_t(b));
                EXPECT_EQ(outs[0].pitch(), size_t(bucket_t * kH * 4));
            }
            EXPECT_EQ(packed(*dev, outs[0]), kit::fetch<float>(*dev, ey.get(), elems)) << "output";
            EXPECT_EQ(packed(*dev, grads.inputs[0]), kit::fetch<float>(*dev, egx.get(), elems)) << "input grad";
            EXPECT_EQ(kit::fetch<float>(*dev, grads.params[0].ptr(), size_t(kH * kH)),
                      kit::fetch<float>(*dev, egw.get(), size_t(kH * kH)))
                << "weight grad";
            EXPECT_EQ(kit::fetch<float>(*dev, grads.params[1].ptr(), size_t(kH)),
                      kit::fetch<float>(*dev, egb.get(), size_t(kH)))
                << "bias grad";
            grads = graphed::Grads{};
        }
    }
}

// A tensor may vary on another dimension than its first only where it says
// which (dynamic_dim), inside its shape, at the largest bucket; a grid's
// forward names both sizes; the device's choice is refused over either.
TEST_P(Buckets, OtherDimensionsAndGridsRefuseWhatTheyCannotDo) {
    kit::Buffer w = floats(64, 5), bias = floats(8, 6);
    TokenLinear l;
    l.dev = dev.get();
    l.b = 2;
    l.h = 8;
    {
        graphed::Session s(config());
        graphed::Callable c = l.callable({4, 16}, {}, w.get(), bias.get());
        c.inputs[0].dynamic_dim = 2;
        EXPECT_TRUE(throws(GRAPHED_STATUS_INVALID_ARGUMENT, [&] { s.add_callable(c); }, "the largest bucket's size (16)"));
        c.inputs[0].dynamic_dim = 3;
        EXPECT_TRUE(throws(GRAPHED_STATUS_INVALID_ARGUMENT, [&] { s.add_callable(c); }, "has 3 dimensions"));
    }
    {
        graphed_session_config cfg = config();
        cfg.bucket_choice_on_device = 1;
        graphed::Session s(cfg);
        graphed::Callable c = l.callable({4, 8}, {}, w.get(), bias.get());
        s.add_callable(c);
        EXPECT_TRUE(throws(GRAPHED_STATUS_INVALID_ARGUMENT, [&] { s.capture(); }, "bucket_choice_on_device"));
    }
    graphed::Session s(config());
    graphed::Callable c = l.callable({4, 8}, {1, 2}, w.get(), bias.get());
    s.add_callable(c);
    EXPECT_EQ(s.bucket_of(0, 2, 5).index, 3u);
    EXPECT_EQ(s.bucket_of(0, 2, 5).size2, 8u);
    s.capture();
    kit::Buffer x = floats(2 * 8 * 8, 1);
    std::vector<graphed::Ref> outs;
    graphed::Replay r;
    r.stream(dev->stream()).size(2).data(x.get());
    EXPECT_TRUE(throws(GRAPHED_STATUS_INVALID_ARGUMENT, [&] { s.forward(r, outs); }, "names both actual sizes"));
}

INSTANTIATE_TEST_SUITE_P(Backends, Buckets, backends(), BackendName());

}  // namespace
