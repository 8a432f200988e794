#include "engine/launch/launcher.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/sysinfo.h>
#include <sys/wait.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <fstream>
#include <deque>
#include <regex>
#include <utility>
#include <filesystem>

#include <fmt/format.h>

#include "engine/error.h"
#include "engine/launch/binding.h"
#include "engine/memory.h"
#include "engine/memory_budget.h"
#include "engine/memory_tracker.h"

namespace zeal {
namespace {

using Clock = std::chrono::steady_clock;

int g_signal_pipe[2] = {-1, -1};

void on_signal(int sig) {
  const int saved = errno;
  const unsigned char b = static_cast<unsigned char>(sig);
  [[maybe_unused]] ssize_t n = write(g_signal_pipe[1], &b, 1);
  errno = saved;
}

void write_all(int fd, const std::string& s) {
  size_t off = 0;
  while (off < s.size()) {
    const ssize_t n = write(fd, s.data() + off, s.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    off += static_cast<size_t>(n);
  }
}

struct Stream {
  int fd = -1;     // read end of the rank's pipe, -1 once closed
  int out_fd = 1;  // where its lines go
  std::string partial;
};

struct Rank {
  int local = 0, global = 0;
  pid_t pid = -1;
  bool running = false;
  int status = 0;  // waitpid status once exited
  int64_t max_rss = 0;  // the kernel's peak resident set of the rank's process, once exited (bytes)
  // The most VmHWM read from /proc while it ran: a program may reset its own high-water mark
  // (/proc/self/clear_refs, as zeal's memory tracker does per phase), which ru_maxrss then misses.
  int64_t polled_peak = 0;
  int64_t last_rss = 0;  // VmRSS at the last sample while it ran
  std::string oom;       // how the kernel's out-of-memory killer ended it, when it did
  std::string last_error_line;  // the first line of its last message on stderr
  Stream out, err;
  std::deque<std::string> tail;
};

std::string describe_status(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with status {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    return fmt::format("was killed by signal {} ({}){}", sig, sigabbrev_np(sig) ? sigabbrev_np(sig) : "?",
                       WCOREDUMP(status) ? ", core dumped" : "");
  }
  return "ended";
}

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

bool failed(int status) { return !(WIFEXITED(status) && WEXITSTATUS(status) == 0); }

// Finds `program` the way execvp would, for an error before anything starts.
bool program_exists(const std::string& program) {
  if (program.find('/') != std::string::npos) return access(program.c_str(), X_OK) == 0;
  const char* path = std::getenv("PATH");
  std::string p = path ? path : "/usr/bin:/bin";
  size_t start = 0;
  while (start <= p.size()) {
    size_t end = p.find(':', start);
    if (end == std::string::npos) end = p.size();
    std::string dir = p.substr(start, end - start);
    if (dir.empty()) dir = ".";
    if (access((dir + "/" + program).c_str(), X_OK) == 0) return true;
    start = end + 1;
  }
  return false;
}

// Whether the kernel's out-of-memory killer ended a process: its log (/dev/kmsg, readable by
// root) names the pid; without the log, the memory cgroup's OOM-kill count rising says so.
class OomWatch {
 public:
  OomWatch() : kills_(cgroup_oom_kills()) {
    kmsg_ = open("/dev/kmsg", O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (kmsg_ >= 0) lseek(kmsg_, 0, SEEK_END);  // only what happens from now on
  }
  ~OomWatch() {
    if (kmsg_ >= 0) close(kmsg_);
  }
  OomWatch(const OomWatch&) = delete;
  OomWatch& operator=(const OomWatch&) = delete;

  // For a process that died of SIGKILL: the words for it when the OOM killer sent the signal, else "".
  std::string explain(pid_t pid, int64_t last_rss, int64_t peak) {
    bool named = false;
    // The kernel's record may come a moment after the exit.
    for (int tries = 0; kmsg_ >= 0 && tries < 10 && !(named = logged(pid)); ++tries) usleep(20'000);
    // Without the kernel's log, the cgroup's count: one new kill explains one rank.
    const int64_t kills = cgroup_oom_kills();
    const bool counted = kmsg_ < 0 && kills_ >= 0 && kills > kills_;
    if (counted) ++kills_;
    if (!named && !counted) return {};
    return fmt::format("was killed by the kernel's out-of-memory killer (SIGKILL; {}); it held {} at the last sample, "
                       "{} at most",
                       named ? "the kernel log names its pid" : "the memory cgroup counted an OOM kill",
                       format_bytes(static_cast<double>(last_rss)), format_bytes(static_cast<double>(peak)));
  }

 private:
  bool logged(pid_t pid) {
    char rec[8192];
    for (;;) {
      const ssize_t n = read(kmsg_, rec, sizeof rec - 1);
      if (n < 0 && errno == EPIPE) continue;  // records overwritten while unread
      if (n <= 0) break;
      rec[n] = 0;
      const std::string r(rec);
      if (r.find("Killed process") != std::string::npos || r.find("oom-kill") != std::string::npos) oom_lines_ += r;
    }
    return oom_lines_.find(fmt::format("Killed process {} ", pid)) != std::string::npos ||
           oom_lines_.find(fmt::format(",pid={},", pid)) != std::string::npos;
  }

  int kmsg_ = -1;
  int64_t kills_ = -1;
  std::string oom_lines_;
};

int attempt_port(const LaunchOptions& o, int restart) { return o.master_port + (o.nnodes > 1 ? restart : 0); }

class Group {
 public:
  // previous_pids: the ranks of the attempt before this one (their swap files may be left).
  Group(const LaunchOptions& o, int restart, std::string previous_pids)
      : o_(o), restart_(restart), previous_pids_(std::move(previous_pids)) {}

  std::string pids() const {
    std::string s;
    for (const auto& r : ranks_) {
      if (r.pid > 0) s += (s.empty() ? "" : ",") + std::to_string(r.pid);
    }
    return s;
  }

  // How the attempt ended, for the restart decision.
  bool interrupted() const { return interrupted_by_ != 0; }
  bool rank_failed() const { return first_failure_ >= 0; }
  // A program's own failure (it exited non-zero) as its status and last line on stderr: equal for
  // two attempts that failed the same way. Empty for a rank ended by a signal (killed, crashed):
  // such a failure may be the machine's, not the program's, and is retried.
  std::string failure_signature() const {
    if (first_failure_ < 0) return {};
    const Rank& r = ranks_[first_failure_];
    if (!WIFEXITED(r.status)) return {};
    // Any rank may be the first to fail a bad config: rank numbers in the line do not count.
    // Nor sequence numbers (collective #1234), which count from the process's start and differ
    // after a resume.
    static const std::regex rank_number(R"(\brank \d+)"), sequence(R"(#\d+)");
    return fmt::format("{}|{}", WEXITSTATUS(r.status),
                       std::regex_replace(std::regex_replace(r.last_error_line, rank_number, "rank #"), sequence, "#"));
  }
  std::string failure_summary() const {
    if (first_failure_ < 0) return {};
    const Rank& r = ranks_[first_failure_];
    return fmt::format("rank {} {}", r.global, r.oom.empty() ? describe_status(r.status) : r.oom);
  }
  double seconds() const { return std::chrono::duration<double>(Clock::now() - started_).count(); }

  int run() {
    // Signals are caught before the first rank starts: a SIGTERM while ranks are still being
    // started reaches the ones already running instead of orphaning them.
    install_handlers();
    start_all();
    loop();
    return finish();
  }

 private:
  void start_all() {
    const int world = o_.nnodes * o_.nproc_per_node;
    std::vector<CpuBinding> binding;
    if (o_.bind) binding = plan_cpu_binding(o_.nproc_per_node);
    std::string config_abs;
    if (!o_.config_file.empty()) config_abs = std::filesystem::absolute(o_.config_file).string();
    if (o_.verbose) {
      std::fprintf(stderr, "zeal launch: node %d of %d, %d processes here, world size %d, master %s:%d\n",
                   o_.node_rank, o_.nnodes, o_.nproc_per_node, world, o_.master_addr.c_str(), port());
    }
    ranks_.resize(o_.nproc_per_node);
    for (int l = 0; l < o_.nproc_per_node; ++l) {
      Rank& r = ranks_[l];
      r.local = l;
      r.global = o_.node_rank * o_.nproc_per_node + l;
      std::map<std::string, std::string> env = o_.env;
      env["RANK"] = std::to_string(r.global);
      env["LOCAL_RANK"] = std::to_string(l);
      env["WORLD_SIZE"] = std::to_string(world);
      env["LOCAL_WORLD_SIZE"] = std::to_string(o_.nproc_per_node);
      env["NODE_RANK"] = std::to_string(o_.node_rank);
      env["GROUP_RANK"] = std::to_string(o_.node_rank);
      env["MASTER_ADDR"] = o_.master_addr;
      env["MASTER_PORT"] = std::to_string(port());
      env["ZEAL_LAUNCH"] = "1";
      env["ZEAL_RESTART_COUNT"] = std::to_string(restart_);
      env["TORCHELASTIC_RESTART_COUNT"] = std::to_string(restart_);
      env["TORCHELASTIC_MAX_RESTARTS"] = std::to_string(o_.max_restarts);
      if (!previous_pids_.empty()) env["ZEAL_PREVIOUS_ATTEMPT_PIDS"] = previous_pids_;
      // The ranks' output reaches a terminal through this process: a progress bar may redraw.
      if (terminal_) env["ZEAL_TERMINAL"] = "1";
      env["PYTHONUNBUFFERED"] = "1";
      if (!config_abs.empty()) env["ZEAL_CONFIG_FILE"] = config_abs;
      const CpuBinding* b = l < static_cast<int>(binding.size()) ? &binding[l] : nullptr;
      if (b) {
        env["ZEAL_CPU_BIND"] = format_cpu_list(b->cpus);
        if (!std::getenv("OMP_NUM_THREADS")) env["OMP_NUM_THREADS"] = std::to_string(b->cpus.size());
      }
      if (o_.verbose) {
        std::fprintf(stderr, "zeal launch: rank %d (local %d): %s\n", r.global, l,
                     b ? b->describe().c_str() : "not bound");
      }
      if (pending_signal()) break;  // stopped while starting: start no more
      spawn(r, env, b);
    }
  }

  void install_handlers() {
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    sigaction(SIGINT, &sa, &old_int_);
    sigaction(SIGTERM, &sa, &old_term_);
    sigaction(SIGHUP, &sa, &old_hup_);
    sigaction(SIGCHLD, &sa, &old_chld_);
  }

  // True when a stopping signal is waiting in the pipe (left there for loop() to act on).
  bool pending_signal() {
    pollfd p{g_signal_pipe[0], POLLIN, 0};
    if (poll(&p, 1, 0) <= 0) return false;
    unsigned char sigs[64];
    const ssize_t k = read(g_signal_pipe[0], sigs, sizeof sigs);
    bool stop = false;
    for (ssize_t i = 0; i < k; ++i) {
      if (sigs[i] == SIGCHLD) continue;
      stop = true;
      early_signals_.push_back(sigs[i]);
    }
    return stop;
  }

  void spawn(Rank& r, const std::map<std::string, std::string>& env, const CpuBinding* b) {
    int out[2], err[2];
    if (pipe2(out, O_CLOEXEC) != 0 || pipe2(err, O_CLOEXEC) != 0) throw Error(std::string("pipe: ") + std::strerror(errno));
    const pid_t pid = fork();
    if (pid < 0) throw Error(std::string("fork: ") + std::strerror(errno));
    if (pid == 0) {
      // The rank dies with the launcher, even when the launcher is killed with SIGKILL.
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent_) _exit(127);  // the launcher died before the line above
      setpgid(0, 0);
      sigset_t none;
      sigemptyset(&none);
      sigprocmask(SIG_SETMASK, &none, nullptr);
      signal(SIGINT, SIG_DFL);
      signal(SIGTERM, SIG_DFL);
      signal(SIGHUP, SIG_DFL);
      signal(SIGCHLD, SIG_DFL);
      signal(SIGPIPE, SIG_DFL);
      dup2(out[1], 1);
      dup2(err[1], 2);
      for (const auto& [k, v] : env) setenv(k.c_str(), v.c_str(), 1);
      std::string why;
      if (b && !apply_cpu_binding(*b, &why)) std::fprintf(stderr, "zeal launch: warning: %s\n", why.c_str());
      std::vector<char*> argv;
      for (const auto& a : o_.command) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      execvp(argv[0], argv.data());
      std::fprintf(stderr, "zeal launch: cannot run %s: %s\n", argv[0], std::strerror(errno));
      _exit(127);
    }
    setpgid(pid, pid);  // also in the parent, so a signal sent right away reaches the group
    close(out[1]);
    close(err[1]);
    fcntl(out[0], F_SETFL, O_NONBLOCK);
    fcntl(err[0], F_SETFL, O_NONBLOCK);
    r.pid = pid;
    r.running = true;
    r.out = {out[0], 1, {}};
    r.err = {err[0], 2, {}};
  }

  // What a terminal shows after "\r" and an erase-line code: the text a redraw leaves.
  static std::string after_redraw(const std::string& text) {
    std::string t = text.substr(text.rfind('\r') == std::string::npos ? 0 : text.rfind('\r') + 1);
    if (t.rfind("\033[K", 0) == 0) t.erase(0, 3);
    return t;
  }

  void emit(Rank& r, Stream& s, std::string line) {
    const bool redrawn = line.find('\r') != std::string::npos;
    if (redrawn) line = after_redraw(line);
    r.tail.push_back(line);
    // The head line of the last message on stderr (continuation lines are indented).
    if (&s == &r.err && !line.empty() && line[0] != ' ' && line[0] != '\t') r.last_error_line = line;
    if (static_cast<int>(r.tail.size()) > o_.tail_lines) r.tail.pop_front();
    if (o_.quiet_ranks && r.global != 0) return;
    // A line under a progress bar: the bar is cleared, the line written, the bar drawn again
    // below it (unless this line is the bar's own last state).
    if (!bar_.empty()) write_all(1, "\r\033[K");
    write_all(s.out_fd, fmt::format("[rank {}] {}\n", r.global, line));
    if (redrawn && &s == &r.out && r.global == bar_rank_) bar_.clear();
    if (!bar_.empty()) write_all(1, bar_);
  }

  // A rank's unfinished line that redraws itself ("\r…", a progress bar) is shown as it comes.
  void show_bar(Rank& r, Stream& s) {
    if (!terminal_ || &s != &r.out || s.partial.find('\r') == std::string::npos) return;
    if (o_.quiet_ranks && r.global != 0) return;
    bar_rank_ = r.global;
    bar_ = fmt::format("\r\033[K[rank {}] {}", r.global, after_redraw(s.partial));
    write_all(1, bar_);
    s.partial.erase(0, s.partial.rfind('\r'));  // the text before the last redraw is gone
  }

  // Reads what is available; returns false at end of file.
  bool drain(Rank& r, Stream& s) {
    char buf[65536];
    for (;;) {
      const ssize_t n = read(s.fd, buf, sizeof buf);
      if (n > 0) {
        s.partial.append(buf, static_cast<size_t>(n));
        size_t nl;
        while ((nl = s.partial.find('\n')) != std::string::npos) {
          emit(r, s, s.partial.substr(0, nl));
          s.partial.erase(0, nl + 1);
        }
        show_bar(r, s);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
      if (!s.partial.empty()) emit(r, s, std::exchange(s.partial, {}));
      close(s.fd);
      s.fd = -1;
      return false;
    }
  }

  void signal_all(int sig) {
    for (auto& r : ranks_) {
      if (r.running) kill(-r.pid, sig);
    }
  }

  void begin_stop(int sig) {
    if (stopping_) return;
    stopping_ = true;
    signal_all(sig);
    kill_deadline_ = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(o_.grace_seconds * 1000));
  }

  void reap() {
    for (;;) {
      int status = 0;
      struct rusage usage {};
      const pid_t pid = wait4(-1, &status, WNOHANG, &usage);
      if (pid <= 0) return;
      for (auto& r : ranks_) {
        if (r.pid != pid || !r.running) continue;
        r.running = false;
        r.status = status;
        r.max_rss = static_cast<int64_t>(usage.ru_maxrss) * 1024;  // KiB on Linux
        // The rank is gone; anything it started in its group goes too.
        kill(-r.pid, SIGKILL);
        if (!failed(status) && !stopping_ && !early_exit_) {
          early_exit_ = true;
          early_exit_rank_ = r.global;
          early_exit_at_ = Clock::now();
        }
        // A SIGKILL this launcher did not send (it sends them only while stopping): the OOM killer's?
        if (WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL && !stopping_) {
          r.oom = oom_.explain(r.pid, r.last_rss, peak_of(r));
        }
        if (failed(status) && !stopping_ && first_failure_ < 0) {
          first_failure_ = r.local;
          const int others = static_cast<int>(std::count_if(ranks_.begin(), ranks_.end(), [](const Rank& x) { return x.running; }));
          std::fprintf(stderr, "zeal launch: rank %d (local rank %d, pid %d) %s; stopping %d other rank%s\n",
                       r.global, r.local, static_cast<int>(r.pid),
                       r.oom.empty() ? describe_status(status).c_str() : r.oom.c_str(), others,
                       others == 1 ? "" : "s");
          begin_stop(SIGTERM);
        }
      }
    }
  }

  // A rank that exited 0 while others still run after a few seconds: they may be waiting for it
  // in a collective, which fails only after comm_timeout. Said once, at once.
  void report_early_exit() {
    if (!early_exit_ || early_exit_reported_ || stopping_) return;
    if (Clock::now() - early_exit_at_ < kEarlyExitNotice) return;
    std::string still;
    int n = 0;
    for (const auto& r : ranks_) {
      if (!r.running) continue;
      still += fmt::format("{}{}", still.empty() ? "" : ", ", r.global);
      ++n;
    }
    if (n == 0) return;
    early_exit_reported_ = true;
    std::fprintf(stderr,
                 "zeal launch: rank %d exited with status 0 %.0f s ago while rank%s %s still run%s; if %s waiting for "
                 "it in a collective, %s fail after comm_timeout\n",
                 early_exit_rank_, std::chrono::duration<double>(Clock::now() - early_exit_at_).count(),
                 n == 1 ? "" : "s", still.c_str(), n == 1 ? "s" : "", n == 1 ? "it is" : "they are",
                 n == 1 ? "it will" : "they will");
  }

  void on_stop_signal(int sig) {
    if (interrupted_by_ == 0) {
      interrupted_by_ = sig;
      std::fprintf(stderr, "zeal launch: received %s; passing it to every rank\n", sigabbrev_np(sig));
      // The first signal goes through as it came (SIGINT lets a program save and exit);
      // the grace period then ends in SIGKILL.
      begin_stop(sig);
    } else {
      signal_all(SIGKILL);
    }
  }

  static int64_t peak_of(const Rank& r) { return std::max(r.max_rss, r.polled_peak); }

  // Each running rank's resident set and its high-water mark, from /proc (a rank the OOM killer
  // ends is reported with what it held last).
  void sample_memory() {
    for (auto& r : ranks_) {
      if (!r.running) continue;
      std::ifstream in("/proc/" + std::to_string(r.pid) + "/status");
      std::string line;
      while (std::getline(in, line)) {
        if (line.rfind("VmHWM:", 0) == 0) {
          r.polled_peak = std::max<int64_t>(r.polled_peak, std::atoll(line.c_str() + 6) * 1024);
        } else if (line.rfind("VmRSS:", 0) == 0) {
          r.last_rss = std::atoll(line.c_str() + 6) * 1024;
          break;
        }
      }
    }
  }

  void loop() {
    for (int sig : early_signals_) on_stop_signal(sig);
    for (;;) {
      if (o_.verbose || Clock::now() >= next_sample_) {
        sample_memory();
        next_sample_ = Clock::now() + std::chrono::milliseconds(500);
      }
      reap();
      report_early_exit();
      const bool any_running = std::any_of(ranks_.begin(), ranks_.end(), [](const Rank& r) { return r.running; });
      std::vector<pollfd> fds;
      std::vector<std::pair<Rank*, Stream*>> owners;
      fds.push_back({g_signal_pipe[0], POLLIN, 0});
      owners.push_back({nullptr, nullptr});
      for (auto& r : ranks_) {
        for (Stream* s : {&r.out, &r.err}) {
          if (s->fd < 0) continue;
          fds.push_back({s->fd, POLLIN, 0});
          owners.push_back({&r, s});
        }
      }
      if (!any_running) {
        // Every rank has exited: take what is left in the pipes (a grandchild may still hold one
        // open; its group was killed with its rank) and stop.
        for (size_t i = 1; i < fds.size(); ++i) drain(*owners[i].first, *owners[i].second);
        return;
      }
      int timeout_ms = early_exit_ && !early_exit_reported_ ? 250 : o_.verbose ? 100 : 500;
      if (stopping_) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(kill_deadline_ - Clock::now()).count();
        if (left <= 0) {
          signal_all(SIGKILL);
          timeout_ms = 100;
        } else {
          timeout_ms = static_cast<int>(std::min<int64_t>(left, 1000));
        }
      }
      const int n = poll(fds.data(), fds.size(), timeout_ms);
      if (n < 0 && errno != EINTR) throw Error(std::string("poll: ") + std::strerror(errno));
      if (n <= 0) continue;
      if (fds[0].revents & POLLIN) {
        unsigned char sigs[64];
        const ssize_t k = read(g_signal_pipe[0], sigs, sizeof sigs);
        for (ssize_t i = 0; i < k; ++i) {
          if (sigs[i] != SIGCHLD) on_stop_signal(sigs[i]);
        }
      }
      for (size_t i = 1; i < fds.size(); ++i) {
        if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) drain(*owners[i].first, *owners[i].second);
      }
    }
  }

  int finish() {
    if (!bar_.empty()) write_all(1, "\n");  // a bar whose rank ended without its newline
    sigaction(SIGINT, &old_int_, nullptr);
    sigaction(SIGTERM, &old_term_, nullptr);
    sigaction(SIGHUP, &old_hup_, nullptr);
    sigaction(SIGCHLD, &old_chld_, nullptr);
    for (auto& r : ranks_) {
      for (Stream* s : {&r.out, &r.err}) {
        if (s->fd >= 0) close(s->fd);
      }
    }
    if (first_failure_ >= 0) {
      const Rank& r = ranks_[first_failure_];
      if (!r.tail.empty()) {
        std::fprintf(stderr, "zeal launch: last %zu line%s of rank %d:\n", r.tail.size(), r.tail.size() == 1 ? "" : "s",
                     r.global);
        for (const auto& line : r.tail) std::fprintf(stderr, "  | %s\n", line.c_str());
      }
      std::fprintf(stderr, "zeal launch: failed: rank %d %s\n", r.global,
                   r.oom.empty() ? describe_status(r.status).c_str() : r.oom.c_str());
      return exit_code_of(r.status);
    }
    if (interrupted_by_ != 0) return 128 + interrupted_by_;
    // With --verbose, what each rank's process held at most, as the kernel counted it (its
    // high-water mark, read every 100 ms while it ran and at its exit): the sum bounds the node's
    // peak from above.
    const double seconds = std::chrono::duration<double>(Clock::now() - started_).count();
    if (o_.verbose) {
      std::string per;
      int64_t sum = 0;
      for (const auto& r : ranks_) {
        const int64_t peak = peak_of(r);
        per += fmt::format("{}rank {} {:.2f} GiB", per.empty() ? "" : ", ", r.global, static_cast<double>(peak) / (1 << 30));
        sum += peak;
      }
      std::fprintf(stderr, "zeal launch: peak resident set per rank: %s; sum %.2f GiB; %.0f s\n", per.c_str(),
                   static_cast<double>(sum) / (1 << 30), seconds);
    }
    return 0;
  }

  const LaunchOptions& o_;
  const int restart_;
  // The rendezvous port of this attempt: with several machines, restart k meets on the first port + k,
  // so ranks of different attempts can never meet in one store (each launcher restarts on its own).
  int port() const { return attempt_port(o_, restart_); }
  const std::string previous_pids_;
  OomWatch oom_;
  Clock::time_point next_sample_{};
  std::vector<Rank> ranks_;
  const bool terminal_ = isatty(1) != 0;
  const Clock::time_point started_ = Clock::now();
  std::string bar_;  // the progress bar on the terminal now (redraw codes included), or empty
  int bar_rank_ = -1;
  bool stopping_ = false;
  Clock::time_point kill_deadline_{};
  int first_failure_ = -1;
  int interrupted_by_ = 0;
  std::vector<int> early_signals_;  // stopping signals that came while ranks were being started
  const pid_t parent_ = getpid();
  static constexpr auto kEarlyExitNotice = std::chrono::seconds(5);
  bool early_exit_ = false, early_exit_reported_ = false;
  int early_exit_rank_ = -1;
  Clock::time_point early_exit_at_{};
  struct sigaction old_int_ {}, old_term_ {}, old_hup_ {}, old_chld_ {};
};

// More ranks than cores, or more than memory holds: said before anything starts, with the numbers.
// A rank's memory is at least what a process that loaded LibTorch holds (this one's resident set).
void warn_about_capacity(const LaunchOptions& o) {
  const long cores = sysconf(_SC_NPROCESSORS_ONLN);
  if (cores > 0 && o.nproc_per_node > cores) {
    std::fprintf(stderr, "zeal launch: warning: %d ranks on %ld cores: ranks will share cores and run slower\n",
                 o.nproc_per_node, cores);
  }
  struct sysinfo si {};
  if (sysinfo(&si) != 0) return;
  const double total = static_cast<double>(si.totalram) * si.mem_unit;
  const double per_rank = static_cast<double>(std::max<int64_t>(detail::resident_bytes(), 64ll << 20));
  const double need = per_rank * o.nproc_per_node;
  if (need > 0.8 * total) {
    std::fprintf(stderr,
                 "zeal launch: warning: %d ranks need at least %.1f GiB (%.0f MiB each before any model: a LibTorch "
                 "process's resident set), but this machine has %.1f GiB of memory: expect them to run out of "
                 "memory; start fewer ranks (--num_processes)\n",
                 o.nproc_per_node, need / (1 << 30), per_rank / (1 << 20), total / (1 << 30));
  }
}

}  // namespace

bool port_is_free(int port, std::string* why) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return true;
  const int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  if (!ok && why) *why = std::strerror(errno);
  close(fd);
  return ok;
}

int launch(const LaunchOptions& o) {
  if (o.command.empty()) throw Error("zeal launch: no program given (usage: zeal launch [options] PROGRAM [ARGS...])");
  if (o.nproc_per_node < 1) throw Error(fmt::format("--nproc_per_node must be at least 1, got {}", o.nproc_per_node));
  if (o.nnodes < 1) throw Error(fmt::format("--nnodes must be at least 1, got {}", o.nnodes));
  if (o.node_rank < 0 || o.node_rank >= o.nnodes) {
    throw Error(fmt::format("--node_rank {} is outside 0..{} for --nnodes {}", o.node_rank, o.nnodes - 1, o.nnodes));
  }
  if (o.master_port < 1 || o.master_port > 65535) throw Error(fmt::format("--master_port {} is not a TCP port", o.master_port));
  if (!(o.grace_seconds >= 0.0 && o.grace_seconds <= 3600.0)) {
    throw Error(fmt::format("--stop_grace {}: expected seconds from 0 to 3600", o.grace_seconds));
  }
  warn_about_capacity(o);
  if (!program_exists(o.command[0])) {
    throw Error(fmt::format("cannot find the program '{}' (not a path to an executable, and not on PATH)", o.command[0]));
  }
  std::string why;
  if (o.node_rank == 0 && !port_is_free(o.master_port, &why)) {
    throw Error(fmt::format(
        "port {} is already in use on this machine ({}): rank 0 listens there for the rendezvous. Another job may be "
        "running; choose a free port with --main_process_port (or MASTER_PORT)",
        o.master_port, why));
  }
  if (g_signal_pipe[0] < 0) {
    if (pipe2(g_signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0) throw Error(std::string("pipe: ") + std::strerror(errno));
  }
  if (o.max_restarts < 0) throw Error(fmt::format("--max_restarts must be at least 0, got {}", o.max_restarts));
  if (o.nnodes > 1 && o.master_port + o.max_restarts > 65535) {
    throw Error(fmt::format("--max_restarts {} with several machines uses ports {} to {}: past 65535", o.max_restarts,
                            o.master_port, o.master_port + o.max_restarts));
  }
  // Several machines restart on the next ports: machine 0 needs them all.
  for (int k = 1; o.node_rank == 0 && o.nnodes > 1 && k <= o.max_restarts; ++k) {
    if (!port_is_free(o.master_port + k, &why)) {
      throw Error(fmt::format("port {} is already in use on this machine ({}): with --max_restarts {} over several "
                              "machines, restart {} meets there. Choose a --main_process_port with {} free ports after it",
                              o.master_port + k, why, o.max_restarts, k, o.max_restarts));
    }
  }
  std::string previous, previous_pids;
  for (int attempt = 0;; ++attempt) {
    Group group(o, attempt, previous_pids);
    const int code = group.run();
    previous_pids = group.pids();
    if (code == 0 || group.interrupted() || !group.rank_failed()) return code;
    if (attempt >= o.max_restarts) {
      if (o.max_restarts > 0) {
        std::fprintf(stderr, "zeal launch: giving up: %d restart%s used (--max_restarts %d)\n", attempt,
                     attempt == 1 ? "" : "s", o.max_restarts);
      }
      return code;
    }
    const std::string signature = group.failure_signature();
    if (!signature.empty() && signature == previous) {
      std::fprintf(stderr,
                   "zeal launch: giving up after %d restart%s: the attempt failed as the one before it did (%s, with the "
                   "same error message), so restarting will not change that\n",
                   attempt, attempt == 1 ? "" : "s", group.failure_summary().c_str());
      return code;
    }
    previous = signature;
    const int next_port = attempt_port(o, attempt + 1);
    std::fprintf(stderr, "zeal launch: restarting every rank (restart %d of %d) after %s, %.0f s into the attempt%s\n",
                 attempt + 1, o.max_restarts, group.failure_summary().c_str(), group.seconds(),
                 o.nnodes > 1 ? fmt::format("; the machines meet again on port {}", next_port).c_str() : "");
    // Rank 0's store port is free again once its sockets are closed.
    for (int i = 0; i < 100 && o.node_rank == 0 && !port_is_free(next_port); ++i) usleep(100'000);
    if (o.node_rank == 0 && !port_is_free(next_port, &why)) {
      std::fprintf(stderr, "zeal launch: giving up: port %d, where restart %d meets, is in use (%s)\n", next_port,
                   attempt + 1, why.c_str());
      return code;
    }
  }
}

}  // namespace zeal
