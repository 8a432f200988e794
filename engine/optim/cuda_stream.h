// The device's current stream and device scope for zeal's own CUDA kernels, through c10's
// device-generic interface: the same code builds against LibTorch's CPU half and runs on the GPU
// when its CUDA half is loaded (internal).
#pragma once

#include <c10/core/Device.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

namespace zeal::optim {

// The stream LibTorch computes on now on `device` (a cudaStream_t for CUDA devices): zeal's kernels
// launch there, so they are ordered with the program's own work.
inline void* current_stream(const c10::Device& device) {
  c10::impl::VirtualGuardImpl impl(device.type());
  return impl.getStream(device).native_handle();
}

// Makes `device` current while it lives (kernels launch on the current device).
using CudaDeviceScope = c10::DeviceGuard;

}  // namespace zeal::optim
