#include "engine/checkpoint/transforms.h"

#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <map>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "engine/checkpoint/safetensors.h"
#include "engine/checkpoint/tensor_dtype.h"
#include "engine/error.h"
#include "engine/output.h"

namespace zeal {

PretrainedOptions::TensorSource transposed(std::string file_name) {
  return [name = std::move(file_name)](const std::function<at::Tensor(const std::string&)>& read) {
    const at::Tensor t = read(name);
    if (t.dim() != 2) throw Error(fmt::format("transposed('{}'): the tensor has {} dimensions, not 2", name, t.dim()));
    return t.t().contiguous();
  };
}

PretrainedOptions::TensorSource split_part(std::string file_name, int64_t dim, int64_t part, int64_t parts) {
  return [name = std::move(file_name), dim, part, parts](const std::function<at::Tensor(const std::string&)>& read) {
    const at::Tensor t = read(name);
    if (dim < 0 || dim >= t.dim() || parts < 1 || part < 0 || part >= parts || t.size(dim) % parts != 0) {
      throw Error(fmt::format("split_part('{}', dim {}, part {} of {}): the tensor's shape [{}] does not split so", name, dim,
                              part, parts, fmt::join(t.sizes(), ", ")));
    }
    const int64_t n = t.size(dim) / parts;
    return t.narrow(dim, part * n, n).contiguous();
  };
}

PretrainedOptions::TensorSource concatenated(std::vector<std::string> file_names, int64_t dim) {
  return [names = std::move(file_names), dim](const std::function<at::Tensor(const std::string&)>& read) {
    std::vector<at::Tensor> parts;
    for (const auto& n : names) parts.push_back(read(n));
    return at::cat(parts, dim).contiguous();
  };
}

namespace ckpt {
namespace fs = std::filesystem;

StagedWeights::StagedWeights(const std::string& path, const std::vector<Transformed>& transformed) {
  static std::atomic<int> counter{0};
  dir_ = (fs::temp_directory_path() / fmt::format("zeal-pretrained-{}-{}", ::getpid(), counter++)).string();
  fs::create_directories(dir_);
  try {
    // One transform at a time, its result written to a file of its own and let go: the load holds
    // one transform's inputs and result, never all of them.
    auto read = [&](const std::string& name) {
      read_.insert(name);
      return detail::read_tensor(path, name);
    };
    nlohmann::json index;
    for (const auto& [name, file] : detail::tensor_files(path)) index["weight_map"][name] = file;
    for (size_t i = 0; i < transformed.size(); ++i) {
      const Transformed& t = transformed[i];
      at::Tensor x;
      try {
        x = t.source(read).detach().to(at::kCPU).contiguous();
      } catch (const std::exception& e) {
        throw Error(fmt::format("the transform of '{}': {}", t.model_name, without_backtrace(e.what())));
      }
      const std::string file = fmt::format("transformed-{}.safetensors", i);
      SafetensorsWriter w((fs::path(dir_) / file).string(),
                          {{t.staged_name, safetensors_dtype(x.scalar_type()), x.sizes().vec(),
                            x.numel() * static_cast<int64_t>(x.element_size()), 0}},
                          {{"format", "pt"}}, {}, 1 << 20, 4 << 20);  // 4 MiB of staging: files come one by one
      w.append(x.data_ptr(), x.nbytes());
      w.finish();
      index["weight_map"][t.staged_name] = file;
    }
    write_file_whole((fs::path(dir_) / "model.safetensors.index.json").string(), index.dump(), "the transforms' index");
  } catch (...) {
    std::error_code ec;
    fs::remove_all(dir_, ec);
    throw;
  }
}

StagedWeights::~StagedWeights() {
  std::error_code ec;
  fs::remove_all(dir_, ec);
}

}  // namespace ckpt
}  // namespace zeal
