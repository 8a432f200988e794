#include "engine/memory_tracker.h"

#include "engine/host_cache.h"

#include <ATen/DeviceAccelerator.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <mutex>
#include <set>

#include <unistd.h>

#include "engine/engine.h"

namespace zeal {

namespace {

// The first engine's start in this process (a forked rank measures its own).
std::mutex baseline_mu;
int64_t baseline = 0;
pid_t baseline_pid = 0;

// The open phases: resetting the high-water mark for a new phase first folds it into theirs (the
// resident set's, and the accelerator allocator's peak of allocated bytes).
std::mutex open_mu;
std::set<int64_t*> open_peaks;
std::set<int64_t*> open_device_peaks;

void reset_cpu_peak() {
  std::lock_guard<std::mutex> lock(open_mu);
  const int64_t hwm = detail::resident_peak_bytes();
  for (int64_t* p : open_peaks) *p = std::max(*p, hwm);
  std::ofstream("/proc/self/clear_refs") << "5";  // VmHWM := VmRSS (Linux 4.0 and later)
}

// PEFT's b2mb, int(x / 2**20): truncated toward zero; its total peak is b2mb(max - begin) + b2mb(begin).
int64_t mb(int64_t bytes) { return bytes / (int64_t{1} << 20); }

bool on_accelerator(const at::Device& d) { return !d.is_cpu() && !d.is_meta(); }

}  // namespace

namespace detail {
void note_runtime_baseline() {
  std::lock_guard<std::mutex> lock(baseline_mu);
  if (baseline_pid == ::getpid()) return;
  baseline_pid = ::getpid();
  baseline = resident_bytes();
}
int64_t runtime_baseline() {
  std::lock_guard<std::mutex> lock(baseline_mu);
  return baseline_pid == ::getpid() ? baseline : 0;
}
void reset_resident_peak() { reset_cpu_peak(); }
}  // namespace detail

MemoryTracker::MemoryTracker(Engine& engine, std::string phase) : engine_(engine) {
  host_cache_trim();  // a phase's lines count what tensors hold, not blocks kept for reuse
  record_.phase = std::move(phase);
  record_.rank = engine.process_index();
  const at::Device d = engine.device();
  if (on_accelerator(d)) {
    record_.device_label = d.is_cuda() ? "GPU" : c10::DeviceTypeName(d.type(), /*lower_case=*/false);
    try {
      // The caching allocator exists once the device is initialised: before the first allocation on
      // it, its statistics would be refused ("Invalid device argument").
      at::globalContext().lazyInitDevice(d.type());
      const int index = d.index() < 0 ? 0 : d.index();
      std::lock_guard<std::mutex> lock(open_mu);
      const int64_t peak = at::accelerator::getDeviceStats(index).allocated_bytes[0].peak;
      for (int64_t* p : open_device_peaks) *p = std::max(*p, peak);  // an enclosing phase keeps its peak
      at::accelerator::resetPeakStats(index);
      record_.device.begin = at::accelerator::getDeviceStats(index).allocated_bytes[0].current;
      record_.device.peak = record_.device.begin;
      record_.device.measured = true;
      open_device_peaks.insert(&record_.device.peak);
    } catch (const std::exception&) {
      record_.device.measured = false;  // an allocator without statistics: CPU lines only
    }
  }
  reset_cpu_peak();
  record_.cpu.begin = detail::resident_bytes();
  record_.cpu.peak = record_.cpu.begin;
  record_.cpu.measured = true;
  std::lock_guard<std::mutex> lock(open_mu);
  open_peaks.insert(&record_.cpu.peak);
}

MemoryTracker::~MemoryTracker() {
  try {
    if (!ended_) end(false);
  } catch (...) {
  }
  std::lock_guard<std::mutex> lock(open_mu);
  open_peaks.erase(&record_.cpu.peak);
  open_device_peaks.erase(&record_.device.peak);
}

PhaseMemory MemoryTracker::now() const {
  PhaseMemory r = record_;
  if (ended_) return r;
  r.cpu.end = detail::resident_bytes();
  {
    // The kernel's counters are per-CPU and read approximately (a few pages either way): the peak
    // reported is the most of every reading, so it never falls from one call to the next.
    std::lock_guard<std::mutex> lock(open_mu);
    record_.cpu.peak = std::max({record_.cpu.peak, detail::resident_peak_bytes(), r.cpu.end});
    r.cpu.peak = record_.cpu.peak;
  }
  if (r.device.measured) {
    const at::Device d = engine_.device();
    const auto stats = at::accelerator::getDeviceStats(d.index() < 0 ? 0 : d.index());
    r.device.end = stats.allocated_bytes[0].current;
    std::lock_guard<std::mutex> lock(open_mu);
    record_.device.peak = std::max({record_.device.peak, stats.allocated_bytes[0].peak, r.device.end});
    r.device.peak = record_.device.peak;
  }
  r.runtime_baseline = detail::runtime_baseline();
  r.engine = engine_.memory();
  return r;
}

const PhaseMemory& MemoryTracker::end(bool print) {
  if (ended_) return record_;
  const HostCacheStats cache = host_cache_stats();  // what it held at the phase's end, before the trim
  host_cache_trim();
  record_ = now();
  record_.engine.host_cache = cache.cached_bytes;
  ended_ = true;
  {
    std::lock_guard<std::mutex> lock(open_mu);
    open_peaks.erase(&record_.cpu.peak);
    open_device_peaks.erase(&record_.device.peak);
  }
  if (print && engine_.is_main_process()) {
    for (const auto& l : record_.lines()) engine_.print(l);
    std::string parts;
    for (const auto& p : record_.breakdown()) {
      if (p.bytes == 0) continue;
      parts += fmt::format("{}{} {}", parts.empty() ? "" : ", ", p.name, format_bytes(static_cast<double>(p.bytes)));
    }
    engine_.print(fmt::format("zeal: {} peak resident set {} = {}", record_.phase,
                              format_bytes(static_cast<double>(record_.cpu.peak)), parts));
    if (record_.engine.host_cache_peak > 0) {
      engine_.print(fmt::format("zeal: host allocator cache: {} now, at most {} (reused blocks, none of them in the peak)",
                                format_bytes(static_cast<double>(record_.engine.host_cache)),
                                format_bytes(static_cast<double>(record_.engine.host_cache_peak))));
    }
  }
  return record_;
}

std::vector<std::string> PhaseMemory::lines() const {
  std::vector<std::string> out;
  auto add = [&](const std::string& label, const MemoryUse& u) {
    out.push_back(fmt::format("{} Memory before entering the {} : {}", label, phase, mb(u.begin)));
    out.push_back(fmt::format("{} Memory consumed at the end of the {} (end-begin): {}", label, phase, mb(u.end - u.begin)));
    out.push_back(fmt::format("{} Peak Memory consumed during the {} (max-begin): {}", label, phase, mb(u.peak - u.begin)));
    out.push_back(fmt::format("{} Total Peak Memory consumed during the {} (max): {}", label, phase,
                              mb(u.peak - u.begin) + mb(u.begin)));
  };
  if (device.measured) add(device_label, device);
  add("CPU", cpu);
  return out;
}

std::vector<PhaseMemory::Part> PhaseMemory::breakdown() const {
  const MemoryReport& e = engine;
  // On an accelerator the model states are device memory, except what offload keeps on the host.
  const bool host_states = !device.measured;
  std::vector<Part> parts{{"runtime", runtime_baseline}};
  if (host_states) {
    parts.push_back({"parameters", e.params});
    parts.push_back({"gradients", e.grads});
    parts.push_back({"master weights", e.master});
    parts.push_back({"optimizer states", e.optimizer_states});
    parts.push_back({"frozen parameters", e.frozen_params});
    parts.push_back({"buffers", e.buffers});
    parts.push_back({"workspace and gathered units", e.workspace});
  }
  // Offload keeps master and optimizer state on the host (counted above on the CPU) plus its buffers.
  const int64_t offload_extra = host_states ? std::max<int64_t>(0, e.offload_host_peak - e.master - e.optimizer_states)
                                            : e.offload_host_peak;
  if (offload_extra > 0) parts.push_back({"offload buffers", offload_extra});
  if (e.comm_buffers > 0) parts.push_back({"communication buffers", e.comm_buffers});
  int64_t named = 0;
  for (const auto& p : parts) named += p.bytes;
  parts.push_back({"activations and the rest", cpu.peak - named});
  return parts;
}

std::string PhaseMemory::json() const {
  auto use = [](const MemoryUse& u) {
    return nlohmann::json{{"before", u.begin},
                          {"consumed", u.end - u.begin},
                          {"peak", u.peak - u.begin},
                          {"total_peak", u.peak},
                          {"before_mb", mb(u.begin)},
                          {"consumed_mb", mb(u.end - u.begin)},
                          {"peak_mb", mb(u.peak - u.begin)},
                          {"total_peak_mb", mb(u.peak - u.begin) + mb(u.begin)}};
  };
  nlohmann::json j{{"phase", phase}, {"rank", rank}, {"cpu", use(cpu)}};
  if (device.measured) j[device_label == "GPU" ? "gpu" : device_label] = use(device);
  nlohmann::json parts = nlohmann::json::object();
  for (const auto& p : breakdown()) parts[p.name] = p.bytes;
  j["cpu_peak_breakdown"] = parts;
  if (engine.offload_disk > 0) j["bytes_on_disk"] = engine.offload_disk;
  j["host_cache_bytes"] = engine.host_cache;
  j["host_cache_peak_bytes"] = engine.host_cache_peak;
  return j.dump();
}

}  // namespace zeal
