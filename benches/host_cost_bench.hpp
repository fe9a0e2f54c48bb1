// The host-cost table of graphed_bench (host_cost_bench.cpp).
#pragma once

#include "tools.hpp"

#include <ostream>

namespace bench {

// Writes section 3 to `report`: host time of a forward and backward
// replay (ALIAS, CLONE from a clone slot, CLONE copied) against raw graph
// launches of the same kernels, medians over batches of `per_batch`.
void host_cost_table(kit::Device& dev, Tools& tools, std::ostream& report, int per_batch);

}  // namespace bench
