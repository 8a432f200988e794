// The `zeal` program, run as a user runs it: exit codes, messages and written files.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/config/config.h"
#include "tests/cli/run_zeal.h"

namespace fs = std::filesystem;

namespace {

class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("zeal_cli_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  void write(const std::string& name, const std::string& text) const { std::ofstream(dir_ / name) << text; }
  fs::path dir_;
};

}  // namespace

TEST_F(CliTest, EveryCommandHasHelp) {
  for (const char* cmd : {"--help", "config --help", "config validate --help", "config show --help",
                          "config keys --help", "env --help", "offload tune --help"}) {
    Result r = run_zeal(cmd);
    EXPECT_EQ(r.status, 0) << cmd << "\n" << r.output;
    EXPECT_NE(r.output.find("Usage"), std::string::npos) << cmd << "\n" << r.output;
  }
  Result top = run_zeal("--help");
  EXPECT_NE(top.output.find("config"), std::string::npos);
  EXPECT_NE(top.output.find("env"), std::string::npos);
}

TEST_F(CliTest, UnknownCommandExitsTwo) {
  Result r = run_zeal("frobnicate");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("--help"), std::string::npos) << r.output;
}

TEST_F(CliTest, ValidateAcceptsShippedConfigs) {
  Result r = run_zeal("config validate configs/ds_zero3_cpu.yaml");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("valid: DEEPSPEED, ZeRO stage 3"), std::string::npos) << r.output;
}

TEST_F(CliTest, ValidateRejectsWithKeyLocationAndExitTwo) {
  write("bad.yaml", "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 2\n  offload_param_device: cpu\n"
                    "num_proceses: 2\n");
  Result r = run_zeal("config validate " + path("bad.yaml"));
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find(path("bad.yaml") + ":5:1: num_proceses: unknown key; did you mean num_processes?"),
            std::string::npos) << r.output;
}

TEST_F(CliTest, ValidateReportsContradictionsWithExitTwo) {
  write("bad.yaml", "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 2\n  offload_param_device: cpu\n");
  Result r = run_zeal("config validate " + path("bad.yaml"));
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("parameter offload needs ZeRO stage 3, but stage is 2"), std::string::npos) << r.output;
}

TEST_F(CliTest, ValidateOfMissingFileExitsTwo) {
  Result r = run_zeal("config validate " + path("missing.yaml"));
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.output.find("no such config file"), std::string::npos) << r.output;
}

TEST_F(CliTest, ShowOutputLoadsBackToTheSameConfig) {
  Result r = run_zeal("config show configs/zero2_offload.yaml --zero_stage 3 --gradient_accumulation_steps 4");
  ASSERT_EQ(r.status, 0) << r.output;
  write("shown.yaml", r.output);
  zeal::Config expected = zeal::Config::load("configs/zero2_offload.yaml", false);
  expected.set("zero_stage", "3", {zeal::Origin::Kind::kFlag, "--zero_stage"});
  expected.set("gradient_accumulation_steps", "4", {zeal::Origin::Kind::kFlag, "--gradient_accumulation_steps"});
  zeal::Config back = zeal::Config::load(path("shown.yaml"), false);
  EXPECT_TRUE(back == expected) << r.output;
  EXPECT_EQ(back.zero.stage, 3);
  EXPECT_NE(r.output.find("stage: 3  # flag --zero_stage"), std::string::npos) << r.output;
}

TEST_F(CliTest, FlagsBeatEnvironmentWhichBeatsTheFile) {
  Result env = run_zeal("config show configs/zero2.yaml", "ZEAL_ZERO_STAGE=1");
  ASSERT_EQ(env.status, 0) << env.output;
  EXPECT_NE(env.output.find("stage: 1  # environment ZEAL_ZERO_STAGE"), std::string::npos) << env.output;
  Result flag = run_zeal("config show configs/zero2.yaml --zero_stage 3", "ZEAL_ZERO_STAGE=1");
  EXPECT_NE(flag.output.find("stage: 3  # flag --zero_stage"), std::string::npos) << flag.output;
  Result bad = run_zeal("config show configs/zero2.yaml", "ZEAL_ZERO_STAGE=7");
  EXPECT_EQ(bad.status, 2);
  EXPECT_NE(bad.output.find("environment ZEAL_ZERO_STAGE"), std::string::npos) << bad.output;
}

TEST_F(CliTest, ConfigWithFlagsWritesAValidAccelerateFile) {
  Result r = run_zeal("config --config_file " + path("c.yaml") +
                   " --distributed_type MULTI_CPU --num_processes 4 --zero_stage 3 --offload_optimizer_device cpu"
                   " --offload_param_device cpu --mixed_precision bf16 --gradient_accumulation_steps 2",
               "</dev/null");
  ASSERT_EQ(r.status, 0) << r.output;
  zeal::Config c = zeal::Config::load(path("c.yaml"), false);
  EXPECT_EQ(c.launch.distributed_type, "DEEPSPEED");
  EXPECT_EQ(c.launch.num_processes, 4);
  EXPECT_EQ(c.zero.stage, 3);
  EXPECT_EQ(c.zero.offload_optimizer.device, zeal::OffloadDevice::kCpu);
  EXPECT_EQ(c.zero.offload_param.device, zeal::OffloadDevice::kCpu);
  EXPECT_TRUE(c.zero.zero3_init_flag) << "the questionnaire's default";
  EXPECT_EQ(c.mixed_precision, "bf16");
  EXPECT_EQ(c.gradient_accumulation_steps.value, 2);
  std::ifstream in(path("c.yaml"));
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_NE(text.str().find("deepspeed_config:\n"), std::string::npos) << "Accelerate's format";
  EXPECT_NE(text.str().find("  zero_stage: 3\n"), std::string::npos) << text.str();
}

TEST_F(CliTest, QuestionnaireAnswersBecomeTheConfig) {
  // machine type, machines, processes, stage, optimizer offload, param offload, init flag (default),
  // 16-bit save (default), precision, accumulation, clipping
  write("answers", "MULTI_CPU\n1\n4\n7\n3\ncpu\nnone\n\n\nfp16\n2\n0.5\n");
  Result r = run_zeal("config --interactive --config_file " + path("q.yaml"), "<" + path("answers"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("Please answer one of 0/1/2/3"), std::string::npos) << "a wrong answer is asked again";
  zeal::Config c = zeal::Config::load(path("q.yaml"), false);
  EXPECT_EQ(c.launch.num_processes, 4);
  EXPECT_EQ(c.zero.stage, 3);
  EXPECT_EQ(c.zero.offload_optimizer.device, zeal::OffloadDevice::kCpu);
  EXPECT_EQ(c.zero.offload_param.device, zeal::OffloadDevice::kNone);
  EXPECT_TRUE(c.zero.zero3_init_flag);
  EXPECT_FALSE(c.zero.stage3_gather_16bit_weights_on_model_save);
  EXPECT_EQ(c.mixed_precision, "fp16");
  EXPECT_EQ(c.gradient_accumulation_steps.value, 2);
  EXPECT_DOUBLE_EQ(c.gradient_clipping.value, 0.5);
}

TEST_F(CliTest, ContradictoryAnswersWriteNothingAndExitTwo) {
  Result r = run_zeal("config --config_file " + path("c.yaml") +
                   " --distributed_type MULTI_CPU --zero_stage 0 --offload_optimizer_device cpu",
               "</dev/null");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("optimizer offload needs ZeRO stage 1, 2 or 3"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(path("c.yaml")));
}

// A config file that cannot be written (the name of a folder, a folder that cannot be made): exit 2
// naming the path, and nothing left behind.
TEST_F(CliTest, UnwritableConfigFileLeavesNothingBehind) {
  fs::create_directories(path("folder"));
  Result r = run_zeal("config --config_file " + path("folder") + " --distributed_type NO", "</dev/null");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find(path("folder") + ": is a directory"), std::string::npos) << r.output;
  write("file", "x");
  Result under_file = run_zeal("config --config_file " + path("file/c.yaml") + " --distributed_type NO", "</dev/null");
  EXPECT_EQ(under_file.status, 2) << under_file.output;
  EXPECT_NE(under_file.output.find(path("file/c.yaml")), std::string::npos) << under_file.output;
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(dir_)) left.push_back(e.path().filename().string());
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{"file", "folder"}));
  EXPECT_TRUE(fs::is_empty(path("folder")));
}

TEST_F(CliTest, DefaultConfigGoesToZealHome) {
  Result r = run_zeal("config --num_processes 2 --zero_stage 2", "ZEAL_HOME=" + path("home") + " </dev/null");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(fs::exists(path("home/default_config.yaml"))) << r.output;
  Result show = run_zeal("config show", "ZEAL_HOME=" + path("home"));
  EXPECT_NE(show.output.find("stage: 2  # file " + path("home/default_config.yaml")), std::string::npos)
      << show.output;
}

TEST_F(CliTest, KeysListsEveryKey) {
  Result r = run_zeal("config keys --markdown");
  ASSERT_EQ(r.status, 0);
  for (const auto& k : zeal::config_keys()) EXPECT_NE(r.output.find("`" + k.key + "`"), std::string::npos) << k.key;
}

TEST_F(CliTest, EnvReportsVersionsAndHardware) {
  Result r = run_zeal("env");
  ASSERT_EQ(r.status, 0) << r.output;
  for (const char* item : {"zeal:", "LibTorch:", "2.11", "CUDA driver:", "GPUs:", "NCCL:", "liburing:",
                           "io_uring usable:", "hwloc:", "CPU SIMD:", "cores:", "NUMA nodes:", "zeal CPU kernels:",
                           "LibTorch CPU kernels:"})
    EXPECT_NE(r.output.find(item), std::string::npos) << item << "\n" << r.output;
  // The kernels' path: the widest by default, ZEAL_CPU_ISA's when set, a bad value described.
  EXPECT_NE(r.output.find("ZEAL_CPU_ISA unset"), std::string::npos) << r.output;
  Result scalar = run_zeal("env", "ZEAL_CPU_ISA=scalar");
  EXPECT_NE(scalar.output.find("scalar (ZEAL_CPU_ISA;"), std::string::npos)
      << scalar.output;
  Result bad = run_zeal("env", "ZEAL_CPU_ISA=sse9");
  EXPECT_NE(bad.output.find("invalid: ZEAL_CPU_ISA=sse9: expected scalar, avx2 or avx512"), std::string::npos)
      << bad.output;
}

// `zeal offload tune` measures the directory's disk over its grid and prints an aio section whose
// values come from the settings it measured; it leaves nothing behind; a bad path is named.
TEST_F(CliTest, OffloadTunePrintsTheAioSectionToPaste) {
  Result r = run_zeal("offload tune --nvme_path " + dir_.string() + " --mib 8 --seconds 30");
  ASSERT_EQ(r.status, 0) << r.output;
  const size_t aio = r.output.find("\naio:\n  block_size: ");
  ASSERT_NE(aio, std::string::npos) << r.output;
  const long long block = std::stoll(r.output.substr(aio + 20));
  const size_t qd_at = r.output.find("  queue_depth: ", aio);
  ASSERT_NE(qd_at, std::string::npos) << r.output;
  const int depth = std::stoi(r.output.substr(qd_at + 15));
  // The chosen pair is a measured row of the table.
  EXPECT_NE(r.output.find("\n" + std::to_string(block) + std::string(12 - std::to_string(block).size(), ' ') + " " +
                          std::to_string(depth)),
            std::string::npos)
      << r.output;
  EXPECT_EQ(block % 4096, 0);
  EXPECT_TRUE(fs::is_empty(dir_)) << "the tuner left files in " << dir_;
  Result bad = run_zeal("offload tune --nvme_path " + path("missing"));
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.output.find("nvme_path '" + path("missing") + "' is not a directory"), std::string::npos) << bad.output;
}

// estimate-memory's stage-3 persistence threshold: by default the engine's (1e5, also what it fills
// "auto" with), so the tiny preset's blocks (about 50 K elements each) stay gathered as they do in
// a run; a threshold of 0 shards them and the predicted peak falls.
TEST_F(CliTest, EstimatePersistenceThresholdIsTheEnginesByDefault) {
  auto peak = [&](const std::string& extra) {
    const std::string out = path("e" + std::to_string(extra.size()) + ".json");
    Result r = run_zeal("estimate-memory --model tiny --num_processes 2 --seq_len 32 --stages 3 --offload none --json " +
                        out + " " + extra);
    EXPECT_EQ(r.status, 0) << r.output;
    // The peak less the runtime, which the command measures in itself each time.
    const auto row = nlohmann::json::parse(std::ifstream(out)).at("zeal").at(0);
    const auto& parts = row.at("parts");
    const int64_t runtime = parts.contains("runtime") ? parts["runtime"].at("bytes").get<int64_t>() : 0;
    return row.at("host_peak_bytes").get<int64_t>() - runtime;
  };
  const int64_t by_default = peak(""), explicit_default = peak("--stage3_param_persistence_threshold 100000"),
                sharded = peak("--stage3_param_persistence_threshold 0");
  EXPECT_EQ(by_default, explicit_default);
  EXPECT_GT(by_default, sharded);
  Result bad = run_zeal("estimate-memory --model tiny --stage3_param_persistence_threshold -1");
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.output.find("--stage3_param_persistence_threshold"), std::string::npos) << bad.output;
}
