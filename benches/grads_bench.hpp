// The grad-return tables of graphed_bench (grads_bench.cpp).
#pragma once

#include "tools.hpp"

#include <cstddef>
#include <ostream>
#include <vector>

namespace bench {

// `n` parameter grads of `bytes` each.
struct GradSize {
    size_t n, bytes;
};

// Writes section 1 to `report` (clone on return) for each of `sizes`;
// returns the number of failed correctness checks.
int clone_table(kit::Device& dev, Tools& tools, std::ostream& report, const std::vector<GradSize>& sizes,
                int samples);

// Writes section 2 to `report` (ACCUMULATE_INTO against CLONE and an add)
// for each of `sizes`; returns the number of failed correctness checks.
int accumulate_table(kit::Device& dev, Tools& tools, std::ostream& report, const std::vector<GradSize>& sizes,
                     int samples);

}  // namespace bench
