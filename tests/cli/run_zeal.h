// Runs the `zeal` program as a user does, for the CLI and launcher tests.
#pragma once

#include <sys/wait.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <string>

struct Result {
  int status = -1;
  std::string output;  // stdout and stderr together
  double seconds = 0;
};

// Runs `zeal ARGS` through the shell; `prefix` may set environment variables or pipe input.
inline Result run_zeal(const std::string& args, const std::string& prefix = "") {
  const std::string cmd = prefix + " " + ZEAL_CLI + " " + args + " 2>&1";
  Result r;
  const auto t0 = std::chrono::steady_clock::now();
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf{};
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.output.append(buf.data(), n);
  const int st = pclose(p);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  return r;
}
