// A classifier under zeal::Trainer: the step's loss, predictions and labels from its logits, and the
// accuracy of the gathered predictions (compute_metrics).
#pragma once

#include <torch/nn/functional/loss.h>

#include "engine/trainer/trainer.h"

namespace zeal_examples {

// Cross-entropy of the logits (in fp32) against the labels; the predicted class of each sample.
inline zeal::StepOutput classification_step(const at::Tensor& logits, const at::Tensor& labels) {
  const at::Tensor l = logits.to(at::kFloat);
  return {torch::nn::functional::cross_entropy(l, labels), l.argmax(-1), labels};
}

inline zeal::Metrics accuracy(const zeal::EvalPrediction& p) {
  const double correct = p.predictions.eq(p.label_ids).sum().item<double>();
  return {{"accuracy", correct / static_cast<double>(p.predictions.size(0))}};
}

}  // namespace zeal_examples
