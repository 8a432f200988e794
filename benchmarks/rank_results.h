// What the ranks of a benchmark's zeal run leave behind, and how it is read back: each rank writes
// one JSON array to DIR/rank<r> — its timed steps' seconds, then its peak bytes, then any extra
// numbers — and the run's result is the slowest rank per step, the largest peak and each extra's
// largest value over the ranks.
#pragma once

#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <string>
#include <vector>

namespace zeal_bench {

inline void write_rank_result(const std::string& dir, int64_t rank, const std::vector<double>& step_s, double peak_bytes,
                              const std::vector<double>& extras = {}) {
  std::vector<double> v = step_s;
  v.push_back(peak_bytes);
  v.insert(v.end(), extras.begin(), extras.end());
  std::ofstream(dir + "/rank" + std::to_string(rank)) << nlohmann::json(v).dump();
}

struct RankResults {
  std::vector<double> step_s;  // the slowest rank per step
  double peak_bytes = 0;       // the most over ranks
  std::vector<double> extras;  // each the most over ranks
};

inline RankResults read_rank_results(const std::string& dir, int world, int steps, int extras) {
  RankResults out;
  out.step_s.assign(steps, 0);
  out.extras.assign(extras, 0);
  for (int r = 0; r < world; ++r) {
    const auto v = nlohmann::json::parse(std::ifstream(dir + "/rank" + std::to_string(r))).get<std::vector<double>>();
    for (int s = 0; s < steps; ++s) out.step_s[s] = std::max(out.step_s[s], v.at(s));
    out.peak_bytes = std::max(out.peak_bytes, v.at(steps));
    for (int e = 0; e < extras; ++e) out.extras[e] = std::max(out.extras[e], v.at(steps + 1 + e));
  }
  return out;
}

}  // namespace zeal_bench
