// Instruction-tunes a LLaMA-family causal LM with zeal's Trainer: Hugging Face weights and
// tokenizer.json in (examples/models/llama.h, bpe.h), JSON-lines records with the loss on the
// responses only (instruction_data.h), LoRA (or full fine-tuning) under any ZeRO stage and offload
// (configs/ds_zero3_cpu.yaml as it is), the evaluation loss and a few greedy generations every
// epoch, PEFT's memory lines per epoch, and the adapter in PEFT's format (with --merged, the merged
// model too, beside a config.json and tokenizer.json transformers loads).
//
//   zeal launch --num_processes 2 build/bin/finetune_causal_lm --config_file configs/ds_zero3_cpu.yaml
//       --model_dir DIR --train train.jsonl --eval eval.jsonl --output_dir out --num_train_epochs 2
//
// Every Hugging Face training argument is a flag (see --help). The last line is
// "exact_match: <fraction>": the evaluation responses the model generates exactly (greedy).
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <iostream>
#include <optional>
#include <stdexcept>
#include <sstream>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/estimate.h"
#include "engine/error.h"
#include "engine/output.h"
#include "engine/peft/lora.h"
#include "engine/trainer/trainer.h"
#include "examples/common/flags.h"
#include "examples/models/bpe.h"
#include "examples/models/generate.h"
#include "examples/models/instruction_data.h"
#include "examples/models/llama.h"

namespace fs = std::filesystem;
using namespace zeal::models;

namespace {

struct Prompt {
  std::vector<int64_t> ids;
  std::string prompt, response;
};

// The evaluation records' prompts as the model sees them before its answer, and the answers.
std::vector<Prompt> prompts(const std::string& path, const zeal::text::BpeTokenizer& tok, const ChatTemplate& t) {
  std::vector<Prompt> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const auto r = nlohmann::json::parse(line);
    if (!r.contains("prompt") || !r.contains("response")) continue;
    Prompt p{t.add_bos ? tok.encode("", true) : std::vector<int64_t>{}, r["prompt"].get<std::string>(),
             r["response"].get<std::string>()};
    for (const auto& part : {t.user_prefix, p.prompt + t.user_suffix, t.assistant_prefix}) {
      const auto ids = tok.encode(part, false);
      p.ids.insert(p.ids.end(), ids.begin(), ids.end());
    }
    out.push_back(std::move(p));
  }
  return out;
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string x; std::getline(ss, x, ',');)
    if (!x.empty()) out.push_back(x);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Instruction-tune a LLaMA-family causal LM with LoRA under zeal's Trainer"};
  app.allow_extras();
  std::string model_dir, train_path, eval_path, targets = "q_proj,v_proj";
  int64_t r = 8, max_length = 256, samples = 3, max_new_tokens = 32;
  double alpha = 16, dropout = 0.0;
  bool full = false, merged = false;
  app.add_option("--model_dir", model_dir, "config.json, model.safetensors and tokenizer.json (save_pretrained's)")->required();
  app.add_option("--train", train_path, "JSON-lines records: prompt and response, or messages")->required();
  app.add_option("--eval", eval_path, "held-out records (loss, generations, exact match)");
  app.add_option("--lora_r", r)->capture_default_str()->check(zeal_examples::integer_in(1, 1 << 16));
  app.add_option("--lora_alpha", alpha)->capture_default_str()->check(zeal_examples::positive_finite());
  app.add_option("--lora_dropout", dropout)->capture_default_str()->check(zeal_examples::real_in(0.0, 0.99));
  app.add_option("--target_modules", targets, "comma-separated, or all-linear")->capture_default_str();
  app.add_flag("--full", full, "train every parameter (no adapters)");
  app.add_flag("--merged", merged, "also save the merged model (output_dir/merged)");
  app.add_option("--max_length", max_length, "tokens per record at most")->capture_default_str()->check(zeal_examples::at_least_one());
  app.add_option("--samples", samples, "greedy generations printed at each evaluation")->capture_default_str()->check(zeal_examples::non_negative());
  app.add_option("--max_new_tokens", max_new_tokens)->capture_default_str()->check(zeal_examples::at_least_one());
  zeal::TrainingArguments args;
  args.output_dir = "causal_lm_out";
  args.learning_rate = 2e-4;
  args.logging_steps = 10;
  args.run_name = "finetune_causal_lm";
  args.dataloader_num_workers = 1;
  if (auto code = zeal_examples::parse_trainer_flags(app, argc, argv, "finetune_causal_lm", args)) return *code;
  if (!eval_path.empty() && args.eval_strategy == "no") args.eval_strategy = "epoch";
  std::optional<zeal::Config> config = zeal_examples::load_config(argc, argv, "finetune_causal_lm");
  if (!config) return 2;
  try {
    zeal::check_output_dir(args.output_dir, "--output_dir");
    zeal::Engine engine(std::move(*config));
    const auto tok_ptr = std::make_shared<const zeal::text::BpeTokenizer>(
        zeal::text::BpeTokenizer::from_file(model_dir + "/tokenizer.json"));
    const auto& tok = *tok_ptr;
    const ChatTemplate chat;
    // Records are tokenized as the loader's workers prepare their batches.
    InstructionStream train(train_path, tok_ptr, chat, max_length);
    std::optional<InstructionStream> eval;
    std::vector<Prompt> eval_prompts;
    if (!eval_path.empty()) {
      eval.emplace(eval_path, tok_ptr, chat, max_length);
      eval_prompts = prompts(eval_path, tok, chat);
    }
    const int64_t pad = std::max<int64_t>(0, tok.token_id("<|pad|>"));
    at::manual_seed(args.seed);
    const auto cfg = LlamaConfig::from_file(model_dir + "/config.json");
    auto model = engine.init<LlamaForCausalLM>(cfg);
    zeal::PretrainedOptions load;
    load.strict = true;
    load.quiet = true;
    zeal::load_pretrained(model, model_dir, load);
    zeal::peft::PeftModel peft;
    if (!full) {
      zeal::peft::LoraConfig lc;
      lc.r = r;
      lc.lora_alpha = alpha;
      lc.lora_dropout = dropout;
      lc.target_modules = split(targets);
      lc.task_type = "CAUSAL_LM";
      lc.base_model_name_or_path = fs::absolute(model_dir).string();
      peft = zeal::peft::get_peft_model(model, lc);
      if (engine.is_main_process()) peft.print_trainable_parameters();
    }
    zeal::Trainer trainer(engine, model, args, std::move(train), std::move(eval),
                          [&](const InstructionBatch& b) { return model->loss(b.data, b.labels, b.attention_mask); },
                          PadCollate{pad});
    // Greedy generations of the evaluation prompts: a few printed at each evaluation; the exact
    // matches counted at the end. Every rank generates (stage 3 gathers in each forward).
    GenerationConfig g;
    g.max_new_tokens = max_new_tokens;
    g.eos_token_id = tok.token_id("<|end|>");
    g.pad_token_id = pad;
    auto answers = [&](size_t n) {
      std::vector<std::vector<int64_t>> ps;
      for (size_t i = 0; i < n && i < eval_prompts.size(); ++i) ps.push_back(eval_prompts[i].ids);
      model->eval();
      auto out = generate(model, ps, g, &engine);
      model->train();
      std::vector<std::string> texts;
      for (auto& ids : out) {
        if (!ids.empty() && ids.back() == g.eos_token_id) ids.pop_back();
        texts.push_back(tok.decode(ids, true));
      }
      return texts;
    };
    struct Samples : zeal::TrainerCallback {
      std::function<void()> show;
      void on_evaluate(const Args&, const zeal::TrainerState&, zeal::TrainerControl&, const zeal::Metrics&) override { show(); }
    };
    auto cb = std::make_shared<Samples>();
    cb->show = [&] {
      const auto texts = answers(static_cast<size_t>(samples));
      for (size_t i = 0; i < texts.size(); ++i) {
        engine.print(fmt::format("sample: {} -> {} (expected {})", eval_prompts[i].prompt, texts[i], eval_prompts[i].response));
      }
    };
    if (samples > 0 && !eval_prompts.empty()) trainer.add_callback(cb);
    auto exact_match = [&] {
      const auto texts = answers(eval_prompts.size());
      int64_t hits = 0;
      for (size_t i = 0; i < texts.size(); ++i) hits += texts[i] == eval_prompts[i].response;
      return static_cast<double>(hits) / static_cast<double>(texts.size());
    };
    // The largest batch (per_device_train_batch_size records of --max_length tokens) against each
    // rank's memory, checked as the Trainer prepares the model: one that cannot fit ends here.
    zeal::estimate::RunShape batch;
    batch.micro_batch = args.per_device_train_batch_size.value_or(8);
    batch.seq_len = max_length;
    batch.chunked_loss = cfg.chunked_loss;
    batch.loss_chunk = cfg.loss_chunk;
    std::optional<zeal::estimate::ModelShape> shape;
    try {
      shape = zeal::estimate::hf_config_shape(model_dir + "/config.json");
    } catch (const std::runtime_error& e) {  // a config the estimator cannot read still trains
      engine.print(fmt::format("zeal: the batch's memory is not checked: {}", e.what()));
    }
    if (shape) engine.check_batch_memory(*shape, batch);
    trainer.prepare();  // a model engine.init partitioned is usable once prepared
    if (!eval_prompts.empty()) engine.print(fmt::format("exact_match before training: {:.4f}", exact_match()));
    trainer.train();
    if (!full) {
      peft.save_pretrained(args.output_dir + "/adapter", &engine);
      engine.print(fmt::format("zeal: adapter saved: {}/adapter (PEFT's format; base {})", args.output_dir, fs::absolute(model_dir).string()));
      if (merged) {
        peft.merge_and_unload(&engine);
        peft.save_merged(args.output_dir + "/merged", &engine);
      }
    } else if (merged) {
      engine.save_model(args.output_dir + "/merged");
    }
    if (merged && engine.is_main_process()) {
      for (const char* f : {"config.json", "tokenizer.json"}) {
        fs::copy_file(fs::path(model_dir) / f, fs::path(args.output_dir) / "merged" / f, fs::copy_options::overwrite_existing);
      }
      engine.print(fmt::format("zeal: merged model saved: {}/merged", args.output_dir));
    }
    if (!eval_prompts.empty()) engine.print(fmt::format("exact_match: {:.4f}", exact_match()));
  } catch (const std::exception& e) {
    return zeal_examples::report_failure("finetune_causal_lm", e);
  }
  return zeal_examples::finish("finetune_causal_lm");
}
