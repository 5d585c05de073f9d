// Logging and the progress bar: what reaches stderr, checked by reading stderr back. Redirected to a file (not a
// terminal: a line per tenth of the work) and to a pseudo-terminal (redrawn in place at most 10 times a second).
#include "runtime/core/log.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <termios.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/test_util.h"

namespace nflash {
namespace {

// Points stderr (fd 2) at `fd` for its lifetime; restores it and the log level on destruction.
class StderrTo {
 public:
  explicit StderrTo(int fd) : saved_(::dup(STDERR_FILENO)), level_(GetLogLevel()) {
    std::fflush(stderr);
    ::dup2(fd, STDERR_FILENO);
  }
  ~StderrTo() {
    std::fflush(stderr);
    ::dup2(saved_, STDERR_FILENO);
    ::close(saved_);
    SetLogLevel(level_);
  }

 private:
  int saved_;
  LogLevel level_;
};

// Stderr into a temporary file; Text() returns what was written so far.
class CapturedStderr {
 public:
  CapturedStderr() : path_(dir_.File("stderr.txt")), fd_(::open(path_.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600)) {
    redirect_ = std::make_unique<StderrTo>(fd_);
  }
  ~CapturedStderr() {
    redirect_.reset();
    ::close(fd_);
  }
  std::string Text() const {
    std::fflush(stderr);
    return nflash::testing::ReadText(path_);
  }

 private:
  nflash::testing::TempDir dir_;
  std::string path_;
  int fd_;
  std::unique_ptr<StderrTo> redirect_;
};

using nflash::testing::Lines;

// "label [<30 cells>] ": the number of '#' cells of a drawn bar.
int FilledCells(const std::string& line) {
  const size_t open = line.find('[');
  EXPECT_NE(open, std::string::npos) << line;
  EXPECT_EQ(line.substr(open + 31, 1), "]") << "30 cells: " << line;
  int filled = 0;
  for (size_t i = open + 1; i < open + 31 && i < line.size(); ++i) {
    if (line[i] == '#') {
      ++filled;
    } else {
      EXPECT_EQ(line[i], ' ') << line;
    }
  }
  return filled;
}

TEST(LogTest, MessagesCarryTheirLevelAndHonourTheThreshold) {
  CapturedStderr err;
  SetLogLevel(LogLevel::kInfo);
  NF_LOG(Debug) << "not shown";
  NF_LOG(Info) << "info " << 1;
  NF_LOG(Warning) << "careful";
  NF_LOG(Error) << "broken";
  SetLogLevel(LogLevel::kError);  // --quiet: errors only
  NF_LOG(Warning) << "hidden";
  NF_LOG(Error) << "still shown";
  SetLogLevel(LogLevel::kDebug);  // --verbose
  NF_LOG(Debug) << "detail";
  EXPECT_EQ(err.Text(),
            "nflash: info 1\nnflash: warning: careful\nnflash: error: broken\nnflash: error: still shown\n"
            "nflash: debug: detail\n");
  // The level set is the level read back.
  for (LogLevel l : {LogLevel::kDebug, LogLevel::kInfo, LogLevel::kWarning, LogLevel::kError}) {
    SetLogLevel(l);
    EXPECT_EQ(GetLogLevel(), l);
  }
}

// Not a terminal: one line each time the work crosses a tenth (whatever the time between updates), then the final line
// with the total time instead of an estimate. 1000 bytes in steps of 50: tenths 0, 1, ..., 10 crossed once each.
TEST(ProgressBarTest, ToAFileOneLinePerTenthThenTheFinalLine) {
  CapturedStderr err;
  SetLogLevel(LogLevel::kInfo);
  {
    ProgressBar bar("copy", 1000);
    for (uint64_t done = 0; done <= 1000; done += 50) bar.Update(done);
    bar.Finish();
    bar.Finish();  // a second Finish draws nothing
  }
  const std::vector<std::string> lines = Lines(err.Text());
  ASSERT_EQ(lines.size(), 12u) << err.Text();
  for (size_t i = 0; i < lines.size(); ++i) {
    const std::string& l = lines[i];
    SCOPED_TRACE(l);
    EXPECT_EQ(l.rfind("copy [", 0), 0u);
    EXPECT_EQ(l.find('\r'), std::string::npos) << "no carriage returns in a file";
    // Line i < 11 is drawn at done = 100 * i: i tenths, 3 * i of the 30 cells, i * 10 percent.
    const int tenths = i < 11 ? static_cast<int>(i) : 10;
    EXPECT_EQ(FilledCells(l), 3 * tenths);
    char percent[16];
    std::snprintf(percent, sizeof percent, "] %3d%% ", tenths * 10);
    EXPECT_NE(l.find(percent), std::string::npos) << percent;
    // Bytes below 1024 are printed as they are ("500.0 B"): the byte unit's prefixes step by 1024.
    const std::string amount = std::to_string(100 * tenths) + ".0 B ";
    EXPECT_NE(l.find(amount), std::string::npos) << amount;
    if (i < 11) {
      EXPECT_NE(l.find(" ETA "), std::string::npos);
      EXPECT_EQ(l.find(" in "), std::string::npos);
    } else {
      EXPECT_NE(l.find(" in "), std::string::npos);
      EXPECT_EQ(l.find(" ETA "), std::string::npos);
      EXPECT_EQ(l.back(), 's');
    }
  }
}

// Prefixes: bytes step by 1024 (3 MiB is "3.0 MB"), other units by 1000 (2500 tokens are "2.5 Ktok"); T is the last
// prefix (5 * 1024^5 bytes is "5120.0 TB").
TEST(ProgressBarTest, AmountsUseTheUnitsPrefixes) {
  CapturedStderr err;
  SetLogLevel(LogLevel::kInfo);
  const uint64_t tib = uint64_t{1} << 40;
  {
    ProgressBar bytes("b", 3 << 20);
    bytes.Finish();
    ProgressBar tokens("t", 2500, "tok");
    tokens.Finish();
    ProgressBar huge("h", 5 * 1024 * tib);
    huge.Finish();
    ProgressBar kilo("k", 1024);  // exactly the base: one prefix up
    kilo.Finish();
  }
  const std::vector<std::string> lines = Lines(err.Text());
  ASSERT_EQ(lines.size(), 4u) << err.Text();
  EXPECT_NE(lines[0].find("] 100% 3.0 MB "), std::string::npos) << lines[0];
  EXPECT_NE(lines[1].find("] 100% 2.5 Ktok "), std::string::npos) << lines[1];
  EXPECT_NE(lines[2].find("] 100% 5120.0 TB "), std::string::npos) << lines[2];
  EXPECT_NE(lines[3].find("] 100% 1.0 KB "), std::string::npos) << lines[3];
  for (const std::string& l : lines) EXPECT_EQ(FilledCells(l), 30) << l;
}

// Above the info level (warnings only here; --quiet sets errors only): no bar at all; an empty total counts as done;
// an unfinished bar on a file leaves no line of its own behind.
TEST(ProgressBarTest, QuietEmptyAndUnfinishedBars) {
  CapturedStderr err;
  SetLogLevel(LogLevel::kWarning);
  {
    ProgressBar bar("quiet", 100);
    for (uint64_t d = 0; d <= 100; d += 10) bar.Update(d);
    bar.Finish();
  }
  EXPECT_EQ(err.Text(), "");
  SetLogLevel(LogLevel::kInfo);
  {
    ProgressBar empty("empty", 0);
    empty.Update(0);
  }
  {
    ProgressBar unfinished("cut", 100);
    unfinished.Update(30);
  }
  const std::vector<std::string> lines = Lines(err.Text());
  ASSERT_EQ(lines.size(), 2u) << err.Text();
  EXPECT_NE(lines[0].find("] 100% "), std::string::npos) << "nothing to do is all done: " << lines[0];
  EXPECT_NE(lines[1].find("]  30% "), std::string::npos) << lines[1];
  EXPECT_NE(lines[1].find(" ETA "), std::string::npos) << "an unfinished bar never claims its end: " << lines[1];
}

// A pseudo-terminal as stderr (raw mode, so what the bar writes arrives unchanged).
class Pty {
 public:
  Pty() {
    master_ = ::posix_openpt(O_RDWR | O_NOCTTY);
    if (master_ < 0 || ::grantpt(master_) != 0 || ::unlockpt(master_) != 0) return;
    const char* name = ::ptsname(master_);
    if (name == nullptr) return;
    slave_ = ::open(name, O_RDWR | O_NOCTTY);
    if (slave_ < 0) return;
    termios t{};
    ::tcgetattr(slave_, &t);
    ::cfmakeraw(&t);
    ::tcsetattr(slave_, TCSANOW, &t);
    ::fcntl(master_, F_SETFL, O_NONBLOCK);
  }
  ~Pty() {
    if (slave_ >= 0) ::close(slave_);
    if (master_ >= 0) ::close(master_);
  }
  bool ok() const { return slave_ >= 0; }
  int slave() const { return slave_; }
  // What has arrived so far (the writes are synchronous; a short wait lets the line discipline pass them on).
  std::string Drain() {
    std::fflush(stderr);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    std::string out;
    char buf[4096];
    for (ssize_t n; (n = ::read(master_, buf, sizeof buf)) > 0;) out.append(buf, static_cast<size_t>(n));
    return out;
  }

 private:
  int master_ = -1;
  int slave_ = -1;
};

// On a terminal the bar is redrawn in place ("\r", no line break) at most every 100 ms, whatever the tenths; the final
// line ends it; an unfinished bar gets a line break when destroyed, so that what follows starts on a line of its own.
TEST(ProgressBarTest, OnATerminalRedrawsInPlaceAtMostTenTimesASecond) {
  Pty pty;
  ASSERT_TRUE(pty.ok()) << "no pseudo-terminal: " << std::strerror(errno);
  ASSERT_TRUE(::isatty(pty.slave()));
  StderrTo redirect(pty.slave());
  SetLogLevel(LogLevel::kInfo);
  std::string finished_text, unfinished_text;
  using Clock = std::chrono::steady_clock;
  // The "not drawn" checks hold when the updates came within 100 ms (a machine that stalls the test longer between
  // them would rightly draw; the elapsed time is measured, not assumed).
  auto within_100ms = [](Clock::time_point since) { return Clock::now() - since < std::chrono::milliseconds(90); };
  {
    const Clock::time_point before = Clock::now();
    ProgressBar bar("load", 100);
    for (uint64_t d = 0; d <= 90; d += 10) bar.Update(d);  // every tenth, within 100 ms of the start: not drawn
    const bool quick = within_100ms(before);
    const std::string early = pty.Drain();
    if (quick) {
      EXPECT_EQ(early, "");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(150));
    const Clock::time_point redraw = Clock::now();
    bar.Update(95);
    bar.Update(96);  // right after a redraw: not drawn
    const bool quick_again = within_100ms(redraw);
    const std::string drawn = pty.Drain();
    EXPECT_EQ(drawn.find('\n'), std::string::npos) << drawn;
    ASSERT_EQ(drawn.rfind("\rload [", 0), 0u) << drawn;
    if (quick_again) {
      EXPECT_EQ(drawn.find('\r', 1), std::string::npos) << "one redraw: " << drawn;
    }
    EXPECT_NE(drawn.find("]  95% "), std::string::npos) << drawn;
    EXPECT_EQ(FilledCells(drawn), 28);  // 0.95 * 30, rounded down
    bar.Finish();
    finished_text = pty.Drain();
  }
  EXPECT_EQ(finished_text.rfind("\rload [", 0), 0u) << finished_text;
  EXPECT_NE(finished_text.find("] 100% "), std::string::npos) << finished_text;
  ASSERT_FALSE(finished_text.empty());
  EXPECT_EQ(finished_text.back(), '\n');
  EXPECT_NE(finished_text.find(" in "), std::string::npos) << finished_text;
  EXPECT_EQ(pty.Drain(), "") << "a finished bar adds nothing when destroyed";
  {
    ProgressBar cut("cut", 100);
    cut.Update(50);
  }
  unfinished_text = pty.Drain();
  EXPECT_EQ(unfinished_text, "\n") << "an unfinished bar (drawn or not) ends its line";
}

}  // namespace
}  // namespace nflash
