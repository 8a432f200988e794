#include "engine/trainer/callbacks.h"

#include <cmath>

#include <nlohmann/json.hpp>

#include "engine/error.h"

namespace zeal {

std::string TrainerState::to_json() const {
  nlohmann::json j;
  j["global_step"] = global_step;
  j["max_steps"] = max_steps;
  j["num_train_epochs"] = num_train_epochs;
  j["steps_per_epoch"] = steps_per_epoch;
  j["epoch"] = epoch;
  j["epochs_completed"] = epochs_completed;
  j["best_metric"] = best_metric ? nlohmann::json(*best_metric) : nlohmann::json(nullptr);
  j["best_global_step"] = best_global_step;
  j["best_model_checkpoint"] = best_model_checkpoint.empty() ? nlohmann::json(nullptr) : nlohmann::json(best_model_checkpoint);
  nlohmann::json history = nlohmann::json::array();
  for (const auto& m : log_history) {
    nlohmann::json e = nlohmann::json::object();
    for (const auto& [k, v] : m) e[k] = std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr);
    history.push_back(e);
  }
  j["log_history"] = history;
  j["callback_states"] = callback_states;
  return j.dump(2);
}

TrainerState TrainerState::from_json(const std::string& text) {
  TrainerState s;
  try {
    const auto j = nlohmann::json::parse(text);
    s.global_step = j.at("global_step").get<int64_t>();
    s.max_steps = j.at("max_steps").get<int64_t>();
    s.num_train_epochs = j.at("num_train_epochs").get<int64_t>();
    s.steps_per_epoch = j.at("steps_per_epoch").get<int64_t>();
    s.epoch = j.at("epoch").get<double>();
    s.epochs_completed = j.at("epochs_completed").get<int64_t>();
    if (!j.at("best_metric").is_null()) s.best_metric = j.at("best_metric").get<double>();
    s.best_global_step = j.at("best_global_step").get<int64_t>();
    if (!j.at("best_model_checkpoint").is_null()) s.best_model_checkpoint = j.at("best_model_checkpoint").get<std::string>();
    for (const auto& e : j.at("log_history")) {
      Metrics m;
      for (auto it = e.begin(); it != e.end(); ++it) m[it.key()] = it->is_null() ? std::nan("") : it->get<double>();
      s.log_history.push_back(std::move(m));
    }
    s.callback_states = j.at("callback_states").get<std::vector<std::string>>();
  } catch (const nlohmann::json::exception& e) {
    throw Error(std::string("the checkpoint's trainer state is not what zeal::Trainer writes: ") + e.what());
  }
  return s;
}

void EarlyStoppingCallback::on_evaluate(const Args& args, const TrainerState& state, TrainerControl& control,
                                        const Metrics& metrics) {
  const std::string key = args.best_metric_key();
  auto it = metrics.find(key);
  if (it == metrics.end()) {
    std::string names;
    for (const auto& [k, v] : metrics) names += (names.empty() ? "" : ", ") + k;
    throw Error("early stopping: the evaluation has no metric " + key + " (metric_for_best_model); it has " + names);
  }
  const double v = it->second;
  const bool better = args.best_is_greater() ? v > state.best_metric.value_or(0) : v < state.best_metric.value_or(0);
  if (!state.best_metric || (better && std::abs(v - *state.best_metric) > threshold_)) {
    counter_ = 0;
  } else {
    ++counter_;
  }
  if (counter_ >= patience_) control.should_training_stop = true;
}

}  // namespace zeal
