// The table of canonical config keys: for each, how to read it from a YAML node into a Config,
// how to print it back, and what it means. Internal to engine/config.
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <yaml-cpp/yaml.h>

#include "engine/config/config.h"

namespace zeal::config_detail {

// Thrown by a field parser; the loader adds the key and the location.
struct ValueError {
  std::string message;
};

struct Field {
  std::string key;      // canonical dotted path, e.g. "zero_optimization.stage"
  std::string type;     // for docs: "int 0..3", "bool", "cpu|nvme|none", …
  std::string doc;
  std::function<void(Config&, const YAML::Node&)> parse;  // throws ValueError
  std::function<std::string(const Config&)> print;        // a YAML flow scalar or sequence
};

const std::vector<Field>& fields();
const Field* find_field(const std::string& key);
// Dotted section names that hold fields ("zero_optimization", "optimizer.params", …).
bool is_section(const std::string& path);
// Keys directly under a section ("" for the top level): field leaves and sub-sections.
std::vector<std::string> keys_under(const std::string& section);

// DeepSpeed and Accelerate keys that zeal accepts but does not use: key → why that changes no result.
const std::string* not_applicable_reason(const std::string& key);
// Every such key with its reason (README's table).
const std::map<std::string, std::string>& not_applicable_keys();
// For such a key whose value would change the math (a quantization switched on, a schedule started
// elsewhere): why it is refused.
std::optional<std::string> refusal_reason(const std::string& key, const YAML::Node& value);

// The candidate nearest to `word` by edit distance, or "" when none is near enough to suggest.
std::string closest(const std::vector<std::string>& candidates, const std::string& word);

// "did you mean" help for an unknown key at `section`.
std::string suggest(const std::string& section, const std::string& unknown);

bool read_bool(const YAML::Node& n);  // throws ValueError
std::string scalar_text(const YAML::Node& n);  // for messages: the value as written
std::string quote(const std::string& s);

}  // namespace zeal::config_detail
