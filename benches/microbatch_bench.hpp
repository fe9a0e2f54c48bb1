// The microbatch-step table of graphed_bench (microbatch_bench.cpp).
#pragma once

#include "tools.hpp"

#include <ostream>
#include <vector>

namespace bench {

// Writes section 11 to `report` for each microbatch count in `counts`;
// returns the number of failed correctness checks.
int microbatch_table(kit::Device& dev, Tools& tools, std::ostream& report, int layers, int width, int batch,
                     const std::vector<uint32_t>& counts, int samples);

}  // namespace bench
