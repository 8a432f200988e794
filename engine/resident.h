// The process's resident set, read from /proc/self/status (ground floor: no LibTorch, used by the
// stage-3 units' memory trace and by the memory tracker).
#pragma once

#include <cstdint>

namespace zeal::detail {

// The resident set now (VmRSS) and its high-water mark (VmHWM), in bytes; 0 where unreadable.
int64_t resident_bytes();
int64_t resident_peak_bytes();

}  // namespace zeal::detail
