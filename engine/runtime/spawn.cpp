#include "engine/runtime/spawn.h"

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <ATen/Parallel.h>

#include <dlfcn.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <thread>

#include <fmt/format.h>

#include "engine/error.h"
#include "engine/runtime/runtime.h"

namespace zeal {
namespace {

using Clock = std::chrono::steady_clock;

[[noreturn]] void run_child(const std::function<void(Runtime&)>& fn, int rank, int nprocs, int go_fd, int report_fd,
                            const SpawnOptions& o) {
  // The parent hosts the store only once every child exists (see spawn): wait for its port.
  int port = 0;
  if (read(go_fd, &port, sizeof port) != static_cast<ssize_t>(sizeof port)) std::_Exit(3);
  close(go_fd);
  setenv("RANK", std::to_string(rank).c_str(), 1);
  const int per = o.ranks_per_machine > 0 ? o.ranks_per_machine : nprocs;
  setenv("LOCAL_RANK", std::to_string(rank % per).c_str(), 1);
  setenv("WORLD_SIZE", std::to_string(nprocs).c_str(), 1);
  setenv("LOCAL_WORLD_SIZE", std::to_string(per).c_str(), 1);
  setenv("NODE_RANK", std::to_string(rank / per).c_str(), 1);
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
  for (const auto& [k, v] : o.env) setenv(k.c_str(), v.c_str(), 1);
  // The parent's OpenMP pool does not survive fork; one intra-op thread is always safe.
  at::set_num_threads(1);
  int code = 0;
  std::string failure;
  try {
    DistEnv env = DistEnv::from_environment();
    RuntimeOptions ro;
    ro.comm_timeout = o.comm_timeout;
    ro.debug_collectives = o.debug_collectives;
    ro.store_hosted_elsewhere = true;
    ro.report_uncaught = false;
    Runtime rt(env, ro);
    fn(rt);
  } catch (const std::exception& e) {
    failure = without_backtrace(e.what());
    code = 1;
  } catch (...) {
    failure = "unknown exception";
    code = 1;
  }
  if (!failure.empty()) {
    if (failure.size() > 16000) failure.resize(16000);
    [[maybe_unused]] ssize_t n = write(report_fd, failure.data(), failure.size());
  }
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(code);
}

}  // namespace

bool cuda_initialized_in_this_process() {
  // The driver library is loaded only by a process that used CUDA (LibTorch's CUDA half loads
  // the runtime, which opens the driver at its first call). Before cuInit every driver call but a
  // few returns CUDA_ERROR_NOT_INITIALIZED: asking does not initialise anything. A cuInit that
  // found no device (CUDA_VISIBLE_DEVICES="") leaves nothing a child could trip over.
  void* driver = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
  if (!driver) return false;
  using DeviceGetCount = int (*)(int*);
  auto get_count = reinterpret_cast<DeviceGetCount>(dlsym(driver, "cuDeviceGetCount"));
  int count = 0;
  const bool initialized = get_count && get_count(&count) == 0 && count > 0;
  dlclose(driver);
  return initialized;
}

std::vector<RankResult> spawn(const std::function<void(Runtime&)>& fn, int nprocs, const SpawnOptions& o) {
  if (nprocs < 1) throw Error(fmt::format("spawn: nprocs must be at least 1, got {}", nprocs));
  if (cuda_initialized_in_this_process()) {
    throw Error("spawn: CUDA is already initialised in this process (a CUDA tensor, a GPU count, or at::manual_seed "
                "on a machine with a GPU), and ranks forked from it cannot use CUDA (their first CUDA call fails with "
                "\"initialization error\"). Call zeal::spawn before anything touches CUDA (seed the CPU generator with "
                "at::detail::getDefaultCPUGenerator().set_current_seed), or start the ranks with zeal launch");
  }
  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<RankResult> results(nprocs);
  std::vector<pid_t> pids(nprocs, -1);
  std::vector<int> report(nprocs, -1);
  std::vector<bool> running(nprocs, false);
  // Every child is forked before the store exists: forking while the store's server thread runs
  // (serving the ranks forked first) can copy a lock that thread holds into the child, which
  // then hangs. Each child waits on its own pipe for the port.
  std::vector<int> go(nprocs, -1);
  for (int r = 0; r < nprocs; ++r) {
    int fds[2], go_fds[2];
    if (pipe2(fds, O_CLOEXEC) != 0 || pipe2(go_fds, O_CLOEXEC) != 0) {
      throw Error(std::string("spawn: pipe: ") + std::strerror(errno));
    }
    const pid_t parent = getpid();
    const pid_t pid = fork();
    if (pid < 0) throw Error(std::string("spawn: fork: ") + std::strerror(errno));
    if (pid == 0) {
      // A rank never outlives the process that spawned it (killed with SIGKILL included).
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(1);
      close(fds[0]);
      close(go_fds[1]);
      run_child(fn, r, nprocs, go_fds[0], fds[1], o);
    }
    close(fds[1]);
    close(go_fds[0]);
    go[r] = go_fds[1];
    fcntl(fds[0], F_SETFL, O_NONBLOCK);
    pids[r] = pid;
    report[r] = fds[0];
    running[r] = true;
    results[r].rank = r;
  }
  c10d::TCPStoreOptions so;
  so.port = 0;  // any free port
  so.isServer = true;
  so.waitWorkers = false;
  so.timeout = std::chrono::milliseconds(static_cast<int64_t>(o.comm_timeout * 1000.0));
  c10::intrusive_ptr<c10d::TCPStore> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", so);
  } catch (...) {
    // The children read end-of-file instead of a port and exit.
    for (int r = 0; r < nprocs; ++r) {
      close(go[r]);
      waitpid(pids[r], nullptr, 0);
      close(report[r]);
    }
    throw;
  }
  const int port = store->getPort();
  for (int r = 0; r < nprocs; ++r) {
    [[maybe_unused]] ssize_t n = write(go[r], &port, sizeof port);
    close(go[r]);
  }

  auto read_report = [&](int r) {
    char buf[4096];
    for (;;) {
      const ssize_t n = read(report[r], buf, sizeof buf);
      if (n > 0) {
        results[r].failure.append(buf, static_cast<size_t>(n));
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      break;
    }
  };

  const auto start = Clock::now();
  std::optional<Clock::time_point> kill_at;
  int alive = nprocs;
  std::vector<bool> stopped(nprocs, false);
  while (alive > 0) {
    for (int r = 0; r < nprocs; ++r) {
      if (!running[r]) continue;
      read_report(r);
      int status = 0;
      const pid_t p = waitpid(pids[r], &status, WNOHANG);
      if (p != pids[r]) continue;
      read_report(r);
      running[r] = false;
      --alive;
      if (WIFEXITED(status)) {
        results[r].exit_code = WEXITSTATUS(status);
      } else if (WIFSIGNALED(status)) {
        results[r].exit_code = -1;
        results[r].signal = WTERMSIG(status);
        if (results[r].failure.empty()) {
          results[r].failure = stopped[r] ? "stopped: another rank failed or the run timed out"
                                          : fmt::format("killed by signal {}", sigabbrev_np(WTERMSIG(status)));
        }
      }
      if (!results[r].ok() && !kill_at) {
        kill_at = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(o.grace_seconds * 1000));
      }
    }
    const auto now = Clock::now();
    const bool overall = o.timeout_seconds > 0 && now - start > std::chrono::duration<double>(o.timeout_seconds);
    if ((kill_at && now >= *kill_at) || overall) {
      for (int r = 0; r < nprocs; ++r) {
        if (running[r] && !stopped[r]) {
          stopped[r] = true;
          kill(pids[r], SIGKILL);
        }
      }
    }
    if (alive > 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (int fd : report) close(fd);
  return results;
}

std::string describe_failures(const std::vector<RankResult>& results) {
  std::string out;
  for (const auto& r : results) {
    if (r.ok()) continue;
    out += fmt::format("rank {}: {}: {}\n", r.rank,
                       r.signal ? fmt::format("signal {}", sigabbrev_np(r.signal)) : fmt::format("exit {}", r.exit_code),
                       r.failure);
  }
  return out;
}

}  // namespace zeal
