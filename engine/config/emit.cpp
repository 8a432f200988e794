// Printing a Config back as YAML (`zeal config show`) and the key reference (`zeal config keys`).
#include <cstdlib>
#include <set>
#include <sstream>

#include "engine/config/config.h"
#include "engine/config/schema.h"

namespace zeal {
namespace {

std::vector<std::string> split_key(const std::string& key) {
  std::vector<std::string> parts;
  std::stringstream ss(key);
  for (std::string p; std::getline(ss, p, '.');) parts.push_back(p);
  return parts;
}

}  // namespace

std::string Config::to_yaml(bool with_origins) const {
  std::ostringstream out;
  out << "# zeal configuration: every key, its value and where the value came from.\n";
  std::vector<std::string> open;  // the sections currently open
  for (const auto& f : config_detail::fields()) {
    // Without a type, optimizer and scheduler params are all defaults (validate() enforces it).
    if (optimizer.type.empty() && f.key.rfind("optimizer.params.", 0) == 0) continue;
    if (scheduler.type.empty() && f.key.rfind("scheduler.params.", 0) == 0) continue;
    // The other optimizer family's settings are left out (validate() refuses them when given).
    static const std::set<std::string> sgd_only = {"optimizer.params.momentum", "optimizer.params.nesterov"};
    static const std::set<std::string> adam_only = {"optimizer.params.betas", "optimizer.params.eps",
                                                    "optimizer.params.adam_w_mode", "optimizer.params.bias_correction",
                                                    "optimizer.params.amsgrad"};
    if ((optimizer.type == "SGD" ? adam_only : sgd_only).count(f.key)) {
      const auto o = origins.find(f.key);
      if (o == origins.end() || o->second.kind == Origin::Kind::kDefault) continue;
    }
    std::vector<std::string> parts = split_key(f.key);
    std::vector<std::string> section(parts.begin(), parts.end() - 1);
    size_t common = 0;
    while (common < open.size() && common < section.size() && open[common] == section[common]) ++common;
    for (size_t i = common; i < section.size(); ++i)
      out << std::string(2 * i, ' ') << section[i] << ":\n";
    open = section;
    // An unset batch size is left out (0 is not a value a file may give); it is derived at the start.
    const Auto<int64_t>* batch = f.key == "train_batch_size"                 ? &train_batch_size
                                 : f.key == "train_micro_batch_size_per_gpu" ? &train_micro_batch_size_per_gpu
                                                                             : nullptr;
    if (batch && !batch->is_auto && batch->value == 0) {
      out << std::string(2 * section.size(), ' ') << "# " << parts.back() << ": left out, derived at the start\n";
      continue;
    }
    out << std::string(2 * section.size(), ' ') << parts.back() << ": " << f.print(*this);
    if (with_origins) {
      auto it = origins.find(f.key);
      out << "  # " << (it == origins.end() ? Origin{}.describe() : it->second.describe());
    }
    out << "\n";
  }
  if (with_origins) {
    for (const auto& [key, value] : recorded) {
      std::string v = value;
      for (auto& ch : v)
        if (ch == '\n') ch = ' ';
      out << "# recorded " << key << ": " << v << "\n";
    }
    for (const auto& n : notes) out << "# note: " << n << "\n";
  }
  return out.str();
}

std::string default_config_path() {
  if (const char* home = std::getenv("ZEAL_HOME"); home && *home) return std::string(home) + "/default_config.yaml";
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg && *xdg) return std::string(xdg) + "/zeal/default_config.yaml";
  const char* home = std::getenv("HOME");
  return std::string(home ? home : ".") + "/.cache/zeal/default_config.yaml";
}

std::vector<KeyInfo> config_keys() {
  const Config defaults;
  std::vector<KeyInfo> keys;
  for (const auto& f : config_detail::fields()) keys.push_back({f.key, f.type, f.print(defaults), f.doc});
  return keys;
}

}  // namespace zeal
