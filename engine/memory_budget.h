// The memory a rank may use: the memory cgroup's limit (v2 memory.max, v1 memory.limit_in_bytes)
// or, without one, what the machine has available, shared by the ranks on the machine. No
// LibTorch headers.
#pragma once

#include <cstdint>
#include <string>

namespace zeal {

struct MemoryBudget {
  int64_t bytes = -1;   // per rank; -1 when nothing could be read
  std::string source;   // how it was found, for messages ("the memory cgroup's limit of 4.00 GiB, …")
};

// For a rank holding `own_resident` bytes now, one of `local_ranks` on its machine that hold about
// as much each: its share of the cgroup's limit, or of MemAvailable plus what the ranks hold.
MemoryBudget rank_memory_budget(int local_ranks, int64_t own_resident);

// The memory cgroup's limit and its usage without inactive page cache, in bytes (-1 when there is
// no limit or it cannot be read).
int64_t cgroup_memory_limit();
int64_t cgroup_memory_usage();

// The memory cgroup's count of processes its out-of-memory killer ended (v2 memory.events, v1
// memory.oom_control), -1 when unknown.
int64_t cgroup_oom_kills();

}  // namespace zeal
