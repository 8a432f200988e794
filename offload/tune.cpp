#include "offload/tune.h"

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>

#include <fmt/format.h>

#include "offload/swap_dir.h"

namespace zeal::offload {
namespace {

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

TuneResult tune_io(const std::string& dir, int64_t bytes_per_trial, double seconds,
                   const std::function<void(const TuneTrial&)>& progress) {
  const std::vector<int64_t> blocks{128 << 10, 256 << 10, 1 << 20, 4 << 20};
  const std::vector<int> depths{4, 8, 16, 32};
  const int64_t largest = blocks.back();
  const int64_t bytes = std::max<int64_t>(largest, (bytes_per_trial + largest - 1) / largest * largest);
  SwapDir swap(dir, "tune-" + new_run_id(), 0);
  swap.require(bytes + (64 << 20), "zeal offload tune");
  const int fd = swap.open_file("tune.dat");
  const std::string path = swap.path() + "/tune.dat";
  AlignedBuffer buf(bytes);
  for (int64_t i = 0; i < bytes; i += 4096) std::memset(buf.data() + i, static_cast<int>(i / 4096), 4096);
  TuneResult r;
  r.stale = swap.stale();
  const auto t0 = std::chrono::steady_clock::now();
  try {
    for (int64_t b : blocks) {
      for (int d : depths) {
        if (!r.trials.empty() && seconds_since(t0) > seconds) {
          r.stopped_early = true;
          break;
        }
        IoOptions o;
        o.block_size = b;
        o.queue_depth = d;
        o.thread_count = d;  // the fallback's threads stand in for the queue depth
        std::string why;
        auto io = make_io_engine(o, false, &why);
        r.engine = io->kind();
        r.warning = why;
        TuneTrial t;
        t.block_size = b;
        t.queue_depth = d;
        auto ts = std::chrono::steady_clock::now();
        io->write(fd, path, buf.data(), bytes, 0);
        t.write_bytes_per_s = bytes / seconds_since(ts);
        ts = std::chrono::steady_clock::now();
        io->read(fd, path, buf.data(), bytes, 0);
        t.read_bytes_per_s = bytes / seconds_since(ts);
        r.trials.push_back(t);
        if (progress) progress(t);
        if (t.swap_bytes_per_s() > r.best.swap_bytes_per_s()) r.best = t;
      }
      if (r.stopped_early) break;
    }
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  return r;
}

std::string aio_section(const TuneTrial& best) {
  return fmt::format("aio:\n  block_size: {}\n  queue_depth: {}\n  thread_count: 1\n  single_submit: false\n"
                     "  overlap_events: true\n",
                     best.block_size, best.queue_depth);
}

}  // namespace zeal::offload
