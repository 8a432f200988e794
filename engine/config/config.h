// zeal::Config — the one typed configuration of a zeal run.
//
// A Config is loaded from YAML or JSON in any of the formats users already have: Accelerate's
// `accelerate config` files (with a `deepspeed_config:` or `fsdp_config:` section), DeepSpeed's
// JSON keys, or both mixed at the top level. Defaults are DeepSpeed's. Every value remembers where
// it came from (default, file:line:col, environment variable or command-line flag), and overrides
// are applied in that order, later ones winning. Loading validates everything at once: a bad file
// raises zeal::ConfigError listing every problem with the key, its location and what is allowed.
//
// The engine reads these structs, never YAML.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace zeal {

// A value that a file may set to "auto": it is then filled in from what the program passes
// (Config::resolve_auto) instead of from the file.
template <class T>
struct Auto {
  T value{};
  bool is_auto = false;
  bool operator==(const Auto&) const = default;
};

enum class OffloadDevice { kNone, kCpu, kNvme };
enum class Precision { kFp32, kFp16, kBf16 };

struct OffloadOptimizerConfig {
  OffloadDevice device = OffloadDevice::kNone;
  std::string nvme_path;  // empty: none
  bool pin_memory = false;
  int64_t buffer_count = 4;
  bool fast_init = false;
  double ratio = 1.0;
  bool operator==(const OffloadOptimizerConfig&) const = default;
};

struct OffloadParamConfig {
  OffloadDevice device = OffloadDevice::kNone;
  std::string nvme_path;
  bool pin_memory = false;
  int64_t buffer_count = 5;
  int64_t buffer_size = 100'000'000;
  int64_t max_in_cpu = 1'000'000'000;
  bool operator==(const OffloadParamConfig&) const = default;
};

struct ZeroConfig {
  int64_t stage = 0;
  OffloadOptimizerConfig offload_optimizer;
  OffloadParamConfig offload_param;
  bool overlap_comm = false;  // DeepSpeed's default: true for stage 3, false below
  bool contiguous_gradients = true;
  Auto<int64_t> reduce_bucket_size{500'000'000};
  int64_t allgather_bucket_size = 500'000'000;
  bool allgather_partitions = true;
  bool reduce_scatter = true;
  bool round_robin_gradients = false;
  int64_t sub_group_size = 1'000'000'000;
  Auto<int64_t> stage3_prefetch_bucket_size{50'000'000};
  Auto<int64_t> stage3_param_persistence_threshold{100'000};
  int64_t stage3_max_live_parameters = 1'000'000'000;
  int64_t stage3_max_reuse_distance = 1'000'000'000;
  bool stage3_gather_16bit_weights_on_model_save = false;
  // Stage 3 only: build the model already partitioned (Accelerate's zero3_init_flag).
  bool zero3_init_flag = false;
  // Names of the module types that form sharding units (fsdp_transformer_layer_cls_to_wrap).
  std::vector<std::string> unit_names;
  // HYBRID_SHARD: shard inside a node, replicate across nodes.
  bool hybrid_shard = false;
  bool operator==(const ZeroConfig&) const = default;
};

struct AioConfig {
  // "auto": a short measurement of the nvme_path's disk at start-up picks them (zeal offload tune).
  Auto<int64_t> block_size{1'048'576};
  Auto<int64_t> queue_depth{8};
  int64_t thread_count = 1;
  bool single_submit = false;
  bool overlap_events = true;
  bool verify = false;  // zeal: a CRC32C per block of swap files, checked on every read
  bool operator==(const AioConfig&) const = default;
};

// DeepSpeed's activation_checkpointing section (its presence turns checkpointing on, as
// Accelerate's fsdp_activation_checkpointing: true does): every zeal::Sharded unit, or every
// unit_interval-th, checkpoints its activations (engine/activation_checkpoint.h).
struct ActivationCheckpointingConfig {
  bool enabled = false;
  int64_t unit_interval = 1;             // zeal: checkpoint units 0, k, 2k, … (k = 1: every unit)
  bool cpu_checkpointing = false;        // the kept inputs in pinned host memory (GPU ranks)
  bool synchronize_checkpoint_boundary = false;  // wait for the device at each checkpoint's boundaries
  bool operator==(const ActivationCheckpointingConfig&) const = default;
};

struct Fp16Config {
  Auto<bool> enabled{false};
  double loss_scale = 0.0;  // 0: dynamic loss scaling
  int64_t initial_scale_power = 16;
  int64_t loss_scale_window = 1000;
  int64_t hysteresis = 2;
  bool consecutive_hysteresis = false;
  double min_loss_scale = 1.0;
  bool operator==(const Fp16Config&) const = default;
};

struct OptimizerConfig {
  std::string type;  // empty: the program passes its own optimizer
  Auto<double> lr{1e-3};
  Auto<std::array<double, 2>> betas{{0.9, 0.999}};
  Auto<double> eps{1e-8};
  Auto<double> weight_decay{0.0};
  double momentum = 0.0;
  bool nesterov = false;
  // DeepSpeed's Adam keys. `adam_w_mode` (default true) makes "type": "Adam" decoupled weight decay
  // (AdamW), DeepSpeed's rule; false gives Adam with L2 decay (torch.optim.Adam). Without
  // `bias_correction` the moments are used as they are (no 1/(1 − βᵗ)). `amsgrad` is refused.
  bool adam_w_mode = true;
  bool bias_correction = true;
  bool amsgrad = false;
  bool operator==(const OptimizerConfig&) const = default;
};

struct SchedulerConfig {
  std::string type;  // empty, WarmupLR, WarmupDecayLR or WarmupCosineLR
  Auto<double> warmup_min_lr{0.0};
  Auto<double> warmup_max_lr{1e-3};
  // DeepSpeed's per-group form: a list with one rate per parameter group (empty: the scalar above
  // for every group). The scalar then holds the list's first value.
  std::vector<double> warmup_min_lrs, warmup_max_lrs;
  Auto<int64_t> warmup_num_steps{1000};
  std::string warmup_type = "log";  // log or linear
  Auto<int64_t> total_num_steps{0};  // required by the decaying schedules
  double warmup_min_ratio = 0.0;
  double cos_min_ratio = 0.0001;
  bool operator==(const SchedulerConfig&) const = default;
};

// How processes are started: Accelerate's top-level keys.
struct LaunchConfig {
  std::string distributed_type = "NO";
  int64_t num_processes = 1;  // over all machines
  int64_t num_machines = 1;
  int64_t machine_rank = 0;
  std::string main_process_ip = "127.0.0.1";
  int64_t main_process_port = 29500;
  std::string rdzv_backend = "static";
  bool same_network = true;
  bool use_cpu = false;
  std::string gpu_ids = "all";
  double comm_timeout = 1800.0;  // seconds a collective may wait before the rank fails
  bool operator==(const LaunchConfig&) const = default;
};

// Where a value came from, for `zeal config show` and error messages.
struct Origin {
  enum class Kind { kDefault, kFile, kEnvironment, kFlag, kProgram };
  Kind kind = Kind::kDefault;
  std::string where;  // "file.yaml:3:5", "ZEAL_ZERO_STAGE", "--zero_stage"
  std::string describe() const;
};

// What the program knows that "auto" values are resolved from (Config::resolve_auto).
struct ProgramValues {
  std::optional<int64_t> micro_batch_size;
  std::optional<int64_t> world_size;
  std::optional<int64_t> hidden_size;
  std::optional<double> lr;
  std::optional<int64_t> total_num_steps;
  std::optional<int64_t> warmup_num_steps;
};

// DeepSpeed's tensorboard and csv_monitor sections: a tracker writing into output_path/job_name.
struct MonitorConfig {
  bool enabled = false;
  std::string output_path;                   // empty: logging_dir
  std::string job_name = "DeepSpeedJobName";
  bool operator==(const MonitorConfig&) const = default;
};

struct Config {
  LaunchConfig launch;
  std::string mixed_precision = "no";  // no, fp16, bf16 (kept consistent with fp16/bf16.enabled)
  ZeroConfig zero;
  AioConfig aio;
  ActivationCheckpointingConfig activation_checkpointing;
  Fp16Config fp16;
  Auto<bool> bf16_enabled{false};
  Auto<int64_t> train_batch_size{0};                 // 0: not set
  Auto<int64_t> train_micro_batch_size_per_gpu{0};   // 0: not set, taken from the data loader
  Auto<int64_t> gradient_accumulation_steps{1};
  Auto<double> gradient_clipping{0.0};               // 0: off
  // The dtypes gradients are summed in across micro-steps (DeepSpeed's data_types.grad_accum_dtype)
  // and reduced across ranks in (communication_data_type): fp32, fp16 or bf16; empty means fp32
  // (16-bit sums lose the small contributions of later micro-steps and ranks).
  std::string grad_accum_dtype;
  std::string communication_data_type;
  OptimizerConfig optimizer;
  SchedulerConfig scheduler;
  int64_t steps_per_print = 10;
  bool wall_clock_breakdown = false;
  // After every optimizer step the model's buffers (BatchNorm statistics, EMAs, counters) take rank
  // 0's values on every rank, as DDP's broadcast_buffers keeps them in step.
  bool broadcast_buffers = true;
  // At prepare each rank predicts its peak resident set (model states, offload buffers, gathered
  // units, the runtime) and compares it with the memory it may use: "warn" says so when it will not
  // fit, "error" refuses to train, "off" does not check.
  std::string memory_check = "warn";
  // Experiment trackers for engine.init_trackers / engine.log (Accelerate's log_with): tensorboard,
  // csv, jsonl or all; Accelerate's other names (wandb, comet_ml, …) are accepted and said to log
  // nowhere. They write into logging_dir/<project>; DeepSpeed's sections choose their own folders.
  std::vector<std::string> log_with;
  std::string logging_dir = "runs";
  MonitorConfig tensorboard, csv_monitor;

  // Accelerate/FSDP settings kept as given, with what zeal made of each.
  std::map<std::string, std::string> recorded;
  // Things the user should know: keys mapped approximately or not applicable.
  std::vector<std::string> notes;
  // Canonical key → where its value came from. Not part of equality.
  std::map<std::string, Origin> origins;

  bool operator==(const Config& o) const;

  Precision precision() const;
  int64_t world_size() const { return launch.num_processes; }

  // Loads a YAML or JSON file, then applies ZEAL_* environment overrides. Throws ConfigError.
  static Config load(const std::string& path, bool apply_environment = true);
  // Parses text as if it were the file `name` (for tests and stdin).
  static Config parse(const std::string& text, const std::string& name = "<string>",
                      bool apply_environment = false);
  // Defaults plus environment overrides (no file).
  static Config defaults(bool apply_environment = true);
  // The program's entry point: --config_file F or $ZEAL_CONFIG_FILE (or defaults), then the
  // environment, then override flags among argv (--zero_stage 3, --mixed_precision bf16, …).
  static Config from_env_or_file(int argc, const char* const* argv);

  // Sets one canonical key (or launcher flag name) from a string, recording its origin, and
  // re-validates. Throws ConfigError naming the key and the allowed values.
  void set(const std::string& key, const std::string& value, Origin origin);
  // Sets several keys, then validates once (so num_machines and machine_rank can change together).
  struct Setting {
    std::string key, value;
    Origin origin;
  };
  void set_all(const std::vector<Setting>& settings);
  // Fills "auto" values and checks the batch-size identity. Throws ConfigError when an "auto"
  // has nothing to be resolved from.
  void resolve_auto(const ProgramValues& values);
  // Throws ConfigError listing every contradiction; returns warnings.
  std::vector<std::string> validate() const;

  // The resolved config as YAML in zeal's own format, each value commented with its origin.
  // Parsing the result gives back an equal Config.
  std::string to_yaml(bool with_origins = true) const;
};

// gpu_ids' GPUs: empty for "all" (or ""), else the distinct device indices of a comma-separated list
// ("0,1"), as the process sees them (after CUDA_VISIBLE_DEVICES). Throws zeal::Error naming the key
// and the bad entry.
std::vector<int> parse_gpu_ids(const std::string& gpu_ids);

// Where `zeal config` writes and `zeal launch` reads the default config:
// $ZEAL_HOME/default_config.yaml, else ~/.cache/zeal/default_config.yaml.
std::string default_config_path();

// Canonical keys, their types, defaults and descriptions (for docs and `zeal config keys`).
struct KeyInfo {
  std::string key;
  std::string type;
  std::string default_value;
  std::string description;
};
std::vector<KeyInfo> config_keys();

// The flags `zeal launch` and Config::from_env_or_file accept, each mapped to a canonical key,
// and the environment variable that sets the same value.
struct OverrideFlag {
  std::string flag;  // without leading dashes
  std::string key;
  std::string env;
  std::string help;
};
const std::vector<OverrideFlag>& override_flags();

}  // namespace zeal
