#include "engine/checkpoint/commit.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>

#include <fmt/format.h>

#include "engine/checkpoint/fault_hooks.h"
#include "engine/error.h"
#include "engine/output.h"
#include "offload/crc32c.h"

namespace zeal::ckpt {

namespace fs = std::filesystem;
using nlohmann::json;

void write_file_synced(const fs::path& p, const std::string& text) {
  {
    std::ofstream f(p, std::ios::binary | std::ios::trunc);
    f << text;
    if (!f.flush()) throw Error(fmt::format("checkpoint: cannot write {}", p.string()));
  }
  fsync_path(p.string());
}

void publish_file(const fs::path& p, const std::string& text) { write_file_whole(p.string(), text, "checkpoint"); }

bool is_checkpoint_name(const std::string& n) {
  return n.rfind("checkpoint_", 0) == 0 && n.size() > 11 && n.find_first_not_of("0123456789", 11) == std::string::npos;
}

void remove_all_quietly(const std::vector<fs::path>& doomed) {
  for (const auto& p : doomed) {
    std::error_code ec;
    fs::remove_all(p, ec);
  }
}

json file_record(const std::string& name, const FileDigest& d) {
  return {{"name", name}, {"bytes", d.bytes}, {"crc32c", d.crc32c}, {"crc_block", d.crc_block}, {"block_crcs", d.block_crcs}};
}

std::vector<fs::path> complete_checkpoint(const fs::path& dir, const fs::path& tmp, const std::vector<json>& reports,
                                          json m, const std::vector<std::string>& custom, bool automatic,
                                          int total_limit) {
  const fs::path parent = dir.parent_path();
  json files = json::object(), pieces = json::array();
  for (const auto& rep : reports) {
    files[rep["file"]["name"].get<std::string>()] = rep["file"];
    for (auto p : rep["pieces"]) {
      p["file"] = rep["file"]["name"];
      pieces.push_back(std::move(p));
    }
  }
  m["files"] = files;
  m["pieces"] = pieces;
  m["custom_objects"] = custom.size();
  m["custom_crc32c"] = json::array();  // each object's bytes, checked by load_state before anything changes
  for (const auto& c : custom) m["custom_crc32c"].push_back(offload::crc32c(c.data(), c.size()));
  for (size_t k = 0; k < custom.size(); ++k) write_file_synced(tmp / fmt::format("custom_{}.bin", k), custom[k]);
  write_file_synced(tmp / "manifest.json", m.dump(1));
  fsync_path(tmp.string());
  // The new checkpoint takes the name only now, complete; an old one there goes after.
  std::vector<fs::path> doomed;
  const fs::path old = parent / ("." + dir.filename().string() + ".old");
  fs::remove_all(old);
  if (fs::exists(dir)) {
    fs::rename(dir, old);
    doomed.push_back(old);
  }
  fs::rename(tmp, dir);
  fsync_path(parent.string());
  maybe_die("latest", 0);
  // A name of this process's own: two runs saving into one parent never take each other's file.
  const fs::path pointer = parent / fmt::format(".latest.{}.partial", ::getpid());
  write_file_synced(pointer, dir.filename().string() + "\n");
  fs::rename(pointer, parent / "latest");
  fsync_path(parent.string());
  if (automatic && total_limit > 0) {
    std::vector<std::pair<int64_t, fs::path>> found;
    for (const auto& e : fs::directory_iterator(parent)) {
      const std::string n = e.path().filename().string();
      if (is_checkpoint_name(n)) found.push_back({std::stoll(n.substr(11)), e.path()});
    }
    std::sort(found.begin(), found.end());
    for (size_t i = 0; i + total_limit < found.size(); ++i) {
      const fs::path hidden = parent / ("." + found[i].second.filename().string() + ".old");
      fs::remove_all(hidden);
      fs::rename(found[i].second, hidden);
      doomed.push_back(hidden);
    }
    fsync_path(parent.string());
  }
  return doomed;
}

}  // namespace zeal::ckpt
