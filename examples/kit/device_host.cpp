// The kit's host device: graphed's host backend. Memory is host memory and
// every op is a task enqueued with graphed_host_enqueue, so under capture it
// is recorded and replays run it again.
#include "dropout.hpp"
#include "half.hpp"
#include "kit.hpp"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>

namespace kit {

std::vector<float> random_floats(size_t n, uint32_t seed, float scale) {
    std::vector<float> v(n);
    uint64_t x = 0x9E3779B97F4A7C15ull ^ seed;
    for (size_t i = 0; i < n; ++i) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        v[i] = scale * (static_cast<float>(x >> 40) / static_cast<float>(1ull << 24) * 2.0f - 1.0f);
    }
    return v;
}

namespace {

// Element access in f32, whatever the storage dtype.
struct Elems {
    uint32_t dt;
    float get(const void* p, size_t i) const {
        switch (dt) {
            case GRAPHED_DTYPE_F16: return half_to_float(static_cast<const uint16_t*>(p)[i]);
            case GRAPHED_DTYPE_BF16: return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
            default: return static_cast<const float*>(p)[i];
        }
    }
    void set(void* p, size_t i, float v) const {
        switch (dt) {
            case GRAPHED_DTYPE_F16: static_cast<uint16_t*>(p)[i] = float_to_half(v); break;
            case GRAPHED_DTYPE_BF16: static_cast<uint16_t*>(p)[i] = float_to_bf16(v); break;
            default: static_cast<float*>(p)[i] = v;
        }
    }
};

}  // namespace

std::vector<uint8_t> to_dtype(const std::vector<float>& values, uint32_t dtype) {
    std::vector<uint8_t> out(values.size() * graphed::dtype_size(dtype));
    Elems e{dtype};
    for (size_t i = 0; i < values.size(); ++i) e.set(out.data(), i, values[i]);
    return out;
}

std::vector<float> from_dtype(const std::vector<uint8_t>& bytes, uint32_t dtype) {
    std::vector<float> out(bytes.size() / graphed::dtype_size(dtype));
    Elems e{dtype};
    for (size_t i = 0; i < out.size(); ++i) out[i] = e.get(bytes.data(), i);
    return out;
}

namespace {

class HostDevice final : public Device {
  public:
    Backend backend() const override { return Backend::Host; }
    void* alloc(size_t bytes) override {
        void* p = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
        if (!p) throw std::bad_alloc();
        std::memset(p, 0, bytes);
        return p;
    }
    void release(void* p) override { std::free(p); }
    void upload(void* dst, const void* src, size_t bytes) override { std::memcpy(dst, src, bytes); }
    void download(void* dst, const void* src, size_t bytes) override { std::memcpy(dst, src, bytes); }
    graphed_stream stream() override { return nullptr; }
    graphed_stream side_stream() override { return nullptr; }
    void sync() override {}
    size_t free_memory() override { return 0; }

    int linear_fwd(graphed_stream s, uint32_t dt, const void* x, const void* w, const void* b, void* z, int B, int In,
                   int Out) override {
        return enqueue(s, [=, e = Elems{dt}] {
            for (int r = 0; r < B; ++r)
                for (int o = 0; o < Out; ++o) {
                    float acc = 0.0f;
                    for (int i = 0; i < In; ++i) acc += e.get(x, r * In + i) * e.get(w, o * In + i);
                    e.set(z, r * Out + o, acc + e.get(b, o));
                }
        });
    }
    int relu_fwd(graphed_stream s, uint32_t dt, const void* z, void* y, size_t n) override {
        return enqueue(s, [=, e = Elems{dt}] {
            for (size_t i = 0; i < n; ++i) e.set(y, i, e.get(z, i) > 0.0f ? e.get(z, i) : 0.0f);
        });
    }
    int relu_bwd(graphed_stream s, uint32_t dt, const void* gy, const void* z, void* gz, size_t n) override {
        return enqueue(s, [=, e = Elems{dt}] {
            for (size_t i = 0; i < n; ++i) e.set(gz, i, e.get(z, i) > 0.0f ? e.get(gy, i) : 0.0f);
        });
    }
    int linear_bwd_input(graphed_stream s, uint32_t dt, const void* gz, const void* w, void* gx, int B, int In,
                         int Out) override {
        return enqueue(s, [=, e = Elems{dt}] {
            for (int r = 0; r < B; ++r)
                for (int i = 0; i < In; ++i) {
                    float acc = 0.0f;
                    for (int o = 0; o < Out; ++o) acc += e.get(gz, r * Out + o) * e.get(w, o * In + i);
                    e.set(gx, r * In + i, acc);
                }
        });
    }
    int linear_bwd_weight(graphed_stream s, uint32_t dt, const void* gz, const void* x, void* gw, void* gb, int B,
                          int In, int Out) override {
        return enqueue(s, [=, e = Elems{dt}] {
            for (int o = 0; o < Out; ++o) {
                for (int i = 0; i < In; ++i) {
                    float acc = 0.0f;
                    for (int r = 0; r < B; ++r) acc += e.get(gz, r * Out + o) * e.get(x, r * In + i);
                    e.set(gw, o * In + i, acc);
                }
                float acc = 0.0f;
                for (int r = 0; r < B; ++r) acc += e.get(gz, r * Out + o);
                e.set(gb, o, acc);
            }
        });
    }
    int sub(graphed_stream s, uint32_t dt, const void* a, const void* b, void* y, size_t n) override {
        return enqueue(s, [=, e = Elems{dt}] {
            for (size_t i = 0; i < n; ++i) e.set(y, i, e.get(a, i) - e.get(b, i));
        });
    }
    int add(graphed_stream s, uint32_t dt, void* y, const void* x, size_t n) override {
        return enqueue(s, [=, e = Elems{dt}] {
            for (size_t i = 0; i < n; ++i) e.set(y, i, e.get(y, i) + e.get(x, i));
        });
    }
    int sgd(graphed_stream s, uint32_t dt, void* w, const void* g, float lr, size_t n) override {
        return enqueue(s, [=, e = Elems{dt}] {
            for (size_t i = 0; i < n; ++i) e.set(w, i, e.get(w, i) - lr * e.get(g, i));
        });
    }
    int mul(graphed_stream s, uint32_t dt, const void* a, const void* b, void* out, size_t n) override {
        return enqueue(s, [=, e = Elems{dt}] {
            for (size_t i = 0; i < n; ++i) e.set(out, i, e.get(a, i) * e.get(b, i));
        });
    }
    int dropout(graphed_stream s, uint32_t dt, const void* x, void* y, size_t n, float p, uint64_t seed,
                uint32_t mb_host, const uint32_t* mb_at) override {
        return enqueue(s, [=, e = Elems{dt}] {
            const uint32_t mb = mb_at ? *mb_at : mb_host;
            const float scale = 1.0f / (1.0f - p);
            for (size_t i = 0; i < n; ++i) e.set(y, i, dropout_keeps(seed, mb, i, p) ? e.get(x, i) * scale : 0.0f);
        });
    }
    int sgd_momentum(graphed_stream s, float* w, const float* g, float* m, const float* scalars,
                     size_t n) override {
        return enqueue(s, [=] {
            const float lr = scalars[0], mu = scalars[1];
            for (size_t i = 0; i < n; ++i) {
                const volatile float mm = mu * m[i];
                m[i] = mm + g[i];
                const volatile float step = lr * m[i];
                w[i] = w[i] - step;
            }
        });
    }
    int flag_nonfinite(graphed_stream s, const float* g, size_t n, uint32_t* flag) override {
        return enqueue(s, [=] {
            for (size_t i = 0; i < n; ++i)
                if (!std::isfinite(g[i])) *flag = 1;
        });
    }
    int illegal(graphed_stream s) override {
        // As a stream synchronize under CUDA capture: invalidates the
        // capture. Report success, as careless code would.
        (void)graphed_host_synchronize(s);
        return 0;
    }
    int copy(graphed_stream s, void* dst, const void* src, size_t bytes) override {
        return enqueue(s, [=] { std::memcpy(dst, src, bytes); });
    }
    int alloc_outside_pool(graphed_stream s) override {
        return refused(s, "cudaMalloc (an allocation outside the graph's pool)");
    }
    int unjoined_work(graphed_stream s) override {
        // Careless, as the CUDA kit's: the capture's end reports it.
        (void)graphed_host_invalidate_capture(s, "work on a stream the capture does not know (never joined back)");
        return 0;
    }
    int uncapturable_call(graphed_stream s) override {
        return refused(s, "cudaMemcpy (a CUDA library call that cannot be captured)");
    }
    // The host counterpart of a CUDA call refused under capture.
    static int refused(graphed_stream s, const char* operation) {
        if (graphed_host_invalidate_capture(s, operation) == GRAPHED_STATUS_OK) return 0;
        const std::string said = std::string(operation) + " failed: " + graphed_last_error_message();
        (void)graphed_callback_fail_message(said.c_str());
        return 1;
    }

  private:
    // Captured tasks are replayed later, so their closures must live as long
    // as the device: keep them all.
    int enqueue(graphed_stream s, std::function<void()> f) {
        std::function<void()>* task;
        {
            std::lock_guard<std::mutex> lock(mu_);
            tasks_.push_back(std::move(f));
            task = &tasks_.back();
        }
        return static_cast<int>(graphed_host_enqueue(s, &HostDevice::trampoline, task));
    }
    static void trampoline(void* p) { (*static_cast<std::function<void()>*>(p))(); }

    std::mutex mu_;
    std::deque<std::function<void()>> tasks_;
};

}  // namespace

std::unique_ptr<Device> make_host_device() { return std::make_unique<HostDevice>(); }

std::unique_ptr<Device> make_device(Backend b, std::string* why_not) {
    if (b == Backend::Host) return make_host_device();
    return make_cuda_device(why_not);
}

}  // namespace kit
