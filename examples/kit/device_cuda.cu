// The kit's CUDA device: plain deterministic kernels (one thread per output
// element, a fixed summation order), launched on the given stream.
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

__global__ void k_linear_fwd(const float* x, const float* w, const float* b, float* z, int B, int In, int Out) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= B * Out) return;
    int r = idx / Out, o = idx % Out;
    float acc = 0.0f;
    for (int i = 0; i < In; ++i) acc = __fadd_rn(acc, __fmul_rn(x[r * In + i], w[o * In + i]));
    z[idx] = __fadd_rn(acc, b[o]);
}

__global__ void k_relu_fwd(const float* z, float* y, size_t n) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) y[i] = z[i] > 0.0f ? z[i] : 0.0f;
}

__global__ void k_relu_bwd(const float* gy, const float* z, float* gz, size_t n) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) gz[i] = z[i] > 0.0f ? gy[i] : 0.0f;
}

__global__ void k_linear_bwd_input(const float* gz, const float* w, float* gx, int B, int In, int Out) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= B * In) return;
    int r = idx / In, i = idx % In;
    float acc = 0.0f;
    for (int o = 0; o < Out; ++o) acc = __fadd_rn(acc, __fmul_rn(gz[r * Out + o], w[o * In + i]));
    gx[idx] = acc;
}

__global__ void k_linear_bwd_weight(const float* gz, const float* x, float* gw, int B, int In, int Out) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= Out * In) return;
    int o = idx / In, i = idx % In;
    float acc = 0.0f;
    for (int r = 0; r < B; ++r) acc = __fadd_rn(acc, __fmul_rn(gz[r * Out + o], x[r * In + i]));
    gw[idx] = acc;
}

__global__ void k_bias_grad(const float* gz, float* gb, int B, int Out) {
    int o = blockIdx.x * blockDim.x + threadIdx.x;
    if (o >= Out) return;
    float acc = 0.0f;
    for (int r = 0; r < B; ++r) acc = __fadd_rn(acc, gz[r * Out + o]);
    gb[o] = acc;
}

__global__ void k_sub(const float* a, const float* b, float* y, size_t n) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) y[i] = __fsub_rn(a[i], b[i]);
}

__global__ void k_add(float* y, const float* x, size_t n) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) y[i] = __fadd_rn(y[i], x[i]);
}

__global__ void k_sgd(float* w, const float* g, float lr, size_t n) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) w[i] = __fsub_rn(w[i], __fmul_rn(lr, g[i]));
}

__global__ void k_mul_f32(const float* a, const float* b, float* o, size_t n) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) o[i] = __fmul_rn(a[i], b[i]);
}

__global__ void k_mul_f16(const __half* a, const __half* b, __half* o, size_t n) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) o[i] = __float2half_rn(__fmul_rn(__half2float(a[i]), __half2float(b[i])));
}

__global__ void k_mul_bf16(const __nv_bfloat16* a, const __nv_bfloat16* b, __nv_bfloat16* o, size_t n) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) o[i] = __float2bfloat16_rn(__fmul_rn(__bfloat162float(a[i]), __bfloat162float(b[i])));
}

class CudaDevice final : public Device {
  public:
    CudaDevice() {
        cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
        cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking);
    }
    ~CudaDevice() override {
        cudaStreamSynchronize(stream_);
        cudaStreamDestroy(stream_);
        cudaStreamDestroy(side_);
    }
    Backend backend() const override { return Backend::Cuda; }
    void* alloc(size_t bytes) override {
        void* p = nullptr;
        if (cudaMalloc(&p, bytes) != cudaSuccess) throw std::runtime_error("cudaMalloc failed");
        cudaMemset(p, 0, bytes);
        return p;
    }
    void release(void* p) override {
        cudaDeviceSynchronize();
        cudaFree(p);
    }
    void upload(void* dst, const void* src, size_t bytes) override {
        cudaStreamSynchronize(stream_);
        if (cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice) != cudaSuccess)
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

    int linear_fwd(graphed_stream s, const float* x, const float* w, const float* b, float* z, int B, int In,
                   int Out) override {
        k_linear_fwd<<<blocks(size_t(B) * Out), 256, 0, cs(s)>>>(x, w, b, z, B, In, Out);
        return launched();
    }
    int relu_fwd(graphed_stream s, const float* z, float* y, size_t n) override {
        k_relu_fwd<<<blocks(n), 256, 0, cs(s)>>>(z, y, n);
        return launched();
    }
    int relu_bwd(graphed_stream s, const float* gy, const float* z, float* gz, size_t n) override {
        k_relu_bwd<<<blocks(n), 256, 0, cs(s)>>>(gy, z, gz, n);
        return launched();
    }
    int linear_bwd_input(graphed_stream s, const float* gz, const float* w, float* gx, int B, int In,
                         int Out) override {
        k_linear_bwd_input<<<blocks(size_t(B) * In), 256, 0, cs(s)>>>(gz, w, gx, B, In, Out);
        return launched();
    }
    int linear_bwd_weight(graphed_stream s, const float* gz, const float* x, float* gw, float* gb, int B, int In,
                          int Out) override {
        k_linear_bwd_weight<<<blocks(size_t(Out) * In), 256, 0, cs(s)>>>(gz, x, gw, B, In, Out);
        if (int e = launched()) return e;
        k_bias_grad<<<blocks(Out), 256, 0, cs(s)>>>(gz, gb, B, Out);
        return launched();
    }
    int sub(graphed_stream s, const float* a, const float* b, float* y, size_t n) override {
        k_sub<<<blocks(n), 256, 0, cs(s)>>>(a, b, y, n);
        return launched();
    }
    int add(graphed_stream s, float* y, const float* x, size_t n) override {
        k_add<<<blocks(n), 256, 0, cs(s)>>>(y, x, n);
        return launched();
    }
    int sgd(graphed_stream s, float* w, const float* g, float lr, size_t n) override {
        k_sgd<<<blocks(n), 256, 0, cs(s)>>>(w, g, lr, n);
        return launched();
    }
    int mul(graphed_stream s, uint32_t dtype, const void* a, const void* b, void* out, size_t n) override {
        switch (dtype) {
            case GRAPHED_DTYPE_F32:
                k_mul_f32<<<blocks(n), 256, 0, cs(s)>>>(static_cast<const float*>(a), static_cast<const float*>(b),
                                                        static_cast<float*>(out), n);
                break;
            case GRAPHED_DTYPE_F16:
                k_mul_f16<<<blocks(n), 256, 0, cs(s)>>>(static_cast<const __half*>(a), static_cast<const __half*>(b),
                                                        static_cast<__half*>(out), n);
                break;
            case GRAPHED_DTYPE_BF16:
                k_mul_bf16<<<blocks(n), 256, 0, cs(s)>>>(static_cast<const __nv_bfloat16*>(a),
                                                         static_cast<const __nv_bfloat16*>(b),
                                                         static_cast<__nv_bfloat16*>(out), n);
                break;
            default: return -1;
        }
        return launched();
    }
    int illegal(graphed_stream s) override {
        // Synchronizing a capturing stream is illegal; CUDA returns an error
        // and invalidates the capture. Report success, as careless code would.
        (void)cudaStreamSynchronize(cs(s));
        (void)cudaGetLastError();
        return 0;
    }
    int copy(graphed_stream s, void* dst, const void* src, size_t bytes) override {
        return err(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, cs(s)));
    }

  private:
    cudaStream_t stream_ = nullptr;
    cudaStream_t side_ = nullptr;
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
