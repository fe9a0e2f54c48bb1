// Benchmark tools of one backend: timing, and the reference operations the
// library is measured against (one flat copy, one allocation + copy per
// tensor, one add per tensor, raw graph launches).
#pragma once

#include "kit.hpp"

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace bench {

class Tools {
  public:
    virtual ~Tools() = default;
    // What the numbers come from ("NVIDIA H200 (132 SMs), driver 13000").
    virtual std::string describe() = 0;
    // Whether median_ms measures device time with events.
    virtual bool device_timing() const = 0;
    // The median over `samples` of the time `op` takes, in ms: on CUDA the
    // device time of the work `op` enqueues on the device's stream (event
    // pairs; the GPU is held by a blocking kernel while the samples are
    // enqueued, so host submission gaps are not counted); on the host the
    // wall time. `after` runs after each sample, outside the timing.
    // `launches` is about how many stream operations one sample enqueues.
    virtual double median_ms(const std::function<void()>& op, const std::function<void()>& after, int warmup,
                             int samples, int launches) = 0;
    // One copy of `bytes` on the device's stream.
    virtual void flat_copy(void* dst, const void* src, size_t bytes) = 0;
    // One stream-ordered allocation and one copy per tensor (as cloning
    // each grad with a caching allocator does), and their release.
    virtual void clone_each(std::vector<void*>& out, const std::vector<void*>& src, size_t bytes) = 0;
    virtual void free_each(std::vector<void*>& ptrs) = 0;
    // dst[i] += src[i] for each tensor (f32, `count` elements), one kernel each.
    virtual void add_each(const std::vector<void*>& dst, const std::vector<void*>& src, size_t count) = 0;
    // Raw graphs: `body` captured on a side stream, launched on the
    // device's stream. CUDA only (nullptr elsewhere).
    virtual void* capture(const std::function<void(graphed_stream)>& body) = 0;
    virtual void launch(void* graph) = 0;
    virtual void destroy(void* graph) = 0;
    // The driver's free device memory (0 on the host).
    virtual size_t driver_free() = 0;
};

std::unique_ptr<Tools> make_host_tools(kit::Device& dev);
std::unique_ptr<Tools> make_cuda_tools(kit::Device& dev);  // nullptr without CUDA
// A CUDA device whose linear layers run cuBLAS GEMMs (nullptr without cuBLAS).
std::unique_ptr<kit::Device> make_blas_device(std::string* why_not);

double median(std::vector<double> v);

// A number formatted for the report ("%.3fx", ...).
std::string fmt(const char* f, double v);

// Milliseconds of wall time since `a`.
double ms_since(std::chrono::steady_clock::time_point a);

}  // namespace bench
