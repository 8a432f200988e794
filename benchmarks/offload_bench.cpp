// The offload manager's I/O against fio on the same directory, in one run: 4 GiB of partitions
// written and read back through offload/io.h (io_uring, O_DIRECT) and by fio (ioengine=io_uring,
// direct=1) at the same request size and queue depth, at 1 MiB and 128 KiB requests, in interleaved
// rounds; ratios round by round (median and min–max).
//
// Then the optimizer step of a partition of S parameters (default 1e9) whose fp32 master weights
// and Adam state live in a swap file (offload_optimizer.device nvme: ShardStep, pipelined over
// windows of W elements, reading and writing at once) against its I/O floor: the bytes it reads ÷
// fio's read bandwidth or the bytes it writes ÷ fio's write bandwidth, whichever is longer (reads
// and writes perfectly overlapped; fio's 1 MiB figures of this run). fio reading and writing at
// once (one job each, queue depth Q each) is measured too and reported beside it. And the step's peak
// resident set above the process's before the state existed, against the bound: the bf16
// gradients and parameters the caller holds (2 · 2 · S bytes) + the window buffers ((40 + 2) · W).
//
//   build/bin/offload_bench [--dir D] [--gib G] [--queue_depth Q] [--rounds R]
//                           [--step_params S] [--sub_group W] [--steps K] [--json PATH]
//
// D defaults to build/ (the disk the build is on); zeal and fio use one file there (the same extents
// on the disk), so G GiB and 1 GiB spare must be free, checked before anything is written, and 12·S
// bytes more for the step (--step_params 0 skips it).
#include <fcntl.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include <ATen/ATen.h>

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

constexpr int64_t kPartition = 64 << 20;  // bytes per write or read call: one partition

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

// fio reading and writing at once: one job reading the file's first half while another writes its
// second half, each at queue depth qd (as zeal's reader and writer): both jobs' bytes per second.
double fio_duplex_bandwidth(const std::string& file, int64_t bs, int qd, int64_t bytes) {
  const std::string out = run(fmt::format(
      "fio --filename={} --bs={} --size={} --iodepth={} --ioengine=io_uring --direct=1 --output-format=json "
      "--name=r --rw=read --offset=0 --name=w --rw=write --offset={} 2>&1",
      file, bs, bytes / 2, qd, bytes / 2));
  const auto j = nlohmann::json::parse(out.substr(out.find('{')));
  return j["jobs"][0]["read"]["bw_bytes"].get<double>() + j["jobs"][1]["write"]["bw_bytes"].get<double>();
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir = std::string(ZEAL_BUILD_DIR), json_path;
  int64_t gib = 4;
  int qd = 16, rounds = 3, steps = 3;
  int64_t step_params = 1'000'000'000, sub_group = 100'000'000;
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
      else throw std::invalid_argument("unknown flag " + a);
    }
    if (gib < 1 || qd < 1 || rounds < 1 || steps < 1 || sub_group < 1 || step_params < 0)
      throw std::invalid_argument("--gib, --queue_depth, --rounds, --steps and --sub_group are ≥ 1");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "offload_bench: %s\nusage: offload_bench [--dir D] [--gib G] [--queue_depth Q] [--rounds R] "
                         "[--step_params S] [--sub_group W] [--steps K] [--json PATH]\n", e.what());
    return 2;
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
  if (free_bytes < bytes + 12 * step_params + (1ll << 30)) {
    std::fprintf(stderr, "offload_bench: %s has %.1f GiB free; %.1f GiB and 1 GiB spare are needed\n", dir.c_str(),
                 free_bytes / double(1 << 30), (bytes + 12 * step_params) / double(1 << 30));
    return 1;
  }
  // One file for both: the same extents on the disk, so only the I/O engines differ.
  const std::string zfile = dir + "/offload_bench.dat";
  std::printf("offload_bench: %lld GiB in %lld-MiB partitions, queue depth %d, %d rounds, in %s (%.1f GiB free)\n",
              static_cast<long long>(gib), static_cast<long long>(kPartition >> 20), qd, rounds, dir.c_str(),
              free_bytes / double(1 << 30));
  AlignedBuffer buf(kPartition);
  std::mt19937_64 gen(5);
  for (int64_t i = 0; i < kPartition / 8; ++i) reinterpret_cast<uint64_t*>(buf.data())[i] = gen();

  zeal_bench::Environment env;
  env.begin();
  nlohmann::json out;
  out["gib"] = gib;
  out["queue_depth"] = qd;
  out["rounds"] = rounds;
  double worst_write = 1e9, worst_read = 1e9;
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
    auto zeal_pass = [&](bool write) {
      return zeal_bench::seconds_of([&] {
        for (int64_t off = 0; off < bytes; off += kPartition) {
          if (write) io->write(fd, zfile, buf.data(), kPartition, off);
          else io->read(fd, zfile, buf.data(), kPartition, off);
        }
      });
    };
    std::vector<zeal_bench::Contender> cs{
        {"zeal write", [&] { return bytes / zeal_pass(true); }},
        {"fio write", [&] { return fio_bandwidth(zfile, true, bs, qd, bytes); }},
        {"zeal read", [&] { return bytes / zeal_pass(false); }},
        {"fio read", [&] { return fio_bandwidth(zfile, false, bs, qd, bytes); }},
    };
    const auto s = zeal_bench::interleave(cs, rounds, 1, [&](int r) {
      std::printf("  %lld KiB requests: round %d of %d done\n", static_cast<long long>(bs >> 10), r, rounds);
      std::fflush(stdout);
    });
    ::close(fd);
    const auto w = zeal_bench::ratio(s[0], s[1]), r = zeal_bench::ratio(s[2], s[3]);
    worst_write = std::min(worst_write, w.median);
    worst_read = std::min(worst_read, r.median);
    const std::string key = fmt::format("{}k", bs >> 10);
    std::printf("| %lld KiB | write: zeal %.2f GB/s (%.2f–%.2f), fio %.2f GB/s (%.2f–%.2f), ratio %s | read: zeal %.2f "
                "GB/s (%.2f–%.2f), fio %.2f GB/s (%.2f–%.2f), ratio %s |\n",
                static_cast<long long>(bs >> 10), s[0].median() / 1e9, s[0].min() / 1e9, s[0].max() / 1e9,
                s[1].median() / 1e9, s[1].min() / 1e9, s[1].max() / 1e9, w.text().c_str(), s[2].median() / 1e9,
                s[2].min() / 1e9, s[2].max() / 1e9, s[3].median() / 1e9, s[3].min() / 1e9, s[3].max() / 1e9,
                r.text().c_str());
    out[key] = {{"zeal_write_bytes_per_s", s[0].values}, {"fio_write_bytes_per_s", s[1].values},
                {"zeal_read_bytes_per_s", s[2].values}, {"fio_read_bytes_per_s", s[3].values},
                {"engine", io->kind()}};
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
        for (int64_t off = 0; off < swap_bytes; off += kPartition) io.write(fd, zfile, buf.data(), kPartition, off);
        for (int64_t off = 0; off < swap_bytes; off += kPartition) io.read(fd, zfile, buf.data(), kPartition, off);
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
    // The step: state written once (the offload), then K steps, each timed and its peak resident
    // set taken; fio's 1 MiB bandwidths of this run give the floor.
    std::vector<double> fio_duplex{fio_duplex_bandwidth(zfile, 1 << 20, qd, bytes)};
    const int64_t n = step_params;
    const int64_t before = status_bytes("VmRSS");
    std::printf("step: %.2f G parameters, windows of %.0f M elements, %d steps\n", n / 1e9, sub_group / 1e6, steps);
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
    std::vector<double> step_s, peak;
    {
      zeal::optim::Hyper h;
      h.weight_decay = 0.01;
      std::vector<zeal::zero::ShardStep::Piece> pieces{{0, grad, param}};
      zeal::zero::ShardStep step(at::full({n}, 0.5f, at::kFloat), zeal::optim::make_fused_adamw(h), pieces);
      init_s = zeal_bench::seconds_of([&] {
        step.offload_to_nvme(arena, std::make_shared<zeal::offload::SwapFile>(sdir, io, "optimizer.swp"), sub_group);
      });
      for (int k = 0; k < steps; ++k) {
        reset_peak();
        step_s.push_back(zeal_bench::seconds_of([&] { step.apply(1e-3, 1.0); }));
        peak.push_back(static_cast<double>(status_bytes("VmHWM") - before));
        std::printf("  step %d: %.2f s, peak resident set %.2f GiB above the start\n", k + 1, step_s.back(),
                    peak.back() / double(1 << 30));
        std::fflush(stdout);
      }
    }
    fio_duplex.push_back(fio_duplex_bandwidth(zfile, 1 << 20, qd, bytes));
    const double fio_bw = zeal_bench::Series{fio_duplex}.median();
    const double fio_r = zeal_bench::Series{out["1024k"]["fio_read_bytes_per_s"].get<std::vector<double>>()}.median();
    const double fio_w = zeal_bench::Series{out["1024k"]["fio_write_bytes_per_s"].get<std::vector<double>>()}.median();
    const double moved = 12.0 * n;  // master, m and v: read once and written once per step
    // The strictest floor: reads and writes perfectly overlapped, each at fio's own bandwidth.
    const double floor_s = std::max(moved / fio_r, moved / fio_w);
    const double bound = 2.0 * 2 * n + (40.0 + 2) * std::min(sub_group, n);
    const zeal_bench::Series st{step_s}, pk{peak};
    const double step_ratio = st.median() / floor_s, host_ratio = pk.max() / bound;
    std::printf("| step | %.2f s (%.2f–%.2f) | I/O floor %.2f s (%.1f GB read at fio's %.2f GB/s while as much is "
                "written at %.2f GB/s; fio doing both at once moved %.2f GB/s) | ratio %.3f (goal <= 1.25) | peak "
                "%.2f GiB vs bound %.2f GiB: %.3f | state written in %.2f s |\n",
                st.median(), st.min(), st.max(), floor_s, moved / 1e9, fio_r / 1e9, fio_w / 1e9, fio_bw / 1e9, step_ratio,
                pk.max() / double(1 << 30), bound / double(1 << 30), host_ratio, init_s);
    out["step"] = {{"parameters", n},          {"sub_group_size", sub_group},   {"step_s", step_s},
                   {"io_floor_s", floor_s},    {"bytes_read", moved},           {"bytes_written", moved},
                   {"fio_read_and_write_bytes_per_s", fio_duplex}, {"fio_read_bytes_per_s", fio_r},
                   {"fio_write_bytes_per_s", fio_w}, {"peak_rss_above_start", peak},
                   {"host_bound_bytes", bound}, {"initial_write_s", init_s},    {"io_engine", io->kind()}};
    out["step_ratio_vs_io_floor"] = step_ratio;
    out["host_peak_ratio_vs_bound"] = host_ratio;
  }
  env.end();
  out["write_ratio_vs_fio"] = worst_write;  // the smaller of the two sizes'
  out["read_ratio_vs_fio"] = worst_read;
  out["environment"] = env.json();
  std::printf("write_ratio_vs_fio %.3f, read_ratio_vs_fio %.3f (the smaller of the two request sizes; goal >= 1.0)\n",
              worst_write, worst_read);
  env.print();
  std::filesystem::remove(zfile);
  if (!json_path.empty()) {
    zeal::write_file_whole(json_path, out.dump(2).append("\n"), "--json");
    std::printf("wrote %s\n", json_path.c_str());
  }
  return 0;
}
