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

// This process's cgroup folders, most specific first: (v2) its own and every ancestor up to the
// mount's root; (v1, the memory controller) its own, then the mount's root.
struct CgroupDirs {
  bool v2 = false;
  std::vector<std::string> dirs;
};

CgroupDirs cgroup_dirs() {
  CgroupDirs c;
  std::ifstream self("/proc/self/cgroup");
  for (std::string line; std::getline(self, line);) {
    const size_t a = line.find(':'), b = line.find(':', a == std::string::npos ? a : a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    if (controllers.empty()) {
      c.v2 = true;
      c.dirs.clear();
      for (std::string p = path;;) {
        c.dirs.push_back("/sys/fs/cgroup" + (p == "/" ? std::string() : p));
        if (p.empty() || p == "/") break;
        const size_t slash = p.rfind('/');
        p = slash == 0 || slash == std::string::npos ? "/" : p.substr(0, slash);
      }
    } else if (("," + controllers + ",").find(",memory,") != std::string::npos) {
      c.v2 = false;
      c.dirs = {"/sys/fs/cgroup/memory" + path, "/sys/fs/cgroup/memory"};
      break;
    }
  }
  return c;
}

int64_t read_number(const std::string& file) {
  std::ifstream in(file);
  std::string word;
  if (!(in >> word) || word == "max") return -1;
  char* end = nullptr;
  const long long v = std::strtoll(word.c_str(), &end, 10);
  return end && *end == 0 && v >= 0 ? v : -1;
}

int64_t stat_key(const std::string& dir, const std::string& key) {
  std::ifstream in(dir + "/memory.stat");
  std::string k;
  int64_t v = 0;
  while (in >> k >> v) {
    if (k == key) return v;
  }
  return -1;
}

// The limit that binds this process (the smallest on its way to the root) and the folder that
// sets it; -1 when none does.
std::pair<int64_t, std::string> binding_limit() {
  const CgroupDirs c = cgroup_dirs();
  int64_t best = -1;
  std::string where;
  for (const auto& d : c.dirs) {
    // v1 reports the hierarchy's limit itself (hierarchical_memory_limit); v2 sets one per level.
    const int64_t v = c.v2 ? read_number(d + "/memory.max") : stat_key(d, "hierarchical_memory_limit");
    if (v >= 0 && (best < 0 || v < best)) best = v, where = d;
    if (!c.v2 && v >= 0) break;  // the most specific readable v1 folder says it all
  }
  return {best, where};
}

}  // namespace

int64_t cgroup_memory_limit() {
  const int64_t v = binding_limit().first;
  // cgroup v1 writes "no limit" as a page-rounded LONG_MAX; anything beyond the machine's memory
  // is no limit either.
  const int64_t total = meminfo("MemTotal:");
  if (v < 0 || (total > 0 && v >= total)) return -1;
  return v;
}

int64_t cgroup_memory_usage() {
  const auto [limit, where] = binding_limit();
  const CgroupDirs c = cgroup_dirs();
  // Usage where the limit is set (v2), or of this process's group (v1), without the page cache the
  // kernel can drop (as container runtimes count a working set).
  const std::string dir = c.v2 && !where.empty() ? where : (c.dirs.empty() ? std::string() : c.dirs.front());
  if (dir.empty()) return -1;
  int64_t usage = read_number(dir + (c.v2 ? "/memory.current" : "/memory.usage_in_bytes"));
  if (usage < 0 && !c.v2 && c.dirs.size() > 1) usage = read_number(c.dirs.back() + "/memory.usage_in_bytes");
  if (usage < 0) return -1;
  const int64_t inactive = std::max<int64_t>(0, std::max(stat_key(dir, "inactive_file"), stat_key(dir, "total_inactive_file")));
  return std::max<int64_t>(0, usage - inactive);
}

int64_t cgroup_oom_kills() {
  const CgroupDirs c = cgroup_dirs();
  if (c.dirs.empty()) return -1;
  std::ifstream in(c.dirs.front() + (c.v2 ? "/memory.events" : "/memory.oom_control"));
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("oom_kill ", 0) == 0) return std::atoll(line.c_str() + 9);
  }
  return -1;
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
