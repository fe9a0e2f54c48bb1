// Test support: status assertions with graphed's message, RAII session
// handles, and the backend-parameterized fixture (the CUDA instance skips,
// with the reason, where there is no GPU or no CUDA build).
#pragma once

#include <graphed.h>
#include <gtest/gtest.h>

#include "kit.hpp"

#include <memory>
#include <string>

#define GRAPHED_ASSERT_OK(expr)                                                                   \
    do {                                                                                          \
        graphed_status graphed_s_ = (expr);                                                       \
        ASSERT_EQ(GRAPHED_STATUS_OK, graphed_s_)                                                  \
            << #expr << " -> " << graphed_status_name(graphed_s_) << ": " << graphed_last_error_message(); \
    } while (0)

#define GRAPHED_EXPECT_STATUS(expected, expr)                                                     \
    do {                                                                                          \
        graphed_status graphed_s_ = (expr);                                                       \
        EXPECT_EQ(expected, graphed_s_) << #expr << " -> " << graphed_status_name(graphed_s_) << ": " \
                                        << graphed_last_error_message();                          \
    } while (0)

inline std::string last_error() { return graphed_last_error_message(); }

struct SessionDeleter {
    void operator()(graphed_session* s) const { graphed_session_destroy(s); }
};
using SessionPtr = std::unique_ptr<graphed_session, SessionDeleter>;

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
        if (!dev) GTEST_SKIP() << "the " << kit::backend_name(GetParam()) << " backend is not available: " << why;
    }

    graphed_session_config config() const {
        graphed_session_config c = graphed_session_config_default();
        c.backend = dev->graphed_kind();
        return c;
    }

    SessionPtr create(const graphed_session_config& c) {
        graphed_session* s = nullptr;
        graphed_status st = graphed_session_create(&c, &s);
        EXPECT_EQ(GRAPHED_STATUS_OK, st) << graphed_last_error_message();
        return SessionPtr(s);
    }

    graphed_session_stats stats(graphed_session* s) {
        graphed_session_stats st = graphed_session_stats_default();
        EXPECT_EQ(GRAPHED_STATUS_OK, graphed_session_stats_get(s, &st)) << graphed_last_error_message();
        return st;
    }

    std::unique_ptr<kit::Device> dev;
};

#define GRAPHED_BACKENDS(Suite) \
    INSTANTIATE_TEST_SUITE_P(Backends, Suite, ::testing::Values(kit::Backend::Host, kit::Backend::Cuda), BackendName())
