// Faults a test asks for through the environment, at the checkpoint code's worst moments. Nothing
// happens unless the variable is set.
//   ZEAL_CHECKPOINT_KILL=write:<rank>  that rank is killed halfway through its file
//   ZEAL_CHECKPOINT_KILL=latest        rank 0 is killed after the rename, before `latest` moves
//   ZEAL_CHECKPOINT_FAULT=enospc:<rank> that rank's first write fails with ENOSPC
//   ZEAL_CHECKPOINT_FAULT=change:<rank> between a load's two passes, that rank flips a byte of a file
//                                       it is about to read again
//   ZEAL_CHECKPOINT_FAULT=grow:<rank>   ... appends a byte to that file instead (grow:all: every rank)
//   ZEAL_CHECKPOINT_FAULT=evict:<rank>  ... drops the files it reads again from the page cache
//                                       (evict:all: every rank), so the second pass cannot map them
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace zeal::ckpt {

// Kills this process (SIGKILL) when ZEAL_CHECKPOINT_KILL names `point` (or `point`:`rank`).
void maybe_die(const std::string& point, int rank);
// The errno ZEAL_CHECKPOINT_FAULT asks this rank's first checkpoint write to fail with (0: none).
int injected_write_error(int rank);
// Flips the byte at `offset` of `path` when ZEAL_CHECKPOINT_FAULT is change:`rank`; appends a byte
// to `path` when it is grow:`rank` or grow:all.
void maybe_change_between_passes(const std::string& path, int64_t offset, int rank);
// Drops `paths` from the page cache when ZEAL_CHECKPOINT_FAULT is evict:`rank` or evict:all.
void maybe_evict_between_passes(const std::vector<std::string>& paths, int rank);

}  // namespace zeal::ckpt
