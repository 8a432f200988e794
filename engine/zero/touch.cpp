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
using Map = std::unordered_map<const c10::StorageImpl*, Watched>;

// The watched storages: an immutable map replaced whole when a watch begins or ends (at prepare and
// when the engine goes), read by every op through one atomic load. Replaced maps are kept (a few per
// engine, small): an op that loaded one just before may still be reading it.
struct Registry {
  std::mutex mu;  // serializes the replacements
  std::vector<std::unique_ptr<const Map>> maps{};
  std::atomic<const Map*> map{nullptr};
  void publish(Map next) {
    maps.push_back(std::make_unique<const Map>(std::move(next)));
    map.store(maps.back()->empty() ? nullptr : maps.back().get(), std::memory_order_release);
  }
  Map current() const { return maps.empty() ? Map{} : *maps.back(); }
};

Registry& registry() {
  static Registry* r = new Registry;  // outlives every static destructor that might run an op
  return *r;
}

thread_local bool paused = false;
thread_local int watches_here = 0;  // watches made on this thread and alive

struct Hit {
  Stage3* owner;
  Unit* unit;
  bool written;  // an argument the op writes (schema alias annotation `!`) is in this unit
};

// A watched unit's storage among an op's tensors. Only ops of the thread that prepared the model and
// of autograd's backward count: the dispatch state is also inherited by threads that only move the
// units' bytes (c10d's gloo workers filling a gather), which must never gather anything themselves.
// Whether autograd's backward runs this op, asked once and only once a watched storage is found.
struct InBackward {
  int known = -1;
  bool operator()() {
    if (known < 0) known = torch::autograd::get_current_graph_task_id() >= 0 ? 1 : 0;
    return known == 1;
  }
};

void look_up(const Map& m, const at::Tensor& t, InBackward& in_backward, bool written, std::vector<Hit>& hits) {
  if (!t.defined() || !t.has_storage()) return;
  auto it = m.find(t.storage().unsafeGetStorageImpl());
  if (it == m.end()) return;
  if (it->second.thread != std::this_thread::get_id() && !in_backward()) return;
  for (auto& h : hits) {
    if (h.unit == it->second.unit) {
      h.written = h.written || written;
      return;
    }
  }
  hits.push_back({it->second.owner, it->second.unit, written});
}

void look_up(const Map& m, const c10::IValue& v, InBackward& in_backward, bool written, std::vector<Hit>& hits) {
  if (v.isTensor()) {
    look_up(m, v.toTensor(), in_backward, written, hits);
  } else if (v.isTensorList()) {
    for (const at::Tensor t : v.toTensorList()) look_up(m, t, in_backward, written, hits);
  } else if (v.isList()) {  // Tensor?[] (index, and the like)
    for (const c10::IValue& e : v.toListRef())
      if (e.isTensor()) look_up(m, e.toTensor(), in_backward, written, hits);
  }
}

void touch_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  if (!paused) {
    const Map* m = registry().map.load(std::memory_order_acquire);
    if (m != nullptr) {
      std::vector<Hit> hits;
      InBackward in_backward;
      const auto& args = op.schema().arguments();
      const size_t n = args.size();
      for (size_t i = 0; i < n; ++i) {
        const bool written = args[i].alias_info() && args[i].alias_info()->isWrite();
        look_up(*m, (*stack)[stack->size() - n + i], in_backward, written, hits);
      }
      if (!hits.empty()) {
        TouchPause pause;
        while (!hits.empty()) {  // one owner at a time (two engines in one process)
          Stage3* owner = hits.front().owner;
          std::vector<Unit*> units, written;
          for (auto it = hits.begin(); it != hits.end();) {
            if (it->owner != owner) {
              ++it;
              continue;
            }
            units.push_back(it->unit);
            if (it->written) written.push_back(it->unit);
            it = hits.erase(it);
          }
          owner->touched(units, written, op.schema().name(), in_backward());
        }
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
  // The namespace ends at the last "::" before any template arguments (mylib::Block<mylib::Cfg>).
  const size_t colon = type_name.rfind("::", type_name.find('<'));
  const std::string bare = colon == std::string::npos ? type_name : type_name.substr(colon + 2);
  for (const auto& n : names) {
    if (n == type_name || n == bare || n == without_impl(bare) || n == without_impl(type_name)) return true;
  }
  return false;
}

TouchWatch::TouchWatch(Stage3& owner, std::vector<std::pair<const c10::StorageImpl*, Unit*>> storages)
    : thread_(std::this_thread::get_id()) {
  Registry& r = registry();
  {
    std::lock_guard lock(r.mu);
    Map next = r.current();
    for (const auto& [s, u] : storages) {
      next[s] = {&owner, u, thread_};
      storages_.push_back(s);
    }
    r.publish(std::move(next));
  }
  // The key stays included while any watch made on this thread lives (two engines, in any order).
  ++watches_here;
  c10::impl::tls_set_dispatch_key_included(kKey, true);
}

TouchWatch::~TouchWatch() {
  Registry& r = registry();
  {
    std::lock_guard lock(r.mu);
    Map next = r.current();
    for (const auto* s : storages_) next.erase(s);
    r.publish(std::move(next));
  }
  // On another thread the key stays on the preparing one, where the fallback finds nothing to do.
  if (thread_ == std::this_thread::get_id() && --watches_here == 0) c10::impl::tls_set_dispatch_key_included(kKey, false);
}

TouchPause::TouchPause() : was_(paused) { paused = true; }
TouchPause::~TouchPause() { paused = was_; }

}  // namespace zeal::zero
