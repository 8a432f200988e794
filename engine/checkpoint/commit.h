// The checkpoint's commit protocol: files written and fsynced under temporary names, renamed into
// place only when complete; rank 0 completes a checkpoint (manifest, rename, `latest`) only once
// every rank's file is whole. No LibTorch headers.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/checkpoint/safetensors.h"

namespace zeal::ckpt {

// `text` into `p`, flushed and fsynced; zeal::Error when it cannot be written.
void write_file_synced(const std::filesystem::path& p, const std::string& text);
// Writes `text` to `p` atomically (zeal::write_file_whole).
void publish_file(const std::filesystem::path& p, const std::string& text);
// checkpoint_<digits>: the automatic names.
bool is_checkpoint_name(const std::string& n);
// Removes directories renamed out of the way (a hidden name first, so a crash while removing
// leaves nothing that looks like a checkpoint).
void remove_all_quietly(const std::vector<std::filesystem::path>& doomed);
// A rank's file as the manifest lists it.
nlohmann::json file_record(const std::string& name, const FileDigest& d);
// Rank 0, once every rank's file is complete: manifest.json (from `m` and every rank's report),
// the registered objects, then the new checkpoint takes its name and `latest` points at it. The
// directories that must go (an older checkpoint of the same name, those beyond total_limit) are
// renamed to hidden names and returned for removal off the critical path.
std::vector<std::filesystem::path> complete_checkpoint(const std::filesystem::path& dir,
                                                       const std::filesystem::path& tmp,
                                                       const std::vector<nlohmann::json>& reports, nlohmann::json m,
                                                       const std::vector<std::string>& custom, bool automatic,
                                                       int total_limit);

}  // namespace zeal::ckpt
