// The end-to-end MLP table of graphed_bench (mlp_bench.cpp).
#pragma once

#include "tools.hpp"

#include <cstdint>
#include <ostream>
#include <vector>

namespace bench {

struct MlpConfig {
    int width, batch;
    uint32_t dtype;
    int layers;
};

// Writes section 4 to `report`: a training step of each MLP of `configs`,
// eager against graphed (CLONE copying, CLONE zero-copy, ALIAS zero-copy),
// `steps` steps a run; returns the number of failed correctness checks.
int mlp_table(kit::Device& dev, Tools& tools, std::ostream& report, const std::vector<MlpConfig>& configs,
              int steps);

}  // namespace bench
