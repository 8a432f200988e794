#include "engine/buffers.h"

#include <mutex>
#include <unordered_map>

#include <c10/util/intrusive_ptr.h>
#include <fmt/format.h>

#include "engine/error.h"

namespace zeal {
namespace {

// The buffers marked non-persistent, by their tensor: a mark belongs to the tensor registered (a
// device move or a dtype cast, set_data, keeps it). The weak reference keeps the address from being
// reused while the mark is held and tells a dead tensor's mark, dropped at the next marking.
using Weak = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}

std::unordered_map<const c10::TensorImpl*, Weak>& registry() {
  static std::unordered_map<const c10::TensorImpl*, Weak> r;
  return r;
}

// Whether `t` is marked (under the lock): its address can be no other tensor's while a mark holds it.
bool marked(const at::Tensor& t) { return registry().count(t.unsafeGetTensorImpl()) > 0; }

at::Tensor own_buffer(const torch::nn::Module& module, const std::string& name, const char* what) {
  const auto own = module.named_buffers(/*recurse=*/false);
  if (const at::Tensor* t = own.find(name)) return *t;
  std::string names;
  for (const auto& item : own) names += (names.empty() ? "" : ", ") + item.key();
  throw Error(fmt::format("{}: {} has no buffer '{}' of its own (its buffers: {})", what, module.name(), name,
                          names.empty() ? std::string("none") : names));
}

}  // namespace

void set_buffer_persistent(torch::nn::Module& module, const std::string& name, bool persistent) {
  const at::Tensor t = own_buffer(module, name, "set_buffer_persistent");
  if (!t.defined()) throw Error(fmt::format("set_buffer_persistent: {}'s buffer '{}' is undefined", module.name(), name));
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto& r = registry();
  std::erase_if(r, [](const auto& e) { return e.second.expired(); });  // dead tensors' marks
  if (persistent) {
    r.erase(t.unsafeGetTensorImpl());
  } else {
    r.emplace(t.unsafeGetTensorImpl(), Weak(t.getIntrusivePtr()));
  }
}

at::Tensor register_buffer(torch::nn::Module& module, const std::string& name, at::Tensor tensor, bool persistent) {
  at::Tensor& t = module.register_buffer(name, std::move(tensor));
  set_buffer_persistent(module, name, persistent);
  return t;
}

bool buffer_persistent(const torch::nn::Module& module, const std::string& name) {
  const at::Tensor t = own_buffer(module, name, "buffer_persistent");
  std::lock_guard<std::mutex> lock(registry_mutex());
  return !t.defined() || !marked(t);
}

std::unordered_set<std::string> non_persistent_buffers(const torch::nn::Module& model) {
  std::unordered_set<std::string> out;
  std::lock_guard<std::mutex> lock(registry_mutex());
  if (registry().empty()) return out;
  for (const auto& item : model.named_buffers(/*recurse=*/true)) {
    if (item.value().defined() && marked(item.value())) out.insert(item.key());
  }
  return out;
}

}  // namespace zeal
