// Model export from a zeal checkpoint (engine.save_state's directory) to Hugging Face-style
// safetensors: one tensor per parameter under its model name, in fp32, bf16 or fp16, cut into
// files of at most max_shard_size bytes (model-00001-of-0000N.safetensors plus
// model.safetensors.index.json, as transformers writes them; one model.safetensors when it fits).
// Streams parameter by parameter: host memory holds the largest parameter and an I/O buffer,
// never the model. Needs no training ranks. No LibTorch headers.
#pragma once

#include <cstdint>
#include <functional>
#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace zeal::ckpt {

struct ConsolidateOptions {
  std::string dtype = "fp32";              // fp32, bf16 or fp16 (round to nearest even)
  int64_t max_shard_size = 5'000'000'000;  // bytes per file (transformers' default "5GB")
  bool include_frozen = true;              // frozen parameters (saved as `param/...`) too
  // The names the model's owner sees (the manifest's export_names: zeal::Sharded's "block" level
  // left out, LoRA adapter tensors left for the adapter file), as transformers loads them; false:
  // the model's own names, adapters included.
  bool model_names = true;
  // Applied after model_names: a name written → {the name to write instead, written transposed (2-D)}
  // (engine.save_model's SaveModelOptions::names).
  std::map<std::string, std::pair<std::string, bool>> rename;
  // Each LoRA-adapted weight written merged, W + scaling·B·A (the manifest's "lora": the layers whose
  // adapters were active at the save), the sum in float64 rounded once; needs model_names.
  bool merged = false;
};

struct ConsolidateResult {
  std::vector<std::string> files;  // written, in order
  int64_t tensors = 0, bytes = 0;  // tensors and bytes of tensor data written
};

// Reads the checkpoint in `ckpt_dir` (or the one its `latest` names) and writes the model into
// `out_dir` (created). `progress` hears of each tensor written (name, bytes). Errors (zeal::Error)
// name the file or parameter; every byte read is checked against the manifest's CRC32C.
ConsolidateResult consolidate(const std::string& ckpt_dir, const std::string& out_dir, const ConsolidateOptions& o,
                              const std::function<void(const std::string&, int64_t)>& progress = {});

// Moves an export's files (`names`, written complete into `staging` inside `out_dir`) into
// `out_dir`, replacing the previous export there as a set: model.safetensors,
// model.safetensors.index.json and model-0000k-of-0000n.safetensors files not in `names` go (the old
// index first), other files stay.
void publish_export(const std::filesystem::path& out_dir, const std::filesystem::path& staging,
                    const std::vector<std::string>& names);
// The staging folder of this process's export into `out_dir` (.zeal-export.partial.<pid>); those
// of exports whose process is gone are removed first.
std::filesystem::path export_staging(const std::filesystem::path& out_dir);

// "5GB", "500MB", "2GiB", "123" (bytes) → bytes; zeal::Error on anything else.
int64_t parse_size(const std::string& s);

}  // namespace zeal::ckpt
