// A small GPT-like decoder for the engine tests: parameter sizes that no world size divides,
// embeddings, layer norms, causal attention and an MLP, so every kind of gradient appears.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/functional/activation.h>

#include <cmath>

#include "engine/zero/sharded.h"

namespace zeal_test {

struct TinyGptOptions {
  int64_t vocab = 37, dim = 20, heads = 2, layers = 2, seq = 8, hidden = 52;
  double dropout = 0;  // after the attention and the MLP of every block, when training
};

struct BlockImpl : torch::nn::Module {
  BlockImpl(const TinyGptOptions& o)
      : heads(o.heads),
        dropout(o.dropout),
        ln1(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.dim})))),
        // No bias on the keys' projection: softmax cancels it, its gradient is rounding noise that
        // Adam would amplify into lr-sized steps, and no two summation orders agree on noise.
        qkv(register_module("qkv", torch::nn::Linear(torch::nn::LinearOptions(o.dim, 3 * o.dim).bias(false)))),
        proj(register_module("proj", torch::nn::Linear(o.dim, o.dim))),
        ln2(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.dim})))),
        fc1(register_module("fc1", torch::nn::Linear(o.dim, o.hidden))),
        fc2(register_module("fc2", torch::nn::Linear(o.hidden, o.dim))) {}

  at::Tensor forward(const at::Tensor& x) {
    ++forwards;
    const int64_t B = x.size(0), T = x.size(1), C = x.size(2), hd = C / heads;
    auto parts = qkv(ln1(x)).split(C, 2);
    auto split_heads = [&](const at::Tensor& t) { return t.view({B, T, heads, hd}).transpose(1, 2); };
    at::Tensor q = split_heads(parts[0]), k = split_heads(parts[1]), v = split_heads(parts[2]);
    at::Tensor att = at::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(hd));
    at::Tensor mask = at::ones({T, T}, x.options().dtype(at::kBool)).triu(1);
    att = at::softmax(att.masked_fill(mask, -1e4), -1);
    at::Tensor y = at::matmul(att, v).transpose(1, 2).contiguous().view({B, T, C});
    auto drop = [&](const at::Tensor& t) { return dropout > 0 && is_training() ? at::dropout(t, dropout, true) : t; };
    at::Tensor h = x + drop(proj(y));
    return h + drop(fc2(at::gelu(fc1(ln2(h)))));
  }

  int64_t heads;
  double dropout;
  int64_t forwards = 0;  // how often forward ran (a checkpointed block runs again in its backward)
  torch::nn::LayerNorm ln1;
  torch::nn::Linear qkv, proj;
  torch::nn::LayerNorm ln2;
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Block);

struct TinyGptImpl : torch::nn::Module {
  explicit TinyGptImpl(const TinyGptOptions& o = {})
      : wte(register_module("wte", torch::nn::Embedding(o.vocab, o.dim))),
        wpe(register_module("wpe", torch::nn::Embedding(o.seq, o.dim))),
        ln_f(register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.dim})))),
        head(register_module("head", torch::nn::Linear(torch::nn::LinearOptions(o.dim, o.vocab).bias(false)))) {
    for (int64_t i = 0; i < o.layers; ++i) {
      blocks.push_back(register_module("block" + std::to_string(i), zeal::Sharded<Block>(o)));
    }
  }

  // idx: [B, T] token ids → logits [B, T, vocab]
  at::Tensor forward(const at::Tensor& idx) {
    const int64_t T = idx.size(1);
    at::Tensor x = wte(idx) + wpe(at::arange(T, idx.options()));
    for (auto& b : blocks) x = b->forward(x);
    return head(ln_f(x));
  }

  torch::nn::Embedding wte, wpe;
  std::vector<zeal::Sharded<Block>> blocks;  // the stage-3 units; plain blocks in other stages
  torch::nn::LayerNorm ln_f;
  torch::nn::Linear head;
};
TORCH_MODULE(TinyGpt);

}  // namespace zeal_test
