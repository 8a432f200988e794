// The GPT presets' shapes (examples/models/gpt.h builds them), without LibTorch: the memory
// estimator reads them too.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace zeal::models {

struct GptConfig {
  std::string name = "tiny";
  int64_t vocab = 256, context = 128, layers = 2, dim = 64, heads = 4;
  // loss(): the head and cross-entropy a chunk of tokens at a time (zeal::chunked_cross_entropy,
  // never the whole [tokens, vocab] logits; loss_chunk tokens at once, 0: its default); false: the
  // plain logits and cross_entropy.
  bool chunked_loss = true;
  int64_t loss_chunk = 0;
  // The LM head: wte's matrix (GPT-2) or, untied, a vocab × dim matrix of its own (lm_head, LLaMA-style).
  bool tie_head = true;
  // Parameters: embeddings (vocab + context)·dim, per block 12·dim² + 13·dim, final norm 2·dim, an
  // untied head vocab·dim.
  int64_t num_parameters() const {
    return (vocab + context) * dim + layers * (12 * dim * dim + 13 * dim) + 2 * dim + (tie_head ? 0 : vocab * dim);
  }
};

// tiny (byte-level, for tests), GPT-2's small (124 M), medium (355 M) and large (774 M), and
// GPT-2-shaped models at GPT-3's larger widths (Brown et al. 2020, table 2.1: 1.3 B "XL", 2.7 B,
// 6.7 B) with GPT-2's vocabulary and a 1024-token context.
inline std::vector<GptConfig> gpt_presets() {
  return {{"tiny", 256, 128, 2, 64, 4},
          {"gpt2-small", 50257, 1024, 12, 768, 12},
          {"gpt2-medium", 50257, 1024, 24, 1024, 16},
          {"gpt2-large", 50257, 1024, 36, 1280, 20},
          {"gpt2-1.3b", 50257, 1024, 24, 2048, 16},
          {"gpt2-2.7b", 50257, 1024, 32, 2560, 32},
          {"gpt2-6.7b", 50257, 1024, 32, 4096, 32}};
}

inline GptConfig gpt_preset(const std::string& name) {
  std::string known;
  for (const auto& p : gpt_presets()) {
    if (p.name == name) return p;
    known += (known.empty() ? "" : ", ") + p.name;
  }
  throw std::invalid_argument("unknown model preset '" + name + "' (known: " + known + ")");
}

}  // namespace zeal::models
