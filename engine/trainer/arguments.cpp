#include "engine/trainer/arguments.h"

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include <charconv>
#include <cmath>
#include <functional>
#include <limits>
#include <sstream>
#include <system_error>

#include "engine/error.h"

namespace zeal {
namespace {

using Args = TrainingArguments;

// One argument: its name, type, help, and how it is read from text and written back.
struct Field {
  const char* name;
  const char* type;
  const char* help;
  std::function<void(Args&, const std::string&)> set;  // throws std::invalid_argument with the reason
  std::function<std::string(const Args&)> get;
};

int64_t to_int(const std::string& s, int64_t lo, int64_t hi) {
  int64_t v = 0;
  const char* b = s.data() + (s.size() > 1 && s[0] == '+' ? 1 : 0);
  const auto [end, ec] = std::from_chars(b, s.data() + s.size(), v, 10);
  if (s.empty() || ec != std::errc() || end != s.data() + s.size()) {
    throw std::invalid_argument(fmt::format("must be a whole number, got '{}'", s));
  }
  if (v < lo || v > hi) {
    throw std::invalid_argument(hi == std::numeric_limits<int64_t>::max()
                                    ? fmt::format("must be at least {}, got {}", lo, s)
                                    : fmt::format("must be from {} to {}, got {}", lo, hi, s));
  }
  return v;
}

double to_real(const std::string& s, double lo, double hi) {
  double v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc() || end != s.data() + s.size() || !std::isfinite(v)) {
    throw std::invalid_argument(fmt::format("must be a finite number, got '{}'", s));
  }
  if (v < lo || v > hi) throw std::invalid_argument(fmt::format("must be from {} to {}, got {}", lo, hi, s));
  return v;
}

bool to_bool(const std::string& s) {
  if (s == "true" || s == "True" || s == "1" || s == "yes") return true;
  if (s == "false" || s == "False" || s == "0" || s == "no") return false;
  throw std::invalid_argument(fmt::format("must be true or false, got '{}'", s));
}

std::string one_of(const std::string& s, std::initializer_list<const char*> allowed) {
  std::string list;
  for (const char* a : allowed) {
    if (s == a) return s;
    list += fmt::format("{}{}", list.empty() ? "" : ", ", a);
  }
  throw std::invalid_argument(fmt::format("must be one of {}, got '{}'", list, s));
}

std::string real_text(double v) { return fmt::format("{}", v); }

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

#define ZEAL_INT(f, lo, help)                                                                   \
  Field {                                                                                      \
    #f, "int", help, [](Args& a, const std::string& s) { a.f = to_int(s, lo, kMax); },          \
        [](const Args& a) { return std::to_string(a.f); }                                      \
  }
#define ZEAL_OPT_INT(f, lo, help)                                                               \
  Field {                                                                                      \
    #f, "int", help, [](Args& a, const std::string& s) { a.f = to_int(s, lo, kMax); },          \
        [](const Args& a) { return a.f ? std::to_string(*a.f) : std::string(); }               \
  }
#define ZEAL_REAL(f, lo, hi, help)                                                              \
  Field {                                                                                      \
    #f, "float", help, [](Args& a, const std::string& s) { a.f = to_real(s, lo, hi); },         \
        [](const Args& a) { return real_text(a.f); }                                           \
  }
#define ZEAL_BOOL(f, help)                                                                      \
  Field {                                                                                      \
    #f, "bool", help, [](Args& a, const std::string& s) { a.f = to_bool(s); },                  \
        [](const Args& a) { return std::string(a.f ? "true" : "false"); }                      \
  }
#define ZEAL_TEXT(f, help)                                                                      \
  Field {                                                                                      \
    #f, "str", help, [](Args& a, const std::string& s) { a.f = s; }, [](const Args& a) { return a.f; } \
  }
#define ZEAL_CHOICE(f, help, ...)                                                               \
  Field {                                                                                      \
    #f, "str", help, [](Args& a, const std::string& s) { a.f = one_of(s, {__VA_ARGS__}); },     \
        [](const Args& a) { return a.f; }                                                      \
  }

const std::vector<Field>& fields() {
  static const std::vector<Field> f = {
      ZEAL_TEXT(output_dir, "where checkpoints go (output_dir/checkpoint-<step>)"),
      ZEAL_REAL(num_train_epochs, 0.0, 1e9, "epochs to train (max_steps > 0 overrides)"),
      Field{"max_steps", "int", "optimizer steps in all (-1: from num_train_epochs)",
            [](Args& a, const std::string& s) {
              a.max_steps = to_int(s, -1, kMax);
              if (a.max_steps == 0) throw std::invalid_argument("must be -1 (from the epochs) or at least 1, got 0");
            },
            [](const Args& a) { return std::to_string(a.max_steps); }},
      ZEAL_OPT_INT(per_device_train_batch_size, 1, "samples per rank per micro-step (default 8, or the config's)"),
      ZEAL_INT(per_device_eval_batch_size, 1, "samples per rank per evaluation batch"),
      ZEAL_OPT_INT(gradient_accumulation_steps, 1, "micro-steps per optimizer step (default 1, or the config's)"),
      ZEAL_REAL(learning_rate, 0.0, 1e9, "AdamW's peak learning rate"),
      ZEAL_REAL(weight_decay, 0.0, 1e9, "AdamW's decoupled weight decay (not on biases and norms)"),
      ZEAL_REAL(adam_beta1, 0.0, 1.0, "AdamW's beta1"),
      ZEAL_REAL(adam_beta2, 0.0, 1.0, "AdamW's beta2"),
      ZEAL_REAL(adam_epsilon, 0.0, 1.0, "AdamW's epsilon"),
      Field{"max_grad_norm", "float", "clip the gradients' global norm to this (default 1.0, or the config's; 0: off)",
            [](Args& a, const std::string& s) { a.max_grad_norm = to_real(s, 0.0, 1e300); },
            [](const Args& a) { return a.max_grad_norm ? real_text(*a.max_grad_norm) : std::string(); }},
      ZEAL_CHOICE(lr_scheduler_type, "the learning-rate schedule", "linear", "cosine", "polynomial", "constant",
                  "constant_with_warmup"),
      ZEAL_INT(warmup_steps, 0, "warm-up optimizer steps (wins over warmup_ratio)"),
      ZEAL_REAL(warmup_ratio, 0.0, 1.0, "warm-up as a fraction of the optimizer steps"),
      ZEAL_CHOICE(logging_strategy, "when to log", "no", "steps", "epoch"),
      ZEAL_INT(logging_steps, 1, "optimizer steps between logs"),
      ZEAL_BOOL(logging_first_step, "log the first step too"),
      ZEAL_CHOICE(eval_strategy, "when to evaluate", "no", "steps", "epoch"),
      ZEAL_INT(eval_steps, 0, "optimizer steps between evaluations (0: logging_steps)"),
      ZEAL_CHOICE(save_strategy, "when to save a checkpoint", "no", "steps", "epoch"),
      ZEAL_INT(save_steps, 1, "optimizer steps between checkpoints"),
      ZEAL_INT(save_total_limit, 0, "keep at most this many checkpoints, the best included (0: all)"),
      ZEAL_BOOL(load_best_model_at_end, "load the checkpoint with the best metric when training ends"),
      ZEAL_TEXT(metric_for_best_model, "the metric that picks the best checkpoint (default loss)"),
      Field{"greater_is_better", "bool", "whether a larger metric is better (default: false for a loss)",
            [](Args& a, const std::string& s) {
              if (s.empty() || s == "null" || s == "None") {
                a.greater_is_better.reset();
              } else {
                a.greater_is_better = to_bool(s);
              }
            },
            [](const Args& a) { return a.greater_is_better ? std::string(*a.greater_is_better ? "true" : "false") : ""; }},
      Field{"seed", "int", "the data order's and at::manual_seed's seed",
            [](Args& a, const std::string& s) { a.seed = static_cast<uint64_t>(to_int(s, 0, kMax)); },
            [](const Args& a) { return std::to_string(a.seed); }},
      ZEAL_TEXT(resume_from_checkpoint, "a checkpoint directory, latest (output_dir's newest) or auto"),
      Field{"report_to", "list", "trackers: tensorboard, csv, jsonl, all or none (comma-separated)",
            [](Args& a, const std::string& s) {
              a.report_to.clear();
              std::stringstream ss(s);
              for (std::string t; std::getline(ss, t, ',');) {
                while (!t.empty() && t.front() == ' ') t.erase(0, 1);
                while (!t.empty() && t.back() == ' ') t.pop_back();
                if (!t.empty()) a.report_to.push_back(t);
              }
            },
            [](const Args& a) {
              std::string out;
              for (const auto& t : a.report_to) out += (out.empty() ? "" : ",") + t;
              return out;
            }},
      ZEAL_TEXT(logging_dir, "the trackers' folder (default: the config's logging_dir)"),
      ZEAL_TEXT(run_name, "the trackers' project name (default trainer)"),
      ZEAL_BOOL(disable_tqdm, "no progress bar"),
      ZEAL_BOOL(dataloader_drop_last, "drop the last incomplete batch"),
      ZEAL_INT(dataloader_num_workers, 0, "threads preparing batches while the step runs (0: in the loop)"),
      ZEAL_INT(dataloader_prefetch_factor, 1, "batches prepared ahead per worker"),
      ZEAL_INT(early_stopping_patience, 0, "stop after this many evaluations without improvement (0: never)"),
      ZEAL_REAL(early_stopping_threshold, 0.0, 1e300, "the improvement that counts"),
  };
  return f;
}

const Field* find(const std::string& name) {
  for (const auto& f : fields())
    if (name == f.name) return &f;
  return nullptr;
}

std::string suggest(const std::string& name) {
  // The closest known name by edit distance, when it is close.
  auto distance = [](const std::string& a, const std::string& b) {
    std::vector<size_t> row(b.size() + 1);
    for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
    for (size_t i = 1; i <= a.size(); ++i) {
      size_t prev = row[0]++;
      for (size_t j = 1; j <= b.size(); ++j) {
        const size_t cur = row[j];
        row[j] = std::min({row[j] + 1, row[j - 1] + 1, prev + (a[i - 1] == b[j - 1] ? 0 : 1)});
        prev = cur;
      }
    }
    return row[b.size()];
  };
  const Field* best = nullptr;
  size_t d = 4;
  for (const auto& f : fields()) {
    const size_t k = distance(name, f.name);
    if (k < d) d = k, best = &f;
  }
  return best ? fmt::format(" (did you mean {}?)", best->name) : "";
}

}  // namespace

std::string TrainingArguments::best_metric_key() const {
  const std::string m = metric_for_best_model.empty() ? "loss" : metric_for_best_model;
  return m.rfind("eval_", 0) == 0 ? m : "eval_" + m;
}

bool TrainingArguments::best_is_greater() const {
  if (greater_is_better) return *greater_is_better;
  const std::string k = best_metric_key();
  return !(k.size() >= 4 && k.compare(k.size() - 4, 4, "loss") == 0);  // Hugging Face's: ends with "loss"
}

void TrainingArguments::set(const std::string& name, const std::string& value, const std::string& where) {
  const Field* f = find(name);
  if (!f) throw Error(fmt::format("{}: unknown training argument {}{}", where, name, suggest(name)));
  try {
    f->set(*this, value);
  } catch (const std::invalid_argument& e) {
    throw Error(fmt::format("{}: {} {}", where, name, e.what()));
  }
}

void TrainingArguments::validate() const {
  std::vector<std::string> problems;
  if (max_steps <= 0 && num_train_epochs <= 0) {
    problems.push_back("num_train_epochs must be above 0 when max_steps is not set");
  }
  if (load_best_model_at_end) {
    if (eval_strategy == "no") problems.push_back("load_best_model_at_end needs evaluations: set eval_strategy to steps or epoch");
    if (save_strategy != eval_strategy) {
      problems.push_back(fmt::format("load_best_model_at_end needs save_strategy equal to eval_strategy, got {} and {}",
                                     save_strategy, eval_strategy));
    } else if (save_strategy == "steps") {
      const int64_t e = eval_steps > 0 ? eval_steps : logging_steps;
      if (save_steps % e != 0) {
        problems.push_back(fmt::format("load_best_model_at_end needs save_steps ({}) to be a multiple of eval_steps ({})",
                                       save_steps, e));
      }
    }
  }
  if (early_stopping_patience > 0 && eval_strategy == "no") {
    problems.push_back("early_stopping_patience needs evaluations: set eval_strategy to steps or epoch");
  }
  for (const auto& t : report_to) {
    if (t != "tensorboard" && t != "csv" && t != "jsonl" && t != "all" && t != "none" && t != "wandb" &&
        t != "comet_ml" && t != "mlflow" && t != "aim" && t != "clearml" && t != "dvclive") {
      problems.push_back(fmt::format("report_to: unknown tracker '{}' (tensorboard, csv, jsonl, all or none)", t));
    }
  }
  if (!problems.empty()) throw ConfigError(problems);
}

TrainingArguments TrainingArguments::from_file(const std::string& path) { return from_file(path, TrainingArguments{}); }

TrainingArguments TrainingArguments::from_file(const std::string& path, const TrainingArguments& defaults) {
  YAML::Node root;
  try {
    root = YAML::LoadFile(path);
  } catch (const YAML::BadFile&) {
    throw Error(fmt::format("training arguments: cannot read {}", path));
  } catch (const YAML::Exception& e) {
    throw Error(fmt::format("training arguments: {} is not YAML or JSON: {}", path, e.what()));
  }
  TrainingArguments a = defaults;
  if (root.IsNull()) return a;
  if (!root.IsMap()) throw Error(fmt::format("training arguments: {} must hold name: value pairs", path));
  std::vector<std::string> problems;
  for (const auto& kv : root) {
    const std::string name = kv.first.as<std::string>();
    const std::string where = fmt::format("{}:{}", path, kv.first.Mark().line + 1);
    try {
      std::string text;
      if (kv.second.IsSequence()) {
        for (const auto& x : kv.second) text += (text.empty() ? "" : ",") + x.as<std::string>();
      } else if (kv.second.IsScalar()) {
        text = kv.second.as<std::string>();
      } else if (!kv.second.IsNull()) {
        throw Error(fmt::format("{}: {} must be a value", where, name));
      }
      a.set(name, text, where);
    } catch (const Error& e) {
      problems.push_back(e.what());
    }
  }
  if (!problems.empty()) throw ConfigError(problems);
  a.validate();
  return a;
}

TrainingArguments TrainingArguments::parse(int argc, const char* const* argv, std::vector<std::string>* rest,
                                           const TrainingArguments& defaults) {
  // The file first (wherever --training_args stands) over the program's defaults, then the flags.
  TrainingArguments a = defaults;
  std::string file;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    std::string f;
    if (s == "--training_args") {
      if (i + 1 >= argc) throw Error("--training_args needs a file");
      f = argv[i + 1];
    } else if (s.rfind("--training_args=", 0) == 0) {
      f = s.substr(16);
    } else {
      continue;
    }
    if (!file.empty()) throw Error(fmt::format("--training_args is given twice ({} and {}): give one file", file, f));
    file = f;
  }
  if (!file.empty()) a = from_file(file, defaults);
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    if (s == "--training_args" || s.rfind("--training_args=", 0) == 0) {
      i += s == "--training_args" ? 1 : 0;
      continue;
    }
    const Field* f = nullptr;
    std::string name, value;
    bool has_value = false;
    if (s.rfind("--", 0) == 0) {
      const size_t eq = s.find('=');
      name = s.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
      f = find(name);
      if (eq != std::string::npos) value = s.substr(eq + 1), has_value = true;
    }
    if (!f) {
      if (rest) rest->push_back(s);
      continue;
    }
    if (!has_value) {
      const bool next_is_value = i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0;
      bool next_is_bool = false;
      if (next_is_value) {
        try {
          (void)to_bool(argv[i + 1]);
          next_is_bool = true;
        } catch (const std::invalid_argument&) {
        }
      }
      if (std::string(f->type) == "bool" && !next_is_bool) {
        value = "true";  // a bare boolean flag
      } else if (next_is_value) {
        value = argv[++i];
      } else if (std::string(f->type) == "str" || std::string(f->type) == "list") {
        value = "";  // an empty text (--resume_from_checkpoint "" ends the same)
      } else {
        throw Error(fmt::format("--{} needs a value", name));
      }
    }
    a.set(name, value, "--" + name);
  }
  a.validate();
  return a;
}

TrainingArguments TrainingArguments::parse(int argc, const char* const* argv, std::vector<std::string>* rest) {
  return parse(argc, argv, rest, TrainingArguments{});
}

std::string TrainingArguments::help() {
  std::string out = "Training arguments (Hugging Face's names; --training_args FILE reads them from YAML or JSON):\n";
  const TrainingArguments defaults;
  for (const auto& f : fields()) {
    const std::string d = f.get(defaults);
    out += fmt::format("  --{:<30} {:<6} {}{}\n", f.name, f.type, f.help, d.empty() ? "" : fmt::format(" [{}]", d));
  }
  return out;
}

std::map<std::string, std::string> TrainingArguments::to_map() const {
  std::map<std::string, std::string> m;
  for (const auto& f : fields()) m[f.name] = f.get(*this);
  return m;
}

}  // namespace zeal
