#include "engine/runtime/dist_env.h"

#include <cstdlib>

#include <fmt/format.h>

#include "engine/config/config.h"
#include "engine/error.h"

namespace zeal {
namespace {

const char* get(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

int to_int(const char* name, const char* value) {
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(value, &end, 10);
  if (errno != 0 || end == value || *end != '\0' || v < 0 || v > 1 << 24) {
    throw Error(fmt::format("environment variable {}={} is not a non-negative integer", name, value));
  }
  return static_cast<int>(v);
}

int int_var(const char* name, int fallback) {
  const char* v = get(name);
  return v ? to_int(name, v) : fallback;
}

// "4(x2),3" → the first count; Slurm's SLURM_TASKS_PER_NODE.
int first_task_count(const char* value) { return std::atoi(value); }

}  // namespace

DistEnv DistEnv::from_environment(const Config* config) {
  DistEnv e;
  if (config) {
    e.master_addr = config->launch.main_process_ip;
    e.master_port = static_cast<int>(config->launch.main_process_port);
  }
  const char *rank_var = nullptr, *world_var = nullptr;
  if (get("RANK") || get("WORLD_SIZE")) {
    if (!get("RANK") || !get("WORLD_SIZE")) {
      throw Error(fmt::format("{} is set but {} is not: start the program with zeal launch or torchrun, or set both",
                              get("RANK") ? "RANK" : "WORLD_SIZE", get("RANK") ? "WORLD_SIZE" : "RANK"));
    }
    e.source = get("ZEAL_LAUNCH") ? "zeal launch" : "torchrun";
    rank_var = "RANK";
    world_var = "WORLD_SIZE";
    e.rank = to_int("RANK", get("RANK"));
    e.world_size = to_int("WORLD_SIZE", get("WORLD_SIZE"));
    e.local_rank = int_var("LOCAL_RANK", e.rank);
    e.local_world_size = int_var("LOCAL_WORLD_SIZE", e.world_size);
    e.node_rank = int_var("NODE_RANK", int_var("GROUP_RANK", e.rank / std::max(1, e.local_world_size)));
  } else if (get("OMPI_COMM_WORLD_RANK")) {
    e.source = "Open MPI";
    rank_var = "OMPI_COMM_WORLD_RANK";
    world_var = "OMPI_COMM_WORLD_SIZE";
    e.rank = to_int(rank_var, get(rank_var));
    e.world_size = int_var(world_var, 1);
    e.local_rank = int_var("OMPI_COMM_WORLD_LOCAL_RANK", e.rank);
    e.local_world_size = int_var("OMPI_COMM_WORLD_LOCAL_SIZE", e.world_size);
    e.node_rank = int_var("OMPI_COMM_WORLD_NODE_RANK", e.rank / std::max(1, e.local_world_size));
  } else if (get("SLURM_PROCID") && get("SLURM_NTASKS")) {
    e.source = "Slurm";
    rank_var = "SLURM_PROCID";
    world_var = "SLURM_NTASKS";
    e.rank = to_int(rank_var, get(rank_var));
    e.world_size = to_int(world_var, get(world_var));
    e.local_rank = int_var("SLURM_LOCALID", 0);
    e.local_world_size = get("SLURM_NTASKS_PER_NODE") ? int_var("SLURM_NTASKS_PER_NODE", 1)
                         : get("SLURM_TASKS_PER_NODE") ? first_task_count(get("SLURM_TASKS_PER_NODE"))
                                                       : 1;
    e.node_rank = int_var("SLURM_NODEID", 0);
  }
  if (const char* a = get("MASTER_ADDR")) e.master_addr = a;
  if (const char* p = get("MASTER_PORT")) {
    e.master_port = to_int("MASTER_PORT", p);
    if (e.master_port < 1 || e.master_port > 65535) throw Error(fmt::format("MASTER_PORT={} is not a TCP port", p));
  }
  if (rank_var) {
    if (e.world_size < 1) throw Error(fmt::format("{}={} must be at least 1", world_var, e.world_size));
    if (e.rank >= e.world_size) {
      throw Error(fmt::format("{}={} is not below {}={}", rank_var, e.rank, world_var, e.world_size));
    }
    if (e.local_world_size < 1 || e.local_rank >= e.local_world_size) {
      throw Error(fmt::format("local rank {} is not below the local world size {} ({})", e.local_rank,
                              e.local_world_size, e.source));
    }
  }
  return e;
}

}  // namespace zeal
