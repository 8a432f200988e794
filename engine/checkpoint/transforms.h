// zeal::load_pretrained's tensor transforms: the transformed tensors computed from the file's, one at
// a time, each written to a temporary safetensors file of its own beside an index that points every
// other name at its own file, so
// the ordinary loading paths (whole, engine.init's slices, a prepared model's shards) read them.
#pragma once

#include <memory>
#include <set>
#include <string>
#include <vector>

#include "engine/engine.h"

namespace zeal::ckpt {

struct Transformed {
  std::string model_name;   // for messages
  std::string staged_name;  // its name in the staged file
  PretrainedOptions::TensorSource source;
};

// A directory to load from instead of the original path; removed when this goes.
class StagedWeights {
 public:
  StagedWeights(const std::string& path, const std::vector<Transformed>& transformed);
  ~StagedWeights();
  StagedWeights(const StagedWeights&) = delete;
  StagedWeights& operator=(const StagedWeights&) = delete;
  const std::string& dir() const { return dir_; }
  // The file's tensors the transforms read.
  const std::set<std::string>& read() const { return read_; }

 private:
  std::string dir_;
  std::set<std::string> read_;
};

}  // namespace zeal::ckpt
