#include "engine/trackers.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "engine/error.h"
#include "engine/output.h"
#include "offload/crc32c.h"

namespace zeal {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// A file opened for appending whole records: each write is flushed, a failed one is an error.
class Appender {
 public:
  Appender(const fs::path& path, const std::string& what) : path_(path), what_(what) {
    f_ = std::fopen(path.c_str(), "ab");
    if (!f_) throw Error(fmt::format("{}: cannot write {}: {}", what, path.string(), std::strerror(errno)));
  }
  ~Appender() {
    if (f_) std::fclose(f_);
  }
  Appender(const Appender&) = delete;
  Appender& operator=(const Appender&) = delete;
  void write(const std::string& bytes) {
    if (std::fwrite(bytes.data(), 1, bytes.size(), f_) != bytes.size() || std::fflush(f_) != 0) {
      throw Error(fmt::format("{}: writing {} failed: {}", what_, path_.string(), std::strerror(errno)));
    }
  }

 private:
  fs::path path_;
  std::string what_;
  std::FILE* f_ = nullptr;
};

json number(double v) {
  if (std::isfinite(v)) return v;
  return std::isnan(v) ? "nan" : v > 0 ? "inf" : "-inf";  // JSON has no NaN or infinity
}

class JsonlTracker : public Tracker {
 public:
  JsonlTracker(const fs::path& dir, const std::map<std::string, std::string>& config)
      : dir_(dir), out_(dir / "metrics.jsonl", "tracker jsonl") {
    json c = json::object();
    for (const auto& [k, v] : config) c[k] = v;
    out_.write(json{{"config", c}, {"time", now_seconds()}}.dump() + "\n");
  }
  std::string name() const override { return "jsonl"; }
  std::string dir() const override { return dir_.string(); }
  void log(const Metrics& values, int64_t step) override {
    json j = {{"step", step}, {"time", now_seconds()}};
    for (const auto& [k, v] : values) j[k] = number(v);
    out_.write(j.dump() + "\n");
  }
  void finish() override {}

 private:
  fs::path dir_;
  Appender out_;
};

// A metric's name as a file name: "/" and anything unusual become "_" (DeepSpeed's csv_monitor
// writes Train_Samples_train_loss.csv for Train/Samples/train_loss).
std::string file_name_of(const std::string& metric) {
  std::string s;
  for (char c : metric) s += (std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '.') ? c : '_';
  return s.empty() ? "_" : s;
}

class CsvTracker : public Tracker {
 public:
  CsvTracker(const fs::path& dir, const std::map<std::string, std::string>& config) : dir_(dir) {
    json c = json::object();
    for (const auto& [k, v] : config) c[k] = v;
    write_file_whole((dir / "config.json").string(), c.dump(2) + "\n", "tracker csv");
  }
  std::string name() const override { return "csv"; }
  std::string dir() const override { return dir_.string(); }
  void log(const Metrics& values, int64_t step) override {
    for (const auto& [k, v] : values) {
      auto it = files_.find(k);
      if (it == files_.end()) {
        const std::string file = file_name_of(k) + ".csv";
        if (!used_.insert(file).second) {
          throw Error(fmt::format("tracker csv: metrics '{}' and another one both map to the file {}", k, file));
        }
        const fs::path p = dir_ / file;
        const bool fresh = !fs::exists(p);
        it = files_.emplace(k, std::make_unique<Appender>(p, "tracker csv")).first;
        if (fresh) it->second->write(fmt::format("step,{}\n", k));
      }
      it->second->write(fmt::format("{},{}\n", step, v));
    }
  }
  void finish() override { files_.clear(); }

 private:
  fs::path dir_;
  std::map<std::string, std::unique_ptr<Appender>> files_;
  std::set<std::string> used_;
};

void varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out += static_cast<char>((v & 0x7f) | 0x80);
    v >>= 7;
  }
  out += static_cast<char>(v);
}

void field_bytes(std::string& out, int field, const std::string& bytes) {
  varint(out, static_cast<uint64_t>(field) << 3 | 2);
  varint(out, bytes.size());
  out += bytes;
}

template <class T>
void little_endian(std::string& out, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));  // x86 and arm64 are little-endian
  out.append(b, sizeof(T));
}

uint32_t masked_crc(const std::string& bytes) {
  const uint32_t crc = offload::crc32c(bytes.data(), bytes.size());
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

std::string file_version_event(double wall_time) {
  std::string e;
  varint(e, 1 << 3 | 1);  // wall_time: double
  little_endian(e, wall_time);
  field_bytes(e, 3, "brain.Event:2");  // file_version
  return e;
}

class TensorBoardTracker : public Tracker {
 public:
  TensorBoardTracker(const fs::path& dir, const std::map<std::string, std::string>& config)
      : dir_(dir), out_(dir / event_file_name(), "tracker tensorboard") {
    json c = json::object();
    for (const auto& [k, v] : config) c[k] = v;
    write_file_whole((dir / "config.json").string(), c.dump(2) + "\n", "tracker tensorboard");
    out_.write(tfrecord(file_version_event(now_seconds())));
  }
  std::string name() const override { return "tensorboard"; }
  std::string dir() const override { return dir_.string(); }
  void log(const Metrics& values, int64_t step) override { out_.write(tfrecord(scalar_event(now_seconds(), step, values))); }
  void finish() override {}

 private:
  static std::string event_file_name() {
    char host[256] = {0};
    gethostname(host, sizeof host - 1);
    static int counter = 0;
    return fmt::format("events.out.tfevents.{}.{}.{}.{}", static_cast<int64_t>(now_seconds()), host,
                       static_cast<int>(getpid()), counter++);
  }
  fs::path dir_;
  Appender out_;
};

}  // namespace

std::string tfrecord(const std::string& data) {
  std::string r, len;
  little_endian(len, static_cast<uint64_t>(data.size()));
  r += len;
  little_endian(r, masked_crc(len));
  r += data;
  little_endian(r, masked_crc(data));
  return r;
}

std::string scalar_event(double wall_time, int64_t step, const Metrics& values) {
  std::string summary;
  for (const auto& [tag, v] : values) {
    std::string value;
    field_bytes(value, 1, tag);  // Summary.Value.tag
    varint(value, 2 << 3 | 5);   // Summary.Value.simple_value: float
    little_endian(value, static_cast<float>(v));
    field_bytes(summary, 1, value);  // Summary.value
  }
  std::string e;
  varint(e, 1 << 3 | 1);  // Event.wall_time
  little_endian(e, wall_time);
  varint(e, 2 << 3 | 0);  // Event.step
  varint(e, static_cast<uint64_t>(step));
  field_bytes(e, 5, summary);  // Event.summary
  return e;
}

std::unique_ptr<Tracker> make_tracker(const std::string& kind, const std::string& dir,
                                      const std::map<std::string, std::string>& config) {
  check_output_dir(dir, "tracker " + kind);
  if (kind == "jsonl") return std::make_unique<JsonlTracker>(dir, config);
  if (kind == "csv") return std::make_unique<CsvTracker>(dir, config);
  if (kind == "tensorboard") return std::make_unique<TensorBoardTracker>(dir, config);
  throw Error(fmt::format("no tracker '{}': zeal writes jsonl, csv and tensorboard", kind));
}

}  // namespace zeal
