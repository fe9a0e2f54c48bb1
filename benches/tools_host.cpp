// Benchmark tools on the host backend: wall-clock timing and host versions
// of the reference operations.
#include "tools.hpp"

#include <cstdio>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>

namespace bench {

std::string fmt(const char* f, double v) {
    char b[64];
    std::snprintf(b, sizeof b, f, v);
    return b;
}

double ms_since(std::chrono::steady_clock::time_point a) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a).count();
}

double median(std::vector<double> v) {
    if (v.empty()) return 0.0;
    std::sort(v.begin(), v.end());
    size_t n = v.size();
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

namespace {

class HostTools final : public Tools {
  public:
    explicit HostTools(kit::Device& d) : dev_(d) {}
    std::string describe() override { return "host backend (CPU; times are wall-clock, not GPU figures)"; }
    bool device_timing() const override { return false; }
    double median_ms(const std::function<void()>& op, const std::function<void()>& after, int warmup, int samples,
                     int) override {
        for (int i = 0; i < warmup; ++i) {
            op();
            after();
        }
        std::vector<double> t;
        for (int i = 0; i < samples; ++i) {
            auto a = std::chrono::steady_clock::now();
            op();
            auto b = std::chrono::steady_clock::now();
            after();
            t.push_back(std::chrono::duration<double, std::milli>(b - a).count());
        }
        return median(t);
    }
    void flat_copy(void* dst, const void* src, size_t bytes) override { dev_.copy(dev_.stream(), dst, src, bytes); }
    void clone_each(std::vector<void*>& out, const std::vector<void*>& src, size_t bytes) override {
        out.clear();
        for (void* s : src) {
            void* p = std::malloc(bytes);
            std::memcpy(p, s, bytes);
            out.push_back(p);
        }
    }
    void free_each(std::vector<void*>& ptrs) override {
        for (void* p : ptrs) std::free(p);
        ptrs.clear();
    }
    void add_each(const std::vector<void*>& dst, const std::vector<void*>& src, size_t count) override {
        for (size_t i = 0; i < dst.size(); ++i)
            dev_.add(dev_.stream(), GRAPHED_DTYPE_F32, dst[i], src[i], count);
    }
    void* capture(const std::function<void(graphed_stream)>&) override { return nullptr; }
    void launch(void*) override {}
    void destroy(void*) override {}
    size_t driver_free() override { return 0; }

  private:
    kit::Device& dev_;
};

}  // namespace

std::unique_ptr<Tools> make_host_tools(kit::Device& dev) { return std::make_unique<HostTools>(dev); }

}  // namespace bench
