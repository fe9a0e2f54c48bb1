// The kit's dropout mask: one hash of (seed, microbatch, element) that the
// host device and the CUDA kernels evaluate identically, so that a graphed
// step over microbatches can be compared with eager accumulation bit for
// bit, each microbatch drawing its own mask as eager's would.
#pragma once

#include <cstddef>
#include <cstdint>

#ifdef __CUDACC__
#define KIT_HD __host__ __device__ __forceinline__
#else
#define KIT_HD inline
#endif

namespace kit {

// Whether element `i` of microbatch `mb` survives dropout with
// probability `p` of being zeroed (splitmix64 of the three, then the top
// 24 bits as a uniform in [0, 1)).
KIT_HD bool dropout_keeps(uint64_t seed, uint32_t mb, size_t i, float p) {
    uint64_t x = seed + 0x9E3779B97F4A7C15ull * (uint64_t(mb) + 1) + 0xD1B54A32D192ED03ull * uint64_t(i);
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    x ^= x >> 31;
    return float(x >> 40) * (1.0f / 16777216.0f) >= p;
}

}  // namespace kit
