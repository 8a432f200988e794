// How a rank's state moves between the sharding and the checkpoint files: the plan of what a rank
// writes, the walk that opens one group of ranges at a time (stage 3: one unit's shards from disk),
// the writer's side (emit_file) and the loader's (StreamApplier), and the ranks' agreement on errors.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <torch/nn/module.h>

#include "engine/checkpoint/safetensors.h"
#include "engine/checkpoint/staging.h"
#include "engine/checkpoint/tensor_dtype.h"
#include "engine/error.h"
#include "engine/zero/zero_optimizer.h"

namespace zeal {
class Engine;
}

namespace zeal::ckpt {

// The frozen parameters outside stage 3 (whole on every rank), by name, each tensor once.
std::vector<std::pair<std::string, at::Tensor>> frozen_params(torch::nn::Module& m);
// Every rank's string, to every rank (collective).
std::vector<std::string> all_strings(Engine& e, const std::string& text);
// Every rank's error (empty: none) to every rank, as "\n  rank k: …" lines (empty: none failed).
// Collective.
std::string agreed_failures(Engine& e, const std::string& error);

// What one rank writes into its file, in order.
struct FilePlan {
  struct Item {
    const zero::StateRange* range;
    std::string kind;
  };
  std::vector<zero::StateRange> ranges;
  std::vector<Item> items;
  std::vector<TensorEntry> entries;
  std::vector<std::pair<std::string, at::Tensor>> rng;
};

// Walks state ranges in order, opening each range's group when it comes and closing the one before
// (Sharding::open_group): one stage-3 unit's shards from disk in memory at a time.
class GroupWalk {
 public:
  GroupWalk(zero::Sharding& z, bool changed) : z_(z), changed_(changed) {}
  void at(const zero::StateRange& r) {
    if (r.group < 0 || r.group == open_) return;
    close();
    z_.open_group(r.group);
    open_ = r.group;
  }
  void close() {
    if (open_ < 0) return;
    const int g = open_;
    open_ = -1;
    z_.close_group(g, changed_);
  }

 private:
  zero::Sharding& z_;
  const bool changed_;
  int open_ = -1;
};

// Elements [first, first + src.numel()) of range r's `kind` take src's values: a frozen parameter's
// ("param") or a buffer's ("buffer") its values; a trainable one's master or optimizer state where the step keeps it, the
// master's compute copy too (as a step writes it).
void put_elements(const zero::StateRange& r, const std::string& kind, int64_t first, const at::Tensor& src);

// One kind of state ("param", "master", "exp_avg", ...) of one range, as a load applies it.
struct LoadItem {
  const zero::StateRange* range;
  std::string kind, dtype;
  int64_t es;  // bytes per element in the file
};

// A load's second pass: the checked bytes of each read applied where they belong (Engine::load_state):
// whole elements straight from the caller's bytes where they are aligned for their type, the rest
// (an element split between two calls, bytes at an address not aligned for their type) through an
// 8 MiB staging buffer, whole elements from there.
class StreamApplier {
 public:
  // walk: opens each range's group as it comes (null: every range is present).
  StreamApplier(const std::vector<LoadItem>& items, const std::vector<std::pair<size_t, int64_t>>& read_to,
                GroupWalk* walk)
      : items_(items), read_to_(read_to), walk_(walk) {}
  void take(size_t read, int64_t at, const char* p, int64_t n) {
    if (read != cur_) {
      flush();
      cur_ = read;
      done_ = 0;
      if (walk_) walk_->at(*items_[read_to_[read].first].range);
    }
    ZEAL_CHECK(at == done_ + fill_) << "checkpoint bytes out of order";
    const int64_t es = items_[read_to_[cur_].first].es;
    while (n > 0) {
      if (fill_ == 0 && n >= es && reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(es) == 0) {
        const int64_t whole = n / es * es;
        put(p, whole);
        p += whole;
        n -= whole;
        continue;
      }
      // Staged: what completes a split element, else as much as the buffer takes.
      if (buf_.empty()) buf_.resize(kBytes);  // on first use: most loads never stage
      const int64_t k = fill_ % es != 0 ? std::min(n, es - fill_ % es) : std::min(n, kBytes - fill_);
      std::memcpy(buf_.data() + fill_, p, static_cast<size_t>(k));
      fill_ += k;
      p += k;
      n -= k;
      if (fill_ % es == 0) drain();  // also when full: kBytes is a multiple of every element size
    }
  }
  // The read's last bytes (whole elements) applied.
  void flush() {
    if (fill_ > 0) drain();
  }
  // Whether any bytes were applied.
  bool applied() const { return applied_; }

 private:
  // The staged bytes go (whole elements: staging stops at each element's end; put checks it).
  void drain() {
    put(buf_.data(), fill_);
    fill_ = 0;
  }
  // `n` bytes at p (whole elements, aligned for their type) are the next of the current read's range.
  void put(const char* p, int64_t n) {
    const LoadItem& it = items_[read_to_[cur_].first];
    const zero::StateRange& r = *it.range;
    ZEAL_CHECK(n % it.es == 0) << "a partial element of " << r.name;
    const int64_t first = read_to_[cur_].second + done_ / it.es;
    put_elements(r, it.kind, first,
                 at::from_blob(const_cast<char*>(p), {n / it.es}, at::TensorOptions().dtype(at_dtype(it.dtype))));
    done_ += n;
    applied_ = true;
  }
  static constexpr int64_t kBytes = 8 << 20;  // a multiple of every element size
  const std::vector<LoadItem>& items_;
  const std::vector<std::pair<size_t, int64_t>>& read_to_;
  GroupWalk* walk_;
  std::vector<char> buf_;  // the staging, made when first needed
  size_t cur_ = static_cast<size_t>(-1);
  int64_t done_ = 0, fill_ = 0;
  bool applied_ = false;
};

// The rank's file's bytes, in the plan's order, through `sink`; each range's group opened as it comes.
void emit_file(const FilePlan& plan, Sink& sink, int rank, zero::Sharding& z);
// The manifest's pieces of one rank's file (the writer knows their offsets from the start).
nlohmann::json file_pieces(const FilePlan& plan, const SafetensorsWriter& w);

}  // namespace zeal::ckpt
