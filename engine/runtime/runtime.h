// zeal::Runtime: this process's membership of the training group. Constructing it reads where
// the process sits (zeal launch, torchrun, mpirun, srun or nothing: a single process), meets the
// other ranks through a c10d TCPStore on MASTER_ADDR:MASTER_PORT (rank 0 hosts it), and opens
// the Gloo communicator; the NCCL one opens on first use.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "engine/comm/communicator.h"
#include "engine/runtime/dist_env.h"

namespace zeal {

struct Config;

struct RuntimeOptions {
  double comm_timeout = 1800.0;  // seconds; the config's comm_timeout
  bool debug_collectives = false;  // also on when ZEAL_DEBUG_COLLECTIVES=1
  // Rank 0 connects to a store another process already hosts (zeal::spawn does this).
  bool store_hosted_elsewhere = false;
  // Installs a terminate handler that prints an uncaught exception's message with the rank and
  // exits 1, instead of abort() with a core dump.
  bool report_uncaught = true;
  // The GPUs cuda_comm() chooses from (the config's gpu_ids): "all" or a list like 0,1.
  std::string gpu_ids = "all";
};

class Runtime {
 public:
  // Joins the group with options from the config (comm_timeout, main_process_ip/port).
  explicit Runtime(const Config& config);
  Runtime(const DistEnv& env, const RuntimeOptions& options);
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  const DistEnv& env() const;
  int rank() const { return env().rank; }
  int world_size() const { return env().world_size; }
  int local_rank() const { return env().local_rank; }
  int local_world_size() const { return env().local_world_size; }
  bool is_main_process() const { return rank() == 0; }
  bool is_local_main_process() const { return local_rank() == 0; }

  // Collectives on CPU tensors (Gloo).
  Communicator& comm();
  // Collectives on CUDA tensors (NCCL) on GPU `device`; -1: the GPU choose_cuda_device gives this
  // local rank from the options' gpu_ids (engine/runtime/device_choice.h). Created on the first call; a later call naming
  // another GPU is an error. Throws zeal::Error without NCCL or a GPU.
  Communicator& cuda_comm(int device = -1);
  // A communicator over some of the ranks, this one among them (`ranks`: global ranks, in the
  // group's rank order), made on first use and kept under `name`. Every rank of the group must
  // ask for it with the same name and ranks, in the same order relative to its other groups.
  // cuda_device >= 0: NCCL on that GPU (the device cuda_comm uses); -1: Gloo (CPU tensors, CUDA
  // tensors staged through pinned host memory).
  Communicator& group_comm(const std::string& name, const std::vector<int>& ranks, int cuda_device = -1);

  // Small shared values through the store (for rendezvous-like exchanges; not for tensors).
  void store_set(const std::string& key, const std::string& value);
  std::string store_get(const std::string& key);  // waits up to comm_timeout for the key
  int64_t store_add(const std::string& key, int64_t delta);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace zeal
