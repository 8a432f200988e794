// The zeal side of the cross-checks against Python transformers, tokenizers and peft on
// all-MiniLM-L6-v2 (tests/peft/minilm_check.py drives it):
//   minilm_check embed MODEL_DIR SENTENCES OUT.json    token ids and sentence embeddings
//   minilm_check train MODEL_DIR SENTENCES OUT_DIR     (under zeal launch, any stage): LoRA on
//       query/value + the classifier as a module to save, 20 AdamW steps on fixed batches; writes
//       OUT_DIR/initial (the adapter before training), OUT_DIR/final, result.json (losses, logits,
//       and the logits under disable_adapter()), OUT_DIR/export and OUT_DIR/export_merged
//       (engine.save_model, without and with `merged`) and OUT_DIR/base
//       (save_merged before merging: the base model, the classifier's original values)
//   minilm_check eval MODEL_DIR SENTENCES ADAPTER OUT.json   logits with an adapter Python saved
//   minilm_check export MODEL_DIR SENTENCES OUT_DIR    (under zeal launch): two full fine-tuning
//       steps, then engine.save_model into OUT_DIR/export; logits in result.json
#include <ATen/ATen.h>
#include <torch/optim/adamw.h>

#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/config/config.h"
#include "engine/engine.h"
#include "engine/error.h"
#include "engine/peft/lora.h"
#include "examples/models/bert.h"
#include "examples/models/wordpiece.h"

using json = nlohmann::json;
using namespace zeal::models;

namespace {

constexpr int64_t kSeq = 24, kLabels = 3, kSteps = 20, kBatch = 8;

std::vector<std::string> read_lines(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw zeal::Error("cannot read " + path);
  std::vector<std::string> out;
  for (std::string l; std::getline(in, l);)
    if (!l.empty()) out.push_back(l);
  return out;
}

struct Batch {
  at::Tensor ids, mask;
};
Batch encode(const zeal::text::WordPieceTokenizer& tok, const std::vector<std::string>& s, size_t begin, size_t n) {
  std::vector<int64_t> ids, mask;
  for (size_t i = begin; i < begin + n; ++i) {
    auto e = tok.encode(s[i % s.size()], kSeq, kSeq);
    ids.insert(ids.end(), e.ids.begin(), e.ids.end());
    mask.insert(mask.end(), e.attention_mask.begin(), e.attention_mask.end());
  }
  const int64_t rows = static_cast<int64_t>(n);
  return {at::tensor(ids, at::kLong).view({rows, kSeq}), at::tensor(mask, at::kLong).view({rows, kSeq})};
}

BertConfig no_dropout(const std::string& dir) {
  BertConfig c = BertConfig::from_file(dir + "/config.json");
  c.hidden_dropout_prob = c.attention_probs_dropout_prob = 0;
  return c;
}

zeal::peft::LoraConfig lora() {
  zeal::peft::LoraConfig lc;
  lc.r = 4;
  lc.lora_alpha = 8;
  lc.target_modules = {"query", "value"};
  lc.modules_to_save = {"classifier"};
  lc.init_lora_weights = "gaussian";  // B zero as PEFT; A normal so the two runs share it via the file
  lc.task_type = "SEQ_CLS";
  return lc;
}

at::Tensor labels_for(size_t begin, size_t n) {
  std::vector<int64_t> l;
  for (size_t i = begin; i < begin + n; ++i) l.push_back(static_cast<int64_t>((i * 7 + i / 3) % kLabels));
  return at::tensor(l, at::kLong);
}

json to_json(const at::Tensor& t) {
  at::Tensor c = t.to(at::kDouble).contiguous();
  std::vector<double> v(c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
  return {{"shape", c.sizes().vec()}, {"values", v}};
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::cerr << "usage: minilm_check embed|train|eval MODEL_DIR SENTENCES OUT [ADAPTER OUT]\n";
    return 2;
  }
  const std::string mode = argv[1], dir = argv[2];
  try {
    const auto sentences = read_lines(argv[3]);
    const auto tok = zeal::text::WordPieceTokenizer::from_file(dir + "/tokenizer.json");
    if (mode == "embed") {
      BertModel model(no_dropout(dir));
      zeal::load_pretrained(model, dir, {.strict = true});
      model->eval();
      c10::NoGradGuard ng;
      json out;
      out["ids"] = json::array();
      for (const auto& s : sentences) out["ids"].push_back(tok.encode(s, 128).ids);
      const Batch b = encode(tok, sentences, 0, std::min<size_t>(sentences.size(), 32));
      const auto o = model->forward(b.ids, b.mask);
      out["hidden"] = to_json(o.last_hidden_state);
      out["embeddings"] = to_json(BertModelImpl::mean_pool(o.last_hidden_state, b.mask));
      std::ofstream(argv[4]) << out.dump();
      return 0;
    }
    if (mode == "eval") {
      if (argc < 6) throw zeal::Error("eval needs ADAPTER and OUT");
      BertForSequenceClassification model(no_dropout(dir), kLabels);
      zeal::load_pretrained(model, dir, {.quiet = true});
      auto peft = zeal::peft::from_pretrained(model.ptr(), argv[4]);
      c10::NoGradGuard ng;
      const Batch b = encode(tok, sentences, 0, kBatch);
      std::ofstream(argv[5]) << json{{"logits", to_json(model->forward(b.ids, b.mask))}}.dump();
      return 0;
    }
    if (mode == "export") {
      // Full fine-tuning, two steps, then engine.save_model: what transformers loads.
      zeal::Engine engine(zeal::Config::from_env_or_file(argc, argv));
      const std::string out = argv[4];
      at::manual_seed(0);
      auto model = engine.init<BertForSequenceClassification>(no_dropout(dir), kLabels);
      zeal::load_pretrained(model, dir, {.quiet = true});
      torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-4));
      auto [m, o] = engine.prepare(model, opt);
      const int64_t world = engine.num_processes(), rank = engine.process_index(), per = kBatch / world;
      for (int64_t s = 0; s < 2; ++s) {
        const size_t begin = static_cast<size_t>(s * kBatch + rank * per);
        const Batch b = encode(tok, sentences, begin, per);
        engine.backward(at::cross_entropy_loss(m->forward(b.ids, b.mask), labels_for(begin, per)));
        o.step();
        o.zero_grad();
      }
      engine.save_model(out + "/export");
      at::Tensor logits;
      {
        c10::NoGradGuard ng;
        const Batch b = encode(tok, sentences, 0, kBatch);
        logits = m->forward(b.ids, b.mask);
      }
      if (engine.is_main_process()) std::ofstream(out + "/result.json") << json{{"logits", to_json(logits)}}.dump();
      engine.wait_for_everyone();
      return 0;
    }
    if (mode != "train") throw zeal::Error("unknown mode " + mode);
    zeal::Engine engine(zeal::Config::from_env_or_file(argc, argv));
    const std::string out = argv[4];
    at::manual_seed(0);
    auto model = engine.init<BertForSequenceClassification>(no_dropout(dir), kLabels);
    zeal::load_pretrained(model, dir, {.quiet = true});
    auto peft = zeal::peft::get_peft_model(model, lora());
    peft.save_pretrained(out + "/initial");  // before prepare: whole everywhere, written by rank 0
    torch::optim::AdamW opt(peft.trainable_parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
    auto [m, o] = engine.prepare(model, opt);
    const int64_t world = engine.num_processes(), rank = engine.process_index(), per = kBatch / world;
    if (kBatch % world) throw zeal::Error("the batch of 8 must divide among the ranks");
    std::vector<double> losses;
    for (int64_t s = 0; s < kSteps; ++s) {
      const size_t begin = static_cast<size_t>((s % 2) * kBatch + rank * per);  // two batches, in turn: learnable
      const Batch b = encode(tok, sentences, begin, per);
      at::Tensor loss = at::cross_entropy_loss(m->forward(b.ids, b.mask), labels_for(begin, per));
      engine.backward(loss);
      o.step();
      o.zero_grad();
      losses.push_back(engine.reduce(loss.detach(), "mean").item<double>());
    }
    peft.save_pretrained(out + "/final", &engine);
    engine.save_model(out + "/export");  // the base model's names, no adapter tensors
    engine.save_model(out + "/export_merged", {.merged = true});  // the adapters merged into the weights
    peft.save_merged(out + "/base", &engine);  // the base model: the classifier as it was before training
    at::Tensor logits, disabled;
    {
      c10::NoGradGuard ng;
      const Batch b = encode(tok, sentences, 0, kBatch);
      logits = m->forward(b.ids, b.mask);
      auto off = peft.disable_adapter();  // no adapters, the classifier's original values
      disabled = m->forward(b.ids, b.mask);
    }
    at::Tensor again;  // the trained classifier back after the scope
    {
      c10::NoGradGuard ng;
      const Batch b = encode(tok, sentences, 0, kBatch);
      again = m->forward(b.ids, b.mask);
    }
    if (!at::equal(again, logits)) throw zeal::Error("the logits after disable_adapter()'s scope differ from before it");
    if (engine.is_main_process()) {
      std::ofstream(out + "/result.json")
          << json{{"losses", losses}, {"logits", to_json(logits)}, {"disabled_logits", to_json(disabled)}}.dump();
    }
    engine.wait_for_everyone();
  } catch (const std::exception& e) {
    std::cerr << "minilm_check: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
