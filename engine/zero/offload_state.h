// Tensors over the offload manager's host memory (offload/host_arena.h), and the optimizer step of
// a partition whose master weights and optimizer state live there (ZeRO-Offload): the gradients
// stream from the partition's device into a host buffer, the CPU kernels update the host master and
// state, and the updated compute-precision values stream back. The same on a CPU-only run (the
// copies are then host to host), so the path a GPU takes is the one the CPU tests run.
#pragma once

#include <ATen/Tensor.h>

#include <condition_variable>
#include <deque>
#include <map>
#include <future>
#include <memory>
#include <mutex>
#include <thread>

#include "offload/host_arena.h"
#include "offload/swap_dir.h"

namespace zeal::zero {

// A zero-filled tensor of n elements of `dtype` in the arena's memory, given back to the arena when
// the last reference goes (the arena is kept alive until then).
at::Tensor arena_tensor(const std::shared_ptr<offload::HostArena>& arena, int64_t n, at::ScalarType dtype);

// offload_optimizer.device nvme: where the optimizer's swap files go and how they are read.
struct NvmeOffload {
  std::shared_ptr<offload::SwapDir> dir;
  std::shared_ptr<offload::IoEngine> io;
  int64_t sub_group_elems = 1'000'000'000;  // sub_group_size: elements updated per window
  int buffer_sets = 3;                      // offload_optimizer.buffer_count, at most 3 used
};

// offload_param.device nvme (stage 3): the shards of the units that are not persistent (and not
// kept in host memory under max_in_cpu) live in one swap file per rank, each part's shard in its
// own 4 KiB-aligned region, written once when the unit is built and after every optimizer step, and
// read back for the unit's all-gather. Reads run ahead on a reader thread with its own I/O engine:
// along the fetch coordinator's recorded order, the units after those being prefetched are read
// while the current one computes, at most `buffer_count` shards and `buffer_count` × `buffer_size`
// elements at a time (offload_param.buffer_count / buffer_size). A shard read ahead is freed once
// its all-gather is done, like one read on demand.
//
// On a GPU, shards kept in host memory (offload_param.device cpu: all of them; nvme: those within
// max_in_cpu) live the same life in regions of host memory instead of the file (one arena
// allocation each, page-locked when pin_memory asks): a unit's shards leave the GPU when it is built
// and after every optimizer step, and are copied back for its all-gather (from page-locked memory
// without holding up the host). Their offsets have kHostRegion set. Read-ahead is for shards on the
// CPU; from host regions it is a copy done at once (only a test gives them CPU shards).
struct ParamSwapOptions {
  int64_t buffer_count = 5;
  int64_t buffer_elems = 100'000'000;
  int64_t max_in_cpu = 1'000'000'000;  // elements of shards per rank kept in host memory instead
};

class ParamSwap {
 public:
  // On disk: parameters.swp in `dir`; with `host`, regions asked for in host memory come from it.
  ParamSwap(std::shared_ptr<offload::SwapDir> dir, std::shared_ptr<offload::IoEngine> io,
            ParamSwapOptions options = {}, std::shared_ptr<offload::HostArena> host = nullptr);
  // In host memory only: each region an allocation of `arena`.
  ParamSwap(std::shared_ptr<offload::HostArena> arena, ParamSwapOptions options = {});
  ~ParamSwap();
  ParamSwap(const ParamSwap&) = delete;
  ParamSwap& operator=(const ParamSwap&) = delete;
  const ParamSwapOptions& options() const { return options_; }
  bool on_disk() const { return file_ != nullptr; }
  static constexpr int64_t kHostRegion = int64_t{1} << 62;
  static bool in_host(int64_t offset) { return (offset & kHostRegion) != 0; }
  bool pinned() const { return arena_ && arena_->pinned(); }  // in page-locked host memory
  // A region of `bytes` (rounded up to 4 KiB) at the end of the file, or (with `host`, or without a
  // file) its own host memory; returns its offset.
  int64_t reserve(int64_t bytes, bool host = false);
  // Writes t's bytes at `offset`: a contiguous tensor on a GPU, or on the CPU with mapped storage
  // (alloc_storage_mapped), which is written as it is, without a copy.
  void store(const at::Tensor& t, int64_t offset);
  // Gives t's storage its bytes again and reads them from `offset`.
  void load(const at::Tensor& t, int64_t offset);

  // Read-ahead of a CPU shard: whether `elems` more fit the buffers now; then start (t gets mapped
  // storage now, its bytes on the reader thread); finish() waits for one started read (rethrowing
  // its I/O error) and gives its room back.
  bool has_room(int64_t elems) const;
  struct Reading {
    std::shared_future<void> done;
    int64_t elems = 0;
    bool valid() const { return done.valid(); }
  };
  Reading start_read(const at::Tensor& t, int64_t offset);
  void finish(Reading& r);
  int64_t read_ahead_count() const { return read_ahead_count_; }  // reads started ahead, over the run
  int64_t waited_reads() const { return waited_reads_; }          // of them, not done when needed

  int64_t disk_bytes() const { return file_ ? end_ : 0; }
  // In host memory: the arena's bytes now and at most (0 on disk).
  int64_t host_bytes() const;
  int64_t host_peak() const;
  // On disk only.
  offload::SwapDir& dir() { return file_->dir(); }
  offload::SwapFile& file() { return *file_; }

 private:
  void reader_loop();
  // In host memory: the region at `offset` as a tensor shaped like t (its dtype and element count).
  at::Tensor host_region(const at::Tensor& t, int64_t offset) const;

  ParamSwapOptions options_;
  std::unique_ptr<offload::SwapFile> file_;  // on disk
  std::shared_ptr<offload::HostArena> arena_;  // in host memory
  std::map<int64_t, at::Tensor> regions_;      // in host memory: bytes by offset
  int64_t end_ = 0, host_end_ = 0;
  int copy_device_ = -1;  // the GPU asynchronous copies from host regions went to (-1: none)
  // The reader thread and its engine; jobs run in the order they were started.
  std::unique_ptr<offload::IoEngine> reader_io_;
  std::thread reader_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::packaged_task<void()>> jobs_;
  bool stop_ = false;
  int64_t in_flight_ = 0, in_flight_elems_ = 0;  // started and not yet finished
  int64_t read_ahead_count_ = 0, waited_reads_ = 0;
};

}  // namespace zeal::zero
