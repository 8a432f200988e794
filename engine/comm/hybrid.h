// Hybrid sharding (FSDP's HYBRID_SHARD, zero_optimization.hybrid_shard): the ZeRO state is
// sharded across the ranks of one machine and replicated across machines. The communicator the
// sharding code sees is the machine's: its rank and world size are this rank's place in the machine,
// so every shard is 1/(ranks per machine) of a tensor. What it does differently:
// - reduce_scatter reduces over the machine into this rank's shard, then reduces that shard over the
//   ranks holding the same shard on the other machines (the same local rank): with kAvg the result
//   is the mean over every rank of every machine, as with full sharding;
// - all_gather and all_reduce stay inside the machine (replicas hold equal shards: a sum of
//   squares over the machine's shards is the whole norm);
// - broadcast, barrier and agreement points span every rank (a broadcast's root is a global rank).
// A failure in one of the smaller communicators is reported with the global ranks of its group.
#pragma once

#include <memory>
#include <vector>

#include "engine/comm/communicator.h"

namespace zeal {

struct HybridLayout {
  std::vector<int> machine;  // global ranks of this rank's machine, in local-rank order
  std::vector<int> replica;  // global ranks holding this rank's shard, one per machine, in machine order
  int replica_index = 0;     // this rank's machine among `replica` (0: the machine whose ranks save state)
};

// every: all ranks; machine, replica: the communicators over layout.machine and layout.replica.
std::unique_ptr<Communicator> make_hybrid_communicator(Communicator& every, Communicator& machine,
                                                       Communicator& replica, HybridLayout layout);

// The layout of `rank` from every rank's (machine, local rank): machines in ascending order,
// ranks of a machine by local rank. Throws zeal::Error when machines hold different numbers of
// ranks or a machine has a local rank twice.
HybridLayout hybrid_layout(int rank, const std::vector<int>& machine_of, const std::vector<int>& local_rank_of);

}  // namespace zeal
