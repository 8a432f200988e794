// `zeal launch` and `zeal test` as a user runs them: the ranks' environment, prefixed output,
// teardown when a rank fails, signals, and the errors that must not be hangs.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include "tests/cli/run_zeal.h"

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {


bool alive(pid_t pid) { return kill(pid, 0) == 0; }

// This binary as a rank program for PeakIncludesWhatARankResetItself (ZEAL_TEST_HWM_CHILD set): it
// touches 256 MiB, gives them back, then resets its own high-water mark as zeal's memory tracker
// does per phase (after which the kernel's ru_maxrss no longer shows them) and lingers a moment.
const bool g_hwm_child = [] {
  if (!std::getenv("ZEAL_TEST_HWM_CHILD")) return false;
  const size_t n = size_t{256} << 20;
  void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) _exit(3);
  std::memset(p, 1, n);
  munmap(p, n);
  std::this_thread::sleep_for(std::chrono::milliseconds(600));
  std::ofstream("/proc/self/clear_refs") << "5";
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  _exit(0);
}();

// Alive and not a zombie waiting for a parent to reap it.
bool running(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  if (!std::getline(f, stat)) return false;
  const auto close = stat.rfind(')');
  return close != std::string::npos && close + 2 < stat.size() && stat[close + 2] != 'Z' && stat[close + 2] != 'X';
}

// Distinct ports per test so ctest -j can run them side by side.
int port_for(int i) { return 29700 + (getpid() % 100) * 10 + i; }
int port_for2(int i) { return 30800 + (getpid() % 100) * 10 + i; }

class Launch : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("zeal_launch_" + std::to_string(getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // The pids the ranks wrote to pid.<rank>, waiting up to 10 s for `n` of them.
  std::vector<pid_t> pids(int n) {
    std::vector<pid_t> out;
    for (int tries = 0; tries < 200; ++tries) {
      out.clear();
      for (int r = 0; r < n; ++r) {
        std::ifstream f(dir_ / ("pid." + std::to_string(r)));
        pid_t p = 0;
        if (f >> p) out.push_back(p);
      }
      if (static_cast<int>(out.size()) == n) return out;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return out;
  }

  fs::path dir_;
};

TEST_F(Launch, EveryRankGetsTheTorchrunEnvironmentAndPrefixedOutput) {
  const int port = port_for(0);
  Result r = run_zeal("launch --num_processes 3 --main_process_port " + std::to_string(port) +
                      " --config_file configs/zero2.yaml sh -c "
                      "'echo \"env $RANK $LOCAL_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE $NODE_RANK $MASTER_ADDR $MASTER_PORT "
                      "$ZEAL_CONFIG_FILE\"; echo \"to stderr $RANK\" >&2'");
  ASSERT_EQ(r.status, 0) << r.output;
  const std::string config = fs::absolute("configs/zero2.yaml").string();
  for (int rank = 0; rank < 3; ++rank) {
    const std::string want = "[rank " + std::to_string(rank) + "] env " + std::to_string(rank) + " " +
                             std::to_string(rank) + " 3 3 0 127.0.0.1 " + std::to_string(port) + " " + config;
    EXPECT_NE(r.output.find(want), std::string::npos) << want << "\n" << r.output;
    EXPECT_NE(r.output.find("[rank " + std::to_string(rank) + "] to stderr " + std::to_string(rank)), std::string::npos);
  }
}

TEST_F(Launch, TorchrunNamesAndOverridesReachTheRanks) {
  Result r = run_zeal("launch --nproc_per_node 2 --master_port " + std::to_string(port_for(1)) +
                      " --mixed_precision bf16 sh -c 'echo \"w=$WORLD_SIZE mp=$ZEAL_MIXED_PRECISION\"'");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("[rank 1] w=2 mp=bf16"), std::string::npos) << r.output;
}

TEST_F(Launch, QuietRanksShowsRankZeroOnly) {
  Result r = run_zeal("launch --num_processes 3 --quiet_ranks --main_process_port " + std::to_string(port_for(2)) +
                      " sh -c 'echo hello $RANK'");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("[rank 0] hello 0"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("[rank 1]"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("[rank 2]"), std::string::npos) << r.output;
}

TEST_F(Launch, OneRankExitingThreeStopsTheOthersAndExitsThree) {
  const std::string script = "echo $$ > " + dir_.string() +
                             "/pid.$RANK; if [ $RANK = 1 ]; then sleep 1; echo about to fail; exit 3; fi; exec sleep 60";
  Result r = run_zeal("launch --num_processes 3 --main_process_port " + std::to_string(port_for(3)) + " sh -c '" +
                      script + "'");
  EXPECT_EQ(r.status, 3) << r.output;
  EXPECT_LT(r.seconds, 15) << r.output;
  EXPECT_NE(r.output.find("rank 1 (local rank 1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("exited with status 3; stopping 2 other ranks"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("  | about to fail"), std::string::npos) << "the failed rank's last lines\n" << r.output;
  for (pid_t p : pids(3)) EXPECT_FALSE(alive(p)) << "rank process " << p << " still running";
}

TEST_F(Launch, RankKilledBySignalIsReportedWithTheSignal) {
  Result r = run_zeal("launch --num_processes 2 --main_process_port " + std::to_string(port_for(4)) +
                      " sh -c 'if [ $RANK = 0 ]; then kill -9 $$; fi; exec sleep 60'");
  EXPECT_EQ(r.status, 128 + 9) << r.output;
  EXPECT_NE(r.output.find("rank 0 (local rank 0"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("was killed by signal 9 (KILL)"), std::string::npos) << r.output;
}

TEST_F(Launch, SigintToTheLauncherStopsEveryRank) {
  // Rank 1 ignores SIGINT: it must still go, by SIGKILL after the grace period.
  const std::string script = "if [ $RANK = 1 ]; then trap \"\" INT; fi; echo $$ > " + dir_.string() +
                             "/pid.$RANK; while true; do sleep 0.1; done";
  const pid_t launcher = fork();
  ASSERT_GE(launcher, 0);
  if (launcher == 0) {
    const std::string port = std::to_string(port_for(5));
    execl(ZEAL_CLI, ZEAL_CLI, "launch", "--num_processes", "3", "--stop_grace", "1", "--main_process_port", port.c_str(),
          "sh", "-c", script.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  const auto ranks = pids(3);
  ASSERT_EQ(ranks.size(), 3u);
  const auto t0 = Clock::now();
  kill(launcher, SIGINT);
  int status = 0;
  ASSERT_EQ(waitpid(launcher, &status, 0), launcher);
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 10);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 130);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  for (pid_t p : ranks) EXPECT_FALSE(alive(p)) << "rank process " << p << " still running";
}

TEST_F(Launch, PortInUseIsAnErrorBeforeAnythingStarts) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ASSERT_EQ(listen(fd, 1), 0);
  socklen_t len = sizeof a;
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  const int port = ntohs(a.sin_port);
  Result r = run_zeal("launch --num_processes 2 --main_process_port " + std::to_string(port) + " sh -c 'echo started'");
  close(fd);
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("port " + std::to_string(port) + " is already in use"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("started"), std::string::npos) << r.output;
}

TEST_F(Launch, MissingProgramIsAnError) {
  Result r = run_zeal("launch --num_processes 2 no-such-program-zeal");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("cannot find the program 'no-such-program-zeal'"), std::string::npos) << r.output;
}

TEST_F(Launch, RanksStartedWithDifferentWorldSizesAreToldSo) {
  const std::string worker = std::string("ZEAL_TEST_WORKER=1 ") + ZEAL_CLI + " test";
  Result r = run_zeal("launch --num_processes 2 --comm_timeout 20 --main_process_port " + std::to_string(port_for(6)) +
                      " sh -c 'if [ $RANK = 1 ]; then export WORLD_SIZE=3; fi; " + worker + "'");
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_LT(r.seconds, 15) << r.output;
  EXPECT_NE(r.output.find("rank 0 was started with WORLD_SIZE=2 but rank 1 with WORLD_SIZE=3"), std::string::npos)
      << r.output;
}

TEST_F(Launch, RanksStartedWithDifferentStagesAreToldSo) {
  const std::string worker = std::string("ZEAL_TEST_WORKER=1 ") + ZEAL_CLI + " test";
  Result r = run_zeal("launch --num_processes 2 --comm_timeout 20 --main_process_port " + std::to_string(port_for2(0)) +
                      " sh -c 'if [ $RANK = 1 ]; then export ZEAL_ZERO_STAGE=3; fi; " + worker + "'");
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_LT(r.seconds, 15) << r.output;
  const bool named = r.output.find("rank 0 was started with zero_optimization.stage 0 but rank 1 with 3") !=
                         std::string::npos ||
                     r.output.find("rank 1 was started with zero_optimization.stage 3 but rank 0 with 0") !=
                         std::string::npos;
  EXPECT_TRUE(named) << r.output;
  EXPECT_EQ(r.output.find("has not entered any collective"), std::string::npos) << r.output;
}

// Rank 0 hosts the store and leaves last: a rank that takes seconds more to finish (freeing
// gigabytes, deleting swap files) still says goodbye to a live store, and neither side prints c10d's
// warnings or a broken pipe from a run that succeeded.
TEST_F(Launch, RankZeroWaitsForASlowRankToLeaveQuietly) {
  Result r = run_zeal("launch --num_processes 2 --main_process_port " + std::to_string(port_for2(7)) + " " + ZEAL_CLI +
                          " test",
                      "ZEAL_TEST_WORKER=1 ZEAL_TEST_LINGER=1:3000");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("PASS"), std::string::npos) << r.output;
  for (const char* bad : {"waitForInput", "timed out", "Broken pipe", "broken pipe", "Exception raised", "[W"}) {
    EXPECT_EQ(r.output.find(bad), std::string::npos) << bad << " in:\n" << r.output;
  }
  EXPECT_GE(r.seconds, 3) << r.output;
}

// --verbose's peak per rank is the most the rank held, even where the rank reset its own
// high-water mark afterwards (the launcher reads it while the rank runs, not only at its exit).
TEST_F(Launch, PeakIncludesWhatARankResetItself) {
  char self[4096] = {};
  ASSERT_GT(readlink("/proc/self/exe", self, sizeof self - 1), 0);
  Result r = run_zeal("launch --verbose --num_processes 1 --main_process_port " + std::to_string(port_for2(5)) + " " + self,
                      "ZEAL_TEST_HWM_CHILD=1");
  ASSERT_EQ(r.status, 0) << r.output;
  const std::string key = "peak resident set per rank: rank 0 ";
  const auto at = r.output.find(key);
  ASSERT_NE(at, std::string::npos) << r.output;
  const double gib = std::atof(r.output.c_str() + at + key.size());
  EXPECT_GE(gib, 0.25) << r.output;
  EXPECT_LT(gib, 1.0) << r.output;
}

// kill -9 of the launcher: its ranks die with it (parent-death signal), none trains on as an orphan.
TEST_F(Launch, KilledLauncherLeavesNoRankBehind) {
  const std::string script = "echo $$ > " + dir_.string() + "/pid.$RANK; exec sleep 60";
  const pid_t launcher = fork();
  ASSERT_GE(launcher, 0);
  if (launcher == 0) {
    const std::string port = std::to_string(port_for2(1));
    execl(ZEAL_CLI, ZEAL_CLI, "launch", "--num_processes", "3", "--main_process_port", port.c_str(), "sh", "-c",
          script.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  const auto ranks = pids(3);
  ASSERT_EQ(ranks.size(), 3u);
  kill(launcher, SIGKILL);
  int status = 0;
  waitpid(launcher, &status, 0);
  for (pid_t p : ranks) {
    bool gone = false;
    for (int i = 0; i < 100 && !gone; ++i, std::this_thread::sleep_for(std::chrono::milliseconds(20))) gone = !running(p);
    EXPECT_TRUE(gone) << "rank process " << p << " outlived its launcher";
  }
}

// A SIGTERM as the ranks start: every rank that was started is stopped, the launcher exits 143.
TEST_F(Launch, SigtermWhileRanksStartStopsThoseStarted) {
  const std::string script = "echo $$ > " + dir_.string() + "/pid.$RANK; exec sleep 60";
  const pid_t launcher = fork();
  ASSERT_GE(launcher, 0);
  if (launcher == 0) {
    const std::string port = std::to_string(port_for2(2));
    execl(ZEAL_CLI, ZEAL_CLI, "launch", "--num_processes", "24", "--no_bind", "--stop_grace", "1",
          "--main_process_port", port.c_str(), "sh", "-c", script.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  for (int i = 0; i < 500 && !fs::exists(dir_ / "pid.0"); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  kill(launcher, SIGTERM);
  int status = 0;
  ASSERT_EQ(waitpid(launcher, &status, 0), launcher);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGTERM);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  int started = 0;
  for (int r = 0; r < 24; ++r) {
    std::ifstream f(dir_ / ("pid." + std::to_string(r)));
    pid_t p = 0;
    if (!(f >> p)) continue;
    ++started;
    EXPECT_FALSE(running(p)) << "rank " << r << " (pid " << p << ") still running";
  }
  EXPECT_GE(started, 1);
}

// A rank that exits 0 while the others still run is reported within seconds, not after comm_timeout.
TEST_F(Launch, RankExitingZeroEarlyIsReported) {
  Result r = run_zeal("launch --num_processes 3 --main_process_port " + std::to_string(port_for2(3)) +
                      " sh -c 'if [ $RANK = 2 ]; then exit 0; fi; sleep 8; echo done $RANK'");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("rank 2 exited with status 0"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("while ranks 0, 1 still run"), std::string::npos) << r.output;
  // Ranks that finish together are not reported.
  Result together = run_zeal("launch --num_processes 3 --main_process_port " + std::to_string(port_for2(4)) +
                             " sh -c 'sleep 0.$RANK; echo done'");
  EXPECT_EQ(together.status, 0) << together.output;
  EXPECT_EQ(together.output.find("exited with status 0"), std::string::npos) << together.output;
}

TEST_F(Launch, StopGraceMustBeSecondsFromZeroToAnHour) {
  for (const char* bad : {"-1", "nan", "1e30", "inf"}) {
    Result r = run_zeal(std::string("launch --stop_grace ") + bad + " --num_processes 1 sh -c 'echo started'");
    EXPECT_EQ(r.status, 2) << bad << "\n" << r.output;
    EXPECT_NE(r.output.find("--stop_grace"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("started"), std::string::npos) << r.output;
  }
}

// More ranks than cores, and more than memory holds: said before they start, with the numbers.
TEST_F(Launch, TooManyRanksAreWarnedAbout) {
  const unsigned cores = std::thread::hardware_concurrency();
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  double total_kib = 0;
  meminfo >> key >> total_kib;  // "MemTotal: N kB"
  // Each rank counts at least 64 MiB; enough ranks to pass 80 % of memory, if that is not absurd.
  const int for_memory = static_cast<int>(total_kib / (64 * 1024) * 0.8) + 2;
  const int n = std::max<int>(static_cast<int>(cores) + 1, for_memory <= 600 ? for_memory : 0);
  Result r = run_zeal("launch --no_bind --num_processes " + std::to_string(n) + " --main_process_port " +
                      std::to_string(port_for2(5)) + " true");
  EXPECT_EQ(r.status, 0) << r.output.substr(0, 2000);
  EXPECT_NE(r.output.find(std::to_string(n) + " ranks on " + std::to_string(cores) + " cores"), std::string::npos)
      << r.output.substr(0, 2000);
  if (for_memory <= 600) {
    EXPECT_NE(r.output.find(std::to_string(n) + " ranks need at least"), std::string::npos) << r.output.substr(0, 2000);
    EXPECT_NE(r.output.find("GiB of memory"), std::string::npos) << r.output.substr(0, 2000);
  }
}

// Rendezvous failures end fast with one line, without c10d's per-attempt logs and backtraces: a
// name that does not resolve at once, a port nothing answers on within ZEAL_CONNECT_TIMEOUT.
TEST_F(Launch, RendezvousFailuresAreOneLineAndFast) {
  const std::string worker = "ZEAL_TEST_WORKER=1 RANK=1 LOCAL_RANK=1 WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 ";
  Result unresolved = run_zeal("test", worker + "MASTER_ADDR=no-such-host.invalid MASTER_PORT=29999");
  EXPECT_EQ(unresolved.status, 2) << unresolved.output;
  EXPECT_LT(unresolved.seconds, 10) << unresolved.output;
  EXPECT_NE(unresolved.output.find("rendezvous address \"no-such-host.invalid\" (main_process_ip / MASTER_ADDR) does "
                                   "not resolve"),
            std::string::npos)
      << unresolved.output;
  Result silent = run_zeal("test --comm_timeout 600", worker + "MASTER_ADDR=127.0.0.1 MASTER_PORT=1 ZEAL_CONNECT_TIMEOUT=2");
  EXPECT_EQ(silent.status, 2) << silent.output;
  EXPECT_LT(silent.seconds, 15) << silent.output;
  EXPECT_NE(silent.output.find("rank 1 cannot reach the rendezvous store at 127.0.0.1:1 within 2 s"), std::string::npos)
      << silent.output;
  for (const Result* r : {&unresolved, &silent}) {
    EXPECT_EQ(r->output.find("[c10d]"), std::string::npos) << r->output;
    EXPECT_EQ(r->output.find("frame #"), std::string::npos) << r->output;
    EXPECT_EQ(r->output.find("Exception raised from"), std::string::npos) << r->output;
  }
}

TEST_F(Launch, ZealTestPassesOnFourProcesses) {
  Result r = run_zeal("test --num_processes 4 --main_process_port " + std::to_string(port_for(7)));
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("0 failed on 4 ranks (gloo, zeal launch)"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("FAIL "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("PASS  reduce_scatter(avg) bfloat16 n=9"), std::string::npos) << r.output;
}

}  // namespace

namespace {

// "0-2,5" → {0,1,2,5}
std::set<int> parse_cpu_list(const std::string& s) {
  std::set<int> out;
  std::stringstream in(s);
  std::string part;
  while (std::getline(in, part, ',')) {
    const auto dash = part.find('-');
    const int a = std::stoi(part.substr(0, dash));
    const int b = dash == std::string::npos ? a : std::stoi(part.substr(dash + 1));
    for (int c = a; c <= b; ++c) out.insert(c);
  }
  return out;
}

std::map<int, std::pair<std::set<int>, int>> affinity_by_rank(const std::string& output) {
  std::map<int, std::pair<std::set<int>, int>> m;
  std::stringstream in(output);
  std::string line;
  while (std::getline(in, line)) {
    int rank = -1, threads = 0;
    char list[256] = {0};
    if (std::sscanf(line.c_str(), "[rank %d] cpus %255s threads %d", &rank, list, &threads) == 3) {
      m[rank] = {parse_cpu_list(list), threads};
    }
  }
  return m;
}

TEST_F(Launch, EachLocalRankIsBoundToItsOwnCores) {
  const unsigned cores = std::thread::hardware_concurrency();
  if (cores < 2) GTEST_SKIP() << "needs two cores to show disjoint binding";
  const std::string probe =
      " sh -c 'echo cpus $(grep Cpus_allowed_list /proc/self/status | cut -f2) threads ${OMP_NUM_THREADS:-0}'";
  Result bound = run_zeal("launch --num_processes 2 --main_process_port " + std::to_string(port_for(8)) + probe,
                          "env -u OMP_NUM_THREADS");
  ASSERT_EQ(bound.status, 0) << bound.output;
  auto m = affinity_by_rank(bound.output);
  ASSERT_EQ(m.size(), 2u) << bound.output;
  for (int c : m[0].first) EXPECT_EQ(m[1].first.count(c), 0u) << "core " << c << " is in both ranks' sets\n" << bound.output;
  for (int r : {0, 1}) {
    EXPECT_FALSE(m[r].first.empty());
    EXPECT_EQ(m[r].second, static_cast<int>(m[r].first.size())) << "intra-op threads match the cores\n" << bound.output;
  }
  Result free = run_zeal("launch --no_bind --num_processes 2 --main_process_port " + std::to_string(port_for(9)) + probe,
                         "env -u OMP_NUM_THREADS");
  auto f = affinity_by_rank(free.output);
  ASSERT_EQ(f.size(), 2u) << free.output;
  EXPECT_EQ(f[0].first, f[1].first) << free.output;
  EXPECT_GE(f[0].first.size(), 2u) << free.output;
}

}  // namespace
