// Command-line flags of the example programs: every number checked where it enters, and one exit
// code (2) for any flag that is wrong, with the flag named.
#pragma once

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "cli/number_flags.h"
#include "engine/config/config.h"
#include "engine/error.h"
#include "engine/trainer/arguments.h"

namespace zeal_examples {

// Number checks (cli/number_flags.h): decimal only, in range, finite.
using zeal::flags::at_least_one;
using zeal::flags::integer_in;
using zeal::flags::non_negative;
using zeal::flags::non_negative_finite;
using zeal::flags::positive_finite;
using zeal::flags::real_in;

// What a program prints for an exception that ends it: "program: message", without the C++ stack
// trace LibTorch appends (ZEAL_DEBUG=1 keeps it). Returns the exit code, 1.
inline int report_failure(const char* program, const std::exception& e) {
  std::fflush(stdout);
  std::fprintf(stderr, "%s: %s\n", program, zeal::without_backtrace(e.what()).c_str());
  return 1;
}

inline std::optional<int> check_engine_flags(const std::vector<std::string>& rest, const char* program);

// Parses the flags. Returns the exit code when the program should end now: 0 after --help, 2 for a
// flag that is wrong (its message, naming the flag, on stderr).
// The program's own flags (CLI11): the exit code when the program should end now.
inline std::optional<int> parse_app(CLI::App& app, int argc, char** argv, const char* program) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "%s: %s (see --help)\n", program, e.what());
    return 2;
  }
  return std::nullopt;
}

inline std::optional<int> parse_flags(CLI::App& app, int argc, char** argv, const char* program) {
  if (auto code = parse_app(app, argc, argv, program)) return code;
  return check_engine_flags(app.remaining(), program);
}

// The Trainer's programs: the program's own flags, then Hugging Face's training arguments
// (--learning_rate, --eval_strategy, …, --training_args FILE) over `args` (the program's
// defaults), then the engine's. Returns the exit code when the program should end now (0 after
// --help, 2 for a wrong flag, named).
// `program_defaults`, when given, runs after the program's own flags are read and before the training
// arguments' flags, to derive defaults from them.
inline std::optional<int> parse_trainer_flags(CLI::App& app, int argc, char** argv, const char* program,
                                              zeal::TrainingArguments& args,
                                              const std::function<void(zeal::TrainingArguments&)>& program_defaults = {}) {
  app.footer("\n" + zeal::TrainingArguments::help() +
             "\nThe engine's config: --config_file FILE and the override flags (zeal config keys).");
  if (auto code = parse_app(app, argc, argv, program)) return code;
  if (program_defaults) program_defaults(args);
  std::vector<std::string> remaining = app.remaining(), rest;
  std::vector<const char*> v{program};
  for (const auto& r : remaining) v.push_back(r.c_str());
  try {
    args = zeal::TrainingArguments::parse(static_cast<int>(v.size()), v.data(), &rest, args);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s (see --help)\n", program, e.what());
    return 2;
  }
  return check_engine_flags(rest, program);
}

// What the program's own flags left must be the engine's: --config_file or a config override
// flag (each with its value), nothing else.
inline std::optional<int> check_engine_flags(const std::vector<std::string>& rest, const char* program) {
  for (size_t i = 0; i < rest.size(); ++i) {
    const std::string& arg = rest[i];
    if (arg.rfind("--", 0) != 0) {
      std::fprintf(stderr, "%s: unexpected argument '%s' (see --help)\n", program, arg.c_str());
      return 2;
    }
    const size_t eq = arg.find('=');
    const std::string name = arg.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
    bool known = name == "config_file";
    for (const auto& f : zeal::override_flags()) known = known || f.flag == name;
    if (!known) {
      std::fprintf(stderr, "%s: unknown flag %s (see --help; config keys go in --config_file)\n", program, arg.c_str());
      return 2;
    }
    if (eq == std::string::npos) ++i;  // its value
  }
  return std::nullopt;
}

// The engine's config from --config_file, the config override flags and the environment. A wrong
// one (a file that is missing or malformed, a value out of range) ends the program here with exit
// code 2 and the problems named; returns nullopt then.
inline std::optional<zeal::Config> load_config(int argc, char** argv, const char* program) {
  try {
    return zeal::Config::from_env_or_file(argc, argv);
  } catch (const std::exception& e) {
    report_failure(program, e);
    return std::nullopt;
  }
}

// Standard output that could not be written (a full disk, a closed pipe) ends the program with
// exit code 1 and says so; call before returning 0.
inline int finish(const char* program) {
  if (std::fflush(stdout) != 0 || std::ferror(stdout)) {
    std::fprintf(stderr, "%s: cannot write standard output: %s\n", program, std::strerror(errno));
    return 1;
  }
  return 0;
}

}  // namespace zeal_examples
