// Gather on touch: stage-3 units named by their module type (zero_optimization.unit_names, FSDP's
// transformer-based wrap, Accelerate's fsdp_transformer_layer_cls_to_wrap). Internal to engine/zero.
//
// A zeal::Sharded member calls into its unit around its block's forward. A module matched by type
// name has no such wrapper (LibTorch modules have no forward hooks, and a parent calls its child's
// forward directly), so its unit is driven from the dispatcher instead: while a TouchWatch lives,
// every ATen op of the thread that made it (and of autograd's backward, which inherits the thread's
// dispatch state) passes one boxed fallback that looks at the storages of the op's tensors. An op
// reading a watched unit's parameters (or any view of them) gathers that unit first if it is not
// gathered (the all-gather it waits for, or a prefetch it finds in flight) and releases the watched
// units the thread touched before that this op does not use — so a forward or a backward running
// block after block holds one block (plus its prefetches), wherever the blocks sit in the model and
// whatever calls them. Releasing early never costs a read its correctness: a later op on a released
// unit gathers it again. Writes are another matter: an op that writes a unit's parameters (copy_, an in-place op)
// outside engine.gathered(params, modifier_rank) would write into a buffer the next release drops,
// so it stops with an error naming the op and the unit.
#pragma once

#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace c10 {
struct StorageImpl;
}

namespace zeal::zero {

class Stage3;
class Unit;

// Whether a module's type name (Module::name(), e.g. "mylib::GPT2BlockImpl") is one of `names`: the
// name as LibTorch gives it, without its namespace, or without its namespace and the TORCH_MODULE
// "Impl" suffix ("GPT2Block").
bool unit_name_matches(const std::string& type_name, const std::vector<std::string>& names);

// The watch over a set of units' full buffers (their storages), for the life of the object. Ops on
// them on the constructing thread call owner.touched(units the op reads, those it writes, its name).
class TouchWatch {
 public:
  TouchWatch(Stage3& owner, std::vector<std::pair<const c10::StorageImpl*, Unit*>> storages);
  ~TouchWatch();
  TouchWatch(const TouchWatch&) = delete;
  TouchWatch& operator=(const TouchWatch&) = delete;

 private:
  std::vector<const c10::StorageImpl*> storages_;
  std::thread::id thread_;
};

// The engine's own work on the units' buffers (gathers, steps, state access): ops under it are not
// touches.
class TouchPause {
 public:
  TouchPause();
  ~TouchPause();
  TouchPause(const TouchPause&) = delete;
  TouchPause& operator=(const TouchPause&) = delete;

 private:
  bool was_;
};

}  // namespace zeal::zero
