// Hybrid sharding's communicator (see hybrid.h).
#include "engine/comm/hybrid.h"

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <map>
#include <mutex>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace zeal {
namespace {

// A failure in a smaller communicator, said with global ranks.
[[noreturn]] void rethrow_global(const CommError& e, const char* group, const std::vector<int>& ranks) {
  std::vector<int> missing;
  for (int r : e.missing_ranks()) missing.push_back(r >= 0 && r < static_cast<int>(ranks.size()) ? ranks[r] : r);
  throw CommError(fmt::format("{}\n  (hybrid_shard: that was the {} communicator of global ranks [{}]; its rank i is "
                              "global rank [{}][i])",
                              e.what(), group, fmt::join(ranks, ", "), fmt::join(ranks, ", ")),
                  e.op(), e.seq(), std::move(missing));
}

// A Work whose errors name global ranks.
class GlobalWork final : public Work::Impl {
 public:
  GlobalWork(Work w, const char* group, const std::vector<int>* ranks) : w_(std::move(w)), group_(group), ranks_(ranks) {}
  void wait() override {
    try {
      w_.wait();
    } catch (const CommError& e) {
      rethrow_global(e, group_, *ranks_);
    }
  }
  bool done() override { return w_.done(); }

 private:
  Work w_;
  const char* group_;
  const std::vector<int>* ranks_;
};

// The machine's reduce-scatter, then the shard's reduction across machines, issued when the first
// is waited for (every rank waits in its program's order, so replicas issue in the same order).
class TwoLevelWork final : public Work::Impl {
 public:
  TwoLevelWork(Work first, std::function<Work()> then) : first_(std::move(first)), then_(std::move(then)) {}
  void wait() override {
    std::lock_guard<std::mutex> lock(mu_);
    first_.wait();
    if (then_) second_ = std::exchange(then_, nullptr)();
    second_.wait();
  }
  bool done() override {
    std::lock_guard<std::mutex> lock(mu_);
    return !then_ && second_.done();
  }

 private:
  std::mutex mu_;
  Work first_, second_;
  std::function<Work()> then_;
};

class HybridCommunicator final : public Communicator {
 public:
  HybridCommunicator(Communicator& every, Communicator& machine, Communicator& replica, HybridLayout layout)
      : every_(every), machine_(machine), replica_(replica), layout_(std::move(layout)) {}

  int rank() const override { return machine_.rank(); }
  int world_size() const override { return machine_.world_size(); }
  int reduction_world() const override { return every_.world_size(); }
  std::string backend() const override { return machine_.backend(); }

  Work all_gather(const at::Tensor& shard, const at::Tensor& output) override {
    CollectiveLabel l(machine_, label());
    return wrap(machine_.all_gather(shard, output), "machine", layout_.machine);
  }
  Work reduce_scatter(const at::Tensor& input, const at::Tensor& shard, ReduceOp op) override {
    Work first;
    {
      CollectiveLabel l(machine_, label());
      first = wrap(machine_.reduce_scatter(input, shard, op), "machine", layout_.machine);
    }
    if (replica_.world_size() == 1) return first;
    // kAvg: the machine's mean, then the mean of the machines' means (equal sizes: the global mean).
    return Work(std::make_shared<TwoLevelWork>(std::move(first), [this, shard, op, label = label()] {
      CollectiveLabel l(replica_, label + (label.empty() ? "" : ", ") + "across machines");
      return wrap(replica_.all_reduce(shard, op), "replica", layout_.replica);
    }));
  }
  Work all_reduce(const at::Tensor& tensor, ReduceOp op) override {
    CollectiveLabel l(machine_, label());
    return wrap(machine_.all_reduce(tensor, op), "machine", layout_.machine);
  }
  Work broadcast(const at::Tensor& tensor, int root) override {
    CollectiveLabel l(every_, label());
    return every_.broadcast(tensor, root);
  }
  Work barrier() override { return every_.barrier(); }
  uint64_t sequence() const override { return every_.sequence() + machine_.sequence() + replica_.sequence(); }
  void set_progress(int64_t step, int64_t micro_step) override {
    every_.set_progress(step, micro_step);
    machine_.set_progress(step, micro_step);
    replica_.set_progress(step, micro_step);
  }
  // Every rank checks the three in the same order (through the store: no collective to pair): ranks
  // that issued different collectives inside their machine or across machines are caught as well.
  void check_agreement(const std::string& where) override {
    every_.check_agreement(where);
    machine_.check_agreement(where);
    if (replica_.world_size() > 1) replica_.check_agreement(where);
  }
  void set_timeout(double seconds) override {
    every_.set_timeout(seconds);
    machine_.set_timeout(seconds);
    replica_.set_timeout(seconds);
  }
  int64_t buffer_bytes() const override { return machine_.buffer_bytes() + replica_.buffer_bytes(); }

 private:
  static Work wrap(Work w, const char* group, const std::vector<int>& ranks) {
    return Work(std::make_shared<GlobalWork>(std::move(w), group, &ranks));
  }

  Communicator& every_;
  Communicator& machine_;
  Communicator& replica_;
  HybridLayout layout_;
};

}  // namespace

std::unique_ptr<Communicator> make_hybrid_communicator(Communicator& every, Communicator& machine,
                                                       Communicator& replica, HybridLayout layout) {
  return std::make_unique<HybridCommunicator>(every, machine, replica, std::move(layout));
}

HybridLayout hybrid_layout(int rank, const std::vector<int>& machine_of, const std::vector<int>& local_rank_of) {
  std::map<int, std::map<int, int>> ranks;  // machine -> local rank -> global rank
  for (size_t r = 0; r < machine_of.size(); ++r) {
    auto [it, fresh] = ranks[machine_of[r]].emplace(local_rank_of[r], static_cast<int>(r));
    if (!fresh) {
      throw Error(fmt::format("hybrid_shard: ranks {} and {} both say they are local rank {} of machine {}", it->second,
                              r, local_rank_of[r], machine_of[r]));
    }
  }
  const size_t per = ranks.begin()->second.size();
  for (const auto& [m, locals] : ranks) {
    if (locals.size() != per) {
      throw Error(fmt::format("hybrid_shard needs the same number of ranks on every machine: machine {} has {}, "
                              "machine {} has {}",
                              ranks.begin()->first, per, m, locals.size()));
    }
  }
  HybridLayout l;
  const int mine = machine_of.at(rank);
  for (const auto& [local, r] : ranks.at(mine)) l.machine.push_back(r);
  const int position = static_cast<int>(
      std::find(l.machine.begin(), l.machine.end(), rank) - l.machine.begin());  // by local rank order
  for (const auto& [m, locals] : ranks) {
    if (m == mine) l.replica_index = static_cast<int>(l.replica.size());
    l.replica.push_back(std::next(locals.begin(), position)->second);
  }
  return l;
}

}  // namespace zeal
