// WriteBehind: writes to one swap file that leave the caller's thread. The caller owns a few
// buffers ("slots"); it waits until a slot's last write is done, fills the slot, submits its write
// and goes on while a thread of this object, with an I/O engine of its own, writes the slots in the
// order they were submitted. ZeRO-Infinity's gradient swap-out runs this way beside the backward.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "offload/io.h"
#include "offload/swap_dir.h"

namespace zeal::offload {

// One thread submits and waits (the owner's); the writes run on this object's own.
class WriteBehind {
 public:
  // `io` is this object's own engine (an engine serves one thread at a time); `slots` ≥ 1.
  WriteBehind(std::shared_ptr<SwapFile> file, std::unique_ptr<IoEngine> io, int slots);
  // Waits for every submitted write; a failure then has no one to hear it and is dropped.
  ~WriteBehind();
  WriteBehind(const WriteBehind&) = delete;
  WriteBehind& operator=(const WriteBehind&) = delete;

  int slots() const { return static_cast<int>(busy_.size()); }
  // Waits until slot s has no write in flight; then its buffer is the caller's. Throws the first
  // failed write's IoError (a copy, also every time after: what was written since is not trusted).
  void wait_slot(int s);
  // Queues a write of `bytes` at `buf` to `offset` of the file (kIoAlign multiples), through slot s,
  // whose buffer the caller leaves alone until wait_slot(s) or drain() returns.
  void submit(int s, const void* buf, int64_t bytes, int64_t offset);
  // Waits for every submitted write; throws as wait_slot does.
  void drain();
  int64_t writes() const;  // done over the object's life

 private:
  struct Job {
    int slot;
    const void* buf;
    int64_t bytes, offset;
  };
  void run();
  void rethrow_locked() const;

  std::shared_ptr<SwapFile> file_;
  std::unique_ptr<IoEngine> io_;
  mutable std::mutex mu_;
  std::condition_variable work_, done_;
  std::deque<Job> queue_;
  std::vector<char> busy_;  // per slot: a write queued or running
  int64_t in_flight_ = 0, writes_ = 0;
  bool stop_ = false;
  std::unique_ptr<IoError> error_;  // the first failure
  std::thread thread_;              // last: started once everything above exists
};

}  // namespace zeal::offload
