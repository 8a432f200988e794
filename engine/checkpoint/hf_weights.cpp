// Hugging Face-style weights (safetensors files, one or an index) into LibTorch models: into a
// plain model (load_checkpoint_in_model, zeal::load_pretrained's reading), into one an engine built
// partitioned (engine.init) or prepared (each rank reads only its elements, checked first, then
// streamed a few MiB at a time); and the names exports use.
#include "engine/checkpoint/hf_weights.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>

#include "engine/buffers.h"
#include "engine/checkpoint/safetensors.h"
#include "engine/checkpoint/state_stream.h"
#include "engine/checkpoint/tensor_dtype.h"
#include "engine/engine_state.h"
#include "engine/error.h"
#include "engine/log.h"
#include "engine/peft/lora.h"
#include "engine/peft/slots.h"

namespace zeal {

namespace fs = std::filesystem;
using nlohmann::json;

namespace ckpt {

json export_names(const torch::nn::Module& model) {
  const auto hf = peft::hf_namer(model);
  std::vector<std::string> adapters;  // "<layer>.lora_A.", "<layer>.lora_B."
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    const auto children = item.value()->named_children();
    if (children.contains("lora_A") && children.contains("lora_B")) {
      adapters.push_back(item.key() + ".lora_A.");
      adapters.push_back(item.key() + ".lora_B.");
    }
  }
  json out = json::object();
  auto add = [&](const std::string& name) {
    for (const auto& a : adapters) {
      if (name.rfind(a, 0) == 0) {
        out[name] = nullptr;
        return;
      }
    }
    if (const std::string h = hf(name); h != name) out[name] = h;
  };
  for (const auto& item : model.named_parameters(true)) add(item.key());
  for (const auto& item : model.named_buffers(true)) add(item.key());
  return out;
}

json lora_layers(const torch::nn::Module& model) {
  std::map<const void*, std::string> name_of;
  for (const auto& item : model.named_parameters(true)) name_of.emplace(item.value().unsafeGetTensorImpl(), item.key());
  json out = json::object();
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    peft::detail::Slot slot;
    // Adapters turned off by a disable_adapter() scope are still the model's (merged ones have no slot).
    if (!peft::detail::find_any_slot(item.value().get(), &slot)) continue;
    const auto* lin = dynamic_cast<const torch::nn::LinearImpl*>(item.value().get());
    const auto w = lin ? name_of.find(lin->weight.unsafeGetTensorImpl()) : name_of.end();
    const auto a = name_of.find(slot.A->weight.unsafeGetTensorImpl()), b = name_of.find(slot.B->weight.unsafeGetTensorImpl());
    if (w == name_of.end() || a == name_of.end() || b == name_of.end()) {
      throw Error(fmt::format("the LoRA adapters of '{}' are not parameters of the model", item.key()));
    }
    out[w->second] = {{"A", a->second}, {"B", b->second}, {"scaling", slot.scaling}};
  }
  return out;
}

}  // namespace ckpt

using namespace ckpt;

namespace {

// Hugging Face-style weights: a directory (model.safetensors, or an index and its files) or one
// .safetensors file: which file holds each tensor, and where.
struct HfWeights {
  fs::path dir;
  std::map<std::string, std::string> where;
  std::map<std::string, ckpt::SafetensorsHeader> headers;

  explicit HfWeights(const fs::path& d) : dir(d) {
    if (fs::is_regular_file(d)) {
      dir = d.parent_path();
      for (const auto& [name, e] : ckpt::read_safetensors_header(d.string()).tensors) where[name] = d.filename().string();
    } else if (fs::exists(d / "model.safetensors.index.json")) {
      json idx;
      try {
        idx = json::parse(std::ifstream(d / "model.safetensors.index.json"));
        for (auto it = idx.at("weight_map").begin(); it != idx.at("weight_map").end(); ++it) {
          where[it.key()] = it.value().get<std::string>();
        }
      } catch (const json::exception& e) {
        throw Error(fmt::format("{} is not a valid index ({})", (d / "model.safetensors.index.json").string(), e.what()));
      }
    } else if (fs::exists(d / "model.safetensors")) {
      for (const auto& [name, e] : ckpt::read_safetensors_header((d / "model.safetensors").string()).tensors) {
        where[name] = "model.safetensors";
      }
    } else if (!fs::exists(d)) {
      throw Error(fmt::format("{} does not exist", d.string()));
    } else {
      throw Error(fmt::format("{} has neither model.safetensors nor model.safetensors.index.json", d.string()));
    }
  }
  bool has(const std::string& name) const { return where.count(name) > 0; }
  // The tensor `name`, checked against the model's shape (`model_name` in messages).
  std::pair<fs::path, ckpt::TensorEntry> entry(const std::string& name, const std::vector<int64_t>& shape,
                                               const std::string& model_name = "") {
    auto w = where.find(name);
    if (w == where.end()) throw Error(fmt::format("{} has no tensor '{}'", dir.string(), name));
    if (!headers.count(w->second)) headers[w->second] = ckpt::read_safetensors_header((dir / w->second).string());
    auto e = headers[w->second].tensors.find(name);
    if (e == headers[w->second].tensors.end()) {
      throw Error(fmt::format("{} has no tensor '{}' (its index says it has)", (dir / w->second).string(), name));
    }
    if (e->second.shape != shape) {
      const std::string as = model_name.empty() || model_name == name ? "" : fmt::format(" (the model's '{}')", model_name);
      throw Error(fmt::format("'{}'{} is {} in {} and {} in the model", name, as, json(e->second.shape).dump(),
                              w->second, json(shape).dump()));
    }
    return {dir / w->second, e->second};
  }
  // Whether buffer `name` in the files (`b` in the model) is read: a
  // persistent one must be there in the model's shape (entry() then says what is wrong); a
  // non-persistent one (zeal::register_buffer) is read where the files hold it in that shape, else
  // skipped, with a note where the shape differs.
  bool buffer_read(const std::string& name, const at::Tensor& b, bool persistent) {
    if (persistent) {
      if (!has(name)) {
        throw Error(fmt::format("{} has no tensor '{}', a buffer of the model (a buffer the model computes itself, "
                                "as a mask or rotary frequencies, can be marked non-persistent: "
                                "zeal::register_buffer(module, name, tensor, false))",
                                dir.string(), name));
      }
      return true;
    }
    auto w = where.find(name);
    if (w == where.end()) return false;
    if (!headers.count(w->second)) headers[w->second] = ckpt::read_safetensors_header((dir / w->second).string());
    auto e = headers[w->second].tensors.find(name);
    if (e == headers[w->second].tensors.end()) return false;
    if (e->second.shape != b.sizes().vec()) {
      log::info("'{}' is {} in {} and {} in the model, which marks it non-persistent: skipped, the model's kept",
                name, json(e->second.shape).dump(), w->second, json(b.sizes().vec()).dump());  // rank 0 says it
      return false;
    }
    return true;
  }
};

// Elements [begin, begin + count) of a tensor in a safetensors file, in the file's dtype.
at::Tensor read_elements(const fs::path& file, const ckpt::TensorEntry& e, int64_t begin, int64_t count) {
  const int64_t es = ckpt::dtype_size(e.dtype);
  at::Tensor t = at::empty({count}, at::TensorOptions().dtype(at_dtype(e.dtype)));
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error(fmt::format("cannot open {}: {}", file.string(), std::strerror(errno)));
  char* out = static_cast<char*>(t.data_ptr());
  for (int64_t got = 0, n = count * es; got < n;) {
    const ssize_t r = ::pread(fd, out + got, static_cast<size_t>(n - got), e.offset + begin * es + got);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      ::close(fd);
      throw Error(fmt::format("{} is truncated (tensor '{}')", file.string(), e.name));
    }
    got += r;
  }
  ::close(fd);
  return t;
}

// The model's buffers, each tensor once: under the first of its names whose file name (`map`) the
// files hold, else under its first name (a buffer shared under two names, which an export wrote once).
std::vector<std::pair<std::string, at::Tensor>> buffers_once(const torch::nn::Module& model, const HfWeights& w,
                                                             const std::function<std::string(const std::string&)>& map) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  std::unordered_map<const void*, size_t> at;  // tensor → its entry in `out`
  for (const auto& item : model.named_buffers(true)) {
    auto [it, fresh] = at.emplace(item.value().unsafeGetTensorImpl(), out.size());
    if (fresh) {
      out.push_back({item.key(), item.value()});
      continue;
    }
    std::string& chosen = out[it->second].first;
    const std::string f = map(chosen);
    if ((f.empty() || !w.has(f)) && w.has(map(item.key()))) chosen = item.key();
  }
  return out;
}

// Elements [begin, begin + count) of a tensor in a safetensors file copied into `dst` (count
// elements, any dtype and device) 8 MiB at a time.
void read_into(const fs::path& file, const ckpt::TensorEntry& e, int64_t begin, int64_t count, const at::Tensor& dst) {
  if (!dst.is_contiguous()) {  // a view whose elements are not its storage's in order: through one copy
    at::Tensor whole = at::empty({count}, dst.options());
    read_into(file, e, begin, count, whole);
    dst.copy_(whole.view(dst.sizes()));
    return;
  }
  const at::Tensor flat = dst.view({-1});
  const int64_t chunk = std::max<int64_t>(1, (8 << 20) / ckpt::dtype_size(e.dtype));
  for (int64_t at = 0; at < count; at += chunk) {
    const int64_t n = std::min(chunk, count - at);
    flat.narrow(0, at, n).copy_(read_elements(file, e, begin + at, n));
  }
}

// Which engine prepared a module (load_checkpoint_in_model then loads its shards).
std::mutex prepared_mu;
std::map<const torch::nn::Module*, Engine*> prepared_modules;

}  // namespace

void remember_prepared(const torch::nn::Module* module, Engine* engine) {
  std::lock_guard<std::mutex> lock(prepared_mu);
  if (engine) prepared_modules[module] = engine;
  else prepared_modules.erase(module);
}

namespace detail {

int64_t load_mapped(torch::nn::Module& model, const std::string& path,
                    const std::function<std::string(const std::string&)>& map) {
  // The engine that prepared `model`, or the model one prepared that holds it (a module inside it).
  // Its parameters' values live in that engine's shards and master weights: loaded through it, the
  // names relative to `model` (a tied parameter under whichever name the prepared model gives it).
  Engine* engine = nullptr;
  torch::nn::Module* root = nullptr;
  {
    std::lock_guard<std::mutex> lock(prepared_mu);
    auto it = prepared_modules.find(&model);
    if (it != prepared_modules.end()) engine = it->second;
    for (auto p = prepared_modules.begin(); !engine && p != prepared_modules.end(); ++p) {
      // The engine's own handle on its model (alive while the engine is), not the key.
      const auto& held = p->second->state_->module;
      if (!held) continue;
      for (const auto& sub : held->named_modules("", /*include_self=*/false)) {
        if (sub.value().get() != &model) continue;
        engine = p->second;
        root = held.get();
        break;
      }
    }
  }
  if (engine && !root) {
    if (const int64_t n = engine->load_weights_sharded(model, path, map); n >= 0) return n;
  } else if (engine) {
    std::unordered_map<const void*, std::string> relative;  // model's tensors → their names in it
    for (const auto& item : model.named_parameters(true)) relative.emplace(item.value().unsafeGetTensorImpl(), item.key());
    for (const auto& item : model.named_buffers(true)) relative.emplace(item.value().unsafeGetTensorImpl(), item.key());
    std::unordered_map<std::string, std::string> in_model;  // the prepared model's names → model's
    for (const auto& item : root->named_parameters(true)) {
      auto r = relative.find(item.value().unsafeGetTensorImpl());
      if (r != relative.end()) in_model.emplace(item.key(), r->second);
    }
    for (const auto& item : root->named_buffers(true)) {
      auto r = relative.find(item.value().unsafeGetTensorImpl());
      if (r != relative.end()) in_model.emplace(item.key(), r->second);
    }
    const auto mapped = [&](const std::string& name) {
      auto r = in_model.find(name);
      return r == in_model.end() ? std::string() : map(r->second);
    };
    if (const int64_t n = engine->load_weights_sharded(*root, path, mapped); n >= 0) return n;
  }
  HfWeights w{fs::path(path)};
  struct Target {
    std::string name, file_name;
    at::Tensor t;
  };
  std::vector<Target> targets;
  std::unordered_set<const void*> seen;
  for (const auto& item : model.named_parameters(true)) {
    if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;
    std::string f = map(item.key());
    if (!f.empty()) targets.push_back({item.key(), std::move(f), item.value()});
  }
  const auto transient = non_persistent_buffers(model);
  for (const auto& [key, b] : buffers_once(model, w, map)) {
    std::string f = map(key);
    if (f.empty() || !w.buffer_read(f, b, !transient.count(key))) continue;
    if (seen.insert(b.unsafeGetTensorImpl()).second) targets.push_back({key, std::move(f), b});
  }
  // Every name and shape first: nothing changes when one is wrong (the headers' check also says
  // every tensor lies inside its file).
  for (const auto& t : targets) (void)w.entry(t.file_name, t.t.sizes().vec(), t.name);
  c10::NoGradGuard no_grad;
  for (const auto& t : targets) {
    const auto [file, e] = w.entry(t.file_name, t.t.sizes().vec(), t.name);
    read_into(file, e, 0, t.t.numel(), t.t);
  }
  return static_cast<int64_t>(targets.size());
}

std::map<std::string, std::string> tensor_files(const std::string& path) {
  HfWeights w{fs::path(path)};
  std::map<std::string, std::string> out;
  for (const auto& [name, file] : w.where) out[name] = fs::absolute(w.dir / file).string();
  return out;
}

at::Tensor read_tensor(const std::string& path, const std::string& name) {
  HfWeights w{fs::path(path)};
  if (!w.has(name)) throw Error(fmt::format("{} has no tensor '{}'", path, name));
  const std::string file = w.where.at(name);
  const auto header = ckpt::read_safetensors_header((w.dir / file).string());
  const auto& e = header.tensors.at(name);
  int64_t n = 1;
  for (int64_t d : e.shape) n *= d;
  return read_elements(w.dir / file, e, 0, n).view(e.shape);
}

std::vector<std::string> tensor_names(const std::string& path) {
  HfWeights w{fs::path(path)};
  std::vector<std::string> names;
  for (const auto& [name, file] : w.where) names.push_back(name);
  return names;
}

}  // namespace detail

int64_t load_checkpoint_in_model(torch::nn::Module& model, const std::string& dir) {
  try {
    // The names an export wrote (export_names: the Sharded level left out; adapter tensors, which
    // exports leave out, skipped), or the model's own where the files have them.
    const auto in_files = detail::tensor_names(dir);
    const std::unordered_set<std::string> names(in_files.begin(), in_files.end());
    const json exported = export_names(model);
    return detail::load_mapped(model, dir, [names, exported](const std::string& n) -> std::string {
      if (names.count(n)) return n;
      const auto it = exported.find(n);
      if (it == exported.end()) return n;
      return it->is_null() ? std::string() : it->get<std::string>();
    });
  } catch (const Error& e) {
    throw Error(std::string("load_checkpoint_in_model: ") + e.what());
  }
}

int64_t Engine::load_weights_sharded(torch::nn::Module& model, const std::string& path,
                                     const std::function<std::string(const std::string&)>& map) {
  if (!state_->zero) {
    // Built by engine.init and not prepared yet: each partitioned parameter's slice is read
    // (elements [rank·per, rank·per + per) of it), the rest whole. Collective.
    if (!state_->init_shards || state_->init_shards->empty()) return -1;
    // Pass one checks every name and shape (and that the files hold the bytes: the headers' check);
    // the ranks agree; pass two reads each destination's elements 8 MiB at a time into it.
    struct Planned {
      at::Tensor dst;  // count elements
      fs::path file;
      ckpt::TensorEntry e;
      int64_t begin, count;
    };
    std::vector<Planned> reads;
    std::string error;
    int64_t n = 0;
    try {
      HfWeights w{fs::path(path)};
      const auto transient = non_persistent_buffers(model);
      std::unordered_set<const void*> seen;
      // The rank the slices were cut for: its place among the ranks the state is sharded over (with
      // hybrid_shard, its machine's).
      const int64_t rank = shard_comm().rank();
      for (const auto& item : model.named_parameters(true)) {
        if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;
        const std::string f = map(item.key());
        if (f.empty()) continue;
        const auto [file, e] = w.entry(f, item.value().sizes().vec(), item.key());
        ++n;
        if (auto* slice = state_->init_shards->find(item.value())) {
          const int64_t per = slice->data.numel();
          const int64_t begin = std::min<int64_t>(rank * per, slice->numel);
          const int64_t count = std::min<int64_t>(per, slice->numel - begin);
          if (count > 0) reads.push_back({slice->data.narrow(0, 0, count), file, e, begin, count});
        } else {
          reads.push_back({item.value(), file, e, 0, item.value().numel()});
        }
      }
      for (const auto& [key, b] : buffers_once(model, w, map)) {
        const std::string f = map(key);
        if (f.empty() || !w.buffer_read(f, b, !transient.count(key)) || !seen.insert(b.unsafeGetTensorImpl()).second) {
          continue;
        }
        const auto [file, e] = w.entry(f, b.sizes().vec(), key);
        reads.push_back({b, file, e, 0, b.numel()});
        ++n;
      }
      for (const auto& r : reads) (void)at_dtype(r.e.dtype);  // one zeal can read, or the error names it now
    } catch (const std::exception& e) {
      error = e.what();
    }
    const std::string failed = agreed_failures(*this, error);
    if (!failed.empty()) throw Error(fmt::format("{}: nothing was changed:{}", path, failed));
    std::string reread;
    try {
      c10::NoGradGuard no_grad;
      for (const auto& r : reads) read_into(r.file, r.e, r.begin, r.count, r.dst);
    } catch (const std::exception& e) {
      reread = e.what();
    }
    if (const std::string again = agreed_failures(*this, reread); !again.empty()) {
      throw Error(fmt::format("{}: the weights were checked, then failed when read to be applied: the model is now "
                              "partly loaded; load weights again before training:{}",
                              path, again));
    }
    return n;
  }
  wait_for_save();
  zero::Sharding& z = *state_->zero;
  // Pass one checks every name, shape and dtype this rank needs and that the files hold their
  // bytes; the ranks agree; pass two reads each rank's elements a few MiB at a time straight into
  // their places (stage-3 shards on disk a unit at a time), so the load holds no copy of the model.
  std::vector<zero::StateRange> ranges;
  std::vector<std::tuple<const zero::StateRange*, fs::path, ckpt::TensorEntry>> planned;
  std::vector<std::tuple<at::Tensor, fs::path, ckpt::TensorEntry>> buffers;  // the model's, read in pass two
  std::vector<std::pair<at::Tensor, at::Tensor>> copied_back;  // (frozen parameter not contiguous, its copy)
  std::string error;
  try {
    z.begin_state_access();
    HfWeights w{fs::path(path)};
    ranges = z.state_ranges(/*to_write=*/false);
    if (z.stage() < 3) {
      for (auto& [name, p] : frozen_params(*state_->module)) {
        at::Tensor values = p.detach();
        if (!values.is_contiguous()) copied_back.push_back({p, values = values.contiguous()});
        ranges.push_back({name, p.sizes().vec(), 0, p.numel(), values.view({-1})});
      }
    }
    for (const auto& r : ranges) {
      const std::string f = map(r.name);
      if (f.empty()) continue;
      auto [file, e] = w.entry(f, r.shape, r.name);
      (void)at_dtype(e.dtype);  // one zeal can read, or the error names it now
      planned.emplace_back(&r, std::move(file), std::move(e));
    }
    const auto transient = non_persistent_buffers(*state_->module);
    for (const auto& [key, b] : buffers_once(*state_->module, w, map)) {
      const std::string f = map(key);
      if (f.empty() || !w.buffer_read(f, b, !transient.count(key))) continue;
      auto [file, e] = w.entry(f, b.sizes().vec(), key);
      (void)at_dtype(e.dtype);
      buffers.emplace_back(b, std::move(file), std::move(e));
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  const std::string failed = agreed_failures(*this, error);
  if (!failed.empty()) {
    z.end_state_access(/*changed=*/false);
    throw Error(fmt::format("{}: nothing was changed:{}", path, failed));
  }
  std::string reread;
  try {
    c10::NoGradGuard no_grad;
    GroupWalk walk(z, /*changed=*/true);
    for (const auto& [r, file, e] : planned) {
      walk.at(*r);
      const int64_t chunk = std::max<int64_t>(1, (8 << 20) / ckpt::dtype_size(e.dtype));
      for (int64_t at = 0; at < r->count; at += chunk) {
        const int64_t n = std::min(chunk, r->count - at);
        put_elements(*r, r->step ? "master" : "param", at, read_elements(file, e, r->begin + at, n));
      }
    }
    walk.close();
    for (const auto& [b, file, e] : buffers) read_into(file, e, 0, b.numel(), b);
    for (auto& [t, values] : copied_back) t.detach().copy_(values);
  } catch (const std::exception& e) {
    reread = e.what();
  }
  z.end_state_access(/*changed=*/true);
  if (const std::string again = agreed_failures(*this, reread); !again.empty()) {
    throw Error(fmt::format("{}: the weights were checked, then failed when read to be applied: the model is now "
                            "partly loaded; load weights again before training:{}",
                            path, again));
  }
  // Tensors read, counted as the unprepared path counts them: each parameter once, and the buffers.
  std::unordered_set<const void*> seen;
  int64_t n = static_cast<int64_t>(buffers.size());
  for (const auto& item : state_->module->named_parameters(true)) {
    if (map(item.key()).empty()) continue;
    n += seen.insert(item.value().unsafeGetTensorImpl()).second ? 1 : 0;
  }
  return n;
}

}  // namespace zeal
