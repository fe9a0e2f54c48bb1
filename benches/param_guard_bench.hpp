// The moved-parameters table of graphed_bench (param_guard_bench.cpp).
#pragma once

#include "tools.hpp"

#include <cstddef>
#include <ostream>
#include <vector>

namespace bench {

// Writes section 10 to `report`: forward replays of a callable with N
// parameters, for each N of `counts`, with no addresses, the same
// addresses and moved ones; host time over batches of `per_batch`
// (about `replays` replays in all), device time over `samples`; returns
// the number of failed correctness checks.
int param_guard_table(kit::Device& dev, Tools& tools, std::ostream& report, const std::vector<size_t>& counts,
                      int per_batch, int replays, int samples);

}  // namespace bench
