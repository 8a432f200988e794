// `zeal launch`: accelerate launch / torchrun for any program.
#include <filesystem>
#include <map>

#include <fmt/format.h>

#include "cli/commands.h"
#include "cli/number_flags.h"
#include "engine/config/finalize.h"
#include "engine/config/config.h"
#include "engine/error.h"
#include "engine/launch/launcher.h"

namespace zeal::cli {

namespace {

struct LaunchState {
  std::string config_file;
  std::map<std::string, std::string> flags;  // config overrides, by flag name
  int nproc_per_node = 0, nnodes = 0, node_rank = -1, master_port = 0;
  std::string master_addr;
  bool quiet_ranks = false, no_bind = false, verbose = false;
  double grace = 5.0;
  int max_restarts = 0;
};

}  // namespace

Config load_launch_config(const std::string& config_file, const std::map<std::string, std::string>& flags,
                          std::string* used_file) {
  std::string file = config_file;
  if (file.empty() && std::filesystem::exists(default_config_path())) file = default_config_path();
  std::vector<Config::Setting> settings;
  for (const auto& [name, value] : flags) settings.push_back({name, value, {Origin::Kind::kFlag, "--" + name}});
  Config c = config_detail::load_with(file, settings);
  if (used_file) *used_file = file;
  return c;
}

LaunchOptions launch_options_from(const Config& c, const std::string& file, const std::map<std::string, std::string>& flags) {
  LaunchOptions o;
  o.nnodes = static_cast<int>(c.launch.num_machines);
  o.nproc_per_node = static_cast<int>(c.launch.num_processes / std::max<int64_t>(1, c.launch.num_machines));
  o.node_rank = static_cast<int>(c.launch.machine_rank);
  o.master_addr = c.launch.main_process_ip;
  o.master_port = static_cast<int>(c.launch.main_process_port);
  o.config_file = file;
  // The ranks see the same overrides through the environment (ZEAL_<FLAG>), and the launch
  // values through the torchrun variables.
  for (const auto& f : override_flags()) {
    if (auto it = flags.find(f.flag); it != flags.end()) o.env[f.env] = it->second;
  }
  return o;
}

Runner add_launch_command(CLI::App& app) {
  auto st = std::make_shared<LaunchState>();
  auto* cmd = app.add_subcommand(
      "launch",
      "Start PROGRAM once per local rank with RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR, "
      "MASTER_PORT and ZEAL_CONFIG_FILE set; prefix each output line with its rank; stop every rank when one fails");
  cmd->add_option("--config_file", st->config_file,
                  "Config file (default: " + default_config_path() + " when it exists, else the defaults)");
  add_override_flags(*cmd, st->flags);
  cmd->add_option("--nproc_per_node", st->nproc_per_node, "Processes on this machine (torchrun's name; "
                  "--num_processes counts all machines)")->group("torchrun names")->check(flags::integer_in(1, 65536));
  cmd->add_option("--nnodes", st->nnodes, "Machines (same as --num_machines)")->group("torchrun names")->check(flags::integer_in(1, 65536));
  cmd->add_option("--node_rank", st->node_rank, "This machine's index (same as --machine_rank)")->group("torchrun names")->check(flags::integer_in(0, 65535));
  cmd->add_option("--master_addr", st->master_addr, "Address of machine 0 (same as --main_process_ip)")->group("torchrun names");
  cmd->add_option("--master_port", st->master_port, "Rendezvous port (same as --main_process_port)")->group("torchrun names")->check(flags::integer_in(1, 65535));
  cmd->add_flag("--quiet_ranks", st->quiet_ranks, "Show only rank 0's output (a failing rank's last lines are still shown)");
  cmd->add_flag("--no_bind", st->no_bind, "Do not bind each local rank to its own cores");
  cmd->add_flag("--verbose", st->verbose, "Print the ranks, their environment and their CPU binding before starting");
  cmd->add_option("--stop_grace", st->grace, "Seconds between SIGTERM and SIGKILL when stopping ranks")->capture_default_str();
  cmd->add_option("--max_restarts,--max-restarts", st->max_restarts,
                  "Restart every rank this many times at most after one fails (ZEAL_RESTART_COUNT and "
                  "TORCHELASTIC_RESTART_COUNT tell the program which attempt it is; resume with --resume auto); a "
                  "failure that repeats the one before ends the launch at once")
      ->capture_default_str()
      ->check(flags::integer_in(0, 1000));
  cmd->prefix_command();  // PROGRAM and everything after it belong to the program
  cmd->footer("PROGRAM [ARGS...]: any executable; zeal programs read the config from ZEAL_CONFIG_FILE.");

  return [st, cmd]() {
    // torchrun names are the same settings as the config's launch keys.
    if (st->nnodes > 0) st->flags["num_machines"] = std::to_string(st->nnodes);
    if (st->node_rank >= 0) st->flags["machine_rank"] = std::to_string(st->node_rank);
    if (!st->master_addr.empty()) st->flags["main_process_ip"] = st->master_addr;
    if (st->master_port > 0) st->flags["main_process_port"] = std::to_string(st->master_port);
    if (st->nproc_per_node > 0) {
      if (st->flags.count("num_processes")) {
        throw Error("give either --num_processes (all machines) or --nproc_per_node (this machine), not both");
      }
    }
    std::map<std::string, std::string> flags = st->flags;
    if (st->nproc_per_node > 0) {
      // torchrun counts processes per machine; the config counts them over all machines.
      int64_t machines = 0;
      if (auto it = flags.find("num_machines"); it != flags.end()) {
        machines = std::stoll(it->second);
      } else {
        machines = load_launch_config(st->config_file, {}, nullptr).launch.num_machines;
      }
      flags["num_processes"] = std::to_string(st->nproc_per_node * machines);
    }
    std::string file;
    Config c = load_launch_config(st->config_file, flags, &file);
    LaunchOptions o = launch_options_from(c, file, flags);
    o.quiet_ranks = st->quiet_ranks;
    o.bind = !st->no_bind;
    o.verbose = st->verbose;
    o.grace_seconds = st->grace;
    o.max_restarts = st->max_restarts;
    o.command = cmd->remaining();
    if (o.command.empty()) throw Error("zeal launch: no program given (usage: zeal launch [options] PROGRAM [ARGS...])");
    return launch(o);
  };
}

}  // namespace zeal::cli
