// A one-line progress bar (zeal::Trainer, the example programs): on a terminal it redraws itself in place
//
//   step 12/200 [███████▌                    ]  6% loss 4.1234 | 1,530 tok/s | 2.10 s/step | ETA 6m35s
//
// and when the output is a file or a pipe it prints a plain line every `every` steps instead
// ("step 12/200: loss 4.1234, 1530 tokens/s, 2.10 s/step, ETA 6m35s"). Under `zeal launch` the
// launcher says whether its own output is a terminal (ZEAL_TERMINAL=1) and redraws the bar there.
// While the bar is up, other output must go through line(), which clears the bar and redraws it
// below the line.
#pragma once

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>

namespace zeal {

inline std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  const int64_t t = static_cast<int64_t>(s + 0.5);
  if (t >= 3600) return fmt::format("{}h{:02}m", t / 3600, (t % 3600) / 60);
  if (t >= 60) return fmt::format("{}m{:02}s", t / 60, t % 60);
  return fmt::format("{}s", t);
}

inline bool terminal_behind_launcher() {
  const char* t = std::getenv("ZEAL_TERMINAL");
  return t && std::string(t) == "1";
}

class ProgressBar {
 public:
  // `enabled`: this process draws (the main process); `every`: steps between plain lines.
  ProgressBar(int64_t total, bool enabled, int64_t every, FILE* out = stdout)
      : total_(std::max<int64_t>(total, 1)), enabled_(enabled), every_(std::max<int64_t>(every, 1)), out_(out),
        tty_(enabled && terminal(out)) {}
  // Whether `out` shows on a terminal (directly, or behind `zeal launch`'s).
  static bool terminal(FILE* out = stdout) { return isatty(fileno(out)) != 0 || terminal_behind_launcher(); }
  ~ProgressBar() { finish(); }

  bool on_terminal() const { return tty_; }
  // What the rate counts: "tok" (tokens, the default) or "samples".
  void set_unit(std::string unit) { unit_ = std::move(unit); }

  // Step `done` (1-based) of the total finished; `extra` follows the numbers (", model states …").
  void update(int64_t done, double loss, double tokens_per_s, double step_s, double eta_s, const std::string& extra = "") {
    if (!enabled_) return;
    const std::string numbers =
        fmt::format("loss {:.4f} | {:.0f} {}/s | {:.2f} s/step | ETA {}", loss, tokens_per_s, unit_, step_s, format_duration(eta_s));
    if (tty_) {
      const int width = 28;
      const double frac = std::clamp(static_cast<double>(done) / static_cast<double>(total_), 0.0, 1.0);
      const int full = static_cast<int>(frac * width);
      std::string bar;
      for (int i = 0; i < width; ++i) bar += i < full ? "█" : (i == full && frac * width - full >= 0.5 ? "▌" : " ");
      current_ = fmt::format("step {}/{} [{}] {:3.0f}% {}{}", done, total_, bar, 100 * frac, numbers, extra);
      std::fprintf(out_, "\r\033[K%s", current_.c_str());
      std::fflush(out_);
    } else if (done % every_ == 0 || done == total_ || done == 1) {
      std::fprintf(out_, "step %lld/%lld: loss %.4f, %.0f %s/s, %.2f s/step, ETA %s%s\n", static_cast<long long>(done),
                   static_cast<long long>(total_), loss, tokens_per_s, unit_ == "tok" ? "tokens" : unit_.c_str(), step_s,
                   format_duration(eta_s).c_str(), extra.c_str());
      std::fflush(out_);
    }
  }

  // A line of other output, with the bar kept below it.
  void line(const std::string& text) {
    if (!enabled_) return;
    if (tty_ && !current_.empty()) {
      std::fprintf(out_, "\r\033[K%s\n\r\033[K%s", text.c_str(), current_.c_str());
    } else {
      std::fprintf(out_, "%s\n", text.c_str());
    }
    std::fflush(out_);
  }

  // Ends the bar's line (once).
  void finish() {
    if (tty_ && !current_.empty()) {
      std::fprintf(out_, "\n");
      std::fflush(out_);
      current_.clear();
    }
  }

 private:
  int64_t total_;
  bool enabled_;
  int64_t every_;
  FILE* out_;
  bool tty_;
  std::string current_;
  std::string unit_ = "tok";
};

}  // namespace zeal
