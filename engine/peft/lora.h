// zeal::peft — LoRA adapters for any LibTorch module tree, with Hugging Face PEFT's API and file
// format (adapter_model.safetensors + adapter_config.json, keys
// `base_model.model.<module path>.lora_A.weight`), under every ZeRO stage.
//
//   auto model = engine.init<Bert>(cfg);                  // or any model built of torch::nn::Linear
//   zeal::load_pretrained(*model, "all-MiniLM-L6-v2");
//   zeal::peft::LoraConfig lc;  lc.r = 8;  lc.lora_alpha = 16;  lc.target_modules = {"query", "value"};
//   auto peft = zeal::peft::get_peft_model(model.ptr(), lc);   // adapters in, everything else frozen
//   peft.print_trainable_parameters();
//   auto [m, opt] = engine.prepare(model, torch::optim::AdamW(peft.trainable_parameters(), ...));
//   ... train as usual: the model is called exactly as before ...
//   peft.save_pretrained("out/adapter", &engine);        // Python peft loads it
//   peft.merge_and_unload(&engine);  peft.save_merged("out/merged", &engine);
//
// How the adapters enter the forward without changing the model's code: every torch::nn::Linear
// that get_peft_model adapts gets children `lora_A`, `lora_B` (and `lora_dropout` when p > 0), so they
// are ordinary parameters of the Linear's module (the same stage-3 unit as its weight), and zeal's
// libzeal.so provides LibTorch's `torch::nn::LinearImpl::forward` itself (an ELF interposition:
// libzeal comes before libtorch in the program's libraries, as linking the `zeal` CMake target
// arranges). For a Linear without adapters it computes exactly LibTorch's own body; for an adapted
// one PEFT's `base(x) + lora_B(lora_A(dropout(x))) · scaling`. get_peft_model checks that the
// interposition is in effect and throws zeal::Error otherwise (a program that links libtorch
// before libzeal, or a static libtorch).
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <type_traits>
#include <vector>

namespace torch::nn {
class Module;
}

namespace zeal {
class Engine;

namespace peft {

// PEFT's LoraConfig (the fields its adapter_config.json holds).
struct LoraConfig {
  int64_t r = 8;
  double lora_alpha = 8;
  double lora_dropout = 0.0;
  // Which Linear modules get adapters, as PEFT matches them: a module path equal to a name or
  // ending in "." + name ({"query", "value"}) — or, when target_modules_regex is set, a path the
  // pattern matches whole (PEFT's string form: R"(.*\.(query|value))"). "all-linear" alone: every
  // Linear except an output layer named lm_head / classifier / score.
  std::vector<std::string> target_modules;
  std::string target_modules_regex;
  std::vector<std::string> exclude_modules;  // same matching rules, never adapted
  // none: only adapters train; all: every bias trains too; lora_only: the biases of adapted layers.
  std::string bias = "none";
  // Modules trained whole and saved with the adapter (a classification head): a path or its suffix.
  std::vector<std::string> modules_to_save;
  bool use_rslora = false;  // scaling lora_alpha / sqrt(r) instead of lora_alpha / r
  // "default" (PEFT's True: A Kaiming-uniform with a = sqrt(5), B zeros), "gaussian" (A normal with
  // std 1/r, B zeros) or "none" (PEFT's False: B random too, so the adapter is not a no-op).
  std::string init_lora_weights = "default";
  std::string base_model_name_or_path;
  std::string task_type;  // as PEFT writes it (SEQ_CLS, CAUSAL_LM, FEATURE_EXTRACTION ...), may be empty

  double scaling() const;
  // adapter_config.json's text / its parsing (zeal::Error naming the file or field on a bad one).
  std::string to_json() const;
  static LoraConfig from_json(const std::string& text, const std::string& where = "adapter_config.json");
  static LoraConfig from_pretrained(const std::string& dir);
};

// A model with adapters: a handle on the model (which is still called as before), not a wrapper.
class PeftModel {
 public:
  PeftModel() = default;
  std::shared_ptr<torch::nn::Module> model() const { return model_; }
  const LoraConfig& config() const { return config_; }
  // The adapted modules' paths (Hugging Face style: zeal::Sharded's "block" level left out).
  const std::vector<std::string>& adapted_modules() const { return adapted_; }
  // The parameters that train (adapters, modules_to_save, biases per `bias`), for the optimizer.
  std::vector<at::Tensor> trainable_parameters() const;
  int64_t num_trainable_parameters() const;
  int64_t num_parameters() const;
  // PEFT's line: "trainable params: 73,728 || all params: 22,786,560 || trainable%: 0.3236".
  std::string trainable_parameters_line() const;
  void print_trainable_parameters() const;  // on the main process only when an engine runs

  // The adapter's tensors under PEFT's saved names, whole (under stage 3 gathered through
  // `engine`, which every rank must then call with). fp32 copies on the CPU.
  std::map<std::string, at::Tensor> adapter_state_dict(Engine* engine = nullptr) const;
  // adapter_model.safetensors + adapter_config.json in `dir` (written by the main process, through
  // a temporary name, fsynced). Collective with an engine. An adapter without a trainable element
  // is an error, never an empty file.
  void save_pretrained(const std::string& dir, Engine* engine = nullptr) const;
  // Reads an adapter saved by save_pretrained or by Python peft into this model's adapters (names,
  // shapes and r checked; nothing changes on a mismatch). Collective with an engine.
  void load_adapter(const std::string& dir, Engine* engine = nullptr);

  // Turns the adapters off (the base model's output) while the guard lives, as PEFT's
  // disable_adapter() context: the adapted layers run without their adapters, and the modules to
  // save run with their original values (kept beside the trained ones since get_peft_model, as
  // PEFT's ModulesToSaveWrapper keeps original_module), frozen for the scope.
  class DisabledAdapters {
   public:
    explicit DisabledAdapters(const PeftModel* m);
    ~DisabledAdapters();
    DisabledAdapters(const DisabledAdapters&) = delete;
    DisabledAdapters& operator=(const DisabledAdapters&) = delete;

   private:
    const PeftModel* m_;
    std::vector<std::pair<at::Tensor, bool>> swapped_;  // each saved parameter's own data, requires_grad
  };
  [[nodiscard]] DisabledAdapters disable_adapter() const { return DisabledAdapters(this); }

  // Adds scaling·B·A into every adapted weight, one Linear at a time (under stage 3: that weight
  // and its adapters gathered, written back into the shards, released again — the model is never
  // whole on a rank), and turns the adapters off. Without an engine (or before it prepared the
  // model) the adapter modules are removed too and the model is the plain base model again; a
  // prepared model keeps them registered (its engine owns their shards) but unused. Collective with
  // an engine. Returns the model.
  std::shared_ptr<torch::nn::Module> merge_and_unload(Engine* engine = nullptr);
  // The model's weights without the adapters, as model.safetensors (Hugging Face names), streamed
  // one stage-3 unit at a time (each gathered, written by the main process, released): the base
  // model, the modules to save with their original values. Call after merge_and_unload for the
  // merged model (then the modules to save are the trained ones, as PEFT's merge_and_unload keeps
  // its trained copies). Collective with an engine. Returns the file's bytes.
  int64_t save_merged(const std::string& dir, Engine* engine = nullptr) const;

 private:
  friend PeftModel get_peft_model(std::shared_ptr<torch::nn::Module>, const LoraConfig&);
  std::shared_ptr<torch::nn::Module> model_;
  LoraConfig config_;
  std::vector<std::string> adapted_;
  std::vector<std::string> saved_modules_;  // modules_to_save's matched paths
  // modules_to_save: each parameter and its original values (host memory, whole), until merged.
  std::vector<std::pair<at::Tensor, at::Tensor>> originals_;
  std::vector<std::weak_ptr<torch::nn::Module>> linears_;  // the adapted Linear modules
  bool merged_ = false;
};

// Injects LoRA adapters into `model`'s matching Linear layers (before engine.prepare; after
// engine.init is fine) and freezes every other parameter except modules_to_save and the biases the
// `bias` mode trains. zeal::Error when nothing matches (naming the patterns and a few Linear paths
// the model has), on a bad field, or when the forward interposition is not in effect.
PeftModel get_peft_model(std::shared_ptr<torch::nn::Module> model, const LoraConfig& config);
template <class Holder>
  requires requires(const Holder& h) { h.ptr(); }
PeftModel get_peft_model(const Holder& holder, const LoraConfig& config) {
  return get_peft_model(std::static_pointer_cast<torch::nn::Module>(holder.ptr()), config);
}
// PEFT's PeftModel.from_pretrained: the config from dir/adapter_config.json, adapters injected, the
// saved values loaded. Collective with an engine (then the model must not be prepared yet: load
// after prepare with load_adapter).
PeftModel from_pretrained(std::shared_ptr<torch::nn::Module> model, const std::string& dir);
template <class M>
  requires std::is_base_of_v<torch::nn::Module, M>
PeftModel get_peft_model(const std::shared_ptr<M>& model, const LoraConfig& config) {
  return get_peft_model(std::static_pointer_cast<torch::nn::Module>(model), config);
}

// True when zeal's torch::nn::LinearImpl::forward is the one programs call (see above).
bool forward_interposed();

// Hugging Face names for `model`'s parameters and modules: zeal::Sharded's "block" level left out
// ("encoder.layer.0.block.attention.self.query" → "encoder.layer.0.attention.self.query").
std::function<std::string(const std::string&)> hf_namer(const torch::nn::Module& model);



}  // namespace peft
}  // namespace zeal
