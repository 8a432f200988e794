#include "engine/checkpoint/state_stream.h"

#include <unordered_set>

#include <fmt/format.h>

#include "engine/checkpoint/fault_hooks.h"
#include "engine/engine.h"

namespace zeal::ckpt {

using nlohmann::json;

std::vector<std::pair<std::string, at::Tensor>> frozen_params(torch::nn::Module& m) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  std::unordered_set<const void*> seen;
  for (const auto& item : m.named_parameters(true)) {
    if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;
    if (!item.value().requires_grad()) out.push_back({item.key(), item.value()});
  }
  return out;
}

std::vector<std::string> all_strings(Engine& e, const std::string& text) {
  at::Tensor bytes = at::from_blob(const_cast<char*>(text.data()), {static_cast<int64_t>(text.size())}, at::kByte).clone();
  const at::Tensor lens = e.gather(at::tensor({static_cast<int64_t>(text.size())}, at::kLong)).cpu();
  const at::Tensor all = e.gather(bytes).cpu();
  std::vector<std::string> out;
  for (int64_t r = 0, at = 0; r < lens.numel(); ++r) {
    const int64_t n = lens[r].item<int64_t>();
    out.emplace_back(reinterpret_cast<const char*>(all.data_ptr<uint8_t>()) + at, n);
    at += n;
  }
  return out;
}

std::string agreed_failures(Engine& e, const std::string& error) {
  std::string failed;
  const auto errors = all_strings(e, error);
  for (size_t r = 0; r < errors.size(); ++r)
    if (!errors[r].empty()) failed += fmt::format("\n  rank {}: {}", r, errors[r]);
  return failed;
}

void emit_file(const FilePlan& plan, Sink& sink, int rank, zero::Sharding& z) {
  std::vector<float> chunk(1 << 20);
  GroupWalk walk(z, /*changed=*/false);
  for (size_t i = 0; i < plan.items.size(); ++i) {
    if (i == plan.items.size() / 2) maybe_die("write", rank);
    const auto& r = *plan.items[i].range;
    walk.at(r);
    if (!r.step) {
      const at::Tensor v = r.values.cpu().contiguous();
      sink.append(v.data_ptr(), static_cast<int64_t>(v.nbytes()));
      continue;
    }
    if (const float* p = r.step->host_state(plan.items[i].kind, r.index, r.count)) {
      sink.append(p, r.count * 4);  // in host memory already: copied once, from there
      continue;
    }
    for (int64_t at = 0; at < r.count; at += static_cast<int64_t>(chunk.size())) {
      const int64_t n = std::min<int64_t>(static_cast<int64_t>(chunk.size()), r.count - at);
      r.step->read_state(plan.items[i].kind, r.index + at, n, chunk.data());
      sink.append(chunk.data(), n * 4);
    }
  }
  walk.close();
  for (const auto& [key, t] : plan.rng) {
    const at::Tensor b = t.contiguous();
    sink.append(b.data_ptr(), b.numel());
  }
}

json file_pieces(const FilePlan& plan, const SafetensorsWriter& w) {
  json pieces = json::array();
  for (size_t i = 0; i < plan.items.size(); ++i) {
    const auto& r = *plan.items[i].range;
    pieces.push_back({{"kind", plan.items[i].kind}, {"name", r.name}, {"shape", r.shape}, {"begin", r.begin},
                      {"count", r.count}, {"dtype", w.entries()[i].dtype}, {"offset", w.entries()[i].offset},
                      {"trainable", r.step != nullptr}});
  }
  return pieces;
}

void put_elements(const zero::StateRange& r, const std::string& kind, int64_t first, const at::Tensor& src) {
  const int64_t n = src.numel();
  if (kind == "param" || kind == "buffer") {  // frozen parameters and buffers: their own dtype
    r.values.narrow(0, first, n).copy_(src);
    return;
  }
  const at::Tensor f32 = src.to(at::kFloat).contiguous();
  r.step->write_state(kind, r.index + first, n, f32.data_ptr<float>());
  if (kind != "master") return;
  // The compute copy, unless it is the master itself (fp32 parameters aliased as their own master:
  // write_state has just put the values there).
  at::Tensor v = r.values.narrow(0, first, n);
  if (v.scalar_type() == at::kFloat && v.is_contiguous() &&
      v.data_ptr() == r.step->host_state("master", r.index + first, n)) {
    return;
  }
  v.copy_(f32);
}

}  // namespace zeal::ckpt
