// Learning-rate schedules on two parameter groups (2e-4 and 1e-3), through the engine's get_lr():
// the config's DeepSpeed schedulers against DeepSpeed's own in Python (WarmupLR gives every group
// the configured rates, WarmupCosineLR scales each group's own), and a schedule the program prepares
// as PyTorch's and Hugging Face's schedulers apply one: a factor of each group's own rate.
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <cstdlib>
#include <filesystem>
#include <iterator>
#include <fstream>
#include <string>
#include <vector>

#include "engine/config/config.h"
#include "engine/engine.h"
#include "engine/optim/schedule.h"
#include "engine/runtime/spawn.h"
#include "tests/test_helpers.h"

namespace {

namespace fs = std::filesystem;
using zeal_test::peers_python;
constexpr int kSteps = 12;
const std::vector<double> kBase{2e-4, 1e-3};

// The model's two layers as two parameter groups, at kBase's rates.
std::vector<torch::optim::OptimizerParamGroup> two_groups(torch::nn::Sequential& model) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (size_t g = 0; g < 2; ++g) {
    groups.emplace_back(model[g]->parameters(), std::make_unique<torch::optim::AdamWOptions>(kBase[g]));
  }
  return groups;
}

// One rank trains kSteps steps of a two-layer model whose layers are the two groups, recording
// get_lr() before each step; `prepared` (if any) is given to engine.prepare.
std::vector<std::vector<double>> rates(const std::string& config_json,
                                       std::shared_ptr<zeal::optim::LrSchedule> prepared = nullptr) {
  const std::string out = (fs::temp_directory_path() / fmt::format("zeal_sched_{}", ::getpid())).string();
  auto results = zeal::spawn(
      [&](zeal::Runtime& rt) {
        zeal::Config c = zeal::Config::parse(config_json, "ds.json");
        c.launch.use_cpu = true;
        zeal::Engine engine(c, rt);
        auto model = torch::nn::Sequential(torch::nn::Linear(4, 4), torch::nn::Linear(4, 1));
        torch::optim::AdamW opt(two_groups(model));
        auto [m, po] = engine.prepare(model, opt);
        if (prepared) (void)engine.prepare(prepared);
        std::ofstream f(out);
        for (int t = 0; t < kSteps; ++t) {
          const auto lr = engine.get_lr();
          f << fmt::format("{:.17g} {:.17g}\n", lr.at(0), lr.at(1));
          engine.backward(m->forward(at::ones({2, 4})).sum());
          po.step();
          po.zero_grad();
        }
      },
      1);
  EXPECT_EQ(zeal::describe_failures(results), "");
  std::vector<std::vector<double>> r;
  std::ifstream f(out);
  double a, b;
  while (f >> a >> b) r.push_back({a, b});
  fs::remove(out);
  EXPECT_EQ(r.size(), static_cast<size_t>(kSteps));
  return r;
}

// DeepSpeed's scheduler `type` with `params` over the two groups gives zeal's rates.
void check_against_deepspeed(const std::string& type, const std::string& params) {
  const auto got = rates(fmt::format(R"({{"scheduler": {{"type": "{}", "params": {}}}}})", type, params));
  // Not one rate for all groups where the groups' own rates should show, and not constant.
  ASSERT_EQ(got.size(), static_cast<size_t>(kSteps));
  EXPECT_NE(got.front()[0], got.back()[0]);
  std::string zeal = "[";
  for (size_t t = 0; t < got.size(); ++t) zeal += fmt::format("{}[{:.17g}, {:.17g}]", t ? ", " : "", got[t][0], got[t][1]);
  zeal += "]";
  const std::string spec = (fs::temp_directory_path() / fmt::format("zeal_sched_{}.json", ::getpid())).string();
  std::ofstream(spec) << fmt::format(R"({{"type": "{}", "params": {}, "base_lrs": [{}, {}], "zeal": {}}})", type, params,
                                     kBase[0], kBase[1], zeal);
  const std::string python = peers_python();
  if (!fs::exists(python)) {
    const char* required = std::getenv("ZEAL_REQUIRE_PEERS");
    fs::remove(spec);
    if (required && std::string(required) == "1") FAIL() << "no peers Python at " << python << " (ZEAL_REQUIRE_PEERS=1)";
    GTEST_SKIP() << "no peers Python at " << python << " (scripts/peers installs it)";
  }
  const int rc = std::system(fmt::format("{} {}/tests/engine/schedule_groups_check.py {}", python, ZEAL_SOURCE_DIR, spec).c_str());
  fs::remove(spec);
  const int code = WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  if (code == 77) GTEST_SKIP() << python << " has no deepspeed (scripts/peers installs it)";
  EXPECT_EQ(code, 0) << type << ": zeal's rates differ from DeepSpeed's (see above)";
}

TEST(ScheduleGroups, WarmupLRGivesEveryGroupTheConfiguredRatesAsDeepSpeed) {
  check_against_deepspeed("WarmupLR",
                          R"({"warmup_min_lr": 1e-5, "warmup_max_lr": 5e-4, "warmup_num_steps": 6, "warmup_type": "linear"})");
}

// DeepSpeed's per-group form: a list of rates, one per parameter group (its _format_param).
TEST(ScheduleGroups, WarmupLRAndWarmupDecayLRWithAListPerGroupAsDeepSpeed) {
  check_against_deepspeed("WarmupLR", R"({"warmup_min_lr": [1e-5, 0.0], "warmup_max_lr": [5e-4, 2e-3],
                                           "warmup_num_steps": 6, "warmup_type": "linear"})");
  check_against_deepspeed("WarmupDecayLR", R"({"warmup_min_lr": 1e-6, "warmup_max_lr": [3e-4, 1e-3],
                                                "warmup_num_steps": 4, "total_num_steps": 20, "warmup_type": "log"})");
}

// A list whose length is not the number of groups is refused at prepare, naming the key and both counts.
TEST(ScheduleGroups, AListOfAnotherLengthThanTheGroupsIsRefused) {
  const std::string out = (fs::temp_directory_path() / fmt::format("zeal_sched_err_{}", ::getpid())).string();
  auto results = zeal::spawn(
      [&](zeal::Runtime& rt) {
        zeal::Config c = zeal::Config::parse(
            R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": [1e-3, 2e-3, 3e-3]}}})", "ds.json");
        c.launch.use_cpu = true;
        zeal::Engine engine(c, rt);
        auto model = torch::nn::Sequential(torch::nn::Linear(4, 4), torch::nn::Linear(4, 1));
        torch::optim::AdamW opt(two_groups(model));
        try {
          (void)engine.prepare(model, opt);
          std::ofstream(out) << "accepted";
        } catch (const zeal::Error& e) {
          std::ofstream(out) << e.what();
        }
      },
      1);
  EXPECT_EQ(zeal::describe_failures(results), "");
  std::ifstream f(out);
  const std::string msg((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  fs::remove(out);
  EXPECT_NE(msg.find("scheduler.params.warmup_max_lr (from file ds.json:"), std::string::npos) << msg;
  EXPECT_NE(msg.find("expected 2 values (one per parameter group of the optimizer), got 3"), std::string::npos) << msg;
}

TEST(ScheduleGroups, WarmupCosineLRScalesEachGroupsOwnRateAsDeepSpeed) {
  check_against_deepspeed("WarmupCosineLR", R"({"total_num_steps": 10, "warmup_num_steps": 4, "warmup_min_ratio": 0.1,
                                                  "cos_min_ratio": 0.05, "warmup_type": "linear"})");
}

// PyTorch's LambdaLR and Hugging Face's schedules: each group's rate is its own base times the
// schedule's factor; a zeal schedule the program prepares gives group 0's rate, so the factor is
// that rate over group 0's base.
TEST(ScheduleGroups, APreparedScheduleIsAFactorOfEachGroupsOwnRate) {
  auto schedule = std::make_shared<zeal::optim::WarmupCosineLR>(kBase[0], 10, 0.1, 4, 0.05, zeal::optim::Warmup::kLinear);
  const auto got = rates("{}", schedule);
  for (int t = 0; t < static_cast<int>(got.size()); ++t) {
    const double factor = schedule->lr_at(t) / kBase[0];
    EXPECT_DOUBLE_EQ(got[t][0], kBase[0] * factor) << "step " << t;
    EXPECT_DOUBLE_EQ(got[t][1], kBase[1] * factor) << "step " << t;
  }
}

}  // namespace
