// Child processes of this executable (see subprocess.h).
#include "runtime/core/subprocess.h"

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstring>

namespace nflash {

Result<std::string> SelfExecutable() {
  std::vector<char> buf(4096);
  const ssize_t n = ::readlink("/proc/self/exe", buf.data(), buf.size() - 1);
  if (n <= 0) return Status::IOError(std::string("readlink /proc/self/exe: ") + std::strerror(errno));
  return std::string(buf.data(), static_cast<size_t>(n));
}

Result<std::string> RunCapture(const std::vector<std::string>& argv) {
  if (argv.empty()) return Status::InvalidArgument("RunCapture: empty command");
  std::string shown;
  for (const std::string& a : argv) shown += (shown.empty() ? "" : " ") + a;
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  int out[2];
  if (::pipe2(out, O_CLOEXEC) != 0) return Status::IOError(std::string("pipe: ") + std::strerror(errno));
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(out[0]);
    ::close(out[1]);
    return Status::IOError(std::string("fork: ") + std::strerror(errno));
  }
  if (pid == 0) {
    // Child: only async-signal-safe calls until exec.
    ::dup2(out[1], STDOUT_FILENO);
    ::execv(args[0], args.data());
    static constexpr char kMsg[] = "nflash: exec of a child process failed\n";
    (void)!::write(STDERR_FILENO, kMsg, sizeof(kMsg) - 1);
    ::_exit(127);
  }
  ::close(out[1]);
  std::string text;
  char buf[65536];
  for (;;) {
    const ssize_t n = ::read(out[0], buf, sizeof(buf));
    if (n > 0) {
      text.append(buf, static_cast<size_t>(n));
    } else if (n == 0 || errno != EINTR) {
      break;
    }
  }
  ::close(out[0]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFSIGNALED(status)) {
    return Status::Internal("`" + shown + "` was killed by signal " + std::to_string(WTERMSIG(status)));
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return Status::Internal("`" + shown + "` exited with code " + std::to_string(WEXITSTATUS(status)));
  }
  return text;
}

}  // namespace nflash
