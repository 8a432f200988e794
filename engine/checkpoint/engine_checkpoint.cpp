// Engine::save_state, Engine::load_state and Engine::save_model (docs/checkpoints.md): the
// orchestration. The plan and the bytes' movement are in state_stream, the commit protocol in
// commit, asynchronous staging in staging, Hugging Face weights in hf_weights.
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
#include <set>
#include <unordered_set>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "engine/buffers.h"
#include "engine/checkpoint/commit.h"
#include "engine/host_cache.h"
#include "engine/checkpoint/consolidate.h"
#include "engine/checkpoint/fault_hooks.h"
#include "engine/checkpoint/hf_weights.h"
#include "engine/checkpoint/manifest.h"
#include "engine/checkpoint/safetensors.h"
#include "engine/checkpoint/staging.h"
#include "engine/checkpoint/state_stream.h"
#include "engine/checkpoint/tensor_dtype.h"
#include "engine/comm/communicator.h"
#include "engine/engine_state.h"
#include "engine/log.h"
#include "engine/error.h"
#include "engine/runtime/runtime.h"
#include "offload/crc32c.h"
#include "offload/prefault.h"

namespace zeal {

namespace fs = std::filesystem;
using nlohmann::json;

using namespace ckpt;

namespace {

// 2: the model's buffers (kind "buffer") and the names exports use (export_names).
constexpr int kFormatVersion = 2;

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

int64_t Engine::kept_staging_bytes() const { return state_ ? state_->staging_pool->bytes() : 0; }

void Engine::release_kept_staging() {
  // A pending save's chunks go back to the pool when wait_for_save collects it (failed or not).
  struct Release {
    ckpt::StagingPool& pool;
    ~Release() { pool.clear(); }
  } release{*state_->staging_pool};
  wait_for_save();
}

void Engine::finish_background_save() noexcept {
  if (!state_) return;
  try {
    if (state_->saving.valid()) {
      const std::string e = state_->saving.get();
      if (!e.empty()) {
        log::rank_error("the asynchronous save_state of {} failed on this rank: {}", state_->saving_dir, e);
      }
    }
    if (state_->cleanup.valid()) state_->cleanup.wait();
  } catch (...) {
  }
}

std::string Engine::save_state(const std::string& dir_arg, const SaveOptions& options) {
  if (!state_->zero) throw Error("save_state: prepare a model and its optimizer first");
  host_cache_trim();  // a phase ends: the steps' cached blocks go back before the staging comes
  if (state_->grads_pending || backward_pending_) {
    throw Error("save_state: called in the middle of an accumulation (gradients of micro-steps not yet stepped "
                "would be lost); save after opt.step()");
  }
  wait_for_save();  // an earlier asynchronous save completes first
  const bool keep = options.async && options.keep_staging;
  if (!keep) state_->staging_pool->clear();  // kept staging is released before the state is read
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
  meta["skipped_steps"] = skipped_steps_;  // steps an overflow skipped: steps_per_print counts both
  meta["export_names"] = export_names(*state_->module);
  meta["lora"] = lora_layers(*state_->module);  // what an export with `merged` adds into each weight
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
    // hybrid_shard: the other machines hold copies of machine 0's shards; only machine 0 writes them.
    if (state_->replica_index > 0) plan.ranges.clear();
    if (z.stage() < 3 && rank == 0 && options.include_frozen) {
      // The parameters the optimizer holds are saved from it, whatever their requires_grad says now
      // (inside disable_adapter() the modules to save are frozen and hold their original values).
      for (auto& [name, p] : frozen_params(*state_->module)) {
        if (state_->trained_names.count(name)) continue;
        plan.ranges.push_back({name, p.sizes().vec(), 0, p.numel(), p.detach().reshape({-1})});
      }
    }
    if (z.stage() == 3 && !options.include_frozen) {
      std::erase_if(plan.ranges, [](const zero::StateRange& r) { return r.step == nullptr; });
    }
    // The model's buffers, whole, from rank 0 (every rank's are rank 0's with broadcast_buffers).
    const size_t first_buffer = plan.ranges.size();
    if (rank == 0) {
      const auto transient = non_persistent_buffers(*state_->module);
      for (const auto& item : state_->module->named_buffers(true)) {
        if (transient.count(item.key())) continue;
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
    // A test hook (fault_hooks.h): that rank's first write fails.
    if (const int e = injected_write_error(rank)) w->inject({.at_request = 0, .error = e});
    mine["pieces"] = file_pieces(plan, *w);
    if (!options.async) {
      WriterSink sink(*w);
      emit_file(plan, sink, rank, z);
      mine["file"] = file_record(file, w->finish());
    } else {
      // The default budget counts this rank's kept staging as available (the copy reuses it), so a
      // kept staging is as large as a fresh one would be, never growing from save to save.
      const int64_t kept = state_->staging_pool->bytes();  // 0 unless keep (released above)
      int64_t budget = options.staging_bytes > 0 ? options.staging_bytes
                                                 : default_staging_budget(runtime_->local_world_size()) + kept / 2;
      int64_t bytes = 0;
      for (const auto& e : plan.entries) bytes += e.bytes;
      // Where the state fits, the staging is whole chunks that hold it all (a kept one then holds
      // the whole state for the next save).
      const int64_t whole_bytes = Staging::whole_bytes(bytes);
      const bool whole = budget >= whole_bytes;
      budget = std::min(budget, whole_bytes);
      // Writes wait for the copy only when kept staging holds the whole state (the copy then runs at
      // memory speed with the cores to itself); into fresh staging they start at once, so the copy
      // reuses written chunks where faulting in fresh pages is slower than the disk (checkpoint_bench
      // on a VM whose host reclaims free memory: 0.83 of a whole save blocked against 1.63 held).
      const bool hold = whole && keep && kept >= budget;
      staging = std::make_shared<Staging>(budget, keep ? state_->staging_pool : nullptr, hold,
                                          whole ? Staging::chunk_for(bytes + (1 << 20)) : 0);
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
  state_->staging_pool->clear();  // kept staging (keep_staging) is released for the load's own memory
  host_cache_trim();  // a phase ends: the steps' cached blocks go back before the state comes in
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
  // (buffer or frozen parameter not contiguous, the contiguous copy the load writes): put back after.
  std::vector<std::pair<at::Tensor, at::Tensor>> copied_back;
  std::vector<std::unique_ptr<char[]>> kept;  // each read's bytes, when they fit the budget
  // Reads put in place as pass one checks them (optimizer state still at its zeros), what applies
  // them, and the steps whose state it wrote: they go back to zeros unless the load goes on to apply
  // the rest (whatever ends it: an error on any rank, the agreement itself failing).
  std::vector<char> in_place;
  StreamApplier early(items, read_to, /*walk=*/nullptr);
  int64_t in_place_bytes = 0;
  struct ZeroAgain {
    std::set<zero::ShardStep*> steps;
    void now() {
      for (zero::ShardStep* s : steps) s->zero_state();
      steps.clear();
    }
    ~ZeroAgain() {
      try {
        now();
      } catch (...) {  // zeroing host memory does not fail; nothing may escape a destructor
      }
    }
  } zero_again;
  std::vector<std::pair<std::string, at::Tensor>> frozen_whole;  // stages 0-2
  std::vector<std::string> custom;                                 // register_for_checkpointing
  std::vector<std::pair<std::string, at::Tensor>> rng;  // this rank's generators' saved states, checked
  json m;
  std::map<std::string, ckpt::SavedFile> files_;
  std::string error;
  auto t_read = std::chrono::steady_clock::now();  // where pass one begins (ZEAL_LOG_LEVEL=debug times it)
  int64_t pass_bytes = 0;
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
      if (m.contains("custom_crc32c") && k < m["custom_crc32c"].size() &&
          offload::crc32c(custom.back().data(), custom.back().size()) != m["custom_crc32c"][k].get<uint32_t>()) {
        throw Error(fmt::format("{} does not match its CRC32C in the manifest (corrupted or changed)",
                                (dir / fmt::format("custom_{}.bin", k)).string()));
      }
    }
    ranges = z.state_ranges(/*to_write=*/false);
    // Frozen parameters (stages 0-2) and the model's buffers (whole, rank 0's when saved) are ranges
    // too: checked in pass one and put in place in pass two with the rest (one not contiguous
    // through a contiguous copy, put back after).
    const auto whole = [&](const std::string& name, const at::Tensor& t) {
      at::Tensor values = t.detach();
      if (!values.is_contiguous()) copied_back.push_back({t, values = values.contiguous()});
      ranges.push_back({name, t.sizes().vec(), 0, t.numel(), values.view({-1})});
    };
    if (z.stage() < 3) {
      frozen_whole = frozen_params(*state_->module);
      for (auto& [name, p] : frozen_whole) whole(name, p);
    }
    const size_t first_buffer = ranges.size();
    if (m.value("version", 1) >= 2) {
      const auto transient = non_persistent_buffers(*state_->module);
      for (const auto& item : state_->module->named_buffers(true)) {
        if (!transient.count(item.key())) whole(item.key(), item.value());  // else the model's own values
      }
    } else if (!state_->module->buffers(true).empty()) {
      log::warning("load_state: {} was saved without the model's buffers (format version 1): they keep their values",
                   dir.string());
    }
    for (size_t i = 0; i < ranges.size(); ++i) {
      const zero::StateRange& r = ranges[i];
      const bool buffer = i >= first_buffer;
      const char* what = buffer ? "buffer" : "parameter";
      const auto sh = shapes.find(r.name);
      if (sh == shapes.end() || (buffer && !by.count({"buffer", r.name}))) {
        if (!r.step && !buffer) continue;  // a frozen parameter saved without frozen weights: it keeps its value
        throw Error(fmt::format("the checkpoint has no {} '{}'", what, r.name));
      }
      if (sh->second != r.shape) {
        throw Error(fmt::format("{} '{}' is {} in the checkpoint and {} in the model", what, r.name,
                                json(sh->second).dump(), json(r.shape).dump()));
      }
      std::vector<std::string> kinds{r.step ? "master" : buffer ? "buffer" : "param"};
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
    // Random number generators: each rank its own, when the world size is the one that saved them;
    // read and checked now, with everything else, and set once the rest is applied.
    if (m["world_size"].get<int>() == c.world_size()) {
      const std::string file = fmt::format("rank{}.safetensors", c.rank());
      const auto header = ckpt::read_safetensors_header((dir / file).string());
      for (const std::string key : {"rng/cpu", "rng/cuda"}) {
        const auto it = header.tensors.find(key);
        if (it == header.tensors.end()) continue;
        if (key == "rng/cuda" && !device_.is_cuda()) continue;
        at::Tensor t = at::empty({it->second.bytes}, at::kByte);
        ckpt::read_checked(dir / file, files.at(file), it->second.offset, it->second.bytes, static_cast<char*>(t.data_ptr()));
        rng.push_back({key, t});
      }
    }
    // What fits the budget is kept from the check to the apply (each byte read once).
    int64_t total = 0;
    for (const auto& r : reads) total += r.n;
    const int64_t budget = options.memory_budget >= 0
                               ? options.memory_budget
                               : default_staging_budget(runtime_->local_world_size()) / 2;  // -1: auto
    std::unique_ptr<offload::Prefaulter> prefault;
    if (total <= budget && total > 0) {
      // On 4 KiB pages: huge pages measured slower here (docs/benchmarks.md, checkpoint_bench).
      std::vector<std::pair<char*, int64_t>> fresh;
      for (auto& r : reads) {
        kept.emplace_back(new char[static_cast<size_t>(r.n)]);  // not zeroed: every byte is read
        r.out = kept.back().get();
        fresh.emplace_back(r.out, r.n);
      }
      // Their pages are faulted in on a thread of its own, in the order the reads fill them, while
      // the disk reads into the ones before (the reads themselves wait on the disk, not the CPU).
      // (checkpoint_bench, 5e8 parameters on 2 ranks, alternated: 1.10-1.19 GB/s against 0.92-0.96.)
      prefault = std::make_unique<offload::Prefaulter>(std::move(fresh));
    }
    // Two passes read through the page cache: the second finds there what memory pressure left of
    // the first (the page cache is the kernel's to give back, not this process's). Optimizer state
    // that still holds the zeros it was made with (a resume before its first step) has nothing a
    // failed load must keep: it is put in place as pass one checks its blocks, not read again, and
    // zeroed again if any rank fails.
    in_place.assign(reads.size(), 0);
    if (kept.empty()) {
      for (size_t i = 0; i < reads.size(); ++i) {
        const LoadItem& it = items[read_to[i].first];
        const zero::StateRange& r = *it.range;
        in_place[i] = it.kind != "master" && it.kind != "param" && r.step != nullptr && r.step->state_zero() &&
                      r.step->host_state(it.kind, r.index + read_to[i].second, reads[i].n / it.es) != nullptr;
        if (in_place[i]) in_place_bytes += reads[i].n;
        reads[i].cached = !in_place[i];  // read again by pass two: through the page cache
      }
    }
    // Bytes read once (kept, or put in place) go through the page cache too, and leave it as they
    // are checked: on this machine's disk that made the one-read load 20-30 % faster than with
    // O_DIRECT, the resume as fast (docs/benchmarks.md, checkpoint_bench).
    for (size_t i = 0; i < reads.size(); ++i) reads[i].drop = !kept.empty() || in_place[i];
    reader = std::make_unique<ckpt::CheckedReader>(32 << 20, /*direct=*/false);
    t_read = std::chrono::steady_clock::now();
    // Pass one: checked (and kept, within the budget; or put in place, see above).
    reader->read_many(reads, [&](size_t i, int64_t at, const char* p, int64_t n) {
      if (!in_place[i]) return;
      zero_again.steps.insert(items[read_to[i].first].range->step);  // before: a failed take may have written
      early.take(i, at, p, n);
    });
    early.flush();
    for (const auto& r : reads) pass_bytes += r.n;
  } catch (const std::exception& e) {
    error = e.what();
  }
  const auto t_checked = std::chrono::steady_clock::now();
  // Nothing changes unless every rank read and checked everything it needs.
  const std::string failed = agreed_failures(*this, error);
  const auto t_agreed = std::chrono::steady_clock::now();
  const bool read_once = !kept.empty();
  if (!failed.empty()) {
    zero_again.now();  // what was put in place: zeros again
    z.end_state_access(/*changed=*/false);
    throw Error(fmt::format("load_state: {}: nothing was changed:{}", dir.string(), failed));
  }
  // Pass two: the reads not yet in place, checked again, applied as they come.
  std::vector<ckpt::CheckedReader::Read> again;
  std::vector<size_t> again_to;  // each one's index in `reads`
  for (size_t i = 0; i < reads.size(); ++i) {
    if (read_once || !in_place[i]) again.push_back(reads[i]), again_to.push_back(i);
  }
  if (!again.empty()) {
    maybe_change_between_passes(again.front().path.string(), again.front().offset + again.front().n / 2, c.rank());
    std::vector<std::string> paths;
    for (const auto& r : again) paths.push_back(r.path.string());
    maybe_evict_between_passes(paths, c.rank());
  }
  std::string reread;
  GroupWalk walk(z, /*changed=*/true);
  StreamApplier apply(items, read_to, &walk);  // apply.applied(): whether pass two changed anything
  try {
    c10::NoGradGuard no_grad;
    if (read_once) {
      for (size_t i = 0; i < reads.size(); ++i) apply.take(i, 0, reads[i].out, reads[i].n);
    } else {
      // Through mappings of the files (the page cache's pages themselves, no copy into the reader's
      // buffers), else read again.
      const auto take = [&](size_t j, int64_t at, const char* p, int64_t n) { apply.take(again_to[j], at, p, n); };
      reader.reset();  // its spans go: the mapped window takes their place
      // A MiB at a time into host memory (checked while in the CPU's cache), 8 MiB to a device.
      const int64_t piece = device().is_cpu() ? ckpt::kCrcBlock : int64_t{8} << 20;
      if (!ckpt::read_mapped(again, take, piece)) {
        log::debug("load_state: {}: read again with the reader's threads (a file could not be mapped, or the "
                   "page cache no longer holds the bytes)",
                   dir.string());
        ckpt::CheckedReader(32 << 20, /*direct=*/false).read_many(again, take);
      }
    }
    apply.flush();
    walk.close();
    kept.clear();
    for (auto& [t, values] : copied_back) t.detach().copy_(values);
    for (zero::ShardStep* s : z.steps()) s->optimizer().set_steps(m["optimizer_steps"].get<int64_t>());
  } catch (const std::exception& e) {
    reread = e.what();
  }
  z.end_state_access(/*changed=*/true);
  if (const std::string failed_again = agreed_failures(*this, reread); !failed_again.empty()) {
    const auto said = all_strings(*this, apply.applied() ? "1" : "0");
    if (std::find(said.begin(), said.end(), "1") == said.end()) {
      zero_again.now();  // pass one's state in place (if any) was the only change: zeros again
      throw Error(fmt::format("load_state: {}: the checkpoint was checked, then failed when read again to be applied "
                              "(did it change meanwhile?), before anything was applied: nothing was changed:{}",
                              dir.string(), failed_again));
    }
    zero_again.steps.clear();  // partly loaded: the state stays as it is
    throw Error(fmt::format("load_state: {}: the checkpoint was checked, then failed when read again to be applied "
                            "(did it change meanwhile?): the model and optimizer are now partly loaded; load a "
                            "checkpoint again before training:{}",
                            dir.string(), failed_again));
  }
  zero_again.steps.clear();  // loaded: what went in place stays
  const auto t_applied = std::chrono::steady_clock::now();  // pass two done on every rank
  const auto secs = [](auto a, auto b) { return std::chrono::duration<double>(b - a).count(); };
  log::debug("load_state: {} bytes {} ({} of them put in place as they were checked: optimizer state still at its "
             "zeros): read and checked in {:.2f} s ({:.2f} GB/s), the ranks agreed (the slower one waited for) in "
             "{:.2f} s, {} in {:.2f} s ({:.2f} GB/s)",
             pass_bytes, read_once ? "read once" : "in two passes", in_place_bytes, secs(t_read, t_checked),
             pass_bytes / std::max(1e-9, secs(t_read, t_checked)) / 1e9, secs(t_checked, t_agreed),
             read_once ? "applied" : "the rest read again and applied", secs(t_agreed, t_applied),
             (pass_bytes - in_place_bytes) / std::max(1e-9, secs(t_agreed, t_applied)) / 1e9);
  // Random number generators: each rank its own, when the world size is the one that saved them.
  const int saved_world = m["world_size"].get<int>();
  if (saved_world == c.world_size()) {
    for (const auto& [key, t] : rng) {
      at::Generator g = key == "rng/cpu" ? at::detail::getDefaultCPUGenerator()
                                         : at::globalContext().defaultGenerator(device_);  // a handle
      std::lock_guard<std::mutex> lock(g.mutex());
      g.set_state(t);
    }
  } else {
    log::info("load_state: random number generators not restored (saved by {} ranks, running on {})", saved_world,
              c.world_size());
  }
  optimizer_steps_ = m["optimizer_steps"].get<int64_t>();
  skipped_steps_ = m.value("skipped_steps", int64_t{0});  // absent before this field existed
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
      o.merged = options.merged;
      for (const auto& [from, to] : options.names) o.rename[from] = {to.name, to.transpose};
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


void Engine::register_for_checkpointing(std::shared_ptr<Checkpointable> object) {
  if (!object) throw Error("register_for_checkpointing: a null object");
  state_->custom.push_back(std::move(object));
}

}  // namespace zeal
