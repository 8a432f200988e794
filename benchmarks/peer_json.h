// Runs a Python peer of a benchmark and reads its result: the JSON object on the last line of its
// standard output that starts with '{'.
#pragma once

#include <nlohmann/json.hpp>

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <string>

namespace zeal_bench {

// The peer's JSON, or {"error": why} when it could not start or printed no result.
inline nlohmann::json run_peer_json(const std::string& command, const std::string& python) {
  FILE* f = popen(command.c_str(), "r");
  if (!f) return {{"error", "could not start " + python}};
  std::string out;
  std::array<char, 4096> buf;
  size_t got;
  while ((got = fread(buf.data(), 1, buf.size(), f)) > 0) out.append(buf.data(), got);
  const int rc = pclose(f);
  const size_t line = out.rfind("\n{");
  try {
    return nlohmann::json::parse(out.substr(line == std::string::npos ? 0 : line + 1));
  } catch (const std::exception&) {
    const int status = WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
    return {{"error", python + " exited with status " + std::to_string(status) +
                          " and no result (is torch 2.11 installed there? scripts/peers)"}};
  }
}

}  // namespace zeal_bench
