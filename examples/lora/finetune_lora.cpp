// LoRA fine-tune of a pretrained Hugging Face model with zeal: all-MiniLM-L6-v2 (BERT, 22.7 M
// parameters) learns to tell a Debian package's section from its description. LoRA adapters on
// the attention's query and value, the classification head trained whole (modules_to_save), the
// rest frozen; any ZeRO stage, offload included (configs/ds_zero3_cpu.yaml as it is).
//
//   apt-cache dumpavail > /tmp/packages.txt
//   zeal launch --num_processes 2 build/bin/finetune_lora --config_file configs/ds_zero3_cpu.yaml 
//       --data /tmp/packages.txt --out /tmp/lora_out
//   ... --head_only     the baseline: the frozen model with only the head trained
//
// It trains with zeal's Trainer: evaluation and a checkpoint (in --out/checkpoints) every epoch,
// the best checkpoint loaded at the end, PEFT's memory lines for every training epoch and
// evaluation; every Hugging Face training argument is a flag (--early_stopping_patience 2, …; see
// --help). Then it prints the engine's memory report, saves the adapter (PEFT's format), loads it
// back into the model, merges it (unit by unit under stage 3) and saves the merged model, checking
// the accuracy at each step. The last line is "accuracy: <fraction>".
#include <CLI/CLI.hpp>
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/data/datasets/base.h>
#include <torch/data/example.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/error.h"
#include "engine/output.h"
#include "engine/memory.h"
#include "engine/memory_tracker.h"
#include "engine/peft/lora.h"
#include "engine/trainer/trainer.h"
#include "examples/common/classification.h"
#include "examples/common/flags.h"
#include "examples/models/bert.h"
#include "examples/models/wordpiece.h"

namespace fs = std::filesystem;
using namespace zeal::models;

namespace {

struct Package {
  std::string name, section, text;
};

// Debian control records (apt-cache dumpavail, a Packages file): name, section without its
// archive area (contrib/, non-free/), and "name: synopsis. first line of the long description".
std::vector<Package> read_packages(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw zeal::Error("--data: cannot read " + path + " (make it with: apt-cache dumpavail > " + path + ")");
  std::vector<Package> out;
  Package p;
  bool in_description = false;
  std::string long_line;
  auto flush = [&] {
    if (!p.name.empty() && !p.section.empty() && !p.text.empty()) {
      if (!long_line.empty()) p.text += " " + long_line;
      out.push_back(p);
    }
    p = {};
    long_line.clear();
    in_description = false;
  };
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) {
      flush();
      continue;
    }
    if (line[0] == ' ') {
      if (in_description && long_line.empty() && line != " .") long_line = line.substr(1);
      continue;
    }
    in_description = false;
    if (line.rfind("Package: ", 0) == 0) p.name = line.substr(9);
    else if (line.rfind("Section: ", 0) == 0) {
      p.section = line.substr(9);
      if (auto slash = p.section.find('/'); slash != std::string::npos) p.section = p.section.substr(slash + 1);
    } else if (line.rfind("Description: ", 0) == 0) {
      p.text = p.name + ": " + line.substr(13);
      in_description = true;
    }
  }
  flush();
  if (out.empty()) throw zeal::Error("--data: " + path + " holds no package records (Package, Section, Description)");
  return out;
}

class TextDataset : public torch::data::datasets::Dataset<TextDataset> {
 public:
  TextDataset(const std::vector<std::pair<std::string, int64_t>>& rows, const zeal::text::WordPieceTokenizer& tok,
              int64_t seq) {
    for (const auto& [text, label] : rows) {
      ids_.push_back(at::tensor(tok.encode(text, seq, seq).ids, at::kLong));
      labels_.push_back(label);
    }
  }
  torch::data::Example<> get(size_t i) override { return {ids_[i], at::scalar_tensor(labels_[i], at::kLong)}; }
  std::optional<size_t> size() const override { return ids_.size(); }

 private:
  std::vector<at::Tensor> ids_;
  std::vector<int64_t> labels_;
};

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string part; std::getline(ss, part, sep);)
    if (!part.empty()) out.push_back(part);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"LoRA fine-tune of all-MiniLM-L6-v2: Debian package sections from descriptions"};
  app.allow_extras();
  const char* home = std::getenv("HOME");
  std::string model_dir = std::string(home ? home : "") + "/.cache/zeal/models/all-MiniLM-L6-v2";
  std::string data = "/tmp/packages.txt", out_dir = "lora_out", sections = "games,science,net,text,x11";
  int64_t train_per = 200, eval_per = 60, batch = 16, seq = 48, r = 8, log_every = 10;
  double lr = 2e-3, alpha = 16, dropout = 0.05, epochs = 2;
  bool head_only = false;
  using zeal_examples::at_least_one;
  app.add_option("--model_dir", model_dir, "a BERT in Hugging Face's layout (config.json, model.safetensors, tokenizer.json)")
      ->capture_default_str();
  app.add_option("--data", data, "Debian package records (apt-cache dumpavail > FILE)")->capture_default_str();
  app.add_option("--sections", sections, "the labels: Debian sections, comma-separated")->capture_default_str();
  app.add_option("--train_per_section", train_per)->capture_default_str()->check(at_least_one());
  app.add_option("--eval_per_section", eval_per)->capture_default_str()->check(at_least_one());
  app.add_option("--batch_size", batch, "samples per rank per step (per_device_train_batch_size)")
      ->capture_default_str()
      ->check(zeal_examples::integer_in(1, 1 << 20));
  app.add_option("--epochs", epochs, "num_train_epochs")->capture_default_str()->check(zeal_examples::positive_finite());
  app.add_option("--seq_len", seq, "tokens per sample, [CLS] and [SEP] included")->capture_default_str()->check(zeal_examples::integer_in(4, 512));
  app.add_option("--lr", lr, "learning_rate")->capture_default_str()->check(zeal_examples::positive_finite());
  app.add_option("--r", r, "LoRA rank")->capture_default_str()->check(zeal_examples::integer_in(1, 1 << 16));
  app.add_option("--lora_alpha", alpha)->capture_default_str()->check(zeal_examples::positive_finite());
  app.add_option("--lora_dropout", dropout)->capture_default_str()->check(zeal_examples::real_in(0.0, 0.99));
  app.add_option("--log_every", log_every, "logging_steps")->capture_default_str()->check(at_least_one());
  app.add_option("--out", out_dir, "where the adapter and the merged model go")->capture_default_str();
  app.add_flag("--head_only", head_only, "the baseline: freeze the whole model but the head, no adapters");
  // This program's defaults for the training arguments; their flags override them.
  zeal::TrainingArguments args;
  args.num_train_epochs = epochs;
  args.learning_rate = lr;
  args.lr_scheduler_type = "constant";
  args.weight_decay = 0.01;
  args.logging_steps = log_every;
  args.eval_strategy = "epoch";
  args.save_strategy = "epoch";
  args.load_best_model_at_end = true;
  args.metric_for_best_model = "accuracy";
  args.save_total_limit = 1;
  args.run_name = "finetune_lora";
  args.output_dir = "";  // --out/checkpoints
  // The evaluation batch: twice the training batch unless --per_device_eval_batch_size says otherwise.
  auto eval_batch = [&](zeal::TrainingArguments& a) { a.per_device_eval_batch_size = 2 * batch; };
  if (auto code = zeal_examples::parse_trainer_flags(app, argc, argv, "finetune_lora", args, eval_batch)) return *code;
  auto given = [&](const char* flag) { return app.count(flag) > 0; };
  if (given("--epochs")) args.num_train_epochs = epochs;
  if (given("--lr")) args.learning_rate = lr;
  if (given("--log_every")) args.logging_steps = log_every;
  if (args.output_dir.empty()) args.output_dir = out_dir + "/checkpoints";
  const uint64_t seed = args.seed;

  const auto names = split(sections, ',');
  if (names.size() < 2) {
    std::fprintf(stderr, "finetune_lora: --sections: name at least two sections, got '%s' (see --help)\n", sections.c_str());
    return 2;
  }
  std::optional<zeal::Config> config = zeal_examples::load_config(argc, argv, "finetune_lora");
  if (!config) return 2;
  if (given("--batch_size") || (!args.per_device_train_batch_size && config->train_micro_batch_size_per_gpu.value <= 0)) {
    args.per_device_train_batch_size = batch;
  }
  try {
    zeal::check_output_dir(out_dir, "--out");  // before the training it would hold the results of
    zeal::Engine engine(std::move(*config));
    // The data: the same on every rank; a package's hash decides train or held-out.
    std::map<std::string, std::vector<Package>> by_section;
    for (auto& p : read_packages(data)) by_section[p.section].push_back(std::move(p));
    std::vector<std::pair<std::string, int64_t>> train, valid;
    for (size_t k = 0; k < names.size(); ++k) {
      auto& v = by_section[names[k]];
      if (static_cast<int64_t>(v.size()) < train_per + eval_per) {
        throw zeal::Error(fmt::format("--sections: '{}' has {} packages in {}, fewer than {} + {}", names[k], v.size(), data,
                                      train_per, eval_per));
      }
      std::sort(v.begin(), v.end(), [&](const Package& a, const Package& b) {
        return std::hash<std::string>{}(a.name + std::to_string(seed)) < std::hash<std::string>{}(b.name + std::to_string(seed));
      });
      for (int64_t i = 0; i < train_per + eval_per; ++i) (i < train_per ? train : valid).push_back({v[i].text, static_cast<int64_t>(k)});
    }
    const auto tok = zeal::text::WordPieceTokenizer::from_file(model_dir + "/tokenizer.json");
    at::manual_seed(seed);
    BertConfig cfg = BertConfig::from_file(model_dir + "/config.json");
    auto model = engine.init<BertForSequenceClassification>(cfg, static_cast<int64_t>(names.size()));
    zeal::PretrainedOptions load_options;
    load_options.quiet = true;
    const auto report = zeal::load_pretrained(model, model_dir, load_options);
    engine.print(fmt::format("zeal: {} tensors from {} ({} new: {})", report.loaded, model_dir, report.missing.size(),
                             fmt::format("{}", fmt::join(report.missing, ", "))));
    zeal::peft::PeftModel peft;
    if (head_only) {
      for (auto& p : model->parameters()) p.requires_grad_(false);
      for (auto& p : model->classifier->parameters()) p.requires_grad_(true);
    } else {
      zeal::peft::LoraConfig lc;
      lc.r = r;
      lc.lora_alpha = alpha;
      lc.lora_dropout = dropout;
      lc.target_modules = {"query", "value"};
      lc.modules_to_save = {"classifier"};
      lc.task_type = "SEQ_CLS";
      lc.base_model_name_or_path = "sentence-transformers/all-MiniLM-L6-v2";
      peft = zeal::peft::get_peft_model(model, lc);
      if (engine.is_main_process()) peft.print_trainable_parameters();
    }
    // The Trainer trains what requires a gradient: the adapters and the head (or the head alone).
    zeal::Trainer trainer(engine, model, args, TextDataset(train, tok, seq), TextDataset(valid, tok, seq),
                          [&](const torch::data::Example<>& b) {
                            return zeal_examples::classification_step(model->forward(b.data, b.data.ne(tok.pad_id())),
                                                                      b.target);
                          });
    trainer.compute_metrics = zeal_examples::accuracy;
    trainer.train();
    engine.print(fmt::format("zeal: {} ranks, ZeRO stage {}, {} trainable of {} parameters, {} train / {} held-out "
                             "packages in {} sections",
                             engine.num_processes(), engine.zero_stage(), engine.num_trainable_parameters(),
                             cfg.num_parameters() + (cfg.hidden_size + 1) * static_cast<int64_t>(names.size()),
                             train.size(), valid.size(), names.size()));
    // The held-out accuracy (PEFT's memory lines for each evaluation).
    auto evaluate = [&](const std::string& what) {
      const zeal::Metrics m = trainer.evaluate();
      const double acc = m.at("eval_accuracy");
      engine.print(fmt::format("{}: held-out accuracy {:.4f}", what, acc));
      return acc;
    };
    const double accuracy = evaluate("the best model");
    const zeal::MemoryReport mem = engine.memory();
    engine.print("zeal: per-rank memory: ", mem.summary());
    engine.print(fmt::format("zeal: frozen weights {:.1f} MB hold no gradient and no optimizer state: gradients {:.3f} MB, "
                             "fp32 master {:.3f} MB, optimizer states {:.3f} MB per rank (for the {} trainable parameters)",
                             static_cast<double>(mem.frozen_params) / 1e6, static_cast<double>(mem.grads) / 1e6,
                             static_cast<double>(mem.master) / 1e6, static_cast<double>(mem.optimizer_states) / 1e6,
                             engine.num_trainable_parameters()));
    if (!head_only) {
      const std::string adapter = out_dir + "/adapter", merged = out_dir + "/merged";
      peft.save_pretrained(adapter, &engine);
      if (engine.is_main_process()) {
        engine.print(fmt::format("zeal: adapter saved: {} ({} bytes) and adapter_config.json", adapter + "/adapter_model.safetensors",
                                 fs::file_size(adapter + "/adapter_model.safetensors")));
      }
      peft.load_adapter(adapter, &engine);
      const double reloaded = evaluate("adapter reloaded");
      peft.merge_and_unload(&engine);
      const double after_merge = evaluate("merged");
      const int64_t bytes = peft.save_merged(merged, &engine);
      engine.print(fmt::format("zeal: merged model saved: {}/model.safetensors ({} bytes)", merged, bytes));
      if (reloaded != accuracy || std::abs(after_merge - accuracy) > 0.01) {
        throw zeal::Error(fmt::format("the accuracy changed: trained {:.4f}, reloaded {:.4f}, merged {:.4f}", accuracy, reloaded,
                                      after_merge));
      }
    }
    engine.print(fmt::format("accuracy: {:.4f}", accuracy));
  } catch (const std::exception& e) {
    return zeal_examples::report_failure("finetune_lora", e);
  }
  return zeal_examples::finish("finetune_lora");
}
