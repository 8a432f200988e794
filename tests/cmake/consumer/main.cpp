#include <cstdio>

#include "engine/config/config.h"

// Prints the ZeRO stage of the config file given as argv[1].
int main(int argc, char** argv) {
  if (argc < 2) return 1;
  zeal::Config c = zeal::Config::load(argv[1]);
  std::printf("stage=%lld\n", static_cast<long long>(c.zero.stage));
  return 0;
}
