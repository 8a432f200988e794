// torch::nn::LinearImpl::forward, provided by libzeal.so so that LoRA adapters reach every Linear of
// an unmodified model (see engine/peft/lora.h). A Linear without adapters runs zeal::linear: LibTorch
// 2.11's own body (F::linear), except for bf16/fp16 on a CPU without instructions for them, computed
// in fp32 (engine/linear.h); an adapted one PEFT's forward.
#include <c10/core/GradMode.h>
#include <torch/nn/functional/linear.h>
#include <torch/nn/modules/linear.h>

#include "engine/linear.h"
#include "engine/peft/slots.h"

at::Tensor torch::nn::LinearImpl::forward(const at::Tensor& input) {
  if (zeal::peft::detail::live_slots() == 0) return zeal::linear(input, weight, bias);
  zeal::peft::detail::Slot slot;
  if (!zeal::peft::detail::find_slot(this, &slot)) return zeal::linear(input, weight, bias);
  if (c10::GradMode::is_enabled()) slot.runs->fetch_add(1, std::memory_order_relaxed);
  at::Tensor result = zeal::linear(input, weight, bias);
  const auto result_dtype = result.scalar_type();
  at::Tensor x = input;
  if (x.scalar_type() != slot.A->weight.scalar_type()) x = x.to(slot.A->weight.scalar_type());
  if (slot.dropout) x = slot.dropout->forward(x);
  result = result + slot.B->forward(slot.A->forward(x)) * slot.scaling;
  return result.scalar_type() == result_dtype ? result : result.to(result_dtype);
}
