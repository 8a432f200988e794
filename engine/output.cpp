#include "engine/output.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>

#include <fmt/format.h>

#include "engine/error.h"

namespace zeal {

namespace fs = std::filesystem;

void fsync_path(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

void check_output_dir(const std::string& dir, const std::string& what) {
  if (dir.empty()) throw Error(fmt::format("{}: an empty path", what));
  std::error_code ec;
  const fs::path d(dir);
  if (fs::exists(d, ec) && !fs::is_directory(d, ec)) {
    throw Error(fmt::format("{}: {} exists and is not a folder", what, dir));
  }
  fs::create_directories(d, ec);
  if (ec) throw Error(fmt::format("{}: cannot create the folder {}: {}", what, dir, ec.message()));
  const fs::path probe = d / fmt::format(".zeal-write-check.{}", ::getpid());
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw Error(fmt::format("{}: cannot write in the folder {}: {}", what, dir, std::strerror(errno)));
  ::close(fd);
  fs::remove(probe, ec);
}

void check_output_file(const std::string& file, const std::string& what) {
  if (file.empty()) throw Error(fmt::format("{}: an empty path", what));
  std::error_code ec;
  const fs::path f(file);
  if (fs::is_directory(f, ec)) throw Error(fmt::format("{}: {} is a folder, not a file", what, file));
  if (fs::exists(f, ec) && !fs::is_regular_file(f, ec)) return;  // a device or a pipe (/dev/stdout) is written as is
  const fs::path parent = f.parent_path().empty() ? fs::path(".") : f.parent_path();
  check_output_dir(parent.string(), what);
}

namespace {

void write_all(int fd, const std::string& text, const std::function<void(const std::string&, int)>& fail) {
  size_t off = 0;
  while (off < text.size()) {
    const ssize_t n = ::write(fd, text.data() + off, text.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : ENOSPC;
      ::close(fd);
      fail("writing", err);
    }
    off += static_cast<size_t>(n);
  }
}

}  // namespace

// The descriptor a name for this process's own ones means (/dev/stdout, /dev/stderr, /dev/fd/N,
// /proc/self/fd/N), or -1.
static int own_descriptor(const std::string& path) {
  if (path == "/dev/stdin") return 0;
  if (path == "/dev/stdout") return 1;
  if (path == "/dev/stderr") return 2;
  for (const char* prefix : {"/dev/fd/", "/proc/self/fd/"}) {
    const std::string pre(prefix);
    if (path.rfind(pre, 0) != 0 || path.size() == pre.size()) continue;
    const std::string digits = path.substr(pre.size());
    if (digits.size() > 6 || digits.find_first_not_of("0123456789") != std::string::npos) return -1;
    return std::stoi(digits);
  }
  return -1;
}

void write_file_whole(const std::string& path, const std::string& text, const std::string& what) {
  auto fail_here = [&](const std::string& doing, int err) {
    throw Error(fmt::format("{}: {} {}: {}", what, doing, path, std::strerror(err)));
  };
  if (const int own = own_descriptor(path); own >= 0) {
    // This process's own descriptor (a redirected stdout): written there, after what stdio holds.
    std::fflush(stdout);
    std::fflush(stderr);
    const int fd = ::dup(own);
    if (fd < 0) fail_here("cannot write", errno);
    write_all(fd, text, fail_here);
    ::close(fd);
    return;
  }
  fs::path p(path);
  std::error_code ec0;
  // A symbolic link (even one whose file does not exist yet): the file it names is written, the
  // link stays.
  for (int hops = 0; hops < 40 && fs::is_symlink(fs::symlink_status(p, ec0)); ++hops) {
    const fs::path to = fs::read_symlink(p, ec0);
    if (ec0) break;
    p = to.is_absolute() ? to : p.parent_path() / to;
  }
  const fs::file_status target = fs::status(p, ec0);
  if (fs::exists(target) && !fs::is_regular_file(target) && !fs::is_directory(target)) {
    // A device, a pipe or a terminal: written through. Renaming over it would replace the node.
    const int fd = ::open(p.c_str(), O_WRONLY | O_CLOEXEC);
    if (fd < 0) fail_here("cannot write", errno);
    write_all(fd, text, fail_here);
    ::close(fd);
    return;
  }
  const fs::path parent = p.parent_path().empty() ? fs::path(".") : p.parent_path();
  const fs::path tmp = parent / fmt::format(".{}.partial.{}", p.filename().string(), ::getpid());
  auto fail = [&](const std::string& doing, int err) {
    std::error_code ec;
    fs::remove(tmp, ec);
    throw Error(fmt::format("{}: {} {}: {}", what, doing, path, std::strerror(err)));
  };
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("cannot write", errno);
  write_all(fd, text, fail);
  if (::fsync(fd) != 0 && errno != EINVAL) {
    const int err = errno;
    ::close(fd);
    fail("flushing", err);
  }
  ::close(fd);
  if (::rename(tmp.c_str(), p.c_str()) != 0) fail("renaming into place", errno);
  fsync_path(parent.string());
}

}  // namespace zeal
