// safetensors files (the Hugging Face format: an 8-byte little-endian header length, a JSON header
// naming each tensor's dtype, shape and byte range, then the bytes), written as a stream and read
// range by range. The writer knows every tensor's size up front, writes the header, then takes the
// tensors' bytes in header order through the offload I/O engine (O_DIRECT where the file system
// has it, through two 4 KiB-aligned staging buffers: one fills while the other is written), computing a CRC32C of the whole file and of
// every `crc_block` bytes as it goes; the file is fsynced when finished. No LibTorch headers.
#pragma once

#include <cstdint>
#include <map>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "offload/io.h"

namespace zeal::ckpt {

struct TensorEntry {
  std::string name;
  std::string dtype;  // safetensors' names: F32, BF16, F16, F64, I64, I32, I16, I8, U8, BOOL
  std::vector<int64_t> shape;
  int64_t bytes = 0;
  int64_t offset = 0;  // of its bytes from the start of the file (set by the writer / reader)
};

// Bytes per element of a safetensors dtype name; throws zeal::Error for an unknown one.
int64_t dtype_size(const std::string& dtype);

struct FileDigest {
  int64_t bytes = 0;
  uint32_t crc32c = 0;               // of the whole file
  int64_t crc_block = 0;             // bytes per block below
  std::vector<uint32_t> block_crcs;  // of bytes [k·crc_block, (k+1)·crc_block) of the file
};

class SafetensorsWriter {
 public:
  // Creates `path` (truncating it) for `entries` in this order, with `metadata` as the header's
  // "__metadata__" (strings only, as the format wants).
  SafetensorsWriter(std::string path, std::vector<TensorEntry> entries, const std::map<std::string, std::string>& metadata,
                    offload::IoOptions io = {}, int64_t crc_block = 1 << 20, int64_t staging = 32 << 20);
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;
  const std::vector<TensorEntry>& entries() const { return entries_; }
  // A fault in the writes, for tests.
  void inject(const offload::FaultInjection& f) { io_->inject(f); }
  // The next `n` bytes of the tensors, in order (a tensor may come in several calls).
  void append(const void* data, int64_t n);
  // Room in the staging buffer: a caller filling it directly writes at most this many bytes at
  // staging() and then calls commit(n).
  char* staging();
  int64_t staging_room() const;
  void commit(int64_t n);
  // Checks every tensor got its bytes, writes the rest, trims the file to its size, fsyncs.
  FileDigest finish();

 private:
  void flush(bool last);

  std::string path_;
  std::vector<TensorEntry> entries_;
  int fd_ = -1;
  std::unique_ptr<offload::IoEngine> io_;
  std::unique_ptr<offload::AlignedBuffer> buf_, spare_;  // filled / being written
  std::future<void> writing_;                             // the spare buffer's write
  int64_t fill_ = 0;        // bytes in the staging buffer
  int64_t written_ = 0;     // bytes of the file already written (a multiple of 4 KiB)
  int64_t total_ = 0;       // the file's size when complete
  int64_t appended_ = 0;    // bytes given so far, header included
  FileDigest digest_;
  uint32_t block_crc_ = 0;  // of the current CRC block so far
  int64_t block_fill_ = 0;
};

// A safetensors file's header: its tensors with their absolute byte offsets, and its metadata.
struct SafetensorsHeader {
  std::map<std::string, TensorEntry> tensors;
  std::map<std::string, std::string> metadata;
  int64_t data_begin = 0;  // 8 + header length
};
// Reads and checks the header of `path` (zeal::Error naming the file when it is missing, too
// short, or its header is not valid).
SafetensorsHeader read_safetensors_header(const std::string& path);

}  // namespace zeal::ckpt
