// GPT-2's Hugging Face files (transformers' GPT2LMHeadModel / GPT2Model save_pretrained) into the GPT
// example (examples/models/gpt.h): its config.json as a GptConfig, and the load_pretrained options that
// map GPT-2's names onto the example's and transpose its Conv1D weights ([in, out]) into Linear's.
//
//   auto cfg = zeal::models::gpt2_config(dir + "/config.json");
//   auto model = engine.init<zeal::models::Gpt>(cfg);
//   zeal::load_pretrained(model, dir, zeal::models::gpt2_pretrained_options(cfg, dir));
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "examples/models/gpt_config.h"
#include "examples/models/hf_config.h"

namespace zeal::models {

// std::runtime_error naming the file and key for what the example does not compute.
inline GptConfig gpt2_config(const std::string& path) {
  const nlohmann::json j = read_config_json(path);
  GptConfig c;
  c.name = "gpt2 (" + path + ")";
  read_config_key(j, path, "vocab_size", c.vocab);
  read_config_key(j, path, "n_positions", c.context);
  read_config_key(j, path, "n_layer", c.layers);
  read_config_key(j, path, "n_embd", c.dim);
  read_config_key(j, path, "n_head", c.heads);
  std::string type = "gpt2", act = "gelu_new";
  double eps = 1e-5;
  bool tied = true;
  int64_t inner = 0;
  read_config_key(j, path, "model_type", type);
  read_config_key(j, path, "activation_function", act);
  read_config_key(j, path, "layer_norm_epsilon", eps);
  read_config_key(j, path, "tie_word_embeddings", tied);
  read_config_key(j, path, "n_inner", inner);
  if (type != "gpt2") throw std::runtime_error(path + ": model_type '" + type + "' (GPT-2's is gpt2)");
  if (act != "gelu_new" && act != "gelu_pytorch_tanh") {
    throw std::runtime_error(path + ": activation_function '" + act + "' (the example computes GELU's tanh form, gelu_new)");
  }
  if (eps != 1e-5) throw std::runtime_error(path + ": layer_norm_epsilon " + std::to_string(eps) + " (the example's is 1e-5)");
  if (inner != 0 && inner != 4 * c.dim) throw std::runtime_error(path + ": n_inner " + std::to_string(inner) + " (the example's MLP is 4 x n_embd)");
  if (c.dim <= 0 || c.heads <= 0 || c.dim % c.heads != 0) throw std::runtime_error(path + ": n_embd must be a positive multiple of n_head");
  c.tie_head = tied;
  return c;
}

// The example's parameter names against GPT-2's: the file's name (under "transformer." unless
// `top`), and whether the file stores it transposed (Conv1D weights, [in, out]).
struct Gpt2Name {
  std::string model, file;
  bool transposed = false, top = false;
};
inline std::vector<Gpt2Name> gpt2_names(const GptConfig& c) {
  std::vector<Gpt2Name> out{{"wte.weight", "wte.weight"}, {"wpe.weight", "wpe.weight"},
                            {"ln_f.weight", "ln_f.weight"}, {"ln_f.bias", "ln_f.bias"}};
  for (int64_t i = 0; i < c.layers; ++i) {
    const std::string m = "h" + std::to_string(i) + ".", f = "h." + std::to_string(i) + ".";
    for (const char* x : {"weight", "bias"}) {
      out.push_back({m + "ln1." + x, f + "ln_1." + x});
      out.push_back({m + "ln2." + x, f + "ln_2." + x});
    }
    out.push_back({m + "attn.bias", f + "attn.c_attn.bias"});
    out.push_back({m + "attn_proj.bias", f + "attn.c_proj.bias"});
    out.push_back({m + "fc.bias", f + "mlp.c_fc.bias"});
    out.push_back({m + "fc_proj.bias", f + "mlp.c_proj.bias"});
    out.push_back({m + "attn.weight", f + "attn.c_attn.weight", true});
    out.push_back({m + "attn_proj.weight", f + "attn.c_proj.weight", true});
    out.push_back({m + "fc.weight", f + "mlp.c_fc.weight", true});
    out.push_back({m + "fc_proj.weight", f + "mlp.c_proj.weight", true});
  }
  if (!c.tie_head) out.push_back({"lm_head.weight", "lm_head.weight", false, true});
  return out;
}

// GPT-2's names (with "transformer." when the file has it) for the example's, Conv1D weights transposed.
inline PretrainedOptions gpt2_pretrained_options(const GptConfig& c, const std::string& dir) {
  std::string p;
  for (const auto& n : detail::tensor_names(dir)) {
    if (n.rfind("transformer.", 0) == 0) p = "transformer.";
  }
  PretrainedOptions o;
  for (const auto& n : gpt2_names(c)) {
    const std::string file = (n.top ? "" : p) + n.file;
    if (n.transposed) {
      o.transforms[n.model] = transposed(file);
    } else {
      o.rename.push_back({n.model, file});
    }
  }
  return o;
}

// The inverse, for engine.save_model: the example's names written as GPT2LMHeadModel's
// ("transformer.h.0.attn.c_attn.weight", …), its Linear weights written transposed as Conv1D's
// [in, out], so transformers' GPT2LMHeadModel.from_pretrained loads the export with GPT-2's
// config.json beside it. A tied head is written once, as wte (GPT-2 ties them too).
inline SaveModelOptions gpt2_export_options(const GptConfig& c) {
  SaveModelOptions o;
  for (const auto& n : gpt2_names(c)) o.names[n.model] = {(n.top ? "" : "transformer.") + n.file, n.transposed};
  return o;
}

}  // namespace zeal::models
