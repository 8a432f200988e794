// `zeal consolidate CKPT_DIR OUT_DIR [--dtype fp32|bf16|fp16] [--max_shard_size 5GB] [--merged] [--names F]`: a checkpoint
// engine.save_state wrote (at any world size and stage) as Hugging Face-style safetensors, one
// tensor per parameter and buffer under the names the model's owner sees (transformers'), without
// training ranks; memory holds one parameter at a time.
#include <cstdio>
#include <fstream>
#include <map>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "engine/checkpoint/consolidate.h"
#include "engine/error.h"
#include "engine/memory.h"

namespace zeal::cli {

namespace {

// --names: exported name → {name written, transposed}.
std::map<std::string, std::pair<std::string, bool>> read_names(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw zeal::Error(fmt::format("--names: cannot read {}", path));
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    throw zeal::Error(fmt::format("--names: {} is not valid JSON ({})", path, e.what()));
  }
  if (!j.is_object()) throw zeal::Error(fmt::format("--names: {} is not a JSON object of names", path));
  std::map<std::string, std::pair<std::string, bool>> out;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const auto& v = it.value();
    if (v.is_string()) {
      out[it.key()] = {v.get<std::string>(), false};
    } else if (v.is_object() && v.contains("name") && v["name"].is_string() &&
               (!v.contains("transpose") || v["transpose"].is_boolean())) {
      out[it.key()] = {v["name"].get<std::string>(), v.value("transpose", false)};
    } else {
      throw zeal::Error(fmt::format("--names: {}: '{}' maps to {}, not a name nor {{\"name\": ..., \"transpose\": "
                                    "true|false}}",
                                    path, it.key(), v.dump()));
    }
  }
  return out;
}

}  // namespace

Runner add_consolidate_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("consolidate",
                                 "Write a checkpoint's weights as Hugging Face-style safetensors (no ranks needed)");
  struct Options {
    std::string ckpt, out, dtype = "fp32", max_shard_size = "5GB", names;
    bool no_frozen = false, keep_names = false, merged = false;
  };
  auto o = std::make_shared<Options>();
  cmd->add_option("CKPT_DIR", o->ckpt, "The checkpoint (or a directory whose latest names it)")->required();
  cmd->add_option("OUT_DIR", o->out, "Where the safetensors files go (created)")->required();
  cmd->add_option("--dtype", o->dtype, "fp32, bf16 or fp16 (default fp32)");
  cmd->add_option("--max_shard_size", o->max_shard_size, "Bytes per file, e.g. 5GB, 500MB (default 5GB)");
  cmd->add_flag("--no_frozen", o->no_frozen, "Leave frozen parameters out (with --merged, the LoRA-adapted weights stay: merged, they are the fine-tuned layers)");
  cmd->add_flag("--keep_names", o->keep_names,
                "The model's own names (zeal::Sharded's block level kept) and LoRA adapter tensors too");
  cmd->add_flag("--merged", o->merged, "LoRA-adapted weights written merged: W + scaling·B·A (PEFT's merge_and_unload)");
  cmd->add_option("--names", o->names,
                  "A JSON file of renames, as engine.save_model's SaveModelOptions::names: {\"exported name\": "
                  "\"name written\"} or {\"exported name\": {\"name\": \"name written\", \"transpose\": true}}");
  return [o] {
    try {
      ckpt::ConsolidateOptions c;
      c.dtype = o->dtype;
      try {
        c.max_shard_size = ckpt::parse_size(o->max_shard_size);
      } catch (const zeal::Error& e) {
        throw zeal::Error(std::string("--max_shard_size: ") + e.what());
      }
      c.include_frozen = !o->no_frozen;
      c.model_names = !o->keep_names;
      c.merged = o->merged;
      if (!o->names.empty()) c.rename = read_names(o->names);
      int64_t done = 0;
      const auto r = ckpt::consolidate(o->ckpt, o->out, c, [&](const std::string& name, int64_t bytes) {
        done += bytes;
        std::printf("  %s (%s, %s so far)\n", name.c_str(), format_bytes(static_cast<double>(bytes)).c_str(),
                    format_bytes(static_cast<double>(done)).c_str());
        std::fflush(stdout);
      });
      std::printf("zeal consolidate: %lld tensors, %s in %s\n", static_cast<long long>(r.tensors),
                  format_bytes(static_cast<double>(r.bytes)).c_str(), o->out.c_str());
      for (const auto& f : r.files) std::printf("  %s\n", f.c_str());
      return 0;
    } catch (const std::exception& e) {
      return report_error(e);
    }
  };
}

}  // namespace zeal::cli
