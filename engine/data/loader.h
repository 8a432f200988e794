// zeal::DataLoader: a LibTorch-style data loader that engine.prepare() shards over the ranks.
//
//   zeal::DataLoader loader(MyDataset(...), {.batch_size = 32, .shuffle = true});
//   loader = engine.prepare(loader);
//   for (auto& batch : loader) { ... }   // batch.data, batch.target, already on engine.device()
//
// The dataset is anything with `get(size_t)` returning an example (torch::data::Example<> or a
// type the collate function takes) and `size()` (size_t or LibTorch's optional<size_t>). After
// prepare, each rank iterates its own disjoint part (ShardPlan: the global batch b is every
// rank's batch b concatenated in rank order), shuffled identically on every rank for a given seed
// and epoch; size() is the number of batches this rank gets. The epoch advances by itself each
// time an iteration runs to its end, or is set with set_epoch. Batches are moved to the engine's
// device unless device_placement is off: tensors, torch::data::Example, and any batch type with a
// `to_device(Batch, at::Device)` found by argument-dependent lookup (define it in the batch's
// namespace); on a non-CPU device a batch type without one is an error, never left on the host.
//
// num_workers > 0 prepares batches (the dataset's get and the collate function) on that many
// background threads while the step runs, up to prefetch_factor batches per worker ahead of the
// one being used, in the same order and with the same contents as without workers; get() and the
// collate function are then called from several threads at once and must allow it. An exception
// thrown while preparing a batch is rethrown, unchanged, where that batch is used. stats() says how
// much of the preparation was on the training loop's critical path.
#pragma once

#include <ATen/ATen.h>
#include <torch/data/example.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

#include "engine/data/prefetch.h"
#include "engine/data/shard.h"
#include "engine/error.h"

namespace zeal {

struct LoaderOptions {
  int64_t batch_size = 1;      // per rank (with split_batches: the global batch)
  bool shuffle = false;
  uint64_t seed = 0;
  bool drop_last = false;
  bool even_batches = true;    // pad the last global batch by repeating samples from the start
  bool split_batches = false;  // batch_size is the global batch, divided among the ranks
  bool device_placement = true;
  int num_workers = 0;      // background threads preparing batches (0: in the loop, when used)
  int prefetch_factor = 2;  // batches prepared ahead per worker
};

namespace data {

// Where the iteration of the loader currently being iterated stands; the engine reads it for
// gather_for_metrics and for the sync micro-step at the end of the data.
struct Progress {
  bool active = false;
  bool end_of_dataloader = false;  // the batch last yielded is the last of the epoch
  int64_t batch = -1;
  int64_t real_in_global_batch = 0;  // leading samples of the global batch that are not padding
  int64_t global_batch_size = 0;     // all samples of the global batch, padding included
};

// Where a prepared loader stands, kept by the engine for its checkpoints (one per prepared
// loader, in prepare order): the epoch being iterated (or the next one) and the global samples of
// it already yielded, in whole global batches. engine.load_state sets resume_*: the loader's next
// begin() starts that epoch at that sample (at another world size, the global batch there).
struct Cursor {
  int64_t epoch = 0, samples = 0;
  int64_t resume_epoch = -1, resume_samples = 0;
};

// What engine.prepare() gives a loader.
struct Binding {
  int rank = 0;
  int world_size = 1;
  at::Device device = at::kCPU;
  std::shared_ptr<Progress> progress;
  std::shared_ptr<Cursor> cursor;
};

// Default collate: stacks the examples' data (and targets) along a new first dimension.
struct Stack {
  template <class Data, class Target>
  torch::data::Example<Data, Target> operator()(std::vector<torch::data::Example<Data, Target>> items) const {
    std::vector<at::Tensor> data, target;
    data.reserve(items.size());
    for (auto& e : items) {
      data.push_back(std::move(e.data));
      if constexpr (!std::is_same_v<Target, torch::data::example::NoTarget>) target.push_back(std::move(e.target));
    }
    if constexpr (std::is_same_v<Target, torch::data::example::NoTarget>) {
      return {at::stack(data)};
    } else {
      return {at::stack(data), at::stack(target)};
    }
  }
};

inline at::Tensor to_device(at::Tensor t, at::Device d) { return t.device() == d ? t : t.to(d); }
template <class Data, class Target>
torch::data::Example<Data, Target> to_device(torch::data::Example<Data, Target> e, at::Device d) {
  e.data = to_device(std::move(e.data), d);
  if constexpr (!std::is_same_v<Target, torch::data::example::NoTarget>) e.target = to_device(std::move(e.target), d);
  return e;
}

// Where batch preparation spent its time this epoch (reset at begin()).
struct LoaderStats {
  int64_t batches = 0;
  double prepare_seconds = 0;   // building batches (get + collate), on whichever thread did it
  double critical_seconds = 0;  // the loop's time inside the loader: building inline, or waiting for a worker, and placing
};

template <class D>
int64_t dataset_size(const D& d) {
  auto n = d.size();
  if constexpr (std::is_integral_v<decltype(n)>) {
    return static_cast<int64_t>(n);
  } else {
    if (!n.has_value()) throw Error("the dataset has no size: zeal::DataLoader needs a dataset of known size");
    return static_cast<int64_t>(*n);
  }
}

}  // namespace data

template <class Dataset, class Collate = data::Stack>
class DataLoader {
 public:
  using Example = std::decay_t<decltype(std::declval<Dataset&>().get(size_t{}))>;
  using Batch = std::decay_t<decltype(std::declval<const Collate&>()(std::vector<Example>{}))>;

  DataLoader(Dataset dataset, LoaderOptions options = {}, Collate collate = {})
      : s_(std::make_shared<State>(std::move(dataset), options, std::move(collate))) {
    s_->size = data::dataset_size(s_->dataset);
    replan();
  }

  // Batches this rank iterates per epoch.
  int64_t size() const { return s_->plan->num_batches(); }
  int64_t dataset_size() const { return s_->size; }
  const LoaderOptions& options() const { return s_->options; }
  const Dataset& dataset() const { return s_->dataset; }
  void set_epoch(int64_t epoch) { s_->next_epoch = epoch; }
  int64_t epoch() const { return s_->next_epoch; }
  bool prepared() const { return s_->bound; }
  data::LoaderStats stats() const {
    data::LoaderStats out = s_->stats;
    out.prepare_seconds = static_cast<double>(s_->prepare_ns.load()) * 1e-9;
    return out;
  }

  // Called by engine.prepare(); a loader is bound to one engine.
  void bind(const data::Binding& binding) {
    s_->binding = binding;
    s_->bound = true;
    replan();
  }

  class iterator {
   public:
    using value_type = Batch;
    iterator() = default;
    const Batch& operator*() {
      load();
      return *current_;
    }
    const Batch* operator->() { return &**this; }
    iterator& operator++() {
      ++b_;
      current_.reset();
      return *this;
    }
    // Reaching the end finishes the epoch.
    bool operator==(const iterator& o) const {
      const bool equal = b_ == o.b_;
      if (equal && s_ && !o.s_) finish();
      return equal;
    }

   private:
    friend class DataLoader;
    iterator(std::shared_ptr<typename DataLoader::State> s, int64_t b) : s_(std::move(s)), b_(b) {}
    void load() {
      if (current_) return;
      auto& st = *s_;
      const auto t0 = std::chrono::steady_clock::now();
      // A batch already handed over (read again after an exception, a second iterator) is built here.
      Batch batch = st.prefetch && st.prefetch->has(b_) ? st.prefetch->take(b_) : build(st, b_);
      if (st.options.device_placement) batch = place(std::move(batch), st.binding.device);
      current_ = std::move(batch);
      ++st.stats.batches;
      st.stats.critical_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (auto& p = st.binding.progress) {
        p->active = true;
        p->batch = b_;
        p->end_of_dataloader = b_ + 1 == st.plan->num_batches();
        p->real_in_global_batch = st.plan->real_samples_in_global_batch(b_);
        p->global_batch_size = st.plan->per_rank_batch() * st.binding.world_size;
      }
      if (auto& c = st.binding.cursor) {
        c->epoch = st.running_epoch;
        c->samples = (b_ + 1) * st.plan->per_rank_batch() * st.binding.world_size;
      }
    }
    void finish() const {
      if (s_->finished_epoch == s_->running_epoch) return;
      s_->prefetch.reset();
      s_->finished_epoch = s_->running_epoch;
      s_->next_epoch = s_->running_epoch + 1;
      if (auto& p = s_->binding.progress) *p = data::Progress{};
      if (auto& c = s_->binding.cursor) {
        c->epoch = s_->next_epoch;
        c->samples = 0;
      }
    }
    static Batch place(Batch b, at::Device d) {
      using data::to_device;
      if constexpr (requires { to_device(std::move(b), d); }) {
        return to_device(std::move(b), d);
      } else {
        if (!d.is_cpu()) {
          throw Error(std::string("zeal::DataLoader cannot move a batch of type ") + typeid(Batch).name() + " to " +
                      d.str() + ": define to_device(Batch, at::Device) in the batch type's namespace, or set "
                      "device_placement = false and move it yourself");
        }
        return b;
      }
    }
    std::shared_ptr<typename DataLoader::State> s_;
    int64_t b_ = 0;
    std::optional<Batch> current_;
  };

  // Starts an epoch: the order is fixed by the seed and the epoch. After engine.load_state, the
  // saved epoch from the batch after the last one the saved run yielded.
  iterator begin() {
    s_->prefetch.reset();  // an earlier iteration's workers, before the plan changes under them
    int64_t first = 0;
    if (auto& c = s_->binding.cursor; c && c->resume_epoch >= 0) {
      s_->next_epoch = c->resume_epoch;
      first = std::min<int64_t>(c->resume_samples / (s_->plan->per_rank_batch() * s_->binding.world_size), size());
      c->resume_epoch = -1;
    }
    s_->running_epoch = s_->next_epoch;
    s_->plan->set_epoch(s_->running_epoch);
    if (auto& p = s_->binding.progress) *p = data::Progress{};
    if (auto& c = s_->binding.cursor) {
      c->epoch = s_->running_epoch;
      c->samples = first * s_->plan->per_rank_batch() * s_->binding.world_size;
    }
    s_->stats = {};
    s_->prepare_ns = 0;
    if (s_->options.num_workers > 0 && first < size()) {
      auto* st = s_.get();  // the state owns the prefetcher, so outlives its threads
      s_->prefetch = std::make_unique<data::Prefetcher<Batch>>(
          first, size(), s_->options.num_workers,
          static_cast<int64_t>(s_->options.num_workers) * std::max(1, s_->options.prefetch_factor),
          [st](int64_t b) { return build(*st, b); });
    }
    return iterator(s_, first);
  }
  iterator end() { return iterator(nullptr, size()); }

 private:
  struct State {
    State(Dataset d, LoaderOptions o, Collate c) : dataset(std::move(d)), options(o), collate(std::move(c)) {}
    Dataset dataset;
    LoaderOptions options;
    Collate collate;
    int64_t size = 0;
    data::Binding binding;
    bool bound = false;
    std::optional<data::ShardPlan> plan;
    int64_t next_epoch = 0, running_epoch = 0, finished_epoch = -1;
    data::LoaderStats stats;
    std::atomic<int64_t> prepare_ns{0};
    std::unique_ptr<data::Prefetcher<Batch>> prefetch;  // last member: its threads stop first
  };
  // Batch b of the running epoch: the dataset's examples through the collate function.
  static Batch build(State& st, int64_t b) {
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<Example> items;
    for (int64_t i : st.plan->batch(b)) items.push_back(st.dataset.get(static_cast<size_t>(i)));
    Batch batch = st.collate(std::move(items));
    st.prepare_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
    return batch;
  }
  void replan() {
    if (s_->options.num_workers < 0) throw Error("zeal::DataLoader: num_workers must be >= 0, got " + std::to_string(s_->options.num_workers));
    if (s_->options.prefetch_factor < 1) throw Error("zeal::DataLoader: prefetch_factor must be >= 1, got " + std::to_string(s_->options.prefetch_factor));
    s_->prefetch.reset();
    data::ShardOptions o;
    o.batch_size = s_->options.batch_size;
    o.split_batches = s_->options.split_batches;
    o.shuffle = s_->options.shuffle;
    o.seed = s_->options.seed;
    o.even_batches = s_->options.even_batches;
    o.drop_last = s_->options.drop_last;
    s_->plan.emplace(s_->size, s_->binding.world_size, s_->binding.rank, o);
  }
  std::shared_ptr<State> s_;
};

}  // namespace zeal
