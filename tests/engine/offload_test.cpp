// Offload to host memory (offload_optimizer.device cpu; in stage 3 offload_param.device cpu too):
// the master weights and Adam's state live in the offload manager's arena and the step streams the
// gradients in and the parameters out. Same arithmetic, so the same bits as without offload, on
// 1–3 ranks, stages 1–3, fp32 and bf16, with accumulation and clipping.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <ostream>
#include <string>

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
  ASSERT_EQ(plain.params.size(), off.params.size());
  for (size_t r = 0; r < off.params.size(); ++r) {
    EXPECT_TRUE(at::equal(plain.params[r], off.params[r])) << "rank " << r << ": parameters differ after "
                                                           << s.steps << " steps";
    EXPECT_TRUE(at::equal(plain.trajectory[r], off.trajectory[r])) << "rank " << r;
  }
  EXPECT_TRUE(at::equal(plain.losses, off.losses));
  EXPECT_TRUE(at::equal(plain.norms, off.norms));
  // What the offload manager holds: an fp32 master (4 B), m and v (8 B), and the step's fp32
  // gradient (4 B) and compute-precision result (P B) buffers for every element this rank owns.
  const double p_bytes = c.precision == "no" ? 4 : 2;
  for (size_t r = 0; r < off.params.size(); ++r) {
    const double master = off.memory[r][2].item<double>(), state = off.memory[r][3].item<double>();
    const double owned = master / 4;
    EXPECT_GT(owned, 0);
    EXPECT_EQ(state, 8 * owned);
    EXPECT_EQ(off.memory[r][9].item<double>(), (4 + 8 + 4 + p_bytes) * owned) << "rank " << r;
    EXPECT_EQ(plain.memory[r][9].item<double>(), 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, OffloadCpu,
                         ::testing::Values(OffloadCase{1, 1, "no", 1}, OffloadCase{1, 2, "bf16", 2},
                                           OffloadCase{2, 2, "no", 2}, OffloadCase{2, 3, "bf16", 1},
                                           OffloadCase{3, 1, "bf16", 1}, OffloadCase{3, 2, "no", 2},
                                           OffloadCase{3, 3, "bf16", 2}),
                         case_name);

// Parameters to NVMe are named as not there yet, with the key; nothing starts.
TEST(Offload, ParameterNvmeIsRefusedNamingTheKey) {
  const std::string e = error_on_one_rank("offload_nvme", [](zeal::Runtime& rt) {
    zeal::Config c = zeal::Config::defaults(false);
    c.zero.stage = 3;
    c.zero.offload_param.device = zeal::OffloadDevice::kNvme;
    c.zero.offload_param.nvme_path = "/tmp";
    zeal::Engine engine(c, rt);
  });
  EXPECT_NE(e.find("zero_optimization.offload_param.device: nvme offload of parameters is not available"),
            std::string::npos)
      << e;
}

// The optimizer state on disk (offload_optimizer.device nvme, stage 3), updated window by window of
// sub_group_size elements (1000 here: many windows per partition): the same bits as without
// offload, through io_uring and through the thread-pool fallback; the swap files hold 3 regions
// (master, m, v) of the rank's elements, the host only five window buffers; nothing is left on disk.
struct NvmeCase {
  int world;
  std::string precision;
  int accumulation;
  bool threads;  // ZEAL_OFFLOAD_IO=threads
};

void PrintTo(const NvmeCase& c, std::ostream* os) {
  *os << c.world << " ranks, " << c.precision << ", accumulation " << c.accumulation << (c.threads ? ", threads" : "");
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
  const RunResult plain = run_engine(s, "nvme_off");
  const fs::path dir = temp_dir("nvme_swap");
  s.nvme_path = dir.string();
  if (c.threads) ::setenv("ZEAL_OFFLOAD_IO", "threads", 1);
  const RunResult off = run_engine(s, "nvme_on");
  ::unsetenv("ZEAL_OFFLOAD_IO");
  for (size_t r = 0; r < off.params.size(); ++r) {
    EXPECT_TRUE(at::equal(plain.params[r], off.params[r])) << "rank " << r;
    EXPECT_TRUE(at::equal(plain.trajectory[r], off.trajectory[r])) << "rank " << r;
  }
  EXPECT_TRUE(at::equal(plain.losses, off.losses));
  EXPECT_TRUE(at::equal(plain.norms, off.norms));
  const double p_bytes = c.precision == "no" ? 4 : 2;
  for (size_t r = 0; r < off.params.size(); ++r) {
    const double owned = plain.memory[r][3].item<double>() / 8;  // Adam's state: 8 bytes per owned element
    ASSERT_GT(owned, 1000) << "the partition must span several windows";
    const double region = std::ceil(owned * 4 / 4096) * 4096;
    EXPECT_EQ(off.memory[r][10].item<double>(), 3 * region) << "rank " << r;
    EXPECT_EQ(off.memory[r][3].item<double>(), 0) << "rank " << r << ": optimizer state held in memory";
    EXPECT_EQ(off.memory[r][9].item<double>(), (4 * 4 + p_bytes) * 1024) << "rank " << r << ": window buffers";
  }
  EXPECT_TRUE(fs::is_empty(dir)) << "swap files left in " << dir;
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Cases, OffloadNvme,
                         ::testing::Values(NvmeCase{1, "no", 1, false}, NvmeCase{2, "bf16", 2, false},
                                           NvmeCase{3, "no", 1, false}, NvmeCase{2, "no", 2, true}));

}  // namespace
}  // namespace zeal_test
