// Minimal leveled logging to stderr, and a progress bar for long-running commands.
#pragma once

#include <chrono>
#include <cstdint>
#include <sstream>
#include <string>

namespace nflash {

enum class LogLevel : int { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

// The process-wide threshold (set once by the CLI from --verbose/--quiet before any work starts).
void SetLogLevel(LogLevel level);
LogLevel GetLogLevel();

// Collects one message and writes it, with a level prefix, in its destructor (one write, so lines do not interleave).
class LogMessage {
 public:
  explicit LogMessage(LogLevel level) : level_(level) {}
  ~LogMessage();
  std::ostream& stream() { return os_; }

 private:
  LogLevel level_;
  std::ostringstream os_;
};

// A progress bar on stderr ("label [#####     ] 45% 1.2 GB 350 MB/s ETA 3s"), redrawn at most 10 times a second and
// only when stderr is a terminal (otherwise a line every 10%). Call Finish() when the work is complete; a bar destroyed
// unfinished does not print a final line. Thread-safety: not thread-safe.
class ProgressBar {
 public:
  ProgressBar(std::string label, uint64_t total, std::string unit = "B");
  ~ProgressBar();
  void Update(uint64_t done);
  void Finish();

 private:
  void Draw(bool final_line);
  std::string label_;
  uint64_t total_;
  std::string unit_;
  uint64_t done_ = 0;
  bool tty_;
  bool finished_ = false;
  int last_decile_ = -1;
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_draw_;
};

// Turns the streamed message into void so NF_LOG is one expression: safe as the body of an unbraced if/else.
struct LogVoidify {
  void operator&(std::ostream&) {}
};

}  // namespace nflash

#define NF_LOG(level)                                                    \
  (::nflash::LogLevel::k##level < ::nflash::GetLogLevel())               \
      ? (void)0                                                          \
      : ::nflash::LogVoidify() & ::nflash::LogMessage(::nflash::LogLevel::k##level).stream()
