// API contract tests that need no GPU: version, status names, the last-error
// message, invalid arguments, and the answer on machines without a driver.
#include <graphed.h>

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <thread>

namespace {

std::string last_error() { return graphed_last_error_message(); }

bool driver_present() {
    int32_t v = 0;
    return graphed_driver_version(&v) == GRAPHED_STATUS_OK;
}

TEST(Version, MatchesHeaderMacros) {
    const std::string expected = std::to_string(GRAPHED_VERSION_MAJOR) + "." +
                                 std::to_string(GRAPHED_VERSION_MINOR) + "." +
                                 std::to_string(GRAPHED_VERSION_PATCH);
    EXPECT_EQ(expected, graphed_version());
    EXPECT_STREQ(GRAPHED_VERSION_STRING, graphed_version());
}

TEST(Status, NamesAreDenseAndPrefixed) {
    for (uint32_t code = GRAPHED_STATUS_OK; code <= GRAPHED_STATUS_INTERNAL; ++code) {
        const std::string name = graphed_status_name(code);
        EXPECT_EQ(0u, name.rfind("GRAPHED_STATUS_", 0)) << code;
        EXPECT_NE("GRAPHED_STATUS_UNKNOWN", name) << code;
    }
    EXPECT_STREQ("GRAPHED_STATUS_OK", graphed_status_name(GRAPHED_STATUS_OK));
    EXPECT_STREQ("GRAPHED_STATUS_NULL_POINTER", graphed_status_name(GRAPHED_STATUS_NULL_POINTER));
    EXPECT_STREQ("GRAPHED_STATUS_ALIAS_HELD", graphed_status_name(GRAPHED_STATUS_ALIAS_HELD));
    EXPECT_STREQ("GRAPHED_STATUS_INTERNAL", graphed_status_name(GRAPHED_STATUS_INTERNAL));
}

TEST(Status, UnknownCodesHaveAnAnswer) {
    EXPECT_STREQ("GRAPHED_STATUS_UNKNOWN", graphed_status_name(GRAPHED_STATUS_INTERNAL + 1));
    EXPECT_STREQ("GRAPHED_STATUS_UNKNOWN", graphed_status_name(0xFFFFFFFFu));
}

TEST(Errors, NullOutputPointersAreRejectedWithAMessage) {
    EXPECT_EQ(GRAPHED_STATUS_NULL_POINTER, graphed_device_count(nullptr));
    EXPECT_NE(std::string::npos, last_error().find("graphed_device_count: count_out must not be NULL"))
        << last_error();
    EXPECT_EQ(GRAPHED_STATUS_NULL_POINTER, graphed_driver_version(nullptr));
    EXPECT_NE(std::string::npos, last_error().find("graphed_driver_version: version_out must not be NULL"))
        << last_error();
}

TEST(Errors, LastErrorIsPerThread) {
    EXPECT_EQ(GRAPHED_STATUS_NULL_POINTER, graphed_device_count(nullptr));
    ASSERT_FALSE(last_error().empty());
    std::string other;
    std::thread t([&] { other = graphed_last_error_message(); });
    t.join();
    EXPECT_EQ("", other) << "a fresh thread must not see another thread's message";
}

TEST(Device, NoDriverIsAClearAnswer) {
    if (driver_present()) {
        GTEST_SKIP() << "this machine has a CUDA driver; the no-driver answer is checked on machines without one";
    }
    uint32_t count = 12345;
    EXPECT_EQ(GRAPHED_STATUS_NO_DRIVER, graphed_device_count(&count));
    EXPECT_EQ(12345u, count) << "outputs are written only on success";
    EXPECT_NE(std::string::npos, last_error().find("libcuda")) << last_error();
    int32_t version = -7;
    EXPECT_EQ(GRAPHED_STATUS_NO_DRIVER, graphed_driver_version(&version));
    EXPECT_EQ(-7, version);
}

TEST(Device, CountOnAMachineWithADriver) {
    if (!driver_present()) {
        GTEST_SKIP() << "no CUDA driver on this machine: " << last_error();
    }
    uint32_t count = 0;
    graphed_status s = graphed_device_count(&count);
    if (s == GRAPHED_STATUS_NO_DEVICE) {
        EXPECT_FALSE(last_error().empty());
        GTEST_SKIP() << "driver present but no device: " << last_error();
    }
    ASSERT_EQ(GRAPHED_STATUS_OK, s) << last_error();
    EXPECT_GE(count, 1u);
}

}  // namespace
