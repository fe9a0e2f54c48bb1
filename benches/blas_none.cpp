// The cuBLAS device when the CUDA build has no cuBLAS.
#include "tools.hpp"

namespace bench {

std::unique_ptr<kit::Device> make_blas_device(std::string* why_not) {
    if (why_not) *why_not = "this build has no cuBLAS (CUDA::cublas was not found at configure time)";
    return nullptr;
}

}  // namespace bench
