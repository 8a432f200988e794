#include "engine/comm/selfcheck.h"

#include <ATen/ATen.h>

#include <chrono>
#include <thread>

#include <fmt/format.h>

#include "engine/comm/communicator.h"

namespace zeal {
namespace {

struct DType {
  at::ScalarType type;
  const char* name;
};

const DType kDTypes[] = {{at::kFloat, "float32"}, {at::kHalf, "float16"}, {at::kBFloat16, "bfloat16"}, {at::kLong, "int64"}};

// Small integers, exact in every dtype, and their sums over up to 16 ranks too.
at::Tensor values(int64_t n, int rank, at::ScalarType t, const at::TensorOptions& where) {
  at::Tensor i = at::arange(n, at::kLong);
  return (at::remainder(i * 7 + rank * 13, 17) - 8).to(where.dtype(t));
}

// Every rank's input stacked: what each rank would compute if it saw everything.
at::Tensor all_inputs(int64_t n, int world, at::ScalarType t, const at::TensorOptions& where) {
  std::vector<at::Tensor> v;
  for (int r = 0; r < world; ++r) v.push_back(values(n, r, t, where));
  return at::stack(v);
}

at::Tensor average(const at::Tensor& sum, int world) {
  return at::isIntegralType(sum.scalar_type(), false) ? sum.div(world, "trunc") : sum.div(world);
}

std::string difference(const at::Tensor& got, const at::Tensor& want, int rank) {
  if (got.sizes() != want.sizes()) return fmt::format("rank {}: got {} elements, expected {}", rank, got.numel(), want.numel());
  at::Tensor d = (got.to(at::kDouble) - want.to(at::kDouble)).abs().cpu();
  const int64_t at_index = d.argmax().item<int64_t>();
  return fmt::format("rank {}: max difference {} at element {} (got {}, expected {})", rank, d.max().item<double>(),
                     at_index, got.cpu()[at_index].item<double>(), want.cpu()[at_index].item<double>());
}

}  // namespace

std::vector<CheckResult> run_collective_checks(Communicator& comm, bool cuda, std::vector<int64_t> sizes) {
  const int world = comm.world_size(), rank = comm.rank();
  const at::TensorOptions where = cuda ? at::TensorOptions().device(at::kCUDA) : at::TensorOptions();
  if (sizes.empty()) sizes = {1, 2 * world + 1, 1000, 100003};
  std::vector<CheckResult> results;
  auto record = [&](std::string name, const at::Tensor& got, const at::Tensor& want) {
    CheckResult c{std::move(name), at::equal(got, want), ""};
    if (!c.passed) c.detail = difference(got, want, rank);
    results.push_back(std::move(c));
  };

  for (const DType& dt : kDTypes) {
    for (int64_t n : sizes) {
      const int64_t s = comm.shard_size(n);
      const std::string suffix = fmt::format("{} n={}", dt.name, n);
      const at::Tensor everyone = all_inputs(n, world, dt.type, where);
      const at::Tensor sum = everyone.sum(0, false, dt.type);

      {  // all_gather: rank r holds elements [r·s, r·s + s) of one global sequence; padding is 99.
        at::Tensor global = values(s * world, 0, dt.type, where);
        at::Tensor shard = global.narrow(0, rank * s, s).clone();
        for (int64_t j = 0; j < s; ++j) {
          if (rank * s + j >= n) shard[j].fill_(99);
        }
        at::Tensor out = at::full({n}, -1, where.dtype(dt.type));
        comm.all_gather(shard, out).wait();
        record("all_gather " + suffix, out, global.narrow(0, 0, n));
      }
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
        at::Tensor input = values(n, rank, dt.type, where);
        const at::Tensor before = input.clone();
        at::Tensor shard = at::full({s}, -1, where.dtype(dt.type));
        comm.reduce_scatter(input, shard, op).wait();
        at::Tensor padded = at::zeros({s * world}, where.dtype(dt.type));
        padded.narrow(0, 0, n).copy_(op == ReduceOp::kSum ? sum : average(sum, world));
        record(fmt::format("reduce_scatter({}) {}", to_string(op), suffix), shard, padded.narrow(0, rank * s, s));
        record(fmt::format("reduce_scatter({}) leaves its input {}", to_string(op), suffix), input, before);
      }
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
        at::Tensor t = values(n, rank, dt.type, where);
        comm.all_reduce(t, op).wait();
        at::Tensor want = op == ReduceOp::kSum   ? sum
                          : op == ReduceOp::kAvg ? average(sum, world)
                                                 : std::get<0>(everyone.max(0));
        record(fmt::format("all_reduce({}) {}", to_string(op), suffix), t, want);
      }
      {
        const int root = world - 1;
        at::Tensor t = values(n, rank, dt.type, where);
        comm.broadcast(t, root).wait();
        record(fmt::format("broadcast(root {}) {}", root, suffix), t, values(n, root, dt.type, where));
      }
    }
  }
  {  // Several collectives in flight at once, waited for in reverse order.
    std::vector<at::Tensor> ts;
    std::vector<Work> works;
    for (int k = 0; k < 4; ++k) {
      ts.push_back(values(1000 + k, rank + k, at::kFloat, where));
      works.push_back(k % 2 ? comm.all_reduce(ts.back(), ReduceOp::kSum) : comm.broadcast(ts.back(), k % world));
    }
    for (int k = 3; k >= 0; --k) works[k].wait();
    for (int k = 0; k < 4; ++k) {
      // Rank r's tensor holds values(·, r + k).
      at::Tensor want;
      if (k % 2) {
        std::vector<at::Tensor> v;
        for (int r = 0; r < world; ++r) v.push_back(values(1000 + k, r + k, at::kFloat, where));
        want = at::stack(v).sum(0);
      } else {
        want = values(1000 + k, k % world + k, at::kFloat, where);
      }
      record(fmt::format("{} in flight with 3 others (waited in reverse order)", k % 2 ? "all_reduce(sum)" : "broadcast"),
             ts[k], want);
    }
  }
  {  // Rank 0 arrives 200 ms late: no rank may leave the barrier before it arrived.
    using namespace std::chrono;
    auto now_us = [] { return duration_cast<microseconds>(system_clock::now().time_since_epoch()).count(); };
    if (rank == 0) std::this_thread::sleep_for(milliseconds(200));
    at::Tensor last_arrival = at::full({1}, static_cast<int64_t>(now_us()), where.dtype(at::kLong));
    comm.barrier().wait();
    const int64_t left = now_us();
    comm.all_reduce(last_arrival, ReduceOp::kMax).wait();
    const int64_t last = last_arrival.cpu().item<int64_t>();
    // Machines' clocks may disagree by a little; 50 ms is far below the 200 ms a broken barrier shows.
    const bool ok = left >= last - 50000;
    results.push_back({"barrier holds every rank until the last one arrives", ok,
                       ok ? "" : fmt::format("rank {} left {:.1f} ms before the last rank arrived", rank, (last - left) / 1e3)});
  }

  // A check passes only where it passed on every rank.
  at::Tensor failed = at::zeros({static_cast<int64_t>(results.size())}, where.dtype(at::kLong));
  for (size_t i = 0; i < results.size(); ++i) {
    if (!results[i].passed) failed[static_cast<int64_t>(i)].fill_(1);
  }
  comm.all_reduce(failed, ReduceOp::kMax).wait();
  at::Tensor f = failed.cpu();
  for (size_t i = 0; i < results.size(); ++i) {
    if (f[static_cast<int64_t>(i)].item<int64_t>() != 0) results[i].passed = false;
  }
  return results;
}

}  // namespace zeal
