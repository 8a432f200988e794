// checkpoint_bench: engine.save_state and engine.load_state of a model's whole training state
// (fp32 parameters with AdamW: master = parameters, m and v; 12 bytes per parameter) on 2 ranks
// (stage 3), against fio writing and reading as many bytes in the same directory (2 jobs, one per
// rank, 1 MiB requests, queue depth 16, io_uring, O_DIRECT, fsync at the end as a checkpoint must;
// fio writes new files each round, as a checkpoint does, and reads the checkpoint's own files), in
// interleaved rounds; the page cache is
// dropped before every read (where this process may). A load into the engine that saved (its
// optimizer state is the checkpoint's) and a resume (a new engine, made untimed each round, whose
// optimizer state is still the zeros it was made with). Also how long an asynchronous save blocks
// the training loop (save_state with .async: the copy into staging) against the whole save, and
// the floor of that blocking: the same bytes copied by memcpy on both ranks at once, into memory
// already faulted in and into fresh memory. And the peak resident set of `zeal consolidate` on that
// checkpoint against the model's size. A
// save's background work (writes, removing the checkpoint it replaced) ends before the next
// contender starts.
//
//   build/bin/checkpoint_bench [--dir D] [--params N] [--rounds R] [--json PATH]
//
// D defaults to build/; N to 5e8 parameters (6 GB of state: 1e9 needs about 30 GB of memory for
// the two ranks' model, master and state on one machine).
#include <sys/resource.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include "benchmarks/rounds.h"
#include "engine/engine.h"
#include "engine/memory_tracker.h"
#include "engine/runtime/runtime.h"
#include "engine/runtime/spawn.h"
#include "engine/zero/sharded.h"
#include "engine/output.h"
#include "offload/prefault.h"

namespace {

using zeal_bench::run_command;
constexpr auto& run = run_command;

// fio's aggregate bandwidth (bytes/s) of `jobs` jobs moving `bytes` in all under `dir`.
double fio(const std::string& dir, bool write, int64_t bytes, int jobs) {
  const std::string out = run(fmt::format(
      "fio --name=ckpt --directory={} --rw={} --bs=1M --size={} --numjobs={} --iodepth=16 --ioengine=io_uring "
      "--direct=1 --end_fsync={} --group_reporting --output-format=json 2>&1",
      dir, write ? "write" : "read", bytes / jobs, jobs, write ? 1 : 0));
  const auto j = nlohmann::json::parse(out.substr(out.find('{')));
  return j["jobs"][0][write ? "write" : "read"]["bw_bytes"].get<double>();
}

// fio's aggregate read bandwidth (bytes/s) over `files`, one job each, whole files.
double fio_read_files(const std::vector<std::string>& files) {
  std::string cmd =
      "fio --rw=read --bs=1M --iodepth=16 --ioengine=io_uring --direct=1 --group_reporting --output-format=json";
  for (size_t i = 0; i < files.size(); ++i) cmd += fmt::format(" --name=r{} --filename={}", i, files[i]);
  const std::string out = run(cmd + " 2>&1");
  const auto j = nlohmann::json::parse(out.substr(out.find('{')));
  return j["jobs"][0]["read"]["bw_bytes"].get<double>();
}

void drop_caches() { std::ofstream("/proc/sys/vm/drop_caches") << "3\n"; }

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// Blocks of one d x d weight, each a stage-3 unit.
struct Net : torch::nn::Module {
  std::vector<zeal::Sharded<torch::nn::Linear>> blocks;
  Net(int64_t d, int n) {
    for (int b = 0; b < n; ++b) {
      blocks.push_back(register_module("block" + std::to_string(b),
                                       zeal::Sharded<torch::nn::Linear>(torch::nn::LinearOptions(d, d).bias(false))));
    }
  }
};

}  // namespace

int main(int argc, char** argv) {
  std::string dir = ZEAL_BUILD_DIR, json_path;
  int64_t params = 500'000'000;
  int rounds = 3;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
      return argv[++i];
    };
    if (a == "--dir") dir = next();
    else if (a == "--params") params = static_cast<int64_t>(std::stod(next()));
    else if (a == "--rounds") rounds = std::stoi(next());
    else if (a == "--json") json_path = next();
    else {
      std::fprintf(stderr, "usage: checkpoint_bench [--dir D] [--params N] [--rounds R] [--json PATH]\n");
      return 2;
    }
  }
  constexpr int kWorld = 2, kBlocks = 16;
  const int64_t d = static_cast<int64_t>(std::sqrt(static_cast<double>(params) / kBlocks));
  const int64_t n = d * d * kBlocks, state_bytes = 12 * n;
  struct statvfs sv {};
  statvfs(dir.c_str(), &sv);
  const double free_gb = static_cast<double>(sv.f_bavail) * sv.f_frsize / 1e9;
  std::printf("checkpoint_bench: %.2f G parameters (%d blocks of %lld x %lld), %.1f GB of state, %d ranks, %d rounds, "
              "in %s (%.1f GB free)\n",
              n / 1e9, kBlocks, static_cast<long long>(d), static_cast<long long>(d), state_bytes / 1e9, kWorld,
              rounds, dir.c_str(), free_gb);
  if (free_gb * 1e9 < 3.2 * state_bytes) {
    std::fprintf(stderr, "checkpoint_bench: %s needs %.1f GB free\n", dir.c_str(), 3.2 * state_bytes / 1e9);
    return 1;
  }
  std::fflush(stdout);
  const std::string ckpt = dir + "/checkpoint_bench.ckpt", fio_dir = dir + "/checkpoint_bench.fio";
  std::filesystem::create_directories(fio_dir);
  const std::string result = dir + "/checkpoint_bench.result.json";
  zeal_bench::Environment env;
  env.begin();
  auto failures = zeal::spawn(
      [&](zeal::Runtime& rt) {
        zeal::Config c = zeal::Config::defaults(false);
        c.zero.stage = 3;
        c.zero.stage3_param_persistence_threshold = {0, false};
        // The engine, its model and optimizer: made again (a new engine, as a resume makes) by the
        // resume contender, in the same storage (the contenders below refer to `engine`).
        std::optional<zeal::Engine> made;
        std::shared_ptr<Net> model;
        std::optional<torch::optim::AdamW> opt;
        std::shared_ptr<void> prepared;
        auto make = [&] {  // the model goes first: an engine that outlives it has nothing to gather back into it
          prepared.reset();
          opt.reset();
          model.reset();
          made.reset();
          made.emplace(c, rt);
          model = std::make_shared<Net>(d, kBlocks);
          opt.emplace(model->parameters(), torch::optim::AdamWOptions(1e-4));
          using P = decltype(made->prepare(model, *opt));
          prepared = std::make_shared<P>(made->prepare(model, *opt));
        };
        make();
        zeal::Engine& engine = *made;
        const bool main = engine.is_main_process();
        // The background work of a save (an async save's writes, removing the checkpoint it
        // replaced) is over before the next contender starts.
        auto settle = [&] {
          engine.wait_for_save();
          if (main) ::sync();
          engine.wait_for_everyone();
        };
        // Each contender: seconds, measured the same on every rank (a collective ends together).
        auto timed = [&](const std::function<void()>& f) {
          engine.wait_for_everyone();
          const double t0 = now();
          f();
          engine.wait_for_everyone();
          return now() - t0;
        };
        // The resident set a contender adds over what the rank held before it (the kernel's
        // high-water mark, reset first): the most over the rounds, per contender.
        std::map<std::string, double> grown;
        auto measured = [&](const std::string& what, const std::function<void()>& f) {
          const double before = static_cast<double>(zeal::detail::resident_bytes());
          zeal::detail::reset_resident_peak();
          const double t = timed(f);
          grown[what] = std::max(grown[what], static_cast<double>(zeal::detail::resident_peak_bytes()) - before);
          return t;
        };
        // The copy's floor: 512 MiB per rank copied by memcpy on both ranks at once, into memory already
        // faulted in (a kept staging's case) and into fresh memory (FreshBuffer, as staging takes it).
        constexpr int64_t kCopy = int64_t{512} << 20;
        zeal::offload::FreshBuffer copy_src(kCopy), copy_dst(kCopy);
        std::memset(copy_src.data(), 1, kCopy);
        std::memset(copy_dst.data(), 2, kCopy);
        int64_t kept_staging = 0;  // what keep_staging held on this rank (its default budget)
        std::vector<zeal_bench::Contender> cs{
            {"zeal save",
             [&] {
               const double v = state_bytes / measured("save", [&] { engine.save_state(ckpt); });
               settle();
               return v;
             }},
            {"fio write",
             [&] {
               if (main) {  // new files, as a checkpoint writes
                 std::filesystem::remove_all(fio_dir);
                 std::filesystem::create_directories(fio_dir);
                 ::sync();
               }
               return main ? (timed([&] {}), fio(fio_dir, true, state_bytes, kWorld)) : (timed([] {}), 1.0);
             }},
            {"zeal async save, staging kept (blocking)",
             [&] {
               // keep_staging: a first save faults the staging in and keeps it, the second, timed,
               // copies into it.
               engine.save_state(ckpt, {.async = true, .keep_staging = true});
               settle();
               kept_staging = std::max(kept_staging, engine.kept_staging_bytes());
               const double v = state_bytes / timed([&] { engine.save_state(ckpt, {.async = true, .keep_staging = true}); });
               settle();
               engine.release_kept_staging();  // the contenders after it have the memory back
               return v;
             }},
            {"zeal load",  // the default budget: this state is beyond it, two passes
             [&] {
               if (main) drop_caches();
               return state_bytes / measured("load", [&] { engine.load_state(ckpt); });
             }},
            {"zeal resume",  // a new engine (optimizer state at its zeros) loads: the default budget
             [&] {
               make();  // not timed
               if (main) drop_caches();
               return state_bytes / measured("resume", [&] { engine.load_state(ckpt); });
             }},
            {"zeal load (kept)",  // a budget the state fits: each byte read once
             [&] {
               if (main) drop_caches();
               return state_bytes /
                      measured("load_kept", [&] { engine.load_state(ckpt, {.memory_budget = int64_t{1} << 50}); });
             }},
            {"memcpy into kept memory",
             [&] { return kWorld * kCopy / timed([&] { std::memcpy(copy_dst.data(), copy_src.data(), kCopy); }); }},
            {"memcpy into fresh memory",
             [&] {
               return kWorld * kCopy / timed([&] {
                 zeal::offload::FreshBuffer fresh(kCopy);
                 std::memcpy(fresh.data(), copy_src.data(), kCopy);
               });
             }},
            {"fio read",
             [&] {
               if (main) drop_caches();
               // the checkpoint's own files: the same bytes in the same places on the disk
               return main ? (timed([&] {}), fio_read_files({ckpt + "/rank0.safetensors", ckpt + "/rank1.safetensors"}))
                           : (timed([] {}), 1.0);
             }},
            {"zeal async save (blocking)",  // fresh staging; the rotation keeps it after fio read
             [&] {
               const double v = state_bytes / timed([&] { engine.save_state(ckpt, {.async = true}); });
               settle();
               return v;
             }},
        };
        // fio runs on rank 0 only: the others wait for it at the next collective.
        for (auto& cdt : cs) {
          auto inner = cdt.measure;
          cdt.measure = [&engine, inner] {
            const double v = inner();
            engine.wait_for_everyone();
            return v;
          };
        }
        const auto s = zeal_bench::interleave(cs, rounds, 1, [&](int r) {
          if (main) std::printf("  round %d of %d done\n", r, rounds), std::fflush(stdout);
        });
        if (main) {
          // Each contender's series, by name.
          const auto S = [&](const std::string& name) -> const zeal_bench::Series& {
            for (size_t i = 0; i < cs.size(); ++i)
              if (cs[i].name == name) return s[i];
            throw std::logic_error("no contender " + name);
          };
          nlohmann::json out;
          out["zeal_save_bytes_per_s"] = S("zeal save").values;
          out["fio_write_bytes_per_s"] = S("fio write").values;
          out["zeal_async_save_blocking_bytes_per_s"] = S("zeal async save (blocking)").values;
          out["zeal_async_save_kept_blocking_bytes_per_s"] =
              S("zeal async save, staging kept (blocking)").values;
          out["zeal_load_bytes_per_s"] = S("zeal load").values;
          out["zeal_load_kept_bytes_per_s"] = S("zeal load (kept)").values;
          out["memcpy_kept_bytes_per_s"] = S("memcpy into kept memory").values;
          out["memcpy_fresh_bytes_per_s"] = S("memcpy into fresh memory").values;
          out["fio_read_bytes_per_s"] = S("fio read").values;
          out["zeal_resume_bytes_per_s"] = S("zeal resume").values;
          zeal_bench::put_ratio(out, "save_ratio_vs_fio", zeal_bench::ratio(S("zeal save"), S("fio write")));
          zeal_bench::put_ratio(out, "load_ratio_vs_fio", zeal_bench::ratio(S("zeal load"), S("fio read")));
          zeal_bench::put_ratio(out, "load_kept_ratio_vs_fio",
                                zeal_bench::ratio(S("zeal load (kept)"), S("fio read")));
          zeal_bench::put_ratio(out, "resume_ratio_vs_fio", zeal_bench::ratio(S("zeal resume"), S("fio read")));
          // A load within the memory bound whose first pass read as fast as fio: the files read at
          // fio's speed, then the bytes pass two applies copied at memory speed (the kept-memory
          // memcpy's, both ranks at once), round by round. No floor where the page cache's reads
          // outrun fio's O_DIRECT ones. A load into the engine that saved applies everything in pass
          // two; a resume only the master weights (a third of fp32 AdamW's state: m and v go in
          // place as pass one checks them).
          const auto fio_plus_copy = [&](double again) {
            zeal_bench::Series f;
            const auto &rd = S("fio read").values, &cp = S("memcpy into kept memory").values;
            for (size_t i = 0; i < std::min(rd.size(), cp.size()); ++i)
              f.values.push_back(1.0 / (1.0 / rd[i] + again / cp[i]));
            return f;
          };
          out["load_fio_plus_copy_bytes_per_s"] = fio_plus_copy(1.0).values;
          out["resume_fio_plus_copy_bytes_per_s"] = fio_plus_copy(1.0 / 3).values;
          zeal_bench::put_ratio(out, "load_ratio_vs_fio_plus_copy", zeal_bench::ratio(S("zeal load"), fio_plus_copy(1.0)));
          zeal_bench::put_ratio(out, "resume_ratio_vs_fio_plus_copy", zeal_bench::ratio(S("zeal resume"), fio_plus_copy(1.0 / 3)));
          // The floor of an asynchronous save's blocking: the state copied at memory speed, as a
          // fraction of a whole save, round by round.
          zeal_bench::put_ratio(out, "copy_floor_kept_vs_save",
                                zeal_bench::ratio(S("zeal save"), S("memcpy into kept memory")));
          zeal_bench::put_ratio(out, "copy_floor_fresh_vs_save",
                                zeal_bench::ratio(S("zeal save"), S("memcpy into fresh memory")));
          for (const auto& [k, v] : grown) out["rank0_rss_growth_bytes"][k] = v;
          out["rank0_rss_before_bytes"] = static_cast<double>(zeal::detail::resident_bytes());
          zeal_bench::put_ratio(out, "async_save_blocking_vs_save",
                                zeal_bench::ratio(S("zeal save"), S("zeal async save (blocking)")));
          zeal_bench::put_ratio(out, "async_save_kept_blocking_vs_save",
                                zeal_bench::ratio(S("zeal save"), S("zeal async save, staging kept (blocking)")));
          out["rank0_kept_staging_bytes"] = kept_staging;
          std::ofstream(result) << out.dump();
        }
      },
      kWorld);
  if (!zeal::describe_failures(failures).empty()) {
    std::fprintf(stderr, "checkpoint_bench: %s\n", zeal::describe_failures(failures).c_str());
    return 1;
  }
  nlohmann::json out = nlohmann::json::parse(std::ifstream(result));
  std::filesystem::remove(result);
  // Consolidation: `zeal consolidate` in its own process, its peak resident set from wait4.
  const std::string model_dir = dir + "/checkpoint_bench.model";
  const double t0 = now();
  const pid_t pid = fork();
  if (pid == 0) {
    freopen("/dev/null", "w", stdout);
    execl(ZEAL_CLI, ZEAL_CLI, "consolidate", ckpt.c_str(), model_dir.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  int status = 0;
  struct rusage ru {};
  wait4(pid, &status, 0, &ru);
  const double consolidate_s = now() - t0, peak = ru.ru_maxrss * 1024.0, model_bytes = 4.0 * n;
  env.end();
  const auto sv_ = [&](const char* k) { return zeal_bench::Series{out[k].get<std::vector<double>>()}; };
  const auto ps = zeal_bench::ratio(sv_("zeal_save_bytes_per_s"), sv_("fio_write_bytes_per_s"));
  const auto pl = zeal_bench::ratio(sv_("zeal_load_bytes_per_s"), sv_("fio_read_bytes_per_s"));
  std::printf("| save | zeal %.2f GB/s (%.2f–%.2f) | fio write %.2f GB/s (%.2f–%.2f) | ratio %s (goal >= 0.9) |\n",
              sv_("zeal_save_bytes_per_s").median() / 1e9, sv_("zeal_save_bytes_per_s").min() / 1e9,
              sv_("zeal_save_bytes_per_s").max() / 1e9, sv_("fio_write_bytes_per_s").median() / 1e9,
              sv_("fio_write_bytes_per_s").min() / 1e9, sv_("fio_write_bytes_per_s").max() / 1e9, ps.text().c_str());
  std::printf("| load | zeal %.2f GB/s (%.2f–%.2f) | fio read %.2f GB/s (%.2f–%.2f) | ratio %s (goal >= 0.9) |\n",
              sv_("zeal_load_bytes_per_s").median() / 1e9, sv_("zeal_load_bytes_per_s").min() / 1e9,
              sv_("zeal_load_bytes_per_s").max() / 1e9, sv_("fio_read_bytes_per_s").median() / 1e9,
              sv_("fio_read_bytes_per_s").min() / 1e9, sv_("fio_read_bytes_per_s").max() / 1e9, pl.text().c_str());
  {
    const auto pk = zeal_bench::ratio(sv_("zeal_load_kept_bytes_per_s"), sv_("fio_read_bytes_per_s"));
    std::printf("| load, kept (memory_budget >= state) | zeal %.2f GB/s (%.2f–%.2f) | fio read | ratio %s |\n",
                sv_("zeal_load_kept_bytes_per_s").median() / 1e9, sv_("zeal_load_kept_bytes_per_s").min() / 1e9,
                sv_("zeal_load_kept_bytes_per_s").max() / 1e9, pk.text().c_str());
    const auto pr = zeal_bench::ratio(sv_("zeal_resume_bytes_per_s"), sv_("fio_read_bytes_per_s"));
    std::printf("| resume (a new engine loads: its optimizer state still zeros) | zeal %.2f GB/s (%.2f–%.2f) | fio read "
                "| ratio %s (goal >= 0.9) |\n",
                sv_("zeal_resume_bytes_per_s").median() / 1e9, sv_("zeal_resume_bytes_per_s").min() / 1e9,
                sv_("zeal_resume_bytes_per_s").max() / 1e9, pr.text().c_str());
    for (const char* what : {"load", "resume"}) {
      const std::string k = what;
      const auto f = sv_((k + "_fio_plus_copy_bytes_per_s").c_str());
      std::printf("| %s against fio's read plus the copy of what pass two applies | zeal "
                  "%.2f GB/s | fio + copy %.2f GB/s (%.2f–%.2f) | ratio %s |\n",
                  what, sv_(("zeal_" + k + "_bytes_per_s").c_str()).median() / 1e9, f.median() / 1e9, f.min() / 1e9,
                  f.max() / 1e9, zeal_bench::ratio(sv_(("zeal_" + k + "_bytes_per_s").c_str()), f).text().c_str());
    }
    const auto& g = out["rank0_rss_growth_bytes"];
    std::printf("| resident set added (rank 0, most of the rounds) | save %.0f MiB | load %.0f MiB | load, kept %.0f MiB "
                "| resume %.0f MiB (state per rank %.0f MiB) |\n",
                g["save"].get<double>() / (1 << 20), g["load"].get<double>() / (1 << 20),
                g["load_kept"].get<double>() / (1 << 20), g["resume"].get<double>() / (1 << 20),
                state_bytes / kWorld / double(1 << 20));
  }
  {
    const auto b = sv_("zeal_async_save_blocking_bytes_per_s"), full = sv_("zeal_save_bytes_per_s");
    std::printf("| async save | blocks %.2f s (%.2f–%.2f) | whole save %.2f s | blocking/whole %s |\n",
                state_bytes / b.median(), state_bytes / b.max(), state_bytes / b.min(), state_bytes / full.median(),
                zeal_bench::ratio(full, b).text().c_str());
    const auto k = sv_("zeal_async_save_kept_blocking_bytes_per_s");
    const double kept = out["rank0_kept_staging_bytes"].get<double>(), per_rank = double(state_bytes) / kWorld;
    std::printf("| async save, staging kept | blocks %.2f s (%.2f–%.2f) | whole save %.2f s | blocking/whole %s | "
                "staging %.0f MiB of the rank's %.0f MiB (%s) |\n",
                state_bytes / k.median(), state_bytes / k.max(), state_bytes / k.min(), state_bytes / full.median(),
                zeal_bench::ratio(full, k).text().c_str(), kept / (1 << 20), per_rank / (1 << 20),
                kept >= per_rank ? "the whole state: the copy alone blocks"
                                 : "the default budget, half the memory available: the rest waits for the writes");
    const auto mk = sv_("memcpy_kept_bytes_per_s"), mf = sv_("memcpy_fresh_bytes_per_s");
    std::printf("| copy floor (memcpy, both ranks at once) | into kept memory %.1f GB/s: the state in %.2f s, %s of a whole "
                "save | into fresh memory %.1f GB/s: %.2f s, %s |\n",
                mk.median() / 1e9, state_bytes / mk.median(), zeal_bench::ratio(full, mk).text().c_str(),
                mf.median() / 1e9, state_bytes / mf.median(), zeal_bench::ratio(full, mf).text().c_str());
  }
  std::printf("| consolidate (fp32) | %.1f s, peak resident set %.0f MB vs the model's %.0f MB: %.3f | exit %d |\n",
              consolidate_s, peak / 1e6, model_bytes / 1e6, peak / model_bytes,
              WIFEXITED(status) ? WEXITSTATUS(status) : -1);
  out["parameters"] = n;
  out["state_bytes"] = state_bytes;
  out["world_size"] = kWorld;
  out["consolidate_s"] = consolidate_s;
  out["consolidate_peak_rss"] = peak;
  out["consolidate_peak_ratio_vs_model"] = peak / model_bytes;
  out["environment"] = env.json();
  env.print();
  std::filesystem::remove_all(ckpt);
  std::filesystem::remove_all(fio_dir);
  std::filesystem::remove_all(model_dir);
  std::filesystem::remove(dir + "/latest");
  if (!json_path.empty()) {
    zeal::write_file_whole(json_path, out.dump(2).append("\n"), "--json");
    std::printf("wrote %s\n", json_path.c_str());
  }
  return 0;
}
