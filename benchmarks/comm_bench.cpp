// comm_bench: zeal's Gloo communicator beside raw c10d ProcessGroupGloo calls, in one run, on
// ranks started by zeal::spawn on this machine.
//
//   build/bin/comm_bench [--world N] [--min_kib K] [--max_mib M] [--min_seconds S] [--rounds R] [--json PATH]
//
// For all_gather, reduce_scatter and all_reduce of float32 buffers from 4 KiB to M MiB (the
// buffer is the all-gather output, the reduce-scatter input, the all-reduce tensor), it prints
// bus bandwidth as nccl-tests defines it (algorithm bandwidth × (n-1)/n, × 2(n-1)/n for
// all-reduce) and zeal/c10d: each size runs R rounds alternating which of the two goes first, and
// prints each side's median with its min–max and the per-round ratio's median with its min–max.
// c10d's Gloo reduce_scatter is an all-reduce plus a copy; zeal's is a ring. Ranks on one machine talk over loopback TCP, which copies every byte through memory:
// the single-thread memcpy bandwidth printed first bounds what one rank's transfers can reach.
#define USE_C10D_GLOO 1
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "benchmarks/rounds.h"

#include "engine/runtime/runtime.h"
#include "engine/runtime/spawn.h"
#include "engine/output.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Row {
  std::string op;
  int64_t bytes;
  zeal_bench::Series zeal_s, c10d_s;  // seconds per call, one value per round
  zeal_bench::Ratio ratio() const { return zeal_bench::ratio(c10d_s, zeal_s); }  // zeal's speed / c10d's
};

double memcpy_gbs() {
  const size_t n = size_t{256} << 20;
  std::vector<char> a(n, 1), b(n, 2);
  double best = 1e9;
  for (int i = 0; i < 5; ++i) {
    const auto t0 = Clock::now();
    std::memcpy(b.data(), a.data(), n);
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return n / best / 1e9;
}

// Seconds per call of each of two ops, one value per round: a round times `iters` calls of one,
// then of the other, alternating which goes first (rounds.h's interleaving for two contenders).
// Every rank runs the same number of calls: rank 0 picks it (about min_seconds per round) and
// broadcasts it.
std::pair<zeal_bench::Series, zeal_bench::Series> time_pair(zeal::Communicator& comm, const std::function<void()>& a,
                                                            const std::function<void()>& b, double min_seconds,
                                                            int rounds) {
  a();  // warm-up: connections, page faults
  b();
  const auto t0 = Clock::now();
  a();
  const double once = std::chrono::duration<double>(Clock::now() - t0).count();
  at::Tensor count = at::full({1}, std::max<int64_t>(3, static_cast<int64_t>(min_seconds / std::max(once, 1e-6))), at::kLong);
  comm.broadcast(count, 0).wait();
  const int64_t iters = count.item<int64_t>();
  zeal_bench::Series sa, sb;
  for (int round = 0; round < rounds; ++round) {
    for (int w = 0; w < 2; ++w) {
      const int which = (w + round) % 2;  // alternate which goes first
      comm.barrier().wait();
      const auto start = Clock::now();
      for (int64_t i = 0; i < iters; ++i) (which == 0 ? a : b)();
      const double t = std::chrono::duration<double>(Clock::now() - start).count() / iters;
      (which == 0 ? sa : sb).values.push_back(t);
    }
  }
  return {sa, sb};
}

}  // namespace

int main(int argc, char** argv) {
  int world = 2;
  int max_mib = 256;
  int rounds = 7;
  int64_t min_kib = 4;
  double min_seconds = 0.3;
  std::string json_path;
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      auto next = [&]() -> std::string {
        if (i + 1 >= argc) throw std::invalid_argument(a + " expects a value");
        return argv[++i];
      };
      if (a == "--world") world = std::stoi(next());
      else if (a == "--max_mib") max_mib = std::stoi(next());
      else if (a == "--min_kib") min_kib = std::stoll(next());
      else if (a == "--min_seconds") min_seconds = std::stod(next());
      else if (a == "--rounds") rounds = std::stoi(next());
      else if (a == "--json") json_path = next();
      else throw std::invalid_argument(a == "--help" ? "" : "unknown flag " + a);
    }
    if (world < 2 || rounds < 1 || min_kib < 1 || max_mib < 1 || !(min_seconds > 0)) {
      throw std::invalid_argument("--world ≥ 2, --rounds ≥ 1, sizes and --min_seconds positive");
    }
  } catch (const std::exception& e) {
    if (*e.what()) std::fprintf(stderr, "comm_bench: %s\n", e.what());
    std::fprintf(stderr, "usage: comm_bench [--world N] [--min_kib K] [--max_mib M] [--min_seconds S] [--rounds R] "
                         "[--json PATH]\n");
    return *e.what() ? 2 : 0;
  }
  std::printf("comm_bench: %d ranks on this machine (gloo over loopback), float32, %d rounds alternating zeal and c10d\n",
              world, rounds);
  std::printf("single-thread memcpy bandwidth (the copy every loopback byte costs): %.2f GB/s\n\n", memcpy_gbs());
  std::printf("op              size      zeal GB/s, median (min–max)      c10d GB/s, median (min–max)      zeal/c10d\n");
  std::fflush(stdout);

  zeal_bench::Environment env;
  env.begin();
  const std::string rows_path = "/tmp/comm_bench_rows." + std::to_string(::getpid());
  zeal::SpawnOptions so;
  so.comm_timeout = 600;
  auto results = zeal::spawn(
      [&](zeal::Runtime& rt) {
        at::set_num_threads(1);
        // The raw c10d peer: its own ProcessGroupGloo on the same store.
        c10d::TCPStoreOptions o;
        o.port = static_cast<uint16_t>(rt.env().master_port);
        o.isServer = false;
        o.waitWorkers = false;
        auto store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", o);
        auto opts = c10d::ProcessGroupGloo::Options::create_default(std::chrono::minutes(10));
        opts->threads = 2;
        opts->devices = {c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1")};
        auto pg = c10::make_intrusive<c10d::ProcessGroupGloo>(c10::make_intrusive<c10d::PrefixStore>("bench", store),
                                                             rt.rank(), rt.world_size(), opts);
        zeal::Communicator& comm = rt.comm();
        const int n = rt.world_size();
        nlohmann::json rows = nlohmann::json::array();
        for (int64_t bytes = min_kib << 10; bytes <= (int64_t{max_mib} << 20); bytes *= 4) {
          const int64_t total = bytes / 4, shard = comm.shard_size(total);
          at::Tensor flat = at::rand({total});
          at::Tensor part = at::rand({shard});
          at::Tensor out = at::empty({total});
          at::Tensor part_out = at::empty({shard});
          Row ag{"all_gather", bytes, {}, {}};
          std::tie(ag.zeal_s, ag.c10d_s) = time_pair(
              comm, [&] { comm.all_gather(part, out).wait(); }, [&] { pg->_allgather_base(out, part)->wait(); },
              min_seconds, rounds);
          Row rs{"reduce_scatter", bytes, {}, {}};
          std::tie(rs.zeal_s, rs.c10d_s) = time_pair(
              comm, [&] { comm.reduce_scatter(flat, part_out, zeal::ReduceOp::kSum).wait(); },
              [&] { pg->_reduce_scatter_base(part_out, flat)->wait(); }, min_seconds, rounds);
          Row ar{"all_reduce", bytes, {}, {}};
          std::tie(ar.zeal_s, ar.c10d_s) = time_pair(
              comm, [&] { comm.all_reduce(flat, zeal::ReduceOp::kSum).wait(); },
              [&] {
                std::vector<at::Tensor> t{flat};
                pg->allreduce(t)->wait();
              },
              min_seconds, rounds);
          for (const Row& r : {ag, rs, ar}) {
            if (rt.rank() != 0) continue;
            // Bus bandwidth (nccl-tests): bytes / time × (n − 1)/n, × 2 for all-reduce.
            const double factor = (r.op == "all_reduce" ? 2.0 : 1.0) * (n - 1) / n;
            auto gbs = [&](double s) { return r.bytes / s / 1e9 * factor; };
            const zeal_bench::Ratio q = r.ratio();
            std::printf("%-15s %9s  %7.3f (%.3f–%.3f)  %7.3f (%.3f–%.3f)  %s\n", r.op.c_str(),
                        r.bytes >= (1 << 20) ? fmt::format("{} MiB", r.bytes >> 20).c_str()
                                             : fmt::format("{} KiB", r.bytes >> 10).c_str(),
                        gbs(r.zeal_s.median()), gbs(r.zeal_s.max()), gbs(r.zeal_s.min()), gbs(r.c10d_s.median()),
                        gbs(r.c10d_s.max()), gbs(r.c10d_s.min()), q.text().c_str());
            std::fflush(stdout);
            nlohmann::json row = {{"op", r.op},
                                  {"bytes", r.bytes},
                                  {"zeal_seconds", r.zeal_s.median()},
                                  {"c10d_seconds", r.c10d_s.median()},
                                  {"zeal_seconds_spread", {r.zeal_s.min(), r.zeal_s.max()}},
                                  {"c10d_seconds_spread", {r.c10d_s.min(), r.c10d_s.max()}},
                                  {"zeal_busbw_gbs", gbs(r.zeal_s.median())},
                                  {"c10d_busbw_gbs", gbs(r.c10d_s.median())}};
            zeal_bench::put_ratio(row, "ratio", q);
            rows.push_back(row);
          }
        }
        if (rt.rank() == 0) std::ofstream(rows_path) << rows.dump();
      },
      world, so);
  env.end();
  const std::string failures = zeal::describe_failures(results);
  if (!failures.empty()) {
    std::fprintf(stderr, "comm_bench failed:\n%s", failures.c_str());
    std::remove(rows_path.c_str());
    return 1;
  }
  std::printf("\n");
  env.print();
  if (!json_path.empty()) {
    nlohmann::json out = {{"world", world}, {"dtype", "float32"}, {"rounds", rounds}, {"memcpy_gbs", memcpy_gbs()}};
    out["rows"] = nlohmann::json::parse(std::ifstream(rows_path));
    out["environment"] = env.json();
    zeal::write_file_whole(json_path, out.dump(2).append("\n"), "--json");
    std::printf("wrote %s\n", json_path.c_str());
  }
  std::remove(rows_path.c_str());
  return 0;
}
