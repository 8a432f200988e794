// Gradient arrival: a post hook on a parameter's gradient accumulator runs after autograd has
// added this backward's contribution to its .grad. Every ZeRO stage counts arrivals this way.
#pragma once

#include <ATen/Tensor.h>

#include <functional>
#include <memory>
#include <string>

namespace zeal::zero {

// Calls `fn` each time `param`'s gradient accumulator has run. Returns the accumulator, which the
// caller keeps alive (autograd holds it only while a graph uses the parameter). `name` is for the
// error when the tensor has no accumulator (it does not require grad).
std::shared_ptr<void> on_grad_ready(const at::Tensor& param, const std::string& name, std::function<void()> fn);

}  // namespace zeal::zero
