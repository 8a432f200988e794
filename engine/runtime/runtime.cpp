#include "engine/runtime/runtime.h"

#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/util/Logging.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <netdb.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <map>
#include <mutex>
#include <set>
#include <utility>
#include <sstream>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "engine/comm/backends.h"
#include "engine/comm/monitor.h"
#include "engine/comm/staging.h"
#include "engine/log.h"
#include "engine/runtime/device_choice.h"
#include "engine/config/config.h"
#include "engine/config/schema.h"
#include "engine/runtime/environment.h"

namespace zeal {

const char* build_source_id();  // generated at build time (cmake/build_id.cmake)

namespace {

std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string text(const std::vector<uint8_t>& v) { return {v.begin(), v.end()}; }

int g_rank_for_terminate = -1;

// The settings every rank must share ("key=value" lines), taken from the config by
// Runtime(const Config&) for the rendezvous to compare; empty when the runtime was built without one.
std::string g_settings;

// Keys that may differ between machines: where things are on each machine (its rank, paths, GPUs,
// the disk's I/O tuning, how machine 0 is named from here) and what is only printed.
bool machine_specific(const std::string& key) {
  static const std::set<std::string> keys = {"machine_rank", "main_process_ip", "gpu_ids", "steps_per_print",
                                             "wall_clock_breakdown"};
  return keys.count(key) || key.rfind("aio.", 0) == 0 ||
         (key.size() > 10 && key.compare(key.size() - 10, 10, ".nvme_path") == 0);
}

DistEnv note_settings(const Config& c) {
  // The build first (another zeal or LibTorch would compute differently), then every key.
  g_settings = fmt::format("build=zeal {} ({}), LibTorch {}\n", ZEAL_VERSION, build_source_id(), libtorch_version());
  for (const auto& f : config_detail::fields()) {
    if (!machine_specific(f.key)) g_settings += f.key + "=" + f.print(c) + "\n";
  }
  return DistEnv::from_environment(&c);
}

[[noreturn]] void report_and_exit() {
  std::string what = "unknown exception";
  if (auto e = std::current_exception()) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& ex) {
      what = without_backtrace(ex.what());
    } catch (...) {
    }
  } else {
    what = "std::terminate called without an exception";
  }
  std::fflush(stdout);
  std::fprintf(stderr, "zeal: rank %d: error: %s\n", g_rank_for_terminate, what.c_str());
  std::fflush(stderr);
  std::_Exit(1);
}

bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v && *v && std::string(v) != "0" && std::string(v) != "false";
}

// How long a rank tries to reach the store: ZEAL_CONNECT_TIMEOUT seconds, 120 by default (ranks of
// other machines may start a little later; a store silent for two minutes is not coming).
std::chrono::milliseconds connect_timeout() {
  double seconds = 120.0;
  if (const char* v = std::getenv("ZEAL_CONNECT_TIMEOUT"); v && *v) {
    char* end = nullptr;
    const double d = std::strtod(v, &end);
    if (!end || *end || !(d > 0) || d > 1e6)
      throw Error(fmt::format("ZEAL_CONNECT_TIMEOUT={}: expected seconds, a number > 0 and ≤ 1e6", v));
    seconds = d;
  }
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0));
}

// Silences c10 logs below fatal for its lifetime, unless ZEAL_DEBUG is set.
class QuietC10dLogs {
 public:
  QuietC10dLogs() : saved_(FLAGS_caffe2_log_level) {
    if (!env_flag("ZEAL_DEBUG")) FLAGS_caffe2_log_level = std::max(saved_, 3);
  }
  ~QuietC10dLogs() { FLAGS_caffe2_log_level = saved_; }
  QuietC10dLogs(const QuietC10dLogs&) = delete;
  QuietC10dLogs& operator=(const QuietC10dLogs&) = delete;

 private:
  int saved_;
};

// Meets every rank through the store: each posts its world size and host, then waits for all.
void check_in_unguarded(const c10::intrusive_ptr<c10d::Store>& store, const DistEnv& e,
                        std::chrono::milliseconds timeout, const std::string& settings) {
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  const auto call = std::chrono::milliseconds(10000);
  const std::string mine =
      fmt::format("{} {} {} {} {}", e.world_size, e.local_rank, host, static_cast<int>(getpid()), e.node_rank);
  detail::run_bounded([store, key = fmt::format("zeal/rdzv/{}", e.rank), mine] { store->set(key, bytes(mine)); },
                      call, "rendezvous:");
  std::vector<std::string> keys;
  for (int r = 0; r < e.world_size; ++r) keys.push_back(fmt::format("zeal/rdzv/{}", r));
  try {
    detail::run_bounded([store, keys, timeout] { store->wait(keys, timeout); }, timeout + call, "rendezvous:");
  } catch (const detail::StoreSilent&) {
    throw;
  } catch (const std::exception&) {
    std::vector<int> missing;
    for (int r = 0; r < e.world_size; ++r) {
      if (!detail::bounded<bool>([store, key = keys[r]] { return store->check({key}); }, call, "rendezvous:"))
        missing.push_back(r);
    }
    std::string list;
    for (int r : missing) list += (list.empty() ? "" : ", ") + std::to_string(r);
    throw Error(fmt::format(
        "rank {}: rendezvous at {}:{} timed out after {:g} s: {} of {} ranks arrived; missing rank{} {}. Check that "
        "every machine was started with the same --num_processes/--num_machines (WORLD_SIZE={} here)",
        e.rank, e.master_addr, e.master_port, timeout.count() / 1000.0, e.world_size - static_cast<int>(missing.size()),
        e.world_size, missing.size() == 1 ? "" : "s", list, e.world_size));
  }
  // Every rank must agree on the world size.
  std::vector<std::string> posted(e.world_size);
  for (int r = 0; r < e.world_size; ++r) {
    const std::string& v = posted[r] =
        detail::bounded<std::string>([store, key = keys[r]] { return text(store->get(key)); }, call, "rendezvous:");
    const int their_world = std::atoi(v.c_str());
    if (their_world != e.world_size) {
      throw Error(fmt::format("rank {} was started with WORLD_SIZE={} but rank {} with WORLD_SIZE={} ({}): every "
                              "rank must be launched with the same world size",
                              e.rank, e.world_size, r, their_world, v.substr(v.find(' ') + 1)));
    }
  }
  // Which machine each rank is on, for reports of ranks that stop answering: the launcher's node
  // rank, or under Open MPI (whose node rank counts ranks within a machine) the host's order.
  {
    std::vector<int> nodes(e.world_size, -1);
    std::vector<std::string> hosts(e.world_size);
    std::vector<std::string> seen;
    for (int r = 0; r < e.world_size; ++r) {
      std::istringstream in(posted[r]);
      int world = 0, local = 0, pid = 0;
      in >> world >> local >> hosts[r] >> pid >> nodes[r];
      if (e.source == "Open MPI") {
        auto it = std::find(seen.begin(), seen.end(), hosts[r]);
        nodes[r] = static_cast<int>(it - seen.begin());
        if (it == seen.end()) seen.push_back(hosts[r]);
      }
    }
    detail::note_rank_machines(nodes, hosts);
  }
  // And on the build and the config: a rank at another ZeRO stage or with another learning rate
  // would otherwise fail much later, or train something else without a word.
  if (settings.empty()) return;
  // Each rank posts its settings and a digest of them; all compare digests, and the full text of
  // rank 0 and of a differing rank is read only to name the first key that differs.
  const std::string digest = fmt::format("{:016x}", std::hash<std::string>{}(settings));
  detail::run_bounded([store, key = fmt::format("zeal/rdzv/settings/{}", e.rank), settings] {
    store->set(key, bytes(settings));
  }, call, "rendezvous:");
  detail::run_bounded([store, key = fmt::format("zeal/rdzv/digest/{}", e.rank), digest] {
    store->set(key, bytes(digest));
  }, call, "rendezvous:");
  std::vector<std::string> digest_keys;
  for (int r = 0; r < e.world_size; ++r) digest_keys.push_back(fmt::format("zeal/rdzv/digest/{}", r));
  detail::run_bounded([store, digest_keys, timeout] { store->wait(digest_keys, timeout); }, timeout + call,
                      "rendezvous:");
  const std::string base = detail::bounded<std::string>([store, key = digest_keys[0]] { return text(store->get(key)); },
                                                        call, "rendezvous:");
  std::vector<int> differ;
  for (int r = 1; r < e.world_size; ++r) {
    const std::string d = r == e.rank ? digest
                                      : detail::bounded<std::string>(
                                            [store, key = digest_keys[r]] { return text(store->get(key)); }, call,
                                            "rendezvous:");
    if (d != base) differ.push_back(r);
  }
  if (differ.empty()) return;
  const int other = differ.front();
  auto settings_of = [&](int r) {
    if (r == e.rank) return settings;
    return detail::bounded<std::string>(
        [store, key = fmt::format("zeal/rdzv/settings/{}", r)] { return text(store->get(key)); }, call, "rendezvous:");
  };
  const std::string zero = settings_of(0), theirs = settings_of(other);
  // "key=value" lines: name the first that differs (distributed_type only when nothing else does:
  // Accelerate derives it from the stage).
  std::istringstream a(zero), b(theirs);
  std::string key = "a setting", x, y, xa, ya;
  std::vector<std::string> also;
  for (; std::getline(a, xa) && std::getline(b, ya);) {
    if (xa == ya) continue;
    const std::string k = xa.substr(0, xa.find('='));
    if (key == "a setting" || (key == "distributed_type" && k != key)) {
      if (key != "a setting") also.push_back(key);
      key = k, x = xa, y = ya;
    } else {
      also.push_back(k);
    }
  }
  std::string list;
  for (int r : differ) list += (list.empty() ? "" : ", ") + std::to_string(r);
  // Every rank has read what it needs: rank 0, whose process holds the store, leaves only after
  // each has said so (or a short while), so that no rank loses the store before it can report.
  detail::run_bounded([store, key = fmt::format("zeal/rdzv/refused/{}", e.rank)] { store->set(key, bytes("1")); }, call,
                      "rendezvous:");
  if (e.rank == 0) {
    std::vector<std::string> refused;
    for (int r = 0; r < e.world_size; ++r) refused.push_back(fmt::format("zeal/rdzv/refused/{}", r));
    const auto wait = std::min(timeout, std::chrono::milliseconds(30000));
    try {
      detail::run_bounded([store, refused, wait] { store->wait(refused, wait); }, wait + call, "rendezvous:");
    } catch (const std::exception&) {
      // A rank that never says so is gone already; the refusal below stands.
    }
  }
  if (key == "a setting") {
    throw Error(fmt::format("rank {}'s settings differ from rank 0's (ranks {}): every rank must run the same zeal "
                            "build with the same config",
                            other, list));
  }
  std::string more;
  for (const auto& k : also) more += (more.empty() ? "; also " : ", ") + k;
  throw Error(fmt::format(
      "rank {} was started with {} {} but rank 0 with {}{}{}: every rank must run the same zeal build with the same "
      "config (check the files, overrides and programs each machine was given){}",
      other, key, y.empty() ? "(none)" : y.substr(y.find('=') + 1), x.empty() ? "(none)" : x.substr(x.find('=') + 1),
      more, differ.size() > 1 ? fmt::format(" (ranks {} differ from rank 0)", list) : "",
      e.rank == 0 || e.rank == other ? "" : fmt::format(" [seen by rank {}]", e.rank)));
}

void check_in(const c10::intrusive_ptr<c10d::Store>& store, const DistEnv& e, std::chrono::milliseconds timeout,
              const std::string& settings) {
  try {
    check_in_unguarded(store, e, timeout, settings);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& ex) {
    throw Error(fmt::format("rank {}: lost the rendezvous store at {}:{} during the rendezvous (rank 0 hosts it; did it "
                            "exit?): {}",
                            e.rank, e.master_addr, e.master_port, first_line(ex.what())));
  }
}

}  // namespace

struct Runtime::Impl {
  DistEnv env;
  RuntimeOptions options;
  std::chrono::milliseconds timeout{0};
  c10::intrusive_ptr<c10d::Store> store;
  std::unique_ptr<Communicator> gloo;
  std::unique_ptr<Communicator> nccl;
  int nccl_device = -1;
  std::map<std::string, std::unique_ptr<Communicator>> groups;  // group_comm, by name
  std::mutex mu;
};

Runtime::Runtime(const Config& config)
    : Runtime(note_settings(config), RuntimeOptions{.comm_timeout = config.launch.comm_timeout,
                                                    .gpu_ids = config.launch.gpu_ids}) {}

Runtime::Runtime(const DistEnv& env, const RuntimeOptions& options) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  const std::string settings = std::exchange(g_settings, std::string());  // from Runtime(const Config&), if so
  m.env = env;
  m.options = options;
  log::read_environment();  // a ZEAL_LOG_LEVEL it does not know is an error now, not a silent default
  log::set_rank(env.rank, env.world_size);
  m.options.debug_collectives = options.debug_collectives || env_flag("ZEAL_DEBUG_COLLECTIVES");
  m.timeout = std::chrono::milliseconds(static_cast<int64_t>(options.comm_timeout * 1000.0));
  if (options.report_uncaught) {
    g_rank_for_terminate = env.rank;
    std::set_terminate(report_and_exit);
  }
  // Under zeal launch the output goes through a pipe: keep it line by line so the rank
  // prefixes interleave sensibly and nothing is lost when the rank is stopped.
  if (std::getenv("ZEAL_LAUNCH")) std::setvbuf(stdout, nullptr, _IOLBF, 0);

  // A peer that dies closes its sockets; the next write to one must fail with EPIPE (reported
  // as that peer's failure), not kill this rank with SIGPIPE. Python ignores SIGPIPE for the same
  // reason; a handler the program installed itself is left alone.
  struct sigaction pipe_action {};
  if (sigaction(SIGPIPE, nullptr, &pipe_action) == 0 && pipe_action.sa_handler == SIG_DFL) signal(SIGPIPE, SIG_IGN);

  if (options.store_hosted_elsewhere) {
    detail::set_store_host("the parent process (zeal::spawn), which hosts the store,");
  } else if (env.world_size > 1) {
    detail::set_store_host(
        fmt::format("rank 0, which hosts the rendezvous store at {}:{},", env.master_addr, env.master_port));
  }
  std::chrono::milliseconds rendezvous = m.timeout;  // how long the ranks wait to meet
  if (env.world_size == 1) {
    m.store = c10::make_intrusive<c10d::HashStore>();
  } else {
    c10d::TCPStoreOptions o;
    o.port = static_cast<uint16_t>(env.master_port);
    o.isServer = env.rank == 0 && !options.store_hosted_elsewhere;
    o.waitWorkers = false;
    // Connecting has its own, shorter deadline: a store that does not answer in that time will not.
    // A restarted attempt of a run over several machines waits for the other machines' launchers,
    // which restart once their ranks have noticed the failure (within comm_timeout): comm_timeout
    // and a minute more, to connect and to meet.
    const char* restarts = std::getenv("ZEAL_RESTART_COUNT");
    const bool restarted_across = restarts && std::atoi(restarts) > 0 && env.local_world_size < env.world_size;
    rendezvous = restarted_across ? m.timeout + std::chrono::seconds(60) : m.timeout;
    const auto connect = restarted_across ? rendezvous : std::min(m.timeout, connect_timeout());
    o.timeout = connect;
    if (!o.isServer) {
      // A name that does not resolve never will: say so now instead of retrying for the deadline.
      addrinfo hints{};
      hints.ai_socktype = SOCK_STREAM;
      addrinfo* found = nullptr;
      const int rc = getaddrinfo(env.master_addr.c_str(), nullptr, &hints, &found);
      if (found) freeaddrinfo(found);
      if (rc != 0) {
        throw Error(fmt::format("rank {}: the rendezvous address \"{}\" (main_process_ip / MASTER_ADDR) does not "
                                "resolve: {}",
                                env.rank, env.master_addr, gai_strerror(rc)));
      }
    }
    try {
      // c10d logs a warning with a C++ backtrace for every failed connection attempt; the error
      // below says it once (ZEAL_DEBUG=1 shows them).
      QuietC10dLogs quiet;
      m.store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, o);
      m.store->setTimeout(m.timeout);
    } catch (const std::exception& e) {
      if (o.isServer) {
        throw Error(fmt::format("rank 0 cannot host the rendezvous store on port {}: {}. Another job may hold the "
                                "port; choose another with --main_process_port (or MASTER_PORT)",
                                env.master_port, first_line(e.what())));
      }
      throw Error(fmt::format("rank {} cannot reach the rendezvous store at {}:{} within {:g} s (rank 0 hosts it: is "
                              "it running, is MASTER_ADDR/main_process_ip right, is the port open? ZEAL_CONNECT_TIMEOUT "
                              "sets this deadline): {}",
                              env.rank, env.master_addr, env.master_port, connect.count() / 1000.0,
                              first_line(without_backtrace(e.what()))));
    }
    check_in(m.store, env, rendezvous, settings);
  }
  // CUDA tensors are staged through pinned host memory, so ranks that share a GPU can train.
  m.gloo = detail::make_staging_communicator(detail::make_gloo_communicator(
      m.store, env.rank, env.world_size, m.timeout, m.options.debug_collectives,
      env.world_size == 1 ? "127.0.0.1" : env.master_addr));
}

// The rendezvous store lives in rank 0, so rank 0 leaves last: each other rank, its communicators
// (and their heartbeats) stopped, says it is leaving, and rank 0 waits for all of them (up to 10 s:
// a rank may still be freeing gigabytes or deleting its swap files) before its store goes; no
// rank's last store call meets a closed socket (c10d would print a broken pipe and a backtrace
// from a run that succeeded). Rank 0 polls with check(): c10d's timed wait prints a warning
// whenever its timeout passes. A failing rank leaves at once (a peer it waited for may be gone);
// under zeal::spawn the parent hosts the store and nobody waits.
Runtime::~Runtime() {
  if (!impl_) return;
  Impl& m = *impl_;
  m.groups.clear();
  m.nccl.reset();
  m.gloo.reset();
  if (!m.store || m.env.world_size < 2 || m.options.store_hosted_elsewhere || std::uncaught_exceptions() > 0) return;
  const auto bound = std::chrono::milliseconds(1000);
  const auto wait_for = std::chrono::milliseconds(10000);
  try {
    if (m.env.rank != 0) {
      detail::run_bounded([s = m.store, key = "zeal/leave/" + std::to_string(m.env.rank)] {
        s->set(key, std::vector<uint8_t>{1});
      }, bound, "leaving");
    } else {
      std::vector<std::string> keys;
      for (int r = 1; r < m.env.world_size; ++r) keys.push_back("zeal/leave/" + std::to_string(r));
      detail::run_bounded(
          [s = m.store, keys, wait_for] {
            const auto until = std::chrono::steady_clock::now() + wait_for;
            while (!s->check(keys) && std::chrono::steady_clock::now() < until) {
              std::this_thread::sleep_for(std::chrono::milliseconds(20));
            }
          },
          wait_for + std::chrono::milliseconds(500), "leaving");
    }
  } catch (...) {  // a rank that is gone or late: leave anyway
  }
}

const DistEnv& Runtime::env() const { return impl_->env; }

Communicator& Runtime::comm() { return *impl_->gloo; }

Communicator& Runtime::cuda_comm(int device) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (impl_->nccl) {
    if (device >= 0 && device != impl_->nccl_device) {
      throw Error(fmt::format("rank {}: the NCCL communicator works on cuda:{}; it cannot also serve cuda:{}", rank(),
                              impl_->nccl_device, device));
    }
    return *impl_->nccl;
  }
#ifdef ZEAL_HAVE_NCCL
  constexpr bool have_nccl = true;
#else
  constexpr bool have_nccl = false;
#endif
  if (device < 0) {
    const int count = at::detail::getCUDAHooks().hasCUDA() ? at::detail::getCUDAHooks().deviceCount() : 0;
    const DeviceChoice choice =
        choose_cuda_device(local_rank(), local_world_size(), count, have_nccl, impl_->options.gpu_ids);
    if (choice.backend != CudaBackend::kNccl) {
      throw Error("ZEAL_COMM_BACKEND=gloo: CUDA tensors go through the Gloo communicator (Runtime::comm())");
    }
    device = choice.device;
  }
  impl_->nccl = detail::make_nccl_communicator(impl_->store, rank(), world_size(), device, impl_->timeout,
                                               impl_->options.debug_collectives);
  impl_->nccl_device = device;
  return *impl_->nccl;
}

Communicator& Runtime::group_comm(const std::string& name, const std::vector<int>& ranks, int cuda_device) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  const std::string key = fmt::format("{}@{}", name, cuda_device);
  if (auto it = impl_->groups.find(key); it != impl_->groups.end()) return *it->second;
  const auto me = std::find(ranks.begin(), ranks.end(), rank());
  if (me == ranks.end()) {
    throw Error(fmt::format("rank {} asked for the communicator '{}' of ranks [{}], which it is not one of", rank(),
                            name, fmt::join(ranks, ", ")));
  }
  for (int r : ranks) {
    if (r < 0 || r >= world_size() || std::count(ranks.begin(), ranks.end(), r) != 1) {
      throw Error(fmt::format("the communicator '{}': ranks [{}] must be distinct ranks of 0..{}", name,
                              fmt::join(ranks, ", "), world_size() - 1));
    }
  }
  const int index = static_cast<int>(me - ranks.begin()), size = static_cast<int>(ranks.size());
  auto store = c10::make_intrusive<c10d::PrefixStore>(fmt::format("zeal/group/{}/", key), impl_->store);
  std::unique_ptr<Communicator> c =
      cuda_device >= 0
          ? detail::make_nccl_communicator(store, index, size, cuda_device, impl_->timeout,
                                           impl_->options.debug_collectives)
          : detail::make_staging_communicator(detail::make_gloo_communicator(
                store, index, size, impl_->timeout, impl_->options.debug_collectives,
                world_size() == 1 ? "127.0.0.1" : impl_->env.master_addr));
  return *(impl_->groups[key] = std::move(c));
}

// The program's store calls, each under comm_timeout (plus a margin for the wait's own deadline):
// a stopped store host is an error naming it, not a hang, and a store whose host died (its socket
// reset or closed) is an error naming the host too (run_bounded), not c10d's bare "Connection reset".
void Runtime::store_set(const std::string& key, const std::string& value) {
  detail::run_bounded([store = impl_->store, key = "user/" + key, v = bytes(value)] { store->set(key, v); },
                      impl_->timeout, fmt::format("rank {}: store_set({}):", rank(), key));
}

std::string Runtime::store_get(const std::string& key) {
  const auto t = impl_->timeout;
  return detail::bounded<std::string>(
      [store = impl_->store, key = "user/" + key, t] {
        store->wait({key}, t);
        return text(store->get(key));
      },
      t + std::chrono::seconds(10), fmt::format("rank {}: store_get({}):", rank(), key));
}

int64_t Runtime::store_add(const std::string& key, int64_t delta) {
  return detail::bounded<int64_t>([store = impl_->store, key = "user/" + key, delta] { return store->add(key, delta); },
                                  impl_->timeout, fmt::format("rank {}: store_add({}):", rank(), key));
}

#ifndef ZEAL_HAVE_NCCL
namespace detail {
std::unique_ptr<Communicator> make_nccl_communicator(const c10::intrusive_ptr<c10d::Store>&, int, int, int,
                                                     std::chrono::milliseconds, bool) {
  throw Error("this zeal was built without NCCL (no CUDA toolkit with NCCL was found at build time): CUDA collectives "
              "are not available");
}
}  // namespace detail
#endif

}  // namespace zeal
