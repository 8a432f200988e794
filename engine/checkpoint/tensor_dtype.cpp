#include "engine/checkpoint/tensor_dtype.h"

#include <map>

#include <fmt/format.h>

#include "engine/error.h"

namespace zeal::ckpt {

std::string safetensors_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "F32";
    case at::kBFloat16: return "BF16";
    case at::kHalf: return "F16";
    case at::kDouble: return "F64";
    case at::kLong: return "I64";
    case at::kInt: return "I32";
    case at::kShort: return "I16";
    case at::kChar: return "I8";
    case at::kByte: return "U8";
    case at::kBool: return "BOOL";
    default: throw Error(fmt::format("no safetensors dtype for {}", c10::toString(t)));
  }
}

at::ScalarType at_dtype(const std::string& d) {
  static const std::map<std::string, at::ScalarType> m{
      {"F32", at::kFloat}, {"BF16", at::kBFloat16}, {"F16", at::kHalf}, {"F64", at::kDouble}, {"I64", at::kLong},
      {"I32", at::kInt},   {"I16", at::kShort},     {"I8", at::kChar},  {"U8", at::kByte},    {"BOOL", at::kBool}};
  auto it = m.find(d);
  if (it == m.end()) throw Error("checkpoint: unknown dtype " + d);
  return it->second;
}

}  // namespace zeal::ckpt
