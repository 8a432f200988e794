// Memory estimates before a run: DeepSpeed's model-state estimators reproduced exactly (its
// estimate_zero2/zero3_model_states_mem_needs and their "all cold" tables), and zeal's own
// prediction of what each rank holds and of its peak for a stage and an offload choice.
//
// `zeal estimate-memory` prints both; no LibTorch here.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace zeal::estimate {

// --- DeepSpeed's estimators, as deepspeed/runtime/zero/stage3.py and stage_1_and_2.py compute them
// (bytes; the 1.5 "additional buffer factor" included; per CPU = per node, per GPU = per rank).

struct DeepSpeedRow {
  bool offload_optimizer = false, offload_param = false, zero_init = false;
  int64_t cpu_bytes = 0, gpu_bytes = 0;
  int64_t largest_layer_bytes = 0;  // stage 3 only
};
DeepSpeedRow deepspeed_zero3(int64_t total_params, int64_t largest_layer_params, int gpus_per_node, int nodes,
                             bool cpu_offload, bool cpu_offload_params, bool zero_init, double additional_buffer_factor = 1.5);
DeepSpeedRow deepspeed_zero2(int64_t total_params, int gpus_per_node, int nodes, bool cpu_offload,
                             double additional_buffer_factor = 1.5);
// The tables estimate_zero{2,3}_model_states_mem_needs_all_cold print, line for line.
std::string deepspeed_zero3_table(int64_t total_params, int64_t largest_layer_params, int gpus_per_node, int nodes);
std::string deepspeed_zero2_table(int64_t total_params, int gpus_per_node, int nodes);

// --- The model ------------------------------------------------------------------------------------

// What the prediction needs to know about a model: its parameters, the largest module's own
// parameters (DeepSpeed's "largest layer"), the stage-3 units (the root first, then each Sharded
// block), and, for the activations, a transformer's shape (absent for --params).
struct ModelShape {
  std::string name;
  int64_t params = 0;
  int64_t largest_layer = 0;
  std::vector<int64_t> units;
  // The largest single parameter, and how many gradients of it the backward makes before they are
  // summed (2 for an embedding tied to the head: one through the head, one through the lookup;
  // their sum is a third at the end of the backward).
  int64_t largest_param = 0;
  int largest_param_grads = 1;
  // Elements of an embedding tied to the output head (0: none): the head's gradient of it waits
  // through the whole backward for the lookup's.
  int64_t tied_head = 0;
  // Elements of an output head not tied to the embedding (LLaMA-style lm_head; 0: none or tied).
  int64_t untied_head = 0;
  struct Transformer {
    int64_t layers = 0, hidden = 0, heads = 0, vocab = 0, ffn = 0;
    bool lm_head = true;  // logits over the vocabulary per token (false: a classifier on a pooled state)
    // Dropout on the attention probabilities (BERT's attention_probs_dropout_prob): LibTorch's CPU
    // attention then takes its plain path, which keeps each layer's probabilities, the dropout mask
    // and the dropped probabilities (batch · heads · tokens² each) for the backward.
    double attention_dropout = 0;
    // Elements a block keeps per token for its backward (0: GPT/BERT's 8·hidden + 2·ffn). LLaMA-style
    // blocks keep more: rotated q and k beside q, k, v, and a gated MLP's four ffn-wide tensors.
    int64_t kept_per_token = 0;
  };
  std::optional<Transformer> transformer;
};
// The GPT of examples/models/gpt.h (GptConfig's fields): the root (embeddings, final norm; the
// head is tied) and one unit per block.
// tied: the head is wte's matrix (GPT-2); untied: an lm_head of its own in the root.
ModelShape gpt_shape(const std::string& name, int64_t vocab, int64_t context, int64_t layers, int64_t dim, int64_t heads,
                     bool tied = true);
// A Hugging Face config.json: GPT-2 (n_embd, n_layer, n_head, vocab_size, n_positions), BERT
// (hidden_size, num_hidden_layers, intermediate_size, vocab_size, max_position_embeddings,
// type_vocab_size; logits over the vocabulary only when `architectures` names a masked-LM or
// pre-training head) or LLaMA-style (model_type llama/mistral/qwen2: hidden_size,
// num_hidden_layers, intermediate_size, vocab_size, tie_word_embeddings). std::runtime_error naming
// the file and key.
ModelShape hf_config_shape(const std::string& path);

// --- zeal's prediction ----------------------------------------------------------------------------

enum class Offload { kNone, kCpu, kNvme };
std::string offload_name(Offload o);

struct RunShape {
  int stage = 3;
  Offload offload_optimizer = Offload::kNone;
  Offload offload_param = Offload::kNone;
  int world = 1;                        // ranks in all (num_processes × num_machines)
  int nodes = 1;                        // num_machines
  std::string precision = "fp32";       // fp32 | bf16 | fp16
  bool on_gpu = false;                  // the model computes on a GPU (else the CPU)
  int64_t micro_batch = 1, seq_len = 1024;
  // DeepSpeed's defaults, as the engine reads them.
  int64_t sub_group_size = 1'000'000'000;
  int64_t max_live_parameters = 1'000'000'000;
  int64_t max_reuse_distance = 1'000'000'000;
  int64_t max_in_cpu = 1'000'000'000;   // offload_param nvme: shard elements kept in host memory
  // stage3_param_persistence_threshold: the engine's default, and what it fills "auto" with (it does
  // not know the model's hidden size; Config::resolve_auto with one gives 10 × it)
  int64_t persistence_threshold = 100'000;
  int buffer_count = 4;                  // offload_optimizer.buffer_count
  int param_buffer_count = 5;            // offload_param.buffer_count: shard reads ahead at once
  int64_t runtime_bytes = 0;             // the process's resident set before the model (measured)
  // Activation checkpointing of every checkpoint_interval-th block (units 0, k, 2k, …): such a block
  // keeps its input only, and holds its activations again while its backward runs.
  bool activation_checkpointing = false;
  int64_t checkpoint_interval = 1;
  // The head and loss through zeal::chunked_cross_entropy: a block of logits at a time instead of
  // the [tokens, vocab] logits, their softmax and gradient. loss_chunk: tokens per chunk (0: its
  // default).
  bool chunked_loss = false;
  int64_t loss_chunk = 0;
  // Elements that train (-1: all); the others are frozen (LoRA): no gradients, master weights or
  // optimizer states for them.
  int64_t trainable_params = -1;
  // With trainable_params below the total: whether the LM head is part of the frozen base (LoRA's
  // case, the default) or trains (the lower layers frozen).
  bool frozen_head = true;
};

struct Part {
  std::string name;
  int64_t bytes = 0;
  std::string where;  // "device", "host" or "disk"
};

struct Prediction {
  RunShape run;
  std::vector<Part> parts;
  int64_t model_state_bytes = 0;   // DESIGN.md's stage table with the offload moved out
  int64_t device_peak = 0, host_peak = 0, disk_bytes = 0;
};
Prediction predict(const ModelShape& m, const RunShape& r);

// The whole report: DeepSpeed's tables, then zeal's prediction per stage × offload choice, as a
// markdown table; and the same as one JSON document.
struct Report {
  std::string text;
  std::string json;
};
Report report(const ModelShape& m, const RunShape& base, const std::vector<int>& stages,
              const std::vector<Offload>& offloads);

}  // namespace zeal::estimate
