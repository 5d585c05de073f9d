// RunCapture (runtime/core/subprocess.h): a child's standard output returned whole; a non-zero exit, a death by
// signal and a program that cannot start are errors naming the command and what happened.
#include "runtime/core/subprocess.h"

#include <gtest/gtest.h>

#include <csignal>
#include <filesystem>
#include <string>

namespace nflash {
namespace {

TEST(SubprocessTest, CapturesStandardOutputAndReportsHowTheChildEnded) {
  // More than one pipe buffer (64 KiB): the parent reads while the child writes.
  auto big = RunCapture({"/bin/sh", "-c", "yes x | head -c 200000; printf end"});
  ASSERT_TRUE(big.ok()) << big.status().ToString();
  std::string expected;
  for (int i = 0; i < 100000; ++i) expected += "x\n";
  expected += "end";
  EXPECT_TRUE(*big == expected) << big->size() << " bytes, expected " << expected.size();

  auto failed = RunCapture({"/bin/sh", "-c", "echo partial; exit 3"});
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().message(), "`/bin/sh -c echo partial; exit 3` exited with code 3");

  auto killed = RunCapture({"/bin/sh", "-c", "kill -KILL $$"});
  ASSERT_FALSE(killed.ok());
  EXPECT_EQ(killed.status().message(), "`/bin/sh -c kill -KILL $$` was killed by signal " + std::to_string(SIGKILL));

  // exec fails in the child: it exits with 127 (and says so on standard error).
  auto missing = RunCapture({"/nonexistent/nflash-child"});
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().message(), "`/nonexistent/nflash-child` exited with code 127");
  EXPECT_FALSE(RunCapture({}).ok());
}

TEST(SubprocessTest, SelfExecutableIsThisTestBinary) {
  auto self = SelfExecutable();
  ASSERT_TRUE(self.ok()) << self.status().ToString();
  EXPECT_EQ(*self, std::filesystem::canonical("/proc/self/exe").string());
}

}  // namespace
}  // namespace nflash
