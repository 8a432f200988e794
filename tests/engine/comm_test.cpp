// The communicator over 1–4 ranks started by zeal::spawn: every collective against values each
// rank computes itself, and the failure behaviour (timeouts, dead peers, mismatched calls).
#include <ATen/ATen.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <gtest/gtest.h>
#include <dirent.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>

#include <chrono>
#include <cstdlib>
#include <map>
#include <string>
#include <thread>

#include "engine/comm/selfcheck.h"
#include "engine/runtime/dist_env.h"
#include "engine/runtime/runtime.h"
#include "engine/runtime/spawn.h"

namespace zeal {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

class Collectives : public ::testing::TestWithParam<int> {};

TEST_P(Collectives, EveryOpDtypeAndUnevenSizeMatchesLocalValues) {
  const int world = GetParam();
  auto results = spawn(
      [](Runtime& rt) {
        EXPECT_EQ(rt.comm().backend(), "gloo");
        const auto checks = run_collective_checks(rt.comm());
        std::string failed;
        for (const auto& c : checks) {
          if (!c.passed) failed += c.name + " " + c.detail + "\n";
        }
        if (checks.size() < 100) throw Error("too few checks ran: " + std::to_string(checks.size()));
        if (!failed.empty()) throw Error(failed);
      },
      world);
  EXPECT_EQ(describe_failures(results), "");
}

INSTANTIATE_TEST_SUITE_P(World, Collectives, ::testing::Values(1, 2, 3, 4));

// The runtime's host communicator takes CPU and CUDA tensors; anything else is named with the
// operation and the device, before the collective is counted (the ranks stay in step).
TEST(Collectives, ATensorOnAnotherDeviceIsNamed) {
  auto results = spawn(
      [](Runtime& rt) {
        Communicator& c = rt.comm();
        const at::Tensor meta = at::empty({8}, at::TensorOptions().device(at::kMeta));
        const at::Tensor cpu = at::ones({8});
        const uint64_t before = c.sequence();
        auto expect_error = [&](const char* what, auto&& call, const std::string& words) {
          try {
            call();
          } catch (const Error& e) {
            if (std::string(e.what()).find(words) == std::string::npos) {
              throw Error(std::string(what) + ": the error does not say '" + words + "': " + e.what());
            }
            return;
          }
          throw Error(std::string(what) + " took a tensor on the meta device");
        };
        expect_error("all_reduce", [&] { c.all_reduce(meta, ReduceOp::kSum); }, "all_reduce: a tensor is on meta");
        expect_error("broadcast", [&] { c.broadcast(meta, 0); }, "broadcast: a tensor is on meta");
        expect_error("all_gather", [&] { c.all_gather(meta.narrow(0, 0, 4), cpu); }, "all_gather: a tensor is on meta");
        expect_error("reduce_scatter", [&] { c.reduce_scatter(meta, cpu.narrow(0, 0, 4), ReduceOp::kSum); },
                     "reduce_scatter: a tensor is on meta");
        if (c.sequence() != before) throw Error("a refused call was counted as a collective");
        // And the ranks are still in step: a real collective after the refusals.
        at::Tensor t = at::full({3}, static_cast<double>(rt.rank() + 1));
        c.all_reduce(t, ReduceOp::kSum).wait();
        const double want = rt.world_size() * (rt.world_size() + 1) / 2.0;
        if (!at::equal(t, at::full({3}, want))) throw Error("the all_reduce after the refusals is wrong");
      },
      2);
  EXPECT_EQ(describe_failures(results), "");
}

TEST(Collectives, ReduceScatterOfAnUnevenBufferByHand) {
  // 3 ranks, 10 elements: shards of 4, 4 and 2 (+2 padding). Rank r contributes (r+1)·i.
  auto results = spawn(
      [](Runtime& rt) {
        at::Tensor input = at::arange(10, at::kDouble) * (rt.rank() + 1);
        at::Tensor shard = at::empty({4}, at::kDouble);
        rt.comm().reduce_scatter(input, shard, ReduceOp::kSum).wait();
        for (int64_t j = 0; j < 4; ++j) {
          const int64_t g = rt.rank() * 4 + j;
          const double want = g < 10 ? 6.0 * g : 0.0;  // (1+2+3)·g
          if (shard[j].item<double>() != want) {
            throw Error("rank " + std::to_string(rt.rank()) + " element " + std::to_string(j) + ": " +
                        std::to_string(shard[j].item<double>()) + " != " + std::to_string(want));
          }
        }
      },
      3);
  EXPECT_EQ(describe_failures(results), "");
}

TEST(Spawn, ReportsEachRanksExceptionAndExitStatus) {
  auto results = spawn(
      [](Runtime& rt) {
        if (rt.rank() == 1) throw Error("rank one gives up");
      },
      3);
  ASSERT_EQ(results.size(), 3u);
  EXPECT_TRUE(results[0].ok());
  EXPECT_FALSE(results[1].ok());
  EXPECT_EQ(results[1].exit_code, 1);
  EXPECT_NE(results[1].failure.find("rank one gives up"), std::string::npos);
  EXPECT_TRUE(results[2].ok());
}

TEST(Failure, StuckRankIsNamedByTheOthersWithinTheTimeout) {
  SpawnOptions o;
  o.comm_timeout = 3;
  o.grace_seconds = 2;
  const auto t0 = Clock::now();
  auto results = spawn(
      [](Runtime& rt) {
        if (rt.rank() == 1) std::this_thread::sleep_for(std::chrono::seconds(120));  // never arrives
        at::Tensor t = at::ones({1000});
        rt.comm().all_reduce(t, ReduceOp::kSum).wait();
      },
      3, o);
  const double took = seconds_since(t0);
  EXPECT_LT(took, o.comm_timeout + 10);
  for (int r : {0, 2}) {
    EXPECT_FALSE(results[r].ok()) << "rank " << r;
    const std::string& f = results[r].failure;
    EXPECT_NE(f.find("collective #1 all_reduce(sum) of 1000 float32"), std::string::npos) << f;
    EXPECT_NE(f.find("missing: rank 1 has not reached it"), std::string::npos) << f;
    EXPECT_NE(f.find("rank 1 has not entered any collective"), std::string::npos) << f;
    EXPECT_EQ(f.find("rank 1 has not entered any collective and is not responding"), std::string::npos)
        << "a sleeping rank is alive: " << f;
  }
  EXPECT_EQ(results[1].signal, SIGKILL) << "the stuck rank is stopped";
}

TEST(Failure, DeadPeerIsReportedQuicklyAndNamed) {
  SpawnOptions o;
  o.comm_timeout = 30;
  o.grace_seconds = 5;
  const auto t0 = Clock::now();
  auto results = spawn(
      [](Runtime& rt) {
        at::Tensor t = at::ones({10});
        rt.comm().all_reduce(t, ReduceOp::kSum).wait();  // collective #1: everyone
        if (rt.rank() == 2) std::_Exit(7);               // dies before #2
        rt.comm().all_reduce(t, ReduceOp::kSum).wait();
      },
      3, o);
  EXPECT_LT(seconds_since(t0), o.comm_timeout) << "a dead peer must not cost the whole timeout";
  EXPECT_EQ(results[2].exit_code, 7);
  bool named = false;
  for (int r : {0, 1}) {
    EXPECT_FALSE(results[r].ok());
    EXPECT_EQ(results[r].signal, 0) << "rank " << r << " must report the dead peer, not die of SIGPIPE writing to it";
    const std::string& f = results[r].failure;
    EXPECT_NE(f.find("collective #2"), std::string::npos) << f;
    EXPECT_NE(f.find("missing: rank 2 has not reached it"), std::string::npos) << f;
    named = named || f.find("and is not responding") != std::string::npos;
  }
  EXPECT_TRUE(named) << "the dead rank is told apart from a slow one\n" << results[0].failure;
}

TEST(Failure, MismatchedCollectivesUnderDebugNameBothSides) {
  SpawnOptions o;
  o.debug_collectives = true;
  o.comm_timeout = 20;
  auto results = spawn(
      [](Runtime& rt) {
        at::Tensor t = at::ones({8});
        rt.comm().all_reduce(t, ReduceOp::kSum).wait();  // #1 agrees
        if (rt.rank() == 0) {
          rt.comm().all_reduce(t, ReduceOp::kSum).wait();
        } else {
          at::Tensor out = at::empty({16}, at::kBFloat16);
          rt.comm().all_gather(at::ones({8}, at::kBFloat16), out).wait();
        }
      },
      2, o);
  for (int r : {0, 1}) {
    ASSERT_FALSE(results[r].ok());
    const std::string& f = results[r].failure;
    EXPECT_NE(f.find("collective #2 differs between ranks"), std::string::npos) << f;
    EXPECT_NE(f.find("all_reduce(sum) of 8 float32"), std::string::npos) << f;
    EXPECT_NE(f.find("all_gather of 16 bfloat16"), std::string::npos) << f;
  }
}

TEST(Failure, WrongShardSizeIsAnErrorNotAHang) {
  auto results = spawn(
      [](Runtime& rt) {
        at::Tensor out = at::empty({10});
        rt.comm().all_gather(at::ones({3}), out).wait();  // needs 5 per rank
      },
      2);
  for (const auto& r : results) EXPECT_NE(r.failure.find("needs shards of 5 float32"), std::string::npos) << r.failure;
}

// DistEnv reads the launchers' variables.
class EnvGuard {
 public:
  explicit EnvGuard(std::map<std::string, std::string> vars) {
    for (const char* v : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR",
                          "MASTER_PORT", "ZEAL_LAUNCH", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                          "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_NODE_RANK",
                          "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE",
                          "SLURM_TASKS_PER_NODE", "SLURM_NODEID"}) {
      if (const char* old = std::getenv(v)) saved_[v] = old;
      unsetenv(v);
    }
    for (const auto& [k, v] : vars) setenv(k.c_str(), v.c_str(), 1);
    set_ = vars;
  }
  ~EnvGuard() {
    for (const auto& [k, v] : set_) unsetenv(k.c_str());
    for (const auto& [k, v] : saved_) setenv(k.c_str(), v.c_str(), 1);
  }

 private:
  std::map<std::string, std::string> saved_, set_;
};

TEST(DistEnv, SingleProcessWithoutVariables) {
  EnvGuard g(std::map<std::string, std::string>{});
  DistEnv e = DistEnv::from_environment();
  EXPECT_EQ(e.world_size, 1);
  EXPECT_EQ(e.rank, 0);
  EXPECT_EQ(e.source, "single process");
}

TEST(DistEnv, Torchrun) {
  EnvGuard g({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"}, {"GROUP_RANK", "1"},
              {"MASTER_ADDR", "10.0.0.9"}, {"MASTER_PORT", "1234"}});
  DistEnv e = DistEnv::from_environment();
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 4);
  EXPECT_EQ(e.node_rank, 1);
  EXPECT_EQ(e.master_addr, "10.0.0.9");
  EXPECT_EQ(e.master_port, 1234);
  EXPECT_EQ(e.source, "torchrun");
}

TEST(DistEnv, OpenMpi) {
  EnvGuard g({{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "4"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
              {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}, {"OMPI_COMM_WORLD_NODE_RANK", "1"}});
  DistEnv e = DistEnv::from_environment();
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.world_size, 4);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.node_rank, 1);
  EXPECT_EQ(e.source, "Open MPI");
}

TEST(DistEnv, Slurm) {
  EnvGuard g({{"SLURM_PROCID", "6"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "2"}, {"SLURM_TASKS_PER_NODE", "4(x2)"},
              {"SLURM_NODEID", "1"}});
  DistEnv e = DistEnv::from_environment();
  EXPECT_EQ(e.rank, 6);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 2);
  EXPECT_EQ(e.local_world_size, 4);
  EXPECT_EQ(e.node_rank, 1);
  EXPECT_EQ(e.source, "Slurm");
}

TEST(DistEnv, InconsistentValuesNameTheVariable) {
  {
    EnvGuard g({{"RANK", "4"}, {"WORLD_SIZE", "4"}});
    try {
      DistEnv::from_environment();
      FAIL() << "no error";
    } catch (const Error& e) {
      EXPECT_STREQ(e.what(), "RANK=4 is not below WORLD_SIZE=4");
    }
  }
  {
    EnvGuard g(std::map<std::string, std::string>{{"RANK", "1"}});
    EXPECT_THROW(DistEnv::from_environment(), Error);
  }
  {
    EnvGuard g({{"RANK", "0"}, {"WORLD_SIZE", "two"}});
    try {
      DistEnv::from_environment();
      FAIL() << "no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("WORLD_SIZE=two"), std::string::npos);
    }
  }
}

TEST(Rendezvous, UnreachableMasterIsAClearErrorAfterTheTimeout) {
  // A port nothing listens on: bind one, note it, close it.
  EnvGuard g({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "1"}});
  RuntimeOptions o;
  o.comm_timeout = 2;
  o.report_uncaught = false;
  const auto t0 = Clock::now();
  try {
    Runtime rt(DistEnv::from_environment(), o);
    FAIL() << "joined a group with no master";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 cannot reach the rendezvous store at 127.0.0.1:1"), std::string::npos)
        << e.what();
  }
  EXPECT_LT(seconds_since(t0), 15);
}

// Rank 0 hosts the store; when it dies, a rank waiting on the store hears who is gone, not
// c10d's bare "Connection reset by peer" (the engine's start-up waits on the store this way).
TEST(Rendezvous, StoreHostThatDiesIsNamedByAWaitingRank) {
  const int port = 31900 + static_cast<int>(getpid() % 500);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {  // rank 0: meets rank 1, then dies without a word
    EnvGuard g({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(port)}});
    try {
      RuntimeOptions o;
      o.comm_timeout = 20;
      o.report_uncaught = false;
      Runtime rt(DistEnv::from_environment(), o);
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
      _exit(0);  // as a killed process: no goodbye
    } catch (...) {
      _exit(3);
    }
    _exit(0);
  }
  EnvGuard g({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(port)}});
  RuntimeOptions o;
  o.comm_timeout = 20;
  o.report_uncaught = false;
  std::string message;
  const auto t0 = Clock::now();
  {
    Runtime rt(DistEnv::from_environment(), o);
    try {
      rt.store_get("never-set");
    } catch (const std::exception& e) {
      message = e.what();
    }
  }
  int status = 0;
  waitpid(child, &status, 0);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  EXPECT_NE(message.find("rank 1: store_get(never-set): lost the store:"), std::string::npos) << message;
  EXPECT_NE(message.find("rank 0, which hosts the rendezvous store at 127.0.0.1:" + std::to_string(port) +
                         ", exited or closed it?"),
            std::string::npos)
      << message;
  EXPECT_LT(seconds_since(t0), 15) << message;
}

}  // namespace
}  // namespace zeal
