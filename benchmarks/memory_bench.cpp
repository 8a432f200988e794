// memory_bench: what each rank holds at its peak, measured, against the ZeRO stage table
// (docs/concepts.md, model states only) and against `zeal estimate-memory`'s prediction of the peak.
// Each configuration is a real run: `zeal launch --verbose` of build/bin/train_gpt (--model, 2 ranks by
// default, fp32, configs/zero3.yaml's settings with --zero_stage and the offload flags), a few steps.
//
//   build/bin/memory_bench [--model gpt2-medium] [--world 2] [--steps 2] [--seq_len 128]
//       [--micro_batch 1] [--stages 0,1,2,3] [--offload none,cpu,nvme] [--activation_checkpointing off,on]
//       [--chunked_loss true|false] [--max_in_cpu N] [--untied_head] [--nvme_path DIR]
//       [--json PATH] [--markdown PATH] [--png PATH]
//   build/bin/memory_bench --rows benchmarks/estimator/heldout_rows.json [--json PATH] [--markdown PATH]
//
// Without --rows every stage × offload × checkpointing choice runs; with --rows each row of the file
// runs with its own settings (model, world, stage, offload, seq_len, micro_batch,
// activation_checkpointing, chunked_loss, max_in_cpu, untied_head; program lora_bench: lora_bench's
// zeal LoRA row at that stage). Measured per configuration: the train phase's peak resident set on
// rank 0 (the memory report's "CPU Total Peak Memory consumed during the train (max)", from the
// kernel's high-water mark), every rank's peak over its whole life as the launcher's wait4 saw it
// (construction and prepare included), the most over ranks, and the median step time after the
// first. The estimator's error is taken against the train phase's peak; the summary gives the median
// and largest |error| over the rows. The PNG (gnuplot, when installed) shows the three per row.
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "benchmarks/free_port.h"
#include "engine/estimate.h"
#include "engine/memory.h"
#include "engine/memory_tracker.h"
#include "examples/models/gpt_config.h"
#include "engine/output.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::string run_capture(const std::string& cmd, int* status) {
  FILE* f = popen((cmd + " 2>&1").c_str(), "r");
  if (!f) {
    *status = -1;
    return "";
  }
  std::string out;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), f)) > 0) out.append(buf.data(), n);
  *status = pclose(f);
  return out;
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string x;
  while (std::getline(ss, x, ',')) out.push_back(x);
  return out;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

// One configuration to run and predict.
struct Spec {
  std::string name, program = "train_gpt", model = "gpt2-medium", offload = "none";
  int world = 2, stage = 3, steps = 2;
  int64_t seq_len = 128, micro_batch = 1, max_in_cpu = -1;
  bool checkpointing = false, chunked_loss = true, untied = false;
  std::string describe() const {
    return fmt::format("{}{}, {} ranks, stage {}, offload {}, {} x {} tokens{}{}{}", model, untied ? " (untied head)" : "",
                       world, stage, offload, micro_batch, seq_len, checkpointing ? ", checkpointed" : "",
                       chunked_loss ? "" : ", plain loss", max_in_cpu >= 0 ? fmt::format(", max_in_cpu {}", max_in_cpu) : "");
  }
};

struct Row {
  Spec spec;
  bool ok = false;
  std::string why;
  double train_peak = 0, life_peak = 0, table = 0, predicted = 0, predicted_disk = 0, step_s = 0;
  double error() const { return predicted / train_peak - 1; }
};

struct Paths {
  std::string bin, zeal_cli, train_gpt, lora_bench, nvme_path, work;
};

// The trainable elements of lora_bench's LoRA (r on query and value of every layer, the head whole)
// for the BERT config.json in `dir`.
int64_t lora_trainable(const std::string& dir, int64_t r, int64_t labels) {
  json c;
  std::ifstream(dir + "/config.json") >> c;
  const int64_t h = c["hidden_size"], layers = c["num_hidden_layers"];
  return layers * 2 * (2 * r * h) + h * labels + labels;
}

std::string minilm_dir() {
  const char* models = std::getenv("ZEAL_MODELS");
  const char* home = std::getenv("HOME");
  return std::string(models ? models : std::string(home ? home : "") + "/.cache/zeal/models") + "/all-MiniLM-L6-v2";
}

// zeal estimate-memory's prediction for the spec (what users get), host peak and disk.
std::pair<double, double> predict(const Spec& s, const Paths& p, std::string* why) {
  const std::string out_json = p.work + "/estimate.json";
  std::string model_flags;
  if (s.program == "lora_bench") {
    model_flags = fmt::format("--hf_config '{}/config.json' --trainable_params {}", minilm_dir(),
                              lora_trainable(minilm_dir(), 8, 5));
  } else {
    model_flags = fmt::format("--model {}{} --chunked_loss {}", s.model, s.untied ? " --untied_head" : "",
                              s.chunked_loss ? "true" : "false");
  }
  int status = 0;
  const std::string out = run_capture(
      fmt::format("'{}' estimate-memory {} --num_processes {} --seq_len {} --micro_batch {} --stages {} --offload {} "
                  "--activation_checkpointing {}{} --json '{}'",
                  p.zeal_cli, model_flags, s.world, s.seq_len, s.micro_batch, s.stage, s.offload,
                  s.checkpointing ? "true" : "false",
                  s.max_in_cpu >= 0 ? fmt::format(" --max_in_cpu {}", s.max_in_cpu) : "", out_json),
      &status);
  if (status != 0) {
    *why = "zeal estimate-memory failed: " + out.substr(0, 300);
    return {0, 0};
  }
  json e;
  std::ifstream(out_json) >> e;
  for (const auto& row : e["zeal"])
    if (row["stage"] == s.stage && row["offload"] == s.offload)
      return {row["host_peak_bytes"].get<double>(), row["disk_bytes"].get<double>()};
  *why = "no such row in the estimate";
  return {0, 0};
}

void run_train_gpt(Row& r, const Paths& p, int port) {
  const Spec& s = r.spec;
  // The settings of configs/zero3.yaml, and max_in_cpu when the row sets it.
  const std::string config = p.work + "/config.yaml";
  {
    std::ofstream f(config);
    f << "distributed_type: DEEPSPEED\nnum_processes: " << s.world << "\nmixed_precision: 'no'\n"
      << "deepspeed_config:\n  zero_stage: " << s.stage
      << "\n  zero3_init_flag: true\n  gradient_accumulation_steps: 1\n  gradient_clipping: 1.0\n"
      << "zero_optimization:\n  stage3_prefetch_bucket_size: 5e7\n  stage3_param_persistence_threshold: 1e5\n"
      << "  stage3_max_live_parameters: 1e9\n  stage3_max_reuse_distance: 1e9\n";
    if (s.max_in_cpu >= 0) f << "  offload_param:\n    max_in_cpu: " << s.max_in_cpu << "\n";
  }
  std::string flags = fmt::format("--zero_stage {} --activation_checkpointing {}", s.stage, s.checkpointing ? "true" : "false");
  if (s.offload == "cpu") {
    flags += " --offload_optimizer_device cpu";
    if (s.stage == 3) flags += " --offload_param_device cpu";
  } else if (s.offload == "nvme") {
    flags += fmt::format(" --offload_optimizer_device nvme --offload_param_device nvme --offload_optimizer_nvme_path '{}' "
                         "--offload_param_nvme_path '{}'",
                         p.nvme_path, p.nvme_path);
  }
  const std::string log = p.work + "/steps.jsonl";
  fs::remove(log);
  const std::string cmd = fmt::format(
      "'{}' launch --verbose --num_processes {} --main_process_port {} --config_file '{}' {} '{}' --model {}{} "
      "--chunked_loss {} --steps {} --seq_len {} --micro_batch {} --log_every {} --log_jsonl '{}'",
      p.zeal_cli, s.world, port, config, flags, p.train_gpt, s.model, s.untied ? " --untied_head" : "",
      s.chunked_loss ? "true" : "false", s.steps, s.seq_len, s.micro_batch, s.steps, log);
  int status = 0;
  const std::string out = run_capture(cmd, &status);
  static const std::regex total_re(R"(\[rank 0\] CPU Total Peak Memory consumed during the train \(max\): (\d+))");
  static const std::regex life_re(R"(rank (\d+) ([0-9.]+) GiB)");
  std::smatch m;
  if (status == 0 && std::regex_search(out, m, total_re)) {
    r.ok = true;
    r.train_peak = std::stod(m[1]) * (1 << 20);
    const size_t at = out.rfind("peak resident set per rank");
    const std::string tail = out.substr(at == std::string::npos ? 0 : at);
    for (auto it = std::sregex_iterator(tail.begin(), tail.end(), life_re); it != std::sregex_iterator(); ++it) {
      r.life_peak = std::max(r.life_peak, std::stod((*it)[2]) * (1 << 30));
    }
    std::vector<double> steps;
    std::ifstream f(log);
    for (std::string line; std::getline(f, line);) {
      const json j = json::parse(line, nullptr, false);
      if (j.is_object() && j.contains("step_s") && j.value("step", 0) > 0) steps.push_back(j["step_s"].get<double>());
    }
    r.step_s = median(steps);
  } else {
    const size_t at = out.find("error");
    r.why = at == std::string::npos ? out.substr(out.size() > 300 ? out.size() - 300 : 0) : out.substr(at, 300);
  }
}

// lora_bench's zeal LoRA row: the peak resident set of its ranks, whole (not above a baseline).
void run_lora_bench(Row& r, const Paths& p) {
  const Spec& s = r.spec;
  const std::string out_json = p.work + "/lora.json";
  int status = 0;
  const std::string out = run_capture(
      fmt::format("'{}' --world {} --stages {} --steps {} --rounds 1 --seq_len {} --micro_batch {} --no-peers --json '{}'",
                  p.lora_bench, s.world, s.stage, s.steps + 1, s.seq_len, s.micro_batch, out_json),
      &status);
  if (status != 0) {
    r.why = "lora_bench failed: " + out.substr(out.size() > 300 ? out.size() - 300 : 0);
    return;
  }
  json j;
  std::ifstream(out_json) >> j;
  for (const auto& row : j["rows"]) {
    if (row["name"] == fmt::format("zeal stage {}, LoRA", s.stage) && row.value("ok", false)) {
      r.ok = true;
      r.train_peak = row["peak_total_bytes"].get<double>();
      r.life_peak = r.train_peak;
      r.step_s = row["median_step_s"].get<double>();
    }
  }
  if (!r.ok) r.why = "lora_bench has no zeal LoRA row at this stage";
}

Spec spec_of(const json& j) {
  Spec s;
  s.name = j.value("name", "");
  s.program = j.value("program", "train_gpt");
  s.model = j.value("model", s.program == "lora_bench" ? "all-MiniLM-L6-v2" : "gpt2-medium");
  s.world = j.value("world", 2);
  s.stage = j.value("stage", 3);
  s.offload = j.value("offload", "none");
  s.seq_len = j.value("seq_len", int64_t{128});
  s.micro_batch = j.value("micro_batch", int64_t{1});
  s.checkpointing = j.value("activation_checkpointing", false);
  s.chunked_loss = j.value("chunked_loss", true);
  s.max_in_cpu = j.value("max_in_cpu", int64_t{-1});
  s.untied = j.value("untied_head", false);
  s.steps = j.value("steps", 2);
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"memory_bench: measured per-rank peak memory per ZeRO stage, offload and checkpointing choice, against "
               "the stage table and zeal's estimator"};
  std::string model = "gpt2-medium", stages_s = "0,1,2,3", offloads_s = "none,cpu,nvme", ckpt_s = "off";
  std::string nvme_path = "/var/tmp/zeal_memory_bench", rows_path, json_path, md_path, png_path;
  int world = 2, steps = 2;
  int64_t seq_len = 128, micro_batch = 1, max_in_cpu = -1;
  bool chunked_loss = true, untied = false;
  app.add_option("--model", model, "train_gpt preset")->capture_default_str();
  app.add_option("--world", world, "ranks")->check(CLI::Range(1, 64))->capture_default_str();
  app.add_option("--steps", steps, "optimizer steps per run")->check(CLI::Range(1, 1000))->capture_default_str();
  app.add_option("--seq_len", seq_len)->check(CLI::Range(int64_t{1}, int64_t{1} << 20))->capture_default_str();
  app.add_option("--micro_batch", micro_batch)->check(CLI::Range(int64_t{1}, int64_t{1} << 20))->capture_default_str();
  app.add_option("--stages", stages_s)->capture_default_str();
  app.add_option("--offload", offloads_s, "none, cpu, nvme")->capture_default_str();
  app.add_option("--activation_checkpointing", ckpt_s, "off, on, or off,on: each row with each")->capture_default_str();
  app.add_option("--chunked_loss", chunked_loss, "train_gpt's chunked head and loss")->capture_default_str();
  app.add_option("--max_in_cpu", max_in_cpu, "offload_param.max_in_cpu for the NVMe rows (default DeepSpeed's)");
  app.add_flag("--untied_head", untied, "train_gpt --untied_head");
  app.add_option("--rows", rows_path, "a JSON file of rows, each with its own settings (instead of the cross product)");
  app.add_option("--nvme_path", nvme_path, "directory for the NVMe rows' swap files")->capture_default_str();
  app.add_option("--json", json_path);
  app.add_option("--markdown", md_path);
  app.add_option("--png", png_path, "a plot (needs gnuplot)");
  CLI11_PARSE(app, argc, argv);

  std::vector<Spec> specs;
  if (!rows_path.empty()) {
    json j;
    try {
      std::ifstream f(rows_path);
      if (!f) throw std::runtime_error("cannot read " + rows_path);
      f >> j;
      for (const auto& r : j.at("rows")) specs.push_back(spec_of(r));
    } catch (const std::exception& e) {
      std::fprintf(stderr, "memory_bench: --rows: %s\n", e.what());
      return 2;
    }
  } else {
    for (const auto& st : split(stages_s)) {
      for (const auto& off : split(offloads_s)) {
        for (const auto& ck : split(ckpt_s)) {
          Spec s;
          s.model = model, s.world = world, s.steps = steps, s.seq_len = seq_len, s.micro_batch = micro_batch;
          s.stage = std::stoi(st), s.offload = off, s.checkpointing = ck == "on", s.chunked_loss = chunked_loss;
          s.untied = untied;
          s.max_in_cpu = off == "nvme" ? max_in_cpu : -1;
          if (s.offload != "none" && s.stage == 0) continue;  // offload partitions the optimizer: stages 1-3
          if (s.offload == "nvme" && s.stage != 3) continue;  // NVMe offload is stage 3's
          specs.push_back(s);
        }
      }
    }
  }
  for (auto& s : specs) {
    if (s.program == "train_gpt") {
      try {
        (void)zeal::models::gpt_preset(s.model);
      } catch (const std::invalid_argument& e) {
        std::fprintf(stderr, "memory_bench: %s\n", e.what());
        return 2;
      }
    }
    if (s.name.empty()) s.name = fmt::format("stage {}/{}{}", s.stage, s.offload, s.checkpointing ? "/ckpt" : "");
  }

  Paths p;
  p.bin = fs::path(argv[0]).parent_path().string();
  p.zeal_cli = p.bin + "/zeal", p.train_gpt = p.bin + "/train_gpt", p.lora_bench = p.bin + "/lora_bench";
  p.nvme_path = nvme_path;
  char work_template[] = "/tmp/memory_bench.XXXXXX";
  p.work = mkdtemp(work_template);
  fs::create_directories(nvme_path);
  struct statvfs vfs {};
  statvfs(nvme_path.c_str(), &vfs);
  const double free_gb = static_cast<double>(vfs.f_bavail) * static_cast<double>(vfs.f_frsize) / 1e9;
  std::printf("memory_bench: %zu configurations, fp32; %s has %.1f GB free\n", specs.size(), nvme_path.c_str(), free_gb);
  std::fflush(stdout);

  std::vector<Row> rows;
  for (const auto& s : specs) {
    Row r;
    r.spec = s;
    std::string why;
    std::tie(r.predicted, r.predicted_disk) = predict(s, p, &why);
    if (s.program == "lora_bench") {
      run_lora_bench(r, p);
    } else {
      run_train_gpt(r, p, zeal_bench::free_port());
      zeal::models::GptConfig cfg = zeal::models::gpt_preset(s.model);
      cfg.tie_head = !s.untied;
      zeal::StageModel sm;
      sm.stage = s.stage;
      sm.psi = cfg.num_parameters();
      sm.world = s.world;
      sm.param_bytes = 4;
      sm.grad_bytes = 4;
      sm.master_bytes = 0;  // fp32 with a fused Adam: the parameters are the master weights
      sm.optimizer_bytes = 8;
      r.table = zeal::expected_model_state_bytes(sm);
    }
    if (!why.empty()) {
      r.ok = false;
      r.why = why;
    }
    std::printf("  %-36s %s: %s\n", s.name.c_str(), s.describe().c_str(),
                r.ok ? fmt::format("train peak {}, whole-run peak {}, predicted {} ({:+.1f} %), {:.2f} s/step",
                                   zeal::format_bytes(r.train_peak), zeal::format_bytes(r.life_peak),
                                   zeal::format_bytes(r.predicted), 100 * r.error(), r.step_s)
                           .c_str()
                     : ("cannot run: " + r.why).c_str());
    std::fflush(stdout);
    rows.push_back(r);
  }
  fs::remove_all(p.work);

  std::string md =
      "| row | configuration | measured peak, train phase | measured peak, whole run | stage table (model states) | "
      "estimate-memory | estimator error | step (s) |\n|---|---|---|---|---|---|---|---|\n";
  json jrows = json::array();
  std::vector<double> errors;
  std::string dat;
  int k = 0;
  double ymax = 0;
  for (const auto& r : rows) {
    const Spec& s = r.spec;
    if (r.ok) {
      errors.push_back(std::fabs(r.error()));
      md += fmt::format("| {} | {} | {} | {} | {} | {} | {:+.1f} % | {:.2f} |\n", s.name, s.describe(),
                        zeal::format_bytes(r.train_peak), zeal::format_bytes(r.life_peak),
                        r.table > 0 ? zeal::format_bytes(r.table) : "-", zeal::format_bytes(r.predicted),
                        100 * r.error(), r.step_s);
      ymax = std::max({ymax, r.train_peak, r.life_peak, r.table, r.predicted});
      dat += fmt::format("{} \"{}\" {:.3f} {:.3f} {:.3f} {:.3f}\n", k++, s.name, r.train_peak / (1 << 30),
                         r.life_peak / (1 << 30), r.table / (1 << 30), r.predicted / (1 << 30));
    } else {
      md += fmt::format("| {} | {} | cannot run: {} | | | {} | | |\n", s.name, s.describe(), r.why,
                        zeal::format_bytes(r.predicted));
    }
    jrows.push_back({{"name", s.name}, {"program", s.program}, {"model", s.model}, {"untied_head", s.untied},
                     {"world", s.world}, {"stage", s.stage}, {"offload", s.offload}, {"seq_len", s.seq_len},
                     {"micro_batch", s.micro_batch}, {"activation_checkpointing", s.checkpointing},
                     {"chunked_loss", s.chunked_loss}, {"max_in_cpu", s.max_in_cpu}, {"ok", r.ok}, {"why", r.why},
                     {"train_peak_bytes", r.train_peak}, {"whole_run_peak_bytes", r.life_peak},
                     {"stage_table_bytes", r.table}, {"predicted_bytes", r.predicted},
                     {"predicted_disk_bytes", r.predicted_disk}, {"step_s", r.step_s},
                     {"estimator_error", r.ok ? json(r.error()) : json(nullptr)}});
  }
  const double med = median(errors), worst = errors.empty() ? 0 : *std::max_element(errors.begin(), errors.end());
  md += fmt::format("\nEstimator |error| over the {} rows that ran: median {:.1f} %, largest {:.1f} %.\n", errors.size(),
                    100 * med, 100 * worst);
  std::printf("\n%s", md.c_str());
  if (!md_path.empty()) zeal::write_file_whole(md_path, md, "--md");
  if (!json_path.empty()) {
    zeal::write_file_whole(json_path,
                           json{{"rows_file", rows_path}, {"steps", steps}, {"precision", "fp32"},
                                {"free_disk_gb", free_gb}, {"median_abs_error", med}, {"largest_abs_error", worst},
                                {"rows", jrows}}
                                   .dump(2) +
                               "\n",
                           "--json");
  }
  if (!png_path.empty()) {
    const std::string data = png_path + ".dat";
    std::ofstream(data) << dat;
    const std::string script = fmt::format(
        "set terminal pngcairo size 1000,560 font ',10'; set output '{}'; set style data histograms; "
        "set style histogram clustered gap 1; set style fill solid 0.8 border -1; set boxwidth 0.9; "
        "set ylabel 'GiB per rank'; set yrange [0:{:.3f}]; set title 'peak memory per rank'; set key top right; "
        "set xtics rotate by -30; set grid ytics; "
        "plot '{}' using 3:xtic(2) title 'measured, train phase', '' using 4 title 'measured, whole run', "
        "'' using 5 title 'stage table (model states)', '' using 6 title 'estimate-memory'",
        png_path, 1.15 * ymax / (1 << 30), data);
    int status = 0;
    const std::string out = run_capture("gnuplot -e \"" + script + "\"", &status);
    if (status != 0) std::fprintf(stderr, "memory_bench: gnuplot: %s\n", out.c_str());
    else std::printf("wrote %s\n", png_path.c_str());
    std::remove(data.c_str());
  }
  return 0;
}
