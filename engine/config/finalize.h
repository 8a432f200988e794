// After every source of values has been read: derive what DeepSpeed derives (overlap_comm's
// default, the third batch size from the other two) and make mixed_precision agree with
// fp16/bf16.enabled. Internal to engine/config.
#pragma once

#include <string>
#include <vector>

#include "engine/config/config.h"

namespace zeal::config_detail {

void finalize(Config& c, std::vector<std::string>& errors);

}  // namespace zeal::config_detail
