// Errors. User and configuration mistakes throw zeal::Error (or its ConfigError) with a message
// that names the key, file, rank or offset; broken internal invariants use ZEAL_CHECK, which
// aborts with the file and line.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace zeal {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// One or more problems found in a configuration; what() lists them one per line.
class ConfigError : public Error {
 public:
  static constexpr size_t kShown = 20;  // problems in what(); problems() has them all
  explicit ConfigError(std::vector<std::string> problems);
  const std::vector<std::string>& problems() const { return problems_; }

 private:
  std::vector<std::string> problems_;
};

// An exception's text without the C++ stack trace LibTorch appends ("Exception raised from …").
std::string without_backtrace(const std::string& what);

namespace detail {
// Collects the streamed context of a failed ZEAL_CHECK and aborts in its destructor.
class CheckFailure {
 public:
  CheckFailure(const char* file, int line, const char* condition);
  [[noreturn]] ~CheckFailure();
  template <class T>
  CheckFailure& operator<<(const T& v) {
    stream_ << v;
    return *this;
  }

 private:
  std::ostringstream stream_;
};
}  // namespace detail

}  // namespace zeal

#define ZEAL_CHECK(cond) \
  if (cond) {            \
  } else                 \
    ::zeal::detail::CheckFailure(__FILE__, __LINE__, #cond)
