// The collective self-check of `zeal test` (and of the ctest suite): every collective, every
// dtype (float32, float16, bfloat16, int64), sizes that do and do not divide by the world size,
// and overlapping asynchronous calls, each compared with values every rank computes itself.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace zeal {

class Communicator;

struct CheckResult {
  std::string name;    // "all_reduce(avg) bfloat16 n=9"
  bool passed = false; // true only when it passed on every rank
  std::string detail;  // why it failed here (empty when it failed only elsewhere)
};

// Every rank must call it with the same arguments. `cuda`: run on CUDA tensors of the current
// device (for the NCCL communicator). Empty `sizes`: 1, 2·world+1, 1000 and 100003 elements.
std::vector<CheckResult> run_collective_checks(Communicator& comm, bool cuda = false, std::vector<int64_t> sizes = {});

}  // namespace zeal
