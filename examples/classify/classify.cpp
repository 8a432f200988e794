// Text classification with zeal's Trainer: a small transformer encoder learns the sentiment of
// generated hotel reviews. The C++ counterpart of the Accelerate walkthrough's Trainer version:
// evaluation and a checkpoint every epoch, the best checkpoint loaded at the end, the accuracy
// from compute_metrics on the gathered predictions. Every Hugging Face training argument is a flag
// (--eval_strategy steps, --early_stopping_patience 2, --report_to tensorboard, …; see --help).
//
//   zeal launch --num_processes 2 build/bin/classify --config_file configs/zero2.yaml --output_dir /tmp/classify
//
// The last line printed is "accuracy: <fraction>" on the held-out reviews, by the best model.
#include <torch/data/datasets/base.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/modules/transformercoder.h>
#include <torch/nn/modules/transformerlayer.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <iostream>

#include "engine/engine.h"
#include "engine/error.h"
#include "engine/trainer/trainer.h"
#include "examples/common/classification.h"
#include "examples/common/flags.h"
#include "examples/classify/reviews.h"

namespace {

constexpr int64_t kLength = 20;  // [CLS] + up to 19 words

// Reviews as (token ids, label) examples.
class ReviewDataset : public torch::data::datasets::Dataset<ReviewDataset> {
 public:
  ReviewDataset(const std::vector<classify::Review>& reviews, const classify::Vocabulary& vocab) {
    for (const auto& r : reviews) {
      ids_.push_back(at::tensor(vocab.encode(r.text, kLength), at::kLong));
      labels_.push_back(r.label);
    }
  }
  torch::data::Example<> get(size_t i) override { return {ids_[i], at::scalar_tensor(labels_[i], at::kLong)}; }
  std::optional<size_t> size() const override { return ids_.size(); }

 private:
  std::vector<at::Tensor> ids_;
  std::vector<int64_t> labels_;
};

// Token and position embeddings, a transformer encoder, and a linear head on the [CLS] position.
struct ClassifierImpl : torch::nn::Module {
  ClassifierImpl(int64_t vocab, int64_t dim, int64_t layers)
      : tokens(register_module("tokens", torch::nn::Embedding(vocab, dim))),
        positions(register_module("positions", torch::nn::Embedding(kLength, dim))),
        encoder(register_module(
            "encoder", torch::nn::TransformerEncoder(torch::nn::TransformerEncoderOptions(
                           torch::nn::TransformerEncoderLayerOptions(dim, 4).dim_feedforward(2 * dim).dropout(0.0),
                           layers)))),
        norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})))),
        head(register_module("head", torch::nn::Linear(dim, 2))) {}

  at::Tensor forward(const at::Tensor& ids) {
    at::Tensor x = tokens(ids) + positions(at::arange(ids.size(1), ids.options()));
    x = encoder(x.transpose(0, 1), /*src_mask=*/at::Tensor(), /*src_key_padding_mask=*/ids.eq(0));
    return head(norm(x[0]));
  }

  torch::nn::Embedding tokens, positions;
  torch::nn::TransformerEncoder encoder;
  torch::nn::LayerNorm norm;
  torch::nn::Linear head;
};
TORCH_MODULE(Classifier);

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Sentiment classification of generated hotel reviews, trained with zeal's Trainer"};
  app.allow_extras();  // the training arguments, --config_file and the config override flags
  int64_t train_size = 4000, valid_size = 500, batch = 32, dim = 64, layers = 2;
  double epochs = 3, lr = 1e-3;
  using zeal_examples::at_least_one;
  app.add_option("--train_size", train_size, "training reviews")
      ->capture_default_str()
      ->check(zeal_examples::integer_in(1, 10'000'000));
  app.add_option("--valid_size", valid_size, "held-out reviews")
      ->capture_default_str()
      ->check(zeal_examples::integer_in(1, 10'000'000));
  app.add_option("--batch_size", batch, "reviews per rank per step (per_device_train_batch_size)")
      ->capture_default_str()
      ->check(at_least_one());
  app.add_option("--epochs", epochs, "num_train_epochs")->capture_default_str()->check(zeal_examples::positive_finite());
  app.add_option("--lr", lr, "learning_rate")->capture_default_str()->check(zeal_examples::positive_finite());
  app.add_option("--dim", dim, "model width, a multiple of the 4 attention heads")
      ->capture_default_str()
      ->check(zeal_examples::integer_in(4, 1 << 16) & CLI::Validator(
                                                          [](std::string& s) -> std::string {
                                                            return std::stoll(s) % 4 == 0 ? "" : "must be a multiple of 4 (the attention heads), got " + s;
                                                          },
                                                          "MULTIPLE OF 4"));
  app.add_option("--layers", layers, "encoder layers")->capture_default_str()->check(at_least_one());
  int64_t log_every = 20;
  app.add_option("--log_every", log_every, "logging_steps")->capture_default_str()->check(at_least_one());
  // This program's defaults for the training arguments; their flags override them.
  zeal::TrainingArguments args;
  args.output_dir = "classify_out";
  args.num_train_epochs = epochs;
  args.learning_rate = lr;
  args.lr_scheduler_type = "constant";
  args.logging_steps = log_every;
  args.eval_strategy = "epoch";
  args.save_strategy = "epoch";
  args.load_best_model_at_end = true;
  args.metric_for_best_model = "accuracy";
  args.weight_decay = 0.01;
  args.save_total_limit = 2;
  args.run_name = "classify";
  // The evaluation batch: twice the training batch unless --per_device_eval_batch_size says otherwise.
  auto eval_batch = [&](zeal::TrainingArguments& a) { a.per_device_eval_batch_size = 2 * batch; };
  if (auto code = zeal_examples::parse_trainer_flags(app, argc, argv, "classify", args, eval_batch)) return *code;
  // The program's short names, where given, over everything else.
  auto given = [&](const char* flag) { return app.count(flag) > 0; };
  if (given("--epochs")) args.num_train_epochs = epochs;
  if (given("--lr")) args.learning_rate = lr;
  if (given("--log_every")) args.logging_steps = log_every;
  std::optional<zeal::Config> config = zeal_examples::load_config(argc, argv, "classify");
  if (!config) return 2;
  // --batch_size unless the training arguments or the config say otherwise.
  if (given("--batch_size") || (!args.per_device_train_batch_size && config->train_micro_batch_size_per_gpu.value <= 0)) {
    args.per_device_train_batch_size = batch;
  }
  try {
    zeal::Engine engine(std::move(*config));

    // The same data on every rank (fixed seeds); the Trainer gives each rank its part.
    classify::Vocabulary vocab;
    auto reviews = classify::generate_reviews(train_size + valid_size, args.seed);
    std::vector<classify::Review> train(reviews.begin(), reviews.begin() + train_size);
    std::vector<classify::Review> valid(reviews.begin() + train_size, reviews.end());

    at::manual_seed(args.seed);
    Classifier model(vocab.size(), dim, layers);
    zeal::Trainer trainer(engine, model, args, ReviewDataset(train, vocab), ReviewDataset(valid, vocab),
                          [&](const torch::data::Example<>& b) {
                            return zeal_examples::classification_step(model->forward(b.data), b.target);
                          });
    trainer.compute_metrics = zeal_examples::accuracy;
    trainer.train();
    const zeal::Metrics metrics = trainer.evaluate();  // the best model's, after load_best_model_at_end
    engine.print(fmt::format("accuracy: {:.4f}", metrics.at("eval_accuracy")));
  } catch (const std::exception& e) {
    return zeal_examples::report_failure("classify", e);
  }
  return zeal_examples::finish("classify");
}
