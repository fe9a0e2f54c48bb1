// A CUDA device for the end-to-end benchmark whose linear layers run cuBLAS
// GEMMs (fp32 or bf16 storage, fp32 compute), as a real trainer's would;
// everything else is the kit's CUDA device. The handle has its own
// workspace, so GEMMs are capturable and need no allocation under capture.
#include "tools.hpp"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>
#include <type_traits>

namespace bench {
namespace {

__device__ __forceinline__ float ld(const float* p, size_t i) { return p[i]; }
__device__ __forceinline__ float ld(const __nv_bfloat16* p, size_t i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ void st(float* p, size_t i, float v) { p[i] = v; }
__device__ __forceinline__ void st(__nv_bfloat16* p, size_t i, float v) { p[i] = __float2bfloat16_rn(v); }

template <class T>
__global__ void add_bias(T* z, const T* b, int rows, int cols) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < size_t(rows) * cols) st(z, i, ld(z, i) + ld(b, i % cols));
}

template <class T>
__global__ void bias_grad(const T* gz, T* gb, int rows, int cols) {
    int o = blockIdx.x * blockDim.x + threadIdx.x;
    if (o >= cols) return;
    float acc = 0.0f;
    for (int r = 0; r < rows; ++r) acc += ld(gz, size_t(r) * cols + o);
    st(gb, o, acc);
}

class BlasDevice final : public kit::Device {
  public:
    explicit BlasDevice(std::unique_ptr<kit::Device> inner) : in_(std::move(inner)) {
        if (cublasCreate(&h_) != CUBLAS_STATUS_SUCCESS) throw std::runtime_error("cublasCreate failed");
        ws_ = in_->alloc(kWorkspace);
        cublasSetWorkspace(h_, ws_, kWorkspace);
        cublasSetMathMode(h_, CUBLAS_DEFAULT_MATH);
    }
    ~BlasDevice() override {
        cublasDestroy(h_);
        in_->release(ws_);
    }

    kit::Backend backend() const override { return in_->backend(); }
    void* alloc(size_t b) override { return in_->alloc(b); }
    void release(void* p) override { in_->release(p); }
    void upload(void* d, const void* s, size_t b) override { in_->upload(d, s, b); }
    void download(void* d, const void* s, size_t b) override { in_->download(d, s, b); }
    graphed_stream stream() override { return in_->stream(); }
    graphed_stream side_stream() override { return in_->side_stream(); }
    void sync() override { in_->sync(); }
    size_t free_memory() override { return in_->free_memory(); }
    int relu_fwd(graphed_stream s, uint32_t dt, const void* z, void* y, size_t n) override {
        return in_->relu_fwd(s, dt, z, y, n);
    }
    int relu_bwd(graphed_stream s, uint32_t dt, const void* gy, const void* z, void* gz, size_t n) override {
        return in_->relu_bwd(s, dt, gy, z, gz, n);
    }
    int sub(graphed_stream s, uint32_t dt, const void* a, const void* b, void* y, size_t n) override {
        return in_->sub(s, dt, a, b, y, n);
    }
    int add(graphed_stream s, uint32_t dt, void* y, const void* x, size_t n) override {
        return in_->add(s, dt, y, x, n);
    }
    int sgd(graphed_stream s, uint32_t dt, void* w, const void* g, float lr, size_t n) override {
        return in_->sgd(s, dt, w, g, lr, n);
    }
    int mul(graphed_stream s, uint32_t dt, const void* a, const void* b, void* o, size_t n) override {
        return in_->mul(s, dt, a, b, o, n);
    }
    int dropout(graphed_stream s, uint32_t dt, const void* x, void* y, size_t n, float p, uint64_t seed,
                uint32_t mb_host, const uint32_t* mb_at) override {
        return in_->dropout(s, dt, x, y, n, p, seed, mb_host, mb_at);
    }
    int sgd_momentum(graphed_stream s, float* w, const float* g, float* m, const float* scalars,
                     size_t n) override {
        return in_->sgd_momentum(s, w, g, m, scalars, n);
    }
    int flag_nonfinite(graphed_stream s, const float* g, size_t n, uint32_t* flag) override {
        return in_->flag_nonfinite(s, g, n, flag);
    }
    int illegal(graphed_stream s) override { return in_->illegal(s); }
    int alloc_outside_pool(graphed_stream s) override { return in_->alloc_outside_pool(s); }
    int unjoined_work(graphed_stream s) override { return in_->unjoined_work(s); }
    int uncapturable_call(graphed_stream s) override { return in_->uncapturable_call(s); }
    int copy(graphed_stream s, void* d, const void* src, size_t b) override { return in_->copy(s, d, src, b); }

    // Row-major tensors, as column-major transposes.
    int linear_fwd(graphed_stream s, uint32_t dt, const void* x, const void* w, const void* b, void* z, int B, int In,
                   int Out) override {
        if (int e = gemm(s, dt, CUBLAS_OP_T, CUBLAS_OP_N, Out, B, In, w, In, x, In, z, Out)) return e;
        return launch(dt, [&](auto t) {
            using T = std::remove_pointer_t<decltype(t)>;
            add_bias<<<blocks(size_t(B) * Out), 256, 0, cs(s)>>>(static_cast<T*>(z), static_cast<const T*>(b), B, Out);
        });
    }
    int linear_bwd_input(graphed_stream s, uint32_t dt, const void* gz, const void* w, void* gx, int B, int In,
                         int Out) override {
        return gemm(s, dt, CUBLAS_OP_N, CUBLAS_OP_N, In, B, Out, w, In, gz, Out, gx, In);
    }
    int linear_bwd_weight(graphed_stream s, uint32_t dt, const void* gz, const void* x, void* gw, void* gb, int B,
                          int In, int Out) override {
        if (int e = gemm(s, dt, CUBLAS_OP_N, CUBLAS_OP_T, In, Out, B, x, In, gz, Out, gw, In)) return e;
        return launch(dt, [&](auto t) {
            using T = std::remove_pointer_t<decltype(t)>;
            bias_grad<<<blocks(Out), 256, 0, cs(s)>>>(static_cast<const T*>(gz), static_cast<T*>(gb), B, Out);
        });
    }

  private:
    static constexpr size_t kWorkspace = 64u << 20;
    static cudaStream_t cs(graphed_stream s) { return static_cast<cudaStream_t>(s); }
    static unsigned blocks(size_t n) { return unsigned((n + 255) / 256); }

    template <class F>
    int launch(uint32_t dt, F&& f) {
        if (dt == GRAPHED_DTYPE_F32)
            f(static_cast<float*>(nullptr));
        else if (dt == GRAPHED_DTYPE_BF16)
            f(static_cast<__nv_bfloat16*>(nullptr));
        else
            return -1;
        return cudaGetLastError() == cudaSuccess ? 0 : 2;
    }

    int gemm(graphed_stream s, uint32_t dt, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
             const void* a, int lda, const void* b, int ldb, void* c, int ldc) {
        if (dt != GRAPHED_DTYPE_F32 && dt != GRAPHED_DTYPE_BF16) return -1;
        cudaDataType t = dt == GRAPHED_DTYPE_F32 ? CUDA_R_32F : CUDA_R_16BF;
        const float one = 1.0f, zero = 0.0f;
        // cublasSetStream puts the handle back on cuBLAS's default
        // workspace, which it allocates under capture (cudaMallocAsync:
        // graph nodes a loop's body may not hold); our workspace again.
        // One workspace for every stream: the benchmarks run one at a time.
        cublasSetStream(h_, cs(s));
        cublasSetWorkspace(h_, ws_, kWorkspace);
        cublasStatus_t st = cublasGemmEx(h_, ta, tb, m, n, k, &one, a, t, lda, b, t, ldb, &zero, c, t, ldc,
                                         CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
        return st == CUBLAS_STATUS_SUCCESS ? 0 : 3000 + int(st);
    }

    std::unique_ptr<kit::Device> in_;
    cublasHandle_t h_ = nullptr;
    void* ws_ = nullptr;
};

}  // namespace

std::unique_ptr<kit::Device> make_blas_device(std::string* why_not) {
    auto inner = kit::make_cuda_device(why_not);
    if (!inner) return nullptr;
    return std::make_unique<BlasDevice>(std::move(inner));
}

}  // namespace bench
