// Experiment trackers, as Accelerate's init_trackers / log / end_training use them: JSON lines,
// CSV (DeepSpeed's csv_monitor layout) and TensorBoard event files that TensorBoard reads. The
// engine makes them from the config (log_with, logging_dir, DeepSpeed's tensorboard and
// csv_monitor sections) on the main process. No LibTorch headers.
//
//   engine.init_trackers("my_project", {{"lr", "3e-4"}});
//   engine.log({{"train/loss", 2.31}, {"lr", 3e-4}}, step);
//   engine.end_training();
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>

namespace zeal {

// Scalar metrics by name ("train/loss"): TensorBoard's tags, the CSV files' names, JSON keys.
using Metrics = std::map<std::string, double>;

class Tracker {
 public:
  virtual ~Tracker() = default;
  virtual std::string name() const = 0;  // "jsonl", "csv" or "tensorboard"
  virtual std::string dir() const = 0;   // the folder it writes in
  // One record per call, flushed before it returns (a reader sees whole records only).
  virtual void log(const Metrics& values, int64_t step) = 0;
  virtual void finish() = 0;
};

// A tracker writing into `dir` (created): "jsonl" (metrics.jsonl: the run's config first, then one
// object per log call), "csv" (one <metric>.csv per metric: "step,<metric>" then rows, as
// DeepSpeed's csv_monitor writes them) or "tensorboard" (an events.out.tfevents.* file of scalar
// summaries). `config` is the run's hyperparameters, recorded where the format has room (the
// first JSON line; a config.json beside the CSV and TensorBoard files). zeal::Error for an unknown
// kind or a folder that cannot be written.
std::unique_ptr<Tracker> make_tracker(const std::string& kind, const std::string& dir,
                                      const std::map<std::string, std::string>& config);

// TensorBoard's framing and encoding, for tests: one TFRecord (length, masked CRC32C of it, data,
// masked CRC32C of the data) and an Event holding scalar summaries.
std::string tfrecord(const std::string& data);
std::string scalar_event(double wall_time, int64_t step, const Metrics& values);

}  // namespace zeal
