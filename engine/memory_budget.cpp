#include "engine/memory_budget.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <vector>

#include <fmt/format.h>

#include "engine/memory.h"

namespace zeal {
namespace {

// The memory controller's files for this process, most specific first: its own cgroup's, then
// the mount root's (a container often sees its own cgroup as the root).
std::vector<std::string> cgroup_files(const std::string& v2_name, const std::string& v1_name) {
  std::ifstream self("/proc/self/cgroup");
  std::vector<std::string> files;
  for (std::string line; std::getline(self, line);) {
    const size_t a = line.find(':'), b = line.find(':', a == std::string::npos ? a : a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    if (controllers.empty()) {
      files.push_back("/sys/fs/cgroup" + path + "/" + v2_name);
      files.push_back("/sys/fs/cgroup/" + v2_name);
    } else if (("," + controllers + ",").find(",memory,") != std::string::npos) {
      files.push_back("/sys/fs/cgroup/memory" + path + "/" + v1_name);
      files.push_back("/sys/fs/cgroup/memory/" + v1_name);
    }
  }
  return files;
}

int64_t first_number(const std::vector<std::string>& files) {
  for (const auto& f : files) {
    std::ifstream in(f);
    std::string word;
    if (!(in >> word)) continue;
    if (word == "max") return -1;
    char* end = nullptr;
    const long long v = std::strtoll(word.c_str(), &end, 10);
    if (end && *end == 0 && v >= 0) return v;
  }
  return -1;
}

int64_t meminfo(const char* key) {
  std::ifstream in("/proc/meminfo");
  std::string k;
  int64_t kb = 0;
  std::string unit;
  while (in >> k >> kb) {
    std::getline(in, unit);
    if (k == key) return kb * 1024;
  }
  return -1;
}

// A key of the cgroup's memory.stat (v1 names the hierarchy's totals "total_<key>").
int64_t memory_stat(const std::string& key) {
  for (const auto& f : cgroup_files("memory.stat", "memory.stat")) {
    std::ifstream in(f);
    if (!in) continue;
    std::string k;
    int64_t v = 0;
    while (in >> k >> v) {
      if (k == key || k == "total_" + key) return v;
    }
  }
  return 0;
}

}  // namespace

int64_t cgroup_oom_kills() {
  for (const auto& f : cgroup_files("memory.events", "memory.oom_control")) {
    std::ifstream in(f);
    for (std::string line; std::getline(in, line);) {
      if (line.rfind("oom_kill ", 0) == 0) return std::atoll(line.c_str() + 9);
    }
  }
  return -1;
}

int64_t cgroup_memory_limit() {
  const int64_t v = first_number(cgroup_files("memory.max", "memory.limit_in_bytes"));
  // cgroup v1 writes "no limit" as a page-rounded LONG_MAX; anything beyond the machine's memory
  // is no limit either.
  const int64_t total = meminfo("MemTotal:");
  if (v < 0 || (total > 0 && v >= total)) return -1;
  return v;
}

int64_t cgroup_memory_usage() {
  const int64_t usage = first_number(cgroup_files("memory.current", "memory.usage_in_bytes"));
  // Without the page cache the kernel can drop (as container runtimes count a working set).
  return usage < 0 ? usage : std::max<int64_t>(0, usage - memory_stat("inactive_file"));
}

MemoryBudget rank_memory_budget(int local_ranks, int64_t own_resident) {
  const int n = std::max(1, local_ranks);
  const int64_t held = own_resident * n;  // the ranks' own memory is theirs to use
  MemoryBudget b;
  if (const int64_t available = meminfo("MemAvailable:"); available >= 0) {
    b.bytes = (available + held) / n;
    b.source = fmt::format("the machine's available memory ({} now, plus {} the {} rank{} hold{}){}",
                           format_bytes(static_cast<double>(available)), format_bytes(static_cast<double>(held)), n,
                           n == 1 ? "" : "s", n == 1 ? "s" : "", n == 1 ? "" : fmt::format(", shared by {} ranks", n));
  }
  if (const int64_t limit = cgroup_memory_limit(); limit > 0) {
    const int64_t usage = std::max<int64_t>(0, cgroup_memory_usage());
    // What the group holds besides these ranks (other processes, page cache) stays held.
    const int64_t others = std::max<int64_t>(0, usage - held);
    const int64_t share = std::max<int64_t>(0, limit - others) / n;
    if (b.bytes < 0 || share < b.bytes) {
      b.bytes = share;
      b.source = fmt::format("the memory cgroup's limit of {}{}", format_bytes(static_cast<double>(limit)),
                             n == 1 ? "" : fmt::format(", shared by {} ranks", n));
    }
  }
  return b;
}

}  // namespace zeal
