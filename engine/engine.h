// zeal::Engine: the training loop's one entry point, Accelerate's Accelerator for LibTorch.
//
//   zeal::Engine engine(zeal::Config::from_env_or_file(argc, argv));
//   auto [model, opt, loader, sched] = engine.prepare(model, optimizer, loader, scheduler);
//   for (auto& batch : loader) {
//     auto guard = engine.accumulate();
//     auto loss = loss_fn(model->forward(batch.data), batch.target);
//     engine.backward(loss);
//     opt.step(); sched.step(); opt.zero_grad();
//   }
//
// The engine joins the ranks (zeal launch, torchrun, mpirun or Slurm; one process otherwise),
// puts the model on its device, and replaces the optimizer's update by ZeRO's (stage 0, 1 or 2
// of the config): the trainable parameters live in flat buffers, the fp32 master weights and
// optimizer states are sharded over the ranks from stage 1 and the gradients from stage 2.
// Mixed precision (fp16/bf16) computes in 16 bits with an fp32 master; fp16 uses DeepSpeed's
// dynamic loss scaling. See README.md, "The training loop", for the guide.
//
// An Engine must outlive what it prepared. Everything here runs on every rank in the same order
// (each collective call on every rank), except print and the *_main_process queries.
#pragma once

#include <ATen/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>

#include <concepts>
#include <cstdint>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "engine/buffers.h"
#include "engine/trackers.h"
#include "engine/config/config.h"
#include "engine/data/loader.h"
#include "engine/memory.h"
#include "engine/optim/schedule.h"

namespace zeal {

class Runtime;
class Communicator;
class Engine;
namespace zero {
class InitContext;
}
namespace estimate {
struct ModelShape;
struct RunShape;
}  // namespace estimate

// The optimizer after prepare: its step is ZeRO's; hyperparameters and learning rates are read
// from the LibTorch optimizer it came from (so LibTorch LR schedulers keep working on it).
class PreparedOptimizer {
 public:
  explicit PreparedOptimizer(Engine* engine) : engine_(engine) {}
  void step();       // engine.step(): a no-op on micro-steps that do not sync
  void zero_grad();  // on the sync micro-step only (the step clears gradients too)
  bool step_was_skipped() const;

 private:
  Engine* engine_;
};

// The scheduler after prepare: step() advances it only after an optimizer step that ran (not
// on accumulation micro-steps, not after a skipped fp16 step).
class PreparedScheduler {
 public:
  PreparedScheduler(Engine* engine, int index) : engine_(engine), index_(index) {}
  void step();
  double last_lr() const;

 private:
  Engine* engine_;
  int index_;
};

// An object of the program saved and restored with the engine's checkpoints
// (engine.register_for_checkpointing): its state as bytes, and back.
class Checkpointable {
 public:
  virtual ~Checkpointable() = default;
  virtual std::string state_dict() const = 0;
  virtual void load_state_dict(const std::string& state) = 0;
};

// engine.save_model's options.
struct SaveModelOptions {
  std::string dtype;                       // fp32, bf16, fp16; empty: the compute dtype when the config
                                           // asks for 16-bit weights on save
                                           // (stage3_gather_16bit_weights_on_model_save), else fp32
  int64_t max_shard_size = 5'000'000'000;  // bytes per file
  // For a model whose names or layouts differ from the format a reader expects (the inverse of
  // load_pretrained's rename and transforms): exported name (zeal::Sharded's "block" level left out)
  // → the name written, and whether the 2-D tensor is written transposed (GPT-2's Conv1D weights are
  // [in, out]). Names not listed are written as they are; a listed name that matches no tensor, or a
  // transpose of a tensor that is not 2-D, is an error. zeal::models::gpt2_export_options makes
  // GPT-2's.
  struct Rename {
    std::string name;
    bool transpose = false;
  };
  std::map<std::string, Rename> names;
  // LoRA: write each adapted weight merged, W + scaling·B·A (PEFT's merge_and_unload; the sum taken
  // in float64, rounded once), instead of the base weight W. The adapter tensors are never written
  // (PeftModel::save_pretrained writes them). The model keeps its adapters.
  bool merged = false;
};

// Reads Hugging Face-style safetensors weights (model.safetensors, or the files
// model.safetensors.index.json names, as engine.save_model and `zeal consolidate` write them) into
// `model`'s parameters and buffers by name (the model's own, or the exported name: zeal::Sharded's
// "block" level left out; LoRA adapter tensors a file lacks keep their values), converting the
// dtype; a missing name or a shape that differs is a zeal::Error naming it (nothing is changed then),
// but for buffers marked non-persistent (engine/buffers.h: read where the files hold them in the
// model's shape, else skipped). For a model an engine prepared
// with its optimizer, or a module inside one (its names relative to that module; a parameter tied
// to one outside it is loaded too), every rank calls it (collective) and reads only the elements it holds (its shards under stage 3), and the fp32
// master weights take the values too; the optimizer's state stays. Returns the number of tensors
// read.
int64_t load_checkpoint_in_model(torch::nn::Module& model, const std::string& dir);

// zeal::load_pretrained's options and report.
struct PretrainedOptions {
  // Explicit renames, model name prefix → file name prefix, tried before anything else
  // ({"encoder.", "bert.encoder."}); the first that applies wins.
  std::vector<std::pair<std::string, std::string>> rename;
  // Tensors the file stores in another form: the model's tensor (by its Hugging Face-style name,
  // zeal::Sharded's "block" level left out) as a function of the file's tensors, each read whole by
  // its name. zeal::transposed, zeal::split_part and zeal::concatenated make the usual ones (GPT-2's
  // Conv1D weights are stored [in, out]; fused or split QKV). Each result is written to a temporary
  // file of its own as it is made (under TMPDIR, on disk: together they hold every transformed
  // tensor) and read from there as the file's own tensors are: the load holds one transform's
  // inputs and result at a time.
  using TensorSource = std::function<at::Tensor(const std::function<at::Tensor(const std::string&)>& read)>;
  std::map<std::string, TensorSource> transforms;
  // Every parameter and persistent buffer must come from the file (default: those the file lacks
  // keep their values and are listed, as transformers' "Some weights ... were not initialized"
  // does; buffers marked non-persistent, engine/buffers.h, are read only where the file has them in
  // the model's shape).
  bool strict = false;
  bool quiet = false;  // no warning lines on the main process
};
struct PretrainedReport {
  int64_t loaded = 0;                // tensors read (parameters once, and buffers)
  std::vector<std::string> missing;  // model parameters and persistent buffers the file does not have
  std::vector<std::string> unused;   // file tensors no parameter or buffer took
  std::string model_prefix, file_prefix;  // the prefix dropped from model names / added for the file
};
// Hugging Face weights into a LibTorch model: `path` is a directory with model.safetensors (or
// model.safetensors.index.json and its files) or one .safetensors file. Names map as Hugging Face
// names modules: zeal::Sharded's "block" level is left out ("encoder.layer.0.block.attention..."
// reads "encoder.layer.0.attention..."), and a prefix one side has and the other lacks ("bert." of a
// BertForSequenceClassification file, say) is found from the names and dropped. Shapes must match;
// dtypes convert. For a model built by engine.init (stage 3, partitioned) or prepared by an engine,
// every rank calls it (collective) and reads only the byte ranges of the elements it holds.
// zeal::Error naming the file and tensor on a shape mismatch, a truncated file, or when no
// parameter matched; nothing changes then.
PretrainedReport load_pretrained(torch::nn::Module& model, const std::string& path, const PretrainedOptions& options = {});
// PretrainedOptions::transforms' usual sources: the file's 2-D tensor transposed; part `part` of
// `parts` equal parts along `dim`; the tensors concatenated along `dim`.
PretrainedOptions::TensorSource transposed(std::string file_name);
PretrainedOptions::TensorSource split_part(std::string file_name, int64_t dim, int64_t part, int64_t parts);
PretrainedOptions::TensorSource concatenated(std::vector<std::string> file_names, int64_t dim);
template <class Holder>
  requires requires(const Holder& h) { h.ptr(); }
PretrainedReport load_pretrained(const Holder& model, const std::string& path, const PretrainedOptions& options = {}) {
  return load_pretrained(*model.ptr(), path, options);
}

namespace detail {
// Reads tensors into `model` by a name map: model name → the file's name ("" leaves it alone). `path`:
// a directory as load_checkpoint_in_model takes or a .safetensors file. Every mapped name must be
// in the file. Collective for an init-built or prepared model (each rank reads what it holds).
int64_t load_mapped(torch::nn::Module& model, const std::string& path,
                    const std::function<std::string(const std::string&)>& map);
// The tensor names in `path` (as load_mapped takes it).
std::vector<std::string> tensor_names(const std::string& path);
// Each tensor name in `path` and the file that holds it (an absolute path).
std::map<std::string, std::string> tensor_files(const std::string& path);
// The tensor `name` of `path`, whole, in the file's dtype.
at::Tensor read_tensor(const std::string& path, const std::string& name);
}  // namespace detail

// engine.save_state's options.
struct SaveStateOptions {
  bool include_frozen = true;  // frozen parameters' values too
  int total_limit = 0;         // automatic names: keep at most this many checkpoints (0: all)
  // Return once the state is copied into host memory; a background thread writes the files and
  // completes the checkpoint (manifest, rename, `latest`). The next save_state, load_state,
  // wait_for_save or the engine's end waits for it. Training may go on meanwhile: the checkpoint
  // holds the state as it was at the call.
  bool async = false;
  // async: host memory per rank for that copy. A state larger than this makes the call wait until
  // the writes have made room for the rest. 0: half the memory available, shared by this machine's
  // ranks.
  int64_t staging_bytes = 0;
  // async: keep that host memory after the save for the next asynchronous save (DCP's
  // cache_staged_state_dict), whose copy then runs at memory speed instead of faulting in fresh
  // pages (docs/checkpoints.md); the default staging_bytes counts it as memory available. Where
  // the state fits the budget it is whole chunks holding the state (at most one chunk, 32 MiB,
  // more; kept_staging_bytes()); it stays held until a save without this option, a load_state,
  // release_kept_staging() or the engine's end releases it.
  bool keep_staging = false;
};

struct LoadStateOptions {
  // Host memory per rank the load may hold to read each byte once: when what this rank needs fits,
  // the bytes the first pass checked are kept and applied from memory; beyond it (and by default,
  // 0) the second pass reads them again, from the page cache where it still holds them, and the
  // load holds one window beside the training's own memory. Reading once means fresh memory for
  // the whole state, which measured slower than the second pass on the virtual machine measured
  // (docs/checkpoints.md); where fresh memory is cheap it may be faster. -1: a quarter of the memory
  // available, shared by the ranks on the machine.
  int64_t memory_budget = 0;
};

template <class T>
concept ModuleHolderLike = requires(T m) {
  { m.ptr() } -> std::convertible_to<std::shared_ptr<torch::nn::Module>>;
};

class Engine {
 public:
  // Joins the ranks described by the environment (and the config's launch section).
  explicit Engine(Config config);
  // Uses a Runtime the caller owns (zeal::spawn, tests).
  Engine(Config config, Runtime& runtime);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Prepares any of: a model (ModuleHolder or shared_ptr<Module>), a LibTorch optimizer, a
  // zeal::DataLoader, a LibTorch LR scheduler or a zeal schedule, in any order; returns the
  // prepared counterparts in the same order (one thing: that thing; several: a tuple).
  template <class... Ts>
  auto prepare(Ts&&... things) {
    static_assert(sizeof...(Ts) > 0, "prepare what?");
    auto prepared = std::tuple{prepare_one(std::forward<Ts>(things))...};
    finish_prepare();
    if constexpr (sizeof...(Ts) == 1) {
      return std::get<0>(std::move(prepared));
    } else {
      return prepared;
    }
  }

  // Builds the model: M(args...) for a ModuleHolder M (returns M), std::make_shared<M>(args...)
  // for a Module M. In stage 3 with zero_optimization.zero3_init_flag (on more than one rank) it is
  // built partitioned: each zeal::Sharded member keeps only this rank's slice of its parameters as
  // soon as its block exists, so the whole model never exists on one rank, and every rank builds
  // with rank 0's random state (the values one process seeded like rank 0 would build). Such a
  // model must then be prepared with its optimizer before any use; read or change its values under
  // engine.gathered(). Collective. memory().construction_peak tells what construction held.
  template <class M, class... Args>
  auto init(Args&&... args) {
    InitScope scope(this);
    if constexpr (ModuleHolderLike<M>) {
      M model(std::forward<Args>(args)...);
      scope.finish(*model.ptr());
      return model;
    } else {
      auto model = std::make_shared<M>(std::forward<Args>(args)...);
      scope.finish(*model);
      return model;
    }
  }

  // --- the step --------------------------------------------------------------------------
  // Backward of loss / gradient_accumulation_steps (× the fp16 loss scale); on the sync
  // micro-step the gradients are reduced as they arrive.
  void backward(const at::Tensor& loss);
  // On the sync micro-step: unscale, check inf/nan on every rank, clip, update, clear gradients,
  // advance the config's schedule. Otherwise nothing.
  void step();
  void zero_grad();

  // Marks one micro-step: the gradients are synchronized (and the optimizer steps) on every
  // gradient_accumulation_steps-th one and on the last batch of a prepared loader. Without a
  // guard, each backward() is a micro-step.
  class [[nodiscard]] AccumulateGuard {
   public:
    explicit AccumulateGuard(Engine* e) : e_(e) {}
    AccumulateGuard(AccumulateGuard&& o) noexcept : e_(std::exchange(o.e_, nullptr)) {}
    ~AccumulateGuard();

   private:
    Engine* e_;
  };
  AccumulateGuard accumulate();
  template <class M>
  AccumulateGuard accumulate(const M&) {
    return accumulate();
  }
  bool sync_gradients() const { return sync_; }
  int64_t gradient_accumulation_steps() const { return accumulation_steps_; }

  // Clip the gradients of this step (between backward and step); returns the global norm of the
  // unscaled gradients before clipping. The config's gradient_clipping does the same in step().
  double clip_grad_norm_(double max_norm, double norm_type = 2.0);
  void clip_grad_value_(double clip_value);
  bool optimizer_step_was_skipped() const { return last_step_skipped_; }
  // DeepSpeed's safe_get_full_grad: the full gradient of `param` after backward and before the step,
  // every rank's contribution reduced, the fp16 loss scale removed, before clipping (the
  // accumulation dtype: fp32 unless the config says otherwise). In stages 1-3 it is gathered from
  // the shards: collective, every rank calls it for the same parameters.
  at::Tensor full_grad(const at::Tensor& param);
  double last_grad_norm() const { return last_grad_norm_; }
  double loss_scale() const;
  // wall_clock_breakdown: the mean milliseconds per optimizer step of the last steps_per_print window
  // (the numbers rank 0 prints; every rank has its own), with the optimizer step count it ended at;
  // at_step 0 until a window was measured.
  struct StepBreakdown {
    int64_t at_step = 0, steps = 0;
    double forward_ms = 0, backward_ms = 0, step_ms = 0;
    double reduction_wait_ms = 0, gather_wait_ms = 0, read_wait_ms = 0, write_wait_ms = 0;
  };
  const StepBreakdown& wall_clock() const;
  // DeepSpeed's get_lr: the learning rate of each parameter group for the next optimizer step, as
  // the scheduler gives it (the config's: WarmupLR and WarmupDecayLR the same rates for every group,
  // WarmupCosineLR a fraction of each group's own; one the program prepared: a factor of each
  // group's own rate, as PyTorch's and Hugging Face's schedulers; none: the optimizer's rates).
  std::vector<double> get_lr() const;

  // Autocast to the compute dtype on this device while the guard lives (no-op in fp32).
  class [[nodiscard]] AutocastGuard {
   public:
    AutocastGuard(at::DeviceType device, at::ScalarType dtype, bool enable);
    AutocastGuard(AutocastGuard&& o) noexcept;
    ~AutocastGuard();

   private:
    at::DeviceType device_;
    bool active_ = false, prev_enabled_ = false;
    at::ScalarType prev_dtype_;
  };
  AutocastGuard autocast() const;

  // --- checkpoints (README.md, "Checkpoints") ---------------------------------------------------
  using SaveOptions = SaveStateOptions;
  // Saves what a resumed run needs into `dir` (created; an existing checkpoint there is replaced
  // only once the new one is complete), or, when empty, checkpoints/checkpoint_<k> with the next k,
  // and points `latest` in its parent at it. Each rank writes its own file
  // (rank<k>.safetensors: the fp32 master weights and optimizer state of the elements it owns, and
  // its frozen parameters); rank 0 writes manifest.json (the layout, the counters, a CRC32C per
  // file). Between optimizer steps; collective. Returns the checkpoint's directory.
  std::string save_state(const std::string& dir = "", const SaveOptions& options = {});
  // Restores a checkpoint written by save_state at any world size and ZeRO stage, with or without
  // offload: `dir` itself, or the checkpoint its `latest` names (default: checkpoints/). Every
  // rank reads only the byte ranges its elements need and checks their CRC32C; a missing,
  // truncated or corrupted file, or a parameter the checkpoint lacks, is an error naming it before
  // anything changes; then the bytes go where they live a few MiB at a time, so the load holds no
  // more than a window beside the training's own memory (docs/checkpoints.md). Two passes: the first
  // checks every byte (a new engine's optimizer state in host memory, still zeros, goes in place as
  // it is checked, and is zeros again if the load fails); the second reads again what is not in
  // place, through the page cache, and applies it. Collective.
  void load_state(const std::string& dir = "", const LoadStateOptions& options = {});
  // Waits until an asynchronous save_state is complete on every rank; its failure on any rank is a
  // zeal::Error here (naming the ranks and why). Collective; returns at once when none is pending.
  void wait_for_save();
  // Host memory this rank holds for the next asynchronous save (SaveOptions::keep_staging), bytes.
  int64_t kept_staging_bytes() const;
  // Releases that memory (before a phase that needs it), after wait_for_save. Collective.
  void release_kept_staging();
  // Objects of the program saved by every save_state (rank 0's, as custom_<k>.bin inside the
  // checkpoint, so they appear and disappear with it) and restored by load_state on every rank, in
  // the order they were registered. Accelerate's register_for_checkpointing.
  void register_for_checkpointing(std::shared_ptr<Checkpointable> object);
  // The model's weights as Hugging Face-style safetensors in `dir` (model.safetensors, or
  // model-0000k-of-0000n.safetensors with model.safetensors.index.json beyond max_shard_size),
  // written by rank 0 from a checkpoint the ranks save first (in `dir`/.state, removed after):
  // stage 3's shards are never gathered on one rank, and rank 0's memory holds one parameter at a
  // time. Parameters and buffers under the names the model's owner sees, as transformers loads
  // them: zeal::Sharded's "block" level left out ("layers.0.block.mlp.fc1.weight" is written as
  // "layers.0.mlp.fc1.weight"), and LoRA adapter tensors left out (PeftModel::save_pretrained writes
  // them; PeftModel::save_merged the merged model). Collective. Returns the files written.
  std::vector<std::string> save_model(const std::string& dir, const SaveModelOptions& options = {});

  // --- collectives on results ----------------------------------------------------------------
  // Every rank's tensor concatenated along dim 0 in rank order (0-d tensors become [world]);
  // first dimensions may differ between ranks.
  at::Tensor gather(const at::Tensor& t);
  // gather, minus the samples the prepared loader repeated to even out the last batch.
  at::Tensor gather_for_metrics(const at::Tensor& t);
  std::vector<at::Tensor> gather_for_metrics(const std::vector<at::Tensor>& ts);
  // Element-wise "sum" or "mean" over ranks (a new tensor).
  at::Tensor reduce(const at::Tensor& t, const std::string& op = "sum");
  // Pads dimension `dim` to the largest size on any rank with pad_value.
  at::Tensor pad_across_processes(const at::Tensor& t, int64_t dim = 0, double pad_value = 0,
                                  bool pad_first = false);

  // --- trackers (Accelerate's init_trackers / log / end_training; docs/trackers.md) -------------
  // Opens the trackers the config chooses (log_with in logging_dir/<project_name>, DeepSpeed's
  // tensorboard and csv_monitor sections in output_path/job_name) on the main process, recording
  // `config` (the run's hyperparameters) with them; the other processes keep none. Collective: when
  // the main process cannot open them, every rank throws. Every process may call log: only the
  // main process writes (a failed write is an error there).
  void init_trackers(const std::string& project_name, const std::map<std::string, std::string>& config = {});
  // One record of scalar metrics at `step` (-1: the optimizer steps taken so far) to every tracker.
  void log(const Metrics& values, int64_t step = -1);
  // Closes the trackers (also done when the engine goes).
  void end_training();
  // The open tracker of that name ("jsonl", "csv", "tensorboard"), or null (and on other processes).
  Tracker* get_tracker(const std::string& name);

  // --- processes ------------------------------------------------------------------------------
  template <class... Args>
  void print(const Args&... args) const {
    if (!is_main_process()) return;
    (std::cout << ... << args) << std::endl;
  }
  bool is_main_process() const;
  bool is_local_main_process() const;
  int num_processes() const;
  int process_index() const;
  int local_process_index() const;
  // The model's buffers take rank 0's values on every rank (collective; nothing where
  // broadcast_buffers is false or on one rank). The engine calls it after every optimizer step; a
  // program whose forwards between steps read buffers calls it where it needs them in step.
  void sync_buffers();
  void wait_for_everyone();
  // The main process runs the guarded block first, the others after it is done.
  class [[nodiscard]] MainProcessFirst {
   public:
    explicit MainProcessFirst(Engine* e);
    MainProcessFirst(MainProcessFirst&& o) noexcept : e_(std::exchange(o.e_, nullptr)) {}
    ~MainProcessFirst() noexcept(false);

   private:
    Engine* e_;
  };
  MainProcessFirst main_process_first() { return MainProcessFirst(this); }

  // DeepSpeed's GatheredParameters: while the guard lives, the full values of `params` (every
  // parameter when empty) are present on every rank, to read or, with modifier_rank >= 0, to
  // modify in place: at the end of the guard that rank's values are broadcast and written into
  // every rank's shards and master weights. Outside stage 3 parameters are always whole and the
  // guard only broadcasts modifications. Every rank must open and close it.
  class [[nodiscard]] Gathered {
   public:
    Gathered(Engine* e, std::vector<int> units, std::vector<at::Tensor> params, int modifier_rank)
        : e_(e), units_(std::move(units)), params_(std::move(params)), modifier_rank_(modifier_rank) {}
    Gathered(Gathered&& o) noexcept
        : e_(std::exchange(o.e_, nullptr)), units_(std::move(o.units_)), params_(std::move(o.params_)),
          modifier_rank_(o.modifier_rank_) {}
    ~Gathered() noexcept(false);

   private:
    Engine* e_;
    std::vector<int> units_;
    std::vector<at::Tensor> params_;
    int modifier_rank_;
  };
  Gathered gathered(std::vector<at::Tensor> params = {}, int modifier_rank = -1);

  at::Device device() const { return device_; }
  // Waits until this rank's device has finished the work queued so far (torch.cuda.synchronize()):
  // read a clock after it, not before, to time GPU work. Nothing to wait for on the CPU.
  void synchronize() const;
  // Stage 3: restart the gathered-bytes peak of memory(); how many unit gathers there were in
  // all, how many of them prefetch issued, and how often the recorded order did not match
  // (fetched on demand, traced again).
  void reset_peak_memory();
  struct FetchCounts {
    int64_t gathers = 0, prefetched = 0, retraced = 0;
  };
  FetchCounts fetch_counts() const;
  // offload_param nvme: unit shards read from disk ahead of their all-gather (on the reader
  // thread), and of those the ones still being read when the gather needed them.
  struct DiskReads {
    int64_t ahead = 0, waited = 0;
  };
  DiskReads param_disk_reads() const;
  // offload_optimizer nvme: windows of optimizer state (master, m, v) the steps so far found read
  // while the backward ran, instead of reading them after it (docs/offload.md).
  int64_t optimizer_windows_read_ahead() const;
  int zero_stage() const;
  at::ScalarType compute_dtype() const { return compute_dtype_; }
  template <class M>
  M unwrap_model(M model) const {
    return model;
  }
  const Config& config() const { return config_; }
  // Before the model is prepared: sets config keys from what the program decided (zeal::Trainer's
  // arguments fill gradient_accumulation_steps, gradient_clipping, …), as Config::set_all with the
  // program as their origin. Every rank must pass the same. zeal::Error once the model is prepared.
  void configure(const std::vector<Config::Setting>& settings);
  // Keeps `object` (an optimizer or schedule a helper made and prepared) alive as long as the engine.
  void keep_alive(std::shared_ptr<void> object);
  Runtime& runtime() { return *runtime_; }

  // Bytes this rank holds for the model states, by kind.
  MemoryReport memory() const;
  // memory_check for a batch (collective; called before prepare, it runs when prepare builds the
  // ZeRO state — a model prepared without an optimizer is never checked): the
  // peak prepare predicted plus what `batch.micro_batch` sequences of `batch.seq_len` tokens add
  // through `model` (zeal::estimate::gpt_shape, hf_config_shape; batch.chunked_loss and loss_chunk
  // as the model computes its loss; the other fields come from the config), against the memory the
  // rank may use. zeal::Error naming the micro-batch, the tokens, both sizes, the largest micro-batch
  // predicted to fit and the peak with activation checkpointing when the activations alone exceed it
  // (whatever memory_check says, unless off), or when the whole peak does and memory_check is error;
  // a warning with warn. Host memory: nothing is checked on GPU ranks (their allocator fails cleanly).
  void check_batch_memory(const estimate::ModelShape& model, const estimate::RunShape& batch);
  int64_t num_trainable_parameters() const;
  int64_t optimizer_steps() const { return optimizer_steps_; }

 private:
  friend class PreparedOptimizer;
  friend class PreparedScheduler;

  template <class T>
  auto prepare_one(T&& x) {
    using U = std::remove_cvref_t<T>;
    if constexpr (ModuleHolderLike<U>) {
      prepare_module(x.ptr());
      return U(x);
    } else if constexpr (std::is_convertible_v<U, std::shared_ptr<torch::nn::Module>>) {
      prepare_module(x);
      return U(x);
    } else if constexpr (std::is_base_of_v<torch::optim::Optimizer, U>) {
      static_assert(std::is_lvalue_reference_v<T>, "prepare the optimizer object itself (it must outlive the engine)");
      prepare_optimizer(&x);
      return PreparedOptimizer(this);
    } else if constexpr (std::is_base_of_v<torch::optim::LRScheduler, U>) {
      static_assert(std::is_lvalue_reference_v<T>, "prepare the scheduler object itself (it must outlive the engine)");
      return PreparedScheduler(this, add_scheduler(&x, nullptr));
    } else if constexpr (std::is_convertible_v<U, std::shared_ptr<optim::LrSchedule>>) {
      return PreparedScheduler(this, add_scheduler(nullptr, std::shared_ptr<optim::LrSchedule>(x)));
    } else if constexpr (requires(U u, data::Binding b) { u.bind(b); }) {
      U loader(x);
      loader.bind(binding());
      return loader;
    } else {
      static_assert(sizeof(U) == 0, "engine.prepare takes models, optimizers, zeal::DataLoaders and schedulers");
    }
  }

  void init();
  Communicator& comm();
  // The communicator the ZeRO state is sharded over: comm(), or with hybrid_shard the machine's
  // ranks, replicated across machines (engine/comm/hybrid.h).
  Communicator& shard_comm();
  void check_adapters_ran();
  void make_hybrid_comm();
  // engine.init's context: open while the model is built.
  class InitScope {
   public:
    explicit InitScope(Engine* e);
    ~InitScope();
    void finish(torch::nn::Module& model);

   private:
    Engine* e_;
    std::unique_ptr<zero::InitContext> ctx_;
  };
  void prepare_module(std::shared_ptr<torch::nn::Module> module);
  void prepare_optimizer(torch::optim::Optimizer* optimizer);
  int add_scheduler(torch::optim::LRScheduler* torch_scheduler, std::shared_ptr<optim::LrSchedule> schedule);
  data::Binding binding();
  void finish_prepare();
  void finish_background_save() noexcept;
  friend int64_t load_checkpoint_in_model(torch::nn::Module& model, const std::string& dir);
  friend int64_t detail::load_mapped(torch::nn::Module& model, const std::string& path,
                                     const std::function<std::string(const std::string&)>& map);
  // Each rank reads its elements (prepared model or engine.init's slices); -1: whole reads needed.
  int64_t load_weights_sharded(torch::nn::Module& model, const std::string& path,
                               const std::function<std::string(const std::string&)>& map);
  void build_zero();
  void check_memory_at_prepare();
  void open_trackers(const std::string& project_name, const std::map<std::string, std::string>& config);
  void say_gradient_dtypes(int world) const;
  void report_progress(const std::vector<double>& lrs);
  void begin_micro_step();
  void scheduler_step(int index);
  double scheduler_last_lr(int index) const;
  std::vector<double> learning_rates() const;
  void make_config_schedules();
  double inv_scale() const;

  struct State;
  Config config_;
  std::unique_ptr<Runtime> owned_runtime_;
  Runtime* runtime_;
  at::Device device_ = at::kCPU;
  at::ScalarType compute_dtype_;
  int64_t accumulation_steps_ = 1;
  bool sync_ = true, guard_open_ = false, backward_pending_ = false;
  bool last_step_skipped_ = false;
  double last_grad_norm_ = 0;
  int64_t micro_steps_ = 0, optimizer_steps_ = 0;
  int64_t skipped_steps_ = 0;  // steps an overflow or a failed check skipped (steps_per_print's count)
  std::unique_ptr<State> state_;
};

}  // namespace zeal
