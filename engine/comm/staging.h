// A communicator for host tensors that also takes CUDA tensors, staging them through pinned host
// memory (internal; zeal::Runtime wraps its Gloo communicator in it). Several ranks can then share
// one GPU: NCCL refuses two ranks on one device.
//
// For a CUDA tensor, a collective (1) makes the communicator's own stream on that device wait for
// the work queued on the device's current stream, (2) copies the tensor into pinned host memory on
// that stream and waits for the copy, (3) runs the host collective, and at wait() (4) copies the
// result back on the communicator's stream and makes the then-current stream wait for it through an
// event, without blocking the host. The device memory involved is recorded on the communicator's
// stream, so LibTorch's caching allocator does not hand it out before the copies are done.
// CPU tensors go straight through.
#pragma once

#include <memory>

#include "engine/comm/communicator.h"

namespace zeal::detail {

std::unique_ptr<Communicator> make_staging_communicator(std::unique_ptr<Communicator> host);

}  // namespace zeal::detail
