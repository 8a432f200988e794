// comm_bench: zeal's Gloo communicator beside raw c10d ProcessGroupGloo calls, in one run, on
// ranks started by zeal::spawn on this machine.
//
//   build/bin/comm_bench [--world N] [--min_kib K] [--max_mib M] [--min_seconds S] [--json PATH]
//
// For all_gather, reduce_scatter and all_reduce of float32 buffers from 4 KiB to M MiB (the
// buffer is the all-gather output, the reduce-scatter input, the all-reduce tensor), it prints
// bus bandwidth as nccl-tests defines it (algorithm bandwidth × (n-1)/n, × 2(n-1)/n for
// all-reduce) and zeal/c10d. c10d's Gloo reduce_scatter is an all-reduce plus a copy; zeal's is
// a ring. Ranks on one machine talk over loopback TCP, which copies every byte through memory:
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

#include "engine/runtime/runtime.h"
#include "engine/runtime/spawn.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Row {
  std::string op;
  int64_t bytes;
  double zeal_s, c10d_s;
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

// Seconds per call of each of two ops: a round times `iters` calls of one, then of the other;
// the best of 5 rounds counts, so both see the same machine. Every rank runs the same number of
// calls: rank 0 picks it (about min_seconds per round) and broadcasts it.
std::pair<double, double> time_pair(zeal::Communicator& comm, const std::function<void()>& a,
                                    const std::function<void()>& b, double min_seconds) {
  a();  // warm-up: connections, page faults
  b();
  const auto t0 = Clock::now();
  a();
  const double once = std::chrono::duration<double>(Clock::now() - t0).count();
  at::Tensor count = at::full({1}, std::max<int64_t>(3, static_cast<int64_t>(min_seconds / std::max(once, 1e-6))), at::kLong);
  comm.broadcast(count, 0).wait();
  const int64_t iters = count.item<int64_t>();
  double best_a = 1e9, best_b = 1e9;
  for (int round = 0; round < 5; ++round) {
    for (int w = 0; w < 2; ++w) {
      const int which = (w + round) % 2;  // alternate which goes first
      comm.barrier().wait();
      const auto start = Clock::now();
      for (int64_t i = 0; i < iters; ++i) (which == 0 ? a : b)();
      const double t = std::chrono::duration<double>(Clock::now() - start).count() / iters;
      (which == 0 ? best_a : best_b) = std::min(which == 0 ? best_a : best_b, t);
    }
  }
  return {best_a, best_b};
}

}  // namespace

int main(int argc, char** argv) {
  int world = 2;
  int max_mib = 256;
  int64_t min_kib = 4;
  double min_seconds = 0.3;
  std::string json;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&] { return i + 1 < argc ? std::string(argv[++i]) : std::string(); };
    if (a == "--world") world = std::stoi(next());
    else if (a == "--max_mib") max_mib = std::stoi(next());
    else if (a == "--min_kib") min_kib = std::stoll(next());
    else if (a == "--min_seconds") min_seconds = std::stod(next());
    else if (a == "--json") json = next();
    else {
      std::fprintf(stderr, "usage: comm_bench [--world N] [--min_kib K] [--max_mib M] [--min_seconds S] [--json PATH]\n");
      return 2;
    }
  }
  std::printf("comm_bench: %d ranks on this machine (gloo over loopback), float32\n", world);
  std::printf("single-thread memcpy bandwidth (the copy every loopback byte costs): %.2f GB/s\n\n", memcpy_gbs());
  std::fflush(stdout);

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
        std::vector<Row> rows;
        for (int64_t bytes = min_kib << 10; bytes <= (int64_t{max_mib} << 20); bytes *= 4) {
          const int64_t total = bytes / 4, shard = comm.shard_size(total);
          at::Tensor flat = at::rand({total});
          at::Tensor part = at::rand({shard});
          at::Tensor out = at::empty({total});
          at::Tensor part_out = at::empty({shard});
          Row ag{"all_gather", bytes, 0, 0};
          std::tie(ag.zeal_s, ag.c10d_s) = time_pair(
              comm, [&] { comm.all_gather(part, out).wait(); }, [&] { pg->_allgather_base(out, part)->wait(); },
              min_seconds);
          Row rs{"reduce_scatter", bytes, 0, 0};
          std::tie(rs.zeal_s, rs.c10d_s) = time_pair(
              comm, [&] { comm.reduce_scatter(flat, part_out, zeal::ReduceOp::kSum).wait(); },
              [&] { pg->_reduce_scatter_base(part_out, flat)->wait(); }, min_seconds);
          Row ar{"all_reduce", bytes, 0, 0};
          std::tie(ar.zeal_s, ar.c10d_s) = time_pair(
              comm, [&] { comm.all_reduce(flat, zeal::ReduceOp::kSum).wait(); },
              [&] {
                std::vector<at::Tensor> t{flat};
                pg->allreduce(t)->wait();
              },
              min_seconds);
          for (Row r : {ag, rs, ar}) {
            rows.push_back(r);
            if (rt.rank() != 0) continue;
            const double factor = (r.op == "all_reduce" ? 2.0 : 1.0) * (n - 1) / n;
            const double zbw = r.bytes / r.zeal_s / 1e9 * factor, cbw = r.bytes / r.c10d_s / 1e9 * factor;
            std::printf("%-15s %9s  zeal %8.3f GB/s (%9.1f us)  c10d %8.3f GB/s (%9.1f us)  zeal/c10d %.2f\n",
                        r.op.c_str(),
                        r.bytes >= (1 << 20) ? fmt::format("{} MiB", r.bytes >> 20).c_str()
                                             : fmt::format("{} KiB", r.bytes >> 10).c_str(),
                        zbw, r.zeal_s * 1e6, cbw, r.c10d_s * 1e6, r.c10d_s / r.zeal_s);
            std::fflush(stdout);
          }
        }
        if (rt.rank() == 0 && !json.empty()) {
          std::ofstream f(json);
          f << "{\"world\": " << n << ", \"dtype\": \"float32\", \"rows\": [";
          for (size_t i = 0; i < rows.size(); ++i) {
            const Row& r = rows[i];
            const double factor = (r.op == "all_reduce" ? 2.0 : 1.0) * (n - 1) / n;
            f << (i ? "," : "") << "\n  {\"op\": \"" << r.op << "\", \"bytes\": " << r.bytes
              << ", \"zeal_seconds\": " << r.zeal_s << ", \"c10d_seconds\": " << r.c10d_s
              << ", \"zeal_busbw_gbs\": " << r.bytes / r.zeal_s / 1e9 * factor
              << ", \"c10d_busbw_gbs\": " << r.bytes / r.c10d_s / 1e9 * factor << ", \"ratio\": " << r.c10d_s / r.zeal_s
              << "}";
          }
          f << "\n]}\n";
        }
      },
      world, so);
  const std::string failures = zeal::describe_failures(results);
  if (!failures.empty()) {
    std::fprintf(stderr, "comm_bench failed:\n%s", failures.c_str());
    return 1;
  }
  return 0;
}
