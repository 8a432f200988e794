#include "engine/zero/touch.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "engine/zero/stage3.h"

namespace zeal::zero {

namespace {

// The functionality key LibTorch reserves for out-of-core module machinery (torchdistx's deferred
// init): above autograd, so a touched unit is gathered before autograd records the op.
constexpr c10::DispatchKey kKey = c10::DispatchKey::DeferredInit;

struct Watched {
  Stage3* owner;
  Unit* unit;
  std::thread::id thread;  // the thread that prepared the model
};

struct Registry {
  std::mutex mu;
  std::unordered_map<const c10::StorageImpl*, Watched> units;
  std::atomic<int64_t> watched{0};
};

Registry& registry() {
  static Registry* r = new Registry;  // outlives every static destructor that might run an op
  return *r;
}

thread_local bool paused = false;

using Hits = std::vector<std::pair<Stage3*, Unit*>>;

// A watched unit's storage among an op's tensors. Only ops of the thread that prepared the model and
// of autograd's backward count: the dispatch state is also inherited by threads that only move the
// units' bytes (c10d's gloo workers filling a gather), which must never gather anything themselves.
void look_up(Registry& r, const at::Tensor& t, bool in_backward, Hits& hits) {
  if (!t.defined() || !t.has_storage()) return;
  auto it = r.units.find(t.storage().unsafeGetStorageImpl());
  if (it == r.units.end()) return;
  if (!in_backward && it->second.thread != std::this_thread::get_id()) return;
  const std::pair<Stage3*, Unit*> hit{it->second.owner, it->second.unit};
  if (std::find(hits.begin(), hits.end(), hit) == hits.end()) hits.push_back(hit);
}

void look_up(Registry& r, const c10::IValue& v, bool in_backward, Hits& hits) {
  if (v.isTensor()) {
    look_up(r, v.toTensor(), in_backward, hits);
  } else if (v.isTensorList()) {
    for (const at::Tensor t : v.toTensorList()) look_up(r, t, in_backward, hits);
  } else if (v.isList()) {  // Tensor?[] (index, and the like)
    for (const c10::IValue& e : v.toListRef())
      if (e.isTensor()) look_up(r, e.toTensor(), in_backward, hits);
  }
}

void touch_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  Registry& r = registry();
  if (!paused && r.watched.load(std::memory_order_relaxed) > 0) {
    Hits hits;
    const bool in_backward = torch::autograd::get_current_graph_task_id() >= 0;
    {
      const size_t n = op.schema().arguments().size();
      std::lock_guard lock(r.mu);
      for (size_t i = stack->size() - n; i < stack->size(); ++i) look_up(r, (*stack)[i], in_backward, hits);
    }
    if (!hits.empty()) {
      TouchPause pause;
      while (!hits.empty()) {  // one owner at a time (two engines in one process)
        Stage3* owner = hits.front().first;
        std::vector<Unit*> units;
        for (auto it = hits.begin(); it != hits.end();) {
          if (it->first != owner) {
            ++it;
            continue;
          }
          units.push_back(it->second);
          it = hits.erase(it);
        }
        owner->touched(units, in_backward);
      }
    }
  }
  op.redispatchBoxed(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kKey), stack);
}

TORCH_LIBRARY_IMPL(_, DeferredInit, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&touch_fallback>()); }

std::string without_impl(std::string s) {
  if (s.size() > 4 && s.compare(s.size() - 4, 4, "Impl") == 0) s.resize(s.size() - 4);
  return s;
}

}  // namespace

bool unit_name_matches(const std::string& type_name, const std::vector<std::string>& names) {
  const size_t colon = type_name.rfind("::");
  const std::string bare = colon == std::string::npos ? type_name : type_name.substr(colon + 2);
  for (const auto& n : names) {
    if (n == type_name || n == bare || n == without_impl(bare) || n == without_impl(type_name)) return true;
  }
  return false;
}

TouchWatch::TouchWatch(Stage3& owner, std::vector<std::pair<const c10::StorageImpl*, Unit*>> storages) {
  Registry& r = registry();
  {
    std::lock_guard lock(r.mu);
    for (const auto& [s, u] : storages) {
      r.units[s] = {&owner, u, std::this_thread::get_id()};
      storages_.push_back(s);
    }
  }
  r.watched.fetch_add(static_cast<int64_t>(storages_.size()));
  was_included_ = c10::impl::tls_is_dispatch_key_included(kKey);
  c10::impl::tls_set_dispatch_key_included(kKey, true);
}

TouchWatch::~TouchWatch() {
  Registry& r = registry();
  {
    std::lock_guard lock(r.mu);
    for (const auto* s : storages_) r.units.erase(s);
  }
  r.watched.fetch_sub(static_cast<int64_t>(storages_.size()));
  c10::impl::tls_set_dispatch_key_included(kKey, was_included_);
}

TouchPause::TouchPause() : was_(paused) { paused = true; }
TouchPause::~TouchPause() { paused = was_; }

}  // namespace zeal::zero
