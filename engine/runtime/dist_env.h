// Where this process sits in the group: rank, world size, local rank and the rendezvous address,
// read from the variables of zeal launch / torchrun, Open MPI (mpirun) or Slurm (srun).
#pragma once

#include <string>

namespace zeal {

struct Config;

struct DistEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string source = "single process";  // "zeal launch", "torchrun", "Open MPI", "Slurm"

  // Reads the environment. MASTER_ADDR/MASTER_PORT, when set, win over the config's
  // main_process_ip/main_process_port (mpirun and srun do not set them). Throws zeal::Error
  // naming the variable when values are missing or inconsistent.
  static DistEnv from_environment(const Config* config = nullptr);
};

}  // namespace zeal
