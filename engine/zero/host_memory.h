// Storage that comes and goes: the full buffers of stage-3 units exist only while a unit is gathered,
// partitioned parameters keep a shape without data, gradient staging lives for one backward.
//
// On the CPU, buffers of a MiB and more are mapped directly (mmap) and unmapped when freed: malloc
// would keep freed blocks under its dynamic mmap threshold (up to 32 MiB) in its heap, so releasing a
// unit would not lower the process's memory.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>

namespace zeal::zero {

// Gives `t`'s storage its bytes again (after free_storage); a no-op when it has them.
void alloc_storage(const at::Tensor& t);
// Frees `t`'s storage, keeping its shape, dtype and every view of it.
void free_storage(const at::Tensor& t);
// n zeros with options `o`, mapped on the CPU from a MiB up (fresh mappings are zero already).
at::Tensor staging_zeros(int64_t n, const at::TensorOptions& o);

}  // namespace zeal::zero
