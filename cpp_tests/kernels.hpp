// The kernels a parameterized suite's layers run: the host backend's tasks,
// the kit's CUDA kernels, or cuBLAS GEMMs (where the build has cuBLAS); their
// names in GoogleTest's output, and the device of each. Shared by the suites
// over moved parameters and grads written in place.
#pragma once

#include "layers.hpp"
#include "tools.hpp"

#include <cstdlib>
#include <memory>
#include <ostream>
#include <string>

#include <gtest/gtest.h>

namespace graphed_test_kernels {

#ifdef GRAPHED_TESTS_CUBLAS
constexpr bool kCublasBuilt = true;
#else
constexpr bool kCublasBuilt = false;
#endif

enum class Kernels { Host, Cuda, Cublas };

inline const char* kernels_name(Kernels k) {
    switch (k) {
        case Kernels::Host: return "host";
        case Kernels::Cuda: return "cuda";
        case Kernels::Cublas: return "cuda_cublas";
    }
    return "?";
}

// For GoogleTest's messages.
inline void PrintTo(Kernels k, std::ostream* os) { *os << kernels_name(k); }

struct KernelsName {
    std::string operator()(const ::testing::TestParamInfo<Kernels>& i) const { return kernels_name(i.param); }
};

// The device of `k`; null, with the reason in `why`, where it does not come up.
inline std::unique_ptr<kit::Device> device_of(Kernels k, std::string* why) {
    switch (k) {
        case Kernels::Host: return kit::make_host_device();
        case Kernels::Cuda: return kit::make_cuda_device(why);
        case Kernels::Cublas: return bench::make_blas_device(why);
    }
    return nullptr;
}

// Whether a device of `k` that does not come up is a failure here, not a
// skip: on the GPU machine (GRAPHED_REQUIRE_CUDA=1, scripts/gpu-run.sh), for
// the CUDA kernels, and for cuBLAS where the build has it.
inline bool required(Kernels k) {
    const char* require = std::getenv("GRAPHED_REQUIRE_CUDA");
    return require && std::string(require) == "1" && (k == Kernels::Cuda || (k == Kernels::Cublas && kCublasBuilt));
}

// A suite over the kernels: SetUp makes the parameter's device, or fails
// (where it is required) or skips saying why, leaving `dev` null; a derived
// SetUp calls it first and returns when `dev` is null.
class KernelsTest : public ::testing::TestWithParam<Kernels> {
  protected:
    void SetUp() override {
        std::string why;
        dev = device_of(GetParam(), &why);
        if (dev) return;
        if (required(GetParam()))
            FAIL() << "GRAPHED_REQUIRE_CUDA=1, but the " << kernels_name(GetParam()) << " kernels are not available: "
                   << why;
        GTEST_SKIP() << "the " << kernels_name(GetParam()) << " kernels are not available: " << why;
    }

    std::unique_ptr<kit::Device> dev;
};

}  // namespace graphed_test_kernels
