// The step-graph table of graphed_bench (step_bench.cpp).
#pragma once

#include "tools.hpp"

#include <ostream>
#include <string>

namespace bench {

// Writes section 5 to `report`: a training step of `layers` Linear(`width`)
// + ReLU layers, batch `batch`, as one step graph against a hand-captured
// graph, pass-by-pass replays and torch's figure from `torch_json` (empty:
// none), `steps` steps a run; returns the number of failed correctness
// checks.
int step_table(kit::Device& dev, Tools& tools, std::ostream& report, int layers, int width, int batch, int steps,
               const std::string& torch_json);

}  // namespace bench
