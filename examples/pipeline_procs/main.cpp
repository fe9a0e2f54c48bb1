// graphed across processes, without libtorch: a two-stage pipeline of an MLP
// in two processes, one graphed session each, exchanging activations and
// grads between replays, against the same MLP trained eagerly in one
// process (every final weight bit for bit).
//
// The launcher (this program without --rank) forks the two ranks before
// anything touches CUDA, gives them a socket pair as their link, reads each
// rank's final weights from a pipe and waits for both with a time limit (a
// rank that hangs is killed and the run fails). Rank 0 holds layers 0 and 1,
// rank 1 layers 2 and 3 and the loss. Each step, rank 0 replays its forwards
// and sends its output; rank 1 replays its forwards, takes the loss grad,
// replays its backwards and sends the grad of its input back; rank 0 replays
// its backwards; both apply SGD with the parameter grads graphed returned.
// On the GPU the activations cross through host memory (a device-to-host
// copy, the socket, a host-to-device copy); NCCL or CUDA IPC would replace
// the socket, not the sessions.
//
//   pipeline_procs [--backend auto|host|cuda] [--steps N]
//                  [--fail-rank R --fail-step S] [--teardown session-first|link-first]
//
// --fail-rank makes rank R exit abruptly in step S, after receiving what
// the other rank sent: the other rank must then fail with an error naming
// its lost peer, not hang, and the launcher exits 0 when both did as
// expected. --teardown picks what each rank destroys first at the end: its
// graphed session or its link. Exit status: 0 when every check passed, 77
// when --backend cuda finds no GPU (a skip), 1 otherwise.
#include "layers.hpp"

#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

constexpr int kLayers = 4, kBatch = 16, kWidth = 32;
constexpr uint32_t kSeed = 7;
constexpr float kLr = 0.05f;
constexpr int kPeerTimeoutMs = 30000;  // a rank waits this long for the other
constexpr int kRunTimeoutS = 120;      // the launcher waits this long for both
constexpr int kSkip = 77;

struct Options {
    std::string backend = "auto";
    int steps = 4;
    int fail_rank = -1, fail_step = -1;
    bool session_first = true;
};

// ---- the link between the ranks: a socket, with a time limit on reads -------------------

class Link {
  public:
    Link(int fd, int rank) : fd_(fd), rank_(rank) {}
    Link(const Link&) = delete;
    Link& operator=(const Link&) = delete;
    ~Link() { close(); }
    void close() {
        if (fd_ >= 0) ::close(fd_);
        fd_ = -1;
    }

    void send(const void* data, size_t bytes) {
        const char* p = static_cast<const char*>(data);
        while (bytes > 0) {
            ssize_t n = ::send(fd_, p, bytes, MSG_NOSIGNAL);
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) throw std::runtime_error(who() + "cannot send to the other rank (" + std::strerror(errno) + ")");
            p += n;
            bytes -= size_t(n);
        }
    }
    void receive(void* data, size_t bytes) {
        char* p = static_cast<char*>(data);
        while (bytes > 0) {
            pollfd pfd{fd_, POLLIN, 0};
            int ready = ::poll(&pfd, 1, kPeerTimeoutMs);
            if (ready < 0 && errno == EINTR) continue;
            if (ready < 0) throw std::runtime_error(who() + "cannot wait for the other rank (" + std::strerror(errno) + ")");
            if (ready == 0)
                throw std::runtime_error(who() + "nothing from the other rank in " + std::to_string(kPeerTimeoutMs / 1000) +
                                         " s");
            ssize_t n = ::recv(fd_, p, bytes, 0);
            if (n < 0 && errno == EINTR) continue;
            if (n == 0) throw std::runtime_error(who() + "the other rank closed the link (it failed or exited)");
            if (n < 0) throw std::runtime_error(who() + "cannot receive (" + std::strerror(errno) + ")");
            p += n;
            bytes -= size_t(n);
        }
    }

  private:
    std::string who() const { return "rank " + std::to_string(rank_) + ": "; }
    int fd_;
    int rank_;
};

// ---- one rank ----------------------------------------------------------------------------

std::unique_ptr<kit::Device> device_for(const std::string& backend, std::string* why_not) {
    if (backend == "host") return kit::make_host_device();
    auto cuda = kit::make_cuda_device(why_not);
    if (cuda || backend == "cuda") return cuda;
    return kit::make_host_device();
}

// The step's data, the same in every process.
std::vector<float> step_input(int step) { return kit::random_floats(size_t(kBatch) * kWidth, 100 + step); }
std::vector<float> step_target(int step) { return kit::random_floats(size_t(kBatch) * kWidth, 200 + step); }

// What a rank reports to the launcher: its backend, then the weights and
// biases of its layers.
void report(int fd, kit::Device& dev, kit::Mlp& mlp, int first) {
    std::vector<float> all;
    all.push_back(dev.backend() == kit::Backend::Cuda ? 1.0f : 0.0f);
    for (int i = first; i < first + 2; ++i) {
        auto w = mlp.weights(i), b = mlp.biases(i);
        all.insert(all.end(), w.begin(), w.end());
        all.insert(all.end(), b.begin(), b.end());
    }
    const char* p = reinterpret_cast<const char*>(all.data());
    size_t bytes = all.size() * sizeof(float);
    while (bytes > 0) {
        ssize_t n = ::write(fd, p, bytes);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) throw std::runtime_error("cannot report to the launcher");
        p += n;
        bytes -= size_t(n);
    }
}

int run_rank(int rank, int link_fd, int report_fd, const Options& o) {
    std::string why;
    std::unique_ptr<kit::Device> dev = device_for(o.backend, &why);
    if (!dev) {
        std::fprintf(stderr, "rank %d: no GPU: %s\n", rank, why.c_str());
        return kSkip;
    }
    Link link(link_fd, rank);
    kit::Mlp mlp(*dev, kLayers, kBatch, kWidth, kSeed);  // every rank builds the same model ...
    const int first = 2 * rank;                         // ... and graphs its own two layers
    const size_t act = size_t(kBatch) * kWidth * sizeof(float);
    kit::Buffer x(*dev, act), target(*dev, act), grad(*dev, act);
    auto session = std::make_unique<graphed::Session>(graphed::session_config(dev->graphed_kind()));
    for (int i = first; i < first + 2; ++i)
        session->add_callable(mlp.layer(i).callable(x.get(), /*input_requires_grad=*/i > 0));
    session->capture();

    graphed_stream s = dev->stream();
    graphed::Replay r;
    r.stream(s);
    std::vector<graphed::Ref> outs;
    std::vector<graphed::Grads> grads(2);
    std::vector<float> host(size_t(kBatch) * kWidth);
    for (int step = 0; step < o.steps; ++step) {
        // Forwards: rank 0 from the step's data, rank 1 from what rank 0 sent.
        if (rank == 0) {
            auto xs = step_input(step);
            dev->upload(x.get(), xs.data(), act);
        } else {
            link.receive(host.data(), act);
            dev->upload(x.get(), host.data(), act);
        }
        if (rank == o.fail_rank && step == o.fail_step) {
            std::fprintf(stderr, "rank %d: failing on purpose in step %d\n", rank, step + 1);
            std::fflush(stderr);
            _exit(3);  // abruptly: no teardown, the link closes with the process
        }
        const void* in = x.get();
        for (int i = first; i < first + 2; ++i) {
            session->forward(r.callable(uint32_t(i - first)).data(in), outs);
            in = outs[0].ptr();
        }
        // The grad of this stage's output: the loss's on rank 1, rank 1's on rank 0.
        if (rank == 0) {
            dev->download(host.data(), in, act);
            link.send(host.data(), act);
            link.receive(host.data(), act);
            dev->upload(grad.get(), host.data(), act);
        } else {
            auto ts = step_target(step);
            dev->upload(target.get(), ts.data(), act);
            dev->sub(s, static_cast<const float*>(in), target.f32(), grad.f32(), size_t(kBatch) * kWidth);
        }
        const void* g = grad.get();
        for (int i = first + 1; i >= first; --i) {
            session->backward(r.callable(uint32_t(i - first)).data(g), grads[i - first]);
            g = grads[i - first].inputs.empty() ? nullptr : grads[i - first].inputs[0].ptr();
        }
        if (rank == 1) {
            dev->download(host.data(), g, act);
            link.send(host.data(), act);
        }
        for (int i = first; i < first + 2; ++i) {
            kit::LinearLayer& l = mlp.layer(i);
            graphed::Grads& gr = grads[i - first];
            dev->sgd(s, static_cast<float*>(l.w), static_cast<const float*>(gr.params[0].ptr()), kLr,
                     gr.params[0].bytes() / sizeof(float));
            dev->sgd(s, static_cast<float*>(l.b), static_cast<const float*>(gr.params[1].ptr()), kLr,
                     gr.params[1].bytes() / sizeof(float));
            for (auto& p : gr.params) p.release();
        }
        dev->sync();
    }
    // Teardown in the order asked for: graphed's session and the link are
    // independent, so either order must work.
    if (o.session_first) {
        session.reset();
        link.close();
    } else {
        link.close();
        session.reset();
    }
    report(report_fd, *dev, mlp, first);
    return 0;
}

// ---- the launcher --------------------------------------------------------------------------

struct Child {
    pid_t pid = -1;
    int report_fd = -1;
    std::vector<char> report;
    bool eof = false;
    int status = -1;  // exit code; -1 while running; 128 + signal when killed
};

bool collect(std::vector<Child>& ranks) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(kRunTimeoutS);
    for (;;) {
        bool running = false;
        for (Child& c : ranks) {
            if (!c.eof) {
                pollfd pfd{c.report_fd, POLLIN, 0};
                if (::poll(&pfd, 1, 10) > 0) {
                    char buf[65536];
                    ssize_t n = ::read(c.report_fd, buf, sizeof buf);
                    if (n > 0) c.report.insert(c.report.end(), buf, buf + n);
                    if (n == 0) c.eof = true;
                }
            }
            if (c.status < 0) {
                int st = 0;
                if (::waitpid(c.pid, &st, WNOHANG) == c.pid)
                    c.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
            }
            running = running || c.status < 0 || !c.eof;
        }
        if (!running) return true;
        if (std::chrono::steady_clock::now() > deadline) {
            for (Child& c : ranks)
                if (c.status < 0) {
                    ::kill(c.pid, SIGKILL);
                    int st = 0;
                    ::waitpid(c.pid, &st, 0);
                    c.status = 128 + SIGKILL;
                }
            return false;
        }
    }
}

// Kills and reaps the ranks already started (a launch that failed halfway).
void abort_ranks(std::vector<Child>& ranks) {
    for (Child& c : ranks)
        if (c.pid > 0) {
            ::kill(c.pid, SIGKILL);
            int st = 0;
            ::waitpid(c.pid, &st, 0);
            ::close(c.report_fd);
        }
}

int launch(const Options& o) {
    int link[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM, 0, link) != 0) {
        std::perror("socketpair");
        return 1;
    }
    std::fflush(stdout);
    std::vector<Child> ranks(2);
    for (int rank = 0; rank < 2; ++rank) {
        int pipe_fd[2];
        if (::pipe(pipe_fd) != 0) {
            std::perror("pipe");
            abort_ranks(ranks);
            return 1;
        }
        pid_t pid = ::fork();
        if (pid < 0) {
            std::perror("fork");
            ::close(pipe_fd[0]);
            ::close(pipe_fd[1]);
            abort_ranks(ranks);
            return 1;
        }
        if (pid == 0) {
            ::close(pipe_fd[0]);
            ::close(link[1 - rank]);
            for (int k = 0; k < rank; ++k) ::close(ranks[k].report_fd);
            int code = 1;
            try {
                code = run_rank(rank, link[rank], pipe_fd[1], o);
            } catch (const std::exception& e) {
                std::fprintf(stderr, "%s\n", e.what());
                code = 2;
            }
            std::fflush(stdout);
            std::fflush(stderr);
            _exit(code);
        }
        ::close(pipe_fd[1]);
        ranks[rank].pid = pid;
        ranks[rank].report_fd = pipe_fd[0];
    }
    ::close(link[0]);
    ::close(link[1]);
    const bool finished = collect(ranks);
    for (Child& c : ranks) ::close(c.report_fd);
    std::printf("rank 0 exited with %d, rank 1 with %d%s\n", ranks[0].status, ranks[1].status,
                finished ? "" : " (killed: the run passed its time limit)");
    if (!finished) return 1;

    if (ranks[0].status == kSkip || ranks[1].status == kSkip) {
        std::printf("skipped: no GPU for --backend cuda\n");
        return kSkip;
    }
    if (o.fail_rank >= 0) {
        // The failing rank exits with 3; the other must fail with an error
        // (2), not hang and not succeed.
        const int other = 1 - o.fail_rank;
        const bool ok = ranks[o.fail_rank].status == 3 && ranks[other].status == 2;
        std::printf("rank %d failed in step %d; rank %d %s\n", o.fail_rank, o.fail_step + 1, other,
                    ok ? "stopped with an error, as it must" : "did NOT stop with an error");
        return ok ? 0 : 1;
    }
    if (ranks[0].status != 0 || ranks[1].status != 0) return 1;

    // The reference: the same MLP and steps, eagerly, in this process (the
    // ranks are gone, so CUDA may start here).
    const bool cuda = !ranks[0].report.empty() && reinterpret_cast<const float*>(ranks[0].report.data())[0] == 1.0f;
    std::string why;
    std::unique_ptr<kit::Device> dev = cuda ? kit::make_cuda_device(&why) : kit::make_host_device();
    if (!dev) {
        std::printf("the ranks ran on CUDA but the launcher has no GPU: %s\n", why.c_str());
        return 1;
    }
    kit::Mlp eager(*dev, kLayers, kBatch, kWidth, kSeed);
    const size_t act = size_t(kBatch) * kWidth * sizeof(float);
    kit::Buffer x(*dev, act), t(*dev, act);
    for (int step = 0; step < o.steps; ++step) {
        auto xs = step_input(step), ts = step_target(step);
        dev->upload(x.get(), xs.data(), act);
        dev->upload(t.get(), ts.data(), act);
        eager.eager_step(x.f32(), t.f32(), kLr, /*keep=*/false);
    }
    dev->sync();
    bool same = true;
    for (int rank = 0; rank < 2; ++rank) {
        std::vector<float> want;
        want.push_back(cuda ? 1.0f : 0.0f);
        for (int i = 2 * rank; i < 2 * rank + 2; ++i) {
            auto w = eager.weights(i), b = eager.biases(i);
            want.insert(want.end(), w.begin(), w.end());
            want.insert(want.end(), b.begin(), b.end());
        }
        const std::vector<char>& got = ranks[rank].report;
        const bool equal = got.size() == want.size() * sizeof(float) &&
                           std::memcmp(got.data(), want.data(), got.size()) == 0;
        std::printf("rank %d: layers %d and %d after %d steps, bit for bit equal to one process trained eagerly: %s\n",
                    rank, 2 * rank, 2 * rank + 1, o.steps, equal ? "yes" : "NO");
        same = same && equal;
    }
    std::printf("backend: %s\n", cuda ? "cuda (activations through host memory)" : "host");
    return same ? 0 : 1;
}

bool parse(int argc, char** argv, Options& o) {
    for (int i = 1; i < argc; ++i) {
        std::string a = argv[i];
        auto value = [&]() -> std::string {
            if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
            return argv[++i];
        };
        if (a == "--backend") {
            o.backend = value();
            if (o.backend != "auto" && o.backend != "host" && o.backend != "cuda")
                throw std::invalid_argument("--backend is auto, host or cuda");
        } else if (a == "--steps") {
            o.steps = std::stoi(value());
        } else if (a == "--fail-rank") {
            o.fail_rank = std::stoi(value());
        } else if (a == "--fail-step") {
            o.fail_step = std::stoi(value()) - 1;
        } else if (a == "--teardown") {
            std::string t = value();
            if (t != "session-first" && t != "link-first")
                throw std::invalid_argument("--teardown is session-first or link-first");
            o.session_first = t == "session-first";
        } else {
            throw std::invalid_argument("unknown argument " + a);
        }
    }
    if (o.steps < 1) throw std::invalid_argument("--steps must be at least 1");
    if ((o.fail_rank >= 0) != (o.fail_step >= 0)) throw std::invalid_argument("--fail-rank needs --fail-step");
    if (o.fail_rank > 1 || (o.fail_rank >= 0 && o.fail_step >= o.steps))
        throw std::invalid_argument("--fail-rank is 0 or 1, --fail-step one of the steps");
    return true;
}

}  // namespace

int main(int argc, char** argv) {
    Options o;
    try {
        parse(argc, argv, o);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "pipeline_procs: %s\n", e.what());
        return 1;
    }
    return launch(o);
}
