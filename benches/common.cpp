// What the tables of graphed_bench share (common.hpp).
#include "common.hpp"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <vector>

namespace bench {

void Checks::operator()(bool ok, const std::string& what) {
    if (!ok) {
        std::fprintf(stderr, "CHECK FAILED: %s\n", what.c_str());
        ++failed;
    }
}

// Why the session copies an input it was asked to rebind: the plan
// dump's line for it.
std::string copied_because(const graphed::Session& s) {
    const std::string plan = s.plan_dump();
    const size_t at = plan.find("copied at replay: ");
    return at == std::string::npos ? "see the plan dump" : plan.substr(at + 18, plan.find('\n', at) - at - 18);
}

std::string bytes_str(size_t b) {
    if (b >= (1u << 20)) return fmt("%.0f MiB", b / 1048576.0);
    return fmt("%.0f KiB", b / 1024.0);
}

// Host time per call of `op`, in microseconds: median over batches.
double host_us(kit::Device& dev, const std::function<void()>& op, int per_batch, int batches) {
    std::vector<double> t;
    for (int i = 0; i < per_batch; ++i) op();
    dev.sync();
    for (int b = 0; b < batches; ++b) {
        auto a = std::chrono::steady_clock::now();
        for (int i = 0; i < per_batch; ++i) op();
        auto z = std::chrono::steady_clock::now();
        dev.sync();
        t.push_back(std::chrono::duration<double, std::micro>(z - a).count() / per_batch);
    }
    return bench::median(t);
}

// A number from the one-line JSON of benches/torch_reference.py (NaN when
// the key is missing).
double json_number(const std::string& text, const std::string& key) {
    const std::string k = "\"" + key + "\":";
    size_t at = text.find(k);
    if (at == std::string::npos) return std::nan("");
    return std::strtod(text.c_str() + at + k.size(), nullptr);
}

std::string read_file(const std::string& path) {
    std::ifstream f(path);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
}

}  // namespace bench
