// The input-rebinding table of graphed_bench (rebind_bench.cpp).
#pragma once

#include "tools.hpp"

#include <ostream>
#include <string>

namespace bench {

// Writes a row of section 7 to `report` (and the section's heading when
// `header`): the host cost of rebinding a layer's input, with the kernels
// of `dev` named `label`, medians over batches of `per_batch`.
void rebind_table(kit::Device& dev, std::ostream& report, const std::string& label, bool header, int per_batch);

}  // namespace bench
