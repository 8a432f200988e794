#include "engine/zero/grad_hook.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "engine/error.h"

namespace zeal::zero {
namespace {

class GradReadyHook final : public torch::autograd::FunctionPostHook {
 public:
  explicit GradReadyHook(std::function<void()> fn) : fn_(std::move(fn)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    fn_();
    return outputs;
  }

 private:
  std::function<void()> fn_;
};

}  // namespace

std::shared_ptr<void> on_grad_ready(const at::Tensor& param, const std::string& name, std::function<void()> fn) {
  auto acc = torch::autograd::impl::grad_accumulator(param);
  ZEAL_CHECK(acc) << "no gradient accumulator for " << name;
  acc->add_post_hook(std::make_unique<GradReadyHook>(std::move(fn)));
  return acc;
}

}  // namespace zeal::zero
