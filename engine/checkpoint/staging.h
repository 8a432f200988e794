// Where a rank's checkpoint bytes go, in order: the file's writer itself, or the host staging of an
// asynchronous save (a bounded set of chunks the training thread fills and a background thread
// writes). No LibTorch headers.
#pragma once

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/checkpoint/safetensors.h"
#include "engine/error.h"
#include "offload/prefault.h"

namespace zeal::ckpt {

// Where a rank's bytes go, in order: the writer itself, or the staging of an asynchronous save.
class Sink {
 public:
  virtual ~Sink() = default;
  virtual void append(const void* data, int64_t n) = 0;
};

class WriterSink : public Sink {
 public:
  explicit WriterSink(SafetensorsWriter& w) : w_(w) {}
  void append(const void* data, int64_t n) override { w_.append(data, n); }

 private:
  SafetensorsWriter& w_;
};

struct StagingChunk {
  explicit StagingChunk(int64_t n) : bytes(n), size(n) {}  // huge pages where the system offers them
  offload::FreshBuffer bytes;
  int64_t size = 0;
  int64_t fill = 0;
};

// Staging chunks kept from one asynchronous save for the next (SaveStateOptions::keep_staging, as
// DCP's cache_staged_state_dict): the next copy writes into pages already faulted in.
class StagingPool {
 public:
  // The pool becomes `chunks`: kept chunks the save could not use (another size) go.
  void keep(std::vector<std::unique_ptr<StagingChunk>> chunks) {
    std::lock_guard<std::mutex> lock(mu_);
    chunks_ = std::move(chunks);
  }
  // A kept chunk of `size` bytes, or null.
  std::unique_ptr<StagingChunk> take(int64_t size) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = chunks_.begin(); it != chunks_.end(); ++it) {
      if ((*it)->size != size) continue;
      auto c = std::move(*it);
      chunks_.erase(it);
      c->fill = 0;
      return c;
    }
    return nullptr;
  }
  int64_t bytes() {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t n = 0;
    for (const auto& c : chunks_) n += c->size;
    return n;
  }
  void clear() {
    std::lock_guard<std::mutex> lock(mu_);
    chunks_.clear();
  }

 private:
  std::mutex mu_;
  std::vector<std::unique_ptr<StagingChunk>> chunks_;
};

// An asynchronous save's snapshot: the training thread copies the state into at most `budget`
// bytes of host memory, in chunks; the background thread writes each chunk and gives it back. A
// state larger than the budget makes the copy wait for the writes. With a pool (keep_staging),
// chunks come from it first, written chunks are reused only once the budget is reached, and the
// pool is this save's chunks when it is over.
class Staging : public Sink {
 public:
  using Chunk = StagingChunk;
  // hold: the budget holds the whole state, so the writes wait until the copy is done (the copy,
  // which the training waits for, then has the cores to itself; DCP stages before it uploads too).
  // The chunk size a budget gets.
  static int64_t chunk_for(int64_t budget) { return std::clamp<int64_t>(budget / 4, 64 << 10, 32 << 20); }
  // Bytes of whole chunks that hold a state of `bytes` (and its file's header).
  static int64_t whole_bytes(int64_t bytes) {
    const int64_t need = bytes + (1 << 20), chunk = chunk_for(need);
    return (need + chunk - 1) / chunk * chunk;
  }
  // `budget`: whole_bytes(state) when the state fits (whole chunks of chunk_for(state + 1 MiB)).
  explicit Staging(int64_t budget, std::shared_ptr<StagingPool> pool = nullptr, bool hold = false, int64_t chunk = 0)
      : chunk_(chunk > 0 ? chunk : chunk_for(budget)),
        max_(std::max<int64_t>(2, hold ? (budget + chunk_ - 1) / chunk_ : budget / chunk_)),
        pool_(std::move(pool)),
        hold_(hold) {}
  ~Staging() override {
    if (pool_) pool_->keep(std::move(all_));
  }

  // The training thread's side.
  void append(const void* data, int64_t n) override {
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      if (!cur_) cur_ = take();
      const int64_t k = std::min(n, chunk_ - cur_->fill);
      std::memcpy(cur_->bytes.data() + cur_->fill, p, static_cast<size_t>(k));
      cur_->fill += k;
      p += k;
      n -= k;
      if (cur_->fill == chunk_) publish();
    }
  }
  void close() {
    if (cur_) publish();
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    cv_.notify_all();
  }
  // Either side: stop (the snapshot failed on some rank, or the writes did).
  void cancel(const std::string& why) {
    std::lock_guard<std::mutex> lock(mu_);
    if (error_.empty()) error_ = why;
    cv_.notify_all();
  }
  bool cancelled() {
    std::lock_guard<std::mutex> lock(mu_);
    return !error_.empty();
  }
  // The background thread's side: the next chunk to write (null when all are written).
  Chunk* next() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return (!ready_.empty() && !hold_) || closed_ || !error_.empty(); });
    if (!error_.empty()) throw Error(error_);
    if (ready_.empty()) return nullptr;
    Chunk* c = ready_.front();
    ready_.pop_front();
    return c;
  }
  void done(Chunk* c) {
    std::lock_guard<std::mutex> lock(mu_);
    c->fill = 0;
    free_.push_back(c);
    cv_.notify_all();
  }

 private:
  Chunk* take() {
    std::unique_lock<std::mutex> lock(mu_);
    if (hold_ && free_.empty() && static_cast<int64_t>(all_.size()) >= max_) {
      hold_ = false;  // never both waiting for room and holding the writes back
      cv_.notify_all();
    }
    const auto room = [&] { return static_cast<int64_t>(all_.size()) < max_; };
    cv_.wait(lock, [&] { return !free_.empty() || room() || !error_.empty(); });
    if (!error_.empty()) throw Error(error_);
    // A staging that is kept grows to the state's size (within the budget) before it reuses a
    // written chunk: what it keeps is then the same whatever the disk's pace, and holds the whole
    // state for the next save where the budget allows.
    if (!free_.empty() && !(pool_ && room())) {
      Chunk* c = free_.back();
      free_.pop_back();
      return c;
    }
    std::unique_ptr<Chunk> kept = pool_ ? pool_->take(chunk_) : nullptr;
    all_.push_back(kept ? std::move(kept) : std::make_unique<Chunk>(chunk_));
    return all_.back().get();
  }
  void publish() {
    std::lock_guard<std::mutex> lock(mu_);
    ready_.push_back(cur_);
    cur_ = nullptr;
    cv_.notify_all();
  }

  const int64_t chunk_, max_;
  std::shared_ptr<StagingPool> pool_;
  bool hold_;  // guarded by mu_
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::unique_ptr<Chunk>> all_;
  std::vector<Chunk*> free_;
  std::deque<Chunk*> ready_;
  Chunk* cur_ = nullptr;
  bool closed_ = false;
  std::string error_;
};

// Host memory an asynchronous save may stage by default: half of what is available, shared by
// the ranks on this machine.
int64_t default_staging_budget(int local_ranks);

}  // namespace zeal::ckpt
