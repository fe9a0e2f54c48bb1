// The memory table of graphed_bench (memory_bench.cpp).
#pragma once

#include "tools.hpp"

#include <ostream>
#include <string>
#include <vector>

namespace bench {

// Writes section 6 to `report`: the static and scratch bytes of N
// Linear(`width`) + ReLU layers, batch `batch`, for each N of
// `layer_counts`, and torch's figure from `torch_json` (empty: none).
void memory_table(kit::Device& dev, std::ostream& report, const std::vector<int>& layer_counts, int width, int batch,
                  const std::string& torch_json);

}  // namespace bench
