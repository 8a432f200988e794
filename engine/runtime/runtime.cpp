#include "engine/runtime/runtime.h"

#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <mutex>

#include <fmt/format.h>

#include "engine/comm/backends.h"
#include "engine/comm/staging.h"
#include "engine/runtime/device_choice.h"
#include "engine/config/config.h"

namespace zeal {
namespace {

std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string text(const std::vector<uint8_t>& v) { return {v.begin(), v.end()}; }

int g_rank_for_terminate = -1;

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

// Meets every rank through the store: each posts its world size and host, then waits for all.
void check_in_unguarded(c10d::Store& store, const DistEnv& e, std::chrono::milliseconds timeout) {
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  store.set(fmt::format("zeal/rdzv/{}", e.rank),
            bytes(fmt::format("{} {} {} {}", e.world_size, e.local_rank, host, static_cast<int>(getpid()))));
  std::vector<std::string> keys;
  for (int r = 0; r < e.world_size; ++r) keys.push_back(fmt::format("zeal/rdzv/{}", r));
  try {
    store.wait(keys, timeout);
  } catch (const std::exception&) {
    std::vector<int> missing;
    for (int r = 0; r < e.world_size; ++r) {
      if (!store.check({keys[r]})) missing.push_back(r);
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
  for (int r = 0; r < e.world_size; ++r) {
    const std::string v = text(store.get(keys[r]));
    const int their_world = std::atoi(v.c_str());
    if (their_world != e.world_size) {
      throw Error(fmt::format("rank {} was started with WORLD_SIZE={} but rank {} with WORLD_SIZE={} ({}): every "
                              "rank must be launched with the same world size",
                              e.rank, e.world_size, r, their_world, v.substr(v.find(' ') + 1)));
    }
  }
}

void check_in(c10d::Store& store, const DistEnv& e, std::chrono::milliseconds timeout) {
  try {
    check_in_unguarded(store, e, timeout);
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
  std::mutex mu;
};

Runtime::Runtime(const Config& config)
    : Runtime(DistEnv::from_environment(&config), RuntimeOptions{config.launch.comm_timeout}) {}

Runtime::Runtime(const DistEnv& env, const RuntimeOptions& options) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.env = env;
  m.options = options;
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

  if (env.world_size == 1) {
    m.store = c10::make_intrusive<c10d::HashStore>();
  } else {
    c10d::TCPStoreOptions o;
    o.port = static_cast<uint16_t>(env.master_port);
    o.isServer = env.rank == 0 && !options.store_hosted_elsewhere;
    o.waitWorkers = false;
    o.timeout = m.timeout;
    try {
      m.store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, o);
    } catch (const std::exception& e) {
      if (o.isServer) {
        throw Error(fmt::format("rank 0 cannot host the rendezvous store on port {}: {}. Another job may hold the "
                                "port; choose another with --main_process_port (or MASTER_PORT)",
                                env.master_port, first_line(e.what())));
      }
      throw Error(fmt::format("rank {} cannot reach the rendezvous store at {}:{} within {:g} s (rank 0 hosts it: is "
                              "it running, is MASTER_ADDR/main_process_ip right, is the port open?): {}",
                              env.rank, env.master_addr, env.master_port, options.comm_timeout,
                              first_line(e.what())));
    }
    check_in(*m.store, env, m.timeout);
  }
  // CUDA tensors are staged through pinned host memory, so ranks that share a GPU can train.
  m.gloo = detail::make_staging_communicator(detail::make_gloo_communicator(
      m.store, env.rank, env.world_size, m.timeout, m.options.debug_collectives,
      env.world_size == 1 ? "127.0.0.1" : env.master_addr));
}

Runtime::~Runtime() = default;

const DistEnv& Runtime::env() const { return impl_->env; }

Communicator& Runtime::comm() { return *impl_->gloo; }

Communicator& Runtime::cuda_comm() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (!impl_->nccl) {
#ifdef ZEAL_HAVE_NCCL
    constexpr bool have_nccl = true;
#else
    constexpr bool have_nccl = false;
#endif
    const int count = at::detail::getCUDAHooks().hasCUDA() ? at::detail::getCUDAHooks().deviceCount() : 0;
    const DeviceChoice choice = choose_cuda_device(local_rank(), local_world_size(), count, have_nccl);
    if (choice.backend != CudaBackend::kNccl) {
      throw Error("ZEAL_COMM_BACKEND=gloo: CUDA tensors go through the Gloo communicator (Runtime::comm())");
    }
    impl_->nccl = detail::make_nccl_communicator(impl_->store, rank(), world_size(), choice.device, impl_->timeout,
                                                 impl_->options.debug_collectives);
  }
  return *impl_->nccl;
}

void Runtime::store_set(const std::string& key, const std::string& value) { impl_->store->set("user/" + key, bytes(value)); }

std::string Runtime::store_get(const std::string& key) {
  impl_->store->wait({"user/" + key}, impl_->timeout);
  return text(impl_->store->get("user/" + key));
}

int64_t Runtime::store_add(const std::string& key, int64_t delta) { return impl_->store->add("user/" + key, delta); }

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
