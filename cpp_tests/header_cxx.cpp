// The public header alone, compiled as C++17 with warnings as errors and
// included twice (the include guard must hold).
#include "graphed.h"
#include "graphed.h"

#include <cstdio>
#include <cstring>
#include <type_traits>

static_assert(std::is_same<std::underlying_type<graphed_status>::type, uint32_t>::value,
              "graphed_status must be a 32-bit enum in C++");

int main() {
    if (std::strcmp(graphed_version(), GRAPHED_VERSION_STRING) != 0) {
        std::fprintf(stderr, "version mismatch: %s vs %s\n", graphed_version(), GRAPHED_VERSION_STRING);
        return 1;
    }
    graphed_status s = graphed_driver_version(nullptr);
    if (s != GRAPHED_STATUS_NULL_POINTER) {
        std::fprintf(stderr, "graphed_driver_version(nullptr) returned %s\n", graphed_status_name(s));
        return 1;
    }
    std::printf("graphed %s (C++17): %s\n", graphed_version(), graphed_last_error_message());
    return 0;
}
