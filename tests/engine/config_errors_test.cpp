// Malformed configurations: each must raise ConfigError whose message names the key, the place
// and what is allowed (never a crash, never a silent default).
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "engine/config/config.h"
#include "engine/error.h"

namespace {

struct BadConfig {
  const char* name;
  const char* yaml;
  std::vector<std::string> expected;  // substrings the message must contain
};

const BadConfig kCases[] = {
    {"UnknownTopLevelKeySuggestsTheClosest", "num_proceses: 2\n",
     {"bad.yaml:1:1", "num_proceses", "unknown key", "did you mean num_processes?"}},
    {"UnknownNestedKeySuggestsTheClosest", "zero_optimization:\n  stag: 2\n",
     {"bad.yaml:2:3", "zero_optimization.stag", "did you mean zero_optimization.stage?"}},
    {"KeyUnderTheWrongSectionNamesItsHome", "stage: 2\n",
     {"bad.yaml:1:1", "did you mean zero_optimization.stage?", "belongs under zero_optimization"}},
    {"UnknownDeepSpeedInlineKey", "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stag: 2\n",
     {"bad.yaml:3:3", "deepspeed_config.zero_stag", "did you mean deepspeed_config.zero_stage?"}},
    {"UnknownFsdpKey", "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_stratgy: FULL_SHARD\n",
     {"bad.yaml:3:3", "fsdp_config.fsdp_sharding_stratgy", "did you mean fsdp_config.fsdp_sharding_strategy?"}},
    {"StageOutOfRange", "zero_optimization:\n  stage: 4\n",
     {"bad.yaml:2:10", "zero_optimization.stage", "an integer from 0 to 3", "\"4\""}},
    {"StageNotANumber", "zero_optimization:\n  stage: three\n", {"bad.yaml:2:10", "\"three\""}},
    {"InlineStageOutOfRangeNamesBothSpellings", "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 5\n",
     {"bad.yaml:3:15", "deepspeed_config.zero_stage (sets zero_optimization.stage)", "from 0 to 3"}},
    {"BoolNotABool", "use_cpu: maybe\n", {"bad.yaml:1:10", "use_cpu", "expected true or false", "\"maybe\""}},
    {"MixedPrecisionFp8IsNotSupported", "mixed_precision: fp8\n",
     {"mixed_precision", "expected one of no, fp16, bf16", "\"fp8\""}},
    {"OffloadDeviceUnknown", "zero_optimization:\n  stage: 2\n  offload_optimizer:\n    device: gpu\n",
     {"bad.yaml:4:13", "zero_optimization.offload_optimizer.device", "none, cpu, nvme"}},
    {"NegativeClipping", "gradient_clipping: -1\n", {"gradient_clipping", "a number ≥ 0", "\"-1\""}},
    // Keys zeal accepts without effect, refused where their value would change the math.
    {"PartialOptimizerOffloadIsRefused",
     "zero_optimization:\n  stage: 3\n  offload_optimizer:\n    device: cpu\n    ratio: 0.3\n",
     {"bad.yaml:5:12", "zero_optimization.offload_optimizer.ratio", "offloads all of it or none"}},
    {"QuantizedWeightsAreRefused", "zero_optimization:\n  stage: 3\n  zero_quantized_weights: true\n",
     {"bad.yaml:3:3", "zero_optimization.zero_quantized_weights", "does not quantize"}},
    {"QuantizedGradientsAreRefused", "zero_optimization:\n  stage: 3\n  zero_quantized_gradients: true\n",
     {"zero_optimization.zero_quantized_gradients", "does not quantize"}},
    {"Fp16AutoCastIsRefused", "fp16:\n  enabled: true\n  auto_cast: true\n", {"fp16.auto_cast", "engine.autocast()"}},
    {"ScheduleStartedElsewhereIsRefused",
     "scheduler:\n  type: WarmupLR\n  params:\n    last_batch_iteration: 100\n",
     {"scheduler.params.last_batch_iteration", "changes every learning rate"}},
    {"CompressionIsRefused", "compression_training:\n  weight_quantization:\n    shared_parameters: {}\n",
     {"compression_training", "does not quantize or prune"}},
    {"ElasticityEnabledIsRefused", "elasticity:\n  enabled: true\n", {"elasticity", "batch sizes"}},
    {"AmsgradIsRefused", "optimizer:\n  type: Adam\n  params:\n    amsgrad: true\n",
     {"optimizer.params.amsgrad", "AMSGrad"}},
    {"AdamWModeFalseContradictsAdamW", "optimizer:\n  type: AdamW\n  params:\n    adam_w_mode: false\n",
     {"optimizer.params.adam_w_mode", "contradicts optimizer.type AdamW"}},
    {"AdamKeysOnSgd", "optimizer:\n  type: SGD\n  params:\n    lr: 0.1\n    bias_correction: false\n",
     {"optimizer.params.bias_correction", "belongs to Adam"}},
    {"ZeroAccumulation", "gradient_accumulation_steps: 0\n", {"gradient_accumulation_steps", "an integer ≥ 1"}},
    {"PortOutOfRange", "main_process_port: 70000\n", {"main_process_port", "from 1 to 65535"}},
    {"BetasOfWrongLength", "optimizer:\n  type: Adam\n  params:\n    betas: [0.9]\n",
     {"bad.yaml:4:12", "optimizer.params.betas", "two numbers"}},
    {"EpsMustBePositive", "optimizer:\n  type: Adam\n  params:\n    eps: 0\n",
     {"optimizer.params.eps", "a number > 0"}},
    {"MappingWhereANumberBelongs", "num_processes:\n  a: 1\n", {"num_processes", "got a mapping"}},
    {"SectionGivenAsAScalar", "zero_optimization: 3\n", {"zero_optimization", "expected a mapping"}},
    {"YamlSyntaxErrorHasItsLine", "zero_optimization:\n  stage: [1, 2\nnum_processes: 2\n",
     {"bad.yaml:", "YAML syntax error"}},
    {"DuplicateKey", "num_processes: 2\nnum_processes: 4\n", {"bad.yaml:2:1", "num_processes", "appears twice"}},
    {"ParamOffloadBelowStage3", "zero_optimization:\n  stage: 2\n  offload_param:\n    device: cpu\n",
     {"zero_optimization.offload_param.device", "needs ZeRO stage 3", "stage is 2", "bad.yaml:4:13"}},
    {"OptimizerOffloadAtStage0", "zero_optimization:\n  offload_optimizer:\n    device: cpu\n",
     {"zero_optimization.offload_optimizer.device", "needs ZeRO stage 1, 2 or 3"}},
    {"OptimizerNvmeWithoutPath", "zero_optimization:\n  stage: 3\n  offload_optimizer:\n    device: nvme\n",
     {"zero_optimization.offload_optimizer.device", "needs zero_optimization.offload_optimizer.nvme_path"}},
    {"ParamNvmeWithoutPathInAccelerateFile",
     "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 3\n  offload_param_device: nvme\n",
     {"zero_optimization.offload_param.device", "deepspeed_config.offload_param_nvme_path", "bad.yaml:4:25"}},
    {"OptimizerNvmeBelowStage3", "zero_optimization:\n  stage: 2\n  offload_optimizer:\n    device: nvme\n    nvme_path: /x\n",
     {"nvme needs ZeRO stage 3"}},
    {"Fp16AndBf16BothOn", "fp16:\n  enabled: true\nbf16:\n  enabled: true\n", {"fp16.enabled and bf16.enabled are both true"}},
    {"AioBlockSizeNotAMultipleOf4096", "aio:\n  block_size: 1000\n",
     {"aio.block_size", "not a multiple of 4096", "bad.yaml:2:15"}},
    {"BatchSizeIdentityBroken",
     "num_processes: 2\ndistributed_type: MULTI_CPU\ntrain_batch_size: 30\ntrain_micro_batch_size_per_gpu: 4\n"
     "gradient_accumulation_steps: 2\n",
     {"train_batch_size 30 ≠ train_micro_batch_size_per_gpu 4 × gradient_accumulation_steps 2 × world size 2 = 16"}},
    {"BatchProductOverflows",
     "num_processes: 2\ndistributed_type: MULTI_CPU\ntrain_micro_batch_size_per_gpu: 4611686018427387904\n"
     "gradient_accumulation_steps: 4\n",
     {"train_micro_batch_size_per_gpu 4611686018427387904 × gradient_accumulation_steps 4 × world size 2",
      "does not fit in 64 bits"}},
    {"BatchProductOverflowsBesideAGivenTotal",
     "num_processes: 4\ndistributed_type: MULTI_CPU\ntrain_batch_size: 64\ntrain_micro_batch_size_per_gpu: "
     "3074457345618258603\ngradient_accumulation_steps: 3\n",
     {"does not fit in 64 bits"}},
    {"ExplicitZeroTrainBatchSizeIsAValue", "train_batch_size: 0\ntrain_micro_batch_size_per_gpu: 4\n",
     {"bad.yaml:1:19", "train_batch_size", "an integer ≥ 1", "\"0\""}},
    {"ExplicitZeroMicroBatchIsAValue", "train_micro_batch_size_per_gpu: 0\n",
     {"train_micro_batch_size_per_gpu", "an integer ≥ 1"}},
    {"SecondYamlDocumentIsNotIgnored", "zero_optimization:\n  stage: 2\n---\nzero_optimization:\n  stage: 3\n",
     {"bad.yaml:4:1", "a second YAML document", "would be ignored"}},
    {"UnknownKeyFarFromAnyDoesNotListTheTable", "qqqqqqqqqqqqqqqqqqqqqqq: 1\n",
     {"bad.yaml:1:1", "no key like it at the top level", "`zeal config keys`"}},
    {"KeysAreCaseSensitive", "zero_optimization:\n  Stage: 2\n  stage: 3\n",
     {"bad.yaml:2:3", "zero_optimization.Stage", "unknown key", "did you mean zero_optimization.stage?"}},
    {"MixedPrecisionDisagreesWithSection", "mixed_precision: fp16\nbf16:\n  enabled: true\n",
     {"mixed_precision is fp16", "bf16.enabled says bf16", "make them agree"}},
    {"MachineRankOutOfRange", "num_machines: 2\nmachine_rank: 2\nnum_processes: 2\ndistributed_type: MULTI_CPU\n",
     {"machine_rank", "out of range for num_machines 2"}},
    {"ProcessesNotDivisibleOverMachines", "num_machines: 2\nnum_processes: 3\ndistributed_type: MULTI_CPU\n",
     {"num_processes", "cannot be split evenly over 2 machines"}},
    {"NoDistributionWithSeveralProcesses", "distributed_type: 'NO'\nnum_processes: 4\n",
     {"distributed_type", "NO runs a single process"}},
    {"DeepSpeedFileWithInlineKeys",
     "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: ds.json\n  zero_stage: 2\n",
     {"deepspeed_config.zero_stage", "cannot be set inline together with deepspeed_config_file"}},
    {"DeepSpeedFileMissing", "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: /nonexistent/ds.json\n",
     {"deepspeed_config.deepspeed_config_file", "no such file: /nonexistent/ds.json"}},
    {"UnsupportedOptimizerType", "optimizer:\n  type: Lion\n", {"optimizer.type", "expected one of Adam, AdamW, SGD"}},
    {"SgdWithBetas", "optimizer:\n  type: SGD\n  params:\n    betas: [0.9, 0.99]\n", {"SGD has no betas"}},
    {"AdamWithMomentum", "optimizer:\n  type: Adam\n  params:\n    momentum: 0.9\n", {"momentum belongs to SGD"}},
    {"DecayScheduleWithoutTotalSteps", "scheduler:\n  type: WarmupDecayLR\n",
     {"scheduler.type", "needs scheduler.params.total_num_steps > 0"}},
    {"OptimizerParamsWithoutType", "optimizer:\n  params:\n    lr: 0.1\n", {"optimizer.type is missing"}},
    {"MegatronIsNotSupported", "megatron_lm_config:\n  megatron_lm_tp_degree: 2\n", {"megatron_lm_config", "not supported"}},
    {"SageMakerIsNotSupported", "compute_environment: AMAZON_SAGEMAKER\n", {"compute_environment", "only LOCAL_MACHINE"}},
    {"HybridShardBelowStage2", "zero_optimization:\n  stage: 1\n  hybrid_shard: true\n",
     {"hybrid sharding needs ZeRO stage 2 or 3"}},
    {"FsdpStrategyUnknown", "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: HALF_SHARD\n",
     {"fsdp_config.fsdp_sharding_strategy", "expected one of FULL_SHARD", "\"HALF_SHARD\""}},
    {"FileMustBeAMapping", "- a\n- b\n", {"bad.yaml:1:1", "must hold a mapping"}},
    {"DistributedTypeUnknown", "distributed_type: TPU\n", {"distributed_type", "expected one of NO, MULTI_CPU"}},
    {"WarmupMinAboveMax", "scheduler:\n  type: WarmupLR\n  params:\n    warmup_min_lr: 0.1\n    warmup_max_lr: 0.01\n",
     {"warmup_min_lr 0.1 is above warmup_max_lr 0.01"}},
    {"WarmupTypeUnknown", "scheduler:\n  type: WarmupLR\n  params:\n    warmup_type: cubic\n",
     {"scheduler.params.warmup_type", "expected one of log, linear"}},
    {"MinLossScaleAboveInitialScale", "fp16:\n  enabled: true\n  initial_scale_power: 2\n  min_loss_scale: 8\n",
     {"fp16.min_loss_scale", "above the initial scale 2^2"}},
};

class MalformedConfig : public ::testing::TestWithParam<BadConfig> {};

TEST_P(MalformedConfig, IsRejectedWithAMessageNamingTheProblem) {
  const BadConfig& c = GetParam();
  try {
    zeal::Config::parse(c.yaml, "bad.yaml");
    FAIL() << "accepted:\n" << c.yaml;
  } catch (const zeal::ConfigError& e) {
    const std::string msg = e.what();
    for (const auto& want : c.expected) EXPECT_NE(msg.find(want), std::string::npos) << "missing '" << want << "' in:\n" << msg;
  }
}

INSTANTIATE_TEST_SUITE_P(Config, MalformedConfig, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<BadConfig>& info) { return std::string(info.param.name); });

TEST(MalformedConfig, EveryProblemInAFileIsReportedAtOnce) {
  try {
    zeal::Config::parse("num_proceses: 2\nzero_optimization:\n  stage: 9\nuse_cpu: perhaps\n", "bad.yaml");
    FAIL();
  } catch (const zeal::ConfigError& e) {
    EXPECT_EQ(e.problems().size(), 3u) << e.what();
  }
}

// A thousand unknown keys: the message shows the first 20 and counts the rest; each line names its
// key with one suggestion, never the whole key table.
TEST(MalformedConfig, ManyProblemsAreCappedAndCounted) {
  std::string yaml;
  for (int i = 0; i < 1000; ++i) yaml += "unknown_key_number_" + std::to_string(i) + ": 1\n";
  try {
    zeal::Config::parse(yaml, "bad.yaml");
    FAIL();
  } catch (const zeal::ConfigError& e) {
    const std::string msg = e.what();
    EXPECT_EQ(e.problems().size(), 1000u);
    EXPECT_NE(msg.find("bad.yaml:20:1: unknown_key_number_19"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("unknown_key_number_20:"), std::string::npos) << msg;
    EXPECT_NE(msg.find("… and 980 more problems"), std::string::npos) << msg;
    EXPECT_LT(msg.size(), 20u * 200) << msg;
  }
}

// Files the loader must refuse by name before YAML sees them, and a JSON file with a trailing comma.
TEST(MalformedConfig, DirectoriesAndTrailingCommasAreNamed) {
  const std::string dir = ::testing::TempDir() + "/zeal_cfg_dir";
  std::filesystem::create_directories(dir);
  auto message = [](const std::string& path) {
    try {
      zeal::Config::load(path, false);
    } catch (const zeal::ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_NE(message(dir).find(dir + ": is a directory, not a config file"), std::string::npos) << message(dir);
  { std::ofstream(dir + "/ds.json") << "{\n  \"zero_optimization\": {\"stage\": 2,\n  },\n  \"s\": \"a,}\"\n}\n"; }
  EXPECT_NE(message(dir + "/ds.json").find(dir + "/ds.json:2:35: trailing comma"), std::string::npos)
      << message(dir + "/ds.json");
  // A comma inside a string is not one; without the trailing comma the file loads.
  { std::ofstream(dir + "/ds.json") << "{\"zero_optimization\": {\"stage\": 2}, \"x_note\": \"a,}\"}\n"; }
  EXPECT_EQ(message(dir + "/ds.json").find("trailing comma"), std::string::npos) << message(dir + "/ds.json");
  std::filesystem::remove_all(dir);
}

// Accelerate accepts zero3_init_flag inline beside deepspeed_config_file (it is not in its
// _deepspeed_config_checks list); zeal does too and applies it with the file's settings.
TEST(DeepSpeedFile, Zero3InitFlagInlineBesideTheFileIsAccepted) {
  const std::string dir = ::testing::TempDir();
  { std::ofstream(dir + "/zeal_ds.json") << R"({"zero_optimization": {"stage": 3}})"; }
  { std::ofstream(dir + "/zeal_acc.yaml") << "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: "
                                        << dir << "/zeal_ds.json\n  zero3_init_flag: true\n"; }
  const zeal::Config c = zeal::Config::load(dir + "/zeal_acc.yaml", false);
  EXPECT_TRUE(c.zero.zero3_init_flag);
  EXPECT_EQ(c.zero.stage, 3);
  std::remove((dir + "/zeal_ds.json").c_str());
  std::remove((dir + "/zeal_acc.yaml").c_str());
}

// Accelerate's rule for mixed_precision beside deepspeed_config_file: taken from the Accelerate file
// it is refused (accelerate launch adds it to ACCELERATE_CONFIG_DS_FIELDS, DeepSpeedPlugin raises);
// given on the command line it is taken; left out, the DeepSpeed file's bf16 section decides.
TEST(DeepSpeedFile, MixedPrecisionFollowsAccelerateBesideTheFile) {
  const std::string dir = ::testing::TempDir();
  const std::string ds = dir + "/zeal_mp_ds.json", acc = dir + "/zeal_mp_acc.yaml", bare = dir + "/zeal_mp_bare.yaml";
  { std::ofstream(ds) << R"({"zero_optimization": {"stage": 2}, "bf16": {"enabled": true}})"; }
  { std::ofstream(acc) << "distributed_type: DEEPSPEED\nmixed_precision: bf16\ndeepspeed_config:\n  deepspeed_config_file: " << ds << "\n"; }
  { std::ofstream(bare) << "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: " << ds << "\n"; }
  try {
    (void)zeal::Config::load(acc, false);
    ADD_FAILURE() << "mixed_precision in the Accelerate file beside deepspeed_config_file was accepted";
  } catch (const zeal::ConfigError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("mixed_precision (file " + acc + ":2:"), std::string::npos) << msg;
    EXPECT_NE(msg.find("together with deepspeed_config_file"), std::string::npos) << msg;
    EXPECT_NE(msg.find("--mixed_precision bf16"), std::string::npos) << msg;
  }
  // On the command line (a program's flags, or zeal launch's): taken.
  const std::string flag_file = "--config_file=" + acc;
  const char* argv[] = {"prog", flag_file.c_str(), "--mixed_precision", "bf16"};
  const zeal::Config flagged = zeal::Config::from_env_or_file(4, argv);
  EXPECT_EQ(flagged.mixed_precision, "bf16");
  // With other overrides in the environment too (they and the flags are checked together).
  ::setenv("ZEAL_COMM_TIMEOUT", "60", 1);
  EXPECT_EQ(zeal::Config::from_env_or_file(4, argv).mixed_precision, "bf16");
  ::unsetenv("ZEAL_COMM_TIMEOUT");
  // Left out: the DeepSpeed file's section.
  const zeal::Config c = zeal::Config::load(bare, false);
  EXPECT_EQ(c.mixed_precision, "bf16");
  EXPECT_EQ(c.zero.stage, 2);
  // A section left "auto" follows the command line's --mixed_precision.
  const std::string ds_auto = dir + "/zeal_mp_ds_auto.json", acc_auto = dir + "/zeal_mp_auto.yaml";
  { std::ofstream(ds_auto) << R"({"zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto"}})"; }
  { std::ofstream(acc_auto) << "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: " << ds_auto << "\n"; }
  const std::string auto_file = "--config_file=" + acc_auto;
  const char* argv_auto[] = {"prog", auto_file.c_str(), "--mixed_precision=bf16"};
  zeal::Config resolved = zeal::Config::from_env_or_file(3, argv_auto);
  resolved.resolve_auto({});
  EXPECT_TRUE(resolved.bf16_enabled.value);
  EXPECT_EQ(resolved.mixed_precision, "bf16");
  for (const auto& f : {ds, acc, bare, ds_auto, acc_auto}) std::remove(f.c_str());
}

TEST(MalformedConfig, MissingFileIsNamed) {
  try {
    zeal::Config::load("/nonexistent/zeal.yaml", false);
    FAIL();
  } catch (const zeal::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/zeal.yaml: no such config file"), std::string::npos);
  }
}

TEST(MalformedConfig, UnknownOverrideKeyIsNamed) {
  zeal::Config c = zeal::Config::defaults(false);
  try {
    c.set("zero_optimization.stag", "2", {zeal::Origin::Kind::kFlag, "--set"});
    FAIL();
  } catch (const zeal::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("did you mean zero_optimization.stage?"), std::string::npos) << e.what();
  }
  EXPECT_EQ(c.zero.stage, 0) << "a rejected override leaves the config as it was";
}

}  // namespace
