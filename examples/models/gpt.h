// A GPT-2 style decoder for zeal's examples and benchmarks: token and position embeddings,
// pre-norm blocks (causal self-attention, GELU MLP), a final layer norm and an LM head tied to the
// token embedding. Each block is a zeal::Sharded<Block>, the stage-3 unit (FSDP's
// transformer_layer_cls_to_wrap); the embeddings, the final norm and the tied head form the root.
// loss() computes the head and the cross-entropy a chunk of tokens at a time by default
// (zeal::chunked_cross_entropy), so the [tokens, vocab] logits never exist whole.
//
//   auto model = engine.init<zeal::models::Gpt>(zeal::models::gpt_preset("gpt2-small"));
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/init.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/chunked_loss.h"
#include "engine/linear.h"
#include "engine/zero/sharded.h"
#include "examples/models/gpt_config.h"

namespace zeal::models {

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(const GptConfig& c)
      : heads(c.heads),
        ln1(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim})))),
        attn(register_module("attn", torch::nn::Linear(c.dim, 3 * c.dim))),
        attn_proj(register_module("attn_proj", torch::nn::Linear(c.dim, c.dim))),
        ln2(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim})))),
        fc(register_module("fc", torch::nn::Linear(c.dim, 4 * c.dim))),
        fc_proj(register_module("fc_proj", torch::nn::Linear(4 * c.dim, c.dim))) {
    // GPT-2's initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2·layers).
    c10::NoGradGuard no_grad;
    for (auto* l : {&attn, &attn_proj, &fc, &fc_proj}) {
      (*l)->weight.normal_(0, 0.02);
      (*l)->bias.zero_();
    }
    const double scale = 1.0 / std::sqrt(2.0 * static_cast<double>(c.layers));
    attn_proj->weight.mul_(scale);
    fc_proj->weight.mul_(scale);
  }

  // x: [B, T, C]
  at::Tensor forward(const at::Tensor& x) {
    const int64_t B = x.size(0), T = x.size(1), C = x.size(2);
    auto qkv = attn(ln1(x)).split(C, 2);
    auto heads_of = [&](const at::Tensor& t) { return t.view({B, T, heads, C / heads}).transpose(1, 2); };
    at::Tensor y = at::scaled_dot_product_attention(heads_of(qkv[0]), heads_of(qkv[1]), heads_of(qkv[2]), {}, 0.0,
                                                    /*is_causal=*/true);
    at::Tensor h = x + attn_proj(y.transpose(1, 2).contiguous().view({B, T, C}));
    return h + fc_proj(at::gelu(fc(ln2(h)), "tanh"));
  }

  int64_t heads;
  torch::nn::LayerNorm ln1;
  torch::nn::Linear attn, attn_proj;
  torch::nn::LayerNorm ln2;
  torch::nn::Linear fc, fc_proj;
};
TORCH_MODULE(Block);

struct GptImpl : torch::nn::Module {
  explicit GptImpl(const GptConfig& c)
      : config(c),
        wte(register_module("wte", torch::nn::Embedding(c.vocab, c.dim))),
        wpe(register_module("wpe", torch::nn::Embedding(c.context, c.dim))),
        ln_f(register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim})))) {
    c10::NoGradGuard no_grad;
    wte->weight.normal_(0, 0.02);
    wpe->weight.normal_(0, 0.01);
    for (int64_t i = 0; i < c.layers; ++i) blocks.push_back(register_module("h" + std::to_string(i), Sharded<Block>(c)));
    if (!c.tie_head) {
      lm_head = register_module("lm_head", torch::nn::Linear(torch::nn::LinearOptions(c.dim, c.vocab).bias(false)));
      lm_head->weight.normal_(0, 0.02);
    }
  }

  // The head's matrix: the token embedding's (tied) or lm_head's.
  const at::Tensor& head_weight() const { return config.tie_head ? wte->weight : lm_head->weight; }

  // idx: [B, T] token ids (T ≤ context) → the final hidden states [B, T, dim].
  at::Tensor hidden(const at::Tensor& idx) {
    at::Tensor x = wte(idx) + wpe(at::arange(idx.size(1), idx.options()));
    for (auto& b : blocks) x = b->forward(x);
    return ln_f(x);
  }

  // idx: [B, T] token ids (T ≤ context) → logits [B, T, vocab]; the head is wte's matrix.
  at::Tensor forward(const at::Tensor& idx) {
    return zeal::linear(hidden(idx), head_weight());  // fast in bf16 on CPUs without bf16 instructions too
  }

  // Mean cross-entropy of predicting tokens[:, 1:] from tokens[:, :-1]: through the chunked head
  // (config.chunked_loss) or the whole logits.
  at::Tensor loss(const at::Tensor& tokens) {
    const int64_t T = tokens.size(1) - 1;
    const at::Tensor targets = tokens.narrow(1, 1, T);
    if (config.chunked_loss) {
      return zeal::chunked_cross_entropy(hidden(tokens.narrow(1, 0, T)), head_weight(), targets,
                                         {.chunk = config.loss_chunk});
    }
    at::Tensor logits = forward(tokens.narrow(1, 0, T));
    return at::cross_entropy_loss(logits.reshape({-1, config.vocab}).to(at::kFloat), targets.reshape({-1}));
  }

  GptConfig config;
  torch::nn::Embedding wte, wpe;
  std::vector<Sharded<Block>> blocks;
  torch::nn::LayerNorm ln_f;
  torch::nn::Linear lm_head{nullptr};  // untied heads only
};
TORCH_MODULE(Gpt);

}  // namespace zeal::models
