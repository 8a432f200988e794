#include "engine/wait_clock.h"

#include <atomic>
#include <cstdint>

namespace zeal::detail {
namespace {
std::array<std::atomic<int64_t>, kWaitKinds> g_waited{};  // nanoseconds
}  // namespace

void add_wait(WaitKind kind, std::chrono::steady_clock::duration d) {
  g_waited[static_cast<int>(kind)].fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(d).count(),
                                             std::memory_order_relaxed);
}

std::array<double, kWaitKinds> take_waits() {
  std::array<double, kWaitKinds> out{};
  for (int k = 0; k < kWaitKinds; ++k) out[k] = static_cast<double>(g_waited[k].exchange(0)) * 1e-9;
  return out;
}

}  // namespace zeal::detail
