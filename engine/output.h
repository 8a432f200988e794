// Outputs that are whole or absent, and output places checked before the work that fills them.
// No LibTorch headers.
//
//   zeal::check_output_dir(save_dir, "--save_dir");      // at start: created, writable, or an error
//   zeal::check_output_file(json_path, "--json");        // at start: its folder is writable
//   ...
//   zeal::write_file_whole(json_path, text, "--json");   // at the end: appears complete or not at all
#pragma once

#include <string>

namespace zeal {

// Creates `dir` (and its parents) when missing and proves it writable by creating and removing a
// file in it. zeal::Error naming `what` (a flag or key), the folder and the reason otherwise.
void check_output_dir(const std::string& dir, const std::string& what);

// `file` is not a folder and the folder it goes into passes check_output_dir (a device or a pipe
// that exists, /dev/stdout, passes as it is).
void check_output_file(const std::string& file, const std::string& what);

// Flushes a file or a folder (its entries: a rename into it) to the disk; quietly nothing when it
// cannot be opened.
void fsync_path(const std::string& path);

// Writes `text` to `path` under a temporary name in the same folder, flushes it to the disk and
// renames it into place: a reader sees the previous file or the whole new one, never a part. The
// temporary file is removed when anything fails (zeal::Error naming `what` and the path). A
// symbolic link, a device or a pipe that exists (/dev/stdout) is written through, in place.
void write_file_whole(const std::string& path, const std::string& text, const std::string& what);

}  // namespace zeal
