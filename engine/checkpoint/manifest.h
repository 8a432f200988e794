// The pieces of a checkpoint's format shared by the engine's load and `zeal consolidate`: the
// manifest's entries and reading a file's bytes with their CRC32C checked. No LibTorch headers.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace zeal::ckpt {

constexpr int64_t kCrcBlock = 1 << 20;  // bytes per CRC32C in the manifest

// A piece of a parameter, as the manifest lists it.
struct SavedPiece {
  std::string file, dtype;
  int64_t begin = 0, count = 0, offset = 0;  // elements of the parameter; byte offset in the file
};

// A file, as the manifest lists it.
struct SavedFile {
  int64_t bytes = 0, crc_block = kCrcBlock;
  uint32_t crc32c = 0;
  std::vector<uint32_t> block_crcs;
};

// Reads bytes [offset, offset + n) of checkpoint files into `out`, checking the CRC32C of every
// block it touches; zeal::Error names the file and the block when one is missing or differs.
// Whole blocks are read with O_DIRECT through the offload I/O engine (io_uring, 1 MiB requests,
// up to 32 in flight per reader) where the file system allows, a file's short last block with
// pread. Reader threads (two by default), taking spans in turn, stay up to readers + 2 spans ahead
// of the checking, across all the requests of one read_many; files stay open for the reader's life.
class CheckedReader {
 public:
  struct Read {
    std::filesystem::path path;
    const SavedFile* file;
    int64_t offset, n;
    char* out;
    bool cached = false;  // through the page cache even where the reader reads with O_DIRECT
    // Through the page cache (never O_DIRECT), then dropped from it: bytes nothing reads again soon.
    bool drop = false;
  };
  // Where the checked bytes of a Read whose `out` is null go, in order: `at` bytes into read
  // `read`, `n` bytes at `p` (valid during the call). Without one, such a read is only checked.
  using Sink = std::function<void(size_t read, int64_t at, const char* p, int64_t n)>;
  // span: bytes read at once. direct: whole blocks with O_DIRECT (no page cache), but for reads
  // marked `cached`; false: every read through the page cache (a second read of the same bytes soon
  // after then costs no disk time).
  // readers: threads reading spans in turn, each with its own requests in flight.
  explicit CheckedReader(int64_t span = 32 << 20, bool direct = true, int readers = 2);
  ~CheckedReader();
  CheckedReader(const CheckedReader&) = delete;
  CheckedReader& operator=(const CheckedReader&) = delete;
  void read(const std::filesystem::path& path, const SavedFile& f, int64_t offset, int64_t n, char* out);
  void read_many(const std::vector<Read>& reads, const Sink& sink = {});
  // Bytes of host memory the reader holds (its ring of spans).
  int64_t buffer_bytes() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};
void read_checked(const std::filesystem::path& path, const SavedFile& f, int64_t offset, int64_t n, char* out);

// The reads again, through read-only mappings of the files: no copy out of the page cache, for bytes
// a first pass has just put there (a load's second pass). `piece` bytes (whole blocks) at a time,
// their CRC32Cs checked once their bytes went to `sink` (or `out`): one block keeps them in the
// CPU's cache for the check; a device destination wants fewer, larger copies. A file whose size
// differs from the manifest's, that changed or that was truncated meanwhile (no SIGBUS: see
// offload::MappedFile) is a zeal::Error naming it and the bytes. False, with nothing read, where a
// file cannot be mapped or the page cache holds less than 90 % of the bytes (reading them from the
// disk through mappings is slower than the reader's threads): the caller reads them otherwise.
bool read_mapped(const std::vector<CheckedReader::Read>& reads, const CheckedReader::Sink& sink,
                 int64_t piece = kCrcBlock);

// The checkpoint directory `dir` means: itself when it holds manifest.json, else the one its
// `latest` names.
std::filesystem::path resolve_checkpoint(const std::filesystem::path& dir);

}  // namespace zeal::ckpt
