#include "engine/checkpoint/consolidate.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <cstdlib>
#include <map>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "engine/checkpoint/manifest.h"
#include "engine/checkpoint/safetensors.h"
#include "engine/error.h"
#include "engine/output.h"

namespace zeal::ckpt {

namespace fs = std::filesystem;
using nlohmann::json;


namespace {

// The files of a Hugging Face-style export: model.safetensors, model.safetensors.index.json and
// model-0000k-of-0000n.safetensors.
bool is_export_file(const std::string& n) {
  if (n == "model.safetensors" || n == "model.safetensors.index.json") return true;
  // model-00001-of-00002.safetensors
  if (n.size() != 32 || n.rfind("model-", 0) != 0 || n.substr(11, 4) != "-of-" || n.substr(20) != ".safetensors") {
    return false;
  }
  return std::all_of(n.begin() + 6, n.begin() + 11, ::isdigit) && std::all_of(n.begin() + 15, n.begin() + 20, ::isdigit);
}

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t to_bf16(float f) {
  const uint32_t u = bits_of(f);
  if (std::isnan(f)) return static_cast<uint16_t>((u >> 16) | 0x40);  // stays a NaN
  return static_cast<uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);  // round to nearest even
}

uint16_t to_f16(float f) {
  const uint32_t u = bits_of(f);
  const uint32_t sign = (u >> 16) & 0x8000;
  const uint32_t abs = u & 0x7fffffff;
  if (abs >= 0x7f800000) return static_cast<uint16_t>(sign | 0x7c00 | (abs > 0x7f800000 ? 0x200 : 0));  // inf, nan
  if (abs >= 0x477ff000) return static_cast<uint16_t>(sign | 0x7c00);  // rounds to beyond 65504: inf
  if (abs < 0x38800000) {  // below 2^-14: a subnormal half (or zero), rounded to nearest even
    const float a = float_of(abs);
    const float scaled = a * 16777216.0f;  // / 2^-24, exact
    float r = std::nearbyint(scaled);      // the default rounding mode: to nearest even
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(r));
  }
  // Normal: rebias the exponent (127 → 15) and round the 23-bit mantissa to 10 bits, nearest even.
  const uint32_t mant = abs & 0x7fffff, exp = (abs >> 23) - 127 + 15;
  uint32_t h = (exp << 10) | (mant >> 13);
  const uint32_t rest = mant & 0x1fff;
  if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) ++h;  // a carry into the exponent is right
  return static_cast<uint16_t>(sign | h);
}

float from_bf16(uint16_t h) { return float_of(static_cast<uint32_t>(h) << 16); }

float from_f16(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  if (exp == 0) return (sign ? -1.0f : 1.0f) * std::ldexp(static_cast<float>(mant), -24);
  if (exp == 31) return float_of(sign | 0x7f800000 | (mant << 13));
  return float_of(sign | ((exp - 15 + 127) << 23) | (mant << 13));
}

bool is_float(const std::string& d) { return d == "F32" || d == "BF16" || d == "F16"; }

struct Param {
  std::string name, dtype;  // dtype of its pieces
  std::string own;          // the model's name
  std::vector<int64_t> shape;  // as saved (before a transpose)
  bool transpose = false;      // written transposed (2-D)
  int64_t numel = 1;
  std::vector<SavedPiece> pieces;
};

// The n elements at `bytes` (F32, BF16 or F16) as floats.
std::vector<float> floats_of(const char* bytes, const std::string& dtype, int64_t n) {
  std::vector<float> out(static_cast<size_t>(n));
  for (int64_t e = 0; e < n; ++e) {
    if (dtype == "F32") {
      std::memcpy(&out[e], bytes + 4 * e, 4);
    } else {
      uint16_t h;
      std::memcpy(&h, bytes + 2 * e, 2);
      out[e] = dtype == "BF16" ? from_bf16(h) : from_f16(h);
    }
  }
  return out;
}

// w[rows × cols] + scaling · b[rows × r] · a[r × cols], each element summed in float64 and rounded
// once.
void add_lora(std::vector<float>& w, const std::vector<float>& b, const std::vector<float>& a, int64_t rows, int64_t r,
              int64_t cols, double scaling) {
  std::vector<double> acc(static_cast<size_t>(cols));
  for (int64_t i = 0; i < rows; ++i) {
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int64_t k = 0; k < r; ++k) {
      const double bk = b[i * r + k];
      const float* ak = a.data() + k * cols;
      for (int64_t j = 0; j < cols; ++j) acc[j] += bk * ak[j];
    }
    float* wi = w.data() + i * cols;
    for (int64_t j = 0; j < cols; ++j) wi[j] = static_cast<float>(static_cast<double>(wi[j]) + scaling * acc[j]);
  }
}

}  // namespace

int64_t parse_size(const std::string& text) {
  const std::string example = fmt::format("'{}' is not a size (e.g. 5GB, 500MB, 2GiB)", text);
  size_t i = 0, dots = 0;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.')) dots += text[i++] == '.';
  if (i == 0 || dots > 1 || (i == 1 && dots == 1)) throw Error(example);
  const double v = std::strtod(text.substr(0, i).c_str(), nullptr);
  std::string unit = text.substr(i);
  for (auto& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  static const std::map<std::string, double> units{{"", 1},      {"B", 1},          {"KB", 1e3},       {"MB", 1e6},
                                                   {"GB", 1e9},  {"TB", 1e12},      {"KIB", 1024.0},   {"MIB", 1048576.0},
                                                   {"GIB", 1073741824.0}, {"TIB", 1099511627776.0}};
  auto it = units.find(unit);
  if (it == units.end() || !(v > 0)) throw Error(example);
  const double bytes = v * it->second;
  if (bytes < 1 || bytes > 1e15) throw Error(fmt::format("'{}' is outside 1 byte to 1 PB", text));
  return static_cast<int64_t>(bytes);
}

// Moves the new export's files from `staging` into `out_dir`, replacing the previous export there
// as a set: the old entry points the new set lacks (index, single file) go first, the new files
// come in with the index last, then the old shards the new set does not have are removed. Other
// files in `out_dir` (config.json, a tokenizer) stay.
fs::path export_staging(const fs::path& out_dir) {
  // Staging folders of exports whose process is gone (killed mid-export) go; a live one's stays.
  std::error_code ec;
  for (auto it = fs::directory_iterator(out_dir, ec); !ec && it != fs::directory_iterator(); it.increment(ec)) {
    const std::string n = it->path().filename().string();
    if (n.rfind(".zeal-export.partial.", 0) != 0) continue;
    const long pid = std::atol(n.c_str() + 21);
    if (pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) fs::remove_all(it->path(), ec);
  }
  return out_dir / fmt::format(".zeal-export.partial.{}", ::getpid());
}

void publish_export(const fs::path& out_dir, const fs::path& staging, const std::vector<std::string>& names) {
  std::vector<fs::path> old;
  for (const auto& e : fs::directory_iterator(out_dir)) {
    const std::string n = e.path().filename().string();
    if (is_export_file(n) && std::find(names.begin(), names.end(), n) == names.end()) old.push_back(e.path());
  }
  std::error_code ec;
  // The old entry points the new set lacks go first (a loader takes model.safetensors before an
  // index, zeal the index first): an interruption then leaves no export, never an old one beside
  // a new one.
  for (const char* entry : {"model.safetensors.index.json", "model.safetensors"}) {
    if (std::find(names.begin(), names.end(), entry) == names.end()) fs::remove(out_dir / entry, ec);
  }
  for (const auto& n : names) {
    if (n == "model.safetensors.index.json") continue;
    fs::rename(staging / n, out_dir / n);
  }
  if (std::find(names.begin(), names.end(), "model.safetensors.index.json") != names.end()) {
    fs::rename(staging / "model.safetensors.index.json", out_dir / "model.safetensors.index.json");
  }
  for (const auto& p : old) fs::remove(p, ec);
  fsync_path(out_dir.string());
}

ConsolidateResult consolidate(const std::string& ckpt_dir, const std::string& out_dir, const ConsolidateOptions& o,
                              const std::function<void(const std::string&, int64_t)>& progress) {
  const std::map<std::string, std::string> out_types{{"fp32", "F32"}, {"bf16", "BF16"}, {"fp16", "F16"}};
  if (!out_types.count(o.dtype)) throw Error(fmt::format("--dtype: '{}' is not fp32, bf16 or fp16", o.dtype));
  const std::string out_dtype = out_types.at(o.dtype);
  if (o.max_shard_size <= 0) throw Error("max_shard_size must be positive");
  const fs::path dir = resolve_checkpoint(ckpt_dir);
  std::ifstream mf(dir / "manifest.json");
  if (!mf) throw Error(fmt::format("{} holds no checkpoint (no manifest.json, no latest)", fs::path(ckpt_dir).string()));
  json m;
  try {
    m = json::parse(mf);
  } catch (const std::exception& e) {
    throw Error(fmt::format("{} is not valid JSON ({})", (dir / "manifest.json").string(), e.what()));
  }
  if (m.value("format", "") != "zeal-checkpoint") throw Error(fmt::format("{} is not a zeal checkpoint", dir.string()));
  std::map<std::string, SavedFile> files;
  for (auto it = m["files"].begin(); it != m["files"].end(); ++it) {
    SavedFile f;
    f.bytes = it.value()["bytes"].get<int64_t>();
    f.crc32c = it.value()["crc32c"].get<uint32_t>();
    f.crc_block = it.value()["crc_block"].get<int64_t>();
    f.block_crcs = it.value()["block_crcs"].get<std::vector<uint32_t>>();
    std::error_code ec;
    const auto size = fs::file_size(dir / it.key(), ec);
    if (ec) throw Error(fmt::format("{} is missing", (dir / it.key()).string()));
    if (static_cast<int64_t>(size) != f.bytes) {
      throw Error(fmt::format("{} is truncated or changed: {} bytes, the manifest says {}", (dir / it.key()).string(),
                              size, f.bytes));
    }
    files[it.key()] = std::move(f);
  }
  // The parameters in the order they first appear, their values: the fp32 master of trainable ones,
  // the saved values of frozen ones.
  std::vector<Param> params;
  std::map<std::string, size_t> index;
  // The model's buffers are written too (BatchNorm's statistics; saved by rank 0, whole).
  const json renames = o.model_names && m.contains("export_names") ? m["export_names"] : json::object();
  // With `merged`: each adapted weight's layer (by the weight's model name), and the adapters'
  // tensors, read beside it.
  const json lora = o.merged && m.contains("lora") ? m["lora"] : json::object();
  if (o.merged && !o.model_names) {
    throw Error("merged: LoRA-adapted weights are written merged only under the names the model's owner sees (not with "
                "--keep_names, which writes the adapter tensors too)");
  }
  if (o.merged && lora.empty()) {
    throw Error(fmt::format("merged: {} holds no active LoRA adapters to merge (none were saved with it, or it was saved "
                            "before checkpoints recorded their scaling)",
                            dir.string()));
  }
  std::set<std::string> adapter_names;
  for (const auto& [w, layer] : lora.items()) {
    adapter_names.insert(layer["A"].get<std::string>());
    adapter_names.insert(layer["B"].get<std::string>());
  }
  std::map<std::string, Param> adapters;  // by model name
  std::set<std::string> used;  // o.rename's names met
  std::map<std::string, std::string> source;  // each name written: the model's name it comes from
  for (const auto& p : m["pieces"]) {
    const std::string kind = p["kind"].get<std::string>();
    const std::string own = p["name"].get<std::string>();
    // A merged export writes each adapted weight (frozen under LoRA) merged, --no_frozen or not: it
    // is the fine-tuned layer, not a frozen one.
    const bool adapted = kind == "param" && lora.contains(own);
    if (kind != "master" && kind != "buffer" && !(kind == "param" && o.include_frozen) && !adapted) continue;
    if (adapter_names.count(own)) {  // kept apart, for the merge
      Param& q = adapters[own];
      if (q.pieces.empty()) {
        q.name = q.own = own;
        q.dtype = p["dtype"].get<std::string>();
        q.shape = p["shape"].get<std::vector<int64_t>>();
        for (int64_t d : q.shape) q.numel *= d;
      }
      q.pieces.push_back({p["file"].get<std::string>(), p["dtype"].get<std::string>(), p["begin"].get<int64_t>(),
                          p["count"].get<int64_t>(), p["offset"].get<int64_t>()});
    }
    std::string name = own;
    if (const auto r = renames.find(own); r != renames.end()) {
      if (r->is_null()) continue;  // an adapter tensor
      name = r->get<std::string>();
    }
    bool transpose = false;
    if (const auto r = o.rename.find(name); r != o.rename.end()) {
      used.insert(name);
      transpose = r->second.second;
      name = r->second.first;
    }
    if (const auto [it, fresh] = source.try_emplace(name, own); !fresh && it->second != own) {
      throw Error(fmt::format("'{}' and '{}' would both be written as '{}'; consolidate with --keep_names", it->second,
                              own, name));
    }
    auto [it, fresh] = index.try_emplace(name, params.size());
    if (fresh) {
      Param q;
      q.name = name;
      q.own = own;
      q.dtype = p["dtype"].get<std::string>();
      q.shape = p["shape"].get<std::vector<int64_t>>();
      q.transpose = transpose;
      if (transpose && q.shape.size() != 2) {
        throw Error(fmt::format("'{}' ({}) is to be written transposed but has {} dimensions, not 2", name, own,
                                q.shape.size()));
      }
      for (int64_t d : q.shape) q.numel *= d;
      params.push_back(std::move(q));
    }
    params[it->second].pieces.push_back({p["file"].get<std::string>(), p["dtype"].get<std::string>(),
                                         p["begin"].get<int64_t>(), p["count"].get<int64_t>(),
                                         p["offset"].get<int64_t>()});
  }
  for (const auto& [w, layer] : lora.items()) {
    bool found = false;
    for (const Param& q : params) found = found || q.own == w;
    if (!found) {
      throw Error(fmt::format("merged: {} does not hold the weight '{}' its LoRA adapters change (saved without frozen "
                              "weights: save_state's include_frozen); nothing was written",
                              dir.string(), w));
    }
  }
  for (const auto& [from, to] : o.rename) {
    if (!used.count(from)) {
      throw Error(fmt::format("the export's names list '{}' (to be written as '{}'), which the checkpoint does not hold",
                              from, to.first));
    }
  }
  // Files of at most max_shard_size bytes (a larger tensor alone).
  auto out_type = [&](const Param& p) { return is_float(p.dtype) ? out_dtype : p.dtype; };
  std::vector<std::vector<size_t>> shards;
  int64_t in_shard = 0, total = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t b = params[i].numel * dtype_size(out_type(params[i]));
    if (shards.empty() || (in_shard > 0 && in_shard + b > o.max_shard_size)) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(i);
    in_shard += b;
    total += b;
  }
  // Written under a hidden folder inside out_dir, then moved into place as a set (publish_export).
  fs::create_directories(out_dir);
  const fs::path staging = export_staging(out_dir);
  fs::create_directories(staging);
  struct Cleanup {
    fs::path dir;
    ~Cleanup() {
      std::error_code ec;
      fs::remove_all(dir, ec);
    }
  } cleanup{staging};
  std::vector<std::string> names;
  ConsolidateResult result;
  json weight_map = json::object();
  std::vector<char> src;
  std::vector<char> dst;
  CheckedReader reader(8 << 20);  // small buffers: the memory is the largest parameter's
  // All of p's elements, checked, into `out` (p's dtype).
  auto read_param = [&](const Param& p, std::vector<char>& out) {
    const int64_t es = dtype_size(p.dtype);
    out.resize(static_cast<size_t>(p.numel * es));
    int64_t covered = 0;
    for (const SavedPiece& s : p.pieces) {
      if (s.dtype != p.dtype) throw Error(fmt::format("the pieces of '{}' differ in dtype", p.name));
      if (s.begin < 0 || s.count < 0 || s.begin + s.count > p.numel) {
        throw Error(fmt::format("a piece of '{}' lies outside its {} elements", p.name, p.numel));
      }
      reader.read(dir / s.file, files.at(s.file), s.offset, s.count * es, out.data() + s.begin * es);
      covered += s.count;
    }
    if (covered != p.numel) {
      throw Error(fmt::format("the checkpoint covers {} of the {} elements of '{}'", covered, p.numel, p.name));
    }
  };
  // The adapted weight p (its bytes in `bytes`, p's dtype) merged with its layer's adapters: fp32
  // bytes in their place.
  auto merge = [&](const Param& p, const json& layer, std::vector<char>& bytes) {
    const std::string an = layer["A"].get<std::string>(), bn = layer["B"].get<std::string>();
    if (!adapters.count(an) || !adapters.count(bn)) {
      throw Error(fmt::format("merged: the checkpoint lacks the LoRA adapters of '{}' ({}, {})", p.own, an, bn));
    }
    const Param &a = adapters.at(an), &b = adapters.at(bn);
    if (p.shape.size() != 2 || a.shape.size() != 2 || b.shape.size() != 2 || b.shape[0] != p.shape[0] ||
        a.shape[1] != p.shape[1] || a.shape[0] != b.shape[1] || !is_float(p.dtype)) {
      throw Error(fmt::format("merged: '{}' {} does not take its adapters' B {} · A {}", p.own, fmt::join(p.shape, "×"),
                              fmt::join(b.shape, "×"), fmt::join(a.shape, "×")));
    }
    std::vector<char> ab, bb;
    read_param(a, ab);
    read_param(b, bb);
    std::vector<float> w = floats_of(bytes.data(), p.dtype, p.numel);
    add_lora(w, floats_of(bb.data(), b.dtype, b.numel), floats_of(ab.data(), a.dtype, a.numel), p.shape[0], a.shape[0],
             p.shape[1], layer["scaling"].get<double>());
    bytes.resize(static_cast<size_t>(p.numel * 4));  // fp32 now: rounded once more, to the output dtype
    std::memcpy(bytes.data(), w.data(), bytes.size());
  };
  for (size_t k = 0; k < shards.size(); ++k) {
    const std::string name = shards.size() == 1 ? "model.safetensors"
                                                : fmt::format("model-{:05d}-of-{:05d}.safetensors", k + 1, shards.size());
    std::vector<TensorEntry> entries;
    for (size_t i : shards[k]) {
      const Param& p = params[i];
      const std::vector<int64_t> shape = p.transpose ? std::vector<int64_t>{p.shape[1], p.shape[0]} : p.shape;
      entries.push_back({p.name, out_type(p), shape, p.numel * dtype_size(out_type(p))});
      weight_map[p.name] = name;
    }
    SafetensorsWriter w((staging / name).string(), entries, {{"format", "pt"}}, {}, 1 << 20, 4 << 20);
    for (size_t i : shards[k]) {
      const Param& p = params[i];
      read_param(p, src);
      // The bytes' dtype: p's, or fp32 once merged (rounded once, to the output dtype below).
      std::string have = p.dtype;
      if (const auto layer = lora.find(p.own); layer != lora.end()) {
        merge(p, *layer, src);
        have = "F32";
      }
      const int64_t es = dtype_size(have);
      const std::string to = out_type(p);
      if (to == have && !p.transpose) {
        w.append(src.data(), static_cast<int64_t>(src.size()));
      } else {
        // A MiB of elements at a time: transposed ([rows, cols] → [cols, rows]) and converted into
        // `dst`, then written; the parameter is never held twice.
        const int64_t os = dtype_size(to), rows = p.transpose ? p.shape[0] : 0, cols = p.transpose ? p.shape[1] : 0;
        const bool same = to == have, from32 = have == "F32", from_b = have == "BF16", to32 = to == "F32",
                   to_b = to == "BF16";
        constexpr int64_t kChunk = int64_t{1} << 20;
        dst.resize(static_cast<size_t>(std::min(p.numel, kChunk) * os));
        for (int64_t e0 = 0; e0 < p.numel; e0 += kChunk) {
          const int64_t n = std::min(kChunk, p.numel - e0);
          for (int64_t j = 0; j < n; ++j) {
            const int64_t e = e0 + j;
            const char* from = src.data() + (p.transpose ? (e % rows) * cols + e / rows : e) * es;
            char* out = dst.data() + j * os;
            if (same) {
              std::memcpy(out, from, static_cast<size_t>(es));
              continue;
            }
            float f;
            if (from32) {
              std::memcpy(&f, from, 4);
            } else {
              uint16_t h;
              std::memcpy(&h, from, 2);
              f = from_b ? from_bf16(h) : from_f16(h);
            }
            if (to32) {
              std::memcpy(out, &f, 4);
            } else {
              const uint16_t h = to_b ? to_bf16(f) : to_f16(f);
              std::memcpy(out, &h, 2);
            }
          }
          w.append(dst.data(), n * os);
        }
      }
      ++result.tensors;
      if (progress) progress(p.name, p.numel * dtype_size(to));
    }
    w.finish();
    names.push_back(name);
  }
  if (shards.size() > 1) {
    json idx = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    write_file_whole((staging / "model.safetensors.index.json").string(), idx.dump(2) + "\n", "export");
    names.push_back("model.safetensors.index.json");
  }
  publish_export(out_dir, staging, names);
  for (const auto& n : names) result.files.push_back((fs::path(out_dir) / n).string());
  result.bytes = total;
  return result;
}

}  // namespace zeal::ckpt
