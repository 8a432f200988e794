// `zeal launch`: starts a program once per local rank with the torchrun environment, prefixes
// and forwards its output, forwards signals, and tears the group down when one rank fails.
#pragma once

#include <map>
#include <string>
#include <vector>

namespace zeal {

struct LaunchOptions {
  std::vector<std::string> command;  // program and its arguments
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string config_file;                  // exported as ZEAL_CONFIG_FILE when not empty
  std::map<std::string, std::string> env;   // more variables for every rank (ZEAL_<FLAG> overrides)
  bool quiet_ranks = false;                 // show only global rank 0's output
  bool bind = true;                         // hwloc CPU binding per local rank
  bool verbose = false;                     // print the plan: ranks, environment, binding
  double grace_seconds = 5.0;               // SIGTERM → SIGKILL delay when stopping ranks
  int tail_lines = 20;                      // lines of a failed rank's output repeated at the end
  // Restarts of the whole group after a rank fails (torchrun's --max_restarts): each attempt's
  // ranks see TORCHELASTIC_RESTART_COUNT / ZEAL_RESTART_COUNT (and ZEAL_PREVIOUS_ATTEMPT_PIDS: the
  // ranks before, whose offload swap files are removed). A program's failure that repeats the
  // previous one exactly (the same exit status and the same head line of its last message on
  // stderr, rank numbers aside) ends the launch at once: a bad config or a missing file does not
  // change by restarting. Ranks ended by a signal are retried.
  int max_restarts = 0;
};

// Runs the group to completion and returns the launcher's exit status: 0 when every rank exits
// 0, else the first failing rank's exit status (128 + signal for a signal) of the last attempt,
// 128 + signal when the launcher itself was interrupted. Throws zeal::Error for problems found before any rank starts
// (port in use, program not found, bad sizes).
int launch(const LaunchOptions& options);

// True when nothing listens on `port` here (checked by binding it).
bool port_is_free(int port, std::string* why = nullptr);

}  // namespace zeal
