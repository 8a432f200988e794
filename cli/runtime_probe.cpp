// The runtime's share of a rank's memory, measured: this process's resident set after it trained
// the tiny GPT for two steps through the engine on one rank (on the GPU for --gpu estimates). A
// process that only loaded the libraries misses what training adds to every rank whatever the
// model: the code of the kernels a step runs (paged in from libtorch), the engine's and the
// allocator's threads, the communicator.
#include <malloc.h>

#include <torch/optim/adamw.h>

#include "cli/commands.h"
#include "engine/engine.h"
#include "engine/runtime/dist_env.h"
#include "engine/runtime/runtime.h"
#include "engine/memory_tracker.h"
#include "examples/models/gpt.h"

namespace zeal::cli {

int64_t measured_runtime_bytes(bool on_gpu) {
  {
    Config config = Config::defaults(false);
    config.launch.use_cpu = !on_gpu;  // a CUDA context adds to the host's share only where ranks use one
    RuntimeOptions options;
    options.report_uncaught = false;
    Runtime runtime(DistEnv{}, options);  // one rank, whatever the environment says
    Engine engine(config, runtime);
    at::manual_seed(0);
    const models::GptConfig shape = models::gpt_preset("tiny");
    auto model = engine.init<models::Gpt>(shape);
    torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));
    auto [m, opt] = engine.prepare(model, optimizer);
    for (int step = 0; step < 2; ++step) {
      at::Tensor tokens = at::randint(0, shape.vocab, {2, 33}, at::kLong).to(engine.device());
      engine.backward(m->loss(tokens));
      opt.step();
      opt.zero_grad();
    }
  }
  malloc_trim(0);  // what the step freed is not the runtime's
  return detail::resident_bytes();
}

}  // namespace zeal::cli
