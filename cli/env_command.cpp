// `zeal env`: versions and hardware, for bug reports.
#include <cstdio>

#include "cli/commands.h"
#include "engine/runtime/environment.h"

namespace zeal::cli {

Runner add_env_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("env", "Print zeal, LibTorch, CUDA, NCCL, liburing and hwloc versions, "
                                        "io_uring support, CPU features, cores, NUMA nodes and GPUs");
  return [cmd] {
    (void)cmd;
    size_t width = 0;
    auto items = describe_environment();
    for (const auto& i : items) width = std::max(width, i.name.size());
    for (const auto& i : items) std::printf("%-*s  %s\n", static_cast<int>(width + 1), (i.name + ":").c_str(), i.value.c_str());
    return 0;
  };
}

}  // namespace zeal::cli
