// A part of a training run through zeal::Engine: steps [from, to) of a run whose step k always sees
// the same global batch, loading a checkpoint before and saving one after (or before a given
// step) as asked; every rank's final parameters come back. Checkpoint tests compare a run in one
// phase with the same run split in two around a save and a load.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "tests/engine/engine_harness.h"

namespace zeal_test {

constexpr int kPhaseSteps = 6;  // the whole run

struct Phase {
  RunSpec spec;
  int from = 0, to = kPhaseSteps;
  std::string load, save;  // directories (empty: none)
  int save_at = -1;         // save before this step instead of after the last
  zeal::SaveStateOptions options = {};
  int save_also_at = -1;    // and an earlier save before this step, into <save>.earlier (same options)
  zeal::LoadStateOptions load_options = {};
};

// Steps [from, to) of a run whose step k always sees the same global batch, through a prepared
// model and optimizer.
template <class M, class O>
void train_steps(zeal::Engine& engine, M& m, O& o, const RunSpec& s, int from, int to) {
  const int64_t per_step = s.micro_batch * s.world * s.accumulation;
  at::Tensor tokens = make_tokens(per_step * kPhaseSteps);
  for (int step = from; step < to; ++step) {
    for (int micro = 0; micro < s.accumulation; ++micro) {
      auto guard = engine.accumulate(m);
      const int64_t first = step * per_step + (micro * s.world + engine.process_index()) * s.micro_batch;
      at::Tensor loss;
      {
        auto ac = engine.autocast();
        loss = lm_loss(m, tokens.narrow(0, first, s.micro_batch).to(engine.device()));
      }
      engine.backward(loss);
      if (engine.sync_gradients() && s.clip > 0) engine.clip_grad_norm_(s.clip);
      o.step();
      o.zero_grad();
    }
  }
}

// Trains steps [from, to) of a run whose step k always sees the same global batch (samples
// k·B … (k+1)·B − 1 of one fixed stream, B the global batch), on the spec's device, loading before
// and saving after as asked; returns every rank's final parameters.
inline std::vector<at::Tensor> run_phase(const Phase& p, const std::string& name) {
  const RunSpec& s = p.spec;
  const std::string out = temp_dir("ckpt_out_" + name);
  zeal::SpawnOptions so;
  so.env = s.env;
  so.ranks_per_machine = s.ranks_per_machine;
  auto results = zeal::spawn(
      [&](zeal::Runtime& rt) {
        zeal::Engine engine(make_config(s), rt);
        zeal_test::Setup u = make_setup(s);
        auto [m, o] = engine.prepare(u.model, *u.opt);
        if (!p.load.empty()) engine.load_state(p.load, p.load_options);
        for (int step = p.from; step < p.to; ++step) {
          if (step == p.save_also_at && !p.save.empty()) engine.save_state(p.save + ".earlier", p.options);
          if (step == p.save_at && !p.save.empty()) engine.save_state(p.save, p.options);
          train_steps(engine, m, o, s, step, step + 1);
        }
        if (!p.save.empty() && p.save_at < 0) engine.save_state(p.save, p.options);
        engine.wait_for_save();
        auto g = engine.gathered();
        write_tensor(out + "/params_" + std::to_string(engine.process_index()), flat_params(*m));
      },
      s.world, so);
  EXPECT_EQ(zeal::describe_failures(results), "") << name;
  std::vector<at::Tensor> params;
  for (int r = 0; r < s.world; ++r) params.push_back(read_tensor(out + "/params_" + std::to_string(r)));
  std::filesystem::remove_all(out);
  return params;
}

}  // namespace zeal_test
