// The kit's CUDA device when the build has no CUDA compiler.
#include "kit.hpp"

namespace kit {

std::unique_ptr<Device> make_cuda_device(std::string* why_not) {
    if (why_not) *why_not = "this build has no CUDA compiler, so the CUDA kit was not compiled";
    return nullptr;
}

}  // namespace kit
