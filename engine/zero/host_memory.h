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
// The same, always mapped on the CPU (page-aligned, whole pages: a buffer O_DIRECT can read into,
// rounded up to 4 KiB); elsewhere as alloc_storage.
void alloc_storage_mapped(const at::Tensor& t);
// Frees `t`'s storage, keeping its shape, dtype and every view of it.
void free_storage(const at::Tensor& t);
// Elements [offset, offset + count) of contiguous `t` as a tensor on its storage, made even while
// that storage is freed (narrow would refuse): usable whenever the storage has its bytes.
at::Tensor storage_slice(const at::Tensor& t, int64_t offset, int64_t count);
// n zeros with options `o`, mapped on the CPU from a MiB up (fresh mappings are zero already).
at::Tensor staging_zeros(int64_t n, const at::TensorOptions& o);

// Makes glibc's malloc map every block of 128 KiB and more and unmap it when freed, for LibTorch's
// own CPU tensors too (activations, autograd's gradients, optimizer states), and return a heap's
// free top beyond 128 KiB: with glibc's defaults, freeing a mapped block raises its mmap threshold
// to that block's size (up to 32 MiB) and the trim threshold to twice that, and every later block
// under it comes from a heap, which keeps what is freed: the resident set then holds the largest
// step's temporaries on top of the model states (half a GiB for gpt2-small in stage 3; with a
// 1 MiB threshold gpt2-1.3b on NVMe still kept 80 MiB per rank of freed blocks). Once per process;
// left alone when the user chose a threshold (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_ or
// GLIBC_TUNABLES glibc.malloc.mmap_threshold / trim_threshold). No-op without glibc.
void keep_large_allocations_mapped();

}  // namespace zeal::zero
