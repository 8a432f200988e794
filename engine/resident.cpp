#include "engine/resident.h"

#include <fstream>
#include <string>

namespace zeal::detail {
namespace {

int64_t status_field(const char* field) {
  std::ifstream f("/proc/self/status");
  std::string line;
  const size_t n = std::char_traits<char>::length(field);
  while (std::getline(f, line)) {
    if (line.compare(0, n, field) == 0 && line.size() > n && line[n] == ':') return std::stoll(line.substr(n + 1)) * 1024;
  }
  return 0;
}

}  // namespace

int64_t resident_bytes() { return status_field("VmRSS"); }
int64_t resident_peak_bytes() { return status_field("VmHWM"); }

}  // namespace zeal::detail
