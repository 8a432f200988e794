// A Python peer kept running for a whole benchmark: it answers each request line on its standard
// input with one JSON line, so a peer's measurements interleave with zeal's round by round instead
// of running minutes later in another process. Its standard error goes to a file whose tail is
// quoted when it fails.
#pragma once

#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

namespace zeal_bench {

class PeerProcess {
 public:
  // argv[0] is the interpreter; `env` adds NAME=VALUE entries to this process's environment.
  PeerProcess(const std::vector<std::string>& argv, const std::vector<std::string>& env) {
    char tmpl[] = "/tmp/zeal_peer_stderr.XXXXXX";
    const int err_fd = mkstemp(tmpl);
    stderr_path_ = tmpl;
    int in[2], out[2];
    if (err_fd < 0 || pipe(in) != 0 || pipe(out) != 0) {
      error_ = std::string("cannot create pipes: ") + std::strerror(errno);
      return;
    }
    pid_ = fork();
    if (pid_ == 0) {
      dup2(in[0], 0);
      dup2(out[1], 1);
      dup2(err_fd, 2);
      for (int fd : {in[0], in[1], out[0], out[1], err_fd}) close(fd);
      for (const auto& e : env) putenv(const_cast<char*>(e.c_str()));
      std::vector<char*> args;
      for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      execvp(args[0], args.data());
      std::fprintf(stderr, "cannot run %s: %s\n", args[0], std::strerror(errno));
      _exit(127);
    }
    close(in[0]);
    close(out[1]);
    close(err_fd);
    to_ = in[1];
    from_ = out[0];
    if (pid_ < 0) error_ = std::string("fork failed: ") + std::strerror(errno);
  }

  ~PeerProcess() { close_peer(); }
  PeerProcess(const PeerProcess&) = delete;
  PeerProcess& operator=(const PeerProcess&) = delete;

  // The next JSON line from the peer (its hello, or an answer), or {"error": why}.
  nlohmann::json read(double timeout_s) {
    if (!error_.empty()) return {{"error", error_}};
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    for (;;) {
      const size_t nl = buffer_.find('\n');
      if (nl != std::string::npos) {
        const std::string line = buffer_.substr(0, nl);
        buffer_.erase(0, nl + 1);
        if (line.empty() || line[0] != '{') continue;  // a library's chatter on stdout
        try {
          return nlohmann::json::parse(line);
        } catch (const std::exception&) {
          continue;
        }
      }
      const double left = std::chrono::duration<double>(deadline - std::chrono::steady_clock::now()).count();
      if (left <= 0) return fail("no answer within " + std::to_string(static_cast<int>(timeout_s)) + " s");
      pollfd p{from_, POLLIN, 0};
      if (poll(&p, 1, static_cast<int>(std::min(left, 1.0) * 1000) + 1) < 0 && errno != EINTR) return fail("poll failed");
      if (!(p.revents & (POLLIN | POLLHUP))) continue;
      char buf[4096];
      const ssize_t got = ::read(from_, buf, sizeof buf);
      if (got <= 0) return fail("exited");
      buffer_.append(buf, static_cast<size_t>(got));
    }
  }

  // Sends one request line and returns the peer's JSON answer, or {"error": why}.
  nlohmann::json request(const std::string& line, double timeout_s) {
    if (!error_.empty()) return {{"error", error_}};
    const std::string msg = line + "\n";
    if (write(to_, msg.data(), msg.size()) != static_cast<ssize_t>(msg.size())) return fail("does not read its input");
    return read(timeout_s);
  }

  const std::string& error() const { return error_; }

  // Asks the peer to quit and waits for it (so its CPU time counts as this process's children's).
  void close_peer() {
    if (pid_ <= 0) return;
    if (to_ >= 0) {
      (void)!write(to_, "quit\n", 5);
      close(to_);
      to_ = -1;
    }
    int status = 0;
    for (int i = 0; i < 100 && waitpid(pid_, &status, WNOHANG) == 0; ++i) usleep(100 * 1000);
    if (waitpid(pid_, &status, WNOHANG) == 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, &status, 0);
    }
    pid_ = -1;
    if (from_ >= 0) close(from_);
    from_ = -1;
    std::remove(stderr_path_.c_str());
  }

 private:
  nlohmann::json fail(const std::string& what) {
    std::ifstream f(stderr_path_);
    std::string all((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    std::string tail = all.size() > 400 ? all.substr(all.size() - 400) : all;
    for (auto& c : tail)
      if (c == '\n') c = ' ';
    error_ = "the peer " + what + (tail.empty() ? "" : ": " + tail);
    return {{"error", error_}};
  }

  pid_t pid_ = -1;
  int to_ = -1, from_ = -1;
  std::string buffer_, stderr_path_, error_;
};

}  // namespace zeal_bench
