// The whole-iteration table of graphed_bench (optimizer_bench.cpp).
#pragma once

#include "tools.hpp"

#include <ostream>

namespace bench {

// Writes section 5's second table to `report`: one training iteration of
// `layers` Linear(`width`) + ReLU layers and the squared-error loss, batch
// `batch`, fp32, with the kit's SGD with momentum, as a graphed step with
// the update inside against the same step followed by the update launched
// eagerly and against one graph hand-captured around the same kernels.
// GPU time: `rounds` interleaved rounds of `samples` iterations per
// variant; host time: the median of `samples` calls. Returns the number
// of failed correctness checks.
int optimizer_table(kit::Device& dev, Tools& tools, std::ostream& report, int layers, int width, int batch,
                    int rounds, int samples);

}  // namespace bench
