// Where the training thread waits (wall_clock_breakdown): time blocked on gradient reductions, on
// parameter gathers, and on reads and writes of offloaded state, summed since the last take. Process
// wide (one engine trains per rank); ground floor (no LibTorch).
#pragma once

#include <array>
#include <chrono>

namespace zeal::detail {

enum class WaitKind { kReduction = 0, kGather = 1, kRead = 2, kWrite = 3 };
constexpr int kWaitKinds = 4;

void add_wait(WaitKind kind, std::chrono::steady_clock::duration d);
// Seconds waited of each kind since the last call (in WaitKind order), and a fresh start.
std::array<double, kWaitKinds> take_waits();

// Counts the time from construction to destruction as a wait of `kind`.
class ScopedWait {
 public:
  explicit ScopedWait(WaitKind kind) : kind_(kind), start_(std::chrono::steady_clock::now()) {}
  ~ScopedWait() { add_wait(kind_, std::chrono::steady_clock::now() - start_); }
  ScopedWait(const ScopedWait&) = delete;
  ScopedWait& operator=(const ScopedWait&) = delete;

 private:
  WaitKind kind_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace zeal::detail
