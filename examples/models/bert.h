// A BERT encoder with Hugging Face's module names, so zeal::load_pretrained reads a transformers
// checkpoint (all-MiniLM-L6-v2, bert-base-uncased ...) as it is: BertModel (embeddings, encoder
// layers, pooler) and BertForSequenceClassification (bert + classifier). Each encoder layer is a
// zeal::Sharded<BertLayer>, the stage-3 unit; zeal's names leave out Sharded's "block" level, so
// "encoder.layer.3.attention.self.query.weight" is the same name here as in the file.
//
//   auto cfg = zeal::models::BertConfig::from_file(dir + "/config.json");
//   auto model = engine.init<zeal::models::BertForSequenceClassification>(cfg, /*labels=*/8);
//   zeal::load_pretrained(model, dir);  // "bert." is found and added; the classifier stays new
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/zero/sharded.h"
#include "examples/models/hf_config.h"

namespace zeal::models {

struct BertConfig {
  int64_t vocab_size = 30522, hidden_size = 384, num_hidden_layers = 6, num_attention_heads = 12;
  int64_t intermediate_size = 1536, max_position_embeddings = 512, type_vocab_size = 2;
  double layer_norm_eps = 1e-12, hidden_dropout_prob = 0.1, attention_probs_dropout_prob = 0.1;
  double initializer_range = 0.02;
  std::string hidden_act = "gelu";

  // transformers' config.json (a BertModel's); std::runtime_error naming the file otherwise.
  static BertConfig from_file(const std::string& path) {
    const nlohmann::json j = read_config_json(path);
    BertConfig c;
    auto get = [&](const char* k, auto& v) { read_config_key(j, path, k, v); };
    get("vocab_size", c.vocab_size);
    get("hidden_size", c.hidden_size);
    get("num_hidden_layers", c.num_hidden_layers);
    get("num_attention_heads", c.num_attention_heads);
    get("intermediate_size", c.intermediate_size);
    get("max_position_embeddings", c.max_position_embeddings);
    get("type_vocab_size", c.type_vocab_size);
    get("layer_norm_eps", c.layer_norm_eps);
    get("hidden_dropout_prob", c.hidden_dropout_prob);
    get("attention_probs_dropout_prob", c.attention_probs_dropout_prob);
    get("initializer_range", c.initializer_range);
    get("hidden_act", c.hidden_act);
    if (c.hidden_act != "gelu") throw std::runtime_error(path + ": hidden_act '" + c.hidden_act + "' (only gelu is built)");
    if (c.hidden_size % c.num_attention_heads != 0) {
      throw std::runtime_error(path + ": hidden_size is not a multiple of num_attention_heads");
    }
    return c;
  }
  int64_t num_parameters() const {
    const int64_t H = hidden_size, I = intermediate_size;
    const int64_t layer = 4 * (H * H + H) + 2 * 2 * H + (H * I + I) + (I * H + H);
    return (vocab_size + max_position_embeddings + type_vocab_size) * H + 2 * H + num_hidden_layers * layer + H * H + H;
  }
};

namespace bert_detail {
inline torch::nn::LayerNorm layer_norm(const BertConfig& c) {
  return torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.hidden_size}).eps(c.layer_norm_eps));
}
// transformers' _init_weights: Linear and Embedding N(0, initializer_range), biases 0, LayerNorm 1/0.
inline void init_linear(torch::nn::Linear& l, const BertConfig& c) {
  c10::NoGradGuard no_grad;
  l->weight.normal_(0, c.initializer_range);
  if (l->bias.defined()) l->bias.zero_();
}
}  // namespace bert_detail

struct BertEmbeddingsImpl : torch::nn::Module {
  explicit BertEmbeddingsImpl(const BertConfig& c)
      : word_embeddings(register_module("word_embeddings", torch::nn::Embedding(c.vocab_size, c.hidden_size))),
        position_embeddings(register_module("position_embeddings", torch::nn::Embedding(c.max_position_embeddings, c.hidden_size))),
        token_type_embeddings(register_module("token_type_embeddings", torch::nn::Embedding(c.type_vocab_size, c.hidden_size))),
        LayerNorm(register_module("LayerNorm", bert_detail::layer_norm(c))),
        dropout(register_module("dropout", torch::nn::Dropout(c.hidden_dropout_prob))) {
    c10::NoGradGuard no_grad;
    for (auto* e : {&word_embeddings, &position_embeddings, &token_type_embeddings}) (*e)->weight.normal_(0, c.initializer_range);
  }
  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& token_type_ids) {
    const at::Tensor positions = at::arange(input_ids.size(1), input_ids.options()).unsqueeze(0);
    at::Tensor x = word_embeddings(input_ids) + token_type_embeddings(token_type_ids);
    x = x + position_embeddings(positions);
    return dropout(LayerNorm(x));
  }
  torch::nn::Embedding word_embeddings, position_embeddings, token_type_embeddings;
  torch::nn::LayerNorm LayerNorm;
  torch::nn::Dropout dropout;
};
TORCH_MODULE(BertEmbeddings);

struct BertSelfAttentionImpl : torch::nn::Module {
  explicit BertSelfAttentionImpl(const BertConfig& c)
      : heads(c.num_attention_heads),
        query(register_module("query", torch::nn::Linear(c.hidden_size, c.hidden_size))),
        key(register_module("key", torch::nn::Linear(c.hidden_size, c.hidden_size))),
        value(register_module("value", torch::nn::Linear(c.hidden_size, c.hidden_size))),
        dropout_p(c.attention_probs_dropout_prob) {
    for (auto* l : {&query, &key, &value}) bert_detail::init_linear(*l, c);
  }
  // x [B, T, H], additive mask [B, 1, 1, T] (0 or the dtype's lowest) → [B, T, H]
  at::Tensor forward(const at::Tensor& x, const at::Tensor& mask) {
    const int64_t B = x.size(0), T = x.size(1), H = x.size(2);
    auto split = [&](const at::Tensor& t) { return t.view({B, T, heads, H / heads}).transpose(1, 2); };
    at::Tensor ctx = at::scaled_dot_product_attention(split(query(x)), split(key(x)), split(value(x)), mask,
                                                      is_training() ? dropout_p : 0.0);
    return ctx.transpose(1, 2).reshape({B, T, H});
  }
  int64_t heads;
  torch::nn::Linear query, key, value;
  double dropout_p;
};
TORCH_MODULE(BertSelfAttention);

// dense → dropout → LayerNorm(· + residual): BertSelfOutput and BertOutput alike.
struct BertResidualImpl : torch::nn::Module {
  BertResidualImpl(const BertConfig& c, int64_t in)
      : dense(register_module("dense", torch::nn::Linear(in, c.hidden_size))),
        LayerNorm(register_module("LayerNorm", bert_detail::layer_norm(c))),
        dropout(register_module("dropout", torch::nn::Dropout(c.hidden_dropout_prob))) {
    bert_detail::init_linear(dense, c);
  }
  at::Tensor forward(const at::Tensor& x, const at::Tensor& residual) { return LayerNorm(dropout(dense(x)) + residual); }
  torch::nn::Linear dense;
  torch::nn::LayerNorm LayerNorm;
  torch::nn::Dropout dropout;
};
TORCH_MODULE(BertResidual);

struct BertAttentionImpl : torch::nn::Module {
  explicit BertAttentionImpl(const BertConfig& c)
      : self(register_module("self", BertSelfAttention(c))), output(register_module("output", BertResidual(c, c.hidden_size))) {}
  at::Tensor forward(const at::Tensor& x, const at::Tensor& mask) { return output(self(x, mask), x); }
  BertSelfAttention self;
  BertResidual output;
};
TORCH_MODULE(BertAttention);

struct BertIntermediateImpl : torch::nn::Module {
  explicit BertIntermediateImpl(const BertConfig& c)
      : dense(register_module("dense", torch::nn::Linear(c.hidden_size, c.intermediate_size))) {
    bert_detail::init_linear(dense, c);
  }
  at::Tensor forward(const at::Tensor& x) { return at::gelu(dense(x)); }  // exact (erf) GELU, as "gelu"
  torch::nn::Linear dense;
};
TORCH_MODULE(BertIntermediate);

struct BertLayerImpl : torch::nn::Module {
  explicit BertLayerImpl(const BertConfig& c)
      : attention(register_module("attention", BertAttention(c))),
        intermediate(register_module("intermediate", BertIntermediate(c))),
        output(register_module("output", BertResidual(c, c.intermediate_size))) {}
  at::Tensor forward(const at::Tensor& x, const at::Tensor& mask) {
    at::Tensor a = attention(x, mask);
    return output(intermediate(a), a);
  }
  BertAttention attention;
  BertIntermediate intermediate;
  BertResidual output;
};
TORCH_MODULE(BertLayer);

struct BertEncoderImpl : torch::nn::Module {
  explicit BertEncoderImpl(const BertConfig& c) {
    layer = register_module("layer", torch::nn::ModuleList());
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      layers.push_back(Sharded<BertLayer>(c));
      layer->push_back(layers.back());
    }
  }
  at::Tensor forward(at::Tensor x, const at::Tensor& mask) {
    for (auto& l : layers) x = l->forward(x, mask);
    return x;
  }
  torch::nn::ModuleList layer;
  std::vector<Sharded<BertLayer>> layers;
};
TORCH_MODULE(BertEncoder);

struct BertPoolerImpl : torch::nn::Module {
  explicit BertPoolerImpl(const BertConfig& c) : dense(register_module("dense", torch::nn::Linear(c.hidden_size, c.hidden_size))) {
    bert_detail::init_linear(dense, c);
  }
  at::Tensor forward(const at::Tensor& hidden) { return at::tanh(dense(hidden.select(1, 0))); }  // the [CLS] token
  torch::nn::Linear dense;
};
TORCH_MODULE(BertPooler);

struct BertOutputs {
  at::Tensor last_hidden_state;  // [B, T, H]
  at::Tensor pooler_output;      // [B, H]
};

struct BertModelImpl : torch::nn::Module {
  explicit BertModelImpl(const BertConfig& c)
      : config(c),
        embeddings(register_module("embeddings", BertEmbeddings(c))),
        encoder(register_module("encoder", BertEncoder(c))),
        pooler(register_module("pooler", BertPooler(c))) {}
  // input_ids, attention_mask (1 real, 0 padding) and token_type_ids [B, T] (int64; the last two
  // may be undefined: all ones / zeros).
  BertOutputs forward(const at::Tensor& input_ids, at::Tensor attention_mask = {}, at::Tensor token_type_ids = {}) {
    if (!attention_mask.defined()) attention_mask = at::ones_like(input_ids);
    if (!token_type_ids.defined()) token_type_ids = at::zeros_like(input_ids);
    at::Tensor x = embeddings(input_ids, token_type_ids);
    const at::Tensor keep = attention_mask.to(x.scalar_type()).unsqueeze(1).unsqueeze(2);
    const at::Tensor mask = (1.0 - keep) * std::numeric_limits<float>::lowest();
    x = encoder(x, mask.to(x.scalar_type()));
    return {x, pooler(x)};
  }
  // sentence-transformers' embedding: the mean of the real tokens' hidden states, L2-normalised.
  static at::Tensor mean_pool(const at::Tensor& hidden, const at::Tensor& attention_mask, bool normalize = true) {
    const at::Tensor m = attention_mask.unsqueeze(-1).to(hidden.scalar_type());
    at::Tensor e = (hidden * m).sum(1) / m.sum(1).clamp_min(1e-9);
    return normalize ? e / e.norm(2, {1}, true).clamp_min(1e-12) : e;
  }
  BertConfig config;
  BertEmbeddings embeddings;
  BertEncoder encoder;
  BertPooler pooler;
};
TORCH_MODULE(BertModel);

// transformers' BertForSequenceClassification: logits = classifier(dropout(pooler_output)).
struct BertForSequenceClassificationImpl : torch::nn::Module {
  BertForSequenceClassificationImpl(const BertConfig& c, int64_t num_labels)
      : bert(register_module("bert", BertModel(c))),
        dropout(register_module("dropout", torch::nn::Dropout(c.hidden_dropout_prob))),
        classifier(register_module("classifier", torch::nn::Linear(c.hidden_size, num_labels))) {
    bert_detail::init_linear(classifier, c);
  }
  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& attention_mask = {}, const at::Tensor& token_type_ids = {}) {
    return classifier(dropout(bert(input_ids, attention_mask, token_type_ids).pooler_output));
  }
  BertModel bert;
  torch::nn::Dropout dropout;
  torch::nn::Linear classifier;
};
TORCH_MODULE(BertForSequenceClassification);

}  // namespace zeal::models
