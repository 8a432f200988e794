// The safetensors dtype name of a LibTorch scalar type (F32, BF16, F16, F64, I64, I32, I16, I8, U8,
// BOOL); zeal::Error for any other.
#pragma once

#include <c10/core/ScalarType.h>

#include <string>

namespace zeal::ckpt {
std::string safetensors_dtype(at::ScalarType t);
}  // namespace zeal::ckpt
