// Benchmark tools when the build has no CUDA compiler.
#include "tools.hpp"

namespace bench {

std::unique_ptr<Tools> make_cuda_tools(kit::Device&) { return nullptr; }

std::unique_ptr<kit::Device> make_blas_device(std::string* why_not) {
    if (why_not) *why_not = "this build has no CUDA compiler";
    return nullptr;
}

}  // namespace bench
