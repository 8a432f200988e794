#include "engine/memory.h"

#include <fmt/format.h>

namespace zeal {

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) {
    bytes /= 1024;
    ++u;
  }
  return u == 0 ? fmt::format("{:.0f} B", bytes) : fmt::format("{:.2f} {}", bytes, units[u]);
}

std::string MemoryReport::summary() const {
  std::string s = fmt::format("params {}, grads {}, master {}, optimizer {} (model states {}); frozen {}, buffers {}, "
                              "workspace {}",
                              format_bytes(params), format_bytes(grads), format_bytes(master),
                              format_bytes(optimizer_states), format_bytes(model_states()), format_bytes(frozen_params),
                              format_bytes(buffers), format_bytes(workspace));
  if (offload_host > 0) s += fmt::format("; offloaded to host memory {}", format_bytes(offload_host));
  if (offload_disk > 0) s += fmt::format(", to disk {}", format_bytes(offload_disk));
  if (host_cache > 0) s += fmt::format("; host allocator cache {}", format_bytes(host_cache));
  return s;
}

double expected_model_state_bytes(const StageModel& m) {
  const double psi = static_cast<double>(m.psi), n = m.world;
  const double p = m.param_bytes, g = m.grad_bytes, k = m.master_bytes + m.optimizer_bytes;
  switch (m.stage) {
    case 0: return (p + g + k) * psi;
    case 1: return (p + g) * psi + k * psi / n;
    case 2: return p * psi + (g + k) * psi / n;
    default: return (p + g + k) * psi / n;
  }
}

}  // namespace zeal
