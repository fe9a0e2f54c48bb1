// Test support: the backend-parameterized fixture (the CUDA instance skips,
// with the reason, where there is no GPU or no CUDA build). Sessions,
// descriptors and returned grads come from graphed.hpp; a call expected to
// succeed goes through graphed::check (or the C++ layer), whose
// graphed::Error fails the test with the status and the message; expected
// failures are checked with expect.hpp.
#pragma once

#include "expect.hpp"
#include "kit.hpp"

#include <cstdlib>
#include <memory>
#include <string>

// The backends every parameterized suite runs on.
inline auto backends() { return ::testing::Values(kit::Backend::Host, kit::Backend::Cuda); }

struct BackendName {
    std::string operator()(const ::testing::TestParamInfo<kit::Backend>& i) const {
        return kit::backend_name(i.param);
    }
};

// A fixture over both backends: `dev` is the device under test.
class BackendTest : public ::testing::TestWithParam<kit::Backend> {
  protected:
    void SetUp() override {
        std::string why;
        dev = kit::make_device(GetParam(), &why);
        if (!dev) {
            // On the GPU machine (scripts/gpu-run.sh) a CUDA backend that
            // does not come up is a failure, not a skip.
            const char* require = std::getenv("GRAPHED_REQUIRE_CUDA");
            if (GetParam() == kit::Backend::Cuda && require && std::string(require) == "1")
                FAIL() << "GRAPHED_REQUIRE_CUDA=1, but the cuda backend is not available: " << why;
            GTEST_SKIP() << "the " << kit::backend_name(GetParam()) << " backend is not available: " << why;
        }
    }

    graphed_session_config config() const { return graphed::session_config(dev->graphed_kind()); }

    std::unique_ptr<kit::Device> dev;
};
