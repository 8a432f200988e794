// Derivations, contradictions and "auto" resolution.
#include <cstdlib>
#include <cctype>
#include <algorithm>
#include <cmath>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "engine/config/config.h"
#include "engine/config/finalize.h"
#include "engine/error.h"

namespace zeal {
namespace {

int rank_of(const Origin& o) { return static_cast<int>(o.kind); }

bool explicitly_set(const Config& c, const std::string& key) {
  auto it = c.origins.find(key);
  return it != c.origins.end() && it->second.kind != Origin::Kind::kDefault;
}

Origin origin_of(const Config& c, const std::string& key) {
  auto it = c.origins.find(key);
  return it == c.origins.end() ? Origin{} : it->second;
}

// "key (from where)": how a problem names the values involved.
std::string named(const Config& c, const std::string& key) {
  return fmt::format("{} (from {})", key, origin_of(c, key).describe());
}

void derive(Config& c, const std::string& key, const std::string& why) {
  if (!explicitly_set(c, key)) c.origins[key] = {Origin::Kind::kDefault, why};
}

// a × b × c, or nothing where the product does not fit in 64 bits.
std::optional<int64_t> product(int64_t a, int64_t b, int64_t c) {
  int64_t ab = 0, abc = 0;
  if (__builtin_mul_overflow(a, b, &ab) || __builtin_mul_overflow(ab, c, &abc)) return std::nullopt;
  return abc;
}

std::string overflow_text(const Config& c, int64_t micro, int64_t accum, int64_t world) {
  return fmt::format("train_micro_batch_size_per_gpu {} × gradient_accumulation_steps {} × world size {} does not "
                     "fit in 64 bits ({}; {})",
                     micro, accum, world, origin_of(c, "train_micro_batch_size_per_gpu").describe(),
                     origin_of(c, "gradient_accumulation_steps").describe());
}

}  // namespace

std::string Origin::describe() const {
  switch (kind) {
    case Kind::kDefault: return where.empty() ? "default" : "default: " + where;
    case Kind::kFile: return "file " + where;
    case Kind::kEnvironment: return "environment " + where;
    case Kind::kFlag: return "flag " + where;
    case Kind::kProgram: return "program " + where;
  }
  return "?";
}

bool Config::operator==(const Config& o) const {
  return launch == o.launch && mixed_precision == o.mixed_precision && zero == o.zero && aio == o.aio &&
         activation_checkpointing == o.activation_checkpointing &&
         fp16 == o.fp16 && bf16_enabled == o.bf16_enabled && train_batch_size == o.train_batch_size &&
         train_micro_batch_size_per_gpu == o.train_micro_batch_size_per_gpu &&
         gradient_accumulation_steps == o.gradient_accumulation_steps &&
         gradient_clipping == o.gradient_clipping && optimizer == o.optimizer && scheduler == o.scheduler &&
         steps_per_print == o.steps_per_print && wall_clock_breakdown == o.wall_clock_breakdown &&
         broadcast_buffers == o.broadcast_buffers && memory_check == o.memory_check && log_with == o.log_with &&
         logging_dir == o.logging_dir && tensorboard == o.tensorboard && csv_monitor == o.csv_monitor;
}

Precision Config::precision() const {
  if (mixed_precision == "fp16") return Precision::kFp16;
  if (mixed_precision == "bf16") return Precision::kBf16;
  return Precision::kFp32;
}

namespace config_detail {

void finalize(Config& c, std::vector<std::string>& errors) {
  // A DeepSpeed file says nothing of distributed_type: infer it, as `deepspeed` itself would run.
  if (!explicitly_set(c, "distributed_type")) {
    if (c.zero.stage > 0) {
      c.launch.distributed_type = "DEEPSPEED";
      c.origins["distributed_type"] = {Origin::Kind::kDefault, "ZeRO stage > 0"};
    } else if (c.launch.num_processes > 1) {
      c.launch.distributed_type = c.launch.use_cpu ? "MULTI_CPU" : "MULTI_GPU";
      c.origins["distributed_type"] = {Origin::Kind::kDefault, "several processes"};
    } else {
      c.launch.distributed_type = "NO";
      c.origins["distributed_type"] = {Origin::Kind::kDefault, ""};
    }
  }
  // overlap_comm: DeepSpeed turns it on by default for stage 3 only.
  if (!explicitly_set(c, "zero_optimization.overlap_comm")) {
    c.zero.overlap_comm = c.zero.stage == 3;
    c.origins["zero_optimization.overlap_comm"] = {Origin::Kind::kDefault, "true for stage 3, else false"};
  }

  // mixed_precision and the fp16/bf16 sections describe one thing; the later source wins, two
  // disagreeing values from sources of the same rank are an error.
  const bool mp_set = explicitly_set(c, "mixed_precision");
  // Accelerate's rule beside a DeepSpeed file: a mixed_precision that comes from the Accelerate
  // config file itself is refused (accelerate launch lists it among the keys the DeepSpeed file
  // overrides and DeepSpeedPlugin raises); one given on the command line or in the environment
  // is taken. The file's fp16/bf16 sections decide the precision.
  if (auto ds = c.recorded.find("deepspeed_config.deepspeed_config_file"); ds != c.recorded.end() && mp_set) {
    const Origin& o = origin_of(c, "mixed_precision");
    if (o.kind == Origin::Kind::kFile) {
      const std::string named = ds->second.substr(ds->second.find(' ') + 1);
      errors.push_back(fmt::format(
          "mixed_precision ({}) cannot be set in the config file together with deepspeed_config_file (as with "
          "accelerate launch): remove it and let {} decide ({}), or pass --mixed_precision {} on the command line",
          o.describe(), named,
          c.mixed_precision == "no" ? "its fp16/bf16 sections off or absent"
                                    : fmt::format("\"{}\": {{\"enabled\": true}}", c.mixed_precision),
          c.mixed_precision));
      return;
    }
  }
  const bool fp16_set = explicitly_set(c, "fp16.enabled") && !c.fp16.enabled.is_auto;
  const bool bf16_set = explicitly_set(c, "bf16.enabled") && !c.bf16_enabled.is_auto;
  if (fp16_set && bf16_set && c.fp16.enabled.value && c.bf16_enabled.value) {
    errors.push_back(fmt::format("fp16.enabled and bf16.enabled are both true ({}; {}): choose one",
                                 origin_of(c, "fp16.enabled").describe(), origin_of(c, "bf16.enabled").describe()));
    return;
  }
  // What the sections claim: a precision when one is enabled; "no" when the section of the
  // precision that mixed_precision names is explicitly off; nothing when they are silent.
  std::string from_sections;
  int sections_rank = -1;
  const char* claim_key = "fp16.enabled";
  if (fp16_set && c.fp16.enabled.value) {
    from_sections = "fp16";
  } else if (bf16_set && c.bf16_enabled.value) {
    from_sections = "bf16", claim_key = "bf16.enabled";
  } else if (fp16_set && c.mixed_precision == "fp16") {
    from_sections = "no";
  } else if (bf16_set && c.mixed_precision == "bf16") {
    from_sections = "no", claim_key = "bf16.enabled";
  }
  if (!from_sections.empty()) sections_rank = rank_of(origin_of(c, claim_key));
  if (mp_set && sections_rank >= 0 && from_sections != c.mixed_precision) {
    const int mp_rank = rank_of(origin_of(c, "mixed_precision"));
    if (mp_rank == sections_rank) {
      const char* section = claim_key;
      errors.push_back(fmt::format("mixed_precision is {} ({}) but {} says {} ({}): make them agree",
                                   c.mixed_precision, origin_of(c, "mixed_precision").describe(), section,
                                   from_sections, origin_of(c, section).describe()));
      return;
    }
    if (sections_rank > mp_rank) {
      c.mixed_precision = from_sections;
      c.origins["mixed_precision"] = {Origin::Kind::kDefault, "from the fp16/bf16 sections"};
    }
  } else if (!mp_set && sections_rank >= 0 && from_sections != "no") {
    c.mixed_precision = from_sections;
    c.origins["mixed_precision"] = {Origin::Kind::kDefault, "from the fp16/bf16 sections"};
  }
  // The sections follow mixed_precision, except where they are "auto" (resolved later from it).
  auto follow = [&](Auto<bool>& enabled, const char* key, const char* precision) {
    if (enabled.is_auto) return;
    const bool want = c.mixed_precision == precision;
    if (want != enabled.value || !explicitly_set(c, key)) {
      enabled.value = want;
      c.origins[key] = {Origin::Kind::kDefault, "from mixed_precision"};
    }
  };
  follow(c.fp16.enabled, "fp16.enabled", "fp16");
  follow(c.bf16_enabled, "bf16.enabled", "bf16");

  // Batch sizes: DeepSpeed derives the third of train_batch_size = micro × accumulation × world.
  const int64_t world = c.launch.num_processes;
  auto known = [&](const Auto<int64_t>& a) { return !a.is_auto && a.value > 0; };
  auto& tbs = c.train_batch_size;
  auto& micro = c.train_micro_batch_size_per_gpu;
  auto& accum = c.gradient_accumulation_steps;
  const bool accum_given = explicitly_set(c, "gradient_accumulation_steps") && known(accum);
  if (known(tbs) && known(micro) && !accum_given && !accum.is_auto &&
      !explicitly_set(c, "gradient_accumulation_steps")) {
    const auto per_step = product(micro.value, 1, world);
    if (per_step && tbs.value % *per_step == 0) {
      accum.value = tbs.value / *per_step;
      derive(c, "gradient_accumulation_steps", "train_batch_size / (micro batch × world)");
    }
  } else if (known(tbs) && !micro.is_auto && micro.value == 0 && known(accum)) {
    const auto per_sample = product(accum.value, 1, world);
    if (per_sample && tbs.value % *per_sample == 0) {
      micro.value = tbs.value / *per_sample;
      derive(c, "train_micro_batch_size_per_gpu", "train_batch_size / (accumulation × world)");
    }
  } else if (!explicitly_set(c, "train_batch_size") && known(micro) && known(accum)) {
    // An overflowing product is left unset here and named by validate().
    if (const auto all = product(micro.value, accum.value, world)) {
      tbs.value = *all;
      derive(c, "train_batch_size", "micro batch × accumulation × world");
    }
  }
}

}  // namespace config_detail

std::vector<int> parse_gpu_ids(const std::string& gpu_ids) {
  std::vector<int> ids;
  if (gpu_ids.empty() || gpu_ids == "all") return ids;
  std::stringstream in(gpu_ids);
  for (std::string item; std::getline(in, item, ',');) {
    const auto b = item.find_first_not_of(' '), e = item.find_last_not_of(' ');
    const std::string id = b == std::string::npos ? "" : item.substr(b, e - b + 1);
    const bool digits = !id.empty() && id.size() <= 4 && std::all_of(id.begin(), id.end(), [](char c) {
      return c >= '0' && c <= '9';
    });
    if (!digits) {
      throw Error(fmt::format("gpu_ids: '{}' in \"{}\" is not a GPU index; expected all or a list like 0,1", id,
                              gpu_ids));
    }
    const int v = std::stoi(id);
    if (std::find(ids.begin(), ids.end(), v) != ids.end()) {
      throw Error(fmt::format("gpu_ids: GPU {} is listed twice in \"{}\"", v, gpu_ids));
    }
    ids.push_back(v);
  }
  return ids;
}

std::vector<std::string> Config::validate() const {
  std::vector<std::string> errors, warnings;
  const auto& z = zero;
  const std::string stage_text = named(*this, "zero_optimization.stage");

  try {
    (void)parse_gpu_ids(launch.gpu_ids);
  } catch (const Error& e) {
    // parse_gpu_ids's message starts with the key; say where its value came from instead.
    errors.push_back(fmt::format("{}: {}", named(*this, "gpu_ids"), std::string(e.what()).substr(9)));
  }
  if (z.offload_param.device != OffloadDevice::kNone && z.stage < 3)
    errors.push_back(fmt::format("{}: parameter offload needs ZeRO stage 3, but stage is {} — {}",
                                 named(*this, "zero_optimization.offload_param.device"), z.stage, stage_text));
  if (z.offload_optimizer.device != OffloadDevice::kNone && z.stage == 0)
    errors.push_back(fmt::format("{}: optimizer offload needs ZeRO stage 1, 2 or 3, but stage is 0 — {}",
                                 named(*this, "zero_optimization.offload_optimizer.device"), stage_text));
  if (z.offload_optimizer.device == OffloadDevice::kNvme && z.stage != 3 && z.stage != 0)
    errors.push_back(fmt::format("{}: optimizer offload to nvme needs ZeRO stage 3 (ZeRO-Infinity), but stage is {}",
                                 named(*this, "zero_optimization.offload_optimizer.device"), z.stage));
  if (z.offload_optimizer.device == OffloadDevice::kNvme && z.offload_optimizer.nvme_path.empty())
    errors.push_back(fmt::format("{}: device nvme needs zero_optimization.offload_optimizer.nvme_path "
                                 "(deepspeed_config.offload_optimizer_nvme_path)",
                                 named(*this, "zero_optimization.offload_optimizer.device")));
  if (z.offload_param.device == OffloadDevice::kNvme && z.offload_param.nvme_path.empty())
    errors.push_back(fmt::format("{}: device nvme needs zero_optimization.offload_param.nvme_path "
                                 "(deepspeed_config.offload_param_nvme_path)",
                                 named(*this, "zero_optimization.offload_param.device")));
  if (!aio.block_size.is_auto && aio.block_size.value % 4096 != 0)
    errors.push_back(fmt::format("{}: {} is not a multiple of 4096 (O_DIRECT needs whole 4 KiB blocks)",
                                 named(*this, "aio.block_size"), aio.block_size.value));
  if (!fp16.enabled.is_auto && !bf16_enabled.is_auto && fp16.enabled.value && bf16_enabled.value)
    errors.push_back("fp16.enabled and bf16.enabled are both true: choose one");
  if (z.hybrid_shard && z.stage < 2)
    errors.push_back(fmt::format("{}: hybrid sharding needs ZeRO stage 2 or 3, but stage is {}",
                                 named(*this, "zero_optimization.hybrid_shard"), z.stage));

  // Launch geometry.
  if (launch.machine_rank >= launch.num_machines)
    errors.push_back(fmt::format("{}: {} is out of range for num_machines {} (ranks are 0..{})",
                                 named(*this, "machine_rank"), launch.machine_rank, launch.num_machines,
                                 launch.num_machines - 1));
  if (launch.num_processes % launch.num_machines != 0)
    errors.push_back(fmt::format("{}: {} processes cannot be split evenly over {} machines",
                                 named(*this, "num_processes"), launch.num_processes, launch.num_machines));
  if (launch.distributed_type == "NO" && launch.num_processes > 1 && explicitly_set(*this, "distributed_type"))
    errors.push_back(fmt::format("{}: NO runs a single process, but num_processes is {} ({}); use MULTI_CPU, "
                                 "MULTI_GPU, DEEPSPEED or FSDP",
                                 named(*this, "distributed_type"), launch.num_processes,
                                 origin_of(*this, "num_processes").describe()));

  // Batch identity.
  const int64_t world = launch.num_processes;
  const auto& tbs = train_batch_size;
  const auto& micro = train_micro_batch_size_per_gpu;
  const auto& accum = gradient_accumulation_steps;
  const auto all = product(micro.value, accum.value, world);
  if (!micro.is_auto && !accum.is_auto && micro.value > 0 && !all)
    errors.push_back(overflow_text(*this, micro.value, accum.value, world));
  else if (!tbs.is_auto && !micro.is_auto && !accum.is_auto && tbs.value > 0 && micro.value > 0 &&
           tbs.value != *all)
    errors.push_back(fmt::format(
        "train_batch_size {} ≠ train_micro_batch_size_per_gpu {} × gradient_accumulation_steps {} × world size {} "
        "= {} ({}; {}; {})",
        tbs.value, micro.value, accum.value, world, *all,
        origin_of(*this, "train_batch_size").describe(), origin_of(*this, "train_micro_batch_size_per_gpu").describe(),
        origin_of(*this, "gradient_accumulation_steps").describe()));
  else if (!tbs.is_auto && tbs.value > 0 && (micro.value == 0 || accum.value == 0) && !micro.is_auto &&
           !accum.is_auto && tbs.value % world != 0)
    errors.push_back(fmt::format("{}: {} is not divisible by the world size {}", named(*this, "train_batch_size"),
                                 tbs.value, world));

  // Optimizer and schedule.
  const bool sgd = optimizer.type == "SGD";
  if (sgd && explicitly_set(*this, "optimizer.params.betas"))
    errors.push_back(fmt::format("{}: SGD has no betas; they belong to Adam and AdamW",
                                 named(*this, "optimizer.params.betas")));
  if (!sgd && explicitly_set(*this, "optimizer.params.momentum"))
    errors.push_back(fmt::format("{}: momentum belongs to SGD; {} uses betas",
                                 named(*this, "optimizer.params.momentum"),
                                 optimizer.type.empty() ? std::string("the optimizer") : optimizer.type));
  if (optimizer.amsgrad)
    errors.push_back(fmt::format("{}: zeal's Adam has no AMSGrad variant (it would change the update); set it to false "
                                 "or leave it out",
                                 named(*this, "optimizer.params.amsgrad")));
  for (const char* key : {"optimizer.params.adam_w_mode", "optimizer.params.bias_correction"}) {
    if (!sgd || !explicitly_set(*this, key)) continue;
    errors.push_back(fmt::format("{}: belongs to Adam; SGD has no such setting", named(*this, key)));
  }
  if (optimizer.type == "AdamW" && !optimizer.adam_w_mode)
    errors.push_back(fmt::format("{}: false contradicts optimizer.type AdamW (decoupled weight decay); use type Adam "
                                 "for L2 weight decay",
                                 named(*this, "optimizer.params.adam_w_mode")));
  if (sgd && optimizer.nesterov && optimizer.momentum <= 0.0)
    errors.push_back(fmt::format("{}: Nesterov momentum needs optimizer.params.momentum > 0",
                                 named(*this, "optimizer.params.nesterov")));
  for (const char* section : {"optimizer", "scheduler"}) {
    const std::string& type = std::string(section) == "optimizer" ? optimizer.type : scheduler.type;
    if (!type.empty()) continue;
    const std::string prefix = std::string(section) + ".params.";
    for (const auto& [key, origin] : origins) {
      if (key.rfind(prefix, 0) == 0 && origin.kind != Origin::Kind::kDefault) {
        errors.push_back(fmt::format("{}: {} params are given but {}.type is missing ({})", named(*this, key),
                                     section, section,
                                     std::string(section) == "optimizer" ? "Adam, AdamW or SGD"
                                                                         : "WarmupLR, WarmupDecayLR or WarmupCosineLR"));
        break;
      }
    }
  }
  const auto& s = scheduler;
  if ((s.type == "WarmupDecayLR" || s.type == "WarmupCosineLR") && !s.total_num_steps.is_auto &&
      s.total_num_steps.value <= 0)
    errors.push_back(fmt::format("{}: {} needs scheduler.params.total_num_steps > 0", named(*this, "scheduler.type"),
                                 s.type));
  if (!s.type.empty() && !s.total_num_steps.is_auto && !s.warmup_num_steps.is_auto && s.total_num_steps.value > 0 &&
      s.total_num_steps.value < s.warmup_num_steps.value)
    errors.push_back(fmt::format("{}: total_num_steps {} is shorter than warmup_num_steps {}",
                                 named(*this, "scheduler.params.total_num_steps"), s.total_num_steps.value,
                                 s.warmup_num_steps.value));
  if (!s.warmup_min_lrs.empty() && !s.warmup_max_lrs.empty() && s.warmup_min_lrs.size() != s.warmup_max_lrs.size())
    errors.push_back(fmt::format("{} lists {} rates and {} lists {}: one per parameter group in both",
                                 named(*this, "scheduler.params.warmup_min_lr"), s.warmup_min_lrs.size(),
                                 named(*this, "scheduler.params.warmup_max_lr"), s.warmup_max_lrs.size()));
  else if (!s.warmup_min_lr.is_auto && !s.warmup_max_lr.is_auto) {
    // Group by group when either is a list (a scalar stands for every group).
    const size_t n = std::max({s.warmup_min_lrs.size(), s.warmup_max_lrs.size(), size_t{1}});
    for (size_t g = 0; g < n; ++g) {
      const double lo = s.warmup_min_lrs.empty() ? s.warmup_min_lr.value : s.warmup_min_lrs[g];
      const double hi = s.warmup_max_lrs.empty() ? s.warmup_max_lr.value : s.warmup_max_lrs[g];
      if (lo > hi) {
        errors.push_back(fmt::format("{}: warmup_min_lr {} is above warmup_max_lr {}{}",
                                     named(*this, "scheduler.params.warmup_min_lr"), lo, hi,
                                     n > 1 ? fmt::format(" for parameter group {}", g) : std::string()));
        break;
      }
    }
  }
  if (fp16.loss_scale == 0.0 && fp16.min_loss_scale > std::ldexp(1.0, static_cast<int>(fp16.initial_scale_power)))
    errors.push_back(fmt::format("{}: min_loss_scale {} is above the initial scale 2^{}",
                                 named(*this, "fp16.min_loss_scale"), fp16.min_loss_scale, fp16.initial_scale_power));

  if (!errors.empty()) throw ConfigError(errors);

  // Accepted, but worth saying.
  for (const char* key : {"zero_optimization.zero3_init_flag", "zero_optimization.stage3_prefetch_bucket_size",
                          "zero_optimization.stage3_param_persistence_threshold",
                          "zero_optimization.stage3_max_live_parameters", "zero_optimization.stage3_max_reuse_distance",
                          "zero_optimization.stage3_gather_16bit_weights_on_model_save"}) {
    if (z.stage < 3 && explicitly_set(*this, key))
      warnings.push_back(fmt::format("{} applies to stage 3 only; stage is {}", named(*this, key), z.stage));
  }
  if (launch.num_machines > 1 && (launch.main_process_ip == "127.0.0.1" || launch.main_process_ip == "localhost"))
    warnings.push_back(fmt::format("num_machines is {} but main_process_ip is {}: other machines cannot reach it",
                                   launch.num_machines, launch.main_process_ip));
  if (z.offload_optimizer.pin_memory && z.offload_optimizer.device == OffloadDevice::kNone)
    warnings.push_back("zero_optimization.offload_optimizer.pin_memory has no effect without offload");
  return warnings;
}

void Config::resolve_auto(const ProgramValues& v) {
  std::vector<std::string> errors;
  auto program = [](const std::string& what) { return Origin{Origin::Kind::kProgram, what}; };
  auto missing = [&](const std::string& key, const std::string& what) {
    errors.push_back(fmt::format("{} is \"auto\" ({}) but the program passed no {}", key,
                                 origin_of(*this, key).describe(), what));
  };
  if (v.world_size) {
    launch.num_processes = *v.world_size;
    origins["num_processes"] = program("world size");
  }
  const int64_t world = launch.num_processes;
  auto& micro = train_micro_batch_size_per_gpu;
  if (micro.is_auto || micro.value == 0) {
    if (v.micro_batch_size) {
      micro = {*v.micro_batch_size, false};
      origins["train_micro_batch_size_per_gpu"] = program("data loader batch size");
    } else if (micro.is_auto) {
      missing("train_micro_batch_size_per_gpu", "micro batch size");
    }
  }
  auto& accum = gradient_accumulation_steps;
  if (accum.is_auto) {
    const auto per_step = product(micro.value, 1, world);
    if (!train_batch_size.is_auto && train_batch_size.value > 0 && micro.value > 0 && per_step) {
      accum = {std::max<int64_t>(1, train_batch_size.value / *per_step), false};
    } else {
      accum = {1, false};
    }
    origins["gradient_accumulation_steps"] = program("derived");
  }
  if (train_batch_size.is_auto || (train_batch_size.value == 0 && micro.value > 0)) {
    const auto all = product(micro.value, accum.value, world);
    if (!all) throw ConfigError({overflow_text(*this, micro.value, accum.value, world)});
    train_batch_size = {*all, false};
    origins["train_batch_size"] = program("micro batch × accumulation × world");
  }
  if (gradient_clipping.is_auto) gradient_clipping = {1.0, false};
  if (fp16.enabled.is_auto) fp16.enabled = {mixed_precision == "fp16", false};
  if (bf16_enabled.is_auto) bf16_enabled = {mixed_precision == "bf16", false};
  auto from_hidden = [&](Auto<int64_t>& a, const char* key, double factor) {
    if (!a.is_auto) return;
    if (!v.hidden_size) return missing(key, "hidden size");
    a = {static_cast<int64_t>(factor * static_cast<double>(*v.hidden_size)), false};
    origins[key] = program("from the hidden size");
  };
  const double h = v.hidden_size ? static_cast<double>(*v.hidden_size) : 0.0;
  from_hidden(zero.reduce_bucket_size, "zero_optimization.reduce_bucket_size", h);
  from_hidden(zero.stage3_prefetch_bucket_size, "zero_optimization.stage3_prefetch_bucket_size", 0.9 * h);
  from_hidden(zero.stage3_param_persistence_threshold, "zero_optimization.stage3_param_persistence_threshold", 10.0);
  auto from_value = [&](auto& a, const char* key, const auto& given, const char* what) {
    if (!a.is_auto) return;
    if (!given) return missing(key, what);
    a.value = *given;
    a.is_auto = false;
    origins[key] = program(what);
  };
  from_value(optimizer.lr, "optimizer.params.lr", v.lr, "learning rate");
  if (optimizer.betas.is_auto) optimizer.betas = {{0.9, 0.999}, false};
  if (optimizer.eps.is_auto) optimizer.eps = {1e-8, false};
  if (optimizer.weight_decay.is_auto) optimizer.weight_decay = {0.0, false};
  if (scheduler.warmup_min_lr.is_auto) scheduler.warmup_min_lr = {0.0, false};
  if (scheduler.warmup_max_lr.is_auto) {
    std::optional<double> lr = v.lr ? v.lr : std::optional<double>(optimizer.lr.value);
    from_value(scheduler.warmup_max_lr, "scheduler.params.warmup_max_lr", lr, "learning rate");
  }
  from_value(scheduler.warmup_num_steps, "scheduler.params.warmup_num_steps", v.warmup_num_steps,
             "number of warm-up steps");
  from_value(scheduler.total_num_steps, "scheduler.params.total_num_steps", v.total_num_steps,
             "number of training steps");
  if (!errors.empty()) throw ConfigError(errors);
  config_detail::finalize(*this, errors);
  if (!errors.empty()) throw ConfigError(errors);
  validate();
}

}  // namespace zeal
