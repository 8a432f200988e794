// How every zeal benchmark measures, so its ratios hold on a shared machine.
//
//  - Interleaved rounds: the contenders (zeal, the floor, each peer) run one measurement each per
//    round, in an order rotated every round, so a disturbance that lasts a few seconds lands on all
//    of them instead of on whichever ran then. Each contender reports its median and the min–max
//    over rounds; every ratio is computed round by round (the two measurements were seconds apart)
//    and reported as the median ratio with the min–max of the per-round ratios: its spread.
//  - The environment goes into every result: CPU model, the kernels' path, the process's CPU
//    affinity, transparent huge pages, the load average before and after, and the CPU time other
//    processes took while the benchmark ran (from /proc/stat, minus this process and its waited-for
//    children), plus the hypervisor's steal time. A busy machine is named with a warning.
//
// Header-only, no LibTorch.
#pragma once

#include <nlohmann/json.hpp>

#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <stdexcept>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cpu/adam.h"

namespace zeal_bench {

// Runs a shell command (fio, …) and returns its standard output; throws std::runtime_error with
// the start of the output when it fails.
inline std::string run_command(const std::string& cmd) {
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) throw std::runtime_error("cannot run: " + cmd);
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int rc = pclose(p);
  if (rc != 0) throw std::runtime_error("'" + cmd + "' failed (" + std::to_string(rc) + "): " + out.substr(0, 400));
  return out;
}

// --- statistics --------------------------------------------------------------------------------

// One contender's measurements, one per round (seconds, bytes, …).
struct Series {
  std::vector<double> values;
  double median() const {
    if (values.empty()) return 0;
    std::vector<double> v = values;
    std::sort(v.begin(), v.end());
    const size_t n = v.size();
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
  }
  double min() const { return values.empty() ? 0 : *std::min_element(values.begin(), values.end()); }
  double max() const { return values.empty() ? 0 : *std::max_element(values.begin(), values.end()); }
  bool empty() const { return values.empty(); }
};

// A ratio computed round by round: its median and the min–max over rounds.
struct Ratio {
  double median = 0, lo = 0, hi = 0;
  bool valid = false;
  nlohmann::json value() const { return valid ? nlohmann::json(median) : nlohmann::json(nullptr); }
  nlohmann::json spread() const { return valid ? nlohmann::json::array({lo, hi}) : nlohmann::json(nullptr); }
  // "1.07 (1.02–1.11)"
  std::string text(int digits = 2) const {
    if (!valid) return "n/a";
    char buf[96];
    std::snprintf(buf, sizeof buf, "%.*f (%.*f–%.*f)", digits, median, digits, lo, digits, hi);
    return buf;
  }
};

// num[r] / den[r] round by round (the two series were measured in the same rounds).
inline Ratio ratio(const Series& num, const Series& den) {
  Ratio r;
  const size_t n = std::min(num.values.size(), den.values.size());
  if (n == 0) return r;
  Series q;
  for (size_t i = 0; i < n; ++i) q.values.push_back(num.values[i] / den.values[i]);
  r = {q.median(), q.min(), q.max(), true};
  return r;
}

// Puts `r` into `out` as key (the median) and key_spread ([lo, hi]).
inline void put_ratio(nlohmann::json& out, const std::string& key, const Ratio& r) {
  out[key] = r.value();
  out[key + "_spread"] = r.spread();
}

// --- interleaved rounds ------------------------------------------------------------------------

// A contender measures once per call and returns the quantity (usually seconds of one step).
struct Contender {
  std::string name;
  std::function<double()> measure;
};

// Runs every contender `warmups` times untimed, then `rounds` rounds; in round r the contenders
// go in their order rotated by r. `progress` (if set) is told after each round.
inline std::vector<Series> interleave(const std::vector<Contender>& contenders, int rounds, int warmups = 1,
                                      const std::function<void(int)>& progress = {}) {
  std::vector<Series> out(contenders.size());
  for (int w = 0; w < warmups; ++w)
    for (const auto& c : contenders) (void)c.measure();
  const size_t n = contenders.size();
  for (int r = 0; r < rounds; ++r) {
    for (size_t k = 0; k < n; ++k) {
      const size_t i = (k + static_cast<size_t>(r)) % n;
      out[i].values.push_back(contenders[i].measure());
    }
    if (progress) progress(r + 1);
  }
  return out;
}

// Seconds `fn` takes.
inline double seconds_of(const std::function<void()>& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// --- environment -------------------------------------------------------------------------------

namespace detail {

inline std::string first_line(const std::string& path) {
  std::ifstream f(path);
  std::string line;
  std::getline(f, line);
  return line;
}

inline std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown";
}

// The bracketed choice of a sysfs setting: "always [madvise] never" → "madvise".
inline std::string selected(const std::string& line) {
  const size_t a = line.find('['), b = line.find(']');
  return a == std::string::npos || b == std::string::npos ? (line.empty() ? "unknown" : line) : line.substr(a + 1, b - a - 1);
}

inline std::string affinity() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) return "unknown";
  std::string out;
  int run_start = -1, prev = -2;
  auto flush = [&] {
    if (run_start < 0) return;
    out += (out.empty() ? "" : ",") + (run_start == prev ? std::to_string(run_start)
                                                           : std::to_string(run_start) + "-" + std::to_string(prev));
  };
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (!CPU_ISSET(c, &set)) continue;
    if (c != prev + 1) {
      flush();
      run_start = c;
    }
    prev = c;
  }
  flush();
  return out;
}

// Machine-wide busy and steal time (seconds) from /proc/stat's cpu line.
struct CpuTimes {
  double busy = 0, steal = 0;
};
inline CpuTimes machine_cpu_times() {
  std::ifstream f("/proc/stat");
  std::string cpu;
  double user = 0, nice = 0, system = 0, idle = 0, iowait = 0, irq = 0, softirq = 0, steal = 0;
  f >> cpu >> user >> nice >> system >> idle >> iowait >> irq >> softirq >> steal;
  const double hz = static_cast<double>(sysconf(_SC_CLK_TCK));
  return {(user + nice + system + irq + softirq) / hz, steal / hz};
}

// CPU seconds this process and its waited-for children have used.
inline double own_cpu_seconds() {
  double s = 0;
  for (int who : {RUSAGE_SELF, RUSAGE_CHILDREN}) {
    rusage u{};
    getrusage(who, &u);
    s += u.ru_utime.tv_sec + u.ru_utime.tv_usec * 1e-6 + u.ru_stime.tv_sec + u.ru_stime.tv_usec * 1e-6;
  }
  return s;
}

inline std::vector<double> load_average() {
  std::istringstream in(first_line("/proc/loadavg"));
  double a = 0, b = 0, c = 0;
  in >> a >> b >> c;
  return {a, b, c};
}

}  // namespace detail

// Call begin() before the first measurement and end() after the last.
class Environment {
 public:
  void begin() {
    cores_ = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    load_before_ = detail::load_average();
    times_before_ = detail::machine_cpu_times();
    own_before_ = detail::own_cpu_seconds();
    t0_ = std::chrono::steady_clock::now();
  }

  void end() {
    wall_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
    load_after_ = detail::load_average();
    const auto times = detail::machine_cpu_times();
    own_ = detail::own_cpu_seconds() - own_before_;
    others_ = std::max(0.0, times.busy - times_before_.busy - own_);
    steal_ = times.steal - times_before_.steal;
  }

  // The share of the machine's CPU time other processes (and the hypervisor) took during the run.
  double others_share() const { return wall_ > 0 ? (others_ + steal_) / (wall_ * cores_) : 0; }

  std::vector<std::string> warnings() const {
    std::vector<std::string> w;
    char buf[320];
    if (load_before_[0] > 0.25 * cores_) {
      std::snprintf(buf, sizeof buf,
                    "the machine was busy before the run: 1-minute load average %.2f on %d cores (wait for it to "
                    "settle below %.2f)",
                    load_before_[0], cores_, 0.25 * cores_);
      w.push_back(buf);
    }
    if (others_share() > 0.05) {
      std::snprintf(buf, sizeof buf,
                    "other processes and the hypervisor took %.0f %% of the machine's CPU time during the run "
                    "(%.1f CPU-seconds, %.1f of them stolen): the spreads may be wide",
                    100 * others_share(), others_ + steal_, steal_);
      w.push_back(buf);
    }
    return w;
  }

  nlohmann::json json() const {
    return {{"cpu", detail::cpu_model()},
            {"cores", cores_},
            {"zeal_cpu_kernels", zeal::cpu::describe_active_simd()},
            {"cpu_affinity", detail::affinity()},
            {"transparent_hugepages", detail::selected(detail::first_line("/sys/kernel/mm/transparent_hugepage/enabled"))},
            {"load_average_before", load_before_},
            {"load_average_after", load_after_},
            {"wall_seconds", wall_},
            {"own_cpu_seconds", own_},
            {"other_processes_cpu_seconds", others_},
            {"steal_seconds", steal_},
            {"warnings", warnings()}};
  }

  // The lines a result table starts with, and the warnings, loudly.
  void print(FILE* out = stdout) const {
    const nlohmann::json j = json();
    std::fprintf(out, "environment: %s, %d cores; zeal kernels %s; affinity %s; transparent huge pages %s\n",
                 j["cpu"].get<std::string>().c_str(), cores_, j["zeal_cpu_kernels"].get<std::string>().c_str(),
                 j["cpu_affinity"].get<std::string>().c_str(), j["transparent_hugepages"].get<std::string>().c_str());
    std::fprintf(out,
                 "load average before %.2f %.2f %.2f, after %.2f %.2f %.2f; other processes %.1f CPU-s and steal "
                 "%.1f s over %.0f s (%.1f %% of the machine)\n",
                 load_before_[0], load_before_[1], load_before_[2], load_after_[0], load_after_[1], load_after_[2],
                 others_, steal_, wall_, 100 * others_share());
    for (const auto& w : warnings()) std::fprintf(out, "WARNING: %s\n", w.c_str());
  }

 private:
  int cores_ = 1;
  std::vector<double> load_before_{0, 0, 0}, load_after_{0, 0, 0};
  detail::CpuTimes times_before_;
  double own_before_ = 0, own_ = 0, others_ = 0, steal_ = 0, wall_ = 0;
  std::chrono::steady_clock::time_point t0_;
};

}  // namespace zeal_bench
