#include "engine/checkpoint/staging.h"

#include <fstream>

namespace zeal::ckpt {

int64_t default_staging_budget(int local_ranks) {
  std::ifstream f("/proc/meminfo");
  std::string key;
  int64_t kb = 0;
  while (f >> key >> kb) {
    if (key == "MemAvailable:") return kb * 1024 / 2 / std::max(1, local_ranks);
    f.ignore(1 << 10, '\n');
  }
  return int64_t{1} << 30;
}

}  // namespace zeal::ckpt
