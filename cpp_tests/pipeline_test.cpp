// Suite Pipeline: interleaved pipeline schedules, reused static buffers and
// delayed weight-gradient graphs, on both backends. A rig runs training
// iterations following a schedule, eagerly and through a graphed session,
// with the same kernels; parameter grads of the microbatches are
// accumulated as autograd would (the first becomes the grad, the others
// are added), then an SGD step. Every forward output of every iteration and
// the final weights must be equal, bit for bit.
#include "layers.hpp"
#include "support.hpp"

#include <algorithm>
#include <map>
#include <utility>
#include <vector>

namespace {

using kit::Buffer;
using graphed::schedule_from_te_order;

// The Transformer Engine scenario, in its `_order` notation: 2 chunks of 1
// layer, 3 microbatches.
const std::vector<double> kTeOrder = {1, 2, 1, 2, -2, -1, 1, 2, -2, -1, -2, -1};

struct Options {
    uint32_t dtype = GRAPHED_DTYPE_F32;
    std::vector<graphed_schedule_step> steps;
    std::vector<uint32_t> layers_per_chunk;  // empty: one layer per chunk
    bool reuse = false;
    bool clones = true;
    bool split_wgrad = false;
    int batch = 4, width = 16, iterations = 3;
};

class Rig {
  public:
    Rig(kit::Device& dev, Options o) : dev_(dev), o_(std::move(o)) {
        if (o_.layers_per_chunk.empty()) {
            uint32_t chunks = 0;
            for (auto& s : o_.steps) chunks = std::max(chunks, s.chunk + 1);
            o_.layers_per_chunk.assign(chunks, 1);
        }
        for (uint32_t n : o_.layers_per_chunk) layers_ += int(n);
        // Microbatches and the layers of each chunk, as the library derives them.
        graphed::ScheduleShape shape = graphed::schedule_shape(o_.steps, uint32_t(layers_), o_.layers_per_chunk);
        chunks_ = int(shape.chunks);
        mb_ = int(shape.microbatches);
        first_.assign(shape.chunk_first.begin(), shape.chunk_first.end());
        es_ = graphed::dtype_size(o_.dtype);
        act_ = size_t(o_.batch) * o_.width * es_;
        for (Model* m : {&eager_, &graphed_}) build(*m);
        for (int i = 0; i < mb_; ++i) {
            x_.emplace_back(dev, act_);
            t_.emplace_back(dev, act_);
            lg_eager_.emplace_back(dev, act_);
            lg_graphed_.emplace_back(dev, act_);
        }
        for (int l = 0; l < layers_; ++l)
            for (int m = 0; m < mb_; ++m)
                for (auto* v : {&z_, &y_, &gz_, &gx_}) (*v)[{l, m}] = Buffer(dev, act_);
    }

    graphed_session_config config() const {
        graphed_session_config c = graphed_session_config_default();
        c.backend = dev_.graphed_kind();
        c.schedule = o_.steps.data();
        c.num_schedule_steps = o_.steps.size();
        c.layers_per_chunk = o_.layers_per_chunk.data();
        c.num_layers_per_chunk = o_.layers_per_chunk.size();
        c.reuse_buffers = o_.reuse;
        c.clone_param_grads_on_return = o_.clones;
        return c;
    }

    // Registers the graphed model's layers into a session and captures it.
    void capture(graphed::Session& s) {
        upload_data(0);
        for (int l = 0; l < layers_; ++l) s.add_callable(graphed_.layers[l].callable(x_[0].get(), l > 0));
        s.capture();
    }

    // Runs every iteration both ways; compares outputs and final weights.
    void run_and_compare(graphed::Session& s) {
        for (int it = 0; it < o_.iterations; ++it) {
            SCOPED_TRACE(testing::Message() << "iteration " << it);
            upload_data(it + 1);
            outputs_eager_.clear();
            outputs_graphed_.clear();
            iterate(eager_, nullptr);
            iterate(graphed_, &s);
            if (HasFatalFailure()) return;
            ASSERT_EQ(outputs_eager_.size(), size_t(layers_ * mb_));
            for (auto& [key, v] : outputs_eager_)
                ASSERT_EQ(v, outputs_graphed_[key]) << "output of layer " << key.first << ", microbatch " << key.second;
        }
        for (int l = 0; l < layers_; ++l) {
            EXPECT_EQ(fetch(eager_.w[l]), fetch(graphed_.w[l])) << "final weights of layer " << l;
            EXPECT_EQ(fetch(eager_.b[l]), fetch(graphed_.b[l])) << "final biases of layer " << l;
        }
    }

    int layers() const { return layers_; }
    int microbatches() const { return mb_; }
    kit::LinearLayer& graphed_layer(int l) { return graphed_.layers[l]; }
    const void* x(int m) const { return x_[m].get(); }

  private:
    struct Model {
        std::vector<Buffer> w, b, gw, gb;  // parameters and accumulated grads
        std::vector<kit::LinearLayer> layers;
        std::vector<bool> have_grad;
    };

    void build(Model& m) {
        m.layers.resize(layers_);
        for (int l = 0; l < layers_; ++l) {
            size_t wb = size_t(o_.width) * o_.width * es_, bb = size_t(o_.width) * es_;
            m.w.emplace_back(dev_, wb);
            m.b.emplace_back(dev_, bb);
            m.gw.emplace_back(dev_, wb);
            m.gb.emplace_back(dev_, bb);
            put(m.w[l], kit::random_floats(o_.width * o_.width, 10 + l, 0.5f));
            put(m.b[l], kit::random_floats(o_.width, 20 + l, 0.1f));
            kit::LinearLayer& L = m.layers[l];
            L.dev = &dev_;
            L.batch = o_.batch;
            L.in = L.out = o_.width;
            L.relu = l + 1 < layers_ && !o_.split_wgrad;
            L.split_wgrad = o_.split_wgrad;
            L.param_flags = o_.split_wgrad ? GRAPHED_PARAM_FLAGS_DELAYED_WGRAD : GRAPHED_PARAM_FLAGS_NONE;
            L.dtype = o_.dtype;
            L.w = m.w[l].get();
            L.b = m.b[l].get();
            L.name = "fc" + std::to_string(l);
        }
        m.have_grad.assign(layers_, false);
    }

    void put(Buffer& b, const std::vector<float>& v) {
        auto raw = kit::to_dtype(v, o_.dtype);
        dev_.upload(b.get(), raw.data(), raw.size());
    }
    std::vector<uint8_t> fetch(const void* p, size_t bytes) {
        std::vector<uint8_t> v(bytes);
        dev_.download(v.data(), p, bytes);
        return v;
    }
    std::vector<uint8_t> fetch(const Buffer& b) { return fetch(b.get(), b.bytes()); }

    void upload_data(int it) {
        for (int m = 0; m < mb_; ++m) {
            put(x_[m], kit::random_floats(o_.batch * o_.width, 1000 * it + m));
            put(t_[m], kit::random_floats(o_.batch * o_.width, 5000 * it + m));
        }
    }

    // grad (+)= g, as autograd accumulates.
    void accumulate(Model& m, int l, const void* gw, const void* gb) {
        graphed_stream s = dev_.stream();
        size_t nw = size_t(o_.width) * o_.width, nb = o_.width;
        if (!m.have_grad[l]) {
            dev_.copy(s, m.gw[l].get(), gw, nw * es_);
            dev_.copy(s, m.gb[l].get(), gb, nb * es_);
            m.have_grad[l] = true;
        } else {
            dev_.add(s, o_.dtype, m.gw[l].get(), gw, nw);
            dev_.add(s, o_.dtype, m.gb[l].get(), gb, nb);
        }
    }

    void take(Model& m, int l, std::vector<graphed::Ref>& gp) {
        ASSERT_NE(GRAPHED_REF_KIND_NONE, gp[0].kind());
        accumulate(m, l, gp[0].ptr(), gp[1].ptr());
        for (auto& g : gp) g.release();
    }

    // One iteration following the schedule: eagerly when `s` is NULL.
    void iterate(Model& m, graphed::Session* s) {
        graphed_stream st = dev_.stream();
        const int n = int(o_.width) * o_.batch;
        std::vector<int> fwd(chunks_), bwd(chunks_), wg(chunks_);
        std::map<std::pair<int, int>, const void*> out, gin;  // graphed: what replays returned
        Buffer wtmp(dev_, size_t(o_.width) * o_.width * es_), btmp(dev_, size_t(o_.width) * es_);
        graphed::Replay a;
        a.stream(st);
        auto& lg = s ? lg_graphed_ : lg_eager_;
        auto& outputs = s ? outputs_graphed_ : outputs_eager_;
        for (const graphed_schedule_step& step : o_.steps) {
            const int c = int(step.chunk), first = first_[c], count = int(o_.layers_per_chunk[c]);
            if (step.pass == GRAPHED_PASS_FORWARD) {
                const int mb = fwd[c]++;
                for (int l = first; l < first + count; ++l) {
                    const void* in = l == 0 ? x_[mb].get() : (s ? out[{l - 1, mb}] : y_[{l - 1, mb}].get());
                    const void* y;
                    if (s) {
                        out[{l, mb}] = y = s->forward(a.callable(uint32_t(l)).microbatch(uint32_t(mb)).data(in))[0].ptr();
                    } else {
                        ASSERT_EQ(0, m.layers[l].eager_forward(st, in, z_[{l, mb}].get(), y_[{l, mb}].get()));
                        y = y_[{l, mb}].get();
                    }
                    outputs[{l, mb}] = fetch(y, act_);
                }
            } else if (step.pass == GRAPHED_PASS_BACKWARD) {
                const int mb = bwd[c]++;
                for (int l = first + count - 1; l >= first; --l) {
                    const void* gy;
                    if (l == layers_ - 1) {
                        const void* y = s ? out[{l, mb}] : y_[{l, mb}].get();
                        dev_.sub(st, o_.dtype, y, t_[mb].get(), lg[mb].get(), n);
                        gy = lg[mb].get();
                    } else {
                        gy = s ? gin[{l + 1, mb}] : gx_[{l + 1, mb}].get();
                    }
                    const void* xin = l == 0 ? x_[mb].get() : y_[{l - 1, mb}].get();
                    if (s) {
                        graphed::Grads g = s->backward(a.callable(uint32_t(l)).microbatch(uint32_t(mb)).data(gy));
                        gin[{l, mb}] = g.inputs[0].ptr();
                        if (!o_.split_wgrad) take(m, l, g.params);
                    } else if (o_.split_wgrad) {
                        // Input grad now; the weight grad at the weight-grad step.
                        if (l > 0)
                            ASSERT_EQ(0, dev_.linear_bwd_input(st, o_.dtype, gy, m.w[l].get(), gx_[{l, mb}].get(),
                                                               o_.batch, o_.width, o_.width));
                        saved_gy_[{l, mb}] = gy;
                    } else {
                        void* gx = l == 0 ? nullptr : gx_[{l, mb}].get();
                        ASSERT_EQ(0, m.layers[l].eager_backward(st, xin, z_[{l, mb}].get(), gy, gz_[{l, mb}].get(), gx,
                                                                wtmp.get(), btmp.get()));
                        accumulate(m, l, wtmp.get(), btmp.get());
                    }
                }
            } else {
                const int mb = wg[c]++;
                for (int l = first + count - 1; l >= first; --l) {
                    if (s) {
                        std::vector<graphed::Ref> gp = s->wgrad(a.callable(uint32_t(l)).microbatch(uint32_t(mb)).no_data());
                        take(m, l, gp);
                    } else {
                        const void* xin = l == 0 ? x_[mb].get() : y_[{l - 1, mb}].get();
                        ASSERT_EQ(0, dev_.linear_bwd_weight(st, o_.dtype, saved_gy_[{l, mb}], xin, wtmp.get(),
                                                            btmp.get(), o_.batch, o_.width, o_.width));
                        accumulate(m, l, wtmp.get(), btmp.get());
                    }
                }
            }
        }
        for (int l = 0; l < layers_; ++l) {
            dev_.sgd(st, o_.dtype, m.w[l].get(), m.gw[l].get(), 0.05f, size_t(o_.width) * o_.width);
            dev_.sgd(st, o_.dtype, m.b[l].get(), m.gb[l].get(), 0.05f, o_.width);
            m.have_grad[l] = false;
        }
        dev_.sync();
    }

    static bool HasFatalFailure() { return ::testing::Test::HasFatalFailure(); }

    kit::Device& dev_;
    Options o_;
    int chunks_ = 0, mb_ = 0, layers_ = 0;
    size_t es_ = 4, act_ = 0;
    std::vector<int> first_;
    Model eager_, graphed_;
    std::vector<Buffer> x_, t_, lg_eager_, lg_graphed_;
    std::map<std::pair<int, int>, Buffer> z_, y_, gz_, gx_;
    std::map<std::pair<int, int>, const void*> saved_gy_;
    std::map<std::pair<int, int>, std::vector<uint8_t>> outputs_eager_, outputs_graphed_;
};

class Pipeline : public BackendTest {
  protected:
    // Builds, captures and runs a rig; returns the session's stats.
    graphed_session_stats run(const Options& o, std::string* plan = nullptr) {
        Rig rig(*dev, o);
        graphed::Session s(rig.config());
        rig.capture(s);
        rig.run_and_compare(s);
        if (plan) *plan = s.plan_dump();
        graphed_session_stats stats = s.stats();
        EXPECT_EQ(uint32_t(rig.microbatches()), stats.microbatches);
        EXPECT_EQ(0u, stats.clone_bytes_outstanding);
        return stats;
    }
};

TEST_P(Pipeline, InterleavedMatchesEager) {
    Options o;
    o.steps = schedule_from_te_order(kTeOrder);
    graphed_session_stats st = run(o);
    EXPECT_EQ(12u, st.graph_count) << "2 layers x 3 microbatches x (forward, backward)";
    EXPECT_EQ(st.static_bytes, st.static_bytes_without_reuse);
}

TEST_P(Pipeline, ReusedBuffersMatchEager) {
    Options o;
    o.steps = schedule_from_te_order(kTeOrder);
    o.reuse = true;
    graphed_session_stats st = run(o);
    EXPECT_LT(st.static_bytes, st.static_bytes_without_reuse);
}

TEST_P(Pipeline, ReusedBuffersNoCloneMatchEager) {
    for (uint32_t dtype : {GRAPHED_DTYPE_F32, GRAPHED_DTYPE_F16}) {
        SCOPED_TRACE(dtype == GRAPHED_DTYPE_F32 ? "fp32" : "fp16");
        Options o;
        o.steps = schedule_from_te_order(kTeOrder);
        o.reuse = true;
        o.clones = false;
        o.dtype = dtype;
        run(o);
    }
}

TEST_P(Pipeline, DelayedWgradMatchesEager) {
    // Weight-grad steps right after each backward (TE's -c - 0.5).
    Options o;
    o.steps = schedule_from_te_order({1, 2, 1, 2, -2, -2.5, -1, -1.5, -2, -2.5, -1, -1.5});
    o.split_wgrad = true;
    o.reuse = true;
    graphed_session_stats st = run(o);
    EXPECT_EQ(12u, st.graph_count) << "2 layers x 2 microbatches x (forward, backward, weight-grad)";
}

TEST_P(Pipeline, ThreeChunkScheduleMatchesEager) {
    Options o;
    o.steps = schedule_from_te_order({1, 2, 3, 1, 2, 3, -3, -2, -1, -3, -2, -1});
    o.layers_per_chunk = {1, 2, 1};
    o.reuse = true;
    graphed_session_stats st = run(o);
    EXPECT_EQ(16u, st.graph_count);
    EXPECT_LT(st.static_bytes, st.static_bytes_without_reuse);
}

TEST_P(Pipeline, ReuseUsesLessStaticMemory) {
    Options o;
    o.steps = schedule_from_te_order(kTeOrder);
    o.width = 64;
    o.batch = 32;
    o.iterations = 1;
    graphed_session_stats plain = run(o);
    o.reuse = true;
    std::string plan;
    graphed_session_stats reused = run(o, &plan);
    std::printf("%s", plan.c_str());
    // A header, a column line, and one line per buffer: 6 instances with an
    // input, an output, a grad-output, a slab, and grad-inputs for the 3 of
    // layer 1 (layer 0's input takes no grad).
    EXPECT_EQ(2u + 6 * 4 + 3, size_t(std::count(plan.begin(), plan.end(), '\n'))) << plan;
    EXPECT_NE(std::string::npos, plan.find("static bytes " + std::to_string(reused.static_bytes))) << plan;
    std::printf("  2 layers x 3 microbatches, batch 32, width 64, fp32: static bytes without reuse %llu, with reuse %llu "
                "(peak live lower bound %llu)\n",
                (unsigned long long)plain.static_bytes, (unsigned long long)reused.static_bytes,
                (unsigned long long)reused.peak_live_bytes);
    EXPECT_LT(reused.static_bytes, plain.static_bytes) << "reuse must use strictly less";
    EXPECT_GE(reused.static_bytes, reused.peak_live_bytes) << "no plan can beat the peak of live bytes";
    EXPECT_EQ(plain.static_bytes, reused.static_bytes_without_reuse);
}

TEST_P(Pipeline, StrictLeaseCatchesAHeldOutputAboutToBeReused) {
    Options o;
    o.steps = schedule_from_te_order(kTeOrder);
    o.reuse = true;
    Rig rig(*dev, o);
    graphed_session_config c = rig.config();
    c.strict_leases = 1;
    graphed::Session s(c);
    rig.capture(s);
    // Follow the TE order, keeping the outputs of microbatch 0 (and their
    // leases); every other lease goes as soon as it is handed out.
    graphed::Replay a;
    a.stream(dev->stream());
    std::vector<int> fwd(2), bwd(2);
    std::map<std::pair<int, int>, graphed::Ref> kept;
    std::map<std::pair<int, int>, const void*> out;
    graphed_status failed = GRAPHED_STATUS_OK;
    std::string message;
    try {
        for (double step : kTeOrder) {
            const int l = int(std::abs(step)) - 1;
            const int mb = step > 0 ? fwd[l]++ : bwd[l]++;
            a.callable(uint32_t(l)).microbatch(uint32_t(mb));
            if (step > 0) {
                std::vector<graphed::Ref> r = s.forward(a.data(l == 0 ? rig.x(mb) : out[{0, mb}]));
                out[{l, mb}] = r[0].ptr();
                if (mb == 0) kept[{l, mb}] = std::move(r[0]);
            } else {
                s.backward(a.no_data());  // its input grad and clone grads go at once
            }
        }
    } catch (const graphed::Error& e) {
        failed = e.status();
        message = e.message();
    }
    EXPECT_EQ(GRAPHED_STATUS_ALIAS_HELD, failed) << message;
    EXPECT_NE(std::string::npos, message.find("(microbatch 0), an alias handed out")) << message;
    EXPECT_NE(std::string::npos, message.find("output 0 of callable")) << message;
}

TEST_P(Pipeline, InvalidScheduleRejected) {
    struct Case {
        std::vector<double> order;
        std::vector<uint32_t> layers;
        int callables;
        bool split_wgrad;
        bool reuse;
        const char* message;
    };
    const std::vector<Case> cases = {
        {{1, 2, 1, 2, -2, -1, 1, 2, -2, -1, -2}, {}, 2, false, false, "chunks x microbatches x 2"},
        {{1, 1, -2, -2}, {}, 2, false, false, "chunk 0 has 2 forward and 0 backward"},
        {{-1, 1}, {}, 1, false, false, "comes before its forward"},
        {{2, 1, -2, -1}, {}, 2, false, false, "whose output it takes"},
        {{1, 2, -1, -2}, {}, 2, false, false, "whose input grad it takes"},
        {kTeOrder, {}, 3, false, false, "cannot be split evenly"},
        {kTeOrder, {1, 2}, 2, false, false, "hold 3 layers in all"},
        {kTeOrder, {1}, 2, false, false, "layers_per_chunk has 1 entries"},
        {{1, -1, -1.5}, {}, 1, false, false, "no weight-grad callback"},
        {{1, -1, -1.5}, {}, 2, true, false, "one layer per chunk"},
        {{1, -1, -1.5, -1.5}, {}, 1, true, false, "2 weight-grad steps and 1 backward"},
        {{1, -1.5, -1}, {}, 1, true, false, "comes before its backward"},
        {{1, -1}, {}, 1, true, false, "no weight-grad steps to capture it"},
        {{}, {}, 1, false, true, "reuse_buffers needs a pipeline schedule"},
    };
    Buffer w(*dev, 16 * 16 * 4), b(*dev, 16 * 4), x(*dev, 4 * 16 * 4);
    for (const Case& k : cases) {
        SCOPED_TRACE(k.message);
        const std::vector<graphed_schedule_step> steps = schedule_from_te_order(k.order);
        graphed_session_config c = config();
        c.schedule = steps.empty() ? nullptr : steps.data();
        c.num_schedule_steps = steps.size();
        c.layers_per_chunk = k.layers.empty() ? nullptr : k.layers.data();
        c.num_layers_per_chunk = k.layers.size();
        c.reuse_buffers = k.reuse;
        graphed_status st = GRAPHED_STATUS_OK;
        std::string message;
        try {
            graphed::Session s(c);
            // Rules that need the callables are checked at capture.
            std::vector<kit::LinearLayer> layers(k.callables);
            for (int i = 0; i < k.callables; ++i) {
                kit::LinearLayer& L = layers[i];
                L.dev = dev.get();
                L.batch = 4;
                L.in = L.out = 16;
                L.w = w.get();
                L.b = b.get();
                L.split_wgrad = k.split_wgrad;
                L.name = "fc" + std::to_string(i);
                s.add_callable(L.callable(x.get(), false));
            }
            try {
                s.capture();
            } catch (const graphed::Error&) {
                EXPECT_EQ(0u, s.stats().static_bytes) << "a refused schedule allocates nothing";
                throw;
            }
        } catch (const graphed::Error& e) {
            st = e.status();
            message = e.message();
        }
        EXPECT_EQ(GRAPHED_STATUS_INVALID_SCHEDULE, st) << graphed::status_name(st) << ": " << message;
        EXPECT_NE(std::string::npos, message.find(k.message)) << message;
    }
}

INSTANTIATE_TEST_SUITE_P(Backends, Pipeline, backends(), BackendName());

}  // namespace
