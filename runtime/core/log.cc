// Logging and progress bar implementation.
#include "runtime/core/log.h"

#include <unistd.h>

#include <atomic>
#include <cstdio>

namespace nflash {
namespace {
std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};

std::string HumanCount(double v, const std::string& unit) {
  const char* prefixes[] = {"", "K", "M", "G", "T"};
  int p = 0;
  double base = unit == "B" ? 1024.0 : 1000.0;
  while (v >= base && p < 4) {
    v /= base;
    ++p;
  }
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.1f %s%s", v, prefixes[p], unit.c_str());
  return buf;
}
}  // namespace

void SetLogLevel(LogLevel level) { g_level.store(static_cast<int>(level)); }
LogLevel GetLogLevel() { return static_cast<LogLevel>(g_level.load()); }

LogMessage::~LogMessage() {
  static const char* kPrefix[] = {"debug: ", "", "warning: ", "error: "};
  std::string line = "nflash: " + std::string(kPrefix[static_cast<int>(level_)]) + os_.str() + "\n";
  std::fwrite(line.data(), 1, line.size(), stderr);
}

ProgressBar::ProgressBar(std::string label, uint64_t total, std::string unit)
    : label_(std::move(label)), total_(total), unit_(std::move(unit)), tty_(::isatty(STDERR_FILENO) != 0) {
  start_ = last_draw_ = std::chrono::steady_clock::now();
}

// An unfinished bar (the work failed) is left as it was, on a line of its own: it never claims 100%.
ProgressBar::~ProgressBar() {
  if (!finished_ && tty_ && GetLogLevel() <= LogLevel::kInfo) std::fputs("\n", stderr);
}

void ProgressBar::Update(uint64_t done) {
  done_ = done;
  if (GetLogLevel() > LogLevel::kInfo) return;
  auto now = std::chrono::steady_clock::now();
  if (tty_) {
    if (now - last_draw_ < std::chrono::milliseconds(100)) return;
    last_draw_ = now;
    Draw(false);
  } else {
    int decile = total_ ? static_cast<int>(10 * done_ / total_) : 10;
    if (decile != last_decile_) {
      last_decile_ = decile;
      Draw(false);
    }
  }
}

void ProgressBar::Finish() {
  if (finished_) return;
  finished_ = true;
  if (GetLogLevel() > LogLevel::kInfo) return;
  done_ = total_;
  Draw(true);
}

void ProgressBar::Draw(bool final_line) {
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  double frac = total_ ? static_cast<double>(done_) / static_cast<double>(total_) : 1.0;
  constexpr int kWidth = 30;
  int filled = static_cast<int>(frac * kWidth);
  std::string bar(filled, '#');
  bar.resize(kWidth, ' ');
  double rate = secs > 0 ? done_ / secs : 0;
  double eta = rate > 0 ? (total_ - done_) / rate : 0;
  char buf[256];
  std::snprintf(buf, sizeof buf, "%s [%s] %3.0f%% %s %s/s %s%.0fs", label_.c_str(), bar.c_str(), frac * 100,
                HumanCount(static_cast<double>(done_), unit_).c_str(), HumanCount(rate, unit_).c_str(),
                final_line ? "in " : "ETA ", final_line ? secs : eta);
  std::string line = tty_ ? "\r" + std::string(buf) + (final_line ? "\n" : "") : std::string(buf) + "\n";
  std::fwrite(line.data(), 1, line.size(), stderr);
}

}  // namespace nflash
