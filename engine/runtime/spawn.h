// zeal::spawn: runs a function on N ranks in child processes (Accelerate's notebook_launcher).
// The parent hosts a fresh c10d store on a free port; each child builds a zeal::Runtime and
// calls the function with it. When a rank fails, the others get a grace period to fail or
// finish on their own and are then killed.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

namespace zeal {

class Runtime;

struct SpawnOptions {
  double comm_timeout = 60.0;       // seconds, for every collective in the children
  bool debug_collectives = false;   // ZEAL_DEBUG_COLLECTIVES in the children
  double grace_seconds = 10.0;      // after the first failure, before SIGKILL
  double timeout_seconds = 0.0;     // whole run; 0: none
  std::map<std::string, std::string> env;  // more variables for the children
  // Ranks per simulated machine (0: all on one): rank r is local rank r % n of machine r / n
  // (LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK), as a launcher per machine would start them.
  int ranks_per_machine = 0;
};

struct RankResult {
  int rank = 0;
  int exit_code = 0;     // the child's exit status; -1 when killed by a signal
  int signal = 0;        // the signal that ended it, 0 if none
  std::string failure;   // the exception text when the function threw, or why it was stopped
  bool ok() const { return exit_code == 0 && signal == 0; }
};

// Returns one result per rank, in rank order. Children run torch with one intra-op thread
// unless the function sets another count. Refuses (zeal::Error) in a process that has already
// initialised CUDA: forked children could not use it.
std::vector<RankResult> spawn(const std::function<void(Runtime&)>& fn, int nprocs, const SpawnOptions& options = {});

// Whether this process has initialised the CUDA driver (without initialising it to find out).
bool cuda_initialized_in_this_process();

// "rank 1: exit 1: <failure>" lines for the failed ranks (empty when all succeeded).
std::string describe_failures(const std::vector<RankResult>& results);

}  // namespace zeal
