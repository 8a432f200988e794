// `zeal offload tune`: measures a directory's disk through zeal's own I/O layer over a grid of request
// sizes and queue depths, and picks the setting that moves a write and a read of the same bytes
// fastest (what the optimizer's swap does every step). No LibTorch headers.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "offload/io.h"

namespace zeal::offload {

struct TuneTrial {
  int64_t block_size = 0;
  int queue_depth = 0;
  double write_bytes_per_s = 0, read_bytes_per_s = 0;
  // Bytes per second of a write and a read of the same bytes, back to back.
  double swap_bytes_per_s() const {
    return write_bytes_per_s > 0 && read_bytes_per_s > 0
               ? 2.0 / (1.0 / write_bytes_per_s + 1.0 / read_bytes_per_s)
               : 0;
  }
};

struct TuneResult {
  std::string engine;  // "io_uring" or "threads"
  std::string warning;  // why the thread pool was measured, if it was
  std::vector<TuneTrial> trials;
  TuneTrial best;
  bool stopped_early = false;  // the time budget ended the grid
  std::vector<std::string> stale;  // directories crashed runs left under the path, with their sizes
};

// Writes and reads `bytes_per_trial` (rounded to the largest block size) in a file under `dir` (removed
// after) for every block size × queue depth, within `seconds` (the grid stops when it is spent; at
// least one trial runs). `progress` hears of each trial.
TuneResult tune_io(const std::string& dir, int64_t bytes_per_trial, double seconds,
                   const std::function<void(const TuneTrial&)>& progress = {});

// The `aio` section to paste into a DeepSpeed-style config.
std::string aio_section(const TuneTrial& best);

}  // namespace zeal::offload
