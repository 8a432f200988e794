// Engine::save_state and Engine::load_state (docs/checkpoints.md).
//
// The format is canonical per parameter, whatever the stage and world size that wrote it: every
// named parameter's flattened elements are cut into contiguous pieces, each piece written once, by
// the rank that owned it, into that rank's safetensors file as "<kind>/<name>/<first element>"
// (kind: master, exp_avg, exp_avg_sq, momentum_buffer for trainable parameters, in fp32; param for
// frozen ones, in their own dtype). manifest.json lists every piece with its file and byte offset,
// and every file with its size, its CRC32C and a CRC32C per MiB. A load asks the sharding which
// elements this rank holds now and reads exactly the pieces' bytes that overlap them (whole MiB
// blocks, to check their CRCs), so any world size and stage resumes any other.
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <future>
#include <thread>
#include <tuple>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <unordered_set>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "engine/checkpoint/safetensors.h"
#include "engine/checkpoint/manifest.h"
#include "engine/checkpoint/consolidate.h"
#include "engine/checkpoint/tensor_dtype.h"
#include "engine/comm/communicator.h"
#include "engine/engine_state.h"
#include "engine/error.h"
#include "engine/peft/lora.h"
#include "engine/runtime/runtime.h"
#include "offload/crc32c.h"

namespace zeal {

namespace fs = std::filesystem;
using nlohmann::json;

namespace ckpt {
std::string safetensors_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "F32";
    case at::kBFloat16: return "BF16";
    case at::kHalf: return "F16";
    case at::kDouble: return "F64";
    case at::kLong: return "I64";
    case at::kInt: return "I32";
    case at::kShort: return "I16";
    case at::kChar: return "I8";
    case at::kByte: return "U8";
    case at::kBool: return "BOOL";
    default: throw Error(fmt::format("no safetensors dtype for {}", c10::toString(t)));
  }
}
}  // namespace ckpt

namespace {

// 2: the model's buffers (kind "buffer") and the names exports use (export_names).
constexpr int kFormatVersion = 2;


at::ScalarType at_dtype(const std::string& d) {
  static const std::map<std::string, at::ScalarType> m{
      {"F32", at::kFloat}, {"BF16", at::kBFloat16}, {"F16", at::kHalf}, {"F64", at::kDouble}, {"I64", at::kLong},
      {"I32", at::kInt},   {"I16", at::kShort},     {"I8", at::kChar},  {"U8", at::kByte},    {"BOOL", at::kBool}};
  auto it = m.find(d);
  if (it == m.end()) throw Error("checkpoint: unknown dtype " + d);
  return it->second;
}

// A test hook: ZEAL_CHECKPOINT_KILL=write:<rank> kills that rank halfway through its file;
// =latest kills rank 0 after the rename, before `latest` changes (a crash at the worst moments).
void maybe_die(const std::string& point, int rank) {
  const char* e = std::getenv("ZEAL_CHECKPOINT_KILL");
  if (!e) return;
  const std::string want(e);
  if (want == point || want == point + ":" + std::to_string(rank)) ::raise(SIGKILL);
}

void fsync_path(const fs::path& p) {
  const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

void write_file_synced(const fs::path& p, const std::string& text) {
  {
    std::ofstream f(p, std::ios::binary | std::ios::trunc);
    f << text;
    if (!f.flush()) throw Error(fmt::format("checkpoint: cannot write {}", p.string()));
  }
  fsync_path(p);
}

// The frozen parameters outside stage 3 (whole on every rank), by name, each tensor once.
std::vector<std::pair<std::string, at::Tensor>> frozen_params(torch::nn::Module& m) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  std::unordered_set<const void*> seen;
  for (const auto& item : m.named_parameters(true)) {
    if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;
    if (!item.value().requires_grad()) out.push_back({item.key(), item.value()});
  }
  return out;
}

// Every rank's string, to every rank (collective).
std::vector<std::string> all_strings(Engine& e, const std::string& text) {
  at::Tensor bytes = at::from_blob(const_cast<char*>(text.data()), {static_cast<int64_t>(text.size())}, at::kByte).clone();
  const at::Tensor lens = e.gather(at::tensor({static_cast<int64_t>(text.size())}, at::kLong)).cpu();
  const at::Tensor all = e.gather(bytes).cpu();
  std::vector<std::string> out;
  for (int64_t r = 0, at = 0; r < lens.numel(); ++r) {
    const int64_t n = lens[r].item<int64_t>();
    out.emplace_back(reinterpret_cast<const char*>(all.data_ptr<uint8_t>()) + at, n);
    at += n;
  }
  return out;
}

// Every rank's error (empty: none) to every rank, as "\n  rank k: …" lines (empty: none failed).
// Collective.
std::string agreed_failures(Engine& e, const std::string& error) {
  std::string failed;
  const auto errors = all_strings(e, error);
  for (size_t r = 0; r < errors.size(); ++r)
    if (!errors[r].empty()) failed += fmt::format("\n  rank {}: {}", r, errors[r]);
  return failed;
}

// What one rank writes into its file, in order.
struct FilePlan {
  struct Item {
    const zero::StateRange* range;
    std::string kind;
  };
  std::vector<zero::StateRange> ranges;
  std::vector<Item> items;
  std::vector<ckpt::TensorEntry> entries;
  std::vector<std::pair<std::string, at::Tensor>> rng;
};

// Where a rank's bytes go, in order: the writer itself, or the staging of an asynchronous save.
class Sink {
 public:
  virtual ~Sink() = default;
  virtual void append(const void* data, int64_t n) = 0;
};

class WriterSink : public Sink {
 public:
  explicit WriterSink(ckpt::SafetensorsWriter& w) : w_(w) {}
  void append(const void* data, int64_t n) override { w_.append(data, n); }

 private:
  ckpt::SafetensorsWriter& w_;
};

// An asynchronous save's snapshot: the training thread copies the state into at most `budget`
// bytes of host memory, in chunks; the background thread writes each chunk and gives it back. A
// state larger than the budget makes the copy wait for the writes.
class Staging : public Sink {
 public:
  struct Chunk {
    std::vector<char> bytes;
    int64_t fill = 0;
  };
  explicit Staging(int64_t budget)
      : chunk_(std::clamp<int64_t>(budget / 4, 64 << 10, 32 << 20)), max_(std::max<int64_t>(2, budget / chunk_)) {}

  // The training thread's side.
  void append(const void* data, int64_t n) override {
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      if (!cur_) cur_ = take();
      const int64_t k = std::min(n, chunk_ - cur_->fill);
      std::memcpy(cur_->bytes.data() + cur_->fill, p, static_cast<size_t>(k));
      cur_->fill += k;
      p += k;
      n -= k;
      if (cur_->fill == chunk_) publish();
    }
  }
  void close() {
    if (cur_) publish();
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    cv_.notify_all();
  }
  // Either side: stop (the snapshot failed on some rank, or the writes did).
  void cancel(const std::string& why) {
    std::lock_guard<std::mutex> lock(mu_);
    if (error_.empty()) error_ = why;
    cv_.notify_all();
  }
  bool cancelled() {
    std::lock_guard<std::mutex> lock(mu_);
    return !error_.empty();
  }
  // The background thread's side: the next chunk to write (null when all are written).
  Chunk* next() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !ready_.empty() || closed_ || !error_.empty(); });
    if (!error_.empty()) throw Error(error_);
    if (ready_.empty()) return nullptr;
    Chunk* c = ready_.front();
    ready_.pop_front();
    return c;
  }
  void done(Chunk* c) {
    std::lock_guard<std::mutex> lock(mu_);
    c->fill = 0;
    free_.push_back(c);
    cv_.notify_all();
  }

 private:
  Chunk* take() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !free_.empty() || static_cast<int64_t>(all_.size()) < max_ || !error_.empty(); });
    if (!error_.empty()) throw Error(error_);
    if (!free_.empty()) {
      Chunk* c = free_.back();
      free_.pop_back();
      return c;
    }
    all_.push_back(std::make_unique<Chunk>());
    all_.back()->bytes.resize(static_cast<size_t>(chunk_));
    return all_.back().get();
  }
  void publish() {
    std::lock_guard<std::mutex> lock(mu_);
    ready_.push_back(cur_);
    cur_ = nullptr;
    cv_.notify_all();
  }

  const int64_t chunk_, max_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::unique_ptr<Chunk>> all_;
  std::vector<Chunk*> free_;
  std::deque<Chunk*> ready_;
  Chunk* cur_ = nullptr;
  bool closed_ = false;
  std::string error_;
};

// Walks state ranges in order, opening each range's group when it comes and closing the one before
// (Sharding::open_group): one stage-3 unit's shards from disk in memory at a time.
class GroupWalk {
 public:
  GroupWalk(zero::Sharding& z, bool changed) : z_(z), changed_(changed) {}
  void at(const zero::StateRange& r) {
    if (r.group < 0 || r.group == open_) return;
    close();
    z_.open_group(r.group);
    open_ = r.group;
  }
  void close() {
    if (open_ < 0) return;
    const int g = open_;
    open_ = -1;
    z_.close_group(g, changed_);
  }

 private:
  zero::Sharding& z_;
  const bool changed_;
  int open_ = -1;
};

// The rank's file's bytes, in the plan's order.
void emit_file(const FilePlan& plan, Sink& sink, int rank, zero::Sharding& z) {
  std::vector<float> chunk(1 << 20);
  GroupWalk walk(z, /*changed=*/false);
  for (size_t i = 0; i < plan.items.size(); ++i) {
    if (i == plan.items.size() / 2) maybe_die("write", rank);
    const auto& r = *plan.items[i].range;
    walk.at(r);
    if (!r.step) {
      const at::Tensor v = r.values.cpu().contiguous();
      sink.append(v.data_ptr(), static_cast<int64_t>(v.nbytes()));
      continue;
    }
    for (int64_t at = 0; at < r.count; at += static_cast<int64_t>(chunk.size())) {
      const int64_t n = std::min<int64_t>(static_cast<int64_t>(chunk.size()), r.count - at);
      r.step->read_state(plan.items[i].kind, r.index + at, n, chunk.data());
      sink.append(chunk.data(), n * 4);
    }
  }
  walk.close();
  for (const auto& [key, t] : plan.rng) {
    const at::Tensor b = t.contiguous();
    sink.append(b.data_ptr(), b.numel());
  }
}

// The manifest's pieces of one rank's file (the writer knows their offsets from the start).
json file_pieces(const FilePlan& plan, const ckpt::SafetensorsWriter& w) {
  json pieces = json::array();
  for (size_t i = 0; i < plan.items.size(); ++i) {
    const auto& r = *plan.items[i].range;
    pieces.push_back({{"kind", plan.items[i].kind}, {"name", r.name}, {"shape", r.shape}, {"begin", r.begin},
                      {"count", r.count}, {"dtype", w.entries()[i].dtype}, {"offset", w.entries()[i].offset},
                      {"trainable", r.step != nullptr}});
  }
  return pieces;
}

json file_record(const std::string& name, const ckpt::FileDigest& d) {
  return {{"name", name}, {"bytes", d.bytes}, {"crc32c", d.crc32c}, {"crc_block", d.crc_block}, {"block_crcs", d.block_crcs}};
}

bool is_checkpoint_name(const std::string& n) {
  return n.rfind("checkpoint_", 0) == 0 && n.size() > 11 && n.find_first_not_of("0123456789", 11) == std::string::npos;
}

// Removes directories renamed out of the way (a hidden name first, so a crash while removing
// leaves nothing that looks like a checkpoint).
void remove_all_quietly(const std::vector<fs::path>& doomed) {
  for (const auto& p : doomed) {
    std::error_code ec;
    fs::remove_all(p, ec);
  }
}

// Rank 0, once every rank's file is complete: manifest.json (from `meta` and every rank's report),
// the registered objects, then the new checkpoint takes its name and `latest` points at it. The
// directories that must go (an older checkpoint of the same name, those beyond total_limit) are
// renamed to hidden names and returned for removal off the critical path.
std::vector<fs::path> complete_checkpoint(const fs::path& dir, const fs::path& tmp, const std::vector<json>& reports,
                                          json m, const std::vector<std::string>& custom, bool automatic,
                                          int total_limit) {
  const fs::path parent = dir.parent_path();
  json files = json::object(), pieces = json::array();
  for (const auto& rep : reports) {
    files[rep["file"]["name"].get<std::string>()] = rep["file"];
    for (auto p : rep["pieces"]) {
      p["file"] = rep["file"]["name"];
      pieces.push_back(std::move(p));
    }
  }
  m["files"] = files;
  m["pieces"] = pieces;
  m["custom_objects"] = custom.size();
  for (size_t k = 0; k < custom.size(); ++k) write_file_synced(tmp / fmt::format("custom_{}.bin", k), custom[k]);
  write_file_synced(tmp / "manifest.json", m.dump(1));
  fsync_path(tmp);
  // The new checkpoint takes the name only now, complete; an old one there goes after.
  std::vector<fs::path> doomed;
  const fs::path old = parent / ("." + dir.filename().string() + ".old");
  fs::remove_all(old);
  if (fs::exists(dir)) {
    fs::rename(dir, old);
    doomed.push_back(old);
  }
  fs::rename(tmp, dir);
  fsync_path(parent);
  maybe_die("latest", 0);
  // A name of this process's own: two runs saving into one parent never take each other's file.
  const fs::path pointer = parent / fmt::format(".latest.{}.partial", ::getpid());
  write_file_synced(pointer, dir.filename().string() + "\n");
  fs::rename(pointer, parent / "latest");
  fsync_path(parent);
  if (automatic && total_limit > 0) {
    std::vector<std::pair<int64_t, fs::path>> found;
    for (const auto& e : fs::directory_iterator(parent)) {
      const std::string n = e.path().filename().string();
      if (is_checkpoint_name(n)) found.push_back({std::stoll(n.substr(11)), e.path()});
    }
    std::sort(found.begin(), found.end());
    for (size_t i = 0; i + total_limit < found.size(); ++i) {
      const fs::path hidden = parent / ("." + found[i].second.filename().string() + ".old");
      fs::remove_all(hidden);
      fs::rename(found[i].second, hidden);
      doomed.push_back(hidden);
    }
    fsync_path(parent);
  }
  return doomed;
}

// Host memory an asynchronous save may stage by default: half of what is available, shared by
// the ranks.
int64_t default_staging_budget(int world) {
  std::ifstream f("/proc/meminfo");
  std::string key;
  int64_t kb = 0;
  while (f >> key >> kb) {
    if (key == "MemAvailable:") return kb * 1024 / 2 / std::max(1, world);
    f.ignore(1 << 10, '\n');
  }
  return int64_t{1} << 30;
}

// Writes `text` to `p` atomically (a temporary name, fsync, rename).
void publish_file(const fs::path& p, const std::string& text) {
  const fs::path t = p.string() + ".tmp";
  write_file_synced(t, text);
  fs::rename(t, p);
}

// One kind of state ("param", "master", "exp_avg", ...) of one range, as a load applies it.
struct LoadItem {
  const zero::StateRange* range;
  std::string kind, dtype;
  int64_t es;  // bytes per element in the file
};

// A load's second pass: the checked bytes of each read, gathered into a small staging buffer and
// applied a buffer at a time where they belong (Engine::load_state).
class StreamApplier {
 public:
  StreamApplier(const std::vector<LoadItem>& items, const std::vector<std::pair<size_t, int64_t>>& read_to,
                GroupWalk& walk)
      : items_(items), read_to_(read_to), walk_(walk), buf_(kBytes) {}
  void take(size_t read, int64_t at, const char* p, int64_t n) {
    if (read != cur_) {
      flush();
      cur_ = read;
      done_ = 0;
      walk_.at(*items_[read_to_[read].first].range);
    }
    ZEAL_CHECK(at == done_ + fill_) << "checkpoint bytes out of order";
    while (n > 0) {
      const int64_t k = std::min(n, kBytes - fill_);
      std::memcpy(buf_.data() + fill_, p, static_cast<size_t>(k));
      fill_ += k;
      p += k;
      n -= k;
      if (fill_ == kBytes) flush();
    }
  }
  void flush() {
    if (fill_ == 0) return;
    const LoadItem& it = items_[read_to_[cur_].first];
    const zero::StateRange& r = *it.range;
    const int64_t first = read_to_[cur_].second + done_ / it.es, count = fill_ / it.es;
    ZEAL_CHECK(fill_ % it.es == 0) << "a partial element of " << r.name;
    const at::Tensor src = at::from_blob(buf_.data(), {count}, at::TensorOptions().dtype(at_dtype(it.dtype)));
    if (it.kind == "param") {
      r.values.narrow(0, first, count).copy_(src);
    } else {
      const at::Tensor f32 = src.to(at::kFloat).contiguous();
      r.step->write_state(it.kind, r.index + first, count, f32.data_ptr<float>());
      if (it.kind == "master") r.values.narrow(0, first, count).copy_(f32);  // the compute copy, as a step writes it
    }
    done_ += fill_;
    fill_ = 0;
  }

 private:
  static constexpr int64_t kBytes = 8 << 20;  // a multiple of every element size
  const std::vector<LoadItem>& items_;
  const std::vector<std::pair<size_t, int64_t>>& read_to_;
  GroupWalk& walk_;
  std::vector<char> buf_;
  size_t cur_ = static_cast<size_t>(-1);
  int64_t done_ = 0, fill_ = 0;
};

// The names an export of `model` uses for its parameters and buffers, where they differ from the
// model's own: zeal::Sharded's "block" level left out (as Hugging Face names modules), and null for
// LoRA adapter tensors (the lora_A / lora_B of a layer that has both), which belong in the adapter
// file, not the model's.
json export_names(const torch::nn::Module& model) {
  const auto hf = peft::hf_namer(model);
  std::vector<std::string> adapters;  // "<layer>.lora_A.", "<layer>.lora_B."
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    const auto children = item.value()->named_children();
    if (children.contains("lora_A") && children.contains("lora_B")) {
      adapters.push_back(item.key() + ".lora_A.");
      adapters.push_back(item.key() + ".lora_B.");
    }
  }
  json out = json::object();
  auto add = [&](const std::string& name) {
    for (const auto& a : adapters) {
      if (name.rfind(a, 0) == 0) {
        out[name] = nullptr;
        return;
      }
    }
    if (const std::string h = hf(name); h != name) out[name] = h;
  };
  for (const auto& item : model.named_parameters(true)) add(item.key());
  for (const auto& item : model.named_buffers(true)) add(item.key());
  return out;
}

}  // namespace

void Engine::wait_for_save() {
  std::string mine;
  if (state_->saving.valid()) mine = state_->saving.get();
  if (state_->cleanup.valid()) state_->cleanup.wait();
  const std::string failed = agreed_failures(*this, mine);
  if (!failed.empty()) {
    throw Error(fmt::format("save_state (asynchronous): {} was not saved (the previous checkpoint, if any, is "
                            "unchanged):{}",
                            state_->saving_dir, failed));
  }
}

void Engine::finish_background_save() noexcept {
  if (!state_) return;
  try {
    if (state_->saving.valid()) {
      const std::string e = state_->saving.get();
      if (!e.empty()) {
        std::fprintf(stderr, "zeal: the asynchronous save_state of %s failed on this rank: %s\n",
                     state_->saving_dir.c_str(), e.c_str());
      }
    }
    if (state_->cleanup.valid()) state_->cleanup.wait();
  } catch (...) {
  }
}

std::string Engine::save_state(const std::string& dir_arg, const SaveOptions& options) {
  if (!state_->zero) throw Error("save_state: prepare a model and its optimizer first");
  if (state_->grads_pending || backward_pending_) {
    throw Error("save_state: called in the middle of an accumulation (gradients of micro-steps not yet stepped "
                "would be lost); save after opt.step()");
  }
  wait_for_save();  // an earlier asynchronous save completes first
  Communicator& c = comm();
  const int rank = c.rank(), world = c.world_size();
  // The directory: the one given, or the next automatic name (every rank's view agrees: max).
  fs::path dir = dir_arg;
  const bool automatic = dir.empty();
  if (automatic) {
    int64_t next = 0;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator("checkpoints", ec)) {
      const std::string n = e.path().filename().string();
      if (is_checkpoint_name(n)) next = std::max<int64_t>(next, std::stoll(n.substr(11)) + 1);
    }
    next = gather(at::tensor({next}, at::kLong)).max().item<int64_t>();
    dir = fs::path("checkpoints") / ("checkpoint_" + std::to_string(next));
  }
  dir = fs::absolute(dir).lexically_normal();
  if (dir.filename().empty()) dir = dir.parent_path();
  const fs::path parent = dir.parent_path(), tmp = parent / ("." + dir.filename().string() + ".partial");
  std::string error;
  if (rank == 0) {
    // (a .partial folder is a save that died before: never complete, never pointed at)
    std::error_code ec;
    if (fs::create_directories(parent, ec); ec) {
      error = fmt::format("save_state: cannot create the folder {}: {}", parent.string(), ec.message());
    } else if (fs::remove_all(tmp, ec); ec) {
      error = fmt::format("save_state: cannot remove {}: {}", tmp.string(), ec.message());
    } else if (fs::create_directories(tmp, ec); ec) {
      error = fmt::format("save_state: cannot create {}: {}", tmp.string(), ec.message());
    }
  }
  wait_for_everyone();
  // What the manifest says besides the pieces, and the registered objects, as they are now.
  json meta;
  meta["format"] = "zeal-checkpoint";
  meta["version"] = kFormatVersion;
  meta["world_size"] = world;
  meta["zero_stage"] = state_->zero->stage();
  meta["compute_dtype"] = c10::toString(compute_dtype_);
  meta["optimizer_steps"] = optimizer_steps_;
  meta["export_names"] = export_names(*state_->module);
  json scheds = json::array();
  for (const auto& s : state_->schedulers) scheds.push_back({{"seen_steps", s.seen_steps}});
  meta["schedulers"] = scheds;
  json loaders = json::array();
  for (const auto& cur : state_->cursors) loaders.push_back({{"epoch", cur->epoch}, {"samples", cur->samples}});
  meta["loaders"] = loaders;
  if (state_->scaler) {
    const auto sc = state_->scaler->snapshot();
    meta["loss_scaler"] = {{"scale", sc.scale}, {"left", sc.left}, {"iter", sc.iter},
                           {"last_overflow", sc.last_overflow}, {"skipped", sc.skipped}};
  }
  std::vector<std::string> custom;
  if (rank == 0)
    for (const auto& obj : state_->custom) custom.push_back(obj->state_dict());

  // Every rank writes its file (synchronously), or snapshots it into staging for a background
  // thread that writes it (asynchronously).
  json mine = {{"rank", rank}};
  const std::string file = fmt::format("rank{}.safetensors", rank);
  zero::Sharding& z = *state_->zero;
  std::shared_ptr<Staging> staging;
  std::future<std::string> background;
  try {
    // Inside: a shard that cannot be read back from disk is an error every rank hears of below.
    z.begin_state_access();
    if (!error.empty()) throw Error(error);
    c10::NoGradGuard no_grad;
    FilePlan plan;
    plan.ranges = z.state_ranges(/*to_write=*/true);
    if (z.stage() < 3 && rank == 0 && options.include_frozen) {
      for (auto& [name, p] : frozen_params(*state_->module)) {
        plan.ranges.push_back({name, p.sizes().vec(), 0, p.numel(), p.detach().reshape({-1})});
      }
    }
    if (z.stage() == 3 && !options.include_frozen) {
      std::erase_if(plan.ranges, [](const zero::StateRange& r) { return r.step == nullptr; });
    }
    // The model's buffers, whole, from rank 0 (every rank's are rank 0's with broadcast_buffers).
    const size_t first_buffer = plan.ranges.size();
    if (rank == 0) {
      for (const auto& item : state_->module->named_buffers(true)) {
        const at::Tensor& b = item.value();
        plan.ranges.push_back({item.key(), b.sizes().vec(), 0, b.numel(), b.detach().reshape({-1})});
      }
    }
    for (size_t i = 0; i < plan.ranges.size(); ++i) {
      const auto& r = plan.ranges[i];
      std::vector<std::string> kinds{i >= first_buffer ? "buffer" : "param"};
      if (r.step) {
        kinds = {"master"};
        for (const auto& s : r.step->state_names()) kinds.push_back(s);
      }
      for (const auto& k : kinds) {
        const std::string dtype = r.step ? "F32" : ckpt::safetensors_dtype(r.values.scalar_type());
        plan.entries.push_back({fmt::format("{}/{}/{}", k, r.name, r.begin), dtype, {r.count},
                                r.count * ckpt::dtype_size(dtype)});
        plan.items.push_back({&r, k});
      }
    }
    // This rank's random number generators (restored by a load at the same world size).
    plan.rng = {{"rng/cpu", at::detail::getDefaultCPUGenerator().get_state()}};
    if (device_.is_cuda()) plan.rng.push_back({"rng/cuda", at::globalContext().defaultGenerator(device_).get_state()});
    for (const auto& [key, t] : plan.rng) plan.entries.push_back({key, "U8", {t.numel()}, t.numel()});
    offload::IoOptions io;
    if (state_->io) io = state_->io->options();
    io.verify = false;
    io.queue_depth = std::max(io.queue_depth, 32);  // 32 MiB staged per write: keep the disk's queue full
    auto w = std::make_shared<ckpt::SafetensorsWriter>(
        (tmp / file).string(), plan.entries, std::map<std::string, std::string>{{"format", "zeal-checkpoint"}, {"rank", std::to_string(rank)}},
        io, ckpt::kCrcBlock);
    // A test hook: ZEAL_CHECKPOINT_FAULT=enospc:<rank> makes that rank's first write fail.
    if (const char* f = std::getenv("ZEAL_CHECKPOINT_FAULT"); f && std::string(f) == fmt::format("enospc:{}", rank)) {
      w->inject({.at_request = 0, .error = ENOSPC});
    }
    mine["pieces"] = file_pieces(plan, *w);
    if (!options.async) {
      WriterSink sink(*w);
      emit_file(plan, sink, rank, z);
      mine["file"] = file_record(file, w->finish());
    } else {
      int64_t budget = options.staging_bytes > 0 ? options.staging_bytes : default_staging_budget(world);
      int64_t bytes = 0;
      for (const auto& e : plan.entries) bytes += e.bytes;
      budget = std::min(budget, bytes + (1 << 20));
      staging = std::make_shared<Staging>(budget);
      const double timeout = config_.launch.comm_timeout;
      // The background thread: writes the staged chunks, publishes this rank's report next to its
      // file; rank 0 then waits for every rank's report and completes the checkpoint.
      background = std::async(std::launch::async, [staging, w, mine, file, tmp, dir, rank, world, meta, custom,
                                                   automatic, total_limit = options.total_limit, timeout]() mutable {
        try {
          while (Staging::Chunk* ch = staging->next()) {
            w->append(ch->bytes.data(), ch->fill);
            staging->done(ch);
          }
          mine["file"] = file_record(file, w->finish());
          w.reset();
          publish_file(tmp / fmt::format("rank{}.json", rank), mine.dump());
        } catch (const std::exception& e) {
          staging->cancel(e.what());
          if (!fs::exists(tmp)) return std::string(e.what());
          std::error_code ec;
          try {
            publish_file(tmp / fmt::format("rank{}.error", rank), e.what());
          } catch (...) {
          }
          return std::string(e.what());
        }
        if (rank != 0) return std::string();
        try {
          std::vector<json> reports(static_cast<size_t>(world));
          const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout);
          for (int r = 0; r < world; ++r) {
            const fs::path ok = tmp / fmt::format("rank{}.json", r), bad = tmp / fmt::format("rank{}.error", r);
            while (!fs::exists(ok)) {
              if (fs::exists(bad)) {
                std::ifstream f(bad);
                throw Error(fmt::format("rank {}: {}", r, std::string(std::istreambuf_iterator<char>(f), {})));
              }
              if (staging->cancelled()) throw Error("cancelled");
              if (std::chrono::steady_clock::now() > deadline) {
                throw Error(fmt::format("rank {} did not finish its file within comm_timeout ({} s)", r, timeout));
              }
              std::this_thread::sleep_for(std::chrono::milliseconds(20));
            }
            reports[r] = json::parse(std::ifstream(ok));
          }
          for (int r = 0; r < world; ++r) fs::remove(tmp / fmt::format("rank{}.json", r));
          remove_all_quietly(complete_checkpoint(dir, tmp, reports, meta, custom, automatic, total_limit));
        } catch (const std::exception& e) {
          std::error_code ec;
          fs::remove_all(tmp, ec);
          return fmt::format("rank 0, finishing: {}", e.what());
        }
        return std::string();
      });
      emit_file(plan, *staging, rank, z);
      staging->close();
    }
  } catch (const std::exception& e) {
    mine["error"] = e.what();
  }
  z.end_state_access(/*changed=*/false);
  if (options.async) {
    // Every rank's snapshot must have succeeded; the rest is the background's (wait_for_save).
    const std::string failed = agreed_failures(*this, mine.value("error", ""));
    if (!failed.empty()) {
      if (staging) staging->cancel("another rank failed");
      if (background.valid()) background.wait();
      wait_for_everyone();
      if (rank == 0) remove_all_quietly({tmp});  // the error below is what matters
      throw Error(fmt::format("save_state: {} was not saved (the previous checkpoint, if any, is unchanged):{}",
                              dir.string(), failed));
    }
    state_->saving = std::move(background);
    state_->saving_dir = dir.string();
    return dir.string();
  }
  // Every rank's outcome and pieces to every rank (rank 0 writes the manifest; all agree on errors).
  std::vector<json> reports;
  for (const auto& t : all_strings(*this, mine.dump())) reports.push_back(json::parse(t));
  std::string failed;
  for (const auto& rep : reports) {
    if (rep.contains("error")) failed += fmt::format("\n  rank {}: {}", rep["rank"].get<int>(), rep["error"].get<std::string>());
  }
  if (failed.empty() && rank == 0) {
    try {
      auto doomed = complete_checkpoint(dir, tmp, reports, meta, custom, automatic, options.total_limit);
      state_->cleanup = std::async(std::launch::async, [doomed] { remove_all_quietly(doomed); });
    } catch (const std::exception& e) {
      failed = fmt::format("\n  rank 0, finishing: {}", e.what());
    }
  }
  // Rank 0's outcome to everyone.
  const bool ok = gather(at::tensor({failed.empty() ? 1 : 0}, at::kLong)).min().item<int64_t>() == 1;
  if (!ok) {
    if (rank == 0) remove_all_quietly({tmp});  // the error below is what matters
    throw Error(fmt::format("save_state: {} was not saved (the previous checkpoint, if any, is unchanged):{}",
                            dir.string(), failed.empty() ? "\n  another rank failed" : failed));
  }
  return dir.string();
}

void Engine::load_state(const std::string& dir_arg, const LoadStateOptions& options) {
  if (!state_->zero) throw Error("load_state: prepare a model and its optimizer first");
  wait_for_save();
  fs::path dir = dir_arg.empty() ? fs::path("checkpoints") : fs::path(dir_arg);
  if (!fs::exists(dir / "manifest.json") && fs::exists(dir / "latest")) {
    std::ifstream f(dir / "latest");
    std::string name;
    std::getline(f, name);
    dir = dir / name;
  }
  Communicator& c = comm();
  zero::Sharding& z = *state_->zero;
  // Two passes, so that a load holds no more than a window beside the training's own memory: the
  // first reads every byte this rank needs and checks its CRC32C, keeping nothing; the ranks agree
  // that nothing is wrong; the second reads the bytes again and streams them into their places
  // (the optimizer state where it lives, NVMe windows written through, stage-3 shards on disk a
  // unit at a time).
  std::vector<zero::StateRange> ranges;
  std::vector<LoadItem> items;
  std::vector<ckpt::CheckedReader::Read> reads;  // out = null: checked, then streamed
  std::vector<std::pair<size_t, int64_t>> read_to;  // each read's item and first element in its range
  std::unique_ptr<ckpt::CheckedReader> reader;
  std::vector<std::pair<at::Tensor, at::Tensor>> buffers;  // the model's, read
  std::vector<std::unique_ptr<char[]>> kept;                // each read's bytes, when they fit the budget
  std::vector<std::pair<std::string, at::Tensor>> frozen_whole;  // stages 0-2
  std::vector<std::string> custom;                                 // register_for_checkpointing
  json m;
  std::map<std::string, ckpt::SavedFile> files_;
  std::string error;
  try {
    z.begin_state_access();
    if (!fs::exists(dir / "manifest.json")) {
      throw Error(fmt::format("{} holds no checkpoint (no manifest.json, no latest)", dir.string()));
    }
    std::ifstream mf(dir / "manifest.json");
    try {
      m = json::parse(mf);
    } catch (const std::exception& e) {
      throw Error(fmt::format("{} is not valid JSON ({})", (dir / "manifest.json").string(), e.what()));
    }
    if (m.value("format", "") != "zeal-checkpoint" || m.value("version", 0) > kFormatVersion) {
      throw Error(fmt::format("{} is not a zeal checkpoint of version {} or older", (dir / "manifest.json").string(),
                              kFormatVersion));
    }
    std::map<std::string, ckpt::SavedFile>& files = files_;
    for (auto it = m["files"].begin(); it != m["files"].end(); ++it) {
      ckpt::SavedFile f;
      f.bytes = it.value()["bytes"].get<int64_t>();
      f.crc32c = it.value()["crc32c"].get<uint32_t>();
      f.crc_block = it.value()["crc_block"].get<int64_t>();
      f.block_crcs = it.value()["block_crcs"].get<std::vector<uint32_t>>();
      const fs::path p = dir / it.key();
      std::error_code ec;
      const auto size = fs::file_size(p, ec);
      if (ec) throw Error(fmt::format("{} is missing", p.string()));
      if (static_cast<int64_t>(size) != f.bytes) {
        throw Error(fmt::format("{} is truncated or changed: {} bytes, the manifest says {}", p.string(), size, f.bytes));
      }
      files[it.key()] = std::move(f);
    }
    // Pieces by kind and name.
    std::map<std::pair<std::string, std::string>, std::vector<ckpt::SavedPiece>> by;
    std::map<std::string, std::vector<int64_t>> shapes;
    for (const auto& p : m["pieces"]) {
      by[{p["kind"].get<std::string>(), p["name"].get<std::string>()}].push_back(
          {p["file"].get<std::string>(), p["dtype"].get<std::string>(), p["begin"].get<int64_t>(),
           p["count"].get<int64_t>(), p["offset"].get<int64_t>()});
      shapes[p["name"].get<std::string>()] = p["shape"].get<std::vector<int64_t>>();
    }
    const size_t saved_custom = m.value("custom_objects", size_t{0});
    if (saved_custom < state_->custom.size()) {
      throw Error(fmt::format("the checkpoint holds {} registered objects, this run registered {}", saved_custom,
                              state_->custom.size()));
    }
    for (size_t k = 0; k < state_->custom.size(); ++k) {
      std::ifstream f(dir / fmt::format("custom_{}.bin", k), std::ios::binary);
      if (!f) throw Error(fmt::format("{} is missing", (dir / fmt::format("custom_{}.bin", k)).string()));
      custom.emplace_back((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    }
    ranges = z.state_ranges(/*to_write=*/false);
    if (z.stage() < 3) {
      frozen_whole = frozen_params(*state_->module);
      for (auto& [name, p] : frozen_whole) ranges.push_back({name, p.sizes().vec(), 0, p.numel(), p.detach().reshape({-1})});
    }
    for (const auto& r : ranges) {
      const auto sh = shapes.find(r.name);
      if (sh == shapes.end()) {
        if (!r.step) continue;  // a frozen parameter saved without frozen weights: it keeps its value
        throw Error(fmt::format("the checkpoint has no parameter '{}'", r.name));
      }
      if (sh->second != r.shape) {
        throw Error(fmt::format("parameter '{}' is {} in the checkpoint and {} in the model", r.name,
                                json(sh->second).dump(), json(r.shape).dump()));
      }
      std::vector<std::string> kinds{r.step ? "master" : "param"};
      if (r.step)
        for (const auto& s : r.step->state_names()) kinds.push_back(s);
      for (const auto& k : kinds) {
        auto pit = by.find({k, r.name});
        if (pit == by.end()) {
          throw Error(fmt::format("the checkpoint has no {} for parameter '{}' (saved with another optimizer?)",
                                  k, r.name));
        }
        const std::string dtype = pit->second.front().dtype;
        const int64_t es = ckpt::dtype_size(dtype);
        items.push_back({&r, k, dtype, es});
        int64_t covered = 0;
        for (const auto& p : pit->second) {
          const int64_t lo = std::max(p.begin, r.begin), hi = std::min(p.begin + p.count, r.begin + r.count);
          if (lo >= hi) continue;
          if (p.dtype != dtype) throw Error(fmt::format("the pieces of {} of '{}' differ in dtype", k, r.name));
          reads.push_back({dir / p.file, &files.at(p.file), p.offset + (lo - p.begin) * es, (hi - lo) * es, nullptr});
          read_to.push_back({items.size() - 1, lo - r.begin});
          covered += hi - lo;
        }
        if (covered != r.count) {
          throw Error(fmt::format("the checkpoint covers {} of the {} elements of {} of '{}' this rank needs", covered,
                                  r.count, k, r.name));
        }
      }
    }
    // The model's buffers: whole (rank 0's when saved), read and kept now (they are small).
    std::vector<ckpt::CheckedReader::Read> buffer_reads;
    if (m.value("version", 1) >= 2) {
      for (const auto& item : state_->module->named_buffers(true)) {
        const at::Tensor& b = item.value();
        auto pit = by.find({"buffer", item.key()});
        if (pit == by.end()) throw Error(fmt::format("the checkpoint has no buffer '{}'", item.key()));
        if (shapes.at(item.key()) != b.sizes().vec()) {
          throw Error(fmt::format("buffer '{}' is {} in the checkpoint and {} in the model", item.key(),
                                  json(shapes.at(item.key())).dump(), json(b.sizes().vec()).dump()));
        }
        const ckpt::SavedPiece& p = pit->second.front();
        at::Tensor host = at::empty({b.numel()}, at::TensorOptions().dtype(at_dtype(p.dtype)));
        buffer_reads.push_back({dir / p.file, &files.at(p.file), p.offset, static_cast<int64_t>(host.nbytes()),
                                static_cast<char*>(host.data_ptr())});
        buffers.push_back({b, host});
      }
    } else if (c.rank() == 0 && !state_->module->buffers(true).empty()) {
      std::fprintf(stderr, "zeal: load_state: %s was saved without the model's buffers (format version 1): they "
                   "keep their values\n", dir.string().c_str());
    }
    // What fits the budget is kept from the check to the apply (each byte read once).
    int64_t total = 0;
    for (const auto& r : reads) total += r.n;
    const int64_t budget = options.memory_budget >= 0 ? options.memory_budget : default_staging_budget(c.world_size()) / 2;
    if (total <= budget) {
      for (auto& r : reads) {
        kept.emplace_back(new char[static_cast<size_t>(r.n)]);  // not zeroed: every byte is read
        r.out = kept.back().get();
      }
    }
    reader = std::make_unique<ckpt::CheckedReader>();
    reader->read_many(buffer_reads);
    reader->read_many(reads);  // pass one: checked (and kept, within the budget)
  } catch (const std::exception& e) {
    error = e.what();
  }
  // Nothing changes unless every rank read and checked everything it needs.
  const std::string failed = agreed_failures(*this, error);
  if (!failed.empty()) {
    z.end_state_access(/*changed=*/false);
    throw Error(fmt::format("load_state: {}: nothing was changed:{}", dir.string(), failed));
  }
  // Pass two: the same reads, checked again, applied as they come.
  std::string reread;
  try {
    c10::NoGradGuard no_grad;
    GroupWalk walk(z, /*changed=*/true);
    StreamApplier apply(items, read_to, walk);
    if (!kept.empty()) {
      for (size_t i = 0; i < reads.size(); ++i) apply.take(i, 0, kept[i].get(), reads[i].n);
    } else {
      reader->read_many(reads, [&](size_t i, int64_t at, const char* p, int64_t n) { apply.take(i, at, p, n); });
    }
    apply.flush();
    walk.close();
    kept.clear();
    for (auto& [b, host] : buffers) b.copy_(host.view(b.sizes()));
    for (zero::ShardStep* s : z.steps()) s->optimizer().set_steps(m["optimizer_steps"].get<int64_t>());
  } catch (const std::exception& e) {
    reread = e.what();
  }
  z.end_state_access(/*changed=*/true);
  if (const std::string again = agreed_failures(*this, reread); !again.empty()) {
    throw Error(fmt::format("load_state: {}: the checkpoint was checked, then failed when read again to be applied "
                            "(did it change meanwhile?): the model and optimizer are now partly loaded; load a "
                            "checkpoint again before training:{}",
                            dir.string(), again));
  }
  // Random number generators: each rank its own, when the world size is the one that saved them.
  const int saved_world = m["world_size"].get<int>();
  if (saved_world == c.world_size()) {
    const std::string file = fmt::format("rank{}.safetensors", c.rank());
    const auto header = ckpt::read_safetensors_header((dir / file).string());
    for (const std::string key : {"rng/cpu", "rng/cuda"}) {
      const auto it = header.tensors.find(key);
      if (it == header.tensors.end()) continue;
      if (key == "rng/cuda" && !device_.is_cuda()) continue;
      at::Tensor t = at::empty({it->second.bytes}, at::kByte);
      ckpt::read_checked(dir / file, files_.at(file), it->second.offset, it->second.bytes, static_cast<char*>(t.data_ptr()));
      at::Generator g = key == "rng/cpu" ? at::detail::getDefaultCPUGenerator()
                                         : at::globalContext().defaultGenerator(device_);  // a handle
      std::lock_guard<std::mutex> lock(g.mutex());
      g.set_state(t);
    }
  } else if (c.rank() == 0) {
    std::fprintf(stderr, "zeal: load_state: random number generators not restored (saved by %d ranks, running on %d)\n",
                 saved_world, c.world_size());
  }
  optimizer_steps_ = m["optimizer_steps"].get<int64_t>();
  micro_steps_ = 0;
  if (state_->scaler && m.contains("loss_scaler")) {
    const auto& s = m["loss_scaler"];
    LossScaler::Snapshot snap;
    snap.scale = s["scale"].get<double>();
    snap.left = s["left"].get<int64_t>();
    snap.iter = s["iter"].get<int64_t>();
    snap.last_overflow = s["last_overflow"].get<int64_t>();
    snap.skipped = s["skipped"].get<int64_t>();
    state_->scaler->restore(snap);
  }
  for (size_t k = 0; k < custom.size(); ++k) state_->custom[k]->load_state_dict(custom[k]);
  // Prepared loaders, in prepare order, continue after the last batch the saved run yielded.
  if (m.contains("loaders")) {
    const auto& ls = m["loaders"];
    for (size_t i = 0; i < state_->cursors.size() && i < ls.size(); ++i) {
      state_->cursors[i]->resume_epoch = ls[i]["epoch"].get<int64_t>();
      state_->cursors[i]->resume_samples = ls[i]["samples"].get<int64_t>();
    }
  }
  // LibTorch schedulers are stepped up to the saved count (their own counters are not reachable);
  // zeal's follow the optimizer step count by themselves.
  const auto& saved = m["schedulers"];
  for (size_t i = 0; i < state_->schedulers.size() && i < saved.size(); ++i) {
    auto& s = state_->schedulers[i];
    const int64_t want = saved[i]["seen_steps"];
    for (; s.seen_steps < want; ++s.seen_steps)
      if (s.torch) s.torch->step();
  }
  zero_grad();
}

std::vector<std::string> Engine::save_model(const std::string& dir, const SaveModelOptions& options) {
  std::string dtype = options.dtype;
  if (dtype.empty()) {
    dtype = "fp32";
    if (config_.zero.stage3_gather_16bit_weights_on_model_save && compute_dtype_ != at::kFloat) {
      dtype = compute_dtype_ == at::kBFloat16 ? "bf16" : "fp16";
    }
  }
  const fs::path state = fs::absolute(fs::path(dir) / ".state");
  save_state(state.string());
  std::string error;
  std::vector<std::string> files;
  if (comm().rank() == 0) {
    try {
      ckpt::ConsolidateOptions o;
      o.dtype = dtype;
      o.max_shard_size = options.max_shard_size;
      files = ckpt::consolidate(state.string(), dir, o).files;
    } catch (const std::exception& e) {
      error = e.what();
    }
    std::error_code ec;
    fs::remove_all(state, ec);
    fs::remove(fs::path(dir) / "latest", ec);  // save_state's pointer to .state
  }
  const auto errors = all_strings(*this, error);
  if (!errors[0].empty()) throw Error(fmt::format("save_model: {}: {}", dir, errors[0]));
  return files;
}

namespace {

// Hugging Face-style weights: a directory (model.safetensors, or an index and its files) or one
// .safetensors file: which file holds each tensor, and where.
struct HfWeights {
  fs::path dir;
  std::map<std::string, std::string> where;
  std::map<std::string, ckpt::SafetensorsHeader> headers;

  explicit HfWeights(const fs::path& d) : dir(d) {
    if (fs::is_regular_file(d)) {
      dir = d.parent_path();
      for (const auto& [name, e] : ckpt::read_safetensors_header(d.string()).tensors) where[name] = d.filename().string();
    } else if (fs::exists(d / "model.safetensors.index.json")) {
      json idx;
      try {
        idx = json::parse(std::ifstream(d / "model.safetensors.index.json"));
        for (auto it = idx.at("weight_map").begin(); it != idx.at("weight_map").end(); ++it) {
          where[it.key()] = it.value().get<std::string>();
        }
      } catch (const json::exception& e) {
        throw Error(fmt::format("{} is not a valid index ({})", (d / "model.safetensors.index.json").string(), e.what()));
      }
    } else if (fs::exists(d / "model.safetensors")) {
      for (const auto& [name, e] : ckpt::read_safetensors_header((d / "model.safetensors").string()).tensors) {
        where[name] = "model.safetensors";
      }
    } else if (!fs::exists(d)) {
      throw Error(fmt::format("{} does not exist", d.string()));
    } else {
      throw Error(fmt::format("{} has neither model.safetensors nor model.safetensors.index.json", d.string()));
    }
  }
  bool has(const std::string& name) const { return where.count(name) > 0; }
  // The tensor `name`, checked against the model's shape (`model_name` in messages).
  std::pair<fs::path, ckpt::TensorEntry> entry(const std::string& name, const std::vector<int64_t>& shape,
                                               const std::string& model_name = "") {
    auto w = where.find(name);
    if (w == where.end()) throw Error(fmt::format("{} has no tensor '{}'", dir.string(), name));
    if (!headers.count(w->second)) headers[w->second] = ckpt::read_safetensors_header((dir / w->second).string());
    auto e = headers[w->second].tensors.find(name);
    if (e == headers[w->second].tensors.end()) {
      throw Error(fmt::format("{} has no tensor '{}' (its index says it has)", (dir / w->second).string(), name));
    }
    if (e->second.shape != shape) {
      const std::string as = model_name.empty() || model_name == name ? "" : fmt::format(" (the model's '{}')", model_name);
      throw Error(fmt::format("'{}'{} is {} in {} and {} in the model", name, as, json(e->second.shape).dump(),
                              w->second, json(shape).dump()));
    }
    return {dir / w->second, e->second};
  }
};

// Elements [begin, begin + count) of a tensor in a safetensors file, in the file's dtype.
at::Tensor read_elements(const fs::path& file, const ckpt::TensorEntry& e, int64_t begin, int64_t count) {
  const int64_t es = ckpt::dtype_size(e.dtype);
  at::Tensor t = at::empty({count}, at::TensorOptions().dtype(at_dtype(e.dtype)));
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error(fmt::format("cannot open {}: {}", file.string(), std::strerror(errno)));
  char* out = static_cast<char*>(t.data_ptr());
  for (int64_t got = 0, n = count * es; got < n;) {
    const ssize_t r = ::pread(fd, out + got, static_cast<size_t>(n - got), e.offset + begin * es + got);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      ::close(fd);
      throw Error(fmt::format("{} is truncated (tensor '{}')", file.string(), e.name));
    }
    got += r;
  }
  ::close(fd);
  return t;
}

// Which engine prepared a module (load_checkpoint_in_model then loads its shards).
std::mutex prepared_mu;
std::map<const torch::nn::Module*, Engine*> prepared_modules;

}  // namespace

void remember_prepared(const torch::nn::Module* module, Engine* engine) {
  std::lock_guard<std::mutex> lock(prepared_mu);
  if (engine) prepared_modules[module] = engine;
  else prepared_modules.erase(module);
}

namespace detail {

int64_t load_mapped(torch::nn::Module& model, const std::string& path,
                    const std::function<std::string(const std::string&)>& map) {
  Engine* engine = nullptr;
  {
    std::lock_guard<std::mutex> lock(prepared_mu);
    auto it = prepared_modules.find(&model);
    if (it != prepared_modules.end()) engine = it->second;
  }
  if (engine) {
    if (const int64_t n = engine->load_weights_sharded(model, path, map); n >= 0) return n;
  }
  HfWeights w{fs::path(path)};
  struct Target {
    std::string name, file_name;
    at::Tensor t;
  };
  std::vector<Target> targets;
  std::unordered_set<const void*> seen;
  for (const auto& item : model.named_parameters(true)) {
    if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;
    std::string f = map(item.key());
    if (!f.empty()) targets.push_back({item.key(), std::move(f), item.value()});
  }
  for (const auto& item : model.named_buffers(true)) {
    std::string f = map(item.key());
    if (!f.empty() && w.has(f) && seen.insert(item.value().unsafeGetTensorImpl()).second) {
      targets.push_back({item.key(), std::move(f), item.value()});
    }
  }
  // Every name and shape first: nothing changes when one is wrong (the headers' check also says
  // every tensor lies inside its file).
  for (const auto& t : targets) (void)w.entry(t.file_name, t.t.sizes().vec(), t.name);
  c10::NoGradGuard no_grad;
  for (const auto& t : targets) {
    const auto [file, e] = w.entry(t.file_name, t.t.sizes().vec(), t.name);
    t.t.copy_(read_elements(file, e, 0, t.t.numel()).view(t.t.sizes()));
  }
  return static_cast<int64_t>(targets.size());
}

std::vector<std::string> tensor_names(const std::string& path) {
  HfWeights w{fs::path(path)};
  std::vector<std::string> names;
  for (const auto& [name, file] : w.where) names.push_back(name);
  return names;
}

}  // namespace detail

int64_t load_checkpoint_in_model(torch::nn::Module& model, const std::string& dir) {
  try {
    // The names an export wrote (export_names: the Sharded level left out; adapter tensors, which
    // exports leave out, skipped), or the model's own where the files have them.
    const auto in_files = detail::tensor_names(dir);
    const std::unordered_set<std::string> names(in_files.begin(), in_files.end());
    const json exported = export_names(model);
    return detail::load_mapped(model, dir, [names, exported](const std::string& n) -> std::string {
      if (names.count(n)) return n;
      const auto it = exported.find(n);
      if (it == exported.end()) return n;
      return it->is_null() ? std::string() : it->get<std::string>();
    });
  } catch (const Error& e) {
    throw Error(std::string("load_checkpoint_in_model: ") + e.what());
  }
}

int64_t Engine::load_weights_sharded(torch::nn::Module& model, const std::string& path,
                                     const std::function<std::string(const std::string&)>& map) {
  if (!state_->zero) {
    // Built by engine.init and not prepared yet: each partitioned parameter's slice is read
    // (elements [rank·per, rank·per + per) of it), the rest whole. Collective.
    if (!state_->init_shards || state_->init_shards->empty()) return -1;
    std::vector<std::pair<at::Tensor, at::Tensor>> reads;  // destination, read
    std::string error;
    int64_t n = 0;
    try {
      HfWeights w{fs::path(path)};
      std::unordered_set<const void*> seen;
      const int64_t rank = process_index();
      for (const auto& item : model.named_parameters(true)) {
        if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;
        const std::string f = map(item.key());
        if (f.empty()) continue;
        const auto [file, e] = w.entry(f, item.value().sizes().vec(), item.key());
        ++n;
        if (auto* slice = state_->init_shards->find(item.value())) {
          const int64_t per = slice->data.numel();
          const int64_t begin = std::min<int64_t>(rank * per, slice->numel);
          const int64_t count = std::min<int64_t>(per, slice->numel - begin);
          if (count > 0) reads.push_back({slice->data.narrow(0, 0, count), read_elements(file, e, begin, count)});
        } else {
          reads.push_back({item.value(), read_elements(file, e, 0, item.value().numel()).view(item.value().sizes())});
        }
      }
      for (const auto& item : model.named_buffers(true)) {
        const std::string f = map(item.key());
        if (f.empty() || !w.has(f) || !seen.insert(item.value().unsafeGetTensorImpl()).second) continue;
        const auto [file, e] = w.entry(f, item.value().sizes().vec(), item.key());
        reads.push_back({item.value(), read_elements(file, e, 0, item.value().numel()).view(item.value().sizes())});
        ++n;
      }
    } catch (const std::exception& e) {
      error = e.what();
    }
    const std::string failed = agreed_failures(*this, error);
    if (!failed.empty()) throw Error(fmt::format("{}: nothing was changed:{}", path, failed));
    c10::NoGradGuard no_grad;
    for (auto& [dst, src] : reads) dst.copy_(src);
    return n;
  }
  wait_for_save();
  zero::Sharding& z = *state_->zero;
  // Pass one checks every name, shape and dtype this rank needs and that the files hold their
  // bytes; the ranks agree; pass two reads each rank's elements a few MiB at a time straight into
  // their places (stage-3 shards on disk a unit at a time), so the load holds no copy of the model.
  std::vector<zero::StateRange> ranges;
  std::vector<std::tuple<const zero::StateRange*, fs::path, ckpt::TensorEntry>> planned;
  std::vector<std::pair<at::Tensor, at::Tensor>> buffers;  // model's, read (small: read in pass one)
  std::string error;
  try {
    z.begin_state_access();
    HfWeights w{fs::path(path)};
    ranges = z.state_ranges(/*to_write=*/false);
    if (z.stage() < 3) {
      for (auto& [name, p] : frozen_params(*state_->module)) {
        ranges.push_back({name, p.sizes().vec(), 0, p.numel(), p.detach().reshape({-1})});
      }
    }
    for (const auto& r : ranges) {
      const std::string f = map(r.name);
      if (f.empty()) continue;
      auto [file, e] = w.entry(f, r.shape, r.name);
      (void)at_dtype(e.dtype);  // one zeal can read, or the error names it now
      planned.emplace_back(&r, std::move(file), std::move(e));
    }
    for (const auto& item : state_->module->named_buffers(true)) {
      const std::string f = map(item.key());
      if (f.empty() || !w.has(f)) continue;
      const auto [file, e] = w.entry(f, item.value().sizes().vec(), item.key());
      buffers.push_back({item.value(), read_elements(file, e, 0, item.value().numel()).view(item.value().sizes())});
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  const std::string failed = agreed_failures(*this, error);
  if (!failed.empty()) {
    z.end_state_access(/*changed=*/false);
    throw Error(fmt::format("{}: nothing was changed:{}", path, failed));
  }
  std::string reread;
  try {
    c10::NoGradGuard no_grad;
    GroupWalk walk(z, /*changed=*/true);
    for (const auto& [r, file, e] : planned) {
      walk.at(*r);
      const int64_t chunk = std::max<int64_t>(1, (8 << 20) / ckpt::dtype_size(e.dtype));
      for (int64_t at = 0; at < r->count; at += chunk) {
        const int64_t n = std::min(chunk, r->count - at);
        const at::Tensor src = read_elements(file, e, r->begin + at, n);
        if (!r->step) {
          r->values.narrow(0, at, n).copy_(src);
          continue;
        }
        const at::Tensor f32 = src.to(at::kFloat).contiguous();
        r->step->write_state("master", r->index + at, n, f32.data_ptr<float>());
        r->values.narrow(0, at, n).copy_(f32);
      }
    }
    walk.close();
    for (auto& [b, src] : buffers) b.copy_(src);
  } catch (const std::exception& e) {
    reread = e.what();
  }
  z.end_state_access(/*changed=*/true);
  if (const std::string again = agreed_failures(*this, reread); !again.empty()) {
    throw Error(fmt::format("{}: the weights were checked, then failed when read to be applied: the model is now "
                            "partly loaded; load weights again before training:{}",
                            path, again));
  }
  // Tensors read, counted as the unprepared path counts them: each parameter once, and the buffers.
  std::unordered_set<const void*> seen;
  int64_t n = static_cast<int64_t>(buffers.size());
  for (const auto& item : state_->module->named_parameters(true)) {
    if (map(item.key()).empty()) continue;
    n += seen.insert(item.value().unsafeGetTensorImpl()).second ? 1 : 0;
  }
  return n;
}

void Engine::register_for_checkpointing(std::shared_ptr<Checkpointable> object) {
  if (!object) throw Error("register_for_checkpointing: a null object");
  state_->custom.push_back(std::move(object));
}

}  // namespace zeal
