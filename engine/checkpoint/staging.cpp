#include "engine/checkpoint/staging.h"

#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <fstream>

namespace zeal::ckpt {

void Staging::fault_in(char* p, int64_t n) {
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14
#endif
  static const int64_t page = ::sysconf(_SC_PAGESIZE);
  // The whole pages inside the chunk in one call (the kernel faults them as a batch); the pages at
  // either end, and every page where the kernel lacks it, by a write.
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + page - 1) & ~static_cast<uintptr_t>(page - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(n)) & ~static_cast<uintptr_t>(page - 1);
  volatile char* v = p;
  if (n <= 0) return;
  if (end > begin && ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_POPULATE_WRITE) == 0) {
    v[0] = 0;
    v[n - 1] = 0;
    return;
  }
  for (int64_t i = 0; i < n; i += page) v[i] = 0;
  v[n - 1] = 0;
}

int cpu_cores_available() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1L, ::sysconf(_SC_NPROCESSORS_ONLN));
}

int64_t default_staging_budget(int world) {
  std::ifstream f("/proc/meminfo");
  std::string key;
  int64_t kb = 0;
  while (f >> key >> kb) {
    if (key == "MemAvailable:") return kb * 1024 / 2 / std::max(1, world);
    f.ignore(1 << 10, '\n');
  }
  return int64_t{1} << 30;
}

}  // namespace zeal::ckpt
