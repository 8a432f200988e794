// The offload manager's I/O against fio on the same directory, in one run: 4 GiB of partitions
// written and read back through offload/io.h (io_uring, O_DIRECT) and by fio (ioengine=io_uring,
// direct=1) at the same request size and queue depth, at 1 MiB and 128 KiB requests, in interleaved
// rounds; ratios round by round (median and min–max). A fifth contender writes through zeal's
// engine from only as much memory as fio's buffers hold (queue depth × request size, mapped over and
// over across each call's address range): on a virtual disk whose host copies the data out of the
// guest's memory, where the data sits decides the write's speed as much as the engine does.
//
// Then the optimizer step of a partition of S parameters (default 1e9) whose fp32 master weights
// and Adam state live in a swap file (offload_optimizer.device nvme: ShardStep, pipelined over
// windows of W elements, reading and writing at once) against its I/O floor, the faster, round by
// round, of zeal's engines replaying the step's I/O with nothing computed (after each step) and fio
// doing the same I/O on the step's own file (12·S bytes read while as many are written, 1 MiB
// requests at queue depth Q each; after all steps, since fio's writes overwrite the state). The
// device's counters show what moved. Before the step a probe asks whether the device caches what was
// just written (a virtual disk's host cache), and says so. And the step's
// peak resident set above the process's before the state existed, against the bound: the bf16
// gradients and parameters the caller holds (2 · 2 · S bytes) + the window buffers ((40 + 2) · W).
//
//   build/bin/offload_bench [--dir D] [--gib G] [--queue_depth Q] [--rounds R]
//                           [--step_params S] [--sub_group W] [--steps K] [--partition_mib P] [--json PATH]
//   build/bin/offload_bench --step_model MODEL [--step_tokens T] [--step_model_steps K] [--step_sub_group W] [--rounds R]
//                           [--dir D] [--json PATH]
//
// --step_model runs only a train_gpt preset's whole training step with its state on NVMe against the
// same step in memory (benchmarks/offload_step_model.h).
//
// D defaults to build/ (the disk the build is on); zeal and fio use one file there (the same extents
// on the disk), so G GiB and 1 GiB spare must be free, checked before anything is written, and 12·S
// bytes more for the step, at least 1 GiB + G for the cache probe (--step_params 0 skips both).
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>

#include <ATen/ATen.h>

#include "benchmarks/offload_step_model.h"
#include "benchmarks/rounds.h"
#include "engine/optim/optimizer.h"
#include "engine/zero/offload_state.h"
#include "engine/zero/shard_step.h"
#include "offload/host_arena.h"
#include "offload/io.h"
#include "offload/swap_dir.h"
#include "offload/tune.h"
#include "engine/output.h"

namespace {

using zeal::offload::AlignedBuffer;
using zeal::offload::IoOptions;


using zeal_bench::run_command;
constexpr auto& run = run_command;

// fio's bandwidth in bytes per second for one job.
double fio_bandwidth(const std::string& file, bool write, int64_t bs, int qd, int64_t bytes) {
  const std::string out =
      run(fmt::format("fio --name=zeal --filename={} --rw={} --bs={} --size={} --iodepth={} --ioengine=io_uring "
                      "--direct=1 --numjobs=1 --group_reporting --output-format=json 2>&1",
                      file, write ? "write" : "read", bs, bytes, qd));
  const auto j = nlohmann::json::parse(out.substr(out.find('{')));
  return j["jobs"][0][write ? "write" : "read"]["bw_bytes"].get<double>();
}

// `bytes` of address space over `pool` bytes of memory mapped again and again (a memfd), so one
// call of zeal's engine writes from as little memory as fio's buffers (queue depth × request size):
// what the writes cost with the data's memory taken out of the comparison.
class AliasedBuffer {
 public:
  AliasedBuffer(int64_t bytes, int64_t pool) : bytes_(bytes) {
    const int fd = ::memfd_create("offload_bench", 0);
    if (fd < 0 || ::ftruncate(fd, pool) != 0) throw std::runtime_error("memfd: " + std::string(std::strerror(errno)));
    void* base = ::mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) throw std::runtime_error("mmap: " + std::string(std::strerror(errno)));
    data_ = static_cast<char*>(base);
    for (int64_t off = 0; off < bytes; off += pool) {
      if (::mmap(data_ + off, std::min(pool, bytes - off), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) ==
          MAP_FAILED)
        throw std::runtime_error("mmap: " + std::string(std::strerror(errno)));
    }
    ::close(fd);
    std::mt19937_64 gen(7);
    for (int64_t i = 0; i < pool / 8; ++i) reinterpret_cast<uint64_t*>(data_)[i] = gen();
  }
  ~AliasedBuffer() { ::munmap(data_, bytes_); }
  char* data() const { return data_; }

 private:
  int64_t bytes_;
  char* data_ = nullptr;
};

// A field of /proc/self/status in bytes (VmRSS, VmHWM).
int64_t status_bytes(const std::string& field) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::stoll(line.substr(field.size() + 1)) * 1024;
  }
  return -1;
}

// Resets VmHWM to the current resident set.
void reset_peak() { std::ofstream("/proc/self/clear_refs") << "5"; }

// Bytes the block device under `dir` has read and written since boot (/sys/dev/block/M:m/stat,
// sectors of 512 bytes): what really moved, whatever the program counted.
struct DiskBytes {
  double read = -1, written = -1, reads = -1, writes = -1;  // bytes, and requests completed
};
DiskBytes disk_bytes(const std::string& dir) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) return {};
  std::ifstream f(fmt::format("/sys/dev/block/{}:{}/stat", major(st.st_dev), minor(st.st_dev)));
  double v[7];
  for (double& x : v) {
    if (!(f >> x)) return {};
  }
  return {v[2] * 512, v[6] * 512, v[0], v[4]};
}

// The step's own I/O done by fio, on the step's own swap file, at the same time: one job reads the
// file's `bytes` while another writes them, in `bs` requests at queue depth qd each, as the step's
// reader and writer threads do (the step reads window i+1 of master, m and v while it writes window
// i−1; fio's jobs run through the file in order instead). Its floor is the later job's time.
struct FioPattern {
  double seconds = 0, read_bw = 0, write_bw = 0;
};
FioPattern fio_step_pattern(const std::string& file, int64_t bs, int qd, int64_t bytes) {
  const std::string out = run(fmt::format(
      "fio --filename={} --bs={} --size={} --iodepth={} --ioengine=io_uring --direct=1 --output-format=json "
      "--name=r --rw=read --name=w --rw=write 2>&1",
      file, bs, bytes, qd));
  const auto j = nlohmann::json::parse(out.substr(out.find('{')));
  FioPattern f;
  f.read_bw = j["jobs"][0]["read"]["bw_bytes"].get<double>();
  f.write_bw = j["jobs"][1]["write"]["bw_bytes"].get<double>();
  f.seconds = std::max(bytes / f.read_bw, bytes / f.write_bw);
  return f;
}

// zeal's own engines doing the step's I/O with nothing computed: window i+1's three slices (master,
// m, v) read while window i−1's are written, two engines on two threads, three buffer sets
// registered with both, as ShardStep::apply does. Each window is written back from the set it was
// read into, so the file keeps the step's state. Returns the seconds.
double replay_step_io(zeal::offload::SwapFile& file, const IoOptions& o, int64_t n, int64_t window) {
  using zeal::offload::kIoAlign;
  auto up = [](int64_t b) { return (b + kIoAlign - 1) / kIoAlign * kIoAlign; };
  window = up(std::min(window, n) * 4) / 4;  // whole pages, as the step rounds its windows
  const int64_t region = up(n * 4), slice = up(window * 4);
  auto reader = zeal::offload::make_io_engine(o), writer = zeal::offload::make_io_engine(o);
  std::vector<std::unique_ptr<AlignedBuffer>> sets;
  for (int k = 0; k < 9; ++k) {
    sets.push_back(std::make_unique<AlignedBuffer>(slice));
    reader->register_buffer(sets.back()->data(), slice);
    writer->register_buffer(sets.back()->data(), slice);
  }
  auto move = [&](zeal::offload::IoEngine& io, bool write, int64_t a, int set) {
    const int64_t bytes = up(std::min(window, n - a) * 4);
    for (int r = 0; r < 3; ++r) {
      void* buf = sets[3 * set + r]->data();
      if (write) file.write(io, buf, bytes, r * region + a * 4);
      else file.read(io, buf, bytes, r * region + a * 4);
    }
  };
  return zeal_bench::seconds_of([&] {
    move(*reader, false, 0, 0);
    for (int64_t a = 0, i = 0; a < n; a += window, ++i) {
      std::future<void> reading, writing;
      if (a + window < n) reading = std::async(std::launch::async, [&, a, i] { move(*reader, false, a + window, (i + 1) % 3); });
      if (i > 0) writing = std::async(std::launch::async, [&, a, i] { move(*writer, true, a - window, (i + 2) % 3); });
      if (reading.valid()) reading.get();
      if (writing.valid()) writing.get();
    }
    move(*writer, true, (n - 1) / window * window, static_cast<int>(((n - 1) / window) % 3));
  });
}

// Whether the device keeps what was just written where reads find it faster than the disk (a virtual
// disk's host page cache does; O_DIRECT only keeps this machine's page cache out): 1 GiB written and
// read straight back by fio, then read again after `evict` bytes more were written to another file.
// A cache larger than `evict` that keeps both goes unseen, so the flag can only say yes.
struct CacheProbe {
  double hot = 0, cold = 0;
  bool caches() const { return hot > 1.25 * cold; }
};
CacheProbe probe_cache(const std::string& dir, int64_t evict) {
  const std::string a = dir + "/offload_bench_probe_a.dat", b = dir + "/offload_bench_probe_b.dat";
  const int64_t one = int64_t{1} << 30;
  CacheProbe p;
  (void)fio_bandwidth(a, true, 1 << 20, 16, one);
  p.hot = fio_bandwidth(a, false, 1 << 20, 16, one);
  (void)fio_bandwidth(b, true, 1 << 20, 16, evict);
  p.cold = fio_bandwidth(a, false, 1 << 20, 16, one);
  std::filesystem::remove(a);
  std::filesystem::remove(b);
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir = std::string(ZEAL_BUILD_DIR), json_path;
  int64_t gib = 4;
  int qd = 16, rounds = 3, steps = 3;
  int64_t step_params = 1'000'000'000, sub_group = 100'000'000;
  int64_t partition = int64_t{64} << 20;  // bytes per write or read call of the I/O measurement
  zeal_bench::StepModelOptions step_model;
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      auto next = [&]() -> std::string {
        if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
        return argv[++i];
      };
      if (a == "--dir") dir = next();
      else if (a == "--gib") gib = std::stoll(next());
      else if (a == "--queue_depth") qd = std::stoi(next());
      else if (a == "--rounds") rounds = std::stoi(next());
      else if (a == "--json") json_path = next();
      else if (a == "--step_params") step_params = static_cast<int64_t>(std::stod(next()));
      else if (a == "--sub_group") sub_group = static_cast<int64_t>(std::stod(next()));
      else if (a == "--steps") steps = std::stoi(next());
      else if (a == "--partition_mib") partition = std::stoll(next()) << 20;
      else if (a == "--step_model") step_model.model = next();
      else if (a == "--step_tokens") step_model.seq_len = std::stoll(next());
      else if (a == "--step_model_steps") step_model.steps = std::stoi(next());
      else if (a == "--step_sub_group") step_model.sub_group_size = static_cast<int64_t>(std::stod(next()));
      else throw std::invalid_argument("unknown flag " + a);
    }
    if (gib < 1 || qd < 1 || rounds < 1 || steps < 1 || sub_group < 1 || step_params < 0 || partition < (1 << 20) ||
        (gib << 30) % partition != 0)
      throw std::invalid_argument("--gib, --queue_depth, --rounds, --steps and --sub_group are ≥ 1; --partition_mib "
                                  "divides --gib's bytes");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "offload_bench: %s\nusage: offload_bench [--dir D] [--gib G] [--queue_depth Q] [--rounds R] "
                         "[--step_params S] [--sub_group W] [--steps K] [--partition_mib P] [--json PATH]\n"
                         "       offload_bench --step_model MODEL [--step_tokens T] [--step_model_steps K] [--step_sub_group W] [--rounds R] "
                         "[--dir D] [--json PATH]\n", e.what());
    return 2;
  }
  if (!step_model.model.empty()) {
    // The model's whole step on NVMe against in memory, alone.
    step_model.dir = dir;
    step_model.bin = std::string(ZEAL_BUILD_DIR) + "/bin";
    step_model.rounds = rounds;
    zeal_bench::Environment env;
    env.begin();
    nlohmann::json out;
    try {
      out["step_model"] = zeal_bench::run_step_model(step_model);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "offload_bench: %s\n", e.what());
      return 1;
    }
    env.end();
    out["nvme_step_ratio_vs_in_memory"] = out["step_model"]["nvme_step_ratio_vs_in_memory"];
    out["environment"] = env.json();
    env.print();
    if (!json_path.empty()) {
      zeal::write_file_whole(json_path, out.dump(2).append("\n"), "--json");
      std::printf("wrote %s\n", json_path.c_str());
    }
    return 0;
  }
  try {
    (void)run("fio --version");
  } catch (const std::exception&) {
    std::fprintf(stderr, "offload_bench: fio is not installed (scripts/setup installs it)\n");
    return 1;
  }
  const int64_t bytes = gib << 30;
  struct statvfs sv {};
  if (statvfs(dir.c_str(), &sv) != 0) {
    std::fprintf(stderr, "offload_bench: cannot read %s: %s\n", dir.c_str(), std::strerror(errno));
    return 1;
  }
  const int64_t free_bytes = static_cast<int64_t>(sv.f_bavail) * static_cast<int64_t>(sv.f_frsize);
  // The I/O file stays while the step's swap file (12·S bytes) or the cache probe's (1 GiB + G) exist.
  const int64_t need = bytes + (step_params > 0 ? std::max<int64_t>(12 * step_params, (int64_t{1} << 30) + bytes) : 0);
  if (free_bytes < need + (1ll << 30)) {
    std::fprintf(stderr, "offload_bench: %s has %.1f GiB free; %.1f GiB and 1 GiB spare are needed\n", dir.c_str(),
                 free_bytes / double(1 << 30), need / double(1 << 30));
    return 1;
  }
  // One file for both: the same extents on the disk, so only the I/O engines differ.
  const std::string zfile = dir + "/offload_bench.dat";
  std::printf("offload_bench: %lld GiB in %lld-MiB partitions, queue depth %d, %d rounds, in %s (%.1f GiB free)\n",
              static_cast<long long>(gib), static_cast<long long>(partition >> 20), qd, rounds, dir.c_str(),
              free_bytes / double(1 << 30));
  AlignedBuffer buf(partition);
  std::mt19937_64 gen(5);
  for (int64_t i = 0; i < partition / 8; ++i) reinterpret_cast<uint64_t*>(buf.data())[i] = gen();

  zeal_bench::Environment env;
  env.begin();
  nlohmann::json out;
  out["gib"] = gib;
  out["queue_depth"] = qd;
  out["rounds"] = rounds;
  double worst_write = 1e9, worst_read = 1e9, worst_write_same_memory = 1e9;
  for (const int64_t bs : {int64_t{1} << 20, int64_t{128} << 10}) {
    IoOptions o;
    o.block_size = bs;
    o.queue_depth = qd;
    std::string why;
    auto io = zeal::offload::make_io_engine(o, false, &why);
    if (!why.empty()) std::printf("WARNING: %s; the thread pool is measured\n", why.c_str());
    const int fd = ::open(zfile.c_str(), O_RDWR | O_CREAT | O_DIRECT, 0600);
    if (fd < 0) {
      std::fprintf(stderr, "offload_bench: cannot open %s with O_DIRECT: %s\n", zfile.c_str(), std::strerror(errno));
      return 1;
    }
    const AliasedBuffer fio_memory(partition, bs * qd);
    auto zeal_pass = [&](bool write, const char* from) {
      return zeal_bench::seconds_of([&] {
        for (int64_t off = 0; off < bytes; off += partition) {
          if (write) io->write(fd, zfile, from, partition, off);
          else io->read(fd, zfile, buf.data(), partition, off);
        }
      });
    };
    std::vector<zeal_bench::Contender> cs{
        {"zeal write", [&] { return bytes / zeal_pass(true, buf.data()); }},
        {"fio write", [&] { return fio_bandwidth(zfile, true, bs, qd, bytes); }},
        {"zeal read", [&] { return bytes / zeal_pass(false, buf.data()); }},
        {"fio read", [&] { return fio_bandwidth(zfile, false, bs, qd, bytes); }},
        {"zeal write from fio's memory", [&] { return bytes / zeal_pass(true, fio_memory.data()); }},
    };
    const auto s = zeal_bench::interleave(cs, rounds, 1, [&](int r) {
      std::printf("  %lld KiB requests: round %d of %d done\n", static_cast<long long>(bs >> 10), r, rounds);
      std::fflush(stdout);
    });
    ::close(fd);
    const auto w = zeal_bench::ratio(s[0], s[1]), r = zeal_bench::ratio(s[2], s[3]), wf = zeal_bench::ratio(s[4], s[1]),
               wm = zeal_bench::ratio(s[0], s[4]);
    worst_write = std::min(worst_write, w.median);
    worst_write_same_memory = std::min(worst_write_same_memory, wf.median);
    worst_read = std::min(worst_read, r.median);
    const std::string key = fmt::format("{}k", bs >> 10);
    std::printf("| %lld KiB | write: zeal %.2f GB/s (%.2f–%.2f), fio %.2f GB/s (%.2f–%.2f), ratio %s | read: zeal %.2f "
                "GB/s (%.2f–%.2f), fio %.2f GB/s (%.2f–%.2f), ratio %s |\n",
                static_cast<long long>(bs >> 10), s[0].median() / 1e9, s[0].min() / 1e9, s[0].max() / 1e9,
                s[1].median() / 1e9, s[1].min() / 1e9, s[1].max() / 1e9, w.text().c_str(), s[2].median() / 1e9,
                s[2].min() / 1e9, s[2].max() / 1e9, s[3].median() / 1e9, s[3].min() / 1e9, s[3].max() / 1e9,
                r.text().c_str());
    std::printf("| %lld KiB | write from fio's memory (%lld KiB mapped over each call, as fio's %d buffers): zeal %.2f GB/s "
                "(%.2f–%.2f), ratio to fio %s; zeal from its own %lld MiB ÷ from fio's memory %s |\n",
                static_cast<long long>(bs >> 10), static_cast<long long>(bs * qd >> 10), qd, s[4].median() / 1e9,
                s[4].min() / 1e9, s[4].max() / 1e9, wf.text().c_str(), static_cast<long long>(partition >> 20),
                wm.text().c_str());
    out[key] = {{"zeal_write_bytes_per_s", s[0].values}, {"fio_write_bytes_per_s", s[1].values},
                {"zeal_read_bytes_per_s", s[2].values}, {"fio_read_bytes_per_s", s[3].values},
                {"zeal_write_from_fio_memory_bytes_per_s", s[4].values}, {"engine", io->kind()}};
    zeal_bench::put_ratio(out[key], "write_ratio_vs_fio_same_memory", wf);
    zeal_bench::put_ratio(out[key], "write_own_memory_vs_fio_memory", wm);
    zeal_bench::put_ratio(out[key], "write_ratio_vs_fio", w);
    zeal_bench::put_ratio(out[key], "read_ratio_vs_fio", r);
  }
  {
    // The tuner (zeal offload tune, as "auto" runs it, with a longer budget) against the shipped
    // aio defaults (DeepSpeed's: 1 MiB requests, queue depth 8): a write and a read of the same
    // bytes through the manager, in interleaved rounds, as the optimizer's swap does each step.
    std::printf("tuner: measuring %s (at most 30 s)\n", dir.c_str());
    std::fflush(stdout);
    const auto tuned = zeal::offload::tune_io(dir, 256ll << 20, 30.0);
    IoOptions def, best;
    def.block_size = 1 << 20;
    def.queue_depth = 8;
    best.block_size = tuned.best.block_size;
    best.queue_depth = tuned.best.queue_depth;
    auto io_def = zeal::offload::make_io_engine(def), io_best = zeal::offload::make_io_engine(best);
    const int fd = ::open(zfile.c_str(), O_RDWR | O_CREAT | O_DIRECT, 0600);
    const int64_t swap_bytes = std::min<int64_t>(bytes, 2ll << 30);
    auto swap_pass = [&](zeal::offload::IoEngine& io) {
      const double t = zeal_bench::seconds_of([&] {
        for (int64_t off = 0; off < swap_bytes; off += partition) io.write(fd, zfile, buf.data(), partition, off);
        for (int64_t off = 0; off < swap_bytes; off += partition) io.read(fd, zfile, buf.data(), partition, off);
      });
      return 2.0 * swap_bytes / t;
    };
    std::vector<zeal_bench::Contender> cs{{"defaults", [&] { return swap_pass(*io_def); }},
                                          {"tuned", [&] { return swap_pass(*io_best); }}};
    const auto s = zeal_bench::interleave(cs, rounds, 1, [&](int r) {
      std::printf("  tuner vs defaults: round %d of %d done\n", r, rounds);
      std::fflush(stdout);
    });
    ::close(fd);
    const auto ratio = zeal_bench::ratio(s[1], s[0]);
    std::printf("| tuner | chose %lld KiB x %d (%zu trials%s) | write+read through the manager: tuned %.2f GB/s "
                "(%.2f–%.2f), defaults 1024 KiB x 8 %.2f GB/s (%.2f–%.2f), ratio %s |\n",
                static_cast<long long>(best.block_size >> 10), best.queue_depth, tuned.trials.size(),
                tuned.stopped_early ? ", budget ended the grid" : "", s[1].median() / 1e9, s[1].min() / 1e9,
                s[1].max() / 1e9, s[0].median() / 1e9, s[0].min() / 1e9, s[0].max() / 1e9, ratio.text().c_str());
    out["tuner"] = {{"block_size", best.block_size},           {"queue_depth", best.queue_depth},
                    {"trials", tuned.trials.size()},          {"stopped_early", tuned.stopped_early},
                    {"tuned_swap_bytes_per_s", s[1].values},  {"default_swap_bytes_per_s", s[0].values},
                    {"default_block_size", def.block_size},   {"default_queue_depth", def.queue_depth}};
    zeal_bench::put_ratio(out["tuner"], "tuned_ratio_vs_defaults", ratio);
    out["tuned_ratio_vs_defaults"] = ratio.median;
  }
  if (step_params > 0) {
    // Does the device cache? Asked before the step, with the I/O measurement's size as the eviction.
    const CacheProbe cache = probe_cache(dir, bytes);
    std::printf("cache probe: 1 GiB read back at once %.2f GB/s, after %lld GiB more written %.2f GB/s: %s\n",
                cache.hot / 1e9, static_cast<long long>(gib), cache.cold / 1e9,
                cache.caches() ? "THE DEVICE CACHES what was just written (reads of fresh data are not the disk's)"
                               : "no cache seen");
    // The step: state written once (the offload), then K steps, each timed and its peak resident
    // set taken, each followed by fio running the step's own I/O on the step's own file: the floor.
    const int64_t n = step_params;
    const int64_t before = status_bytes("VmRSS");
    std::printf("step: %.2f G parameters, windows of %.0f M elements, %d steps, then fio doing the step's I/O as often\n",
                n / 1e9, sub_group / 1e6, steps);
    std::fflush(stdout);
    const std::string run_id = zeal::offload::new_run_id();
    auto sdir = std::make_shared<zeal::offload::SwapDir>(dir, run_id, 0);
    IoOptions o;
    o.block_size = 1 << 20;
    o.queue_depth = qd;
    std::shared_ptr<zeal::offload::IoEngine> io = zeal::offload::make_io_engine(o);
    auto arena = std::make_shared<zeal::offload::HostArena>(false);
    at::Tensor grad = at::full({n}, 1e-3, at::kBFloat16), param = at::zeros({n}, at::kBFloat16);
    double init_s = 0;
    std::vector<double> step_s, peak, floor_s, floor_read, floor_write, disk_read, disk_written, replay_s;
    const double moved = 12.0 * n;  // master, m and v: read once and written once per step
    {
      zeal::optim::Hyper h;
      h.weight_decay = 0.01;
      std::vector<zeal::zero::ShardStep::Piece> pieces{{0, grad, param}};
      zeal::zero::ShardStep step(at::full({n}, 0.5f, at::kFloat), zeal::optim::make_fused_adamw(h), pieces);
      auto file = std::make_shared<zeal::offload::SwapFile>(sdir, io, "optimizer.swp");
      init_s = zeal_bench::seconds_of([&] { step.offload_to_nvme(arena, file, sub_group); });
      // Round k: the step, then zeal's engines replaying its I/O (which leaves the state as it was).
      for (int k = 0; k < steps; ++k) {
        reset_peak();
        const DiskBytes d0 = disk_bytes(dir);
        step_s.push_back(zeal_bench::seconds_of([&] {
          step.apply(1e-3, 1.0);
          step.finish_writes();  // the step's whole I/O, its last window's write-back included
        }));
        const DiskBytes d1 = disk_bytes(dir);
        peak.push_back(static_cast<double>(status_bytes("VmHWM") - before));
        disk_read.push_back(d1.read - d0.read), disk_written.push_back(d1.written - d0.written);
        const double read_kib = disk_read.back() / std::max(1.0, d1.reads - d0.reads) / 1024;
        const double write_kib = disk_written.back() / std::max(1.0, d1.writes - d0.writes) / 1024;
        replay_s.push_back(replay_step_io(*file, o, n, sub_group));
        std::printf("  step %d: %.2f s, the device read %.2f GB and wrote %.2f GB (the step counts %.2f each; requests "
                    "of %.0f and %.0f KiB on average), peak resident set %.2f GiB above the start; its I/O alone "
                    "through zeal's engines %.2f s\n",
                    k + 1, step_s.back(), disk_read.back() / 1e9, disk_written.back() / 1e9, moved / 1e9, read_kib,
                    write_kib, peak.back() / double(1 << 30), replay_s.back());
        std::fflush(stdout);
      }
      // fio's writes overwrite the state, so fio runs once the steps are done.
      for (int k = 0; k < steps; ++k) {
        const FioPattern f = fio_step_pattern(file->path(), o.block_size, qd, static_cast<int64_t>(moved));
        floor_s.push_back(f.seconds), floor_read.push_back(f.read_bw), floor_write.push_back(f.write_bw);
        std::printf("  fio doing the step's I/O, round %d: %.2f s (reads %.2f GB/s, writes %.2f GB/s at once)\n", k + 1,
                    f.seconds, f.read_bw / 1e9, f.write_bw / 1e9);
        std::fflush(stdout);
      }
    }
    const double fio_r = zeal_bench::Series{out["1024k"]["fio_read_bytes_per_s"].get<std::vector<double>>()}.median();
    const double fio_w = zeal_bench::Series{out["1024k"]["fio_write_bytes_per_s"].get<std::vector<double>>()}.median();
    // The model the floor replaced: reads and writes perfectly overlapped, each at the bandwidth fio
    // reached alone on the I/O measurement's file. Printed beside it to show what it missed.
    const double separate_s = std::max(moved / fio_r, moved / fio_w);
    const double bound = 2.0 * 2 * n + (40.0 + 2) * std::min(sub_group, n);
    // The floor of round k: the faster of fio and zeal's own engines doing the step's I/O.
    std::vector<double> floor_best;
    for (int k = 0; k < steps; ++k) floor_best.push_back(std::min(floor_s[k], replay_s[k]));
    const zeal_bench::Series st{step_s}, pk{peak}, fl{floor_s}, rp{replay_s}, best{floor_best};
    const zeal_bench::Ratio step_ratio = zeal_bench::ratio(st, best), over_replay = zeal_bench::ratio(st, rp);
    const double host_ratio = pk.max() / bound;
    std::printf("| step | %.2f s (%.2f–%.2f) | I/O floor %.2f s: the faster, round by round, of fio doing the step's "
                "I/O on its file (%.1f GB read while as much is written: %.2f s (%.2f–%.2f), reads %.2f GB/s, writes "
                "%.2f GB/s) and zeal's engines doing it with nothing computed (%.2f s (%.2f–%.2f)) | ratio %s (goal <= "
                "1.25); step / its I/O alone %s | reads and writes each at fio's separate bandwidths would take %.2f s "
                "| peak %.2f GiB vs bound %.2f GiB: %.3f | state written in %.2f s |\n",
                st.median(), st.min(), st.max(), best.median(), moved / 1e9, fl.median(), fl.min(), fl.max(),
                zeal_bench::Series{floor_read}.median() / 1e9, zeal_bench::Series{floor_write}.median() / 1e9,
                rp.median(), rp.min(), rp.max(), step_ratio.text(3).c_str(), over_replay.text(3).c_str(), separate_s,
                pk.max() / double(1 << 30), bound / double(1 << 30), host_ratio, init_s);
    if (cache.caches()) {
      std::printf("NOTE: the device caches what was just written, so these floors are the cache's, not the disk's\n");
    }
    out["cache_probe"] = {{"hot_read_bytes_per_s", cache.hot}, {"cold_read_bytes_per_s", cache.cold},
                          {"evicting_bytes", bytes},           {"device_caches", cache.caches()}};
    out["step"] = {{"parameters", n},
                   {"sub_group_size", sub_group},
                   {"step_s", step_s},
                   {"io_floor_s", floor_best},
                   {"fio_step_pattern_s", floor_s},
                   {"zeal_io_alone_s", replay_s},
                   {"io_floor_read_bytes_per_s", floor_read},
                   {"io_floor_write_bytes_per_s", floor_write},
                   {"bytes_read", moved},
                   {"bytes_written", moved},
                   {"device_bytes_read", disk_read},
                   {"device_bytes_written", disk_written},
                   {"separate_fio_floor_s", separate_s},
                   {"fio_read_bytes_per_s", fio_r},
                   {"fio_write_bytes_per_s", fio_w},
                   {"peak_rss_above_start", peak},
                   {"host_bound_bytes", bound},
                   {"initial_write_s", init_s},
                   {"io_engine", io->kind()}};
    zeal_bench::put_ratio(out, "step_ratio_vs_io_floor", step_ratio);
    zeal_bench::put_ratio(out, "step_ratio_vs_its_io_alone", over_replay);
    out["host_peak_ratio_vs_bound"] = host_ratio;
  }
  env.end();
  out["write_ratio_vs_fio"] = worst_write;  // the smaller of the two sizes'
  out["read_ratio_vs_fio"] = worst_read;
  out["write_ratio_vs_fio_same_memory"] = worst_write_same_memory;
  out["environment"] = env.json();
  std::printf("write_ratio_vs_fio %.3f, read_ratio_vs_fio %.3f, write_ratio_vs_fio_same_memory %.3f (the smaller of "
              "the two request sizes; goal >= 1.0)\n",
              worst_write, worst_read, worst_write_same_memory);
  env.print();
  std::filesystem::remove(zfile);
  if (!json_path.empty()) {
    zeal::write_file_whole(json_path, out.dump(2).append("\n"), "--json");
    std::printf("wrote %s\n", json_path.c_str());
  }
  return 0;
}
