// Assertions on graphed's answers for GoogleTest: a status together with a
// distinctive part of the library's message, from a C call or from a C++
// call that throws graphed::Error, and the figures of a session's stats for
// "nothing else changed" comparisons.
#pragma once

#include <graphed.hpp>
#include <gtest/gtest.h>

#include <string>
#include <vector>
#include <utility>

inline std::string last_error() { return graphed_last_error_message(); }

// Success when `got` is `expected` and this thread's last error message
// contains `text` (call it right after the call under test):
//     EXPECT_TRUE(fails_with(GRAPHED_STATUS_BUSY, graphed_session_destroy(s), "in use"));
inline ::testing::AssertionResult fails_with(graphed_status expected, graphed_status got, const std::string& text) {
    const std::string msg = last_error();
    if (got != expected)
        return ::testing::AssertionFailure() << "expected " << graphed::status_name(expected) << ", got "
                                             << graphed::status_name(got) << ": " << msg;
    if (msg.find(text) == std::string::npos)
        return ::testing::AssertionFailure() << graphed::status_name(got) << " as expected, but the message lacks \""
                                             << text << "\": " << msg;
    return ::testing::AssertionSuccess();
}

// The same for a C++ call that should throw graphed::Error.
template <class F>
::testing::AssertionResult throws(graphed_status expected, F&& f, const std::vector<std::string>& texts) {
    try {
        std::forward<F>(f)();
    } catch (const graphed::Error& e) {
        if (e.status() != expected)
            return ::testing::AssertionFailure() << "expected " << graphed::status_name(expected) << ", got "
                                                 << e.what();
        for (const std::string& text : texts)
            if (e.message().find(text) == std::string::npos)
                return ::testing::AssertionFailure() << graphed::status_name(expected)
                                                     << " as expected, but the message lacks \"" << text
                                                     << "\": " << e.message();
        return ::testing::AssertionSuccess();
    }
    return ::testing::AssertionFailure() << "expected " << graphed::status_name(expected) << ", but nothing was thrown";
}

template <class F>
::testing::AssertionResult throws(graphed_status expected, F&& f, const std::string& text) {
    return throws(expected, std::forward<F>(f), std::vector<std::string>{text});
}

// Every figure of a session's stats, for "nothing else changed" comparisons
// that print what did change.
inline std::string figures(const graphed_session_stats& s) {
    return "captured " + std::to_string(s.captured) + ", static " + std::to_string(s.static_bytes) + ", scratch " +
           std::to_string(s.scratch_bytes) + ", pool " + std::to_string(s.pool_bytes) + ", clones out " +
           std::to_string(s.clone_bytes_outstanding) + " B in " + std::to_string(s.clone_blocks_outstanding) +
           " blocks, cached " + std::to_string(s.clone_bytes_cached) + ", without reuse " +
           std::to_string(s.static_bytes_without_reuse) + ", peak " + std::to_string(s.peak_live_bytes) + ", graphs " +
           std::to_string(s.graph_count) + ", callables " + std::to_string(s.callables) + ", instances " +
           std::to_string(s.instances) + ", leases " + std::to_string(s.leases_held) + ", microbatches " +
           std::to_string(s.microbatches);
}
