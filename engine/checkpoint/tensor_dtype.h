// The safetensors dtype names of LibTorch scalar types (F32, BF16, F16, F64, I64, I32, I16, I8, U8,
// BOOL) both ways; zeal::Error for any other.
#pragma once

#include <c10/core/ScalarType.h>

#include <string>

namespace zeal::ckpt {
std::string safetensors_dtype(at::ScalarType t);
at::ScalarType at_dtype(const std::string& d);
}  // namespace zeal::ckpt
