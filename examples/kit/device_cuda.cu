// The kit's CUDA device: plain deterministic kernels (one thread per output
// element, a fixed summation order in f32, every product and sum rounded
// explicitly so the compiler cannot fuse them), launched on the given
// stream, for f32, f16 and bf16 storage.
#include "dropout.hpp"
#include "kit.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>

namespace kit {
namespace {

int err(cudaError_t e) { return e == cudaSuccess ? 0 : 1000 + static_cast<int>(e); }
int launched() { return err(cudaGetLastError()); }
unsigned blocks(size_t n, unsigned t = 256) { return static_cast<unsigned>((n + t - 1) / t); }
cudaStream_t cs(graphed_stream s) { return static_cast<cudaStream_t>(s); }

__device__ __forceinline__ float ld(const float* p, size_t i) { return p[i]; }
__device__ __forceinline__ float ld(const __half* p, size_t i) { return __half2float(p[i]); }
__device__ __forceinline__ float ld(const __nv_bfloat16* p, size_t i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ void st(float* p, size_t i, float v) { p[i] = v; }
__device__ __forceinline__ void st(__half* p, size_t i, float v) { p[i] = __float2half_rn(v); }
__device__ __forceinline__ void st(__nv_bfloat16* p, size_t i, float v) { p[i] = __float2bfloat16_rn(v); }

__global__ void k_nothing() {}

template <class T>
__global__ void k_linear_fwd(const T* x, const T* w, const T* b, T* z, int B, int In, int Out) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= B * Out) return;
    int r = idx / Out, o = idx % Out;
    float acc = 0.0f;
    for (int i = 0; i < In; ++i) acc = __fadd_rn(acc, __fmul_rn(ld(x, r * In + i), ld(w, o * In + i)));
    st(z, idx, __fadd_rn(acc, ld(b, o)));
}

template <class T>
__global__ void k_relu_fwd(const T* z, T* y, size_t n) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) st(y, i, ld(z, i) > 0.0f ? ld(z, i) : 0.0f);
}

template <class T>
__global__ void k_relu_bwd(const T* gy, const T* z, T* gz, size_t n) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) st(gz, i, ld(z, i) > 0.0f ? ld(gy, i) : 0.0f);
}

template <class T>
__global__ void k_linear_bwd_input(const T* gz, const T* w, T* gx, int B, int In, int Out) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= B * In) return;
    int r = idx / In, i = idx % In;
    float acc = 0.0f;
    for (int o = 0; o < Out; ++o) acc = __fadd_rn(acc, __fmul_rn(ld(gz, r * Out + o), ld(w, o * In + i)));
    st(gx, idx, acc);
}

template <class T>
__global__ void k_linear_bwd_weight(const T* gz, const T* x, T* gw, int B, int In, int Out) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= Out * In) return;
    int o = idx / In, i = idx % In;
    float acc = 0.0f;
    for (int r = 0; r < B; ++r) acc = __fadd_rn(acc, __fmul_rn(ld(gz, r * Out + o), ld(x, r * In + i)));
    st(gw, idx, acc);
}

template <class T>
__global__ void k_bias_grad(const T* gz, T* gb, int B, int Out) {
    int o = blockIdx.x * blockDim.x + threadIdx.x;
    if (o >= Out) return;
    float acc = 0.0f;
    for (int r = 0; r < B; ++r) acc = __fadd_rn(acc, ld(gz, r * Out + o));
    st(gb, o, acc);
}

template <class T>
__global__ void k_sub(const T* a, const T* b, T* y, size_t n) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) st(y, i, __fsub_rn(ld(a, i), ld(b, i)));
}

template <class T>
__global__ void k_add(T* y, const T* x, size_t n) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) st(y, i, __fadd_rn(ld(y, i), ld(x, i)));
}

template <class T>
__global__ void k_sgd(T* w, const T* g, float lr, size_t n) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) st(w, i, __fsub_rn(ld(w, i), __fmul_rn(lr, ld(g, i))));
}

__global__ void k_sgd_momentum(float* w, const float* g, float* m, const float* scalars, size_t n) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float lr = scalars[0], mu = scalars[1];
    const float mm = __fadd_rn(__fmul_rn(mu, m[i]), g[i]);
    m[i] = mm;
    w[i] = __fsub_rn(w[i], __fmul_rn(lr, mm));
}

__global__ void k_flag_nonfinite(const float* g, size_t n, uint32_t* flag) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n && !isfinite(g[i])) *flag = 1;
}

template <class T>
__global__ void k_mul(const T* a, const T* b, T* o, size_t n) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) st(o, i, __fmul_rn(ld(a, i), ld(b, i)));
}

template <class T>
__global__ void k_dropout(const T* x, T* y, size_t n, float p, float scale, uint64_t seed, uint32_t mb_host,
                          const uint32_t* mb_at) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= n) return;
    const uint32_t mb = mb_at ? *mb_at : mb_host;
    st(y, i, dropout_keeps(seed, mb, i, p) ? __fmul_rn(ld(x, i), scale) : 0.0f);
}

// Calls f with a typed null pointer of the storage type of `dt`.
template <class F>
int dispatch(uint32_t dt, F&& f) {
    switch (dt) {
        case GRAPHED_DTYPE_F32: f(static_cast<float*>(nullptr)); break;
        case GRAPHED_DTYPE_F16: f(static_cast<__half*>(nullptr)); break;
        case GRAPHED_DTYPE_BF16: f(static_cast<__nv_bfloat16*>(nullptr)); break;
        default: return -1;
    }
    return launched();
}

template <class T>
const T* in(const void* p, T*) { return static_cast<const T*>(p); }
template <class T>
T* out(void* p, T*) { return static_cast<T*>(p); }

class CudaDevice final : public Device {
  public:
    CudaDevice() {
        cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
        cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking);
        cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming);
        cudaMalloc(&word_, 4);
    }
    ~CudaDevice() override {
        cudaStreamSynchronize(stream_);
        cudaStreamDestroy(stream_);
        cudaStreamDestroy(side_);
        cudaEventDestroy(fork_);
        cudaFree(word_);
    }
    Backend backend() const override { return Backend::Cuda; }
    void* alloc(size_t bytes) override {
        void* p = nullptr;
        if (cudaMalloc(&p, bytes) != cudaSuccess) throw std::runtime_error("cudaMalloc failed");
        // Zeroed on stream() and waited for, like upload: a plain cudaMemset
        // of device memory runs on the legacy default stream and returns
        // before it ran; stream() (non-blocking) is not ordered after it, so
        // an upload or kernel on stream() could land first and the late
        // memset then zero the weights or inputs just written (more likely
        // when another process holds the GPU's compute engine while the copy
        // engine serves this one, as in Processes.*_cuda).
        if (cudaMemsetAsync(p, 0, bytes, stream_) != cudaSuccess || cudaStreamSynchronize(stream_) != cudaSuccess) {
            cudaFree(p);
            throw std::runtime_error("zeroing new device memory failed");
        }
        return p;
    }
    void release(void* p) override {
        cudaDeviceSynchronize();
        cudaFree(p);
    }
    void upload(void* dst, const void* src, size_t bytes) override {
        // On stream() and waited for: a plain cudaMemcpy from pageable
        // memory runs on the legacy default stream, which a non-blocking
        // stream does not wait for, and may return before its DMA reached
        // the device, so kernels enqueued next on stream() could read the
        // old bytes (seen as a rare mismatch in Processes.*_cuda).
        if (cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_) != cudaSuccess ||
            cudaStreamSynchronize(stream_) != cudaSuccess)
            throw std::runtime_error("upload failed");
    }
    void download(void* dst, const void* src, size_t bytes) override {
        sync();
        if (cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost) != cudaSuccess)
            throw std::runtime_error("download failed");
    }
    graphed_stream stream() override { return stream_; }
    graphed_stream side_stream() override { return side_; }
    void sync() override {
        cudaError_t e = cudaDeviceSynchronize();
        if (e != cudaSuccess) throw std::runtime_error(std::string("device error: ") + cudaGetErrorString(e));
    }
    size_t free_memory() override {
        size_t f = 0, t = 0;
        cudaMemGetInfo(&f, &t);
        return f;
    }

    int linear_fwd(graphed_stream s, uint32_t dt, const void* x, const void* w, const void* b, void* z, int B, int In,
                   int Out) override {
        return dispatch(dt, [&](auto t) {
            k_linear_fwd<<<blocks(size_t(B) * Out), 256, 0, cs(s)>>>(in(x, t), in(w, t), in(b, t), out(z, t), B, In,
                                                                     Out);
        });
    }
    int relu_fwd(graphed_stream s, uint32_t dt, const void* z, void* y, size_t n) override {
        return dispatch(dt, [&](auto t) { k_relu_fwd<<<blocks(n), 256, 0, cs(s)>>>(in(z, t), out(y, t), n); });
    }
    int relu_bwd(graphed_stream s, uint32_t dt, const void* gy, const void* z, void* gz, size_t n) override {
        return dispatch(dt, [&](auto t) {
            k_relu_bwd<<<blocks(n), 256, 0, cs(s)>>>(in(gy, t), in(z, t), out(gz, t), n);
        });
    }
    int linear_bwd_input(graphed_stream s, uint32_t dt, const void* gz, const void* w, void* gx, int B, int In,
                         int Out) override {
        return dispatch(dt, [&](auto t) {
            k_linear_bwd_input<<<blocks(size_t(B) * In), 256, 0, cs(s)>>>(in(gz, t), in(w, t), out(gx, t), B, In, Out);
        });
    }
    int linear_bwd_weight(graphed_stream s, uint32_t dt, const void* gz, const void* x, void* gw, void* gb, int B,
                          int In, int Out) override {
        return dispatch(dt, [&](auto t) {
            k_linear_bwd_weight<<<blocks(size_t(Out) * In), 256, 0, cs(s)>>>(in(gz, t), in(x, t), out(gw, t), B, In,
                                                                            Out);
            k_bias_grad<<<blocks(Out), 256, 0, cs(s)>>>(in(gz, t), out(gb, t), B, Out);
        });
    }
    int sub(graphed_stream s, uint32_t dt, const void* a, const void* b, void* y, size_t n) override {
        return dispatch(dt, [&](auto t) { k_sub<<<blocks(n), 256, 0, cs(s)>>>(in(a, t), in(b, t), out(y, t), n); });
    }
    int add(graphed_stream s, uint32_t dt, void* y, const void* x, size_t n) override {
        return dispatch(dt, [&](auto t) { k_add<<<blocks(n), 256, 0, cs(s)>>>(out(y, t), in(x, t), n); });
    }
    int sgd(graphed_stream s, uint32_t dt, void* w, const void* g, float lr, size_t n) override {
        return dispatch(dt, [&](auto t) { k_sgd<<<blocks(n), 256, 0, cs(s)>>>(out(w, t), in(g, t), lr, n); });
    }
    int mul(graphed_stream s, uint32_t dt, const void* a, const void* b, void* o, size_t n) override {
        return dispatch(dt, [&](auto t) { k_mul<<<blocks(n), 256, 0, cs(s)>>>(in(a, t), in(b, t), out(o, t), n); });
    }
    int dropout(graphed_stream s, uint32_t dt, const void* x, void* y, size_t n, float p, uint64_t seed,
                uint32_t mb_host, const uint32_t* mb_at) override {
        const float scale = 1.0f / (1.0f - p);
        return dispatch(dt, [&](auto t) {
            k_dropout<<<blocks(n), 256, 0, cs(s)>>>(in(x, t), out(y, t), n, p, scale, seed, mb_host, mb_at);
        });
    }
    int illegal(graphed_stream s) override {
        // Synchronizing a capturing stream is illegal; CUDA returns an error
        // and invalidates the capture. Report success, as careless code would.
        (void)cudaStreamSynchronize(cs(s));
        (void)cudaGetLastError();
        return 0;
    }
    int alloc_outside_pool(graphed_stream) override {
        void* p = nullptr;
        const cudaError_t e = cudaMalloc(&p, 256);
        if (e == cudaSuccess) return err(cudaFree(p));
        return refused("cudaMalloc (an allocation outside the graph's pool)", e);
    }
    int unjoined_work(graphed_stream s) override {
        // Careless: each call succeeds, and the capture's end reports
        // CUDA_ERROR_STREAM_CAPTURE_UNJOINED.
        (void)cudaEventRecord(fork_, cs(s));
        (void)cudaStreamWaitEvent(side_, fork_, 0);
        k_nothing<<<1, 1, 0, side_>>>();
        (void)cudaGetLastError();
        return 0;
    }
    int uncapturable_call(graphed_stream) override {
        uint32_t host = 0;
        const cudaError_t e = cudaMemcpy(&host, word_, sizeof host, cudaMemcpyDeviceToHost);
        if (e == cudaSuccess) return 0;
        return refused("cudaMemcpy (a CUDA library call that cannot be captured)", e);
    }
    static int refused(const char* operation, cudaError_t e) {
        (void)cudaGetLastError();
        const std::string said = std::string(operation) + " returned " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e);
        (void)graphed_callback_fail_message(said.c_str());
        return err(e);
    }
    int sgd_momentum(graphed_stream s, float* w, const float* g, float* m, const float* scalars,
                     size_t n) override {
        k_sgd_momentum<<<blocks(n), 256, 0, cs(s)>>>(w, g, m, scalars, n);
        return launched();
    }
    int flag_nonfinite(graphed_stream s, const float* g, size_t n, uint32_t* flag) override {
        k_flag_nonfinite<<<blocks(n), 256, 0, cs(s)>>>(g, n, flag);
        return launched();
    }
    int copy(graphed_stream s, void* dst, const void* src, size_t bytes) override {
        return err(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, cs(s)));
    }

  private:
    cudaStream_t stream_ = nullptr;
    cudaStream_t side_ = nullptr;
    cudaEvent_t fork_ = nullptr;  // unjoined_work's fork
    void* word_ = nullptr;        // uncapturable_call's source
};

}  // namespace

std::unique_ptr<Device> make_cuda_device(std::string* why_not) {
    uint32_t count = 0;
    graphed_status s = graphed_device_count(&count);
    if (s != GRAPHED_STATUS_OK) {
        if (why_not) *why_not = std::string(graphed_status_name(s)) + ": " + graphed_last_error_message();
        return nullptr;
    }
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
        if (why_not) *why_not = std::string("the CUDA runtime sees no device: ") + cudaGetErrorString(e);
        return nullptr;
    }
    cudaSetDevice(0);
    return std::make_unique<CudaDevice>();
}

}  // namespace kit
