// What the tables of graphed_bench share: correctness checks that are
// counted, sizes and the plan dump's reasons as the report writes them,
// host time per call, and the numbers of the torch side's JSON
// (common.cpp).
#pragma once

#include "tools.hpp"

#include <cstddef>
#include <functional>
#include <string>

namespace bench {

// The correctness checks of one table: each failure is said on stderr as
// it happens, and counted.
struct Checks {
    int failed = 0;
    void operator()(bool ok, const std::string& what);
};

// Why the session copies an input it was asked to rebind: the plan
// dump's line for it.
std::string copied_because(const graphed::Session& s);

// A size in MiB, or KiB below one MiB ("16 KiB").
std::string bytes_str(size_t b);

// Host time per call of `op`, in microseconds: median over batches.
double host_us(kit::Device& dev, const std::function<void()>& op, int per_batch, int batches);

// A number from the one-line JSON of benches/torch_reference.py (NaN when
// the key is missing).
double json_number(const std::string& text, const std::string& key);

// The whole text of the file at `path` (empty when it cannot be read).
std::string read_file(const std::string& path);

}  // namespace bench
