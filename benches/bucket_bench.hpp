// The buckets table of graphed_bench (bucket_bench.cpp).
#pragma once

#include "tools.hpp"

#include <cstdint>
#include <ostream>
#include <vector>

namespace bench {

// Writes section 12 to `report`: `layers` Linear(`width`) layers whose
// batch takes `sizes` (ascending), a training step of `actual` rows timed
// over `samples`; returns the number of failed correctness checks.
int bucket_table(kit::Device& dev, Tools& tools, std::ostream& report, int layers, int width,
                 const std::vector<uint64_t>& sizes, uint64_t actual, int samples);

}  // namespace bench
