// graphed for libtorch: what broke a callback. While a callback runs, an
// observer of torch's operators (RecordFunction, on every thread: backward
// ops run on autograd's device threads) notes the operators an exception
// unwinds; the innermost is the one that raised. The report names it,
// where the caller's code issued it (a finder the Python extension sets:
// the traceback's last frame outside torch and graphed) and the
// exception's first line, and goes to graphed
// (graphed_callback_fail_message), so that the capture's error carries it.
#include "internal.h"

#include <ATen/record_function.h>

#include <atomic>
#include <exception>
#include <mutex>

namespace graphed_torch {

namespace {

std::atomic<FailureSite> site_finder{nullptr};

// The operators one exception unwound, innermost first.
struct Unwound {
    std::mutex m;
    std::vector<std::string> ops;
    uint64_t last = 0;  // when the last noted operator began
};

std::atomic<Unwound*> active{nullptr};
std::atomic<uint64_t> began{0};

// When an operator began, and how many exceptions were in flight then.
struct Entered : at::ObserverContext {
    uint64_t seq = 0;
    int exceptions = 0;
};

std::unique_ptr<at::ObserverContext> on_enter(const at::RecordFunction&) {
    auto e = std::make_unique<Entered>();
    e->seq = began.fetch_add(1, std::memory_order_relaxed) + 1;
    e->exceptions = std::uncaught_exceptions();
    return e;
}

void on_exit(const at::RecordFunction& fn, at::ObserverContext* ctx) {
    auto* e = static_cast<Entered*>(ctx);
    // Left by an exception: more of them in flight than when it began.
    if (!e || std::uncaught_exceptions() <= e->exceptions) return;
    Unwound* u = active.load(std::memory_order_acquire);
    if (!u) return;
    std::lock_guard<std::mutex> g(u->m);
    // An operator that began after the last one noted is no caller of it:
    // another exception, whose chain replaces the earlier one.
    if (!u->ops.empty() && e->seq > u->last) u->ops.clear();
    if (u->ops.size() < 16) u->ops.emplace_back(fn.name());
    u->last = e->seq;
}

std::string first_line(const char* what) {
    std::string s = what ? what : "";
    const size_t nl = s.find('\n');
    return nl == std::string::npos ? s : s.substr(0, nl);
}

}  // namespace

void set_failure_site(FailureSite finder) { site_finder.store(finder); }

OperatorWatch::OperatorWatch() {
    auto* u = new Unwound();
    Unwound* none = nullptr;
    if (!active.compare_exchange_strong(none, u)) {
        delete u;  // an outer watch (or another thread's) notes them
        return;
    }
    unwound_ = u;
    handle_ = at::addGlobalCallback(at::RecordFunctionCallback(&on_enter, &on_exit)
                                        .needsInputs(false)
                                        .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
}

OperatorWatch::~OperatorWatch() {
    if (!unwound_) return;
    at::removeCallback(handle_);
    active.store(nullptr, std::memory_order_release);
    delete static_cast<Unwound*>(unwound_);
}

std::string OperatorWatch::report(const std::exception_ptr& e, const char* what) const {
    std::string op;
    if (unwound_) {
        auto* u = static_cast<Unwound*>(unwound_);
        std::lock_guard<std::mutex> g(u->m);
        if (!u->ops.empty()) {
            op = "torch operator " + u->ops.front();
            if (u->ops.size() > 1 && u->ops.back() != u->ops.front()) op += " (called by " + u->ops.back() + ")";
        }
    }
    const FailureSite finder = site_finder.load();
    const std::string site = finder ? finder(e) : std::string();
    std::string out = op;
    if (!site.empty()) out += (out.empty() ? "at " : " at ") + site;
    const std::string line = first_line(what);
    if (out.empty()) return line;
    return out + ": " + line;
}

std::string failure_report(const std::function<void()>& body) {
    OperatorWatch watch;
    try {
        body();
    } catch (const std::exception& e) {
        return watch.report(std::current_exception(), e.what());
    }
    return "";
}

}  // namespace graphed_torch
