// Offload to host memory (offload_optimizer.device cpu; in stage 3 offload_param.device cpu too) on
// CPU ranks: Adam's state (and a master where the parameters cannot be their own) lives in the
// offload manager's arena, with no second copy of anything. Same arithmetic, so the same bits as
// without offload, on 1–3 ranks, stages 1–3, fp32 and bf16, with accumulation and clipping. (From a
// GPU the step streams the gradients in and the parameters out: tests/engine/cuda_engine_test.cpp.)
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/mount.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cmath>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <ostream>
#include <string>

#include <torch/optim/sgd.h>

#include "engine/estimate.h"
#include "engine/prepare_check.h"
#include "engine/zero/layout.h"
#include "tests/engine/engine_harness.h"

namespace zeal_test {
namespace {

struct OffloadCase {
  int stage, world;
  std::string precision;
  int accumulation;
};

std::string case_name(const ::testing::TestParamInfo<OffloadCase>& i) {
  return "stage" + std::to_string(i.param.stage) + "_world" + std::to_string(i.param.world) + "_" +
         (i.param.precision == "no" ? "fp32" : i.param.precision) + "_accum" + std::to_string(i.param.accumulation);
}

void PrintTo(const OffloadCase& c, std::ostream* os) {
  *os << "stage " << c.stage << ", " << c.world << " ranks, " << c.precision << ", accumulation " << c.accumulation;
}

// The same bits as the run without offload: parameters after every step, losses and norms.
void expect_bit_identical(const RunResult& plain, const RunResult& off) {
  ASSERT_EQ(plain.params.size(), off.params.size());
  for (size_t r = 0; r < off.params.size(); ++r) {
    EXPECT_TRUE(at::equal(plain.params[r], off.params[r])) << "rank " << r << ": final parameters differ";
    EXPECT_TRUE(at::equal(plain.trajectory[r], off.trajectory[r])) << "rank " << r << ": parameters differ on the way";
  }
  EXPECT_TRUE(at::equal(plain.losses, off.losses));
  EXPECT_TRUE(at::equal(plain.norms, off.norms));
}

// The bytes on disk the engine counts against the sizes of the rank's swap files, read from the
// file system (so the disk checks below hold for the files, not only for the engine's count).
void expect_disk_as_counted(const RunResult& off) {
  for (size_t r = 0; r < off.memory.size(); ++r) {
    const double counted = off.memory[r][10].item<double>(), measured = off.memory[r][13].item<double>();
    EXPECT_GT(measured, 0) << "rank " << r << ": no swap file on disk";
    EXPECT_EQ(measured, counted) << "rank " << r << ": the swap files hold " << measured << " bytes, the engine counts "
                                 << counted;
  }
}

class OffloadCpu : public ::testing::TestWithParam<OffloadCase> {};

TEST_P(OffloadCpu, TrainsBitIdenticalToNoOffload) {
  const OffloadCase c = GetParam();
  RunSpec s;
  s.stage = c.stage;
  s.world = c.world;
  s.precision = c.precision;
  s.accumulation = c.accumulation;
  const RunResult plain = run_engine(s, "offload_off_" + case_name({c, 0}));
  s.offload = true;
  const RunResult off = run_engine(s, "offload_on_" + case_name({c, 0}));
  expect_bit_identical(plain, off);
  // What the offload manager holds on CPU ranks, whose host memory is where they compute: m and v
  // (8 B) for every element this rank owns, and a master (4 B) only where the parameters cannot be
  // their own (bf16); no copy of fp32 parameters and no step buffers, so exactly the master and
  // state the run without offload holds.
  const bool fp32 = c.precision == "no";
  for (size_t r = 0; r < off.params.size(); ++r) {
    const double master = off.memory[r][2].item<double>(), state = off.memory[r][3].item<double>();
    const double owned = state / 8;
    EXPECT_GT(owned, 0);
    EXPECT_EQ(master, (fp32 ? 0 : 4) * owned) << "rank " << r;
    EXPECT_EQ(off.memory[r][9].item<double>(), master + state) << "rank " << r;
    EXPECT_EQ(plain.memory[r][2].item<double>(), master) << "rank " << r;
    EXPECT_EQ(plain.memory[r][3].item<double>(), state) << "rank " << r;
    EXPECT_EQ(plain.memory[r][9].item<double>(), 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, OffloadCpu,
                         ::testing::Values(OffloadCase{1, 1, "no", 1}, OffloadCase{1, 2, "bf16", 2},
                                           OffloadCase{2, 2, "no", 2}, OffloadCase{2, 3, "bf16", 1},
                                           OffloadCase{3, 1, "bf16", 1}, OffloadCase{3, 2, "no", 2},
                                           OffloadCase{3, 3, "bf16", 2}),
                         case_name);

// The optimizer state on disk (offload_optimizer.device nvme, stage 3), updated window by window of
// sub_group_size elements (1000 here: many windows per partition): the same bits as without
// offload, through io_uring and through the thread-pool fallback; the swap files hold 3 regions
// (master, m, v) of the rank's elements, the host only the window buffers (three sets of master, m, v
// for the pipeline, the gradient and the result); nothing is left on disk.
struct NvmeCase {
  int world;
  std::string precision;
  int accumulation;
  bool threads;  // ZEAL_OFFLOAD_IO=threads
  bool aio_auto = false;  // aio.block_size and aio.queue_depth "auto": measured by rank 0 at start-up
  int buffers = 4;        // offload_optimizer.buffer_count: 1 and 2 pipeline less, 3 and up fully
};

void PrintTo(const NvmeCase& c, std::ostream* os) {
  *os << c.world << " ranks, " << c.precision << ", accumulation " << c.accumulation << (c.threads ? ", threads" : "")
      << (c.aio_auto ? ", aio auto" : "") << ", buffer_count " << c.buffers;
}

class OffloadNvme : public ::testing::TestWithParam<NvmeCase> {};

TEST_P(OffloadNvme, TrainsBitIdenticalToNoOffload) {
  namespace fs = std::filesystem;
  const NvmeCase c = GetParam();
  RunSpec s;
  s.stage = 3;
  s.world = c.world;
  s.precision = c.precision;
  s.accumulation = c.accumulation;
  s.sub_group = 1000;
  s.optimizer_buffer_count = c.buffers;
  const RunResult plain = run_engine(s, "nvme_off");
  const fs::path dir = temp_dir("nvme_swap");
  s.nvme_path = dir.string();
  s.aio_auto = c.aio_auto;
  if (c.threads) ::setenv("ZEAL_OFFLOAD_IO", "threads", 1);
  // The ranks' standard error, to see the start-up measurement "auto" asks for.
  const std::string err_path = dir.string() + ".stderr";
  std::fflush(stderr);
  const int saved_err = ::dup(2), err_fd = ::open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  ::dup2(err_fd, 2);
  const RunResult off = run_engine(s, "nvme_on");
  expect_disk_as_counted(off);
  std::fflush(stderr);
  ::dup2(saved_err, 2);
  ::close(saved_err);
  ::close(err_fd);
  ::unsetenv("ZEAL_OFFLOAD_IO");
  std::ifstream err_file(err_path);
  const std::string err((std::istreambuf_iterator<char>(err_file)), std::istreambuf_iterator<char>());
  fs::remove(err_path);
  EXPECT_EQ(err.find("zeal: offload: aio auto: measured " + dir.string()) != std::string::npos, c.aio_auto) << err;
  expect_bit_identical(plain, off);
  const double p_bytes = c.precision == "no" ? 4 : 2;
  for (size_t r = 0; r < off.params.size(); ++r) {
    const double owned = plain.memory[r][3].item<double>() / 8;  // Adam's state: 8 bytes per owned element
    ASSERT_GT(owned, 1000) << "the partition must span several windows";
    const double region = std::ceil(owned * 4 / 4096) * 4096;
    // On disk: [master | m | v] and the fp32 gradients, each piece of them in its own 4 KiB-aligned region.
    const double disk = off.memory[r][10].item<double>();
    EXPECT_GE(disk, 3 * region + owned * 4) << "rank " << r;
    EXPECT_LT(disk, 3 * region + owned * 4 + 16 * 4096) << "rank " << r;
    EXPECT_EQ(off.memory[r][3].item<double>(), 0) << "rank " << r << ": optimizer state held in memory";
    // The first windows of each step came in while its last backward ran (the first step's always:
    // no write-back is in flight before it).
    EXPECT_GT(off.memory[r][15].item<double>(), 0) << "rank " << r << ": no optimizer window was read ahead";
    EXPECT_EQ(plain.memory[r][15].item<double>(), 0) << "rank " << r;
    EXPECT_EQ(off.memory[r][1].item<double>(), 0) << "rank " << r << ": gradients held in memory";
    EXPECT_GT(plain.memory[r][1].item<double>(), 0) << "rank " << r << ": gradients without offload";
    // Each set holds master, m, v and gradient windows (16 bytes per element) and the gradients'
    // read buffer (a window and 4 KiB on each side), plus the result window.
    const int sets = std::min(c.buffers, 3);
    EXPECT_EQ(off.memory[r][9].item<double>(), sets * (20 * 1024 + 8192) + p_bytes * 1024)
        << "rank " << r << ": window buffers";
  }
  EXPECT_TRUE(fs::is_empty(dir)) << "swap files left in " << dir;
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Cases, OffloadNvme,
                         ::testing::Values(NvmeCase{1, "no", 1, false}, NvmeCase{2, "bf16", 2, false},
                                           NvmeCase{3, "no", 1, false}, NvmeCase{2, "no", 2, true},
                                           NvmeCase{2, "bf16", 1, false, true}, NvmeCase{2, "no", 2, false, false, 1},
                                           NvmeCase{3, "bf16", 1, false, false, 2}));

// Parameters on disk (offload_param.device nvme, stage 3): every block's shards (trainable and
// frozen) live in the rank's swap file, read back for each all-gather (prefetches included) and
// written after each step; with the optimizer state nowhere else, in host memory or on disk too.
// The same bits as without offload, on 1-3 ranks, with a frozen LayerNorm first in every block;
// in memory only the root's shards; on disk exactly each block part's 4 KiB-rounded shard (computed
// here from the model's sizes, and checked against the run without offload).
struct ParamNvmeCase {
  int world;
  std::string precision;
  int accumulation;
  std::string optimizer;  // where the optimizer state lives: none, cpu, nvme
  bool threads;           // ZEAL_OFFLOAD_IO=threads
};

void PrintTo(const ParamNvmeCase& c, std::ostream* os) {
  *os << c.world << " ranks, " << c.precision << ", accumulation " << c.accumulation << ", optimizer on "
      << c.optimizer << (c.threads ? ", threads" : "");
}

struct ShardSizes {
  double all_train = 0, root_train = 0, all_frozen = 0, root_frozen = 0, blocks_on_disk = 0;
};

// Each unit's trainable and frozen parts as stage 3 lays them out (model order, 16-element
// alignment, equal shards), in bytes per rank.
ShardSizes shard_sizes(const RunSpec& s, int64_t esize) {
  Setup u = make_setup(s);
  std::map<std::string, std::pair<std::vector<int64_t>, std::vector<int64_t>>> units;  // name: train, frozen
  for (const auto& item : u.model->named_parameters()) {
    const std::string& k = item.key();
    const std::string unit = k.rfind("block", 0) == 0 ? k.substr(0, k.find('.')) : "";
    (item.value().requires_grad() ? units[unit].first : units[unit].second).push_back(item.value().numel());
  }
  auto bytes = [&](const std::vector<int64_t>& n) {
    return n.empty() ? 0.0 : double(zeal::zero::FlatLayout(n, s.world, 16).shard_size() * esize);
  };
  auto on_disk = [](double b) { return b == 0 ? 0.0 : std::ceil(b / 4096) * 4096; };
  ShardSizes z;
  for (const auto& [name, parts] : units) {
    const double t = bytes(parts.first), f = bytes(parts.second);
    z.all_train += t;
    z.all_frozen += f;
    if (name.empty()) {
      z.root_train = t;
      z.root_frozen = f;
    } else {
      z.blocks_on_disk += on_disk(t) + on_disk(f);
    }
  }
  return z;
}

class OffloadParamNvme : public ::testing::TestWithParam<ParamNvmeCase> {};

TEST_P(OffloadParamNvme, TrainsBitIdenticalToNoOffload) {
  namespace fs = std::filesystem;
  const ParamNvmeCase c = GetParam();
  RunSpec s;
  s.stage = 3;
  s.world = c.world;
  s.precision = c.precision;
  s.accumulation = c.accumulation;
  s.freeze_ln1 = true;
  s.sub_group = 1000;
  const RunResult plain = run_engine(s, "param_nvme_off");
  const fs::path dir = temp_dir("param_swap");
  s.param_nvme_path = dir.string();
  if (c.optimizer == "nvme") s.nvme_path = dir.string();
  if (c.optimizer == "cpu") s.offload = true;
  if (c.threads) ::setenv("ZEAL_OFFLOAD_IO", "threads", 1);
  const RunResult off = run_engine(s, "param_nvme_on");
  expect_disk_as_counted(off);
  ::unsetenv("ZEAL_OFFLOAD_IO");
  expect_bit_identical(plain, off);
  const ShardSizes z = shard_sizes(s, c.precision == "no" ? 4 : 2);
  ASSERT_GT(z.blocks_on_disk, 0);
  for (size_t r = 0; r < off.params.size(); ++r) {
    EXPECT_EQ(plain.memory[r][0].item<double>(), z.all_train) << "rank " << r << ": the layout computed here is off";
    EXPECT_EQ(plain.memory[r][4].item<double>(), z.all_frozen) << "rank " << r;
    EXPECT_EQ(off.memory[r][0].item<double>(), z.root_train) << "rank " << r << ": block shards held in memory";
    EXPECT_EQ(off.memory[r][4].item<double>(), z.root_frozen) << "rank " << r << ": frozen block shards in memory";
    if (c.optimizer == "nvme") {
      // [master | m | v] and the fp32 gradients, each piece of them 4 KiB-aligned.
      const double owned = plain.memory[r][3].item<double>() / 8;  // Adam: 8 bytes per owned element
      const double optimizer_disk = 3 * std::ceil(owned * 4 / 4096) * 4096 + owned * 4;
      EXPECT_GE(off.memory[r][10].item<double>(), z.blocks_on_disk + optimizer_disk) << "rank " << r;
      EXPECT_LT(off.memory[r][10].item<double>(), z.blocks_on_disk + optimizer_disk + 16 * 4096) << "rank " << r;
      EXPECT_EQ(off.memory[r][1].item<double>(), 0) << "rank " << r << ": gradients held in memory";
    } else {
      EXPECT_EQ(off.memory[r][10].item<double>(), z.blocks_on_disk) << "rank " << r;
    }
  }
  EXPECT_TRUE(fs::is_empty(dir)) << "swap files left in " << dir;
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Cases, OffloadParamNvme,
                         ::testing::Values(ParamNvmeCase{1, "no", 1, "none", false},
                                           ParamNvmeCase{2, "bf16", 2, "nvme", false},
                                           ParamNvmeCase{3, "no", 1, "cpu", false},
                                           ParamNvmeCase{2, "no", 1, "none", true}));

// Each unit's trainable and frozen shard bytes per rank, in the model's order (root first).
std::vector<std::pair<double, double>> unit_shards(const RunSpec& s, int64_t esize) {
  Setup u = make_setup(s);
  std::vector<std::string> order{""};
  std::map<std::string, std::pair<std::vector<int64_t>, std::vector<int64_t>>> units;
  for (const auto& item : u.model->named_parameters()) {
    const std::string& k = item.key();
    const std::string unit = k.rfind("block", 0) == 0 ? k.substr(0, k.find('.')) : "";
    if (std::find(order.begin(), order.end(), unit) == order.end()) order.push_back(unit);
    (item.value().requires_grad() ? units[unit].first : units[unit].second).push_back(item.value().numel());
  }
  auto bytes = [&](const std::vector<int64_t>& n) {
    return n.empty() ? 0.0 : double(zeal::zero::FlatLayout(n, s.world, 16).shard_size() * esize);
  };
  std::vector<std::pair<double, double>> out;
  for (const auto& name : order) out.push_back({bytes(units[name].first), bytes(units[name].second)});
  return out;
}

// offload_param.max_in_cpu: the units that fit it per rank (in order, counted in elements of
// their shards) keep their shards in host memory; the rest go to disk. Here room for two blocks:
// the first two stay, the others' shards are on disk, and the result is the same bits.
TEST(OffloadParamNvme, MaxInCpuKeepsTheFirstUnitsThatFitInMemory) {
  namespace fs = std::filesystem;
  RunSpec s;
  s.stage = 3;
  s.world = 2;
  s.freeze_ln1 = true;
  s.layers = 4;
  const RunResult plain = run_engine(s, "param_cpu_max_off");
  const auto shards = unit_shards(s, 4);
  ASSERT_GE(shards.size(), 4u) << "the model needs three blocks or more";
  int64_t block_elems = 0;  // the engine counts a unit's shard as ceil(elements / world)
  {
    zeal_test::Setup u = make_setup(s);
    for (const auto& item : u.model->named_parameters())
      if (item.key().rfind("block0.", 0) == 0) block_elems += item.value().numel();
  }
  const fs::path dir = temp_dir("param_swap_max_in_cpu");
  s.param_nvme_path = dir.string();
  s.param_max_in_cpu = 2 * ((block_elems + s.world - 1) / s.world);
  const RunResult off = run_engine(s, "param_cpu_max_on");
  expect_disk_as_counted(off);
  expect_bit_identical(plain, off);
  auto on_disk = [](double b) { return b == 0 ? 0.0 : std::ceil(b / 4096) * 4096; };
  double in_memory = shards[0].first + shards[1].first + shards[2].first, disk = 0;
  for (size_t i = 3; i < shards.size(); ++i) disk += on_disk(shards[i].first) + on_disk(shards[i].second);
  ASSERT_GT(disk, 0);
  for (size_t r = 0; r < off.params.size(); ++r) {
    EXPECT_EQ(off.memory[r][0].item<double>(), in_memory) << "rank " << r << ": trainable shards in memory";
    EXPECT_EQ(off.memory[r][10].item<double>(), disk) << "rank " << r << ": bytes on disk";
  }
  EXPECT_TRUE(fs::is_empty(dir)) << "swap files left in " << dir;
  fs::remove_all(dir);
}

// fp32 parameters are their own master weights, except where a parameter store frees their shards
// between uses (offload_param nvme; cpu on a GPU): then the master is a copy of its own, which the
// engine holds and `zeal estimate-memory` predicts beside the parameters (the same bits either way).
TEST(OffloadParamNvme, AStoredShardsMasterIsACopyTheEstimateCounts) {
  namespace fs = std::filesystem;
  RunSpec s;
  s.stage = 3;
  s.world = 2;
  s.layers = 4;
  const auto predicted_master = [](const RunSpec& spec) {
    zeal_test::Setup u = make_setup(spec);
    const zeal::Config c = make_config(spec);
    const auto shape = zeal::detail::prepared_model_shape(*u.model, nullptr, c);
    const auto p = zeal::estimate::predict(shape.model, zeal::detail::run_shape_of(c, spec.world, false));
    double bytes = 0;
    for (const auto& part : p.parts)
      if (part.name == "master weights") bytes += static_cast<double>(part.bytes);
    return bytes;
  };
  const RunResult plain = run_engine(s, "param_master_alias");
  const double plain_predicted = predicted_master(s);
  const fs::path dir = temp_dir("param_master_copy");
  s.param_nvme_path = dir.string();
  s.param_max_in_cpu = 0;
  const RunResult stored = run_engine(s, "param_master_copy");
  expect_bit_identical(plain, stored);
  const double predicted = predicted_master(s);
  EXPECT_EQ(plain_predicted, 0);
  for (size_t r = 0; r < stored.params.size(); ++r) {
    EXPECT_EQ(plain.memory[r][2].item<double>(), 0) << "rank " << r << ": fp32 parameters are their own master";
    const double held = stored.memory[r][2].item<double>();
    EXPECT_GT(held, 0) << "rank " << r;
    EXPECT_NEAR(predicted, held, 0.02 * held + 4096) << "rank " << r << ": the master copy the estimate predicts";
  }
  fs::remove_all(dir);
}

// Shards come off the disk ahead of their all-gather on the reader thread, along the recorded
// order past the units being prefetched (one here), as far as offload_param.buffer_count and
// buffer_size allow: with room for one block's shards they are read ahead, the same bits; with
// buffer_size below one block's shards nothing is (every read on demand), the same bits again.
TEST(OffloadParamNvme, ReadsAheadWithinItsBuffers) {
  namespace fs = std::filesystem;
  RunSpec s;
  s.stage = 3;
  s.world = 2;
  s.accumulation = 2;
  s.freeze_ln1 = true;
  s.layers = 4;
  s.prefetch = 1;  // all-gathers prefetch one unit ahead
  const RunResult plain = run_engine(s, "param_ahead_off");
  const fs::path dir = temp_dir("param_swap_ahead");
  s.param_nvme_path = dir.string();
  s.nvme_path = dir.string();
  s.sub_group = 1000;
  int64_t block_elems = 0;
  {
    zeal_test::Setup u = make_setup(s);
    for (const auto& item : u.model->named_parameters())
      if (item.key().rfind("block0.", 0) == 0) block_elems += item.value().numel();
  }
  const int64_t shard = (block_elems + s.world - 1) / s.world;
  s.param_buffer_count = 1;
  s.param_buffer_size = shard + 1024;  // the shard's two parts with their padding, not two blocks
  const RunResult ahead = run_engine(s, "param_ahead_on");
  expect_bit_identical(plain, ahead);
  s.param_buffer_size = shard / 2;
  const RunResult none = run_engine(s, "param_ahead_none");
  expect_bit_identical(plain, none);
  for (size_t r = 0; r < plain.params.size(); ++r) {
    EXPECT_GT(ahead.memory[r][11].item<double>(), 0) << "rank " << r << ": nothing was read ahead";
    EXPECT_EQ(none.memory[r][11].item<double>(), 0) << "rank " << r << ": read ahead beyond buffer_size";
  }
  std::printf("metric reads_ahead %g waited %g (rank 0)\n", ahead.memory[0][11].item<double>(),
              ahead.memory[0][12].item<double>());
  EXPECT_TRUE(fs::is_empty(dir)) << "swap files left in " << dir;
  fs::remove_all(dir);
}

// engine.gathered with a modifier rank on parameters that live on disk: the new values reach the
// swap file, so every rank reads them back after the unit was released and gathered again.
TEST(OffloadParamNvme, GatheredModificationReachesTheDisk) {
  namespace fs = std::filesystem;
  const fs::path swap = temp_dir("param_swap_modify");
  const std::string out = temp_dir("param_swap_modify_out");
  RunSpec s;
  s.stage = 3;
  s.world = 2;
  s.param_nvme_path = swap.string();
  auto results = zeal::spawn(
      [&](zeal::Runtime& rt) {
        zeal::Engine engine(make_config(s), rt);
        zeal_test::Setup u = make_setup(s);
        torch::optim::SGD opt(u.trainable, torch::optim::SGDOptions(0.0));  // lr 0: values stay
        auto [m, o] = engine.prepare(u.model, opt);
        const at::Tensor w = m->blocks[1]->inner->fc1->weight;
        {
          auto g = engine.gathered(std::vector<at::Tensor>{w}, /*modifier_rank=*/1);
          if (engine.process_index() == 1) w.detach().fill_(0.25);
        }
        {
          auto g = engine.gathered();  // straight from the disk
          write_tensor(out + "/before_step_" + std::to_string(engine.process_index()), w.detach().clone());
        }
        at::Tensor tokens = make_tokens(2);
        engine.backward(lm_loss(m, tokens));
        o.step();
        o.zero_grad();
        auto g = engine.gathered();
        write_tensor(out + "/w_" + std::to_string(engine.process_index()), w.detach().clone());
        write_tensor(out + "/p_" + std::to_string(engine.process_index()), flat_params(*m));
      },
      s.world);
  ASSERT_EQ(zeal::describe_failures(results), "");
  zeal_test::Setup ref = make_setup(s);
  ref.model->blocks[1]->inner->fc1->weight.detach().fill_(0.25);
  for (int r = 0; r < s.world; ++r) {
    const at::Tensor w = read_tensor(out + "/w_" + std::to_string(r));
    EXPECT_TRUE(at::equal(w, at::full_like(w, 0.25))) << "rank " << r;
    const at::Tensor b = read_tensor(out + "/before_step_" + std::to_string(r));
    EXPECT_TRUE(at::equal(b, at::full_like(b, 0.25))) << "rank " << r << ", before the step";
    EXPECT_TRUE(at::equal(read_tensor(out + "/p_" + std::to_string(r)), flat_params(*ref.model))) << "rank " << r;
  }
  EXPECT_TRUE(fs::is_empty(swap));
  fs::remove_all(swap);
  fs::remove_all(out);
}

// Not enough room for the parameters on disk: prepare names the directory, what is needed and what
// is free, before anything is trained (an 8 KiB tmpfs mounted for the test, a page of it for the
// run's owner file; skipped where mounting is not permitted).
TEST(OffloadParamNvme, AShortfallIsNamedBeforeTraining) {
  namespace fs = std::filesystem;
  const fs::path root = temp_dir("param_swap_small");
  if (::mount("tmpfs", root.c_str(), "tmpfs", 0, "size=8k") != 0) {
    const std::string why = std::strerror(errno);
    fs::remove_all(root);
    GTEST_SKIP() << "cannot mount a small tmpfs here (" << why << ")";
  }
  RunSpec s;
  s.stage = 3;
  s.world = 2;
  s.param_nvme_path = root.string();
  const std::string e = error_on_one_rank("param_swap_small_run", [&](zeal::Runtime& rt) {
    zeal::Engine engine(make_config(s), rt);
    zeal_test::Setup u = make_setup(s);
    (void)engine.prepare(u.model, *u.opt);
  });
  ::umount(root.c_str());
  fs::remove_all(root);
  // The check at prepare, before anything is written: the folder, the need and what is free.
  EXPECT_NE(e.find("offload: the swap files need about"), std::string::npos) << e;
  EXPECT_NE(e.find("in " + root.string() + " (the parameters' "), std::string::npos) << e;
  EXPECT_NE(e.find("), but its file system has 8.00 KiB free"), std::string::npos) << e;
}

}  // namespace
}  // namespace zeal_test
