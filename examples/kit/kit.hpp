// A small kit of toy training layers on both graphed backends, shared by the
// demo, the tests and the benchmarks: device memory and streams for the
// backend under test, and the math the layers' callbacks enqueue (naive,
// deterministic kernels: the same inputs give the same bits every time, so
// graphed and eager runs can be compared exactly).
#pragma once

#include <graphed.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <ostream>
#include <stdexcept>
#include <string>
#include <vector>

namespace kit {

enum class Backend { Host, Cuda };

inline const char* backend_name(Backend b) { return b == Backend::Host ? "host" : "cuda"; }

// For GoogleTest's messages.
inline void PrintTo(Backend b, std::ostream* os) { *os << backend_name(b); }

// Memory, streams and math of one backend. All math is enqueued on the
// given stream (a callback's ctx->stream, or `stream()` for eager work) and
// returns 0 on success.
class Device {
  public:
    virtual ~Device() = default;
    virtual Backend backend() const = 0;
    graphed_backend graphed_kind() const {
        return backend() == Backend::Host ? GRAPHED_BACKEND_HOST : GRAPHED_BACKEND_CUDA;
    }

    virtual void* alloc(size_t bytes) = 0;
    virtual void release(void* p) = 0;
    // Synchronous copies to and from device memory (they wait for stream()).
    virtual void upload(void* dst, const void* src, size_t bytes) = 0;
    virtual void download(void* dst, const void* src, size_t bytes) = 0;
    // The stream for eager work and replays (NULL on the host: run now).
    virtual graphed_stream stream() = 0;
    // A second stream (for side-stream replays).
    virtual graphed_stream side_stream() = 0;
    virtual void sync() = 0;
    // Driver figure of free device memory (0 when there is none).
    virtual size_t free_memory() = 0;

    // The layer math, in any of f32, f16 and bf16 (`dt`, a graphed_dtype):
    // elements are read as f32, every sum is taken in f32 in a fixed order,
    // and each result is rounded to `dt` once.
    //
    // z[b][o] = sum_i x[b][i] * w[o][i] + bias[o]
    virtual int linear_fwd(graphed_stream s, uint32_t dt, const void* x, const void* w, const void* bias, void* z,
                           int batch, int in, int out) = 0;
    // y = max(z, 0)
    virtual int relu_fwd(graphed_stream s, uint32_t dt, const void* z, void* y, size_t n) = 0;
    // gz = z > 0 ? gy : 0
    virtual int relu_bwd(graphed_stream s, uint32_t dt, const void* gy, const void* z, void* gz, size_t n) = 0;
    // gx[b][i] = sum_o gz[b][o] * w[o][i]
    virtual int linear_bwd_input(graphed_stream s, uint32_t dt, const void* gz, const void* w, void* gx, int batch,
                                 int in, int out) = 0;
    // gw[o][i] = sum_b gz[b][o] * x[b][i]; gbias[o] = sum_b gz[b][o]
    virtual int linear_bwd_weight(graphed_stream s, uint32_t dt, const void* gz, const void* x, void* gw, void* gbias,
                                  int batch, int in, int out) = 0;
    // y = a - b
    virtual int sub(graphed_stream s, uint32_t dt, const void* a, const void* b, void* y, size_t n) = 0;
    // y += x
    virtual int add(graphed_stream s, uint32_t dt, void* y, const void* x, size_t n) = 0;
    // w -= lr * g
    virtual int sgd(graphed_stream s, uint32_t dt, void* w, const void* g, float lr, size_t n) = 0;

    // f32 shorthands.
    int linear_fwd(graphed_stream s, const float* x, const float* w, const float* b, float* z, int batch, int in,
                   int out) {
        return linear_fwd(s, GRAPHED_DTYPE_F32, x, w, b, z, batch, in, out);
    }
    int relu_fwd(graphed_stream s, const float* z, float* y, size_t n) {
        return relu_fwd(s, GRAPHED_DTYPE_F32, z, y, n);
    }
    int relu_bwd(graphed_stream s, const float* gy, const float* z, float* gz, size_t n) {
        return relu_bwd(s, GRAPHED_DTYPE_F32, gy, z, gz, n);
    }
    int linear_bwd_input(graphed_stream s, const float* gz, const float* w, float* gx, int batch, int in, int out) {
        return linear_bwd_input(s, GRAPHED_DTYPE_F32, gz, w, gx, batch, in, out);
    }
    int linear_bwd_weight(graphed_stream s, const float* gz, const float* x, float* gw, float* gb, int batch, int in,
                          int out) {
        return linear_bwd_weight(s, GRAPHED_DTYPE_F32, gz, x, gw, gb, batch, in, out);
    }
    int sub(graphed_stream s, const float* a, const float* b, float* y, size_t n) {
        return sub(s, GRAPHED_DTYPE_F32, a, b, y, n);
    }
    int add(graphed_stream s, float* y, const float* x, size_t n) { return add(s, GRAPHED_DTYPE_F32, y, x, n); }
    int sgd(graphed_stream s, float* w, const float* g, float lr, size_t n) {
        return sgd(s, GRAPHED_DTYPE_F32, w, g, lr, n);
    }
    // out = round(a * b) elementwise in `dtype` (f32, f16, bf16), computed in f32.
    virtual int mul(graphed_stream s, uint32_t dtype, const void* a, const void* b, void* out, size_t n) = 0;
    // Dropout with probability p: y[i] = x[i] * (1 / (1 - p)) where
    // dropout_keeps(seed, mb, i, p) (dropout.hpp), else 0; in place when y
    // is x. The microbatch `mb` is read at run time from `mb_at` (device
    // memory, e.g. graphed_pass_ctx.step_microbatch_index) when it is not
    // NULL, else it is `mb_host`. Backward is the same call on the grad.
    virtual int dropout(graphed_stream s, uint32_t dt, const void* x, void* y, size_t n, float p, uint64_t seed,
                        uint32_t mb_host, const uint32_t* mb_at) = 0;
    // The optimizer of a whole-iteration step (f32): SGD with momentum
    // whose learning rate and momentum are read from device memory when
    // the kernel runs (`scalars[0]` and `scalars[1]`, a step's scalar
    // block): m = mu * m + g, then w -= lr * m, each product and sum
    // rounded on its own.
    virtual int sgd_momentum(graphed_stream s, float* w, const float* g, float* m, const float* scalars,
                             size_t n) = 0;
    // Sets the uint32_t at `flag` (device memory) to 1 when an element of
    // g is not finite; leaves it alone otherwise (a loss scaler's check).
    virtual int flag_nonfinite(graphed_stream s, const float* g, size_t n, uint32_t* flag) = 0;
    // Something illegal under stream capture (a synchronize of the stream).
    virtual int illegal(graphed_stream s) = 0;
    // Other operations stream capture does not allow, as a callback may
    // meet them (tests of failed captures). Each returns 0 where the
    // operation succeeded (not under capture); where it failed, it names
    // the operation and its error with graphed_callback_fail_message and
    // returns non-zero, as a careful callback does. On the host backend
    // each is graphed_host_invalidate_capture naming the CUDA call.
    // An allocation outside the graph's pool (cudaMalloc).
    virtual int alloc_outside_pool(graphed_stream s) = 0;
    // Work forked onto a stream the capture does not know (side_stream(),
    // after waiting for `s`), never joined back: careless, it returns 0,
    // and the capture's end reports it.
    virtual int unjoined_work(graphed_stream s) = 0;
    // A CUDA library call that cannot be captured (a synchronous
    // cudaMemcpy to the host, as a library's setup issues).
    virtual int uncapturable_call(graphed_stream s) = 0;
    // Copy on a stream.
    virtual int copy(graphed_stream s, void* dst, const void* src, size_t bytes) = 0;
};

// The device of a backend, or nullptr with the reason it is unavailable.
std::unique_ptr<Device> make_device(Backend b, std::string* why_not);
std::unique_ptr<Device> make_host_device();
std::unique_ptr<Device> make_cuda_device(std::string* why_not);

// A device buffer that frees itself.
class Buffer {
  public:
    Buffer() = default;
    Buffer(Device& d, size_t bytes) : dev_(&d), bytes_(bytes), ptr_(d.alloc(bytes)) {}
    Buffer(const Buffer&) = delete;
    Buffer& operator=(const Buffer&) = delete;
    Buffer(Buffer&& o) noexcept : dev_(o.dev_), bytes_(o.bytes_), ptr_(o.ptr_) { o.ptr_ = nullptr; }
    Buffer& operator=(Buffer&& o) noexcept {
        if (this != &o) {
            reset();
            dev_ = o.dev_;
            bytes_ = o.bytes_;
            ptr_ = o.ptr_;
            o.ptr_ = nullptr;
        }
        return *this;
    }
    ~Buffer() { reset(); }
    void reset() {
        if (ptr_) dev_->release(ptr_);
        ptr_ = nullptr;
    }
    void* get() const { return ptr_; }
    float* f32() const { return static_cast<float*>(ptr_); }
    size_t bytes() const { return bytes_; }

  private:
    Device* dev_ = nullptr;
    size_t bytes_ = 0;
    void* ptr_ = nullptr;
};

// Host copies of device data.
template <class T>
std::vector<T> fetch(Device& d, const void* src, size_t count) {
    std::vector<T> v(count);
    d.download(v.data(), src, count * sizeof(T));
    return v;
}

// Deterministic pseudo-random floats in [-scale, scale).
std::vector<float> random_floats(size_t n, uint32_t seed, float scale = 1.0f);

// `values` as raw elements of `dtype` (f32, f16 or bf16), rounded to nearest even.
std::vector<uint8_t> to_dtype(const std::vector<float>& values, uint32_t dtype);
// Raw elements of `dtype` back to floats.
std::vector<float> from_dtype(const std::vector<uint8_t>& bytes, uint32_t dtype);

}  // namespace kit
