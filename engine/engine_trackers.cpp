// Engine::init_trackers, log, end_training and get_tracker (docs/trackers.md).
#include <cstdio>
#include <filesystem>

#include <fmt/format.h>

#include "engine/checkpoint/state_stream.h"
#include "engine/engine.h"
#include "engine/engine_state.h"
#include "engine/error.h"
#include "engine/log.h"

namespace zeal {

namespace fs = std::filesystem;

void Engine::init_trackers(const std::string& project_name, const std::map<std::string, std::string>& config) {
  // The main process opens them; every rank learns whether that failed, so that all end together
  // instead of the others waiting in their next collective. Collective.
  std::string error;
  if (is_main_process()) {
    try {
      open_trackers(project_name, config);
    } catch (const std::exception& e) {
      error = e.what();
      state_->trackers.clear();
    }
  }
  const std::string failed = ckpt::agreed_failures(*this, error);
  if (!failed.empty()) throw Error("init_trackers: the trackers could not be opened:" + failed);
}

void Engine::open_trackers(const std::string& project_name, const std::map<std::string, std::string>& config) {
  if (!state_->trackers.empty()) throw Error("init_trackers: the trackers are open already (end_training closes them)");
  if (project_name.empty() || project_name.find('/') != std::string::npos || project_name == "." || project_name == "..") {
    throw Error(fmt::format("init_trackers: the project name '{}' must be a plain folder name", project_name));
  }
  // Which trackers, and where: log_with's in logging_dir/<project>, DeepSpeed's sections in
  // output_path/job_name (a section wins over log_with for its kind).
  std::vector<std::pair<std::string, fs::path>> chosen;
  std::vector<std::string> nowhere;
  auto want = [&](const std::string& kind, const fs::path& dir) {
    for (auto& [k, d] : chosen) {
      if (k == kind) return;
    }
    chosen.emplace_back(kind, dir);
  };
  const fs::path project = fs::path(config_.logging_dir) / project_name;
  auto section = [&](const std::string& kind, const MonitorConfig& m) {
    if (!m.enabled) return;
    want(kind, fs::path(m.output_path.empty() ? config_.logging_dir : m.output_path) / m.job_name);
  };
  section("tensorboard", config_.tensorboard);
  section("csv", config_.csv_monitor);
  for (const auto& name : config_.log_with) {
    if (name == "all") {
      for (const char* k : {"tensorboard", "csv", "jsonl"}) want(k, project);
    } else if (name == "tensorboard" || name == "csv" || name == "jsonl") {
      want(name, project);
    } else {
      nowhere.push_back(name);
    }
  }
  for (const auto& n : nowhere) {
    log::warning("log_with {}: zeal has no {} tracker; nothing is sent there (tensorboard, csv and jsonl are built in)",
                 n, n);
  }
  if (chosen.empty()) return;  // as Accelerate: no tracker chosen, nothing logged, nothing said
  std::map<std::string, std::string> recorded = config;
  recorded.emplace("zeal.project", project_name);
  recorded.emplace("zeal.world_size", std::to_string(num_processes()));
  recorded.emplace("zeal.zero_stage", std::to_string(config_.zero.stage));
  recorded.emplace("zeal.mixed_precision", config_.mixed_precision);
  std::string said;
  for (const auto& [kind, dir] : chosen) {
    state_->trackers.push_back(make_tracker(kind, dir.string(), recorded));
    said += fmt::format("{}{} in {}", said.empty() ? "" : ", ", kind, dir.string());
  }
  log::info("trackers: {}", said);
}

void Engine::log(const Metrics& values, int64_t step) {
  if (state_->trackers.empty()) return;
  const int64_t at = step >= 0 ? step : optimizer_steps_;
  for (auto& t : state_->trackers) t->log(values, at);
}

void Engine::end_training() {
  for (auto& t : state_->trackers) t->finish();
  state_->trackers.clear();
}

Tracker* Engine::get_tracker(const std::string& name) {
  for (auto& t : state_->trackers) {
    if (t->name() == name) return t.get();
  }
  return nullptr;
}

}  // namespace zeal
