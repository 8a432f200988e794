// zeal::peft (LoRA with PEFT's API and files) and zeal::load_pretrained.
#include "engine/peft/lora.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <mutex>
#include <regex>
#include <set>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <torch/nn/init.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>

#include "engine/buffers.h"
#include "engine/checkpoint/consolidate.h"
#include "engine/checkpoint/safetensors.h"
#include "engine/checkpoint/tensor_dtype.h"
#include "engine/checkpoint/transforms.h"
#include "engine/engine.h"
#include "engine/error.h"
#include "engine/log.h"
#include "engine/peft/slots.h"
#include "engine/zero/sharded.h"
#include "engine/zero/touch.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace zeal {
namespace peft {
namespace detail {
namespace {
std::mutex slots_mu;
std::unordered_map<const torch::nn::Module*, Slot> slots;
std::atomic<int> live{0};

void recount() {
  int n = 0;
  for (const auto& [k, s] : slots) n += s.active ? 1 : 0;
  live.store(n, std::memory_order_release);
}
}  // namespace

int live_slots() { return live.load(std::memory_order_acquire); }

namespace {
bool find_in_slots(const torch::nn::Module* linear, Slot* out, bool inactive_too) {
  std::lock_guard<std::mutex> lock(slots_mu);
  auto it = slots.find(linear);
  if (it == slots.end() || (!it->second.active && !inactive_too)) return false;
  auto owner = it->second.owner.lock();
  if (owner.get() != linear) return false;  // a module since destroyed, its address reused
  *out = it->second;
  return true;
}
}  // namespace

bool find_slot(const torch::nn::Module* linear, Slot* out) { return find_in_slots(linear, out, false); }
bool find_any_slot(const torch::nn::Module* linear, Slot* out) { return find_in_slots(linear, out, true); }

void add_slot(const torch::nn::Module* linear, Slot slot) {
  std::lock_guard<std::mutex> lock(slots_mu);
  // Forget slots whose modules are gone.
  for (auto it = slots.begin(); it != slots.end();) it = it->second.owner.expired() ? slots.erase(it) : std::next(it);
  slots[linear] = std::move(slot);
  recount();
}

void set_active(const torch::nn::Module* linear, bool active) {
  std::lock_guard<std::mutex> lock(slots_mu);
  auto it = slots.find(linear);
  if (it != slots.end()) it->second.active = active;
  recount();
}

void remove_slot(const torch::nn::Module* linear) {
  std::lock_guard<std::mutex> lock(slots_mu);
  slots.erase(linear);
  recount();
}

bool has_slot(const torch::nn::Module* linear) {
  std::lock_guard<std::mutex> lock(slots_mu);
  auto it = slots.find(linear);
  return it != slots.end() && it->second.owner.lock().get() == linear;
}

std::vector<std::pair<std::string, bool>> adapter_runs(const torch::nn::Module& root) {
  std::vector<std::pair<std::string, bool>> out;
  if (live_slots() == 0) return out;
  for (const auto& item : root.named_modules("", false)) {
    Slot slot;
    if (find_slot(item.value().get(), &slot)) out.push_back({item.key(), slot.runs->load(std::memory_order_relaxed) > 0});
  }
  return out;
}
}  // namespace detail

namespace {

constexpr const char* kForwardSymbol = "_ZN5torch2nn10LinearImpl7forwardERKN2at6TensorE";
const std::string kPrefix = "base_model.model.";

bool main_process(Engine* engine) {
  if (engine) return engine->is_main_process();
  const char* r = std::getenv("RANK");
  return !r || std::string(r) == "0";
}

// PEFT's matching: a name equal to the module path or a suffix after a dot; or a full-match pattern.
bool matches(const std::string& path, const std::vector<std::string>& names, const std::string& regex) {
  if (!regex.empty()) return std::regex_match(path, std::regex(regex));
  for (const auto& t : names) {
    if (path == t) return true;
    if (path.size() > t.size() && path.compare(path.size() - t.size(), t.size(), t) == 0 &&
        path[path.size() - t.size() - 1] == '.') {
      return true;
    }
  }
  return false;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string thousands(int64_t n) {
  std::string d = std::to_string(n), out;
  for (size_t i = 0; i < d.size(); ++i) {
    if (i > 0 && (d.size() - i) % 3 == 0) out += ',';
    out += d[i];
  }
  return out;
}

// Agrees a failure of any rank (its message) and throws it everywhere.
void agree(Engine* engine, const std::string& what, const std::string& error) {
  if (!engine || engine->num_processes() == 1) {
    if (!error.empty()) throw Error(what + ": " + error);
    return;
  }
  at::Tensor failed = at::full({1}, error.empty() ? 0.0 : 1.0, at::TensorOptions().dtype(at::kFloat).device(engine->device()));
  failed = engine->reduce(failed, "sum");
  if (failed.item<double>() > 0) {
    throw Error(fmt::format("{}: {}", what,
                            error.empty() ? std::string("another rank failed (its message is in its own log)") : error));
  }
}

void write_file_atomically(const fs::path& path, const std::string& text) {
  const fs::path tmp = path.string() + ".partial";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << text;
    out.flush();
    if (!out) throw Error(fmt::format("cannot write {}", tmp.string()));
  }
  const int fd = ::open(tmp.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
  fs::rename(tmp, path);
}


// Writes (name, tensor) pairs as a safetensors file through a temporary name; `fill(i)` gives the
// i-th tensor's values when its turn comes (so one group can be gathered at a time).
struct NamedShape {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
};

}  // namespace

bool forward_interposed() {
  void* sym = ::dlsym(RTLD_DEFAULT, kForwardSymbol);
  if (!sym) return false;
  Dl_info called{}, ours{};
  if (!::dladdr(sym, &called) || !::dladdr(reinterpret_cast<void*>(&forward_interposed), &ours)) return false;
  return called.dli_fbase == ours.dli_fbase;
}

std::function<std::string(const std::string&)> hf_namer(const torch::nn::Module& model) {
  std::vector<std::string> prefixes;  // "P." for each Sharded module P ("" for the root)
  if (dynamic_cast<const ShardedBase*>(&model)) prefixes.push_back("");
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    if (dynamic_cast<const ShardedBase*>(item.value().get())) prefixes.push_back(item.key() + ".");
  }
  std::sort(prefixes.begin(), prefixes.end(), [](const auto& a, const auto& b) { return a.size() > b.size(); });
  return [prefixes](const std::string& name) {
    std::string out = name;
    for (const auto& p : prefixes) {  // longest first: removing later positions keeps earlier ones
      const std::string with = p + "block";
      if (name.compare(0, with.size(), with) == 0 && (name.size() == with.size() || name[with.size()] == '.')) {
        out.erase(p.size(), name.size() == with.size() ? 5 : 6);
      }
    }
    if (!out.empty() && out.back() == '.') out.pop_back();
    return out;
  };
}

// --- LoraConfig -----------------------------------------------------------------------------

double LoraConfig::scaling() const {
  return use_rslora ? lora_alpha / std::sqrt(static_cast<double>(r)) : lora_alpha / static_cast<double>(r);
}

std::string LoraConfig::to_json() const {
  json j;
  j["alpha_pattern"] = json::object();
  j["auto_mapping"] = nullptr;
  j["base_model_name_or_path"] = base_model_name_or_path.empty() ? json(nullptr) : json(base_model_name_or_path);
  j["bias"] = bias;
  j["exclude_modules"] = exclude_modules.empty() ? json(nullptr) : json(exclude_modules);
  j["fan_in_fan_out"] = false;
  j["inference_mode"] = true;
  if (init_lora_weights == "default") j["init_lora_weights"] = true;
  else if (init_lora_weights == "none") j["init_lora_weights"] = false;
  else j["init_lora_weights"] = init_lora_weights;
  j["layer_replication"] = nullptr;
  j["layers_pattern"] = nullptr;
  j["layers_to_transform"] = nullptr;
  j["loftq_config"] = json::object();
  j["lora_alpha"] = lora_alpha;
  j["lora_bias"] = false;
  j["lora_dropout"] = lora_dropout;
  j["megatron_config"] = nullptr;
  j["megatron_core"] = "megatron.core";
  j["modules_to_save"] = modules_to_save.empty() ? json(nullptr) : json(modules_to_save);
  j["peft_type"] = "LORA";
  j["r"] = r;
  j["rank_pattern"] = json::object();
  j["revision"] = nullptr;
  if (!target_modules_regex.empty()) j["target_modules"] = target_modules_regex;
  else if (target_modules.size() == 1 && target_modules[0] == "all-linear") j["target_modules"] = "all-linear";
  else j["target_modules"] = target_modules;
  j["task_type"] = task_type.empty() ? json(nullptr) : json(task_type);
  j["use_dora"] = false;
  j["use_rslora"] = use_rslora;
  return j.dump(2) + "\n";
}

LoraConfig LoraConfig::from_json(const std::string& text, const std::string& where) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw Error(fmt::format("{} is not valid JSON: {}", where, e.what()));
  }
  LoraConfig c;
  auto field = [&](const char* key) -> const json* {
    auto it = j.find(key);
    return it == j.end() || it->is_null() ? nullptr : &*it;
  };
  try {
    if (auto* v = field("peft_type"); v && v->get<std::string>() != "LORA") {
      throw Error(fmt::format("{}: peft_type is '{}'; zeal reads LORA adapters", where, v->get<std::string>()));
    }
    if (auto* v = field("r")) c.r = v->get<int64_t>();
    if (auto* v = field("lora_alpha")) c.lora_alpha = v->get<double>();
    if (auto* v = field("lora_dropout")) c.lora_dropout = v->get<double>();
    if (auto* v = field("bias")) c.bias = v->get<std::string>();
    if (auto* v = field("use_rslora")) c.use_rslora = v->get<bool>();
    if (auto* v = field("target_modules")) {
      if (v->is_string()) {
        const std::string s = v->get<std::string>();
        if (s == "all-linear") c.target_modules = {"all-linear"};
        else c.target_modules_regex = s;
      } else {
        c.target_modules = v->get<std::vector<std::string>>();
      }
    }
    if (auto* v = field("exclude_modules")) {
      if (v->is_string()) throw Error(fmt::format("{}: exclude_modules as a pattern is not supported; give names", where));
      c.exclude_modules = v->get<std::vector<std::string>>();
    }
    if (auto* v = field("modules_to_save")) c.modules_to_save = v->get<std::vector<std::string>>();
    if (auto* v = field("init_lora_weights")) {
      if (v->is_boolean()) c.init_lora_weights = v->get<bool>() ? "default" : "none";
      else c.init_lora_weights = v->get<std::string>();
    }
    if (auto* v = field("base_model_name_or_path")) c.base_model_name_or_path = v->get<std::string>();
    if (auto* v = field("task_type")) c.task_type = v->get<std::string>();
    for (const char* unsupported : {"use_dora", "fan_in_fan_out", "lora_bias"}) {
      if (auto* v = field(unsupported); v && v->is_boolean() && v->get<bool>()) {
        throw Error(fmt::format("{}: {} is true; zeal's LoRA does not support it", where, unsupported));
      }
    }
    for (const char* unsupported : {"rank_pattern", "alpha_pattern"}) {
      if (auto* v = field(unsupported); v && !v->empty()) {
        throw Error(fmt::format("{}: {} is not empty; zeal's LoRA uses one r and lora_alpha for every layer", where,
                                unsupported));
      }
    }
    for (const char* unsupported : {"layers_to_transform", "layer_replication"}) {
      if (field(unsupported)) throw Error(fmt::format("{}: {} is set; zeal's LoRA does not support it", where, unsupported));
    }
  } catch (const json::exception& e) {
    throw Error(fmt::format("{}: a field has the wrong type: {}", where, e.what()));
  }
  return c;
}

LoraConfig LoraConfig::from_pretrained(const std::string& dir) {
  const fs::path p = fs::path(dir) / "adapter_config.json";
  std::ifstream in(p);
  if (!in) throw Error(fmt::format("cannot read {}", p.string()));
  std::stringstream ss;
  ss << in.rdbuf();
  return from_json(ss.str(), p.string());
}

// --- injection ------------------------------------------------------------------------------

namespace {

void check_config(const LoraConfig& c) {
  std::vector<std::string> bad;
  if (c.r <= 0) bad.push_back(fmt::format("r must be at least 1 (got {})", c.r));
  if (!std::isfinite(c.lora_alpha)) bad.push_back("lora_alpha must be a finite number");
  if (!(c.lora_dropout >= 0 && c.lora_dropout < 1)) bad.push_back(fmt::format("lora_dropout must be in [0, 1) (got {})", c.lora_dropout));
  if (c.bias != "none" && c.bias != "all" && c.bias != "lora_only") {
    bad.push_back(fmt::format("bias must be none, all or lora_only (got '{}')", c.bias));
  }
  if (c.init_lora_weights != "default" && c.init_lora_weights != "gaussian" && c.init_lora_weights != "none") {
    bad.push_back(fmt::format("init_lora_weights must be default, gaussian or none (got '{}')", c.init_lora_weights));
  }
  if (c.target_modules.empty() && c.target_modules_regex.empty()) bad.push_back("target_modules is empty: name the Linear modules to adapt");
  if (!c.target_modules_regex.empty()) {
    try {
      std::regex re(c.target_modules_regex);
    } catch (const std::regex_error& e) {
      bad.push_back(fmt::format("target_modules_regex '{}' is not a valid pattern: {}", c.target_modules_regex, e.what()));
    }
  }
  if (!bad.empty()) {
    std::string msg = "get_peft_model: invalid LoraConfig:";
    for (const auto& b : bad) msg += "\n  " + b;
    throw Error(msg);
  }
}

bool is_output_layer(const std::string& path) {
  for (const char* n : {"lm_head", "classifier", "score", "output"}) {
    if (path == n || ends_with(path, std::string(".") + n)) return true;
  }
  return false;
}

struct Entry {
  std::string model_name;  // the model's own name
  std::string key;         // PEFT's saved name
  at::Tensor t;
};

}  // namespace

PeftModel get_peft_model(std::shared_ptr<torch::nn::Module> model, const LoraConfig& config) {
  if (!model) throw Error("get_peft_model: the model is empty");
  check_config(config);
  if (!forward_interposed()) {
    Dl_info called{};
    void* sym = ::dlsym(RTLD_DEFAULT, kForwardSymbol);
    const std::string who = sym && ::dladdr(sym, &called) && called.dli_fname ? called.dli_fname : "nothing";
    throw Error(fmt::format(
        "get_peft_model: torch::nn::LinearImpl::forward resolves to {} instead of libzeal: link the program against "
        "zeal before torch (CMake: target_link_libraries(app PRIVATE zeal), which brings torch after it); a static "
        "libtorch cannot carry adapters",
        who));
  }
  const auto hf = hf_namer(*model);
  const bool all_linear = config.target_modules.size() == 1 && config.target_modules[0] == "all-linear";
  PeftModel pm;
  pm.model_ = model;
  pm.config_ = config;
  // Modules trained whole.
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> saved;
  for (const auto& item : model->named_modules("", false)) {
    const std::string path = hf(item.key());
    if (!config.modules_to_save.empty() && matches(path, config.modules_to_save, "")) {
      bool inside = false;
      for (const auto& [p, m] : saved) inside = inside || path.rfind(p + ".", 0) == 0;
      if (!inside) saved.push_back({path, item.value()});
    }
  }
  for (const auto& m : config.modules_to_save) {
    bool found = false;
    for (const auto& [p, mod] : saved) found = found || matches(p, {m}, "");
    // PEFT adds "classifier" and "score" for SEQ_CLS itself and keeps them when they match nothing.
    const bool peft_default = config.task_type == "SEQ_CLS" && (m == "classifier" || m == "score");
    if (!found && !peft_default) {
      throw Error(fmt::format("get_peft_model: modules_to_save names '{}', which the model does not have", m));
    }
  }
  auto in_saved = [&](const std::string& path) {
    for (const auto& [p, m] : saved) {
      if (path == p || path.rfind(p + ".", 0) == 0) return true;
    }
    return false;
  };
  // The Linear modules to adapt, each once (a module reachable by two paths takes the first).
  struct Target {
    std::string path;
    std::shared_ptr<torch::nn::LinearImpl> linear;
  };
  std::vector<Target> targets;
  std::unordered_set<const torch::nn::Module*> seen;
  std::vector<std::string> linear_paths;
  // Linear modules whose owner multiplies by their weight itself, never calling Linear::forward:
  // adapters there would never run. torch::nn::MultiheadAttention's out_proj is the one LibTorch has.
  std::unordered_map<const torch::nn::Module*, std::string> bypassed;
  for (const auto& item : model->named_modules(std::string(), true)) {
    if (auto mha = std::dynamic_pointer_cast<torch::nn::MultiheadAttentionImpl>(item.value())) {
      if (mha->out_proj) bypassed[mha->out_proj.get()] = "torch::nn::MultiheadAttention";
    }
  }
  for (const auto& item : model->named_modules("", false)) {
    const std::string path = hf(item.key());
    if (ends_with(path, ".lora_A") || ends_with(path, ".lora_B")) continue;
    auto lin = std::dynamic_pointer_cast<torch::nn::LinearImpl>(item.value());
    if (lin) linear_paths.push_back(path);
    const bool hit = all_linear ? (lin && !is_output_layer(path)) : matches(path, config.target_modules, config.target_modules_regex);
    if (!hit || in_saved(path)) continue;
    if (!config.exclude_modules.empty() && matches(path, config.exclude_modules, "")) continue;
    if (!lin) {
      throw Error(fmt::format("get_peft_model: target '{}' matches '{}', a {}; LoRA adapts torch::nn::Linear modules only",
                              config.target_modules_regex.empty() ? fmt::format("{}", fmt::join(config.target_modules, ", "))
                                                                  : config.target_modules_regex,
                              path, item.value()->name()));
    }
    if (!seen.insert(lin.get()).second) continue;
    if (auto by = bypassed.find(lin.get()); by != bypassed.end()) {
      if (all_linear) {
        log::info("get_peft_model: all-linear leaves out '{}': its {} multiplies by its weight directly, so adapters "
                  "there would never run",
                  path, by->second);
        continue;
      }
      throw Error(fmt::format("get_peft_model: '{}' is the out_proj of a {}, which multiplies by its weight directly "
                              "instead of calling Linear::forward: adapters there would never run; leave it out "
                              "(exclude_modules) or adapt Linear modules the model calls",
                              path, by->second));
    }
    if (detail::has_slot(lin.get())) throw Error(fmt::format("get_peft_model: '{}' has adapters already", path));
    targets.push_back({path, lin});
  }
  if (targets.empty()) {
    std::string some;
    for (size_t i = 0; i < linear_paths.size() && i < 6; ++i) some += (i ? ", " : "") + linear_paths[i];
    throw Error(fmt::format("get_peft_model: target_modules {} match no Linear module of the model (its Linear modules: {}{})",
                            config.target_modules_regex.empty() ? json(config.target_modules).dump()
                                                                : "'" + config.target_modules_regex + "'",
                            some.empty() ? "none" : some, linear_paths.size() > 6 ? ", ..." : ""));
  }
  c10::NoGradGuard no_grad;
  for (auto& p : model->parameters(true)) p.requires_grad_(false);
  const double scaling = config.scaling();
  for (auto& t : targets) {
    auto& lin = t.linear;
    const int64_t in = lin->options.in_features(), out = lin->options.out_features();
    torch::nn::Linear A(torch::nn::LinearOptions(in, config.r).bias(false));
    torch::nn::Linear B(torch::nn::LinearOptions(config.r, out).bias(false));
    if (config.init_lora_weights == "default") {
      torch::nn::init::kaiming_uniform_(A->weight, std::sqrt(5.0));
      B->weight.zero_();
    } else if (config.init_lora_weights == "gaussian") {
      A->weight.normal_(0.0, 1.0 / static_cast<double>(config.r));
      B->weight.zero_();
    }  // "none": both keep Linear's own (Kaiming-uniform) initialisation
    const auto opts = lin->weight.options();
    const auto dtype = at::isFloatingType(opts.dtype().toScalarType()) ? opts.dtype().toScalarType() : at::kFloat;
    A->to(opts.device(), dtype);
    B->to(opts.device(), dtype);
    lin->register_module("lora_A", A);
    lin->register_module("lora_B", B);
    detail::Slot slot;
    slot.owner = lin;
    slot.A = A.ptr();
    slot.B = B.ptr();
    if (config.lora_dropout > 0) {
      torch::nn::Dropout d(config.lora_dropout);
      lin->register_module("lora_dropout", d);
      slot.dropout = d.ptr();
    }
    slot.scaling = scaling;
    detail::add_slot(lin.get(), slot);
    A->weight.requires_grad_(true);
    B->weight.requires_grad_(true);
    if (config.bias == "lora_only" && lin->bias.defined()) lin->bias.requires_grad_(true);
    pm.adapted_.push_back(t.path);
    pm.linears_.push_back(lin);
  }
  if (config.bias == "all") {
    for (const auto& item : model->named_parameters(true)) {
      const std::string path = hf(item.key());
      if (path == "bias" || ends_with(path, ".bias")) item.value().requires_grad_(true);
    }
  }
  for (auto& [path, m] : saved) {
    pm.saved_modules_.push_back(path);
    for (auto& p : m->parameters(true)) {
      if (p.has_storage() && p.storage().nbytes() < p.nbytes()) {
        throw Error(fmt::format("get_peft_model: modules_to_save's '{}' holds only this rank's slices (built partitioned "
                                "by engine.init inside a zeal::Sharded unit), so its original values cannot be kept; "
                                "keep it outside the Sharded members",
                                path));
      }
      // The original beside the trained copy (PEFT's ModulesToSaveWrapper): the module itself trains,
      // its values as they are now come back under disable_adapter() and in save_merged.
      c10::NoGradGuard no_grad;
      pm.originals_.push_back({p, p.detach().to(at::kCPU, /*non_blocking=*/false, /*copy=*/true)});
      p.requires_grad_(true);
    }
  }
  return pm;
}

// --- PeftModel ------------------------------------------------------------------------------

namespace {

// What save_pretrained writes, with the model's own names (PEFT's rules: adapters; biases per
// `bias`, an adapted layer's as <path>.base_layer.bias; modules_to_save whole).
std::vector<Entry> saved_entries(const torch::nn::Module& model, const LoraConfig& c,
                                 const std::vector<std::string>& adapted, const std::vector<std::string>& saved) {
  const auto hf = hf_namer(model);
  const std::set<std::string> adapted_set(adapted.begin(), adapted.end());
  std::vector<Entry> out;
  std::unordered_set<const void*> seen;
  for (const auto& item : model.named_parameters(true)) {
    if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;
    const std::string path = hf(item.key());
    const auto dot = path.rfind('.');
    const std::string owner = dot == std::string::npos ? "" : path.substr(0, dot);
    const std::string leaf = dot == std::string::npos ? path : path.substr(dot + 1);
    const auto odot = owner.rfind('.');
    const std::string owner_leaf = odot == std::string::npos ? owner : owner.substr(odot + 1);
    const std::string layer = odot == std::string::npos ? "" : owner.substr(0, odot);
    if ((owner_leaf == "lora_A" || owner_leaf == "lora_B") && adapted_set.count(layer)) {
      out.push_back({item.key(), kPrefix + path, item.value()});
      continue;
    }
    bool in_saved = false;
    for (const auto& s : saved) in_saved = in_saved || path.rfind(s + ".", 0) == 0;
    if (in_saved) {
      out.push_back({item.key(), kPrefix + path, item.value()});
      continue;
    }
    if (leaf == "bias" && (c.bias == "all" || (c.bias == "lora_only" && adapted_set.count(owner)))) {
      out.push_back({item.key(), kPrefix + (adapted_set.count(owner) ? owner + ".base_layer.bias" : path), item.value()});
    }
  }
  return out;
}

}  // namespace

std::vector<at::Tensor> PeftModel::trainable_parameters() const {
  std::vector<at::Tensor> out;
  if (!model_) return out;
  std::unordered_set<const void*> seen;
  for (const auto& p : model_->parameters(true)) {
    if (p.requires_grad() && seen.insert(p.unsafeGetTensorImpl()).second) out.push_back(p);
  }
  return out;
}

int64_t PeftModel::num_trainable_parameters() const {
  int64_t n = 0;
  for (const auto& p : trainable_parameters()) n += p.numel();
  return n;
}

int64_t PeftModel::num_parameters() const {
  if (!model_) return 0;
  int64_t n = 0;
  std::unordered_set<const void*> seen;
  for (const auto& p : model_->parameters(true)) {
    if (seen.insert(p.unsafeGetTensorImpl()).second) n += p.numel();
  }
  return n;
}

std::string PeftModel::trainable_parameters_line() const {
  const int64_t trainable = num_trainable_parameters();
  // PEFT counts a module to save twice (its original and its trained copy): the line says the same.
  int64_t all = num_parameters();
  const auto hf = hf_namer(*model_);
  for (const auto& item : model_->named_parameters(true)) {
    const std::string path = hf(item.key());
    for (const auto& s : saved_modules_) {
      if (path.rfind(s + ".", 0) == 0) {
        all += item.value().numel();
        break;
      }
    }
  }
  return fmt::format("trainable params: {} || all params: {} || trainable%: {:.4f}", thousands(trainable), thousands(all),
                     all > 0 ? 100.0 * static_cast<double>(trainable) / static_cast<double>(all) : 0.0);
}

void PeftModel::print_trainable_parameters() const {
  if (main_process(nullptr)) std::cout << trainable_parameters_line() << std::endl;
}

std::map<std::string, at::Tensor> PeftModel::adapter_state_dict(Engine* engine) const {
  if (!model_) throw Error("adapter_state_dict: no model (get_peft_model makes a PeftModel)");
  const auto entries = saved_entries(*model_, config_, adapted_, saved_modules_);
  std::vector<at::Tensor> ts;
  for (const auto& e : entries) ts.push_back(e.t);
  std::map<std::string, at::Tensor> out;
  auto copy = [&] {
    c10::NoGradGuard no_grad;
    for (const auto& e : entries) out[e.key] = e.t.detach().to(at::kCPU, at::kFloat, false, /*copy=*/true).contiguous();
  };
  if (engine && engine->zero_stage() == 3) {
    auto g = engine->gathered(ts);
    copy();
  } else {
    copy();
  }
  return out;
}

void PeftModel::save_pretrained(const std::string& dir, Engine* engine) const {
  const auto state = adapter_state_dict(engine);  // collective under stage 3
  int64_t elements = 0;
  for (const auto& [k, t] : state) elements += t.numel();
  if (state.empty() || elements == 0) {
    throw Error(fmt::format("save_pretrained: {}: the adapter has no trainable element ({} tensors); nothing was written",
                            dir, state.size()));
  }
  std::string error;
  if (main_process(engine)) {
    try {
      fs::create_directories(dir);
      std::vector<ckpt::TensorEntry> entries;
      for (const auto& [k, t] : state) entries.push_back({k, "F32", t.sizes().vec(), static_cast<int64_t>(t.nbytes()), 0});
      const fs::path file = fs::path(dir) / "adapter_model.safetensors";
      const fs::path tmp = file.string() + ".partial";
      {
        ckpt::SafetensorsWriter w(tmp.string(), entries, {{"format", "pt"}});
        for (const auto& [k, t] : state) w.append(t.data_ptr(), t.nbytes());
        w.finish();
      }
      fs::rename(tmp, file);
      write_file_atomically(fs::path(dir) / "adapter_config.json", config_.to_json());
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  agree(engine, "save_pretrained: " + dir, error);
}

void PeftModel::load_adapter(const std::string& dir, Engine* engine) {
  (void)engine;  // the model's engine is found from the model itself (load_mapped)
  if (!model_) throw Error("load_adapter: no model (get_peft_model makes a PeftModel)");
  fs::path file = fs::path(dir);
  if (fs::is_directory(file)) file /= "adapter_model.safetensors";
  if (!fs::exists(file)) {
    throw Error(fmt::format("load_adapter: {} does not exist{}", file.string(),
                            fs::exists(fs::path(dir) / "adapter_model.bin") ? " (only adapter_model.bin, a pickle, which zeal does not read: save with safe_serialization)" : ""));
  }
  if (fs::exists(fs::path(dir) / "adapter_config.json")) {
    const LoraConfig saved = LoraConfig::from_pretrained(dir);
    if (saved.r != config_.r) {
      throw Error(fmt::format("load_adapter: {} has r = {} and this model's adapters r = {}", dir, saved.r, config_.r));
    }
  }
  const auto entries = saved_entries(*model_, config_, adapted_, saved_modules_);
  std::unordered_map<std::string, std::string> key_of;
  for (const auto& e : entries) key_of[e.model_name] = e.key;
  // A file's tensor this model would not read is a mismatch too (another target set, say).
  const auto names = zeal::detail::tensor_names(file.string());
  std::unordered_set<std::string> wanted;
  for (const auto& e : entries) wanted.insert(e.key);
  for (const auto& n : names) {
    if (!wanted.count(n)) {
      throw Error(fmt::format("load_adapter: {} has '{}', which this model's adapters do not have (adapted: {})",
                              file.string(), n, fmt::join(adapted_, ", ")));
    }
  }
  try {
    zeal::detail::load_mapped(*model_, file.string(), [&](const std::string& n) {
      auto it = key_of.find(n);
      return it == key_of.end() ? std::string() : it->second;
    });
  } catch (const Error& e) {
    throw Error(std::string("load_adapter: ") + e.what());
  }
}

PeftModel::DisabledAdapters::DisabledAdapters(const PeftModel* m) : m_(m) {
  for (const auto& l : m_->linears_)
    if (auto p = l.lock()) detail::set_active(p.get(), false);
  // The modules to save take their original values for the scope (the trained values stay where
  // they are: in the engine's shards, or as this parameter's data, put back at the end). Swapping a
  // parameter's data reads and writes no unit's values.
  zero::TouchPause pause;
  for (const auto& [p, original] : m_->originals_) {
    at::Tensor param = p;
    swapped_.push_back({param.variable_data(), param.requires_grad()});
    param.set_data(original.to(param.device(), param.scalar_type(), /*non_blocking=*/false, /*copy=*/true));
    param.requires_grad_(false);
  }
}

PeftModel::DisabledAdapters::~DisabledAdapters() {
  zero::TouchPause pause;
  for (size_t i = 0; i < swapped_.size(); ++i) {
    at::Tensor param = m_->originals_[i].first;
    param.set_data(swapped_[i].first);
    param.requires_grad_(swapped_[i].second);
  }
  if (m_->merged_) return;
  for (const auto& l : m_->linears_)
    if (auto p = l.lock()) detail::set_active(p.get(), true);
}

std::shared_ptr<torch::nn::Module> PeftModel::merge_and_unload(Engine* engine) {
  if (!model_) throw Error("merge_and_unload: no model");
  if (merged_) return model_;
  const bool stage3 = engine && engine->zero_stage() == 3;
  std::vector<std::shared_ptr<torch::nn::LinearImpl>> linears;
  for (const auto& l : linears_) {
    auto p = std::dynamic_pointer_cast<torch::nn::LinearImpl>(l.lock());
    if (!p) throw Error("merge_and_unload: an adapted Linear no longer exists");
    linears.push_back(p);
  }
  const double scaling = config_.scaling();
  for (auto& lin : linears) {
    auto A = std::dynamic_pointer_cast<torch::nn::LinearImpl>(lin->named_children()["lora_A"]);
    auto B = std::dynamic_pointer_cast<torch::nn::LinearImpl>(lin->named_children()["lora_B"]);
    auto merge = [&] {
      c10::NoGradGuard no_grad;
      // In fp32 at least: 16-bit weights are widened, float64 ones stay (as PEFT merges them).
      const auto t = at::promote_types(lin->weight.scalar_type(), at::kFloat);
      const at::Tensor delta = at::matmul(B->weight.to(t), A->weight.to(t)) * scaling;
      lin->weight.add_(delta.to(lin->weight.scalar_type()));
    };
    if (stage3) {
      // This Linear's unit gathered, the sum written back into every rank's shards, released.
      auto g = engine->gathered({lin->weight, A->weight, B->weight}, /*modifier_rank=*/0);
      merge();
    } else {
      merge();  // whole on every rank, the same values everywhere
    }
    detail::remove_slot(lin.get());
    if (!engine) {
      lin->unregister_module("lora_A");
      lin->unregister_module("lora_B");
      if (lin->named_children().contains("lora_dropout")) lin->unregister_module("lora_dropout");
    }
  }
  merged_ = true;
  originals_.clear();  // the merged model keeps the trained modules, as PEFT's merge_and_unload does
  return model_;
}

int64_t PeftModel::save_merged(const std::string& dir, Engine* engine) const {
  if (!model_) throw Error("save_merged: no model");
  const auto hf = hf_namer(*model_);
  const std::set<std::string> adapted_set(adapted_.begin(), adapted_.end());
  auto is_adapter = [&](const std::string& path) {
    for (const char* part : {".lora_A.", ".lora_B."}) {
      const auto at = path.find(part);
      if (at != std::string::npos && adapted_set.count(path.substr(0, at))) return true;
    }
    return false;
  };
  // Parameters in groups of one stage-3 unit each (consecutive names under one Sharded prefix, or
  // under a module the engine's unit_names makes a unit).
  std::vector<std::string> unit_prefixes;
  const std::vector<std::string> unit_names = engine ? engine->config().zero.unit_names : std::vector<std::string>{};
  for (const auto& item : model_->named_modules("", false)) {
    if (dynamic_cast<const ShardedBase*>(item.value().get()) || zero::unit_name_matches(item.value()->name(), unit_names))
      unit_prefixes.push_back(item.key() + ".");
  }
  auto unit_of = [&](const std::string& name) {
    std::string best;
    for (const auto& p : unit_prefixes)
      if (name.rfind(p, 0) == 0 && p.size() > best.size()) best = p;
    return best;
  };
  struct Item {
    std::string key;
    at::Tensor t;
    std::string unit;
    bool param = true;
  };
  std::vector<Item> items;
  std::unordered_set<const void*> seen;
  // The modules to save as they were (their originals), until merged.
  std::unordered_map<const void*, const at::Tensor*> original_of;
  for (const auto& [p, original] : originals_) original_of[p.unsafeGetTensorImpl()] = &original;
  for (const auto& item : model_->named_parameters(true)) {
    const std::string path = hf(item.key());
    if (is_adapter(path) || !seen.insert(item.value().unsafeGetTensorImpl()).second) continue;
    auto o = original_of.find(item.value().unsafeGetTensorImpl());
    if (o != original_of.end()) {
      items.push_back({path, o->second->to(item.value().scalar_type()), unit_of(item.key()), /*param=*/false});
      continue;
    }
    items.push_back({path, item.value(), unit_of(item.key())});
  }
  const auto transient = non_persistent_buffers(*model_);  // not the model's state (PyTorch's state_dict)
  for (const auto& item : model_->named_buffers(true)) {
    if (transient.count(item.key()) || !seen.insert(item.value().unsafeGetTensorImpl()).second) continue;
    items.push_back({hf(item.key()), item.value(), "~buffers", false});
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.unit < b.unit; });
  const bool main = main_process(engine);
  const bool stage3 = engine && engine->zero_stage() == 3;
  std::string error;
  std::unique_ptr<ckpt::SafetensorsWriter> w;
  const fs::path file = fs::path(dir) / "model.safetensors";
  // Written complete into a hidden folder, then moved in replacing any earlier export as a set.
  fs::path staging, tmp;
  int64_t bytes = 0;
  if (main) {
    try {
      fs::create_directories(dir);
      staging = ckpt::export_staging(dir);
      tmp = staging / "model.safetensors";
      fs::create_directories(staging);
      std::vector<ckpt::TensorEntry> entries;
      for (const auto& it : items) {
        entries.push_back({it.key, ckpt::safetensors_dtype(it.t.scalar_type()), it.t.sizes().vec(), it.t.numel() * static_cast<int64_t>(it.t.element_size()), 0});
      }
      w = std::make_unique<ckpt::SafetensorsWriter>(tmp.string(), entries, std::map<std::string, std::string>{{"format", "pt"}});
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  for (size_t i = 0; i < items.size();) {
    size_t j = i;
    while (j < items.size() && items[j].unit == items[i].unit) ++j;
    auto write = [&] {
      if (!w || !error.empty()) return;
      try {
        for (size_t k = i; k < j; ++k) {
          const at::Tensor c = items[k].t.detach().to(at::kCPU).contiguous();
          w->append(c.data_ptr(), c.nbytes());
        }
      } catch (const std::exception& e) {
        error = e.what();
      }
    };
    if (stage3) {
      std::vector<at::Tensor> params;
      for (size_t k = i; k < j; ++k)
        if (items[k].param) params.push_back(items[k].t);
      auto g = engine->gathered(params);
      write();
    } else {
      write();
    }
    i = j;
  }
  if (w && error.empty()) {
    try {
      bytes = w->finish().bytes;
      w.reset();
      ckpt::publish_export(dir, staging, {"model.safetensors"});
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  if (main && !staging.empty()) {
    w.reset();
    std::error_code ec;
    fs::remove_all(staging, ec);
  }
  agree(engine, "save_merged: " + dir, error);
  return main ? bytes : static_cast<int64_t>(fs::exists(file) ? fs::file_size(file) : 0);
}

PeftModel from_pretrained(std::shared_ptr<torch::nn::Module> model, const std::string& dir) {
  PeftModel pm = get_peft_model(std::move(model), LoraConfig::from_pretrained(dir));
  pm.load_adapter(dir);
  return pm;
}

}  // namespace peft

// --- load_pretrained ------------------------------------------------------------------------

PretrainedReport load_pretrained(torch::nn::Module& model, const std::string& path, const PretrainedOptions& options) {
  std::vector<std::string> file_names;
  try {
    file_names = detail::tensor_names(path);
  } catch (const Error& e) {
    throw Error(std::string("load_pretrained: ") + e.what());
  }
  const std::unordered_set<std::string> in_file(file_names.begin(), file_names.end());
  const auto hf = peft::hf_namer(model);
  struct Named {
    std::string model_name, hf_name;
    bool param;
  };
  std::vector<Named> names;
  std::unordered_set<const void*> seen;
  for (const auto& item : model.named_parameters(true))
    if (seen.insert(item.value().unsafeGetTensorImpl()).second) names.push_back({item.key(), hf(item.key()), true});
  for (const auto& item : model.named_buffers(true))
    if (seen.insert(item.value().unsafeGetTensorImpl()).second) names.push_back({item.key(), hf(item.key()), false});
  // The prefix pair (drop from the model's name, add for the file's) under which most names match.
  auto file_name = [&](const std::string& n, const std::string& pm, const std::string& pf) -> std::string {
    for (const auto& [from, to] : options.rename) {
      if (n.rfind(from, 0) == 0) return to + n.substr(from.size());
    }
    if (n.rfind(pm, 0) != 0) return "";
    return pf + n.substr(pm.size());
  };
  std::set<std::pair<std::string, std::string>> candidates{{"", ""}};
  int probes = 0;
  for (const auto& n : names) {
    if (!n.param || ++probes > 8) continue;
    for (const auto& f : file_names) {
      if (f.size() > n.hf_name.size() && peft::ends_with(f, n.hf_name) && f[f.size() - n.hf_name.size() - 1] == '.') {
        candidates.insert({"", f.substr(0, f.size() - n.hf_name.size())});
      } else if (n.hf_name.size() > f.size() && peft::ends_with(n.hf_name, f) && n.hf_name[n.hf_name.size() - f.size() - 1] == '.') {
        candidates.insert({n.hf_name.substr(0, n.hf_name.size() - f.size()), ""});
      }
    }
  }
  std::pair<std::string, std::string> best{"", ""};
  int best_count = -1;
  for (const auto& [pm, pf] : candidates) {
    int count = 0;
    for (const auto& n : names) count += n.param && in_file.count(file_name(n.hf_name, pm, pf)) ? 1 : 0;
    if (count > best_count || (count == best_count && pm.empty() && pf.empty())) {
      best_count = count;
      best = {pm, pf};
    }
  }
  PretrainedReport report;
  report.model_prefix = best.first;
  report.file_prefix = best.second;
  std::unordered_map<std::string, std::string> map;
  std::unordered_set<std::string> taken;
  const auto transient = non_persistent_buffers(model);
  // Tensors the file stores in another form (options.transforms, by the model's name).
  std::vector<ckpt::Transformed> transformed;
  std::unordered_set<std::string> model_names;
  for (const auto& n : names) model_names.insert(n.hf_name);
  for (const auto& [name, source] : options.transforms) {
    if (!model_names.count(name)) {
      throw Error(fmt::format("load_pretrained: transforms name '{}', which is not a parameter or buffer of the model "
                              "(its names are like {})",
                              name, names.empty() ? std::string("nothing") : names.front().hf_name));
    }
  }
  for (const auto& n : names) {
    if (auto t = options.transforms.find(n.hf_name); t != options.transforms.end()) {
      map[n.model_name] = "zeal.transformed." + n.hf_name;
      transformed.push_back({n.hf_name, map[n.model_name], t->second});
      continue;
    }
    const std::string f = file_name(n.hf_name, best.first, best.second);
    // GPT-2's Conv1D weights are stored [in, out]: loaded as they are into a square Linear they would
    // be transposed without an error.
    static const std::regex conv1d(R"((^|\.)(c_attn|c_proj|c_fc|q_attn)\.weight$)");
    if (!f.empty() && in_file.count(f) && std::regex_search(f, conv1d)) {
      throw Error(fmt::format("load_pretrained: '{}' in {} is a GPT-2 Conv1D weight, stored transposed ([in, out]); "
                              "give the model's '{}' a transform (options.transforms[\"{}\"] = zeal::transposed(\"{}\")) "
                              "instead of loading it as it is",
                              f, path, n.hf_name, n.hf_name, f));
    }
    if (!f.empty() && in_file.count(f)) {
      map[n.model_name] = f;
      taken.insert(f);
    } else if (n.param || !transient.count(n.model_name)) {  // a persistent buffer is the model's state too
      report.missing.push_back(n.hf_name);
    }
  }
  for (const auto& f : file_names)
    if (!taken.count(f)) report.unused.push_back(f);
  if (best_count <= 0 && options.transforms.empty()) {
    std::vector<std::string> some_model, some_file;
    for (size_t i = 0; i < names.size() && some_model.size() < 3; ++i) some_model.push_back(names[i].hf_name);
    for (size_t i = 0; i < file_names.size() && some_file.size() < 3; ++i) some_file.push_back(file_names[i]);
    throw Error(fmt::format("load_pretrained: no parameter of the model is in {} (the model has {}, ...; the file {}, ...)",
                            path, fmt::join(some_model, ", "), fmt::join(some_file, ", ")));
  }
  if (options.strict && !report.missing.empty()) {
    throw Error(fmt::format("load_pretrained: {} lacks {} of the model's parameters and persistent buffers: {}{}; nothing "
                            "was changed (zeal::register_buffer(..., false) marks a buffer the model computes itself)",
                            path,
                            report.missing.size(), fmt::join(report.missing.begin(), report.missing.begin() + std::min<size_t>(5, report.missing.size()), ", "),
                            report.missing.size() > 5 ? ", ..." : ""));
  }
  try {
    std::unique_ptr<ckpt::StagedWeights> staged;
    if (!transformed.empty()) {
      staged = std::make_unique<ckpt::StagedWeights>(path, transformed);
      std::vector<std::string> unused;
      for (const auto& f : report.unused)
        if (!staged->read().count(f)) unused.push_back(f);
      report.unused = std::move(unused);
    }
    report.loaded = detail::load_mapped(model, staged ? staged->dir() : path, [&](const std::string& n) {
      auto it = map.find(n);
      return it == map.end() ? std::string() : it->second;
    });
  } catch (const Error& e) {
    throw Error(std::string("load_pretrained: ") + e.what());
  }
  if (!options.quiet && peft::main_process(nullptr) && !report.missing.empty()) {
    log::warning("load_pretrained: {} parameters or buffers are not in {} and keep their initial values: {}{}",
                 report.missing.size(), path,
                 fmt::join(report.missing.begin(), report.missing.begin() + std::min<size_t>(8, report.missing.size()),
                           ", "),
                 report.missing.size() > 8 ? ", ..." : "");
  }
  return report;
}

}  // namespace zeal
