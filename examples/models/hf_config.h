// Reading a Hugging Face JSON file (config.json, tokenizer.json) for the example models and
// tokenizers: the file as JSON, and a config's keys one at a time
// (a key that is absent or null keeps the default; a value of the wrong type is an error naming the
// file and the key).
#pragma once

#include <fstream>
#include <stdexcept>
#include <string>
#include <type_traits>

#include <nlohmann/json.hpp>

namespace zeal::models {

inline nlohmann::json read_config_json(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot read " + path);
  try {
    return nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    throw std::runtime_error(path + " is not valid JSON: " + e.what());
  }
}

// Sets `value` from j[key] when it is there and not null.
template <class T>
void read_config_key(const nlohmann::json& j, const std::string& path, const char* key, T& value) {
  if (!j.contains(key) || j[key].is_null()) return;
  try {
    value = j[key].get<std::decay_t<T>>();
  } catch (const std::exception& e) {
    throw std::runtime_error(path + ": " + key + ": " + e.what());
  }
}

}  // namespace zeal::models
