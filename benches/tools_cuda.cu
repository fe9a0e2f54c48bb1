// Benchmark tools on CUDA: CUDA-event timing with the GPU held by a blocking
// kernel while samples are enqueued, and the reference operations
// (cudaMemcpyAsync, cudaMallocAsync per tensor, a vectorized add kernel per
// tensor, raw cudaGraphLaunch).
#include "tools.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>

namespace bench {
namespace {

void ck(cudaError_t e, const char* what) {
    if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

// Spins until *flag is set by the host, or a timeout (so a full launch
// queue cannot deadlock the benchmark).
__global__ void hold(volatile int* flag, unsigned long long timeout_ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (*flag == 0 && now - start < timeout_ns);
}

__global__ void add_f32x4(float4* y, const float4* x, size_t n4, float* ys, const float* xs, size_t tail) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t k = i; k < n4; k += stride) {
        float4 a = y[k], b = x[k];
        y[k] = make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
    }
    if (i < tail) ys[i] += xs[i];
}

class CudaTools final : public Tools {
  public:
    explicit CudaTools(kit::Device& d) : dev_(d), s_(static_cast<cudaStream_t>(d.stream())) {
        ck(cudaHostAlloc(&flag_, sizeof(int), cudaHostAllocMapped), "cudaHostAlloc");
        ck(cudaHostGetDevicePointer(&dflag_, flag_, 0), "cudaHostGetDevicePointer");
        ck(cudaStreamCreateWithFlags(&cap_, cudaStreamNonBlocking), "cudaStreamCreate");
        int dev = 0;
        ck(cudaGetDevice(&dev), "cudaGetDevice");
        ck(cudaDeviceGetAttribute(&sms_, cudaDevAttrMultiProcessorCount, dev), "attribute");
        // The reference allocator caches freed memory, as PyTorch's does.
        cudaMemPool_t pool;
        ck(cudaDeviceGetDefaultMemPool(&pool, dev), "cudaDeviceGetDefaultMemPool");
        uint64_t threshold = ~0ull;
        ck(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold), "release threshold");
    }
    ~CudaTools() override {
        for (auto e : events_) cudaEventDestroy(e);
        cudaFreeHost(flag_);
        cudaStreamDestroy(cap_);
    }

    std::string describe() override {
        cudaDeviceProp p{};
        int dev = 0, driver = 0, runtime = 0;
        cudaGetDevice(&dev);
        cudaGetDeviceProperties(&p, dev);
        cudaDriverGetVersion(&driver);
        cudaRuntimeGetVersion(&runtime);
        return std::string(p.name) + " (" + std::to_string(p.multiProcessorCount) + " SMs), driver CUDA " +
               std::to_string(driver / 1000) + "." + std::to_string(driver % 1000 / 10) + ", runtime " +
               std::to_string(runtime / 1000) + "." + std::to_string(runtime % 1000 / 10);
    }
    bool device_timing() const override { return true; }

    double median_ms(const std::function<void()>& op, const std::function<void()>& after, int warmup, int samples,
                     int launches) override {
        for (int i = 0; i < warmup; ++i) {
            op();
            after();
        }
        dev_.sync();
        // At most ~600 queued operations while the GPU is held.
        const int per_batch = std::max(1, std::min(samples, 600 / std::max(1, launches + 2)));
        while (events_.size() < size_t(2 * per_batch)) {
            cudaEvent_t e;
            ck(cudaEventCreate(&e), "cudaEventCreate");
            events_.push_back(e);
        }
        std::vector<double> t;
        for (int done = 0; done < samples;) {
            const int k = std::min(per_batch, samples - done);
            *static_cast<volatile int*>(flag_) = 0;
            hold<<<1, 1, 0, s_>>>(dflag_, 2000000000ull);
            for (int i = 0; i < k; ++i) {
                ck(cudaEventRecord(events_[2 * i], s_), "cudaEventRecord");
                op();
                ck(cudaEventRecord(events_[2 * i + 1], s_), "cudaEventRecord");
                after();
            }
            *static_cast<volatile int*>(flag_) = 1;
            dev_.sync();
            for (int i = 0; i < k; ++i) {
                float ms = 0;
                ck(cudaEventElapsedTime(&ms, events_[2 * i], events_[2 * i + 1]), "cudaEventElapsedTime");
                t.push_back(ms);
            }
            done += k;
        }
        return median(t);
    }

    void flat_copy(void* dst, const void* src, size_t bytes) override {
        ck(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s_), "cudaMemcpyAsync");
    }
    void clone_each(std::vector<void*>& out, const std::vector<void*>& src, size_t bytes) override {
        out.clear();
        for (void* p : src) {
            void* q = nullptr;
            ck(cudaMallocAsync(&q, bytes, s_), "cudaMallocAsync");
            ck(cudaMemcpyAsync(q, p, bytes, cudaMemcpyDeviceToDevice, s_), "cudaMemcpyAsync");
            out.push_back(q);
        }
    }
    void free_each(std::vector<void*>& ptrs) override {
        for (void* p : ptrs) ck(cudaFreeAsync(p, s_), "cudaFreeAsync");
        ptrs.clear();
    }
    void add_each(const std::vector<void*>& dst, const std::vector<void*>& src, size_t count) override {
        size_t n4 = count / 4, tail = count % 4;
        unsigned blocks = unsigned(std::min<size_t>((n4 + 255) / 256 + 1, size_t(sms_) * 16));
        for (size_t i = 0; i < dst.size(); ++i) {
            auto* y = static_cast<float*>(dst[i]);
            auto* x = static_cast<const float*>(src[i]);
            add_f32x4<<<blocks, 256, 0, s_>>>(reinterpret_cast<float4*>(y), reinterpret_cast<const float4*>(x), n4,
                                              y + 4 * n4, x + 4 * n4, tail);
        }
    }
    void* capture(const std::function<void(graphed_stream)>& body) override {
        cudaGraph_t g = nullptr;
        cudaGraphExec_t exec = nullptr;
        ck(cudaStreamBeginCapture(cap_, cudaStreamCaptureModeGlobal), "cudaStreamBeginCapture");
        body(cap_);
        ck(cudaStreamEndCapture(cap_, &g), "cudaStreamEndCapture");
        ck(cudaGraphInstantiate(&exec, g, 0), "cudaGraphInstantiate");
        cudaGraphDestroy(g);
        ck(cudaGraphUpload(exec, s_), "cudaGraphUpload");
        return exec;
    }
    void launch(void* graph) override {
        ck(cudaGraphLaunch(static_cast<cudaGraphExec_t>(graph), s_), "cudaGraphLaunch");
    }
    void destroy(void* graph) override { cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(graph)); }
    size_t driver_free() override {
        size_t f = 0, t = 0;
        cudaMemGetInfo(&f, &t);
        return f;
    }

  private:
    kit::Device& dev_;
    cudaStream_t s_, cap_ = nullptr;
    int* flag_ = nullptr;
    int* dflag_ = nullptr;
    int sms_ = 1;
    std::vector<cudaEvent_t> events_;
};

}  // namespace

std::unique_ptr<Tools> make_cuda_tools(kit::Device& dev) { return std::make_unique<CudaTools>(dev); }

}  // namespace bench
