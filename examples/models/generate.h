// Text generation with the LLaMA decoder (examples/models/llama.h) and its KV cache, as transformers'
// generate does it: prompts of different lengths batched with left padding, greedy or sampling
// (repetition penalty, temperature, top-k, top-p, in that order), max_new_tokens, and rows that reach
// the EOS token padded from then on.
//
//   zeal::models::GenerationConfig g;
//   g.max_new_tokens = 32;
//   g.eos_token_id = tok.token_id("<|eot_id|>");
//   auto out = zeal::models::generate(model, {tok.encode("Hello")}, g, &engine);  // new tokens per prompt
//
// Under stage 3 every rank's forwards gather the units, so every rank must run the same number of
// steps: with an engine, each step the ranks agree (one all-reduce) whether any row of any rank still
// generates, and a rank whose rows are done keeps stepping on padding until all are.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <limits>
#include <stdexcept>
#include <vector>

#include "engine/engine.h"
#include "examples/models/llama.h"

namespace zeal::models {

struct GenerationConfig {
  int64_t max_new_tokens = 20;
  bool do_sample = false;
  double temperature = 1.0;
  int64_t top_k = 0;           // 0: off
  double top_p = 1.0;          // 1: off
  double repetition_penalty = 1.0;
  int64_t eos_token_id = -1;   // -1: none
  int64_t pad_token_id = 0;
  uint64_t seed = 0;           // sampling's generator
};

namespace detail {

// transformers' logits processors in its order, on the last position's logits [B, V].
inline at::Tensor process_logits(at::Tensor logits, const at::Tensor& seen, const GenerationConfig& g) {
  if (g.repetition_penalty != 1.0) {
    // A token already in the sequence: its logit divided by the penalty when positive, multiplied when not.
    at::Tensor score = logits.gather(1, seen);
    score = at::where(score < 0, score * g.repetition_penalty, score / g.repetition_penalty);
    logits = logits.scatter(1, seen, score);
  }
  if (!g.do_sample) return logits;
  if (g.temperature != 1.0) logits = logits / g.temperature;
  const double lowest = -std::numeric_limits<double>::infinity();
  if (g.top_k > 0 && g.top_k < logits.size(1)) {
    const at::Tensor kth = std::get<0>(logits.topk(g.top_k, 1)).narrow(1, g.top_k - 1, 1);
    logits = logits.masked_fill(logits < kth, lowest);
  }
  if (g.top_p < 1.0) {
    // Keep the smallest set of most likely tokens whose probability reaches top_p.
    auto [sorted, order] = logits.sort(1, /*descending=*/false);
    const at::Tensor cum = sorted.softmax(1).cumsum(1);
    at::Tensor drop = cum <= (1.0 - g.top_p);
    drop.select(1, drop.size(1) - 1).fill_(false);
    logits = logits.masked_fill(drop.scatter(1, order, drop), lowest);
  }
  return logits;
}

}  // namespace detail

// The new tokens of each prompt (up to max_new_tokens; a row stops after its EOS, which it keeps).
inline std::vector<std::vector<int64_t>> generate(LlamaForCausalLM& model, const std::vector<std::vector<int64_t>>& prompts,
                                                  const GenerationConfig& g, Engine* engine = nullptr) {
  if (prompts.empty() && !engine) return {};
  const int64_t B = static_cast<int64_t>(prompts.size());
  int64_t T = 1;
  for (const auto& p : prompts) {
    if (p.empty()) throw std::invalid_argument("generate: an empty prompt");
    T = std::max<int64_t>(T, static_cast<int64_t>(p.size()));
  }
  const auto device = model->head_weight().device();
  const auto longs = at::TensorOptions(at::kLong).device(device);
  // Left padding: each prompt ends at the last column.
  const int64_t rows = std::max<int64_t>(B, 1);  // a rank without prompts steps on one row of padding
  at::Tensor ids = at::full({rows, T}, g.pad_token_id, at::kLong), mask = at::zeros({rows, T}, at::kLong);
  for (int64_t b = 0; b < B; ++b) {
    const auto& p = prompts[static_cast<size_t>(b)];
    const int64_t n = static_cast<int64_t>(p.size());
    ids[b].narrow(0, T - n, n).copy_(at::tensor(p, at::kLong));
    mask[b].narrow(0, T - n, n).fill_(1);
  }
  if (B == 0) mask.fill_(1);
  ids = ids.to(device);
  mask = mask.to(device);
  at::Tensor seen = ids;
  // transformers' positions: the count of real tokens before each one (padding at 1).
  at::Tensor positions = (mask.cumsum(1) - 1).masked_fill(mask == 0, 1);
  at::Tensor unfinished = at::ones({rows}, longs);
  if (B == 0) unfinished.zero_();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(g.seed);
  c10::NoGradGuard no_grad;
  LlamaCache cache;
  at::Tensor input = ids;
  std::vector<std::vector<int64_t>> out(static_cast<size_t>(B));
  for (int64_t step = 0; step < g.max_new_tokens; ++step) {
    at::Tensor logits = model->forward(input, mask, positions, &cache).select(1, input.size(1) - 1).to(at::kDouble);
    logits = detail::process_logits(logits, seen, g);
    at::Tensor next;
    if (g.do_sample) {
      next = at::multinomial(logits.softmax(1).cpu(), 1, false, gen).squeeze(1).to(device);
    } else {
      next = logits.argmax(1);
    }
    next = next * unfinished + g.pad_token_id * (1 - unfinished);
    for (int64_t b = 0; b < B; ++b) {
      if (unfinished[b].item<int64_t>()) out[static_cast<size_t>(b)].push_back(next[b].item<int64_t>());
    }
    if (g.eos_token_id >= 0) unfinished = unfinished * next.ne(g.eos_token_id).to(at::kLong);
    // Every rank steps until no row of any rank generates (stage 3 gathers in every forward).
    int64_t left = unfinished.sum().item<int64_t>();
    if (engine) left = engine->reduce(at::scalar_tensor(left, longs), "sum").item<int64_t>();
    if (left == 0) break;
    input = next.unsqueeze(1);
    seen = at::cat({seen, input}, 1);
    mask = at::cat({mask, at::ones({rows, 1}, longs)}, 1);
    positions = positions.narrow(1, positions.size(1) - 1, 1) + 1;
  }
  return out;
}

}  // namespace zeal::models
