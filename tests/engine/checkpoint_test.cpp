// Checkpoints (engine.save_state / engine.load_state): a run of 6 optimizer steps against one of
// 3 steps, a save, a new engine (a new process group) that loads it and 3 more steps — the same
// samples in the same steps. At the same world size and stage the final parameters are the same
// bits (every stage, bf16, accumulation, CPU and NVMe offload, frozen weights); at another world
// size and stage within 1e-5 (other summation orders). A corrupted, truncated or missing file fails
// the load naming it, with the parameters and the optimizer state untouched (also where a new
// engine's state went in place as it was checked); a save killed mid-way leaves the previous
// checkpoint and `latest` as they were; total_limit keeps the newest; Python's safetensors reads
// the files.
#include <gtest/gtest.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/nn/modules/container/sequential.h>
#include <torch/data/datasets/base.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include "engine/checkpoint/consolidate.h"
#include "engine/checkpoint/manifest.h"
#include "engine/checkpoint/safetensors.h"
#include "engine/resident.h"
#include "engine/zero/sharded.h"

#include "tests/engine/engine_harness.h"
#include "tests/engine/phase_harness.h"

namespace zeal_test {
namespace {

namespace ckpt = zeal::ckpt;

namespace fs = std::filesystem;
constexpr int kSteps = kPhaseSteps;

struct ResumeCase {
  std::string label;
  RunSpec before, after;  // the run that saves, the run that resumes
};

void PrintTo(const ResumeCase& c, std::ostream* os) { *os << c.label; }

RunSpec spec(int stage, int world, std::string precision = "no", int accumulation = 1, int64_t micro_batch = 2) {
  RunSpec s;
  s.stage = stage;
  s.world = world;
  s.precision = std::move(precision);
  s.accumulation = accumulation;
  s.micro_batch = micro_batch;
  return s;
}

class Resume : public ::testing::TestWithParam<ResumeCase> {};

TEST_P(Resume, ThreeStepsSavedAndThreeResumedMatchSixInOneRun) {
  const ResumeCase& c = GetParam();
  const std::string ckpt = temp_dir("ckpt_" + c.label);
  RunSpec before = c.before, after = c.after;
  const std::string swap = temp_dir("ckpt_swap_" + c.label);
  for (RunSpec* s : {&before, &after}) {
    if (!s->nvme_path.empty()) s->nvme_path = swap;
    if (!s->param_nvme_path.empty()) s->param_nvme_path = swap;
  }
  const auto whole = run_phase({after, 0, kSteps, "", ""}, c.label + "_whole");
  (void)run_phase({before, 0, kSteps / 2, "", ckpt}, c.label + "_first");
  ASSERT_TRUE(fs::exists(fs::path(ckpt) / "manifest.json"));
  const auto resumed = run_phase({after, kSteps / 2, kSteps, ckpt, ""}, c.label + "_resumed");
  const bool same_layout = before.world == after.world && before.stage == after.stage;
  // The same layout also read once (a memory budget the state fits: the first pass keeps the bytes).
  zeal_test::Phase once{after, kSteps / 2, kSteps, ckpt, ""};
  once.load_options.memory_budget = int64_t{1} << 40;
  const auto resumed_once = same_layout ? run_phase(once, c.label + "_resumed_once") : resumed;
  for (size_t r = 0; r < resumed.size(); ++r) {
    if (same_layout) {
      EXPECT_TRUE(at::equal(whole[r], resumed[r])) << "rank " << r << ": largest difference "
                                                   << (whole[r] - resumed[r]).abs().max().item<double>();
      EXPECT_TRUE(at::equal(whole[r], resumed_once[r])) << "read once, rank " << r;
    } else {
      const double d = rel_diff(resumed[r], whole[r]);
      std::printf("metric resume %s rank %zu rel_diff %.3g\n", c.label.c_str(), r, d);
      EXPECT_LE(d, 1e-5) << "rank " << r;
    }
  }
  fs::remove_all(ckpt);
  fs::remove_all(swap);
}

RunSpec with_offload(RunSpec s) {
  s.offload = true;
  return s;
}
RunSpec with_nvme(RunSpec s) {
  s.nvme_path = "x";
  s.param_nvme_path = "x";
  s.sub_group = 1000;
  return s;
}
RunSpec frozen(RunSpec s) {
  s.freeze_ln1 = true;
  s.freeze_embeddings = true;
  return s;
}

INSTANTIATE_TEST_SUITE_P(
    Cases, Resume,
    ::testing::Values(ResumeCase{"stage0_world2", spec(0, 2), spec(0, 2)},
                      ResumeCase{"stage1_world2_bf16_accum2", spec(1, 2, "bf16", 2), spec(1, 2, "bf16", 2)},
                      ResumeCase{"stage2_world3", spec(2, 3), spec(2, 3)},
                      ResumeCase{"stage3_world2_bf16_frozen", frozen(spec(3, 2, "bf16")), frozen(spec(3, 2, "bf16"))},
                      ResumeCase{"stage3_world2_cpu_offload", with_offload(spec(3, 2)), with_offload(spec(3, 2))},
                      ResumeCase{"stage3_world2_nvme", with_nvme(spec(3, 2)), with_nvme(spec(3, 2))},
                      ResumeCase{"stage3_world2_to_stage0_world1", spec(3, 2), spec(0, 1, "no", 1, 4)},
                      ResumeCase{"stage1_world3_to_stage3_world2_offload", spec(1, 3, "no", 1, 2),
                                 with_offload(spec(3, 2, "no", 1, 3))},
                      ResumeCase{"stage3_world3_nvme_frozen_to_stage2_world2", frozen(with_nvme(spec(3, 3, "no", 1, 2))),
                                 frozen(spec(2, 2, "no", 1, 3))}),
    [](const ::testing::TestParamInfo<ResumeCase>& i) { return i.param.label; });

struct Counter : zeal::Checkpointable {
  int64_t value = 0;
  std::string state_dict() const override { return std::to_string(value); }
  void load_state_dict(const std::string& s) override { value = std::stoll(s); }
};

// Every rank's random number generator continues where it was at the save, when the world size
// is the same: what each rank draws right after its save is what it draws right after the load;
// an object registered for checkpointing gets back rank 0's saved state on every rank.
TEST(CheckpointRng, EachRankContinuesItsOwnRandomStreamAndRegisteredObjectsComeBack) {
  const std::string ckpt = temp_dir("ckpt_rng"), out = temp_dir("ckpt_rng_out");
  RunSpec s = spec(2, 2);
  for (const bool load : {false, true}) {
    auto results = zeal::spawn(
        [&](zeal::Runtime& rt) {
          zeal::Engine engine(make_config(s), rt);
          zeal_test::Setup u = make_setup(s);
          auto [m, o] = engine.prepare(u.model, *u.opt);
          const std::string me = std::to_string(engine.process_index());
          auto counter = std::make_shared<Counter>();
          engine.register_for_checkpointing(counter);
          if (load) {
            zeal_test::seed(999);  // another stream, which the load must replace
            engine.load_state(ckpt);
            if (counter->value != 4242) throw zeal::Error("the registered object was not restored");
          } else {
            counter->value = engine.is_main_process() ? 4242 : 7;  // rank 0's is saved
            zeal_test::seed(100 + engine.process_index());
            (void)at::rand({7});
            engine.save_state(ckpt);
          }
          write_tensor(out + (load ? "/after_load_" : "/after_save_") + me, at::rand({5}));
        },
        s.world);
    ASSERT_EQ(zeal::describe_failures(results), "");
  }
  for (int r = 0; r < s.world; ++r) {
    const at::Tensor a = read_tensor(out + "/after_save_" + std::to_string(r));
    EXPECT_TRUE(at::equal(a, read_tensor(out + "/after_load_" + std::to_string(r)))) << "rank " << r;
    if (r > 0) EXPECT_FALSE(at::equal(a, read_tensor(out + "/after_save_0"))) << "the ranks drew the same stream";
  }
  fs::remove_all(ckpt);
  fs::remove_all(out);
}

struct Ids : torch::data::datasets::Dataset<Ids> {
  explicit Ids(int64_t n) : n(n) {}
  torch::data::Example<> get(size_t i) override {
    return {at::full({1}, static_cast<float>(i)), at::full({}, static_cast<int64_t>(i))};
  }
  std::optional<size_t> size() const override { return n; }
  int64_t n;
};

// A prepared loader continues with the batch after the last one the saved run took: 24 samples,
// shuffled, 4 per global batch (6 per epoch). One run takes two epochs; another takes 3 batches
// and saves; a third loads and takes the rest of epoch 0 and epoch 1 — on 2 ranks, and on 1 rank
// with the same global batch: the same samples in every step.
TEST(CheckpointLoader, AResumedLoaderContinuesWithTheNextBatch) {
  const std::string ckpt = temp_dir("ckpt_loader"), out = temp_dir("ckpt_loader_out");
  auto run = [&](int world, int stop_after, bool load, const std::string& tag) {
    auto results = zeal::spawn(
        [&](zeal::Runtime& rt) {
          RunSpec s = spec(1, world);
          zeal::Engine engine(make_config(s), rt);
          zeal_test::Setup u = make_setup(s);
          zeal::DataLoader loader(Ids(24), {.batch_size = 4 / world, .shuffle = true, .seed = 5});
          auto [m, o, l] = engine.prepare(u.model, *u.opt, loader);
          if (load) engine.load_state(ckpt);
          std::vector<at::Tensor> seen;
          for (int epoch = 0; epoch < 2 && static_cast<int>(seen.size()) != stop_after; ++epoch) {
            for (auto& b : l) {
              seen.push_back(std::get<0>(engine.gather(b.target).sort()));
              if (static_cast<int>(seen.size()) == stop_after) break;
            }
          }
          if (stop_after > 0) engine.save_state(ckpt);
          if (engine.is_main_process()) write_tensor(out + "/" + tag, at::stack(seen));
        },
        world);
    EXPECT_EQ(zeal::describe_failures(results), "") << tag;
    return read_tensor(out + "/" + tag);
  };
  const at::Tensor whole = run(2, -1, false, "whole");
  ASSERT_EQ(whole.numel(), 12 * 4);  // 12 global batches of 4 (written flat)
  (void)run(2, 3, false, "first");
  const at::Tensor rest2 = run(2, -1, true, "rest2"), rest1 = run(1, -1, true, "rest1");
  EXPECT_TRUE(at::equal(rest2, whole.narrow(0, 3 * 4, 9 * 4))) << rest2 << whole;
  EXPECT_TRUE(at::equal(rest1, whole.narrow(0, 3 * 4, 9 * 4))) << rest1 << whole;
  fs::remove_all(ckpt);
  fs::remove_all(out);
}

// A checkpoint saved by one process for the damage tests.
std::string saved_checkpoint(const std::string& name, RunSpec s) {
  const std::string ckpt = temp_dir(name);
  (void)run_phase({s, 0, 2, "", ckpt}, name + "_save");
  return ckpt;
}

// A file's bytes.
std::string file_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

// What a load of `ckpt` on s.world ranks gives, after `steps` steps (0: straight after prepare, as a
// resume): rank 0's error ("accepted" without one), and whether every rank's parameters stayed as
// they were and its whole state (master, optimizer state: what save_state writes) kept its bytes.
std::pair<std::string, bool> load_error(const std::string& ckpt, const RunSpec& s,
                                        const zeal::LoadStateOptions& options = {}, int steps = 0) {
  const std::string out = temp_dir("ckpt_damage_out");
  auto results = zeal::spawn(
      [&](zeal::Runtime& rt) {
        zeal::Engine engine(make_config(s), rt);
        zeal_test::Setup u = make_setup(s);
        auto [m, o] = engine.prepare(u.model, *u.opt);
        train_steps(engine, m, o, s, 0, steps);
        at::Tensor before;
        {
          auto g = engine.gathered();
          before = flat_params(*m);
        }
        engine.save_state(out + "/before");
        std::string msg = "accepted";
        try {
          engine.load_state(ckpt, options);
        } catch (const zeal::Error& e) {
          msg = e.what();
        }
        engine.save_state(out + "/after");
        auto g = engine.gathered();
        const std::string me = std::to_string(engine.process_index());
        write_tensor(out + "/same_" + me, at::tensor({at::equal(before, flat_params(*m)) ? 1 : 0}));
        std::ofstream(out + "/message_" + me) << msg;
      },
      s.world);
  EXPECT_EQ(zeal::describe_failures(results), "");
  bool same = true;
  for (int r = 0; r < s.world; ++r) {
    const std::string f = out + "/same_" + std::to_string(r);
    same = same && fs::exists(f) && read_tensor(f).item<int64_t>() == 1;
    const std::string file = fmt::format("rank{}.safetensors", r);
    const bool state_same = file_bytes(out + "/before/" + file) == file_bytes(out + "/after/" + file);
    EXPECT_GT(file_bytes(out + "/before/" + file).size(), 0u) << file;
    same = same && state_same;
  }
  std::ifstream f(out + "/message_0");
  std::string error((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  fs::remove_all(out);
  return {error, same};
}

// A file changed between a two-pass load's passes (after every rank checked it): the second pass,
// which reads it again through a mapping, finds the changed block after its bytes went out and
// every rank says which file, which bytes, and that the state is now partly loaded. With the bytes
// kept from the first pass (the state within the budget) the change comes too late to matter.
TEST(CheckpointDamage, AFileChangedBetweenTheTwoPassesIsNamedOnEveryRank) {
  RunSpec s = spec(3, 2);
  const std::string ckpt = saved_checkpoint("ckpt_between", s);
  ::setenv("ZEAL_CHECKPOINT_FAULT", "change:1", 1);
  const auto [e, same] = load_error(ckpt, s);  // the default: two passes
  EXPECT_NE(e.find("rank1.safetensors changed after it was checked: bytes"), std::string::npos) << e;
  EXPECT_NE(e.find("partly loaded"), std::string::npos) << e;
  EXPECT_NE(e.find("rank 1"), std::string::npos) << e;
  // A file that grew between the passes on every rank: the second pass finds it before it applies
  // anything, so nothing was changed, a new engine's state that went in place during the first pass
  // included (zeros again).
  const std::string grown = saved_checkpoint("ckpt_between_grown", s);
  ::setenv("ZEAL_CHECKPOINT_FAULT", "grow:all", 1);
  const auto [g, g_same] = load_error(grown, s);
  ::setenv("ZEAL_CHECKPOINT_FAULT", "change:1", 1);
  EXPECT_NE(g.find("before anything was applied: nothing was changed"), std::string::npos) << g;
  EXPECT_TRUE(g_same) << "a load that failed before its second pass applied anything changed the state";
  fs::remove_all(grown);
  const std::string kept_ckpt = saved_checkpoint("ckpt_between_kept", s);
  const auto [kept, kept_same] = load_error(kept_ckpt, s, {.memory_budget = int64_t{1} << 40});
  ::unsetenv("ZEAL_CHECKPOINT_FAULT");
  EXPECT_EQ(kept, "accepted");
  // The byte was flipped all the same: a load now finds it in its first pass.
  const auto [later, later_same] = load_error(kept_ckpt, s);
  EXPECT_NE(later.find("rank1.safetensors is corrupted"), std::string::npos) << later;
  EXPECT_TRUE(later_same);
  fs::remove_all(ckpt);
  fs::remove_all(kept_ckpt);
}

TEST(CheckpointDamage, CorruptTruncatedAndMissingFilesAreNamedAndChangeNothing) {
  RunSpec s = spec(3, 2);
  const std::string ckpt = saved_checkpoint("ckpt_damage", s);
  const fs::path f = fs::path(ckpt) / "rank1.safetensors";
  std::vector<char> bytes;
  {
    std::ifstream in(f, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  ASSERT_GT(bytes.size(), 1000u);
  // One byte flipped in the last tensor's data.
  {
    std::vector<char> bad = bytes;
    bad[bad.size() - 3] ^= 0x40;
    std::ofstream(f, std::ios::binary | std::ios::trunc).write(bad.data(), static_cast<std::streamsize>(bad.size()));
    const auto [e, same] = load_error(ckpt, s);
    EXPECT_NE(e.find("rank1.safetensors is corrupted"), std::string::npos) << e;
    EXPECT_NE(e.find("nothing was changed"), std::string::npos) << e;
    EXPECT_TRUE(same) << "a failed load changed the parameters or the optimizer state";
    // After steps (the optimizer state no longer zeros: pass one only checks it).
    const auto [e2, same2] = load_error(ckpt, s, {}, /*steps=*/1);  // not the checkpoint's 2: other state
    EXPECT_NE(e2.find("nothing was changed"), std::string::npos) << e2;
    EXPECT_TRUE(same2) << "a failed load after steps changed the parameters or the optimizer state";
    // Stage 1 (a flat partition), the state in place before the corrupt block was found.
    RunSpec one = spec(1, 2);
    const std::string ckpt1 = saved_checkpoint("ckpt_damage_1", one);
    const fs::path f1 = fs::path(ckpt1) / "rank1.safetensors";
    std::string b1 = file_bytes(f1.string());
    b1[b1.size() - 3] ^= 0x40;
    std::ofstream(f1, std::ios::binary | std::ios::trunc).write(b1.data(), static_cast<std::streamsize>(b1.size()));
    const auto [e3, same3] = load_error(ckpt1, one);
    EXPECT_NE(e3.find("rank1.safetensors is corrupted"), std::string::npos) << e3;
    EXPECT_TRUE(same3) << "a failed stage-1 load changed the parameters or the optimizer state";
    fs::remove_all(ckpt1);
  }
  // Truncated.
  {
    std::ofstream(f, std::ios::binary | std::ios::trunc).write(bytes.data(), static_cast<std::streamsize>(bytes.size() / 2));
    const auto [e, same] = load_error(ckpt, s);
    EXPECT_NE(e.find("rank1.safetensors is truncated"), std::string::npos) << e;
    EXPECT_TRUE(same);
  }
  // Missing.
  {
    fs::remove(f);
    const auto [e, same] = load_error(ckpt, s);
    EXPECT_NE(e.find("rank1.safetensors is missing"), std::string::npos) << e;
    EXPECT_TRUE(same);
  }
  // A model with a parameter the checkpoint lacks.
  {
    std::ofstream(f, std::ios::binary | std::ios::trunc).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    RunSpec deeper = s;
    deeper.layers = s.layers + 1;
    const auto [e, same] = load_error(ckpt, deeper);
    EXPECT_NE(e.find("the checkpoint has no parameter 'block" + std::to_string(s.layers)), std::string::npos) << e;
    EXPECT_TRUE(same);
  }
  fs::remove_all(ckpt);
}

// On s.world ranks: a 768 x 768 weight (3.5 MB rank files at stage 1 on 2 ranks, several CRC blocks
// each) prepared with AdamW, then `body(engine, model, step)`, `step` taking one optimizer step.
using LinearBody = std::function<void(zeal::Engine&, torch::nn::Module&, std::function<void()>)>;
// A dim x dim weight (no bias), AdamW, one process per rank; `step` trains it one step.
void run_linear(const RunSpec& s, const LinearBody& body, const std::map<std::string, std::string>& env,
                int64_t dim = 768) {
  zeal::SpawnOptions so;
  so.env = env;
  auto results = zeal::spawn(
      [&](zeal::Runtime& rt) {
        zeal::Engine engine(make_config(s), rt);
        torch::manual_seed(3);
        torch::nn::Linear lin(torch::nn::LinearOptions(dim, dim).bias(false));
        torch::optim::AdamW opt(lin->parameters(), torch::optim::AdamWOptions(1e-3));
        auto [m, o] = engine.prepare(lin, opt);
        const auto step = [&] {
          engine.backward(m->forward(at::ones({4, dim})).pow(2).mean());
          o.step();
          o.zero_grad();
        };
        body(engine, *m.ptr(), step);
      },
      s.world, so);
  EXPECT_EQ(zeal::describe_failures(results), "");
}

// Saves the state into out/before, loads ckpt, saves into out/after, and writes what the load said
// ("accepted", or its error) into out/message_<rank>.
LinearBody save_load_save(const std::string& ckpt, const std::string& out) {
  return [ckpt, out](zeal::Engine& e, torch::nn::Module&, std::function<void()>) {
    e.save_state(out + "/before");
    std::string msg = "accepted";
    try {
      e.load_state(ckpt);
    } catch (const zeal::Error& err) {
      msg = err.what();
    }
    e.save_state(out + "/after");
    std::ofstream(out + "/message_" + std::to_string(e.process_index())) << msg;
  };
}

// A rank's saved generator state or a registered object's bytes damaged: every rank refuses the
// load before anything changes (both are checked in the first pass with the rest), naming the file.
// (Here the generator's bytes share their CRC block with the optimizer state before them, which the
// first pass always checked; the registered object, which had no CRC, is the half that was new.)
TEST(CheckpointDamage, ADamagedGeneratorStateOrRegisteredObjectChangesNothingOnAnyRank) {
  const std::string ckpt = temp_dir("ckpt_rng_damage"), out = temp_dir("ckpt_rng_damage_out");
  const RunSpec s = spec(1, 2);
  run_linear(s, [&](zeal::Engine& e, torch::nn::Module&, std::function<void()> step) {
        auto counter = std::make_shared<Counter>();
        e.register_for_checkpointing(counter);
        counter->value = 17;
        step();
        e.save_state(ckpt);
      },
      {});
  const auto try_load = [&](const std::string& damaged, int64_t at) {
    const std::string good = file_bytes(damaged);
    std::string bytes = good;
    bytes[static_cast<size_t>(at)] ^= 0x01;
    std::ofstream(damaged, std::ios::binary | std::ios::trunc).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    run_linear(s, [&](zeal::Engine& e, torch::nn::Module& m, std::function<void()> step) {
          auto counter = std::make_shared<Counter>();
          e.register_for_checkpointing(counter);
          save_load_save(ckpt, out)(e, m, step);
          if (counter->value != 0) throw zeal::Error("a failed load changed the registered object");
        },
        {});
    std::ofstream(damaged, std::ios::binary | std::ios::trunc).write(good.data(), static_cast<std::streamsize>(good.size()));
    const std::string name = fs::path(damaged).filename().string();
    for (int r = 0; r < 2; ++r) {
      const std::string msg = file_bytes(out + "/message_" + std::to_string(r));
      EXPECT_NE(msg.find("nothing was changed"), std::string::npos) << "rank " << r << ": " << msg;
      EXPECT_NE(msg.find(name), std::string::npos) << "rank " << r << ": " << msg;
      const std::string f = "/rank" + std::to_string(r) + ".safetensors";
      EXPECT_TRUE(file_bytes(out + "/before" + f) == file_bytes(out + "/after" + f)) << "rank " << r << " changed";
    }
  };
  const std::string rank1 = (fs::path(ckpt) / "rank1.safetensors").string();
  const auto rng = zeal::ckpt::read_safetensors_header(rank1).tensors.at("rng/cpu");
  try_load(rank1, rng.offset + rng.bytes / 2);
  try_load((fs::path(ckpt) / "custom_0.bin").string(), 0);
  fs::remove_all(ckpt);
  fs::remove_all(out);
}

// A new engine's state put in place over several of the reader's spans (32 MiB each): the state it
// then holds is the saved one, byte for byte; when a block of it fails its check after the spans
// before it went in, the state is zeros again. A 4200 x 4200 weight on 1 rank: its exp_avg and
// exp_avg_sq are 70 MB each.
TEST(CheckpointDamage, AStateInPlaceOverManySpansIsTheSavedOneOrZerosAgain) {
  const std::string ckpt = temp_dir("ckpt_place"), out = temp_dir("ckpt_place_out");
  const RunSpec s = spec(1, 1);
  constexpr int64_t kDim = 4200;
  run_linear(s, [&](zeal::Engine& e, torch::nn::Module&, std::function<void()> step) {
        step();
        e.save_state(ckpt);
      },
      {}, kDim);
  const fs::path f0 = fs::path(ckpt) / "rank0.safetensors";
  const std::string good = file_bytes(f0.string());
  std::string bytes = good;
  int64_t at = -1;
  const auto manifest = nlohmann::json::parse(std::ifstream(fs::path(ckpt) / "manifest.json"));
  for (const auto& p : manifest["pieces"])
    if (p["kind"] == "exp_avg") {  // the last MiB of its first span: the blocks before it check out
      at = (p["offset"].get<int64_t>() / zeal::ckpt::kCrcBlock + 31) * zeal::ckpt::kCrcBlock + 100;
    }
  ASSERT_GT(at, 0);
  bytes[static_cast<size_t>(at)] ^= 0x10;
  std::ofstream(f0, std::ios::binary | std::ios::trunc).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  run_linear(s, save_load_save(ckpt, out), {}, kDim);
  const std::string msg = file_bytes(out + "/message_0");
  EXPECT_NE(msg.find("rank0.safetensors is corrupted"), std::string::npos) << msg;
  EXPECT_TRUE(file_bytes(out + "/before/rank0.safetensors") == file_bytes(out + "/after/rank0.safetensors"))
      << "the state changed in a failed load";
  std::ofstream(f0, std::ios::binary | std::ios::trunc).write(good.data(), static_cast<std::streamsize>(good.size()));
  run_linear(s, [&](zeal::Engine& e, torch::nn::Module&, std::function<void()>) {
        e.load_state(ckpt);
        e.save_state(out + "/loaded");
      },
      {}, kDim);
  EXPECT_TRUE(file_bytes(out + "/loaded/rank0.safetensors") == good) << "the loaded state is not the saved one";
  fs::remove_all(ckpt);
  fs::remove_all(out);
}

// A new engine's optimizer state (still the zeros it was made with) goes in place as the first pass
// checks it (the debug line says how many bytes) and nothing of it is read again; where one rank's
// file fails after part of that rank's state went in, every rank's state is zeros again. An engine
// whose state was loaded reads it twice. A 768 x 768 weight at stage 1 on 2 ranks: 3.5 MB rank
// files, several CRC blocks each.
TEST(CheckpointDamage, ANewEnginesStateGoesInPlaceAndBackToZerosWhenALaterBlockFails) {
  const std::string ckpt = temp_dir("ckpt_in_place"), out = temp_dir("ckpt_in_place_out");
  const RunSpec s = spec(1, 2);
  const auto run = [&](const LinearBody& body, const std::map<std::string, std::string>& env) {
    run_linear(s, body, env);
  };
  run([&](zeal::Engine& e, torch::nn::Module&, std::function<void()> step) {
        step();
        e.save_state(ckpt);
      },
      {});
  // One byte flipped in the middle of rank 1's exp_avg_sq, which comes after its exp_avg in the file.
  const fs::path f1 = fs::path(ckpt) / "rank1.safetensors";
  const std::string good = file_bytes(f1.string());
  int64_t at = -1;
  const auto manifest = nlohmann::json::parse(std::ifstream(fs::path(ckpt) / "manifest.json"));
  for (const auto& p : manifest["pieces"]) {
    if (p["file"] == "rank1.safetensors" && p["kind"] == "exp_avg_sq") {
      at = p["offset"].get<int64_t>() + p["count"].get<int64_t>() * 2;  // its middle (fp32)
    }
  }
  ASSERT_GT(at, int64_t{2} << 20) << "the flipped byte should lie beyond the rank's first blocks";
  std::string bad = good;
  bad[static_cast<size_t>(at)] ^= 0x10;
  std::ofstream(f1, std::ios::binary | std::ios::trunc).write(bad.data(), static_cast<std::streamsize>(bad.size()));
  run(save_load_save(ckpt, out), {});
  for (int r = 0; r < s.world; ++r) {
    const std::string msg = file_bytes(out + "/message_" + std::to_string(r));
    EXPECT_NE(msg.find("rank1.safetensors is corrupted"), std::string::npos) << msg;
    EXPECT_NE(msg.find("nothing was changed"), std::string::npos) << msg;
    const std::string file = fmt::format("rank{}.safetensors", r);
    EXPECT_GT(file_bytes(out + "/before/" + file).size(), size_t{3} << 20) << file;
    EXPECT_TRUE(file_bytes(out + "/before/" + file) == file_bytes(out + "/after/" + file))
        << "rank " << r << "'s state changed in a failed load";
  }
  // The file whole again: a new engine's load says how many bytes went in place, a second load none.
  std::ofstream(f1, std::ios::binary | std::ios::trunc).write(good.data(), static_cast<std::streamsize>(good.size()));
  run([&](zeal::Engine& e, torch::nn::Module&, std::function<void()>) {
        if (e.process_index() == 0) {  // rank 0's debug lines into a file
          const int fd = ::open((out + "/log").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
          ::dup2(fd, 2);
          ::close(fd);
        }
        e.load_state(ckpt);
        e.load_state(ckpt);
      },
      {{"ZEAL_LOG_LEVEL", "debug"}});
  // "<N> bytes in two passes (<M> of them put in place ...": M is exp_avg and exp_avg_sq, 8 of the 12
  // bytes per element (the master weights are the parameters, read again).
  const std::string log = file_bytes(out + "/log");
  const std::regex line(R"((\d+) bytes in two passes \((\d+) of them put in place)");
  std::vector<std::pair<int64_t, int64_t>> loads;
  for (auto it = std::sregex_iterator(log.begin(), log.end(), line); it != std::sregex_iterator(); ++it) {
    loads.push_back({std::stoll((*it)[1]), std::stoll((*it)[2])});
  }
  ASSERT_EQ(loads.size(), 2u) << log;
  EXPECT_GT(loads[0].first, 768 * 768 / 2 * 12 - 4096) << log;
  EXPECT_EQ(loads[0].second * 3, loads[0].first * 2) << "a new engine: its exp_avg and exp_avg_sq in place\n" << log;
  EXPECT_EQ(loads[1].second, 0) << "a loaded state is read twice\n" << log;
  fs::remove_all(ckpt);
  fs::remove_all(out);
}

// The second pass reads through mappings of the page cache's pages; where the cache no longer holds
// the files (evicted between the passes here, as memory pressure would), it reads them again with
// the reader's threads instead. Both give the same state, byte for byte as save_state writes it, and
// the debug log says which way the load went. The checkpoint holds two steps; the engines loading it
// took one (so every byte is read twice, and a load that left the state alone would show).
TEST(CheckpointLoad, ASecondPassWithoutThePageCacheReadsTheFilesAgain) {
  const std::string ckpt = temp_dir("ckpt_evict"), out = temp_dir("ckpt_evict_out");
  const RunSpec s = spec(1, 2);
  const auto run = [&](int steps, const std::function<void(zeal::Engine&)>& body,
                       const std::map<std::string, std::string>& env) {
    run_linear(
        s,
        [&](zeal::Engine& e, torch::nn::Module&, std::function<void()> step) {
          for (int k = 0; k < steps; ++k) step();
          body(e);
        },
        env);
  };
  run(2, [&](zeal::Engine& e) { e.save_state(ckpt); }, {});
  const auto load_and_save = [&](const std::string& tag, const std::string& fault) {
    std::map<std::string, std::string> env{{"ZEAL_LOG_LEVEL", "debug"}};
    if (!fault.empty()) env["ZEAL_CHECKPOINT_FAULT"] = fault;
    run(1,
        [&](zeal::Engine& e) {
          e.save_state(out + "/" + tag + "_before");
          if (e.process_index() == 0) {  // rank 0's debug lines into a file
            const int fd = ::open((out + "/log_" + tag).c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
            ::dup2(fd, 2);
            ::close(fd);
          }
          e.load_state(ckpt);
          e.save_state(out + "/" + tag);
        },
        env);
    return file_bytes(out + "/log_" + tag);
  };
  const std::string mapped = load_and_save("mapped", ""), evicted = load_and_save("evicted", "evict:all");
  const std::string fallback = "read again with the reader's threads";
  EXPECT_EQ(mapped.find(fallback), std::string::npos) << mapped;
  EXPECT_NE(evicted.find(fallback), std::string::npos) << evicted;
  for (int r = 0; r < s.world; ++r) {
    const std::string file = fmt::format("rank{}.safetensors", r);
    const std::string a = file_bytes(out + "/mapped/" + file), b = file_bytes(out + "/evicted/" + file);
    EXPECT_GT(a.size(), size_t{3} << 20) << file;
    EXPECT_TRUE(a == b) << file << ": the state read again differs from the state read through mappings";
    EXPECT_TRUE(a == file_bytes((fs::path(ckpt) / file).string())) << file << ": the loaded state is not the saved one";
    EXPECT_FALSE(file_bytes(out + "/evicted_before/" + file) == b) << file << ": the load had nothing to change";
  }
  fs::remove_all(ckpt);
  fs::remove_all(out);
}

// kill -9 in the middle of a save: while a rank writes its file, and on rank 0 after the new
// directory took its name but before `latest` moved. The previous checkpoint stays loadable; in the
// first case `latest` and the directory are as before, in the second `latest` still names the
// previous one.
TEST(CheckpointCrash, AKilledSaveLeavesThePreviousCheckpoint) {
  const fs::path root = temp_dir("ckpt_crash");
  RunSpec s = spec(2, 1);
  (void)run_phase({s, 0, 2, "", (root / "first").string()}, "crash_first");
  ASSERT_TRUE(fs::exists(root / "latest"));
  auto latest = [&] {
    std::ifstream f(root / "latest");
    std::string n;
    std::getline(f, n);
    return n;
  };
  EXPECT_EQ(latest(), "first");
  for (const std::string point : {"write:0", "latest"}) {
    ::setenv("ZEAL_CHECKPOINT_KILL", point.c_str(), 1);
    auto results = zeal::spawn(
        [&](zeal::Runtime& rt) {
          zeal::Engine engine(make_config(s), rt);
          zeal_test::Setup u = make_setup(s);
          auto [m, o] = engine.prepare(u.model, *u.opt);
          engine.save_state((root / "second").string());
        },
        1);
    ::unsetenv("ZEAL_CHECKPOINT_KILL");
    EXPECT_NE(zeal::describe_failures(results), "") << point << ": the save was not killed";
    EXPECT_EQ(latest(), "first") << point;
    EXPECT_EQ(fs::exists(root / "second" / "manifest.json"), point == "latest") << point;
    // The previous checkpoint loads.
    const auto [e, same] = load_error(root.string(), s);
    EXPECT_EQ(e, "accepted") << point;
    EXPECT_FALSE(same) << point << ": the load changed nothing";
    fs::remove_all(root / "second");
  }
  fs::remove_all(root);
}

// An asynchronous save holds the state as it was at the call while training goes on during its
// writes (with the whole state staged, and with a staging budget far smaller than the state, where
// the call waits for the writes to make room): resuming from it gives the bits of one uninterrupted
// run, and the run that saved is not disturbed either.
TEST(CheckpointAsync, AnAsyncSaveHoldsTheStateOfTheCallWhileTrainingGoesOn) {
  for (const int64_t staging : {int64_t{0}, int64_t{128} << 10}) {
    const std::string label = "async_" + std::to_string(staging);
    const std::string ckpt = temp_dir("ckpt_" + label);
    for (const RunSpec& s : {spec(3, 2), with_offload(spec(1, 2))}) {
      const auto whole = run_phase({s, 0, kSteps, "", ""}, label + "_whole");
      Phase saving{s, 0, kSteps, "", ckpt, kSteps / 2, {.async = true, .staging_bytes = staging}};
      const auto during = run_phase(saving, label + "_saving");
      ASSERT_TRUE(fs::exists(fs::path(ckpt) / "manifest.json")) << label;
      const auto resumed = run_phase({s, kSteps / 2, kSteps, ckpt, ""}, label + "_resumed");
      for (size_t r = 0; r < whole.size(); ++r) {
        EXPECT_TRUE(at::equal(whole[r], during[r])) << label << " rank " << r << ": the saving run was disturbed";
        EXPECT_TRUE(at::equal(whole[r], resumed[r]))
            << label << " stage " << s.stage << " rank " << r << ": largest difference "
            << (whole[r] - resumed[r]).abs().max().item<double>();
      }
      fs::remove_all(ckpt);
    }
  }
  // keep_staging: the save at step 1 leaves its staging chunks for the one at kSteps/2, which copies
  // into them (not zeroed, last filled by the earlier state); that one resumes to the same bits.
  for (const int64_t staging : {int64_t{0}, int64_t{128} << 10}) {
    const std::string label = "async_kept_" + std::to_string(staging);
    const std::string ckpt = temp_dir("ckpt_" + label);
    const RunSpec s = spec(3, 2);
    const auto whole = run_phase({s, 0, kSteps, "", ""}, label + "_whole");
    Phase saving{s, 0, kSteps, "", ckpt, kSteps / 2, {.async = true, .staging_bytes = staging, .keep_staging = true}};
    saving.save_also_at = 1;
    const auto during = run_phase(saving, label + "_saving");
    const auto resumed = run_phase({s, kSteps / 2, kSteps, ckpt, ""}, label + "_resumed");
    for (size_t r = 0; r < whole.size(); ++r) {
      EXPECT_TRUE(at::equal(whole[r], during[r])) << label << " rank " << r << ": the saving run was disturbed";
      EXPECT_TRUE(at::equal(whole[r], resumed[r])) << label << " rank " << r << ": largest difference "
                                                   << (whole[r] - resumed[r]).abs().max().item<double>();
    }
    fs::remove_all(ckpt);
    fs::remove_all(ckpt + ".earlier");
  }
}

// keep_staging: the memory an asynchronous save kept holds this rank's whole file (the budget allows
// it here) and is reused by the next such save (it neither grows nor shrinks), and released by a save without the option (asynchronous or not), by
// release_kept_staging and by a load, also while a kept save is still being written.
TEST(CheckpointAsync, KeptStagingIsReusedAndReleasedByASaveWithoutItARequestOrALoad) {
  const fs::path root = temp_dir("ckpt_kept_staging");
  const RunSpec s = spec(3, 2);
  auto results = zeal::spawn(
      [&](zeal::Runtime& rt) {
        zeal::Engine engine(make_config(s), rt);
        // Wide enough that the staging (a few MB per rank) stands well above the resident set's noise.
        zeal_test::Setup u = make_setup(s, [] {
          TinyGptOptions mo = model_options();
          mo.dim = 128;
          mo.hidden = 512;
          return TinyGpt(mo);
        });
        auto [m, o] = engine.prepare(u.model, *u.opt);
        const std::string dir = (root / "ckpt").string();
        auto held_after = [&](const zeal::SaveStateOptions& opt) {
          engine.save_state(dir, opt);
          engine.wait_for_save();
          return engine.kept_staging_bytes();
        };
        auto check = [&](bool ok, const std::string& what) {
          if (!ok) throw zeal::Error(fmt::format("rank {}: {}", engine.process_index(), what));
        };
        check(engine.kept_staging_bytes() == 0, "staging held before any save");
        const int64_t first = held_after({.async = true, .keep_staging = true});
        const int64_t staged = static_cast<int64_t>(
            fs::file_size(fs::path(dir) / fmt::format("rank{}.safetensors", engine.process_index())));
        check(first >= staged, fmt::format("the kept staging ({} bytes) does not hold this rank's file ({} bytes), "
                                           "whatever the disk's pace",
                                           first, staged));
        check(held_after({.async = true, .keep_staging = true}) == first, "the next kept save did not reuse it exactly");
        check(held_after({.async = true}) == 0, "an asynchronous save without keep_staging did not release it");
        check(held_after({.async = true, .keep_staging = true}) == first, "kept again");
        check(held_after({}) == 0, "a synchronous save did not release it");
        check(held_after({.async = true, .keep_staging = true}) == first, "kept once more");
        // The resident set (from /proc) drops by the bytes the staging held: this rank's file.
        const int64_t file = static_cast<int64_t>(
                          fs::file_size(fs::path(dir) / fmt::format("rank{}.safetensors", engine.process_index()))),
                      before = zeal::detail::resident_bytes();
        engine.release_kept_staging();
        check(engine.kept_staging_bytes() == 0, "release_kept_staging did not release it");
        const int64_t dropped = before - zeal::detail::resident_bytes();
        check(dropped >= file * 9 / 10, fmt::format("release_kept_staging: the resident set dropped by {} bytes, the file "
                                                    "staged is {}", dropped, file));
        check(held_after({.async = true, .keep_staging = true}) == first, "kept after the release");
        engine.load_state(dir);
        check(engine.kept_staging_bytes() == 0, "load_state did not release it");
        // Each release while a kept save is still being written: it waits for that save, whose
        // chunks come back to the pool then, and releases them too.
        engine.save_state(dir, {.async = true, .keep_staging = true});
        engine.release_kept_staging();
        check(engine.kept_staging_bytes() == 0, "release_kept_staging during a kept save kept its chunks");
        engine.save_state(dir, {.async = true, .keep_staging = true});
        engine.save_state(dir, {.async = true});
        engine.wait_for_save();
        check(engine.kept_staging_bytes() == 0, "a save without keep_staging during a kept save kept its chunks");
        engine.save_state(dir, {.async = true, .keep_staging = true});
        engine.load_state(dir);
        check(engine.kept_staging_bytes() == 0, "load_state during a kept save kept its chunks");
      },
      s.world);
  EXPECT_EQ(zeal::describe_failures(results), "");
  fs::remove_all(root);
}

// A write that fails on one rank (no space left) fails the save on every rank, naming that rank
// and the cause: at once for a synchronous save, at wait_for_save (or at the call, if it came
// while the state was still being copied) for an asynchronous one; `latest` still names the
// previous checkpoint, and nothing of the failed one is left.
TEST(CheckpointAsync, AFailedWriteIsReportedOnEveryRankAndKeepsThePreviousCheckpoint) {
  const fs::path root = temp_dir("ckpt_async_fail");
  RunSpec s = spec(2, 2);
  (void)run_phase({s, 0, 1, "", (root / "first").string()}, "async_fail_first");
  for (const bool async : {false, true}) {
    ::setenv("ZEAL_CHECKPOINT_FAULT", "enospc:1", 1);
    auto results = zeal::spawn(
        [&](zeal::Runtime& rt) {
          zeal::Engine engine(make_config(s), rt);
          zeal_test::Setup u = make_setup(s);
          auto [m, o] = engine.prepare(u.model, *u.opt);
          std::string said = "no error";
          try {
            engine.save_state((root / "second").string(), {.async = async});
            engine.wait_for_save();
          } catch (const zeal::Error& e) {
            said = e.what();
          }
          std::ofstream(root / ("said_" + std::to_string(engine.process_index()))) << said;
        },
        s.world);
    ::unsetenv("ZEAL_CHECKPOINT_FAULT");
    EXPECT_EQ(zeal::describe_failures(results), "");
    for (int r = 0; r < s.world; ++r) {
      std::ifstream f(root / ("said_" + std::to_string(r)));
      const std::string said((std::istreambuf_iterator<char>(f)), {});
      EXPECT_NE(said.find("rank 1"), std::string::npos) << "async " << async << ", rank " << r << ": " << said;
      EXPECT_NE(said.find(std::strerror(ENOSPC)), std::string::npos) << "async " << async << ", rank " << r << ": " << said;
      EXPECT_NE(said.find("was not saved"), std::string::npos) << said;
    }
    std::ifstream f(root / "latest");
    std::string n;
    std::getline(f, n);
    EXPECT_EQ(n, "first") << "async " << async;
    EXPECT_FALSE(fs::exists(root / "second")) << "async " << async;
    EXPECT_FALSE(fs::exists(root / ".second.partial")) << "async " << async;
  }
  fs::remove_all(root);
}

TEST(CheckpointNames, AutomaticNamesKeepTotalLimit) {
  const fs::path root = temp_dir("ckpt_auto");
  RunSpec s = spec(1, 2);
  const fs::path cwd = fs::current_path();
  fs::current_path(root);
  auto results = zeal::spawn(
      [&](zeal::Runtime& rt) {
        zeal::Engine engine(make_config(s), rt);
        zeal_test::Setup u = make_setup(s);
        auto [m, o] = engine.prepare(u.model, *u.opt);
        for (int k = 0; k < 3; ++k) engine.save_state("", {.include_frozen = true, .total_limit = 2});
      },
      s.world);
  fs::current_path(cwd);
  EXPECT_EQ(zeal::describe_failures(results), "");
  EXPECT_FALSE(fs::exists(root / "checkpoints" / "checkpoint_0"));
  EXPECT_TRUE(fs::exists(root / "checkpoints" / "checkpoint_1" / "manifest.json"));
  EXPECT_TRUE(fs::exists(root / "checkpoints" / "checkpoint_2" / "manifest.json"));
  std::ifstream f(root / "checkpoints" / "latest");
  std::string n;
  std::getline(f, n);
  EXPECT_EQ(n, "checkpoint_2");
  fs::remove_all(root);
}

// The exported model: engine.save_model (fp32) and `zeal consolidate` (bf16 and fp16, in shards of
// 8 KB with an index) read back by zeal::load_checkpoint_in_model into a fresh model, or into the
// prepared stage-3 model (each rank its shards), equal the parameters the ranks gathered exactly
// (16-bit: as LibTorch rounds them).
// Bytes this process read through read/pread (the kernel's rchar).
int64_t read_bytes_of_process() {
  std::ifstream f("/proc/self/io");
  std::string key;
  int64_t v = 0;
  while (f >> key >> v)
    if (key == "rchar:") return v;
  return -1;
}

TEST(CheckpointExport, ExportedWeightsEqualTheGatheredParameters) {
  const std::string ckpt = temp_dir("ckpt_export"), model_dir = temp_dir("ckpt_export_model"),
                    out = temp_dir("ckpt_export_out");
  RunSpec s = frozen(spec(3, 2));
  auto results = zeal::spawn(
      [&](zeal::Runtime& rt) {
        zeal::Engine engine(make_config(s), rt);
        zeal_test::Setup u = make_setup(s);
        auto [m, o] = engine.prepare(u.model, *u.opt);
        at::Tensor tokens = make_tokens(8);
        for (int step = 0; step < 2; ++step) {
          engine.backward(lm_loss(m, tokens.narrow(0, 2 * engine.process_index(), 2)));
          o.step();
          o.zero_grad();
        }
        engine.save_state(ckpt);
        const auto files = engine.save_model(model_dir);
        if (engine.is_main_process() && files.size() != 1) throw zeal::Error("save_model wrote several files");
        {
          auto g = engine.gathered();
          if (engine.is_main_process()) write_tensor(out + "/gathered", flat_params(*m));
        }
        // Into the prepared model after another step: the master weights take the values too (a
        // second export from them is the same file).
        engine.backward(lm_loss(m, tokens.narrow(0, 2 * engine.process_index(), 2)));
        o.step();
        o.zero_grad();
        zeal::load_checkpoint_in_model(*m, model_dir);
        {
          auto g = engine.gathered();
          if (engine.is_main_process()) write_tensor(out + "/reloaded", flat_params(*m));
        }
        engine.save_model(out + "/again");
      },
      s.world);
  ASSERT_EQ(zeal::describe_failures(results), "");
  const at::Tensor gathered = read_tensor(out + "/gathered");
  EXPECT_TRUE(at::equal(read_tensor(out + "/reloaded"), gathered)) << "loaded into the prepared model";
  EXPECT_EQ(file_bytes(model_dir + "/model.safetensors"), file_bytes(out + "/again/model.safetensors"))
      << "the master weights did not take the loaded values";
  auto fresh = [&] {
    TinyGptOptions mo = model_options();
    mo.layers = s.layers;
    zeal_test::seed(12345);  // other values than the trained ones
    return TinyGpt(mo);
  };
  {
    TinyGpt model = fresh();
    EXPECT_GT(zeal::load_checkpoint_in_model(*model, model_dir), 0);
    EXPECT_TRUE(at::equal(flat_params(*model), gathered)) << "save_model's fp32 weights";
    EXPECT_FALSE(fs::exists(fs::path(model_dir) / ".state")) << "the checkpoint behind save_model was left";
  }
  for (const std::string dtype : {"bf16", "fp16"}) {
    const std::string dst = out + "/" + dtype;
    const std::string cmd = std::string(ZEAL_CLI) + " consolidate " + ckpt + " " + dst + " --dtype " + dtype +
                            " --max_shard_size 8KB > " + out + "/log 2>&1";
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    ASSERT_TRUE(fs::exists(fs::path(dst) / "model.safetensors.index.json")) << "8 KB shards: several files";
    TinyGpt model = fresh();
    zeal::load_checkpoint_in_model(*model, dst);
    const at::ScalarType t = dtype == "bf16" ? at::kBFloat16 : at::kHalf;
    EXPECT_TRUE(at::equal(flat_params(*model), gathered.to(t).to(at::kFloat))) << dtype;
  }
  // A model the weights do not fit is named before anything changes.
  {
    TinyGptOptions mo = model_options();
    mo.layers = s.layers + 1;
    TinyGpt model(mo);
    const at::Tensor before = flat_params(*model);
    try {
      zeal::load_checkpoint_in_model(*model, model_dir);
      ADD_FAILURE() << "a missing tensor was accepted";
    } catch (const zeal::Error& e) {
      EXPECT_NE(std::string(e.what()).find("has no tensor 'block" + std::to_string(s.layers)), std::string::npos)
          << e.what();
    }
    EXPECT_TRUE(at::equal(before, flat_params(*model)));
  }
  fs::remove_all(ckpt);
  fs::remove_all(model_dir);
  fs::remove_all(out);
}

// `zeal consolidate` streams parameter by parameter: its peak resident set (the kernel's count for
// the process, from wait4) stays below the model's size — here 8 layers of 4096 x 4096 (537 MB in
// fp32), saved by one rank.
// Stage 3 over 2 ranks: load_checkpoint_in_model into the prepared model reads about half the
// file on each rank (the kernel's count of bytes the process read), not the whole of it.
TEST(CheckpointExport, EachRankReadsOnlyItsShardsIntoAPreparedModel) {
  const std::string model_dir = temp_dir("ckpt_shard_read"), out = temp_dir("ckpt_shard_read_out");
  struct Net : torch::nn::Module {
    std::vector<zeal::Sharded<torch::nn::Linear>> blocks;
    Net() {
      for (int b = 0; b < 4; ++b) {
        blocks.push_back(register_module("block" + std::to_string(b),
                                         zeal::Sharded<torch::nn::Linear>(torch::nn::LinearOptions(256, 256))));
      }
    }
    at::Tensor forward(at::Tensor x) {
      for (auto& b : blocks) x = torch::tanh(b->forward(x));
      return x;
    }
  };
  auto results = zeal::spawn(
      [&](zeal::Runtime& rt) {
        zeal::Config c = zeal_test::test_config();
        c.zero.stage = 3;
        c.zero.stage3_param_persistence_threshold = {0, false};
        zeal::Engine engine(c, rt);
        auto model = std::make_shared<Net>();
        torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
        auto [m, o] = engine.prepare(model, opt);
        engine.save_model(model_dir);
        {
          auto g = engine.gathered();
          if (engine.is_main_process()) write_tensor(out + "/saved", flat_params(*m));
        }
        engine.backward(m->forward(at::ones({2, 256})).sum());
        o.step();
        const int64_t before = read_bytes_of_process();
        const int64_t tensors = zeal::load_checkpoint_in_model(*m, model_dir);
        const int64_t read = read_bytes_of_process() - before;
        if (tensors != static_cast<int64_t>(model->named_parameters().size())) {
          throw zeal::Error("load_checkpoint_in_model counted " + std::to_string(tensors) + " tensors");
        }
        std::ofstream(out + "/read_" + std::to_string(engine.process_index())) << read;
        auto g = engine.gathered();
        if (engine.is_main_process()) write_tensor(out + "/reloaded", flat_params(*m));
      },
      2);
  ASSERT_EQ(zeal::describe_failures(results), "");
  EXPECT_TRUE(at::equal(read_tensor(out + "/saved"), read_tensor(out + "/reloaded")));
  const auto file = static_cast<double>(fs::file_size(fs::path(model_dir) / "model.safetensors"));
  for (int r = 0; r < 2; ++r) {
    std::ifstream f(out + "/read_" + std::to_string(r));
    int64_t read = 0;
    f >> read;
    std::printf("metric load_checkpoint_in_model rank %d read %lld bytes of a %.0f-byte file\n", r,
                static_cast<long long>(read), file);
    EXPECT_LT(read, 0.6 * file) << "rank " << r << " read more than its shards";
    EXPECT_GT(read, 0.4 * file) << "rank " << r;
  }
  fs::remove_all(model_dir);
  fs::remove_all(out);
}

TEST(CheckpointExport, ConsolidationHoldsLessThanTheModel) {
  const std::string ckpt = temp_dir("ckpt_big"), dst = temp_dir("ckpt_big_out");
  int64_t model_bytes = 0;
  auto results = zeal::spawn(
      [&](zeal::Runtime& rt) {
        RunSpec s = spec(0, 1);
        zeal::Engine engine(make_config(s), rt);
        auto seq = torch::nn::Sequential();
        for (int i = 0; i < 8; ++i) seq->push_back(torch::nn::Linear(torch::nn::LinearOptions(4096, 4096).bias(false)));
        torch::optim::AdamW opt(seq->parameters(), torch::optim::AdamWOptions(1e-3));
        auto [m, o] = engine.prepare(seq, opt);
        engine.save_state(ckpt);
      },
      1);
  ASSERT_EQ(zeal::describe_failures(results), "");
  model_bytes = 8LL * 4096 * 4096 * 4;
  // The CLI's peak resident set: consolidating, and (the libraries it loads alone, which with
  // LibTorch's CUDA half are a few hundred MB) printing its version.
  const auto peak_of = [](std::vector<std::string> args) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      const int null = ::open("/dev/null", O_WRONLY);
      ::dup2(null, 1);
      std::vector<char*> argv{const_cast<char*>(ZEAL_CLI)};
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv(ZEAL_CLI, argv.data());
      ::_exit(127);
    }
    int status = 0;
    struct rusage ru {};
    EXPECT_EQ(::wait4(pid, &status, 0, &ru), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << args[0];
    return static_cast<double>(ru.ru_maxrss) * 1024;
  };
  const double peak = peak_of({"consolidate", ckpt, dst}), idle = peak_of({"--version"});
  std::printf("metric consolidate peak_rss %.0f MB (the CLI alone %.0f MB), model %.0f MB, ratio %.3f\n", peak / 1e6,
              idle / 1e6, model_bytes / 1e6, (peak - idle) / model_bytes);
  EXPECT_LT(peak - idle, 0.6 * model_bytes);
  // Converted to bf16 and every weight transposed: still one parameter (64 MiB) and the buffers,
  // never a converted or transposed copy of it beside it.
  const std::string names = ckpt + "/names.json", dst16 = dst + "16";
  {
    nlohmann::json j;
    for (int i = 0; i < 8; ++i) j[fmt::format("{}.weight", i)] = {{"name", fmt::format("t{}", i)}, {"transpose", true}};
    std::ofstream(names) << j.dump();
  }
  const double peak16 = peak_of({"consolidate", ckpt, dst16, "--dtype", "bf16", "--names", names});
  const double param = 4096.0 * 4096 * 4;
  std::printf("metric consolidate bf16 transposed peak_rss %.0f MB (the CLI alone %.0f MB), largest parameter %.0f MB\n",
              peak16 / 1e6, idle / 1e6, param / 1e6);
  EXPECT_LT(peak16 - idle, param + 64.0 * (1 << 20));
  fs::remove_all(dst16);
  EXPECT_EQ(static_cast<int64_t>(fs::file_size(fs::path(dst) / "model.safetensors")),
            model_bytes + static_cast<int64_t>(ckpt::read_safetensors_header((fs::path(dst) / "model.safetensors").string()).data_begin));
  fs::remove_all(ckpt);
  fs::remove_all(dst);
}

// An export converted (bf16) and transposed by name, of a weight larger than the 1 Mi elements the
// conversion goes by and not square: the fp32 master, transposed, rounded to nearest even, byte for
// byte (LibTorch's own transpose and cast as the reference).
TEST(CheckpointExport, ATransposedConvertedExportIsTheMasterTransposedAndRounded) {
  const std::string ckpt = temp_dir("ckpt_tconv"), out = temp_dir("ckpt_tconv_out");
  auto results = zeal::spawn(
      [&](zeal::Runtime& rt) {
        zeal::Engine engine(make_config(spec(0, 1)), rt);
        torch::manual_seed(9);
        torch::nn::Linear lin(torch::nn::LinearOptions(1000, 1100).bias(false));  // [1100, 1000]
        torch::optim::AdamW opt(lin->parameters(), torch::optim::AdamWOptions(1e-3));
        auto [m, o] = engine.prepare(lin, opt);
        engine.backward(m->forward(at::ones({2, 1000})).pow(2).mean());
        o.step();
        o.zero_grad();
        engine.save_state(ckpt);
      },
      1);
  ASSERT_EQ(zeal::describe_failures(results), "");
  ckpt::consolidate(ckpt, out + "/plain", {});
  ckpt::ConsolidateOptions o;
  o.dtype = "bf16";
  o.rename = {{"weight", {"weight_t", true}}};
  ckpt::consolidate(ckpt, out + "/t", o);
  auto tensor_of = [](const std::string& file, const std::string& name, at::ScalarType type) {
    const auto h = ckpt::read_safetensors_header(file);
    const auto& e = h.tensors.at(name);
    const std::string bytes = file_bytes(file).substr(static_cast<size_t>(e.offset), static_cast<size_t>(e.bytes));
    return at::from_blob(const_cast<char*>(bytes.data()), e.shape, at::TensorOptions().dtype(type)).clone();
  };
  const at::Tensor w = tensor_of(out + "/plain/model.safetensors", "weight", at::kFloat);
  const at::Tensor t = tensor_of(out + "/t/model.safetensors", "weight_t", at::kBFloat16);
  ASSERT_EQ(w.sizes(), (std::vector<int64_t>{1100, 1000}));
  ASSERT_EQ(t.sizes(), (std::vector<int64_t>{1000, 1100}));
  EXPECT_TRUE(at::equal(t, w.t().contiguous().to(at::kBFloat16)));
  fs::remove_all(ckpt);
  fs::remove_all(out);
}

// Python's safetensors (the peers' environment, or any python3 that has it) opens every rank's
// file and finds each piece the manifest names, with its dtype, shape and bytes.
TEST(CheckpointFormat, PythonSafetensorsReadsTheFiles) {
  std::string python = "python3";
  const char* home = std::getenv("HOME");
  if (std::getenv("ZEAL_PEERS_PYTHON")) {
    python = std::getenv("ZEAL_PEERS_PYTHON");
  } else if (home && fs::exists(fs::path(home) / ".cache/zeal/peers/bin/python")) {
    python = (fs::path(home) / ".cache/zeal/peers/bin/python").string();  // scripts/peers' default
  }
  if (std::system((python + " -c 'import safetensors, torch' 2>/dev/null").c_str()) != 0) {
    const char* required = std::getenv("ZEAL_REQUIRE_PEERS");
    if (required && std::string(required) == "1") {
      FAIL() << python << " has no safetensors and torch, and ZEAL_REQUIRE_PEERS=1 (CI) needs this cross-check to run";
    }
    GTEST_SKIP() << python << " has no safetensors and torch (scripts/peers installs them; ZEAL_PEERS_PYTHON names it)";
  }
  const std::string ckpt = saved_checkpoint("ckpt_python", frozen(spec(3, 2, "bf16")));
  const std::string script = ckpt + "/check.py";
  std::ofstream(script) << R"(import json, sys, torch
from safetensors.torch import load_file
d = sys.argv[1]
m = json.load(open(d + "/manifest.json"))
files = {f: load_file(d + "/" + f) for f in m["files"]}
names = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
n = 0
for p in m["pieces"]:
    t = files[p["file"]]["%s/%s/%d" % (p["kind"], p["name"], p["begin"])]
    assert tuple(t.shape) == (p["count"],), (p, t.shape)
    assert t.dtype == names[p["dtype"]], (p, t.dtype)
    n += 1
assert n == sum(len([k for k in f if not k.startswith("rng/")]) for f in files.values())
for f in files.values():
    assert f["rng/cpu"].dtype == torch.uint8
print("pieces", n)
)";
  const int rc = std::system((python + " " + script + " " + ckpt).c_str());
  EXPECT_EQ(rc, 0);
  fs::remove_all(ckpt);
}

}  // namespace
}  // namespace zeal_test
