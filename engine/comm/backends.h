// Constructors of the communicator backends (internal; used by zeal::Runtime).
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <memory>

#include "engine/comm/communicator.h"

namespace zeal::detail {

// Gloo through c10d's ProcessGroupGloo, for CPU tensors. Connects to every rank (full mesh)
// through `store`, from the interface named by GLOO_SOCKET_IFNAME or else the local address
// that routes to `master_addr`.
std::unique_ptr<Communicator> make_gloo_communicator(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                     int world, std::chrono::milliseconds timeout, bool debug,
                                                     const std::string& master_addr);

// NCCL for CUDA tensors on GPU `device`; throws zeal::Error when zeal was built without NCCL.
std::unique_ptr<Communicator> make_nccl_communicator(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                     int world, int device, std::chrono::milliseconds timeout,
                                                     bool debug);

}  // namespace zeal::detail
