#include "engine/estimate.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <fstream>
#include <stdexcept>

#include "engine/memory.h"

namespace zeal::estimate {

// --- DeepSpeed -----------------------------------------------------------------------------------
// Python's arithmetic in Python's order: int × int stays exact, int × float converts the int first,
// int() truncates toward zero.

DeepSpeedRow deepspeed_zero3(int64_t total_params, int64_t largest_layer_params, int gpus_per_node, int nodes,
                             bool cpu_offload, bool cpu_offload_params, bool zero_init, double factor) {
  const int64_t total_gpus = static_cast<int64_t>(nodes) * gpus_per_node;
  const double gpus_factor = 1.0 / nodes;
  const int64_t largest_layer_memory = 4 * largest_layer_params;
  const double t = static_cast<double>(total_params);
  double cpu_mem = 0, gpu_mem = 0;
  // max(4 * num_gpus_per_node, k * gpus_factor): the int when it is larger (or equal: max keeps the first).
  auto total_times_max = [&](double k) {
    const int64_t a = 4 * static_cast<int64_t>(gpus_per_node);
    const double b = k * gpus_factor;
    return static_cast<double>(a) >= b ? static_cast<double>(total_params * a) : t * b;
  };
  if (cpu_offload) {
    if (cpu_offload_params) {
      gpu_mem = static_cast<double>(largest_layer_memory);
      cpu_mem = zero_init ? static_cast<double>(total_params * 18) * gpus_factor * factor : total_times_max(18) * factor;
    } else {
      gpu_mem = static_cast<double>(largest_layer_memory +
                                    static_cast<int64_t>(static_cast<double>(2 * total_params) / static_cast<double>(total_gpus)));
      cpu_mem = zero_init ? static_cast<double>(total_params * 16) * gpus_factor * factor : total_times_max(16) * factor;
    }
  } else {
    gpu_mem = static_cast<double>(largest_layer_memory +
                                  static_cast<int64_t>(static_cast<double>(18 * total_params) / static_cast<double>(total_gpus)));
    cpu_mem = zero_init ? static_cast<double>(largest_layer_params * 4 * gpus_per_node) * factor
                        : static_cast<double>(total_params * 4 * gpus_per_node) * factor;
  }
  DeepSpeedRow r;
  r.offload_optimizer = cpu_offload;
  r.offload_param = cpu_offload_params;
  r.zero_init = zero_init;
  r.cpu_bytes = static_cast<int64_t>(cpu_mem);
  r.gpu_bytes = static_cast<int64_t>(gpu_mem);
  r.largest_layer_bytes = largest_layer_memory;
  return r;
}

DeepSpeedRow deepspeed_zero2(int64_t total_params, int gpus_per_node, int nodes, bool cpu_offload, double factor) {
  const int64_t total_gpus = static_cast<int64_t>(nodes) * gpus_per_node;
  double cpu_mem = 0, gpu_mem = 0;
  if (cpu_offload) {
    gpu_mem = static_cast<double>(2 * total_params);
    cpu_mem = static_cast<double>(total_params * std::max<int64_t>(4 * total_gpus, 16)) * factor;
  } else {
    gpu_mem = static_cast<double>(2 * total_params +
                                  static_cast<int64_t>(static_cast<double>(18 * total_params) / static_cast<double>(total_gpus)));
    cpu_mem = static_cast<double>(total_params * 4 * gpus_per_node) * factor;
  }
  DeepSpeedRow r;
  r.offload_optimizer = cpu_offload;
  r.cpu_bytes = static_cast<int64_t>(cpu_mem);
  r.gpu_bytes = static_cast<int64_t>(gpu_mem);
  return r;
}

namespace {

std::string hw_line(int gpus_per_node, int nodes) {
  return fmt::format("HW: Setup with {} {}, {} {} per node.\n", nodes, nodes > 1 ? "nodes" : "node", gpus_per_node,
                     gpus_per_node > 1 ? "GPUs" : "GPU");
}
std::string gb(int64_t bytes, int width) { return fmt::format("{:{}.2f}GB", static_cast<double>(bytes) / (1 << 30), width); }

}  // namespace

std::string deepspeed_zero3_table(int64_t total_params, int64_t largest_layer_params, int gpus_per_node, int nodes) {
  std::string out = "Estimated memory needed for params, optim states and gradients for a:\n" + hw_line(gpus_per_node, nodes) +
                    fmt::format("SW: Model with {}M total params, {}M largest layer params.\n",
                                static_cast<int64_t>(static_cast<double>(total_params) / 1e6),
                                static_cast<int64_t>(static_cast<double>(largest_layer_params) / 1e6)) +
                    "  per CPU  |  per GPU |   Options\n";
  for (bool cpu_offload : {true, false}) {
    for (bool cpu_offload_params : {true, false}) {
      if (!cpu_offload && cpu_offload_params) continue;
      for (bool zero_init : {true, false}) {
        const auto r = deepspeed_zero3(total_params, largest_layer_params, gpus_per_node, nodes, cpu_offload, cpu_offload_params,
                                       zero_init);
        out += fmt::format(" {} | {} | offload_param={}, offload_optimizer={}, zero_init={}\n", gb(r.cpu_bytes, 7),
                           gb(r.gpu_bytes, 6), cpu_offload_params ? "cpu " : "none", cpu_offload ? "cpu " : "none",
                           zero_init ? 1 : 0);
      }
    }
  }
  return out;
}

std::string deepspeed_zero2_table(int64_t total_params, int gpus_per_node, int nodes) {
  std::string out = "Estimated memory needed for params, optim states and gradients for a:\n" + hw_line(gpus_per_node, nodes) +
                    fmt::format("SW: Model with {}M total params.\n", static_cast<int64_t>(static_cast<double>(total_params) / 1e6)) +
                    "  per CPU  |  per GPU |   Options\n";
  for (bool cpu_offload : {true, false}) {
    const auto r = deepspeed_zero2(total_params, gpus_per_node, nodes, cpu_offload);
    out += fmt::format(" {} | {} | offload_optimizer={}\n", gb(r.cpu_bytes, 7), gb(r.gpu_bytes, 6), cpu_offload ? "cpu " : "none");
  }
  return out;
}

// --- models --------------------------------------------------------------------------------------

ModelShape gpt_shape(const std::string& name, int64_t vocab, int64_t context, int64_t layers, int64_t dim, int64_t heads,
                     bool tied) {
  ModelShape m;
  m.name = tied ? name : name + " (untied head)";
  const int64_t block = 12 * dim * dim + 13 * dim;
  const int64_t root = (vocab + context) * dim + 2 * dim + (tied ? 0 : vocab * dim);
  m.params = root + layers * block;
  m.largest_layer = std::max(vocab * dim, 4 * dim * dim + 4 * dim);  // the token embedding, or the MLP's fc
  m.largest_param = std::max(vocab * dim, 4 * dim * dim);
  m.largest_param_grads = tied && vocab * dim >= 4 * dim * dim ? 2 : 1;  // a tied head: two gradients of wte
  m.tied_head = tied ? vocab * dim : 0;
  m.untied_head = tied ? 0 : vocab * dim;
  m.units.push_back(root);
  for (int64_t l = 0; l < layers; ++l) m.units.push_back(block);
  m.transformer = ModelShape::Transformer{layers, dim, heads, vocab, 4 * dim};
  return m;
}

ModelShape hf_config_shape(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("--hf_config: cannot read " + path);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    throw std::runtime_error("--hf_config: " + path + " is not valid JSON: " + e.what());
  }
  // Every size read is an integer in its range, named with the file and the key when it is not, so
  // nothing below overflows (at every limit at once a model has under 1e16 parameters).
  auto checked = [&](const char* k, int64_t lo, int64_t hi) -> int64_t {
    const nlohmann::json& v = j[k];
    if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(hi))) {
      throw std::runtime_error(
          fmt::format("--hf_config: {}: '{}' is {}; it must be an integer from {} to {}", path, k, v.dump(), lo, hi));
    }
    const int64_t x = v.get<int64_t>();
    if (x < lo || x > hi) {
      throw std::runtime_error(fmt::format("--hf_config: {}: '{}' is {}; it must be from {} to {}", path, k, x, lo, hi));
    }
    return x;
  };
  auto get_in = [&](std::initializer_list<const char*> keys, int64_t lo, int64_t hi) -> int64_t {
    for (const char* k : keys)
      if (j.contains(k) && !j[k].is_null()) return checked(k, lo, hi);
    throw std::runtime_error(fmt::format("--hf_config: {} has no integer '{}'", path, *keys.begin()));
  };
  auto opt_in = [&](const char* k, int64_t fallback, int64_t lo, int64_t hi) -> int64_t {
    return j.contains(k) && !j[k].is_null() ? checked(k, lo, hi) : fallback;
  };
  constexpr int64_t kMaxHidden = 1 << 16, kMaxLayers = 4096, kMaxVocab = 1 << 22, kMaxContext = 1 << 22,
                    kMaxFfn = 1 << 20;
  const std::string type = j.value("model_type", std::string(j.contains("n_embd") ? "gpt2" : "bert"));
  ModelShape m;
  m.name = type + " (" + path + ")";
  const int64_t h = get_in({"hidden_size", "n_embd"}, 1, kMaxHidden);
  const int64_t layers = get_in({"num_hidden_layers", "n_layer"}, 1, kMaxLayers);
  const int64_t heads = get_in({"num_attention_heads", "n_head"}, 1, h), vocab = get_in({"vocab_size"}, 1, kMaxVocab);
  if (h % heads != 0) {
    throw std::runtime_error(fmt::format("--hf_config: {}: the hidden size {} is not a multiple of the {} attention heads",
                                         path, h, heads));
  }
  if (type == "gpt2") {
    const int64_t ctx = get_in({"n_positions", "max_position_embeddings"}, 1, kMaxContext);
    const int64_t ffn = opt_in("n_inner", 4 * h, 1, kMaxFfn);
    const int64_t block = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * ffn + ffn) + (ffn * h + h);
    const int64_t root = (vocab + ctx) * h + 2 * h;
    m.params = root + layers * block;
    m.largest_layer = std::max(vocab * h, h * ffn + ffn);
    m.largest_param = std::max(vocab * h, h * ffn);
    m.largest_param_grads = vocab * h >= h * ffn ? 2 : 1;
    m.tied_head = vocab * h;  // GPT2LMHeadModel ties lm_head to wte
    m.units.push_back(root);
    for (int64_t l = 0; l < layers; ++l) m.units.push_back(block);
    m.transformer = ModelShape::Transformer{layers, h, heads, vocab, ffn};
  } else if (type == "llama" || type == "mistral" || type == "qwen2") {
    const int64_t ffn = get_in({"intermediate_size"}, 1, kMaxFfn);
    const int64_t kv = opt_in("num_key_value_heads", heads, 1, heads);
    if (heads % kv != 0) {
      throw std::runtime_error(fmt::format("--hf_config: {}: 'num_attention_heads' {} is not a multiple of "
                                           "'num_key_value_heads' {}", path, heads, kv));
    }
    const int64_t kv_dim = h / heads * kv;
    const bool bias = type == "qwen2";
    const int64_t block = 2 * h + h * h + 2 * h * kv_dim + h * h + 3 * h * ffn + (bias ? h + 2 * kv_dim : 0);
    const bool tied = j.value("tie_word_embeddings", false);
    const int64_t root = vocab * h * (tied ? 1 : 2) + h;
    m.params = root + layers * block;
    m.largest_layer = std::max(vocab * h, h * ffn);
    m.largest_param = m.largest_layer;
    m.largest_param_grads = tied && vocab * h >= h * ffn ? 2 : 1;
    m.tied_head = tied ? vocab * h : 0;
    m.untied_head = tied ? 0 : vocab * h;  // lm_head, in the root beside embed_tokens
    m.units.push_back(root);
    for (int64_t l = 0; l < layers; ++l) m.units.push_back(block);
    m.transformer = ModelShape::Transformer{layers, h, heads, vocab, ffn};
    // Two RMSNorms' inputs and outputs, q, k, v, the rotated q and k, the attention's output; the
    // gate's and up projection's outputs, the activated gate and the product.
    m.transformer->kept_per_token = 4 * h + (h + 2 * kv_dim) + (h + kv_dim) + h + 4 * ffn;
  } else {  // BERT and its kin: embeddings (word, position, type, LayerNorm), blocks, pooler
    const int64_t ffn = get_in({"intermediate_size"}, 1, kMaxFfn), ctx = get_in({"max_position_embeddings"}, 1, kMaxContext);
    const int64_t types = opt_in("type_vocab_size", 2, 0, 1024);
    const int64_t block = 4 * (h * h + h) + 2 * h + (h * ffn + ffn) + (ffn * h + h) + 2 * h;
    const int64_t root = (vocab + ctx + types) * h + 2 * h + (h * h + h);
    m.params = root + layers * block;
    m.largest_layer = std::max(vocab * h, h * ffn + ffn);
    m.largest_param = std::max(vocab * h, h * ffn);
    m.units.push_back(root);
    for (int64_t l = 0; l < layers; ++l) m.units.push_back(block);
    // Logits over the vocabulary only for a masked-LM or pre-training head (all-MiniLM-L6-v2 names
    // BertModel; a sequence classifier's logits are a few per sequence).
    bool lm = false;
    if (j.contains("architectures") && j["architectures"].is_array()) {
      for (const auto& a : j["architectures"])
        if (a.is_string() && (a.get<std::string>().find("MaskedLM") != std::string::npos ||
                              a.get<std::string>().find("PreTraining") != std::string::npos))
          lm = true;
    }
    double dropout = 0;
    if (j.contains("attention_probs_dropout_prob") && j["attention_probs_dropout_prob"].is_number())
      dropout = j["attention_probs_dropout_prob"].get<double>();
    m.transformer = ModelShape::Transformer{layers, h, heads, vocab, ffn, lm, dropout};
  }
  return m;
}

// --- zeal's prediction ----------------------------------------------------------------------------

std::string offload_name(Offload o) {
  switch (o) {
    case Offload::kCpu: return "cpu";
    case Offload::kNvme: return "nvme";
    default: return "none";
  }
}

// Stage 3 with several ranks: the moment of a training pass that holds the most, following the
// fetch coordinator's rules along the units' trace (forward over the blocks, backward in reverse;
// the root and units within stage3_param_persistence_threshold stay gathered): at each unit the
// unit in use and the next one not gathered yet (prefetch) are gathered, and a unit used is kept
// while its next use comes within stage3_max_reuse_distance elements and the units kept stay within
// stage3_max_live_parameters. Beside the gathered units each moment holds
//   forward:    the activations of the blocks run so far;
//   turnaround: all activations with the logits, their softmax and gradient; then, in the head's
//               backward, the logits' gradient and the head's gradient (tied to the embedding,
//               it waits for the lookup's through the whole backward; untied, it is written into
//               the root's reduction staging and stays there until the root's reduction);
//   backward:   the activations not yet used, the tied head's gradient, and the reduction staging
//               (comm dtype, a unit's size) of the unit in backward and of the two before it (at
//               most two reductions in flight);
//   end:        the root's staging as the embedding's gradient arrives, with both halves of a
//               tied gradient (untied: the embedding's fresh gradient) and the last two
//               reductions in flight.
// (gpt2-1.3b, bf16, 2 ranks, 2 x 64 tokens: 1.32 GiB gathered, 3 x 192 MiB staging, as measured.)
struct Stage3Peak {
  double bytes = 0, gathered_elems = 0, staging_elems = 0, activations = 0, logits = 0, head = 0;
  bool in_head_backward = false;  // `logits` is then the logits' gradient alone
};

// What the blocks hold for their backward, in bytes, block by block: `stored` from the block's
// forward to its backward (a checkpointed block: its input only), `again` while its backward runs
// (a checkpointed block's recomputed activations; 0 for the others).
struct BlockActivations {
  std::vector<double> stored, again;
  double stored_total() const { return std::accumulate(stored.begin(), stored.end(), 0.0); }
  double stored_up_to(size_t i) const {  // blocks 0..i
    return i < stored.size() ? std::accumulate(stored.begin(), stored.begin() + static_cast<long>(i) + 1, 0.0) : 0.0;
  }
};

// Stage 3's persistent units: the root and those within stage3_param_persistence_threshold.
namespace {
bool unit_persistent(const ModelShape& m, const RunShape& r, size_t i) {
  return i == 0 || m.units[i] <= r.persistence_threshold;
}
}  // namespace

Stage3Peak stage3_peak(const ModelShape& m, const RunShape& r, double P, double G, const BlockActivations& acts,
                       double logits, double logits_grad, double head_wait, double head_arrival, double end_extra) {
  const size_t n = m.units.size();
  std::vector<char> persistent(n, 0), held(n, 0);
  double persistent_elems = 0;
  std::vector<size_t> trace;
  for (size_t i = 0; i < n; ++i) {
    persistent[i] = unit_persistent(m, r, i);
    if (persistent[i]) persistent_elems += static_cast<double>(m.units[i]);
    // Every block runs, persistent or not: the trace is theirs (their activations, their gradients'
    // staging); only the released ones are gathered and let go along it.
    if (i > 0) trace.push_back(i);
  }
  const size_t nf = trace.size();
  for (size_t k = nf; k-- > 0;) trace.push_back(trace[k]);
  const double R = static_cast<double>(r.max_reuse_distance), live_cap = static_cast<double>(r.max_live_parameters);
  Stage3Peak best;
  auto consider = [&](double gathered, double staging, double acts, double lg, double hd, bool in_head = false) {
    const double bytes = P * gathered + G * staging + acts + lg + hd;
    if (bytes > best.bytes) best = {bytes, gathered, staging, acts, lg, hd, in_head};
  };
  double live = 0;
  auto hold = [&](size_t u) {  // persistent units are in persistent_elems all along
    if (!held[u] && !persistent[u]) live += static_cast<double>(m.units[u]);
    held[u] = 1;
  };
  auto drop = [&](size_t u) {
    if (held[u] && !persistent[u]) live -= static_cast<double>(m.units[u]);
    held[u] = 0;
  };
  const double activations = acts.stored_total();
  for (size_t k = 0; k < trace.size(); ++k) {
    const size_t u = trace[k];
    hold(u);
    // The next gather, prefetched when a released unit is fetched (a persistent one fetches nothing).
    for (size_t j = k + 1; j < trace.size() && !persistent[u]; ++j) {
      if (!held[trace[j]] && !persistent[trace[j]]) {
        hold(trace[j]);
        break;
      }
    }
    const double gathered = persistent_elems + live;
    if (k < nf) {
      consider(gathered, 0, acts.stored_up_to(k), 0, 0);
    } else {
      const size_t b = k - nf, block = nf - 1 - b;  // the block whose backward runs
      if (b == 0) {
        consider(gathered, 0, activations, logits, 0);
        consider(gathered, 0, activations, logits_grad, head_wait, true);
        consider(gathered, 0, activations, 0, head_arrival, true);
      }
      double staging = 0;
      for (size_t j = 0; j < 3 && j <= b; ++j) staging += static_cast<double>(m.units[trace[k - j]]);
      const double again = block < acts.again.size() ? acts.again[block] : 0;
      consider(gathered, staging, acts.stored_up_to(block) + again, 0, head_wait);
    }
    bool keep = persistent[u] != 0;
    if (!keep && live <= live_cap) {
      double distance = 0;
      for (size_t j = k + 1; j < trace.size() && distance < R; ++j) {
        if (trace[j] == u) {
          keep = true;
          break;
        }
        if (!persistent[trace[j]]) distance += static_cast<double>(m.units[trace[j]]);
      }
    }
    if (!keep) drop(u);
  }
  double last_two = 0;
  for (size_t j = 0; j < 2 && j < nf; ++j) last_two += static_cast<double>(m.units[trace[trace.size() - 1 - j]]);
  consider(persistent_elems, (n > 0 ? static_cast<double>(m.units[0]) : 0) + last_two, 0, 0, end_extra);
  return best;
}

Prediction predict(const ModelShape& m, const RunShape& r) {
  Prediction p;
  p.run = r;
  const double N = std::max(1, r.world), psi = static_cast<double>(m.params);
  const int64_t P = r.precision == "fp32" ? 4 : 2;  // compute copy
  const int64_t G = 4;                              // gradients accumulate in fp32
  // fp32 parameters are their own master weights, unless a parameter store (offload_param nvme, or
  // cpu on a GPU) frees their shards between uses: then the master is a copy of its own.
  const bool param_store =
      r.stage == 3 && (r.offload_param == Offload::kNvme || (r.offload_param == Offload::kCpu && r.on_gpu));
  const int64_t M = P == 4 && !param_store ? 0 : 4;
  const int64_t O = 8;                              // Adam's m and v
  const std::string dev = r.on_gpu ? "device" : "host";
  auto add = [&](const std::string& name, double bytes, const std::string& where) {
    if (bytes > 0) p.parts.push_back({name, static_cast<int64_t>(bytes), where});
  };
  // Gradients, master weights and optimizer states exist for the elements that train only.
  const double trained = r.trainable_params >= 0 ? std::min(psi, static_cast<double>(r.trainable_params)) : psi;
  const double p_share = r.stage == 3 ? psi / N : psi;
  const double g_share = r.stage >= 2 ? trained / N : trained;
  const double mo_share = r.stage >= 1 ? trained / N : trained;
  add("runtime", static_cast<double>(r.runtime_bytes), "host");
  // Parameters offloaded in stage 3: the persistent units' shards stay where the model computes;
  // of the rest, nvme keeps max_in_cpu elements in host memory and the others on disk, cpu all of
  // them in host memory.
  double disk_share = 0;  // elements of parameter shards per rank on disk
  if (r.stage == 3 && r.offload_param != Offload::kNone) {
    double kept = 0;
    for (size_t i = 0; i < m.units.size(); ++i)
      if (unit_persistent(m, r, i)) kept += static_cast<double>(m.units[i]);
    kept = std::min(p_share, kept / N);
    const double rest = p_share - kept;
    const double in_cpu = r.offload_param == Offload::kCpu ? rest : std::min(rest, static_cast<double>(r.max_in_cpu));
    if (r.on_gpu) {
      add("parameters", P * kept, dev);
      add("parameters in host memory", P * in_cpu, "host");
    } else {
      add("parameters", P * (kept + in_cpu), "host");
    }
    disk_share = rest - in_cpu;
    add("parameters on disk", P * disk_share, "disk");
  } else {
    add("parameters", P * p_share, dev);
  }
  // offload_optimizer nvme: the reduced gradients go to disk with the optimizer state (swapped per unit).
  add("gradients", G * g_share, r.offload_optimizer == Offload::kNvme ? "disk" : dev);
  const std::string mo_where = r.offload_optimizer == Offload::kNone ? dev : r.offload_optimizer == Offload::kCpu ? "host" : "disk";
  // Offloaded, the master weights are their own fp32 copy even for fp32 parameters (in host
  // memory, or in the NVMe swap file's [master | m | v]) — except on CPU ranks offloading to the
  // host memory they compute in: nothing moves but the optimizer state, and no step buffers exist.
  const bool local_offload = r.offload_optimizer == Offload::kCpu && !r.on_gpu;
  add("master weights", (r.offload_optimizer != Offload::kNone && !local_offload ? 4 : M) * mo_share, mo_where);
  add("optimizer states", O * mo_share, mo_where);
  double states = 0;
  for (const auto& part : p.parts)
    if (part.name != "runtime" && part.name != "parameters on disk") states += static_cast<double>(part.bytes);
  p.model_state_bytes = static_cast<int64_t>(states);
  // Shards past max_in_cpu are read from disk ahead of their units' gathers: up to
  // offload_param.buffer_count reads in flight, each a unit's shard, and the shard of the unit being
  // gathered (gpt2-small on 2 ranks with 2/3 of its shards on disk: 6 x 14 MiB measured). The
  // optimizer step brings the trainable shards in a unit at a time: one (two across a boundary), or,
  // with the optimizer on NVMe too, those of every unit whose shard starts in the window it
  // updates (sub_group_size elements), and the one before. On a GPU a shard is read when its gather
  // is issued, through one host buffer of its size.
  const double window = std::min(static_cast<double>(nvme_window_elems(r.sub_group_size)), mo_share);
  if (disk_share > 0 && m.units.size() >= 2) {
    const double largest_unit = static_cast<double>(*std::max_element(m.units.begin() + 1, m.units.end()));
    double units_held = r.on_gpu ? 1 : static_cast<double>(r.param_buffer_count + 1);
    if (!r.on_gpu && r.offload_optimizer == Offload::kNvme && largest_unit > 0) {
      units_held = std::max(units_held, std::ceil(window / (largest_unit / N)) + 1);
    }
    add("parameter shards read from disk", P * std::min(disk_share, units_held * largest_unit / N), "host");
  }
  // Offload buffers: NVMe windows (up to three sets of master, m, v, gradients and the gradients'
  // read buffer, plus the result window);
  // CPU offload: the step's gradient and result buffers.
  if (r.offload_optimizer == Offload::kNvme) {
    add("offload windows", (20.0 * std::clamp(r.buffer_count, 1, 3) + P) * window, "host");
  } else if (r.offload_optimizer == Offload::kCpu && !local_offload) {
    add("offload step buffers", (4.0 + P) * mo_share, "host");
  }
  // Activations kept for the backward (a transformer's: per layer and token 8·h + 2·ffn elements in
  // the compute dtype — LayerNorm inputs and outputs, q/k/v, attention output, the MLP's two
  // ffn-wide tensors); a checkpointed block keeps its input (h per token) and holds its activations
  // again while its backward runs. Then the head: the plain one holds the logits with their fp32
  // softmax and gradient before its backward, and the logits' gradient (compute dtype) with the
  // head's fresh weight gradient in it; the chunked one (zeal::chunked_cross_entropy) a block of
  // logits and its exponentials, each token's log-sum-exp and target logit, and in its backward the
  // hidden states' fp32 gradient and a vocabulary slice's weight gradient besides.
  BlockActivations acts;
  double logits = 0, logits_grad = 0, head_grad = 0;
  const double train = r.trainable_params >= 0 ? std::min(psi, static_cast<double>(r.trainable_params)) : psi;
  const bool frozen_head = train < psi && r.frozen_head;  // LoRA: the head is part of the frozen base
  if (m.transformer) {
    const auto& t = *m.transformer;
    const double tokens = static_cast<double>(r.micro_batch * r.seq_len);
    const double kept = t.kept_per_token > 0 ? static_cast<double>(t.kept_per_token) : 8.0 * t.hidden + 2.0 * t.ffn;
    double block = tokens * kept * static_cast<double>(P);
    if (t.attention_dropout > 0 && !r.on_gpu) {
      // The CPU's attention with dropout: the probabilities, their dropout mask and the dropped ones
      // (a GPU's fused attention keeps none of them).
      block += static_cast<double>(r.micro_batch) * static_cast<double>(t.heads) * static_cast<double>(r.seq_len) *
               static_cast<double>(r.seq_len) * (2.0 * static_cast<double>(P) + 1.0);
    }
    const double input = tokens * static_cast<double>(t.hidden) * static_cast<double>(P);
    const int64_t interval = std::max<int64_t>(1, r.checkpoint_interval);
    for (int64_t l = 0; l < t.layers; ++l) {
      const bool ckpt = r.activation_checkpointing && l % interval == 0;
      acts.stored.push_back(ckpt ? input : block);
      acts.again.push_back(ckpt ? block : 0.0);
    }
    if (t.lm_head) {
      const double V = static_cast<double>(t.vocab), C = static_cast<double>(t.hidden);
      if (r.chunked_loss) {
        // chunked_cross_entropy's plan: a vocabulary slice of at most 4 Mi weights, a chunk of tokens
        // making a block of 8 Mi logits with it.
        const double kBlock = 8388608.0, kSlice = 4194304.0;
        double slice = std::min(V, std::max(1.0, std::floor(kSlice / C)));
        const double chunk = r.loss_chunk > 0 ? std::min(tokens, static_cast<double>(r.loss_chunk))
                                              : std::clamp(std::floor(kBlock / slice), 1.0, std::max(1.0, tokens));
        slice = std::min(slice, std::max(1.0, std::floor(kBlock / chunk)));
        const double logit_block = 4.0 * chunk * slice;
        const bool widened = P == 2 && !r.on_gpu;  // bf16/fp16 products in fp32 on CPUs without instructions
        logits = 2 * logit_block + 8.0 * tokens;
        logits_grad = 2 * logit_block + 4.0 * tokens * C + 4.0 * slice * C + (widened ? 4.0 * tokens * C : 0.0);
      } else {
        logits = tokens * V * (static_cast<double>(P) + 8.0);
        logits_grad = tokens * V * static_cast<double>(P);
      }
      head_grad = frozen_head ? 0.0 : static_cast<double>(P) * V * C;
    }
  }
  const double activations = acts.stored_total();
  const double last_again = acts.again.empty() ? 0.0 : acts.again.back();
  if (r.stage == 3 && N > 1 && m.units.size() >= 2) {
    // The moment of the pass that holds the most (stage3_peak).
    // Tied: the head's gradient (compute dtype) waits for the lookup's, and the end holds both and
    // their sum's staging. Untied: the head's gradient sits in the root's staging (accumulation
    // dtype) from the turnaround on, and the end adds the embedding's fresh gradient.
    const double tied = frozen_head ? 0.0 : static_cast<double>(m.tied_head);
    const double untied = frozen_head ? 0.0 : static_cast<double>(m.untied_head);
    // An untied head's fresh gradient (compute dtype) is added into the root's staging when it
    // arrives: for that moment both exist.
    const double head_wait = tied > 0 ? P * tied : G * untied;
    const double head_arrival = tied > 0 ? P * tied : (G + P) * untied;
    const double end_extra = tied > 0 ? 2 * P * tied : P * untied;
    const Stage3Peak s = stage3_peak(m, r, static_cast<double>(P), static_cast<double>(G), acts, logits, logits_grad,
                                     head_wait, head_arrival, end_extra);
    add("gathered units", P * std::min(psi, s.gathered_elems), dev);
    add("gradients being reduced", G * s.staging_elems * (trained / psi), dev);
    add(tied > 0 ? "the tied head's gradient" : "the head's gradient", s.head, dev);
    add("activations", s.activations, dev);
    add(s.in_head_backward ? "the logits' gradient" : r.chunked_loss ? "a block of logits (chunked loss)"
                                                                    : "logits, softmax and their gradient",
        s.logits, dev);
  } else {
    const double largest_unit = m.units.empty() ? psi : static_cast<double>(*std::max_element(m.units.begin(), m.units.end()));
    if (r.stage == 3 && N > 1) {
      add("gathered units", P * psi, dev);
      add("a unit's full gradient before its reduce-scatter", G * largest_unit * (trained / psi), dev);
      add("activations", activations, dev);
      add("logits, softmax and their gradient", logits, dev);
    } else {
      // The backward's own tensors at the moment that holds the most: before the head's backward,
      // the activations with the logits, their softmax and gradient; in it, the activations, the
      // logits' gradient and the head's fresh weight gradient; in the last block's backward, every
      // block's activations (a checkpointed block's again) and the tied head's gradient (waiting for
      // the lookup's); at the end, the largest parameter's fresh gradient — tied to the head, three
      // of it: the head's (waiting since the turnaround), the lookup's and their sum (gpt2-small,
      // 2 ranks: 446 to 456 MiB per rank beside the model states whether 64 or 256 tokens, 3 x 147
      // MiB). Fresh gradients are in the parameters' (compute) dtype; the flat gradients they are
      // added into are the model states' fp32.
      // Stages 1 and 2 on several ranks add the reduction's buffers of reduce_bucket_size (DeepSpeed's
      // 5e8 elements: the whole gradient of models up to that size) from the first gradient that
      // arrives on: to the blocks' backward and its end, not to the head's backward before them.
      const double buckets = (r.stage == 1 || r.stage == 2) && N > 1 ? G * std::min(trained, 5e8) : 0.0;
      // A tied embedding's gradients at the end: the plain head's (the product's transposed result,
      // which the sum copies), the lookup's and their sum — three; the chunked head's is written
      // contiguous and autograd adds the lookup's into it — two (gpt2-small, 2 ranks, 1 x 256 and
      // 1 x 768 tokens at stages 0-2: 2.0 to 2.2 x 147 MiB measured beside the model states and the
      // runtime).
      const double largest = frozen_head ? 0.0 : P * static_cast<double>(m.largest_param);
      const int copies = m.largest_param_grads > 1 ? (r.chunked_loss ? 2 : m.largest_param_grads + 1) : 1;
      const double tied_wait = frozen_head ? 0.0 : P * static_cast<double>(m.tied_head);
      const double before_head = activations + logits, in_head = activations + logits_grad + head_grad;
      const double first_block = buckets + activations + last_again + tied_wait;
      const double at_end = buckets + largest * copies;
      if (at_end >= before_head && at_end >= in_head && at_end >= first_block) {
        add("gradient buckets in flight", buckets, dev);
        add("the largest parameter's fresh gradients", largest * copies, dev);
      } else if (first_block >= before_head && first_block >= in_head) {
        add("gradient buckets in flight", buckets, dev);
        add("activations", activations, dev);
        add("a checkpointed block's activations again", last_again, dev);
        add("the tied head's gradient", tied_wait, dev);
      } else if (in_head >= before_head) {
        add("activations", activations, dev);
        add("the logits' gradient", logits_grad, dev);
        add("the head's fresh gradient", head_grad, dev);
      } else {
        add("activations", activations, dev);
        add(r.chunked_loss ? "a block of logits (chunked loss)" : "logits, softmax and their gradient", logits, dev);
      }
    }
  }
  for (const auto& part : p.parts) {
    if (part.where == "disk") p.disk_bytes += part.bytes;
    else if (part.where == "device") p.device_peak += part.bytes;
    else p.host_peak += part.bytes;
  }
  return p;
}

Report report(const ModelShape& m, const RunShape& base, const std::vector<int>& stages, const std::vector<Offload>& offloads) {
  Report out;
  const int nodes = std::max(1, base.nodes), gpus = std::max(1, base.world / nodes);  // DeepSpeed's per-node count
  nlohmann::json j;
  j["model"] = {{"name", m.name}, {"params", m.params}, {"largest_layer_params", m.largest_layer}};
  j["run"] = {{"world", base.world}, {"nodes", nodes}, {"precision", base.precision}, {"micro_batch", base.micro_batch},
              {"seq_len", base.seq_len}, {"on_gpu", base.on_gpu}, {"runtime_bytes", base.runtime_bytes},
              {"activation_checkpointing", base.activation_checkpointing},
              {"checkpoint_interval", base.checkpoint_interval}, {"chunked_loss", base.chunked_loss},
              {"loss_chunk", base.loss_chunk}, {"max_in_cpu", base.max_in_cpu},
              {"trainable_params", base.trainable_params}, {"frozen_head", base.frozen_head}};
  std::string text = fmt::format("zeal estimate-memory: {}, {:.1f} M parameters (largest layer {:.1f} M), {} ranks, {}, "
                                 "{} x {} tokens per rank{}{}{}\n\n",
                                 m.name, static_cast<double>(m.params) / 1e6, static_cast<double>(m.largest_layer) / 1e6,
                                 base.world, base.precision, base.micro_batch, base.seq_len,
                                 base.activation_checkpointing
                                     ? (base.checkpoint_interval > 1
                                            ? fmt::format(", every {}th block checkpointed", base.checkpoint_interval)
                                            : std::string(", blocks checkpointed"))
                                     : std::string(),
                                 base.chunked_loss ? ", chunked loss" : "",
                                 base.trainable_params >= 0
                                     ? fmt::format(", {:.2f} M parameters train", static_cast<double>(base.trainable_params) / 1e6)
                                     : std::string());
  text += "| stage | offload | model states per rank | " + std::string(base.on_gpu ? "device peak | " : "") +
          "host peak | on disk | what the peak holds |\n|---|---|---|" + (base.on_gpu ? "---|" : "") + "---|---|---|\n";
  nlohmann::json rows = nlohmann::json::array();
  for (int stage : stages) {
    for (Offload o : offloads) {
      if (o == Offload::kNvme && stage != 3) continue;  // NVMe offload is stage 3's
      if (o != Offload::kNone && stage == 0) continue;  // offload shards the optimizer: stages 1-3
      RunShape r = base;
      r.stage = stage;
      r.offload_optimizer = o;
      r.offload_param = stage == 3 ? o : Offload::kNone;
      const Prediction p = predict(m, r);
      std::string parts;
      nlohmann::json jp = nlohmann::json::object();
      for (const auto& part : p.parts) {
        if (part.where != "disk") parts += fmt::format("{}{} {}", parts.empty() ? "" : ", ", part.name, format_bytes(static_cast<double>(part.bytes)));
        jp[part.name] = {{"bytes", part.bytes}, {"where", part.where}};
      }
      text += fmt::format("| {} | {} | {} | {}{} | {} | {} |\n", stage, offload_name(o), format_bytes(static_cast<double>(p.model_state_bytes)),
                          base.on_gpu ? format_bytes(static_cast<double>(p.device_peak)) + " | " : "",
                          format_bytes(static_cast<double>(p.host_peak)), format_bytes(static_cast<double>(p.disk_bytes)), parts);
      rows.push_back({{"stage", stage}, {"offload", offload_name(o)}, {"model_state_bytes", p.model_state_bytes},
                      {"device_peak_bytes", p.device_peak}, {"host_peak_bytes", p.host_peak}, {"disk_bytes", p.disk_bytes},
                      {"parts", jp}});
    }
  }
  j["zeal"] = rows;
  text += "\nDeepSpeed's estimators (model states only, × 1.5 \"additional buffer factor\"):\n\n";
  text += deepspeed_zero2_table(m.params, gpus, nodes) + "\n" + deepspeed_zero3_table(m.params, m.largest_layer, gpus, nodes);
  nlohmann::json ds = nlohmann::json::array();
  for (bool off : {true, false}) {
    const auto r = deepspeed_zero2(m.params, gpus, nodes, off);
    ds.push_back({{"stage", 2}, {"offload_optimizer", off}, {"cpu_bytes", r.cpu_bytes}, {"gpu_bytes", r.gpu_bytes}});
  }
  for (bool off : {true, false})
    for (bool offp : {true, false}) {
      if (!off && offp) continue;
      for (bool init : {true, false}) {
        const auto r = deepspeed_zero3(m.params, m.largest_layer, gpus, nodes, off, offp, init);
        ds.push_back({{"stage", 3}, {"offload_optimizer", off}, {"offload_param", offp}, {"zero_init", init},
                      {"cpu_bytes", r.cpu_bytes}, {"gpu_bytes", r.gpu_bytes}});
      }
    }
  j["deepspeed"] = ds;
  out.text = text;
  out.json = j.dump(2);
  return out;
}

}  // namespace zeal::estimate
