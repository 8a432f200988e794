// A file's bytes read through a read-only mapping of it: no copy out of the page cache, for bytes
// read again soon after a first read put them there (a checkpoint load's second pass). A file
// truncated under the mapping (or unreadable) would make the next access to a missing page raise
// SIGBUS and kill the process; while a MappedFile lives, such a fault instead finds a page of zeros
// mapped in its place and the MappedFile says it lost bytes (lost()), so that the caller fails by
// name. A SIGBUS at an address no MappedFile holds, or sent by a process, gets the disposition that
// was there before, with its own semantics (the default: the process ends as it would have); each
// MappedFile made puts the handler back in front of whatever disposition is there then. No LibTorch.
#pragma once

#include <cstdint>
#include <string>

namespace zeal::offload {

class MappedFile {
 public:
  // Maps bytes [0, bytes) of `path` (zeal::Error naming the file when it cannot be opened or mapped).
  MappedFile(const std::string& path, int64_t bytes);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const char* data() const { return data_; }
  int64_t size() const { return size_; }
  // Whether an access found a page past the file's end (it was truncated): those bytes read as zeros.
  bool lost() const;
  // The file's size now (fstat), to compare with what the caller expects before reading.
  int64_t file_size() const;
  // The fraction of the pages of bytes [begin, end) that the page cache holds now (mincore; 0 where
  // it cannot say).
  double resident_fraction(int64_t begin, int64_t end) const;
  // Starts reading bytes [begin, end) into the page cache, without waiting (MADV_WILLNEED).
  void will_need(int64_t begin, int64_t end) const;
  // Unmaps the pages wholly inside [begin, end) from this process (MADV_DONTNEED; they stay in the
  // page cache): read pages otherwise count in the resident set until the file is unmapped.
  void drop(int64_t begin, int64_t end) const;

 private:
  char* data_ = nullptr;
  int64_t size_ = 0, mapped_ = 0;
  int fd_ = -1, slot_ = -1;
};

}  // namespace zeal::offload
