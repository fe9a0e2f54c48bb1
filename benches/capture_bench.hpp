// The capture-time table of graphed_bench (capture_bench.cpp).
#pragma once

#include "tools.hpp"

#include <ostream>

namespace bench {

// Writes section 8 to `report`: capture time of `layers` Linear(`width`)
// + ReLU layers, batch `batch`, by phase, the median of `repeats` fresh
// sessions per variant, against capturing the same kernels by hand.
void capture_table(kit::Device& dev, Tools& tools, std::ostream& report, int layers, int width, int batch,
                   int repeats);

}  // namespace bench
