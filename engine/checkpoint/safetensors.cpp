#include "engine/checkpoint/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "engine/error.h"
#include "offload/crc32c.h"

namespace zeal::ckpt {


int64_t dtype_size(const std::string& d) {
  static const std::map<std::string, int64_t> sizes{{"F64", 8}, {"F32", 4}, {"BF16", 2}, {"F16", 2}, {"I64", 8},
                                                    {"I32", 4}, {"I16", 2}, {"I8", 1},   {"U8", 1},  {"BOOL", 1}};
  auto it = sizes.find(d);
  if (it == sizes.end()) throw Error(fmt::format("checkpoint: unknown safetensors dtype '{}'", d));
  return it->second;
}

SafetensorsWriter::SafetensorsWriter(std::string path, std::vector<TensorEntry> entries,
                                     const std::map<std::string, std::string>& metadata, offload::IoOptions io,
                                     int64_t crc_block, int64_t staging)
    : path_(std::move(path)), entries_(std::move(entries)) {
  nlohmann::ordered_json h;
  if (!metadata.empty()) h["__metadata__"] = metadata;
  int64_t at = 0;
  for (auto& e : entries_) {
    int64_t n = 1;
    for (int64_t d : e.shape) n *= d;
    if (n * dtype_size(e.dtype) != e.bytes) {
      throw Error(fmt::format("checkpoint: {}: {} bytes do not make a {} tensor of {} elements", e.name, e.bytes,
                              e.dtype, n));
    }
    h[e.name] = {{"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {at, at + e.bytes}}};
    e.offset = at;  // relative until the header's length is known
    at += e.bytes;
  }
  std::string header = h.dump();
  header.append((8 - (8 + header.size()) % 8) % 8, ' ');  // the data starts 8-byte aligned
  const int64_t data_begin = 8 + static_cast<int64_t>(header.size());
  for (auto& e : entries_) e.offset += data_begin;
  total_ = data_begin + at;

  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_DIRECT | O_CLOEXEC, 0644);
  if (fd_ < 0 && errno == EINVAL) fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) throw Error(fmt::format("checkpoint: cannot create {}: {}", path_, std::strerror(errno)));
  // The whole file's blocks at once (as fio lays its files out): the writes then allocate nothing,
  // and a disk that cannot hold the file says so now.
  if (const int rc = ::posix_fallocate(fd_, 0, total_); rc != 0 && rc != EOPNOTSUPP && rc != EINVAL) {
    throw Error(fmt::format("checkpoint: cannot make room for {} ({} bytes): {}", path_, total_, std::strerror(rc)));
  }
  io_ = offload::make_io_engine(io);
  staging = std::max<int64_t>(offload::kIoAlign, staging / offload::kIoAlign * offload::kIoAlign);
  buf_ = std::make_unique<offload::AlignedBuffer>(staging);
  spare_ = std::make_unique<offload::AlignedBuffer>(staging);
  io_->register_buffer(buf_->data(), buf_->size());
  io_->register_buffer(spare_->data(), spare_->size());
  digest_.crc_block = crc_block;
  uint64_t len = header.size();
  char le[8];
  for (int i = 0; i < 8; ++i) le[i] = static_cast<char>((len >> (8 * i)) & 0xff);
  append(le, 8);
  append(header.data(), static_cast<int64_t>(header.size()));
}

SafetensorsWriter::~SafetensorsWriter() {
  if (writing_.valid()) writing_.wait();  // its buffer is ours
  if (fd_ >= 0) ::close(fd_);
}

char* SafetensorsWriter::staging() { return buf_->data() + fill_; }
int64_t SafetensorsWriter::staging_room() const { return buf_->size() - fill_; }

void SafetensorsWriter::commit(int64_t n) {
  if (n < 0 || n > staging_room()) throw Error("checkpoint: a commit past the staging buffer");
  if (appended_ + n > total_) {
    throw Error(fmt::format("checkpoint: {}: {} bytes more than its tensors hold", path_, appended_ + n - total_));
  }
  // The CRCs: of the file, and of each crc_block bytes.
  const char* p = buf_->data() + fill_;
  digest_.crc32c = offload::crc32c(p, static_cast<size_t>(n), digest_.crc32c);
  for (int64_t left = n; left > 0;) {
    const int64_t take = std::min(left, digest_.crc_block - block_fill_);
    block_crc_ = offload::crc32c(p, static_cast<size_t>(take), block_crc_);
    block_fill_ += take;
    p += take;
    left -= take;
    if (block_fill_ == digest_.crc_block) {
      digest_.block_crcs.push_back(block_crc_);
      block_crc_ = 0;
      block_fill_ = 0;
    }
  }
  fill_ += n;
  appended_ += n;
  if (fill_ == buf_->size()) flush(false);
}

void SafetensorsWriter::append(const void* data, int64_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const int64_t take = std::min(n, staging_room());
    std::memcpy(staging(), p, static_cast<size_t>(take));
    commit(take);
    p += take;
    n -= take;
  }
}

void SafetensorsWriter::flush(bool last) {
  if (fill_ == 0) return;
  int64_t n = fill_;
  if (last) {
    n = (fill_ + offload::kIoAlign - 1) / offload::kIoAlign * offload::kIoAlign;
    std::memset(buf_->data() + fill_, 0, static_cast<size_t>(n - fill_));  // trimmed off after
  }
  if (writing_.valid()) writing_.get();  // the spare is free again (rethrows its I/O error)
  writing_ = std::async(std::launch::async, [this, data = buf_->data(), n, at = written_] {
    io_->write(fd_, path_, data, n, at);
  });
  std::swap(buf_, spare_);
  written_ += n;
  fill_ = 0;
}

FileDigest SafetensorsWriter::finish() {
  if (appended_ != total_) {
    throw Error(fmt::format("checkpoint: {}: {} of its {} bytes were given", path_, appended_, total_));
  }
  flush(true);
  if (writing_.valid()) writing_.get();
  if (block_fill_ > 0) digest_.block_crcs.push_back(block_crc_);
  block_fill_ = 0;
  if (::ftruncate(fd_, total_) != 0 || ::fsync(fd_) != 0) {
    throw Error(fmt::format("checkpoint: finishing {}: {}", path_, std::strerror(errno)));
  }
  ::close(fd_);
  fd_ = -1;
  digest_.bytes = total_;
  return digest_;
}

SafetensorsHeader read_safetensors_header(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw Error(fmt::format("checkpoint: {} is missing", path));
  f.seekg(0, std::ios::end);
  const int64_t size = f.tellg();
  f.seekg(0);
  unsigned char le[8];
  if (size < 8 || !f.read(reinterpret_cast<char*>(le), 8)) {
    throw Error(fmt::format("checkpoint: {} is truncated ({} bytes, not even a header)", path, size));
  }
  uint64_t len = 0;
  for (int i = 0; i < 8; ++i) len |= static_cast<uint64_t>(le[i]) << (8 * i);
  if (len > static_cast<uint64_t>(size - 8) || len > (100u << 20)) {
    throw Error(fmt::format("checkpoint: {} is truncated or not a safetensors file (header of {} bytes in a file of {})",
                            path, len, size));
  }
  std::string text(len, '\0');
  f.read(text.data(), static_cast<std::streamsize>(len));
  SafetensorsHeader h;
  h.data_begin = 8 + static_cast<int64_t>(len);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    throw Error(fmt::format("checkpoint: {}: the header is not valid JSON ({})", path, e.what()));
  }
  int64_t end = 0;
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == "__metadata__") {
      for (auto m = it.value().begin(); m != it.value().end(); ++m) h.metadata[m.key()] = m.value().get<std::string>();
      continue;
    }
    TensorEntry e;
    e.name = it.key();
    e.dtype = it.value().at("dtype").get<std::string>();
    e.shape = it.value().at("shape").get<std::vector<int64_t>>();
    const auto off = it.value().at("data_offsets").get<std::vector<int64_t>>();
    if (off.size() != 2 || off[0] < 0 || off[1] < off[0]) throw Error(fmt::format("checkpoint: {}: bad offsets of {}", path, e.name));
    e.bytes = off[1] - off[0];
    e.offset = h.data_begin + off[0];
    end = std::max(end, e.offset + e.bytes);
    h.tensors[e.name] = e;
  }
  if (end > size) {
    throw Error(fmt::format("checkpoint: {} is truncated: its tensors end at byte {}, the file has {}", path, end, size));
  }
  return h;
}

}  // namespace zeal::ckpt
