#include "engine/error.h"

#include <cstdio>
#include <cstdlib>

namespace zeal {

namespace {
std::string join_lines(const std::vector<std::string>& lines) {
  std::string out;
  for (const auto& l : lines) {
    if (!out.empty()) out += '\n';
    out += l;
  }
  return out;
}
}  // namespace

ConfigError::ConfigError(std::vector<std::string> problems)
    : Error(join_lines(problems)), problems_(std::move(problems)) {}

namespace detail {
CheckFailure::CheckFailure(const char* file, int line, const char* condition) {
  stream_ << file << ":" << line << ": check failed: " << condition << ": ";
}
CheckFailure::~CheckFailure() {
  std::fprintf(stderr, "zeal: %s\n", stream_.str().c_str());
  std::fflush(stderr);
  std::abort();
}
}  // namespace detail

std::string without_backtrace(const std::string& what) {
  const size_t at = what.find("Exception raised from");
  std::string s = at == std::string::npos ? what : what.substr(0, at);
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

}  // namespace zeal
