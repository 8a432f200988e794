#include "engine/config/schema.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>
#include <set>

#include <fmt/format.h>

namespace zeal::config_detail {
namespace {

std::string lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string kind_of(const YAML::Node& n) {
  if (n.IsMap()) return "a mapping";
  if (n.IsSequence()) return "a list";
  if (n.IsNull()) return "nothing (null)";
  return quote(n.Scalar());
}

const std::string& need_scalar(const YAML::Node& n, const std::string& expected) {
  if (!n.IsScalar()) throw ValueError{fmt::format("expected {}, got {}", expected, kind_of(n))};
  return n.Scalar();
}

bool is_auto(const YAML::Node& n) { return n.IsScalar() && n.Scalar() == "auto"; }

std::string fmt_int(int64_t v) { return std::to_string(v); }
std::string fmt_float(double v) {
  std::string s = fmt::format("{}", v);
  // Keep a float looking like one so the printed YAML reads back with the same type in mind.
  if (s.find_first_of(".eE") == std::string::npos && s.find_first_of("ni") == std::string::npos) s += ".0";
  return s;
}
std::string fmt_bool(bool v) { return v ? "true" : "false"; }

}  // namespace

bool read_bool(const YAML::Node& n) {
  const std::string v = lower(need_scalar(n, "true or false"));
  if (v == "true" || v == "yes" || v == "on") return true;
  if (v == "false" || v == "no" || v == "off") return false;
  throw ValueError{fmt::format("expected true or false, got {}", quote(n.Scalar()))};
}

namespace {

std::string range_text(int64_t lo, int64_t hi) {
  if (hi == std::numeric_limits<int64_t>::max()) return fmt::format("an integer ≥ {}", lo);
  return fmt::format("an integer from {} to {}", lo, hi);
}

int64_t read_int(const YAML::Node& n, int64_t lo, int64_t hi) {
  const std::string& s = need_scalar(n, range_text(lo, hi));
  errno = 0;
  char* end = nullptr;
  long long v = std::strtoll(s.c_str(), &end, 10);
  bool ok = !s.empty() && end && *end == '\0' && errno == 0;
  if (!ok) {
    // DeepSpeed files write sizes as 5e8 or 1.0e9: accept a float with an integral value.
    double d = std::strtod(s.c_str(), &end);
    ok = !s.empty() && end && *end == '\0' && std::isfinite(d) && d == std::floor(d) &&
         std::fabs(d) < 9.0e18;
    v = ok ? static_cast<long long>(d) : 0;
  }
  if (!ok || v < lo || v > hi)
    throw ValueError{fmt::format("expected {}, got {}", range_text(lo, hi), quote(s))};
  return v;
}

struct FloatRange {
  double lo = 0.0;
  double hi = std::numeric_limits<double>::infinity();
  bool lo_open = false;  // lo itself not allowed
  bool hi_open = false;
  std::string text() const {
    std::string out = "a number";
    if (lo == -std::numeric_limits<double>::infinity()) return out;
    out += lo_open ? fmt::format(" > {}", lo) : fmt::format(" ≥ {}", lo);
    if (std::isfinite(hi)) out += hi_open ? fmt::format(" and < {}", hi) : fmt::format(" and ≤ {}", hi);
    return out;
  }
};

double read_float(const YAML::Node& n, const FloatRange& r) {
  const std::string& s = need_scalar(n, r.text());
  char* end = nullptr;
  double d = std::strtod(s.c_str(), &end);
  bool ok = !s.empty() && end && *end == '\0' && std::isfinite(d);
  ok = ok && (r.lo_open ? d > r.lo : d >= r.lo) && (r.hi_open ? d < r.hi : d <= r.hi);
  if (!ok) throw ValueError{fmt::format("expected {}, got {}", r.text(), quote(s))};
  return d;
}

std::string join(const std::vector<std::string>& v, const std::string& sep) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? sep : "") + v[i];
  return out;
}

std::string read_enum(const YAML::Node& n, const std::vector<std::string>& options) {
  const std::string& s = need_scalar(n, "one of " + join(options, ", "));
  for (const auto& o : options)
    if (lower(o) == lower(s)) return o;
  throw ValueError{fmt::format("expected one of {}, got {}", join(options, ", "), quote(s))};
}

std::string read_string(const YAML::Node& n, bool nullable) {
  if (nullable && n.IsNull()) return "";
  const std::string& s = need_scalar(n, "a string");
  if (nullable && (lower(s) == "none" || lower(s) == "null")) return "";
  return s;
}

const char* device_name(OffloadDevice d) {
  switch (d) {
    case OffloadDevice::kCpu: return "cpu";
    case OffloadDevice::kNvme: return "nvme";
    default: return "none";
  }
}

OffloadDevice read_device(const YAML::Node& n) {
  if (n.IsNull()) return OffloadDevice::kNone;
  std::string v = read_enum(n, {"none", "cpu", "nvme"});
  return v == "cpu" ? OffloadDevice::kCpu : v == "nvme" ? OffloadDevice::kNvme : OffloadDevice::kNone;
}

// ---- field builders ------------------------------------------------------------------------

template <class Get>
Field bool_field(std::string key, Get get, std::string doc) {
  return {std::move(key), "bool", std::move(doc),
          [get](Config& c, const YAML::Node& n) { get(c) = read_bool(n); },
          [get](const Config& c) { return fmt_bool(get(const_cast<Config&>(c))); }};
}

template <class Get>
Field int_field(std::string key, Get get, int64_t lo, int64_t hi, std::string doc) {
  std::string type = hi == std::numeric_limits<int64_t>::max() ? fmt::format("int ≥ {}", lo)
                                                               : fmt::format("int {}..{}", lo, hi);
  return {std::move(key), type, std::move(doc),
          [=](Config& c, const YAML::Node& n) { get(c) = read_int(n, lo, hi); },
          [get](const Config& c) { return fmt_int(get(const_cast<Config&>(c))); }};
}

template <class Get>
Field float_field(std::string key, Get get, FloatRange r, std::string doc) {
  return {std::move(key), "float", std::move(doc),
          [=](Config& c, const YAML::Node& n) { get(c) = read_float(n, r); },
          [get](const Config& c) { return fmt_float(get(const_cast<Config&>(c))); }};
}

template <class Get>
Field string_field(std::string key, Get get, bool nullable, std::string doc) {
  return {std::move(key), "string", std::move(doc),
          [=](Config& c, const YAML::Node& n) { get(c) = read_string(n, nullable); },
          [get](const Config& c) { return quote(get(const_cast<Config&>(c))); }};
}

template <class Get>
Field enum_field(std::string key, Get get, std::vector<std::string> options, std::string doc,
                 bool nullable = false) {
  std::string type = join(options, "|");
  return {std::move(key), type, std::move(doc),
          [=](Config& c, const YAML::Node& n) {
            get(c) = (nullable && (n.IsNull() || (n.IsScalar() && (lower(n.Scalar()) == "none" || n.Scalar().empty()))))
                         ? std::string() : read_enum(n, options);
          },
          [get](const Config& c) { return quote(get(const_cast<Config&>(c))); }};
}

template <class Get>
Field device_field(std::string key, Get get, std::string doc) {
  return {std::move(key), "none|cpu|nvme", std::move(doc),
          [get](Config& c, const YAML::Node& n) { get(c) = read_device(n); },
          [get](const Config& c) { return quote(device_name(get(const_cast<Config&>(c)))); }};
}

// "auto" or an inner value. The inner reader writes into T.
template <class T, class Get, class Read, class Print>
Field auto_field(std::string key, std::string type, Get get, Read read, Print print, std::string doc) {
  return {std::move(key), type + " | auto", std::move(doc),
          [=](Config& c, const YAML::Node& n) {
            Auto<T>& a = get(c);
            if (is_auto(n)) {
              a.is_auto = true;
            } else {
              a.value = read(n);
              a.is_auto = false;
            }
          },
          [=](const Config& c) {
            const Auto<T>& a = get(const_cast<Config&>(c));
            return a.is_auto ? std::string("auto") : print(a.value);
          }};
}

template <class Get>
Field auto_int(std::string key, Get get, int64_t lo, std::string doc) {
  return auto_field<int64_t>(
      std::move(key), fmt::format("int ≥ {}", lo), get,
      [lo](const YAML::Node& n) { return read_int(n, lo, std::numeric_limits<int64_t>::max()); },
      fmt_int, std::move(doc));
}

template <class Get>
Field auto_float(std::string key, Get get, FloatRange r, std::string doc) {
  return auto_field<double>(std::move(key), "float", get,
                            [r](const YAML::Node& n) { return read_float(n, r); }, fmt_float,
                            std::move(doc));
}

template <class Get>
Field auto_bool(std::string key, Get get, std::string doc) {
  return auto_field<bool>(std::move(key), "bool", get, read_bool, fmt_bool, std::move(doc));
}

#define ZEAL_GET(member) [](Config& c) -> auto& { return c.member; }

constexpr int64_t kMaxInt = std::numeric_limits<int64_t>::max();
const FloatRange kNonNegative{};
const FloatRange kPositive{0.0, std::numeric_limits<double>::infinity(), true, false};
const FloatRange kUnit{0.0, 1.0, false, false};

// A learning rate for every parameter group ("auto" or a float), or DeepSpeed's list of one rate per
// group (checked against the groups at prepare).
template <class GetScalar, class GetList>
Field rate_or_list(std::string key, GetScalar scalar, GetList list, std::string doc) {
  Field f = auto_float(key, scalar, kNonNegative, std::move(doc) + "; a list: one per parameter group");
  f.type = "float | auto | list of floats";
  auto parse_scalar = f.parse;
  auto print_scalar = f.print;
  f.parse = [parse_scalar, scalar, list](Config& c, const YAML::Node& n) {
    if (!n.IsSequence()) {
      list(c).clear();
      parse_scalar(c, n);
      return;
    }
    if (n.size() == 0) throw ValueError{"an empty list (give one rate per parameter group, or one rate)"};
    std::vector<double> rates;
    for (const auto& e : n) rates.push_back(read_float(e, kNonNegative));
    list(c) = rates;
    scalar(c) = {rates.front(), false};
  };
  f.print = [print_scalar, list](const Config& c) {
    const auto& rates = list(const_cast<Config&>(c));
    if (rates.empty()) return print_scalar(c);
    std::vector<std::string> q;
    for (double r : rates) q.push_back(fmt_float(r));
    return "[" + join(q, ", ") + "]";
  };
  return f;
}


std::vector<Field> make_fields() {
  std::vector<Field> f;
  // Launcher (Accelerate's top-level keys).
  f.push_back(enum_field("distributed_type", ZEAL_GET(launch.distributed_type),
                         {"NO", "MULTI_CPU", "MULTI_GPU", "DEEPSPEED", "FSDP"},
                         "How ranks share the model; DEEPSPEED and FSDP read their sections"));
  f.push_back(int_field("num_processes", ZEAL_GET(launch.num_processes), 1, 1 << 20,
                        "Processes over all machines (the world size)"));
  f.push_back(int_field("num_machines", ZEAL_GET(launch.num_machines), 1, 1 << 16, "Machines (nodes)"));
  f.push_back(int_field("machine_rank", ZEAL_GET(launch.machine_rank), 0, 1 << 16,
                        "This machine's index, 0..num_machines-1"));
  f.push_back(string_field("main_process_ip", ZEAL_GET(launch.main_process_ip), false,
                           "Address of machine 0, where the rendezvous store runs"));
  f.push_back(int_field("main_process_port", ZEAL_GET(launch.main_process_port), 1, 65535,
                        "Port of the rendezvous store"));
  f.push_back(enum_field("rdzv_backend", ZEAL_GET(launch.rdzv_backend), {"static", "c10d"},
                         "Rendezvous: static (fixed ranks) or c10d"));
  f.push_back(bool_field("same_network", ZEAL_GET(launch.same_network), "All machines on one network"));
  f.push_back(bool_field("use_cpu", ZEAL_GET(launch.use_cpu), "Train on the CPU even when GPUs exist"));
  f.push_back(string_field("gpu_ids", ZEAL_GET(launch.gpu_ids), false,
                           "GPUs to use: all or a list like 0,1 (as the process sees them); local rank r takes the r-th"));
  // A millisecond to 30 days: the deadline is kept in milliseconds.
  f.push_back(float_field("comm_timeout", ZEAL_GET(launch.comm_timeout), FloatRange{0.001, 2592000.0, false, false},
                          "Seconds a collective may wait before its rank fails with a report"));
  f.push_back(enum_field("mixed_precision", ZEAL_GET(mixed_precision), {"no", "fp16", "bf16"},
                         "Compute precision; sets fp16.enabled / bf16.enabled"));
  // Batch sizes and steps (DeepSpeed's top-level keys).
  f.push_back(auto_int("train_batch_size", ZEAL_GET(train_batch_size), 1,
                       "Global batch: micro × accumulation × world (left out: derived)"));
  f.push_back(auto_int("train_micro_batch_size_per_gpu", ZEAL_GET(train_micro_batch_size_per_gpu), 1,
                       "Batch per rank per micro-step (left out: from the data loader)"));
  f.push_back(auto_int("gradient_accumulation_steps", ZEAL_GET(gradient_accumulation_steps), 1,
                       "Micro-steps per optimizer step"));
  f.push_back(auto_float("gradient_clipping", ZEAL_GET(gradient_clipping), kNonNegative,
                         "Clip the global gradient norm to this (0: off)"));
  f.push_back(int_field("steps_per_print", ZEAL_GET(steps_per_print), 1, kMaxInt,
                        "Rank 0 prints DeepSpeed's progress line (step, skipped, lr, grad_norm) every this many steps"));
  f.push_back(bool_field("wall_clock_breakdown", ZEAL_GET(wall_clock_breakdown),
                         "Rank 0 prints forward/backward/step milliseconds and the time blocked on reductions, gathers, reads and writes with each steps_per_print line"));
  f.push_back(bool_field("broadcast_buffers", ZEAL_GET(broadcast_buffers),
                         "After every optimizer step the model's buffers take rank 0's values (DDP's broadcast_buffers)"));
  f.push_back(enum_field("memory_check", ZEAL_GET(memory_check), {"warn", "error", "off"},
                         "At prepare: the rank's predicted peak against the memory it may use; warn or refuse when it "
                         "will not fit"));
  // Experiment trackers.
  f.push_back({"log_with", "list of strings",
               "Trackers for engine.init_trackers / engine.log: tensorboard, csv, jsonl or all (Accelerate's other "
               "names are accepted and log nowhere)",
               [](Config& c, const YAML::Node& n) {
                 static const std::vector<std::string> known = {"tensorboard", "csv", "jsonl", "all", "wandb",
                                                                "comet_ml", "mlflow", "aim", "clearml", "dvclive",
                                                                "swanlab", "trackio"};
                 std::vector<std::string> names;
                 auto add = [&](std::string s) {
                   s.erase(0, s.find_first_not_of(" \t"));
                   s.erase(s.find_last_not_of(" \t") + 1);
                   if (s.empty()) return;
                   if (std::find(known.begin(), known.end(), lower(s)) == known.end()) {
                     throw ValueError{fmt::format("expected tracker names among {}, got {}", join(known, ", "), quote(s))};
                   }
                   names.push_back(lower(s));
                 };
                 if (n.IsSequence()) {
                   for (const auto& e : n) add(need_scalar(e, "a list of tracker names"));
                 } else if (!n.IsNull()) {
                   const std::string s = need_scalar(n, "a list of tracker names");
                   for (size_t start = 0; start <= s.size();) {
                     const size_t comma = s.find(',', start);
                     add(s.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
                     if (comma == std::string::npos) break;
                     start = comma + 1;
                   }
                 }
                 c.log_with = names;
               },
               [](const Config& c) {
                 std::vector<std::string> q;
                 for (const auto& s : c.log_with) q.push_back(quote(s));
                 return "[" + join(q, ", ") + "]";
               }});
  f.push_back(string_field("logging_dir", ZEAL_GET(logging_dir), false,
                           "Folder of log_with's trackers: each writes into logging_dir/<project name>"));
  for (const char* section : {"tensorboard", "csv_monitor"}) {
    const std::string s = section;
    const bool tb = s == "tensorboard";
    auto get = [tb](Config& c) -> MonitorConfig& { return tb ? c.tensorboard : c.csv_monitor; };
    f.push_back(bool_field(s + ".enabled", [get](Config& c) -> bool& { return get(c).enabled; },
                           tb ? "DeepSpeed's TensorBoard monitor: event files of engine.log's scalars"
                              : "DeepSpeed's CSV monitor: one <metric>.csv per metric"));
    f.push_back(string_field(s + ".output_path", [get](Config& c) -> std::string& { return get(c).output_path; }, true,
                             "Folder of the monitor's job folder (empty: logging_dir)"));
    f.push_back(string_field(s + ".job_name", [get](Config& c) -> std::string& { return get(c).job_name; }, false,
                             "The monitor writes into output_path/job_name"));
  }
  // ZeRO.
  f.push_back(int_field("zero_optimization.stage", ZEAL_GET(zero.stage), 0, 3,
                        "0: replicate (DDP); 1: shard optimizer states; 2: + gradients; 3: + parameters"));
  f.push_back(device_field("zero_optimization.offload_optimizer.device",
                           ZEAL_GET(zero.offload_optimizer.device),
                           "Where fp32 master weights and Adam states live (stage ≥ 1)"));
  f.push_back(string_field("zero_optimization.offload_optimizer.nvme_path",
                           ZEAL_GET(zero.offload_optimizer.nvme_path), true, "Directory for nvme offload"));
  f.push_back(bool_field("zero_optimization.offload_optimizer.pin_memory",
                         ZEAL_GET(zero.offload_optimizer.pin_memory), "Page-locked host buffers"));
  f.push_back(int_field("zero_optimization.offload_optimizer.buffer_count",
                        ZEAL_GET(zero.offload_optimizer.buffer_count), 1, 1024,
                        "Window sets of the nvme optimizer step (up to 3 used)"));
  f.push_back(bool_field("zero_optimization.offload_optimizer.fast_init",
                         ZEAL_GET(zero.offload_optimizer.fast_init), "Skip writing initial states to nvme"));
  // DeepSpeed's partial offload (ZeRO-Offload++): zeal offloads all of the state or none of it.
  f.push_back({"zero_optimization.offload_optimizer.ratio", "float", "Fraction of optimizer states offloaded: 1.0 only",
               [](Config& c, const YAML::Node& n) {
                 const double r = read_float(n, kUnit);
                 if (r != 1.0) {
                   throw ValueError{fmt::format("{} would offload part of the optimizer state; zeal offloads all of it "
                                                "or none (DeepSpeed's partial offload is not implemented): set 1.0 or "
                                                "leave it out", fmt_float(r))};
                 }
                 c.zero.offload_optimizer.ratio = r;
               },
               [](const Config& c) { return fmt_float(c.zero.offload_optimizer.ratio); }});
  f.push_back(device_field("zero_optimization.offload_param.device", ZEAL_GET(zero.offload_param.device),
                           "Where released parameter shards live (stage 3)"));
  f.push_back(string_field("zero_optimization.offload_param.nvme_path", ZEAL_GET(zero.offload_param.nvme_path),
                           true, "Directory for nvme offload"));
  f.push_back(bool_field("zero_optimization.offload_param.pin_memory", ZEAL_GET(zero.offload_param.pin_memory),
                         "Page-locked host memory for the shards a GPU keeps in host memory (`cpu`; `nvme`'s "
                         "`max_in_cpu`)"));
  f.push_back(int_field("zero_optimization.offload_param.buffer_count",
                        ZEAL_GET(zero.offload_param.buffer_count), 1, 1024,
                        "Units read ahead from nvme (CPU ranks; on a GPU a unit's shards are read when its gather is "
                        "issued)"));
  f.push_back(int_field("zero_optimization.offload_param.buffer_size", ZEAL_GET(zero.offload_param.buffer_size),
                        1, kMaxInt, "Elements per read-ahead buffer for nvme (CPU ranks)"));
  f.push_back(int_field("zero_optimization.offload_param.max_in_cpu", ZEAL_GET(zero.offload_param.max_in_cpu),
                        0, kMaxInt, "Shard elements per rank kept in host memory instead of nvme (on a GPU too: off "
                        "the GPU)"));
  f.push_back(bool_field("zero_optimization.overlap_comm", ZEAL_GET(zero.overlap_comm),
                         "Reduce gradients while backward runs (default: true for stage 3)"));
  f.push_back(bool_field("zero_optimization.contiguous_gradients", ZEAL_GET(zero.contiguous_gradients),
                         "Copy gradients into one contiguous buffer as they are produced"));
  f.push_back(auto_int("zero_optimization.reduce_bucket_size", ZEAL_GET(zero.reduce_bucket_size), 1,
                       "Elements reduced at once"));
  f.push_back(int_field("zero_optimization.allgather_bucket_size", ZEAL_GET(zero.allgather_bucket_size), 1,
                        kMaxInt, "Elements all-gathered at once (stages 1-2)"));
  f.push_back(bool_field("zero_optimization.allgather_partitions", ZEAL_GET(zero.allgather_partitions),
                         "All-gather updated partitions (stages 1-2)"));
  f.push_back(bool_field("zero_optimization.reduce_scatter", ZEAL_GET(zero.reduce_scatter),
                         "Reduce-scatter gradients instead of all-reduce (stages 1-2)"));
  f.push_back(bool_field("zero_optimization.round_robin_gradients", ZEAL_GET(zero.round_robin_gradients),
                         "Spread gradient copies over ranks (stages 1-2 with offload)"));
  f.push_back(int_field("zero_optimization.sub_group_size", ZEAL_GET(zero.sub_group_size), 1, kMaxInt,
                        "Elements per optimizer step group (offload streaming granularity)"));
  f.push_back(auto_int("zero_optimization.stage3_prefetch_bucket_size",
                       ZEAL_GET(zero.stage3_prefetch_bucket_size), 0, "Elements prefetched ahead (stage 3)"));
  f.push_back(auto_int("zero_optimization.stage3_param_persistence_threshold",
                       ZEAL_GET(zero.stage3_param_persistence_threshold), 0,
                       "Parameters smaller than this stay gathered (stage 3)"));
  f.push_back(int_field("zero_optimization.stage3_max_live_parameters",
                        ZEAL_GET(zero.stage3_max_live_parameters), 0, kMaxInt,
                        "Most gathered elements at once (stage 3)"));
  f.push_back(int_field("zero_optimization.stage3_max_reuse_distance",
                        ZEAL_GET(zero.stage3_max_reuse_distance), 0, kMaxInt,
                        "Keep a unit gathered if it is used again within this many elements (stage 3)"));
  f.push_back(bool_field("zero_optimization.stage3_gather_16bit_weights_on_model_save",
                         ZEAL_GET(zero.stage3_gather_16bit_weights_on_model_save),
                         "Save a consolidated 16-bit model (stage 3)"));
  f.push_back(bool_field("zero_optimization.zero3_init_flag", ZEAL_GET(zero.zero3_init_flag),
                         "Build the model already partitioned (stage 3)"));
  f.push_back({"zero_optimization.unit_names", "list of strings",
               "Module types that form sharding units (fsdp_transformer_layer_cls_to_wrap)",
               [](Config& c, const YAML::Node& n) {
                 std::vector<std::string> names;
                 if (n.IsSequence()) {
                   for (const auto& e : n) names.push_back(need_scalar(e, "a list of type names"));
                 } else {
                   // Accelerate writes "BertLayer,BertEmbeddings".
                   std::string s = need_scalar(n, "a list of type names");
                   size_t start = 0;
                   while (start <= s.size()) {
                     size_t comma = s.find(',', start);
                     std::string part = s.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
                     part.erase(0, part.find_first_not_of(" \t"));
                     part.erase(part.find_last_not_of(" \t") + 1);
                     if (!part.empty()) names.push_back(part);
                     if (comma == std::string::npos) break;
                     start = comma + 1;
                   }
                 }
                 c.zero.unit_names = names;
               },
               [](const Config& c) {
                 std::vector<std::string> q;
                 for (const auto& s : c.zero.unit_names) q.push_back(quote(s));
                 return "[" + join(q, ", ") + "]";
               }});
  f.push_back(bool_field("zero_optimization.hybrid_shard", ZEAL_GET(zero.hybrid_shard),
                         "Shard inside each machine, replicate across machines (HYBRID_SHARD; stages 2 and 3, the "
                         "same number of ranks on every machine, at least 2)"));
  // Asynchronous I/O for nvme offload.
  f.push_back(auto_field<int64_t>(
      "aio.block_size", "int, multiple of 4096", ZEAL_GET(aio.block_size),
      [](const YAML::Node& n) { return read_int(n, 1, kMaxInt); }, fmt_int,
      "Bytes per I/O request (auto: measured at start-up)"));
  f.push_back(auto_field<int64_t>(
      "aio.queue_depth", "int 1..65536", ZEAL_GET(aio.queue_depth),
      [](const YAML::Node& n) { return read_int(n, 1, 65536); }, fmt_int,
      "I/O requests in flight (auto: measured at start-up)"));
  f.push_back(int_field("aio.thread_count", ZEAL_GET(aio.thread_count), 1, 1024, "I/O submission threads"));
  f.push_back(bool_field("aio.single_submit", ZEAL_GET(aio.single_submit), "Submit requests one at a time"));
  f.push_back(bool_field("aio.overlap_events", ZEAL_GET(aio.overlap_events), "Overlap submission and completion"));
  f.push_back(bool_field("aio.verify", ZEAL_GET(aio.verify),
                         "CRC32C per block of swap files, checked on every read (zeal)"));
  // Activation checkpointing.
  f.push_back(bool_field("activation_checkpointing.enabled", ZEAL_GET(activation_checkpointing.enabled),
                         "Checkpoint the activations of zeal::Sharded units (on when a DeepSpeed config has the "
                         "section, or fsdp_activation_checkpointing: true)"));
  f.push_back(int_field("activation_checkpointing.unit_interval", ZEAL_GET(activation_checkpointing.unit_interval), 1,
                        kMaxInt, "Checkpoint every k-th Sharded unit (units 0, k, 2k, …; 1: every unit) (zeal)"));
  f.push_back(bool_field("activation_checkpointing.cpu_checkpointing",
                         ZEAL_GET(activation_checkpointing.cpu_checkpointing),
                         "Keep the checkpoints' inputs in pinned host memory (GPU ranks)"));
  f.push_back(bool_field("activation_checkpointing.synchronize_checkpoint_boundary",
                         ZEAL_GET(activation_checkpointing.synchronize_checkpoint_boundary),
                         "Wait for the device at every checkpoint's boundaries (GPU ranks)"));
  // Precision.
  f.push_back(auto_bool("fp16.enabled", ZEAL_GET(fp16.enabled), "fp16 compute with dynamic loss scaling"));
  f.push_back(float_field("fp16.loss_scale", ZEAL_GET(fp16.loss_scale), kNonNegative,
                          "Static loss scale (0: dynamic)"));
  f.push_back(int_field("fp16.initial_scale_power", ZEAL_GET(fp16.initial_scale_power), 0, 127,
                        "Dynamic scaling starts at 2^this"));
  f.push_back(int_field("fp16.loss_scale_window", ZEAL_GET(fp16.loss_scale_window), 1, kMaxInt,
                        "Steps without overflow before the scale doubles"));
  f.push_back(int_field("fp16.hysteresis", ZEAL_GET(fp16.hysteresis), 1, kMaxInt,
                        "Overflows tolerated before the scale halves"));
  f.push_back(bool_field("fp16.consecutive_hysteresis", ZEAL_GET(fp16.consecutive_hysteresis),
                         "Refill hysteresis after each step without overflow"));
  f.push_back(float_field("fp16.min_loss_scale", ZEAL_GET(fp16.min_loss_scale), kPositive,
                          "The scale never goes below this"));
  f.push_back(auto_bool("bf16.enabled", ZEAL_GET(bf16_enabled), "bf16 compute with fp32 master weights"));
  f.push_back(enum_field("data_types.grad_accum_dtype", ZEAL_GET(grad_accum_dtype), {"fp32", "fp16", "bf16"},
                         "Dtype gradients are summed in across micro-steps (empty: fp32)", true));
  f.push_back(enum_field("communication_data_type", ZEAL_GET(communication_data_type), {"fp32", "fp16", "bf16"},
                         "Dtype gradients are reduced across ranks in (empty: fp32; 16 bits divide first)", true));
  // Optimizer and schedule.
  f.push_back(enum_field("optimizer.type", ZEAL_GET(optimizer.type), {"Adam", "AdamW", "SGD"},
                         "Optimizer zeal builds (empty: the program passes its own)", true));
  f.push_back(auto_float("optimizer.params.lr", ZEAL_GET(optimizer.lr), kNonNegative, "Learning rate"));
  f.push_back(auto_field<std::array<double, 2>>(
      "optimizer.params.betas", "[float, float]", ZEAL_GET(optimizer.betas),
      [](const YAML::Node& n) {
        if (!n.IsSequence() || n.size() != 2)
          throw ValueError{"expected a list of two numbers in [0, 1), like [0.9, 0.999]"};
        const FloatRange r{0.0, 1.0, false, true};
        return std::array<double, 2>{read_float(n[0], r), read_float(n[1], r)};
      },
      [](const std::array<double, 2>& b) { return "[" + fmt_float(b[0]) + ", " + fmt_float(b[1]) + "]"; },
      "Adam's β1, β2"));
  f.push_back(auto_float("optimizer.params.eps", ZEAL_GET(optimizer.eps), kPositive, "Adam's ε"));
  f.push_back(auto_float("optimizer.params.weight_decay", ZEAL_GET(optimizer.weight_decay), kNonNegative,
                         "Weight decay (decoupled for AdamW)"));
  f.push_back(float_field("optimizer.params.momentum", ZEAL_GET(optimizer.momentum), kUnit, "SGD momentum"));
  f.push_back(bool_field("optimizer.params.nesterov", ZEAL_GET(optimizer.nesterov), "SGD Nesterov momentum"));
  f.push_back(bool_field("optimizer.params.adam_w_mode", ZEAL_GET(optimizer.adam_w_mode),
                         "type Adam: decoupled weight decay (AdamW, DeepSpeed's default) or L2 (false)"));
  f.push_back(bool_field("optimizer.params.bias_correction", ZEAL_GET(optimizer.bias_correction),
                         "Adam: divide the moments by 1 − βᵗ"));
  f.push_back(bool_field("optimizer.params.amsgrad", ZEAL_GET(optimizer.amsgrad),
                         "AMSGrad (not implemented: true is refused)"));
  f.push_back(enum_field("scheduler.type", ZEAL_GET(scheduler.type),
                         {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR"},
                         "Learning-rate schedule zeal builds (empty: none or the program's own)", true));
  f.push_back(rate_or_list("scheduler.params.warmup_min_lr", ZEAL_GET(scheduler.warmup_min_lr),
                           ZEAL_GET(scheduler.warmup_min_lrs), "Learning rate at step 0"));
  f.push_back(rate_or_list("scheduler.params.warmup_max_lr", ZEAL_GET(scheduler.warmup_max_lr),
                           ZEAL_GET(scheduler.warmup_max_lrs), "Learning rate after warm-up"));
  f.push_back(auto_int("scheduler.params.warmup_num_steps", ZEAL_GET(scheduler.warmup_num_steps), 0,
                       "Warm-up steps"));
  f.push_back(enum_field("scheduler.params.warmup_type", ZEAL_GET(scheduler.warmup_type), {"log", "linear"},
                         "Warm-up curve"));
  f.push_back(auto_int("scheduler.params.total_num_steps", ZEAL_GET(scheduler.total_num_steps), 0,
                       "Steps of the whole schedule (WarmupDecayLR, WarmupCosineLR)"));
  f.push_back(float_field("scheduler.params.warmup_min_ratio", ZEAL_GET(scheduler.warmup_min_ratio), kUnit,
                          "WarmupCosineLR: start at this fraction of the optimizer's lr"));
  f.push_back(float_field("scheduler.params.cos_min_ratio", ZEAL_GET(scheduler.cos_min_ratio), kUnit,
                          "WarmupCosineLR: end at this fraction of the optimizer's lr"));
  return f;
}

std::map<std::string, std::string> make_not_applicable() {
  // Each key with why accepting it without effect cannot change a result. Keys whose values would
  // change the math are refused instead (refusal_reason below).
  return {
      {"fp8_config", "Accelerate's fp8 settings; zeal computes in fp32, bf16 or fp16 (content is refused)"},
      {"parallelism_config", "Accelerate's tensor/context parallel settings; zeal shards with ZeRO only"},
      {"zero_allow_untested_optimizer", "DeepSpeed's guard against optimizers it has not tested; zeal builds its own"},
      {"zero_force_ds_cpu_optimizer", "chooses DeepSpeed's CPU Adam implementation; zeal's runs on CPU partitions"},
      {"prescale_gradients", "whether DeepSpeed divides by the world size before or after the sum: the same average "
                             "(zeal divides after in fp32, before in 16-bit communication)"},
      {"gradient_predivide_factor", "divides before the sum and multiplies back after: the same average"},
      {"sparse_gradients", "a sparse all-reduce for embedding gradients; zeal reduces them dense, the same sums"},
      {"memory_breakdown", "DeepSpeed's memory printout; use engine.memory()"},
      {"flops_profiler", "a profiler; nothing it does reaches the training"},
      {"wandb", "a logger zeal does not have (tensorboard, csv_monitor and log_with's jsonl are)"},
      {"comet", "a logger zeal does not have (tensorboard, csv_monitor and log_with's jsonl are)"},
      {"comms_logger", "a logger of collectives; use ZEAL_DEBUG_COLLECTIVES"},
      {"activation_checkpointing.partition_activations",
       "splits checkpoints among model-parallel ranks; zeal has no model parallelism, each rank keeps its own"},
      {"activation_checkpointing.contiguous_memory_optimization",
       "copies checkpoints into one preallocated buffer against fragmentation; where they live, not their values"},
      {"activation_checkpointing.number_checkpoints", "sizes that buffer (contiguous_memory_optimization)"},
      {"activation_checkpointing.profile", "DeepSpeed's timing printout of checkpointed forwards"},
      {"dump_state", "prints DeepSpeed's state at start"},
      {"checkpoint", "DeepSpeed's checkpoint options (tag validation, loading of universal checkpoints)"},
      {"elasticity", "elastic batch sizes (an enabled section is refused: it would change the batch)"},
      {"autotuning", "DeepSpeed's autotuner, a separate tool"},
      {"compression_training", "quantization and pruning during training (content is refused)"},
      {"data_efficiency", "curriculum and token dropping (an enabled section is refused: it changes the data)"},
      {"seq_parallel_communication_data_type", "sequence parallelism, which zeal does not do"},
      {"fp16.auto_cast", "casting floating inputs to fp16 (true is refused: use engine.autocast())"},
      {"zero_optimization.load_from_fp32_weights", "a checkpoint-loading choice"},
      {"zero_optimization.elastic_checkpoint", "a checkpoint-format choice"},
      {"zero_optimization.ignore_unused_parameters", "zeal always reduces zeros for parameters without a gradient"},
      {"zero_optimization.memory_efficient_linear", "a memory-saving Linear implementation; the same values"},
      {"zero_optimization.offload_optimizer.pipeline_read", "overlap of NVMe reads; timing only"},
      {"zero_optimization.offload_optimizer.pipeline_write", "overlap of NVMe writes; timing only"},
      {"zero_optimization.offload_optimizer.pipeline", "overlap of NVMe reads and writes; timing only"},
      {"zero_optimization.mics_shard_size", "MiCS sharding groups: where shards live, not what is computed"},
      {"zero_optimization.zero_hpz_partition_size", "ZeRO++'s secondary partition: where shards live"},
      {"zero_optimization.zero_quantized_weights", "ZeRO++'s quantized weights (true is refused)"},
      {"zero_optimization.zero_quantized_gradients", "ZeRO++'s quantized gradients (true is refused)"},
      {"zero_optimization.stage3_module_granularity_threshold", "fuses DeepSpeed's small modules; zeal's units are "
                                                                "the Sharded members"},
      {"zero_optimization.log_trace_cache_warnings", "logging"},
      {"aio.use_gds", "GPUDirect Storage; timing only"},
      {"aio.intra_op_parallelism", "threads of DeepSpeed's aio; timing only"},
      {"bf16.immediate_grad_update", "DeepSpeed adds bf16 gradients into fp32 at once; zeal accumulates in fp32 too"},
      {"bf16.check_grad_overflow", "zeal always checks gradients for inf and nan"},
      {"optimizer.params.torch_adam", "torch's Adam or DeepSpeed's fused one: the same update"},
      {"scheduler.params.last_batch_iteration", "where a schedule starts (-1, the start; another value is refused)"},
  };
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t sub = prev[j - 1] + (std::tolower(a[i - 1]) == std::tolower(b[j - 1]) ? 0 : 1);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, sub});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::string leaf(const std::string& key) {
  size_t dot = key.rfind('.');
  return dot == std::string::npos ? key : key.substr(dot + 1);
}

}  // namespace

namespace {

bool yaml_true(const YAML::Node& n) {
  if (!n || !n.IsScalar()) return false;
  std::string v = n.Scalar();
  for (auto& c : v) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return v == "true" || v == "yes" || v == "on";
}
bool section_enabled(const YAML::Node& n) { return n.IsMap() && yaml_true(n["enabled"]); }
bool has_content(const YAML::Node& n) { return (n.IsMap() || n.IsSequence()) && n.size() > 0; }
}  // namespace

std::optional<std::string> refusal_reason(const std::string& key, const YAML::Node& v) {
  if ((key == "zero_optimization.zero_quantized_weights" || key == "zero_optimization.zero_quantized_gradients") &&
      yaml_true(v)) {
    return "zeal does not quantize weights or gradients (it would change every update); set it to false or leave it out";
  }
  if (key == "fp16.auto_cast" && yaml_true(v)) {
    return "zeal does not cast the model's inputs; run the forward under engine.autocast() instead, and set this to "
           "false or leave it out";
  }
  if (key == "scheduler.params.last_batch_iteration" && v.IsScalar() && v.Scalar() != "-1") {
    return "a schedule started at another step changes every learning rate; leave it at -1 (a resumed run continues "
           "its schedule from the checkpoint)";
  }
  if (key == "compression_training" && has_content(v)) {
    return "zeal does not quantize or prune during training (it would change the model); remove the section";
  }
  if ((key == "data_efficiency" || key == "elasticity") && section_enabled(v)) {
    return key == "elasticity" ? "elastic training changes the batch sizes; zeal trains the configured ones (set "
                                 "enabled: false)"
                               : "curriculum learning and token dropping change the data; zeal does not do them (set "
                                 "enabled: false)";
  }
  if (key == "fp8_config" && has_content(v)) return "zeal does not compute in fp8; remove the section";
  return std::nullopt;
}

const std::vector<Field>& fields() {
  static const std::vector<Field> f = make_fields();
  return f;
}

const Field* find_field(const std::string& key) {
  for (const auto& f : fields())
    if (f.key == key) return &f;
  return nullptr;
}

bool is_section(const std::string& path) {
  for (const auto& f : fields())
    if (f.key.size() > path.size() && f.key.compare(0, path.size(), path) == 0 && f.key[path.size()] == '.')
      return true;
  return false;
}

std::vector<std::string> keys_under(const std::string& section) {
  std::vector<std::string> out;
  const std::string prefix = section.empty() ? "" : section + ".";
  auto add = [&](const std::string& key) {
    if (key.compare(0, prefix.size(), prefix) != 0) return;
    std::string rest = key.substr(prefix.size());
    std::string first = rest.substr(0, rest.find('.'));
    if (std::find(out.begin(), out.end(), first) == out.end()) out.push_back(first);
  };
  for (const auto& f : fields()) add(f.key);
  return out;
}

const std::map<std::string, std::string>& not_applicable_keys() {
  static const auto m = make_not_applicable();
  return m;
}

const std::string* not_applicable_reason(const std::string& key) {
  const auto& m = not_applicable_keys();
  auto it = m.find(key);
  return it == m.end() ? nullptr : &it->second;
}

std::string closest(const std::vector<std::string>& candidates, const std::string& word) {
  std::string best;
  size_t best_d = std::string::npos;
  for (const auto& c : candidates) {
    const size_t d = edit_distance(word, c);
    if (d < best_d) best_d = d, best = c;
  }
  return best_d <= std::max<size_t>(2, word.size() / 3) ? best : std::string();
}

std::string suggest(const std::string& section, const std::string& unknown) {
  // Same name elsewhere: the user put a key under the wrong section.
  for (const auto& f : fields()) {
    if (leaf(f.key) == unknown) {
      std::string parent = f.key.substr(0, f.key.size() - unknown.size());
      if (!parent.empty()) parent.pop_back();
      if (parent != section) return fmt::format("did you mean {}? (it belongs under {})", f.key,
                                                parent.empty() ? std::string("the top level") : parent);
    }
  }
  std::vector<std::string> candidates = keys_under(section);
  if (section.empty()) {
    for (const char* k : {"deepspeed_config", "fsdp_config", "megatron_lm_config", "dynamo_backend"})
      candidates.push_back(k);
  }
  if (std::string best = closest(candidates, unknown); !best.empty())
    return fmt::format("did you mean {}?", section.empty() ? best : section + "." + best);
  std::vector<std::string> valid = keys_under(section);
  if (valid.size() <= 8) return "valid keys here: " + join(valid, ", ");
  return fmt::format("no key like it {}; `zeal config keys` lists all {} keys there",
                     section.empty() ? std::string("at the top level") : "under " + section, valid.size());
}

std::string scalar_text(const YAML::Node& n) { return kind_of(n); }

std::string quote(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

}  // namespace zeal::config_detail
