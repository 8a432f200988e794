// Memory per phase of a run, measured, in the lines PEFT's examples print (TorchTracemalloc):
//
//   GPU Memory before entering the train : 1916
//   GPU Memory consumed at the end of the train (end-begin): 66
//   GPU Peak Memory consumed during the train (max-begin): 7488
//   GPU Total Peak Memory consumed during the train (max): 9404
//   CPU Memory before entering the train : 19411
//   ...
//
// in MB (2^20 bytes, truncated). The CPU lines measure the process's resident set (VmRSS; the peak
// is the kernel's high-water mark VmHWM, reset when a phase begins); the GPU lines, printed when
// the engine computes on an accelerator, its caching allocator's allocated bytes (current and
// peak) — what torch.cuda.memory_allocated() and max_memory_allocated() report.
//
//   {
//     zeal::MemoryTracker train(engine, "train");
//     ... the training loop ...
//   }                                    // or train.end(): prints the lines on the main process
//
// Phases may nest (an "eval" inside "train"): each keeps its own peak.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/resident.h"
#include "engine/memory.h"

namespace zeal {

class Engine;

// Bytes at a phase's beginning and end, and the most in between.
struct MemoryUse {
  bool measured = false;
  int64_t begin = 0, end = 0, peak = 0;
};

// What one phase used, measured, with the engine's own accounting at its end.
struct PhaseMemory {
  std::string phase;
  std::string device_label;  // "GPU" on CUDA, the device type's name on another accelerator
  MemoryUse device;           // measured only on an accelerator
  MemoryUse cpu;              // the resident set
  // The resident set when the engine was created (the runtime: libraries, communicator); 0 if
  // no engine had started in this process.
  int64_t runtime_baseline = 0;
  MemoryReport engine;  // the engine's accounting at the end of the phase
  int rank = 0;

  // The seed's eight lines (four without an accelerator), in MB.
  std::vector<std::string> lines() const;
  // Where the CPU peak went: the runtime's baseline, the model states by kind, frozen weights,
  // buffers, gathered units, offload buffers, and "activations and the rest": the measured peak
  // minus everything named (the engine's parts at their peak where it keeps one). Bytes on disk
  // are listed, not counted.
  struct Part {
    std::string name;
    int64_t bytes = 0;
  };
  std::vector<Part> breakdown() const;
  // One JSON object: phase, rank, device and cpu {before, consumed, peak, total_peak} in bytes and
  // MB, and the breakdown.
  std::string json() const;
};

class MemoryTracker {
 public:
  // Begins `phase` (collective-free; every rank measures itself).
  MemoryTracker(Engine& engine, std::string phase);
  ~MemoryTracker();
  MemoryTracker(const MemoryTracker&) = delete;
  MemoryTracker& operator=(const MemoryTracker&) = delete;

  // Ends the phase (once; later calls return the same record) and prints its lines and breakdown
  // on the main process unless `print` is false.
  const PhaseMemory& end(bool print = true);
  // The phase so far, without ending it.
  PhaseMemory now() const;

 private:
  Engine& engine_;
  mutable PhaseMemory record_;  // now() raises its CPU peak
  bool ended_ = false;
};

namespace detail {
// The engine notes the resident set when it starts: the runtime's baseline in every report.
void note_runtime_baseline();
int64_t runtime_baseline();
// A reset of the resident set's high-water mark (resident_peak_bytes, engine/resident.h) to the
// resident set now (open phases keep the peak they had reached).
void reset_resident_peak();
}  // namespace detail

}  // namespace zeal
