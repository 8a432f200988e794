// Sequence numbers, check-ins and the hang report shared by the communicators (internal).
//
// Each rank publishes the sequence number of the collective it last entered to the store from a
// background thread (the collective itself only bumps a counter and copies its description under
// a mutex; no store traffic, no formatting). When a collective fails or times out, the rank
// reads every rank's progress and names the ranks that never reached it. With
// ZEAL_DEBUG_COLLECTIVES=1, ranks exchange (operation, sequence, size, dtype) through the store
// before every collective and fail with both sides of any difference.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>

#include "engine/comm/communicator.h"

namespace zeal::detail {

struct OpInfo {
  std::string name;   // "all_reduce(sum)"
  uint64_t seq = 0;
  int64_t numel = 0;
  std::string dtype;  // "float32"
  std::string describe() const;  // "collective #7 all_reduce(sum) of 1000 float32"
};

class Monitor {
 public:
  Monitor(c10::intrusive_ptr<c10d::Store> store, std::string prefix, int rank, int world,
          std::chrono::milliseconds timeout, bool debug);
  ~Monitor();
  Monitor(const Monitor&) = delete;
  Monitor& operator=(const Monitor&) = delete;

  // Enters the next collective; in debug mode checks it against every rank (throws CommError).
  OpInfo begin(std::string name, int64_t numel, std::string dtype);
  // Throws the CommError for `op`, which failed with `cause` (an exception's text).
  [[noreturn]] void fail(const OpInfo& op, const std::string& cause);

  std::chrono::milliseconds timeout() const { return timeout_; }
  uint64_t sequence() const { return seq_.load(); }
  int rank() const { return rank_; }

 private:
  void heartbeat();
  void compare(const OpInfo& op);

  c10::intrusive_ptr<c10d::Store> store_;
  std::string prefix_;
  int rank_, world_;
  std::chrono::milliseconds timeout_;
  bool debug_;
  std::atomic<uint64_t> seq_{0};
  std::mutex mu_;
  OpInfo current_;  // the collective last entered (seq 0: none yet), guarded by mu_
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

// "float32", "bfloat16", … for a c10 scalar type name.
std::string dtype_name(const std::string& c10_name);

}  // namespace zeal::detail
