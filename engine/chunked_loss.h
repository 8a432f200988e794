// zeal::chunked_cross_entropy: the cross-entropy of a linear head, cross_entropy(hidden · weightᵀ,
// targets), without the [tokens, vocab] logits.
//
// An LM head's logits are tokens × vocabulary: at 1,024 tokens and GPT-2's 50,257 words, 206 MB per
// sequence in fp32, held three times over by the plain computation (the logits, their softmax and its
// gradient). Here the forward computes the logits a block at a time (a chunk of tokens by a slice of
// the vocabulary), keeps each token's log-sum-exp and target logit, and lets the block go; the
// backward computes each block again and turns it into its share of the two gradients (the fused
// linear-cross-entropy idea). At most one block of logits exists, never all of them; the price is a
// second product with the head in the backward.
//
//   at::Tensor loss = zeal::chunked_cross_entropy(ln_f(x), wte->weight, targets);  // [B, T, C], [V, C], [B, T]
//
// The products run in the compute dtype as zeal::linear runs them (autocast's dtype when it is on;
// fp32 from bf16/fp16 operands on CPUs without instructions for them), the softmax in fp32; each
// block's share of a gradient is one product in the compute dtype (rounded to it, as a linear layer's
// output is), the shares are summed in fp32 and the sum rounded once to the input's dtype. Matches the
// plain computation up to the order of the sums and those roundings.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace zeal {

struct ChunkedLossOptions {
  // Tokens whose logits are computed at once; 0: enough that a block (the chunk by a vocabulary slice
  // of at most 4 Mi weights) holds about 8 Mi logits.
  int64_t chunk = 0;
  int64_t ignore_index = -100;     // targets with this value count for nothing
  std::string reduction = "mean";  // mean (over the targets not ignored), sum, or none (one per token)
};

// hidden: [..., C] (any leading shape), weight: [V, C], targets: hidden's leading shape, int64 in
// [0, V) or ignore_index. Returns the scalar loss (mean, sum) or one per token (none, shaped as the
// targets). Throws zeal::Error naming the problem for shapes, dtypes or a target out of range.
at::Tensor chunked_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                                 const ChunkedLossOptions& options = {});

}  // namespace zeal
