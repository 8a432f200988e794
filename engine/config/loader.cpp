// Reading config files: zeal's own keys (DeepSpeed's plus Accelerate's top level), Accelerate's
// deepspeed_config / fsdp_config sections, DeepSpeed files named by deepspeed_config_file, and
// overrides from the environment and flags.
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <sstream>

#include <fmt/format.h>
#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>

#include "engine/config/config.h"
#include "engine/config/finalize.h"
#include "engine/config/schema.h"
#include "engine/error.h"

namespace zeal {
namespace cd = config_detail;
namespace {

constexpr uintmax_t kMaxConfigBytes = 16u << 20;

std::string location(const std::string& file, const YAML::Node& n) {
  const YAML::Mark m = n.Mark();
  if (m.is_null()) return file;
  return fmt::format("{}:{}:{}", file, m.line + 1, m.column + 1);
}

// JSON's trailing commas (`[1, 2,]`, `{"a": 1,}`): YAML reads them, DeepSpeed's json.load does not,
// so a .json file with one would work here and fail there. Returns "line:col" of the first, or "".
std::string trailing_comma(const std::string& text) {
  bool in_string = false;
  int line = 1, col = 0, comma_line = 0, comma_col = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    const char ch = text[i];
    ++col;
    if (ch == '\n') ++line, col = 0;
    if (in_string) {
      if (ch == '\\') ++i, ++col;
      else if (ch == '"') in_string = false;
      continue;
    }
    if (ch == '"') in_string = true, comma_line = 0;
    else if (ch == ',') comma_line = line, comma_col = col;
    else if ((ch == '}' || ch == ']') && comma_line) return fmt::format("{}:{}", comma_line, comma_col);
    else if (!std::isspace(static_cast<unsigned char>(ch))) comma_line = 0;
  }
  return "";
}

// Where a second document with content starts, if the text has one. yaml-cpp's LoadAll can loop
// forever on some malformed input (it keeps returning empty documents), so the documents are
// walked as events, a bounded number of times.
class DocumentCounter : public YAML::EventHandler {
 public:
  void OnDocumentStart(const YAML::Mark&) override { content_ = false; }
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark& m, YAML::anchor_t) override { note(m, false); }
  void OnAlias(const YAML::Mark& m, YAML::anchor_t) override { note(m, true); }
  void OnScalar(const YAML::Mark& m, const std::string&, YAML::anchor_t, const std::string&) override { note(m, true); }
  void OnSequenceStart(const YAML::Mark& m, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {
    note(m, true);
  }
  void OnSequenceEnd() override {}
  void OnMapStart(const YAML::Mark& m, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {
    note(m, true);
  }
  void OnMapEnd() override {}
  bool content() const { return content_; }
  const YAML::Mark& first() const { return first_; }

 private:
  void note(const YAML::Mark& m, bool content) {
    if (content && !content_) first_ = m;
    content_ = content_ || content;
  }
  bool content_ = false;
  YAML::Mark first_;
};

std::optional<YAML::Mark> second_document(const std::string& text) {
  std::istringstream in(text);
  YAML::Parser parser(in);
  DocumentCounter counter;
  int with_content = 0;
  for (int i = 0; i < 64 && parser.HandleNextDocument(counter); ++i) {
    if (counter.content() && ++with_content == 2) return counter.first();
  }
  return std::nullopt;
}

// One config document from `text`: a YAML syntax error, a second document (after `---`) or, in a
// .json file, a trailing comma is a problem naming the file and line; never a silent default.
std::optional<YAML::Node> read_document(const std::string& text, const std::string& name,
                                        std::vector<std::string>& errors) {
  const std::string ext = std::filesystem::path(name).extension().string();
  if (ext == ".json" || ext == ".JSON") {
    if (const std::string at = trailing_comma(text); !at.empty()) {
      errors.push_back(fmt::format("{}:{}: trailing comma: JSON does not allow one (DeepSpeed's json.load would "
                                   "refuse this file)", name, at));
      return std::nullopt;
    }
  }
  YAML::Node root;
  std::optional<YAML::Mark> second;
  try {
    root = YAML::Load(text);
    second = second_document(text);
  } catch (const YAML::ParserException& e) {
    errors.push_back(fmt::format("{}:{}:{}: YAML syntax error: {}", name, e.mark.line + 1, e.mark.column + 1, e.msg));
    return std::nullopt;
  } catch (const YAML::Exception& e) {
    // yaml-cpp's DeepRecursion and the like: no line to give beyond its own.
    errors.push_back(fmt::format("{}: cannot read as YAML: {}", name, e.msg.empty() ? e.what() : e.msg));
    return std::nullopt;
  }
  if (second) {
    errors.push_back(fmt::format("{}:{}:{}: a second YAML document would be ignored; a config file holds one "
                                 "document — remove the `---` or split the file",
                                 name, second->line + 1, second->column + 1));
    return std::nullopt;
  }
  return root;
}

bool is_empty(const YAML::Node& n) { return n.IsNull() || (n.IsMap() && n.size() == 0); }

std::string upper(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

// Accelerate's deepspeed_config inline keys and the canonical keys they set.
const std::map<std::string, std::string>& deepspeed_inline_keys() {
  static const std::map<std::string, std::string> m = {
      {"zero_stage", "zero_optimization.stage"},
      {"offload_optimizer_device", "zero_optimization.offload_optimizer.device"},
      {"offload_param_device", "zero_optimization.offload_param.device"},
      {"offload_optimizer_nvme_path", "zero_optimization.offload_optimizer.nvme_path"},
      {"offload_param_nvme_path", "zero_optimization.offload_param.nvme_path"},
      {"zero3_init_flag", "zero_optimization.zero3_init_flag"},
      {"zero3_save_16bit_model", "zero_optimization.stage3_gather_16bit_weights_on_model_save"},
      {"gradient_accumulation_steps", "gradient_accumulation_steps"},
      {"gradient_clipping", "gradient_clipping"},
  };
  return m;
}
// Accelerate's deepspeed_config keys about its own multi-node launcher: recorded only.
const std::set<std::string> kDeepspeedLauncherKeys = {
    "deepspeed_multinode_launcher", "deepspeed_hostfile", "deepspeed_exclusion_filter",
    "deepspeed_inclusion_filter", "deepspeed_moe_layer_cls_names"};

// Accelerate keys about its own tooling (TPUs, debugging, notebooks): recorded silently.
const std::set<std::string> kAccelerateAdminKeys = {
    "debug", "downcast_bf16", "main_training_function", "tpu_env", "tpu_use_cluster", "tpu_use_sudo",
    "tpu_name", "tpu_zone", "commands", "command_file", "enable_cpu_affinity", "ipex_config",
    "mpirun_config", "dynamo_config"};

// Old DeepSpeed spellings.
const std::map<std::string, std::string>& aliases() {
  static const std::map<std::string, std::string> m = {
      {"bfloat16.enabled", "bf16.enabled"},
      {"zero_optimization.stage3_gather_fp16_weights_on_model_save",
       "zero_optimization.stage3_gather_16bit_weights_on_model_save"},
  };
  return m;
}

class Loader {
 public:
  Loader(Config& config, std::vector<std::string>& errors) : c_(config), errors_(errors) {}

  void load_root(const YAML::Node& root, const std::string& file) {
    if (root.IsNull()) return;
    if (!root.IsMap()) {
      error(location(file, root), "", "the file must hold a mapping of keys, got " + cd::scalar_text(root));
      return;
    }
    check_duplicates(root, file, "");
    std::optional<YAML::Node> ds, fsdp;
    for (const auto& kv : root) {
      const std::string key = kv.first.Scalar();
      if (key == "deepspeed_config") {
        ds = kv.second;
        ds_key_ = kv.first;
      } else if (key == "fsdp_config") {
        fsdp = kv.second;
        fsdp_key_ = kv.first;
      } else {
        top_level(key, kv.first, kv.second, file);
      }
    }
    const bool type_given = c_.origins.count("distributed_type") > 0;
    if (ds && !is_empty(*ds)) {
      if (!type_given) assign("distributed_type", YAML::Node("DEEPSPEED"), file_origin(file, ds_key_));
      if (c_.launch.distributed_type == "DEEPSPEED") {
        deepspeed_section(*ds, file);
      } else {
        c_.notes.push_back(fmt::format("{}: deepspeed_config ignored: distributed_type is {}",
                                       location(file, ds_key_), c_.launch.distributed_type));
      }
    }
    if (fsdp && !is_empty(*fsdp)) {
      if (!type_given) assign("distributed_type", YAML::Node("FSDP"), file_origin(file, fsdp_key_));
      if (c_.launch.distributed_type == "FSDP") {
        fsdp_section(*fsdp, file);
      } else {
        c_.notes.push_back(fmt::format("{}: fsdp_config ignored: distributed_type is {}",
                                       location(file, fsdp_key_), c_.launch.distributed_type));
      }
    }
  }

  void load_file(const std::string& path) {
    std::error_code ec;
    if (!std::filesystem::exists(path, ec)) {
      errors_.push_back(fmt::format("{}: no such config file", path));
      return;
    }
    if (std::filesystem::is_directory(path, ec)) {
      errors_.push_back(fmt::format("{}: is a directory, not a config file", path));
      return;
    }
    // At most kMaxConfigBytes are read: a device (/dev/zero) or an endless pipe is refused, not read forever.
    std::ifstream in(path, std::ios::binary);
    if (!in) {
      errors_.push_back(fmt::format("{}: cannot open the file: {}", path, std::strerror(errno)));
      return;
    }
    std::string text(kMaxConfigBytes + 1, '\0');
    in.read(text.data(), static_cast<std::streamsize>(text.size()));
    if (in.bad()) {
      errors_.push_back(fmt::format("{}: cannot read the file: {}", path, std::strerror(errno)));
      return;
    }
    text.resize(static_cast<size_t>(in.gcount()));
    if (text.size() > kMaxConfigBytes) {
      errors_.push_back(fmt::format("{}: more than {} MiB; a config file is smaller", path, kMaxConfigBytes >> 20));
      return;
    }
    if (auto root = read_document(text, path, errors_)) load_root(*root, path);
  }

  // Sets canonical `key` from `value`; records the origin or an error naming both.
  void assign(const std::string& key, const YAML::Node& value, const Origin& origin,
              const std::string& shown_key = "") {
    const cd::Field* f = cd::find_field(key);
    ZEAL_CHECK(f != nullptr) << "no field " << key;
    try {
      f->parse(c_, value);
      c_.origins[key] = origin;
    } catch (const cd::ValueError& e) {
      std::string k = shown_key.empty() || shown_key == key ? key : fmt::format("{} (sets {})", shown_key, key);
      error(origin_text(origin), k, e.message);
    }
  }

 private:
  void error(const std::string& where, const std::string& key, const std::string& message) {
    if (key.empty()) {
      errors_.push_back(fmt::format("{}: {}", where, message));
    } else {
      errors_.push_back(fmt::format("{}: {}: {}", where, key, message));
    }
  }

  static std::string origin_text(const Origin& o) {
    switch (o.kind) {
      case Origin::Kind::kEnvironment: return "environment " + o.where;
      case Origin::Kind::kFlag: return "flag " + o.where;
      default: return o.where;
    }
  }

  static Origin file_origin(const std::string& file, const YAML::Node& n) {
    return {Origin::Kind::kFile, location(file, n)};
  }

  void check_duplicates(const YAML::Node& map, const std::string& file, const std::string& section) {
    std::map<std::string, YAML::Node> seen;
    for (const auto& kv : map) {
      const std::string key = kv.first.Scalar();
      auto it = seen.find(key);
      if (it != seen.end()) {
        error(location(file, kv.first), section.empty() ? key : section + "." + key,
              fmt::format("appears twice (first at line {})", it->second.Mark().line + 1));
      } else {
        seen.emplace(key, kv.first);
      }
    }
  }

  void top_level(const std::string& key, const YAML::Node& k, const YAML::Node& v, const std::string& file) {
    if (key == "megatron_lm_config") {
      if (!(v.IsNull() || (v.IsMap() && v.size() == 0)))
        error(location(file, k), key, "Megatron-LM parallelism is not supported by zeal; remove this section");
      return;
    }
    if (key == "dynamo_backend") {
      if (!(v.IsScalar() && upper(v.Scalar()) == "NO"))
        c_.notes.push_back(fmt::format("{}: dynamo_backend {} does not apply to LibTorch C++ programs; ignored",
                                       location(file, k), cd::scalar_text(v)));
      return;
    }
    if (key == "compute_environment") {
      if (!(v.IsScalar() && v.Scalar() == "LOCAL_MACHINE"))
        error(location(file, v), key, fmt::format("only LOCAL_MACHINE is supported, got {}", cd::scalar_text(v)));
      return;
    }
    walk_entry("", key, k, v, file);
  }

  // One key of a DeepSpeed-style mapping at `section` ("" for the top level).
  void walk_entry(const std::string& section, const std::string& key, const YAML::Node& k,
                  const YAML::Node& v, const std::string& file) {
    std::string path = section.empty() ? key : section + "." + key;
    if (path == "bfloat16") path = "bf16";
    if (auto a = aliases().find(path); a != aliases().end()) path = a->second;
    if (cd::find_field(path)) {
      assign(path, v, file_origin(file, v));
      return;
    }
    if (path == "zero_optimization.cpu_offload") {  // DeepSpeed's old spelling of optimizer offload
      try {
        const char* device = cd::read_bool(v) ? "cpu" : "none";
        assign("zero_optimization.offload_optimizer.device", YAML::Node(device), file_origin(file, v), path);
      } catch (const cd::ValueError& e) {
        error(location(file, v), path, e.message);
      }
      return;
    }
    if (cd::is_section(path) || path == "bf16") {
      if (!v.IsMap()) {
        if (v.IsNull()) return;
        error(location(file, v), path, "expected a mapping of keys, got " + cd::scalar_text(v));
        return;
      }
      // DeepSpeed's section on its own turns checkpointing on (its keys only tune it); an explicit
      // enabled: false inside it still wins.
      if (path == "activation_checkpointing") {
        assign("activation_checkpointing.enabled", YAML::Node("true"), file_origin(file, k), path);
      }
      check_duplicates(v, file, path);
      for (const auto& kv : v) walk_entry(path, kv.first.Scalar(), kv.first, kv.second, file);
      return;
    }
    if (section.empty() && kAccelerateAdminKeys.count(path)) {
      c_.recorded[path] = YAML::Dump(v);  // Accelerate's own bookkeeping: nothing to act on
      return;
    }
    if (const std::string* why = cd::not_applicable_reason(path)) {
      if (const auto refused = cd::refusal_reason(path, v)) {
        error(location(file, k), path, *refused);
        return;
      }
      c_.recorded[path] = YAML::Dump(v);
      c_.notes.push_back(fmt::format("{}: {}: {}", location(file, k), path, *why));
      return;
    }
    error(location(file, k), path, "unknown key; " + cd::suggest(section, key));
  }

  void deepspeed_section(const YAML::Node& ds, const std::string& file) {
    if (!ds.IsMap()) {
      error(location(file, ds), "deepspeed_config", "expected a mapping of keys, got " + cd::scalar_text(ds));
      return;
    }
    check_duplicates(ds, file, "deepspeed_config");
    std::optional<YAML::Node> ds_file_node;
    std::vector<std::pair<YAML::Node, std::string>> inline_keys;
    for (const auto& kv : ds) {
      const std::string key = kv.first.Scalar();
      if (key == "deepspeed_config_file") {
        ds_file_node = kv.second;
      } else if (deepspeed_inline_keys().count(key)) {
        inline_keys.emplace_back(kv.first, key);
        assign(deepspeed_inline_keys().at(key), kv.second, file_origin(file, kv.second),
               "deepspeed_config." + key);
      } else if (kDeepspeedLauncherKeys.count(key)) {
        c_.recorded["deepspeed_config." + key] = YAML::Dump(kv.second);
        c_.notes.push_back(fmt::format("{}: deepspeed_config.{}: zeal launch starts every machine's ranks "
                                       "itself; recorded, not used", location(file, kv.first), key));
      } else {
        std::vector<std::string> names;
        for (const auto& [name, target] : deepspeed_inline_keys()) names.push_back(name);
        names.push_back("deepspeed_config_file");
        const std::string best = cd::closest(names, key);
        std::string hint = cd::find_field(key) || cd::is_section(key)
                               ? fmt::format("DeepSpeed keys go in a file named by deepspeed_config_file or at "
                                             "the top level, not inside deepspeed_config")
                           : best.empty() ? fmt::format("no deepspeed_config key is like it ({} are known)", names.size())
                                          : fmt::format("did you mean deepspeed_config.{}?", best);
        error(location(file, kv.first), "deepspeed_config." + key, "unknown key; " + hint);
      }
    }
    if (!ds_file_node) return;
    const YAML::Node& ds_file = *ds_file_node;
    if (!ds_file.IsScalar()) {
      error(location(file, ds_file), "deepspeed_config.deepspeed_config_file", "expected a file path");
      return;
    }
    // Where the file is named: validation holds a mixed_precision from the same config file
    // against it (Accelerate's rule, see validate.cpp).
    c_.recorded["deepspeed_config.deepspeed_config_file"] = location(file, ds_file) + " " + ds_file.Scalar();
    // Accelerate's rule: beside a DeepSpeed file it refuses exactly the inline keys its
    // _deepspeed_config_checks lists; zero3_init_flag is not among them (it applies with the file).
    for (const auto& [k, name] : inline_keys) {
      if (name == "zero3_init_flag") continue;
      error(location(file, k), "deepspeed_config." + name,
            "cannot be set inline together with deepspeed_config_file; set it in " + ds_file.Scalar());
    }
    std::filesystem::path p = ds_file.Scalar();
    if (p.is_relative()) {
      auto candidate = std::filesystem::path(file).parent_path() / p;
      if (!std::filesystem::exists(p) && std::filesystem::exists(candidate)) p = candidate;
    }
    if (!std::filesystem::exists(p)) {
      error(location(file, ds_file), "deepspeed_config.deepspeed_config_file",
            fmt::format("no such file: {}", ds_file.Scalar()));
      return;
    }
    if (depth_ > 4) {
      error(location(file, ds_file), "deepspeed_config.deepspeed_config_file", "files include each other");
      return;
    }
    ++depth_;
    load_file(p.string());
    --depth_;
  }

  void fsdp_section(const YAML::Node& fsdp, const std::string& file) {
    if (!fsdp.IsMap()) {
      error(location(file, fsdp), "fsdp_config", "expected a mapping of keys, got " + cd::scalar_text(fsdp));
      return;
    }
    check_duplicates(fsdp, file, "fsdp_config");
    bool strategy_given = false;
    for (const auto& kv : fsdp) {
      const std::string key = kv.first.Scalar();
      const YAML::Node& v = kv.second;
      const Origin o = file_origin(file, v);
      const std::string shown = "fsdp_config." + key;
      const std::string value = v.IsScalar() ? v.Scalar() : YAML::Dump(v);
      c_.recorded[shown] = value;
      auto note = [&](const std::string& what) {
        c_.notes.push_back(fmt::format("{}: {}: {}", location(file, kv.first), shown, what));
      };
      auto expect = [&](std::initializer_list<const char*> options) -> bool {
        for (const char* opt : options)
          if (upper(value) == opt) return true;
        std::string list;
        for (const char* opt : options) list += (list.empty() ? "" : ", ") + std::string(opt);
        error(location(file, v), shown, fmt::format("expected one of {}, got {}", list, cd::quote(value)));
        return false;
      };
      if (key == "fsdp_sharding_strategy") {
        static const std::map<std::string, std::pair<int, bool>> strategies = {
            {"FULL_SHARD", {3, false}}, {"1", {3, false}},    {"SHARD_GRAD_OP", {2, false}},
            {"2", {2, false}},          {"NO_SHARD", {0, false}}, {"3", {0, false}},
            {"HYBRID_SHARD", {3, true}}, {"4", {3, true}},    {"HYBRID_SHARD_ZERO2", {2, true}},
            {"5", {2, true}}};
        auto it = strategies.find(upper(value));
        if (it == strategies.end()) {
          expect({"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"});
          continue;
        }
        strategy_given = true;
        assign("zero_optimization.stage", YAML::Node(std::to_string(it->second.first)), o, shown);
        assign("zero_optimization.hybrid_shard", YAML::Node(it->second.second ? "true" : "false"), o, shown);
      } else if (key == "fsdp_offload_params") {
        bool on = false;
        try {
          on = cd::read_bool(v);
        } catch (const cd::ValueError& e) {
          error(location(file, v), shown, e.message);
          continue;
        }
        if (on) {
          offload_params_ = o;
          assign("zero_optimization.offload_optimizer.device", YAML::Node("cpu"), o, shown);
        }
      } else if (key == "fsdp_auto_wrap_policy") {
        if (!expect({"TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"})) continue;
        if (upper(value) == "SIZE_BASED_WRAP")
          note("zeal's units are the model's zeal::Sharded members; size-based wrapping does not apply");
        if (upper(value) == "NO_WRAP") no_wrap_ = true;
      } else if (key == "fsdp_transformer_layer_cls_to_wrap") {
        assign("zero_optimization.unit_names", v, o, shown);
      } else if (key == "fsdp_backward_prefetch_policy" || key == "fsdp_backward_prefetch") {
        if (!expect({"BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"})) continue;
        if (upper(value) == "NO_PREFETCH") {
          assign("zero_optimization.stage3_prefetch_bucket_size", YAML::Node("0"), o, shown);
        } else if (upper(value) == "BACKWARD_POST") {
          note("zeal prefetches along the recorded order of units (like BACKWARD_PRE)");
        }
      } else if (key == "fsdp_state_dict_type") {
        if (!expect({"FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT"})) continue;
        if (upper(value) == "FULL_STATE_DICT")
          assign("zero_optimization.stage3_gather_16bit_weights_on_model_save", YAML::Node("true"), o, shown);
      } else if (key == "fsdp_activation_checkpointing") {
        assign("activation_checkpointing.enabled", v, o, shown);
      } else if (key == "fsdp_cpu_ram_efficient_loading") {
        assign("zero_optimization.zero3_init_flag", v, o, shown);
      } else if (key == "fsdp_forward_prefetch" || key == "fsdp_sync_module_states" ||
                 key == "fsdp_use_orig_params" || key == "fsdp_min_num_params" || key == "fsdp_version" ||
                 key == "fsdp_reshard_after_forward") {
        static const std::map<std::string, std::string> why = {
            {"fsdp_forward_prefetch", "zeal always prefetches the next unit along the recorded order"},
            {"fsdp_sync_module_states", "ranks seed identically, so initial states always agree"},
            {"fsdp_use_orig_params", "parameters are always views of the flat buffer (orig params)"},
            {"fsdp_min_num_params", "applies to size-based wrapping only"},
            {"fsdp_version", "zeal has one implementation"},
            {"fsdp_reshard_after_forward", "stage 3 releases units after forward; stage 2 keeps them"}};
        note(why.at(key));
      } else {
        static const std::vector<std::string> known = {
            "fsdp_sharding_strategy", "fsdp_offload_params", "fsdp_auto_wrap_policy",
            "fsdp_transformer_layer_cls_to_wrap", "fsdp_backward_prefetch", "fsdp_state_dict_type",
            "fsdp_cpu_ram_efficient_loading", "fsdp_forward_prefetch", "fsdp_sync_module_states",
            "fsdp_use_orig_params", "fsdp_activation_checkpointing", "fsdp_min_num_params",
            "fsdp_backward_prefetch_policy", "fsdp_version", "fsdp_reshard_after_forward"};
        const std::string best = cd::closest(known, key);
        error(location(file, kv.first), shown,
              best.empty() ? "unknown key; no fsdp_config key is like it"
                           : fmt::format("unknown key; did you mean fsdp_config.{}?", best));
      }
    }
    if (!strategy_given && !c_.origins.count("zero_optimization.stage")) {
      // Accelerate's default strategy is FULL_SHARD.
      c_.zero.stage = 3;
      c_.origins["zero_optimization.stage"] = {Origin::Kind::kDefault, "FSDP's default FULL_SHARD"};
    }
    if (offload_params_) {
      if (c_.zero.stage == 3) {
        assign("zero_optimization.offload_param.device", YAML::Node("cpu"), *offload_params_,
               "fsdp_config.fsdp_offload_params");
      } else {
        c_.notes.push_back(offload_params_->where +
                           ": fsdp_config.fsdp_offload_params: below stage 3 parameters are not sharded, so "
                           "only the optimizer states are offloaded to the CPU");
      }
    }
    if (no_wrap_ && !c_.zero.unit_names.empty()) {
      c_.notes.push_back("fsdp_config.fsdp_auto_wrap_policy is NO_WRAP: the unit names are recorded but the "
                         "model is one unit");
      c_.zero.unit_names.clear();
    }
  }

  Config& c_;
  std::vector<std::string>& errors_;
  YAML::Node ds_key_, fsdp_key_;
  std::optional<Origin> offload_params_;
  bool no_wrap_ = false;
  int depth_ = 0;
};

// All the environment's overrides at once: one may need another (offload device nvme and its
// nvme_path), so they are checked together, not one by one.
void apply_environment(Config& c, std::vector<std::string>& errors) {
  std::vector<Config::Setting> settings;
  for (const auto& f : override_flags()) {
    const char* v = std::getenv(f.env.c_str());
    if (v) settings.push_back({f.flag, v, {Origin::Kind::kEnvironment, f.env}});
  }
  if (settings.empty()) return;
  try {
    c.set_all(settings);
  } catch (const ConfigError& e) {
    errors.insert(errors.end(), e.problems().begin(), e.problems().end());
  }
}

Config finish(Config c, std::vector<std::string> errors) {
  if (errors.empty()) {
    config_detail::finalize(c, errors);
  }
  if (!errors.empty()) throw ConfigError(errors);
  c.validate();
  return c;
}

YAML::Node value_node(const std::string& value) {
  if (!value.empty() && value.front() == '[') {
    try {
      return YAML::Load(value);
    } catch (const YAML::Exception&) {
    }
  }
  return YAML::Node(value);
}

}  // namespace

Config Config::load(const std::string& path, bool apply_env) {
  Config c;
  std::vector<std::string> errors;
  Loader(c, errors).load_file(path);
  if (apply_env && errors.empty()) apply_environment(c, errors);
  return finish(std::move(c), std::move(errors));
}

Config Config::parse(const std::string& text, const std::string& name, bool apply_env) {
  Config c;
  std::vector<std::string> errors;
  if (auto root = read_document(text, name, errors)) Loader(c, errors).load_root(*root, name);
  if (apply_env && errors.empty()) apply_environment(c, errors);
  return finish(std::move(c), std::move(errors));
}

Config Config::defaults(bool apply_env) {
  Config c;
  std::vector<std::string> errors;
  if (apply_env) apply_environment(c, errors);
  return finish(std::move(c), std::move(errors));
}

void Config::set(const std::string& key, const std::string& value, Origin origin) { set_all({{key, value, origin}}); }

namespace {

// Assigns settings (flags or overrides) by their flag or canonical names.
void assign_settings(Config& next, const std::vector<Config::Setting>& settings, std::vector<std::string>& errors) {
  for (const auto& [key, value, origin] : settings) {
    std::string canonical = key;
    for (const auto& f : override_flags())
      if (f.flag == key) canonical = f.key;
    if (!config_detail::find_field(canonical)) {
      std::string section = canonical.substr(0, canonical.rfind('.') == std::string::npos ? 0 : canonical.rfind('.'));
      std::string leaf = canonical.substr(section.empty() ? 0 : section.size() + 1);
      errors.push_back(fmt::format("{}: unknown key {}; {}", origin.where, key, config_detail::suggest(section, leaf)));
      continue;
    }
    Loader(next, errors).assign(canonical, value_node(value), origin, key);
  }
}

}  // namespace

void Config::set_all(const std::vector<Setting>& settings) {
  std::vector<std::string> errors;
  Config next = *this;
  assign_settings(next, settings, errors);
  if (!errors.empty()) throw ConfigError(errors);
  *this = finish(std::move(next), {});
}

Config config_detail::load_with(const std::string& path, const std::vector<Config::Setting>& settings) {
  Config c;
  std::vector<std::string> errors;
  if (!path.empty()) Loader(c, errors).load_file(path);
  if (errors.empty()) {
    // The environment's overrides, then the flags (a later assignment wins), checked once.
    std::vector<Config::Setting> all;
    for (const auto& f : override_flags()) {
      if (const char* v = std::getenv(f.env.c_str())) all.push_back({f.flag, v, {Origin::Kind::kEnvironment, f.env}});
    }
    all.insert(all.end(), settings.begin(), settings.end());
    assign_settings(c, all, errors);
  }
  return finish(std::move(c), std::move(errors));
}

Config Config::from_env_or_file(int argc, const char* const* argv) {
  std::string file;
  if (const char* env = std::getenv("ZEAL_CONFIG_FILE")) file = env;
  std::vector<std::pair<std::string, std::string>> flags;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) != 0) continue;
    std::string name = a.substr(2), value;
    bool has_value = false;
    if (auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    bool known = name == "config_file";
    for (const auto& f : override_flags()) known = known || f.flag == name;
    if (!known) continue;  // the program's own flag
    if (!has_value) {
      if (i + 1 >= argc) throw ConfigError({fmt::format("--{}: expects a value", name)});
      value = argv[++i];
    }
    if (name == "config_file") {
      file = value;
    } else {
      flags.emplace_back(name, value);
    }
  }
  std::vector<Setting> settings;
  if (const char* ws = std::getenv("WORLD_SIZE")) settings.push_back({"num_processes", ws, {Origin::Kind::kEnvironment, "WORLD_SIZE"}});
  for (const auto& [name, value] : flags) settings.push_back({name, value, {Origin::Kind::kFlag, "--" + name}});
  return config_detail::load_with(file, settings);
}

const std::vector<OverrideFlag>& override_flags() {
  static const std::vector<OverrideFlag> flags = [] {
    std::vector<OverrideFlag> v = {
        {"mixed_precision", "mixed_precision", "", "no, fp16 or bf16"},
        {"zero_stage", "zero_optimization.stage", "", "ZeRO stage 0-3"},
        {"gradient_accumulation_steps", "gradient_accumulation_steps", "", "micro-steps per optimizer step"},
        {"gradient_clipping", "gradient_clipping", "", "global gradient-norm clip (0: off)"},
        {"num_processes", "num_processes", "", "processes over all machines"},
        {"num_machines", "num_machines", "", "machines"},
        {"machine_rank", "machine_rank", "", "this machine's index"},
        {"main_process_ip", "main_process_ip", "", "address of machine 0"},
        {"main_process_port", "main_process_port", "", "rendezvous port"},
        {"offload_optimizer_device", "zero_optimization.offload_optimizer.device", "", "none, cpu or nvme"},
        {"offload_param_device", "zero_optimization.offload_param.device", "", "none, cpu or nvme"},
        {"offload_optimizer_nvme_path", "zero_optimization.offload_optimizer.nvme_path", "", "nvme directory"},
        {"offload_param_nvme_path", "zero_optimization.offload_param.nvme_path", "", "nvme directory"},
        {"zero3_init_flag", "zero_optimization.zero3_init_flag", "", "build the model partitioned"},
        {"zero3_save_16bit_model", "zero_optimization.stage3_gather_16bit_weights_on_model_save", "",
         "save a consolidated 16-bit model"},
        {"train_micro_batch_size_per_gpu", "train_micro_batch_size_per_gpu", "", "batch per rank"},
        {"use_cpu", "use_cpu", "", "train on the CPU"},
        {"comm_timeout", "comm_timeout", "", "collective timeout in seconds"},
        {"activation_checkpointing", "activation_checkpointing.enabled", "",
         "checkpoint the activations of Sharded units (true/false)"},
        {"memory_check", "memory_check", "", "warn, error or off: the predicted peak against the memory at prepare"},
    };
    for (auto& f : v) f.env = "ZEAL_" + upper(f.flag);
    return v;
  }();
  return flags;
}

}  // namespace zeal
