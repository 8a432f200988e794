// libFuzzer target for the config loader: any bytes, read as a config file, must end in a config
// or in zeal::ConfigError — never another exception, a crash, a hang or a sanitizer report. A
// config that loads must print (to_yaml) as text that loads back to the same config.
//
//   build/fuzz/config_fuzz -max_total_time=3600 /tmp/new_inputs tests/fuzz/corpus   # by hand
//   tests/fuzz/run.sh build/fuzz/config_fuzz 20                                     # as CI runs it
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "engine/config/config.h"
#include "engine/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // The first byte picks the file name's extension (JSON files get the trailing-comma check).
  const bool json = size > 0 && (data[0] & 1);
  const std::string text(reinterpret_cast<const char*>(data), size);
  const std::string name = json ? "fuzz.json" : "fuzz.yaml";
  zeal::Config c;
  try {
    c = zeal::Config::parse(text, name, /*apply_env=*/false);
  } catch (const zeal::ConfigError& e) {
    if (e.problems().empty()) {
      std::fprintf(stderr, "ConfigError without a problem\n");
      std::abort();
    }
    return 0;
  }
  const std::string shown = c.to_yaml(true);
  try {
    const zeal::Config back = zeal::Config::parse(shown, "shown.yaml", false);
    if (!(back == c)) {
      std::fprintf(stderr, "to_yaml does not load back to the same config:\n%s\n", shown.c_str());
      std::abort();
    }
  } catch (const zeal::ConfigError& e) {
    std::fprintf(stderr, "to_yaml's text is refused: %s\n%s\n", e.what(), shown.c_str());
    std::abort();
  }
  return 0;
}
