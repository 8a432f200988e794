// `zeal test`: accelerate test for the distributed runtime. Launches itself over N ranks; each
// runs the collective self-check and rank 0 prints a PASS/FAIL line per check and a summary.
#include <unistd.h>

#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include <fmt/format.h>

#include "cli/commands.h"
#include "engine/comm/selfcheck.h"
#include "engine/config/config.h"
#include "engine/error.h"
#include "engine/launch/launcher.h"
#include "engine/runtime/runtime.h"

namespace zeal::cli {

namespace {

std::string self_path() {
  char buf[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) throw Error("cannot find this program's path (/proc/self/exe)");
  return std::string(buf, static_cast<size_t>(n));
}

int worker(const std::string& backend) {
  const auto t0 = std::chrono::steady_clock::now();
  const char* no_args[] = {"zeal"};
  Runtime rt(Config::from_env_or_file(1, no_args));
  const bool cuda = backend == "nccl";
  Communicator& comm = cuda ? rt.cuda_comm() : rt.comm();
  const auto results = run_collective_checks(comm, cuda);
  int failed = 0;
  for (const auto& r : results) {
    failed += r.passed ? 0 : 1;
    if (rt.is_main_process()) std::printf("%s  %s\n", r.passed ? "PASS" : "FAIL", r.name.c_str());
    if (!r.passed && !r.detail.empty()) std::fprintf(stderr, "  %s: %s\n", r.name.c_str(), r.detail.c_str());
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (rt.is_main_process()) {
    std::printf("zeal test: %zu checks, %zu passed, %d failed on %d rank%s (%s, %s) in %.1f s\n", results.size(),
                results.size() - failed, failed, rt.world_size(), rt.world_size() == 1 ? "" : "s",
                comm.backend().c_str(), rt.env().source.c_str(), secs);
    std::printf("%s\n", failed ? "FAIL" : "PASS");
  }
  std::fflush(stdout);
  // ZEAL_TEST_LINGER=R:MS: rank R waits MS milliseconds before it leaves (the runtime's exit handshake
  // with a rank that is still freeing memory or deleting files, as after a large run).
  if (const char* linger = std::getenv("ZEAL_TEST_LINGER")) {
    int r = -1, ms = 0;
    if (std::sscanf(linger, "%d:%d", &r, &ms) == 2 && r == rt.rank() && ms > 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    }
  }
  return failed ? 1 : 0;
}

}  // namespace

Runner add_test_command(CLI::App& app) {
  struct State {
    std::string config_file, backend = "gloo";
    std::map<std::string, std::string> flags;
  };
  auto st = std::make_shared<State>();
  auto* cmd = app.add_subcommand("test",
                                 "Check the distributed runtime: every collective, dtype and uneven size over N ranks, "
                                 "compared with values each rank computes itself; one PASS/FAIL line per check");
  cmd->add_option("--config_file", st->config_file, "Config file (default: the default config when it exists)");
  cmd->add_option("--backend", st->backend, "gloo (CPU tensors) or nccl (CUDA tensors, one GPU per rank)")
      ->capture_default_str()
      ->check(CLI::IsMember({"gloo", "nccl"}));
  add_override_flags(*cmd, st->flags);
  return [st]() {
    if (std::getenv("ZEAL_TEST_WORKER")) return worker(st->backend);
    std::string file;
    Config c = load_launch_config(st->config_file, st->flags, &file);
    if (!st->flags.count("num_processes") && c.launch.num_processes < 2) {
      st->flags["num_processes"] = "2";  // a test over one rank checks little
      c = load_launch_config(st->config_file, st->flags, &file);
    }
    LaunchOptions o = launch_options_from(c, file, st->flags);
    o.command = {self_path(), "test", "--backend", st->backend};
    o.env["ZEAL_TEST_WORKER"] = "1";
    o.quiet_ranks = true;
    std::printf("zeal test: launching %d of %d ranks on machine %d (%s)\n", o.nproc_per_node, o.nproc_per_node * o.nnodes,
                o.node_rank, st->backend.c_str());
    std::fflush(stdout);
    return launch(o);
  };
}

}  // namespace zeal::cli
