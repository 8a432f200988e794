// A LLaMA-family decoder with transformers' LlamaForCausalLM's math and parameter names: RMSNorm,
// rotary position embeddings (rope_theta; LLaMA's rotate-half convention), grouped-query attention
// through SDPA, a SwiGLU MLP, a tied or untied LM head, padding masks and a KV cache. Each decoder
// layer is a zeal::Sharded unit (stage 3); the embeddings, the final norm and the head form the root.
// Built from a Hugging Face config.json; zeal::load_pretrained reads a save_pretrained directory
// into it by name ("model.layers.0.self_attn.q_proj.weight", …).
//
//   auto cfg = zeal::models::LlamaConfig::from_file(dir + "/config.json");
//   auto model = engine.init<zeal::models::LlamaForCausalLM>(cfg);
//   zeal::load_pretrained(model, dir, {.strict = true});
//   at::Tensor logits = model->forward(ids);                       // [B, T, vocab]
//   at::Tensor loss = model->loss(ids, labels);                    // labels -100: not counted
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <cmath>
#include <fstream>
#include <initializer_list>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/chunked_loss.h"
#include "engine/linear.h"
#include "engine/zero/sharded.h"
#include "examples/models/hf_config.h"

namespace zeal::models {

struct LlamaConfig {
  int64_t vocab_size = 32000, hidden_size = 4096, intermediate_size = 11008, num_hidden_layers = 32;
  int64_t num_attention_heads = 32, num_key_value_heads = 32, head_dim = 0;  // 0: hidden_size / heads
  int64_t max_position_embeddings = 2048;
  double rms_norm_eps = 1e-6, rope_theta = 10000.0, initializer_range = 0.02;
  bool tie_word_embeddings = false, attention_bias = false, mlp_bias = false;
  bool chunked_loss = true;  // loss() through zeal::chunked_cross_entropy
  int64_t loss_chunk = 0;

  int64_t dim_per_head() const { return head_dim > 0 ? head_dim : hidden_size / num_attention_heads; }
  int64_t num_parameters() const {
    const int64_t hd = dim_per_head(), q = num_attention_heads * hd, kv = num_key_value_heads * hd;
    const int64_t attn = hidden_size * (q + 2 * kv) + q * hidden_size + (attention_bias ? q + 2 * kv : 0);
    const int64_t mlp = 3 * hidden_size * intermediate_size + (mlp_bias ? 2 * intermediate_size + hidden_size : 0);
    const int64_t layer = attn + mlp + 2 * hidden_size;
    return vocab_size * hidden_size * (tie_word_embeddings ? 1 : 2) + num_hidden_layers * layer + hidden_size;
  }

  // transformers' config.json of a LlamaForCausalLM; std::runtime_error naming the file and key for
  // what this model does not compute (another activation, rope scaling).
  static LlamaConfig from_file(const std::string& path) {
    const nlohmann::json j = read_config_json(path);
    LlamaConfig c;
    auto get = [&](const char* k, auto& v) { read_config_key(j, path, k, v); };
    get("vocab_size", c.vocab_size);
    get("hidden_size", c.hidden_size);
    get("intermediate_size", c.intermediate_size);
    get("num_hidden_layers", c.num_hidden_layers);
    get("num_attention_heads", c.num_attention_heads);
    c.num_key_value_heads = c.num_attention_heads;
    get("num_key_value_heads", c.num_key_value_heads);
    get("head_dim", c.head_dim);
    get("max_position_embeddings", c.max_position_embeddings);
    get("rms_norm_eps", c.rms_norm_eps);
    get("rope_theta", c.rope_theta);
    get("initializer_range", c.initializer_range);
    get("tie_word_embeddings", c.tie_word_embeddings);
    get("attention_bias", c.attention_bias);
    get("mlp_bias", c.mlp_bias);
    std::string act = "silu", type = "llama";
    get("hidden_act", act);
    get("model_type", type);
    if (type != "llama") throw std::runtime_error(path + ": model_type '" + type + "' (this model is LLaMA's: llama)");
    if (act != "silu") throw std::runtime_error(path + ": hidden_act '" + act + "' (LLaMA's MLP is silu)");
    // Rotary settings: rope_theta and rope_scaling (transformers 4), or rope_parameters (5).
    for (const char* key : {"rope_scaling", "rope_parameters"}) {
      if (!j.contains(key) || j[key].is_null()) continue;
      const auto& r = j[key];
      if (!r.is_object()) throw std::runtime_error(path + ": " + key + " must be an object");
      const std::string kind = r.value("rope_type", r.value("type", std::string("default")));
      if (kind != "default") {
        throw std::runtime_error(path + ": " + key + " of type '" + kind +
                                 "' is not computed by this model (only unscaled rotary embeddings)");
      }
      if (r.contains("rope_theta") && r["rope_theta"].is_number()) c.rope_theta = r["rope_theta"].get<double>();
    }
    auto positive = [&](const char* k, int64_t v) {
      if (v <= 0) throw std::runtime_error(path + ": " + k + " must be positive, got " + std::to_string(v));
    };
    positive("vocab_size", c.vocab_size);
    positive("hidden_size", c.hidden_size);
    positive("intermediate_size", c.intermediate_size);
    positive("num_hidden_layers", c.num_hidden_layers);
    positive("num_attention_heads", c.num_attention_heads);
    positive("num_key_value_heads", c.num_key_value_heads);
    if (c.num_attention_heads % c.num_key_value_heads != 0) {
      throw std::runtime_error(path + ": num_attention_heads (" + std::to_string(c.num_attention_heads) +
                               ") must be a multiple of num_key_value_heads (" + std::to_string(c.num_key_value_heads) + ")");
    }
    if (c.head_dim == 0 && c.hidden_size % c.num_attention_heads != 0) {
      throw std::runtime_error(path + ": hidden_size must be a multiple of num_attention_heads when head_dim is not given");
    }
    if (c.dim_per_head() % 2 != 0) throw std::runtime_error(path + ": the head dimension must be even (rotary embeddings)");
    return c;
  }
};

// transformers' initialisation of a LLaMA's linear layers: N(0, initializer_range), biases 0.
inline void init_linears(std::initializer_list<torch::nn::Linear> layers, double range) {
  c10::NoGradGuard no_grad;
  for (const auto& l : layers) {
    l->weight.normal_(0, range);
    if (l->bias.defined()) l->bias.zero_();
  }
}

// LLaMA's RMSNorm: x / sqrt(mean(x²) + eps) in fp32, back to x's dtype, times the weight.
struct LlamaRMSNormImpl : torch::nn::Module {
  LlamaRMSNormImpl(int64_t dim, double eps) : eps(eps), weight(register_parameter("weight", at::ones({dim}))) {}
  at::Tensor forward(const at::Tensor& x) {
    const at::Tensor h = x.to(at::kFloat);
    const at::Tensor normed = h * at::rsqrt(h.pow(2).mean(-1, true) + eps);
    return weight * normed.to(x.scalar_type());
  }
  double eps;
  at::Tensor weight;
};
TORCH_MODULE(LlamaRMSNorm);

// cos and sin of the rotary embedding for these positions ([B, T] → [B, T, head_dim] each), in
// fp32 as transformers computes them, then in `dtype`.
inline std::pair<at::Tensor, at::Tensor> llama_rotary(const LlamaConfig& c, const at::Tensor& positions, at::ScalarType dtype) {
  const int64_t dim = c.dim_per_head();
  const auto opts = at::TensorOptions(at::kFloat).device(positions.device());
  const at::Tensor exponent = at::arange(0, dim, 2, opts.dtype(at::kLong)).to(at::kFloat) / static_cast<double>(dim);
  const at::Tensor inv_freq = 1.0 / at::pow(c.rope_theta, exponent);
  const at::Tensor freqs =
      at::matmul(inv_freq.unsqueeze(0).unsqueeze(2).expand({positions.size(0), -1, 1}), positions.unsqueeze(1).to(at::kFloat))
          .transpose(1, 2);
  const at::Tensor emb = at::cat({freqs, freqs}, -1);
  return {emb.cos().to(dtype), emb.sin().to(dtype)};
}

inline at::Tensor llama_rotate_half(const at::Tensor& x) {
  const int64_t h = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, h, h), x.narrow(-1, 0, h)}, -1);
}

struct LlamaAttentionImpl : torch::nn::Module {
  explicit LlamaAttentionImpl(const LlamaConfig& c)
      : heads(c.num_attention_heads), kv_heads(c.num_key_value_heads), head_dim(c.dim_per_head()),
        q_proj(register_module("q_proj", torch::nn::Linear(torch::nn::LinearOptions(c.hidden_size, heads * head_dim).bias(c.attention_bias)))),
        k_proj(register_module("k_proj", torch::nn::Linear(torch::nn::LinearOptions(c.hidden_size, kv_heads * head_dim).bias(c.attention_bias)))),
        v_proj(register_module("v_proj", torch::nn::Linear(torch::nn::LinearOptions(c.hidden_size, kv_heads * head_dim).bias(c.attention_bias)))),
        o_proj(register_module("o_proj", torch::nn::Linear(torch::nn::LinearOptions(heads * head_dim, c.hidden_size).bias(c.attention_bias)))) {
    init_linears({q_proj, k_proj, v_proj, o_proj}, c.initializer_range);
  }

  // x [B, T, C]; cos, sin [B, T, head_dim]; mask [B, 1, T, S] (true: attend) or undefined (causal);
  // past_k, past_v [B, kv_heads, P, head_dim] or undefined. Returns the output and the keys and
  // values of all S = P + T positions.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                                        const at::Tensor& mask, const at::Tensor& past_k,
                                                        const at::Tensor& past_v) {
    const int64_t B = x.size(0), T = x.size(1);
    auto heads_of = [&](const at::Tensor& t, int64_t n) { return t.view({B, T, n, head_dim}).transpose(1, 2); };
    at::Tensor q = heads_of(q_proj(x), heads), k = heads_of(k_proj(x), kv_heads), v = heads_of(v_proj(x), kv_heads);
    const at::Tensor c = cos.unsqueeze(1), s = sin.unsqueeze(1);
    q = q * c + llama_rotate_half(q) * s;
    k = k * c + llama_rotate_half(k) * s;
    if (past_k.defined()) {
      k = at::cat({past_k, k}, 2);
      v = at::cat({past_v, v}, 2);
    }
    const int64_t rep = heads / kv_heads;
    const at::Tensor kr = rep == 1 ? k : k.repeat_interleave(rep, 1), vr = rep == 1 ? v : v.repeat_interleave(rep, 1);
    const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
    at::Tensor y = mask.defined() ? at::scaled_dot_product_attention(q, kr, vr, mask, 0.0, false, scale)
                                  : at::scaled_dot_product_attention(q, kr, vr, {}, 0.0, T > 1, scale);
    return {o_proj(y.transpose(1, 2).reshape({B, T, heads * head_dim})), k, v};
  }

  int64_t heads, kv_heads, head_dim;
  torch::nn::Linear q_proj, k_proj, v_proj, o_proj;
};
TORCH_MODULE(LlamaAttention);

struct LlamaMLPImpl : torch::nn::Module {
  explicit LlamaMLPImpl(const LlamaConfig& c)
      : gate_proj(register_module("gate_proj", torch::nn::Linear(torch::nn::LinearOptions(c.hidden_size, c.intermediate_size).bias(c.mlp_bias)))),
        up_proj(register_module("up_proj", torch::nn::Linear(torch::nn::LinearOptions(c.hidden_size, c.intermediate_size).bias(c.mlp_bias)))),
        down_proj(register_module("down_proj", torch::nn::Linear(torch::nn::LinearOptions(c.intermediate_size, c.hidden_size).bias(c.mlp_bias)))) {
    init_linears({gate_proj, up_proj, down_proj}, c.initializer_range);
  }
  at::Tensor forward(const at::Tensor& x) { return down_proj(at::silu(gate_proj(x)) * up_proj(x)); }
  torch::nn::Linear gate_proj, up_proj, down_proj;
};
TORCH_MODULE(LlamaMLP);

// One decoder layer: the stage-3 unit.
struct LlamaDecoderLayerImpl : torch::nn::Module {
  explicit LlamaDecoderLayerImpl(const LlamaConfig& c)
      : self_attn(register_module("self_attn", LlamaAttention(c))),
        mlp(register_module("mlp", LlamaMLP(c))),
        input_layernorm(register_module("input_layernorm", LlamaRMSNorm(c.hidden_size, c.rms_norm_eps))),
        post_attention_layernorm(register_module("post_attention_layernorm", LlamaRMSNorm(c.hidden_size, c.rms_norm_eps))) {}

  std::tuple<at::Tensor, at::Tensor, at::Tensor> forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                                        const at::Tensor& mask, const at::Tensor& past_k,
                                                        const at::Tensor& past_v) {
    auto [a, k, v] = self_attn->forward(input_layernorm(x), cos, sin, mask, past_k, past_v);
    const at::Tensor h = x + a;
    return {h + mlp(post_attention_layernorm(h)), k, v};
  }

  LlamaAttention self_attn;
  LlamaMLP mlp;
  LlamaRMSNorm input_layernorm, post_attention_layernorm;
};
TORCH_MODULE(LlamaDecoderLayer);

// The keys and values of the positions seen so far, per layer ([B, kv_heads, S, head_dim]).
struct LlamaCache {
  std::vector<at::Tensor> keys, values;
  int64_t length() const { return keys.empty() || !keys[0].defined() ? 0 : keys[0].size(2); }
};

struct LlamaModelImpl : torch::nn::Module {
  explicit LlamaModelImpl(const LlamaConfig& c)
      : config(c),
        embed_tokens(register_module("embed_tokens", torch::nn::Embedding(c.vocab_size, c.hidden_size))),
        layers_module(register_module("layers", std::make_shared<torch::nn::Module>("LlamaLayers"))),
        norm(register_module("norm", LlamaRMSNorm(c.hidden_size, c.rms_norm_eps))) {
    c10::NoGradGuard no_grad;
    embed_tokens->weight.normal_(0, c.initializer_range);
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      layers.push_back(layers_module->register_module(std::to_string(i), Sharded<LlamaDecoderLayer>(c)));
    }
  }

  // ids [B, T]; attention_mask [B, P + T] (1: a token, 0: padding) or undefined; positions [B, T]
  // or undefined (P, P+1, …); cache: read and extended when given. Returns the final hidden states.
  at::Tensor forward(const at::Tensor& ids, const at::Tensor& attention_mask = {}, at::Tensor positions = {},
                     LlamaCache* cache = nullptr) {
    const int64_t B = ids.size(0), T = ids.size(1), P = cache ? cache->length() : 0;
    if (!positions.defined()) positions = at::arange(P, P + T, ids.options().dtype(at::kLong)).unsqueeze(0).expand({B, T});
    at::Tensor h = embed_tokens(ids);
    auto [cos, sin] = llama_rotary(config, positions, h.scalar_type());
    at::Tensor mask;
    if (attention_mask.defined() || (P > 0 && T > 1)) {
      // Causal over all P + T positions, padding keys masked; a query with no key left (a padding
      // position) may see every key, as transformers does, so that its row is not NaN.
      const auto opts = ids.options().dtype(at::kLong);
      at::Tensor allowed = at::arange(P + T, opts).unsqueeze(0) <= (at::arange(T, opts) + P).unsqueeze(1);  // [T, S]
      allowed = allowed.unsqueeze(0).unsqueeze(0).expand({B, 1, T, P + T});
      if (attention_mask.defined()) allowed = allowed & attention_mask.to(at::kBool).view({B, 1, 1, P + T});
      mask = allowed | allowed.logical_not().all(-1, true);
    }
    if (cache && cache->keys.empty()) cache->keys.resize(layers.size()), cache->values.resize(layers.size());
    for (size_t i = 0; i < layers.size(); ++i) {
      const at::Tensor pk = cache ? cache->keys[i] : at::Tensor(), pv = cache ? cache->values[i] : at::Tensor();
      auto [out, k, v] = layers[i]->forward(h, cos, sin, mask, pk, pv);
      h = out;
      if (cache) cache->keys[i] = k.detach(), cache->values[i] = v.detach();
    }
    return norm(h);
  }

  LlamaConfig config;
  torch::nn::Embedding embed_tokens;
  std::shared_ptr<torch::nn::Module> layers_module;
  std::vector<Sharded<LlamaDecoderLayer>> layers;
  LlamaRMSNorm norm;
};
TORCH_MODULE(LlamaModel);

struct LlamaForCausalLMImpl : torch::nn::Module {
  explicit LlamaForCausalLMImpl(const LlamaConfig& c) : config(c), model(register_module("model", LlamaModel(c))) {
    c10::NoGradGuard no_grad;
    if (!c.tie_word_embeddings) {
      lm_head = register_module("lm_head", torch::nn::Linear(torch::nn::LinearOptions(c.hidden_size, c.vocab_size).bias(false)));
      lm_head->weight.normal_(0, c.initializer_range);
    }
  }

  const at::Tensor& head_weight() const { return config.tie_word_embeddings ? model->embed_tokens->weight : lm_head->weight; }

  // Logits [B, T, vocab]; see LlamaModel::forward for the arguments.
  at::Tensor forward(const at::Tensor& ids, const at::Tensor& attention_mask = {}, const at::Tensor& positions = {},
                     LlamaCache* cache = nullptr) {
    return zeal::linear(model->forward(ids, attention_mask, positions, cache), head_weight());
  }

  // transformers' causal-LM loss: position t predicts labels[t + 1]; labels -100 count for nothing;
  // the mean over the rest. Through the chunked head (config.chunked_loss) or the whole logits.
  at::Tensor loss(const at::Tensor& ids, const at::Tensor& labels, const at::Tensor& attention_mask = {}) {
    const int64_t T = ids.size(1) - 1;
    const at::Tensor targets = labels.narrow(1, 1, T);
    const at::Tensor h = model->forward(ids, attention_mask).narrow(1, 0, T);
    if (config.chunked_loss) return zeal::chunked_cross_entropy(h, head_weight(), targets, {.chunk = config.loss_chunk});
    const at::Tensor logits = zeal::linear(h, head_weight());
    // In fp32 at least (16-bit logits are widened; float64 stays).
    const at::ScalarType t = at::promote_types(logits.scalar_type(), at::kFloat);
    return at::cross_entropy_loss(logits.reshape({-1, config.vocab_size}).to(t), targets.reshape({-1}), {},
                                  at::Reduction::Mean, -100);
  }

  LlamaConfig config;
  LlamaModel model;
  torch::nn::Linear lm_head{nullptr};  // untied heads only
};
TORCH_MODULE(LlamaForCausalLM);

}  // namespace zeal::models
