// Re-running this executable as a child (nflash bench rows, nflash plan --calibrate): the path of the running binary
// and a run that captures the child's standard output.
#pragma once

#include <string>
#include <vector>

#include "runtime/core/status.h"

namespace nflash {

// The path of the running executable (/proc/self/exe), for re-executing it.
Result<std::string> SelfExecutable();

// Runs argv[0] with `argv` (no shell), its standard error going to ours, and returns its standard output. An error
// naming the command when it cannot start, is killed by a signal or exits non-zero.
Result<std::string> RunCapture(const std::vector<std::string>& argv);

}  // namespace nflash
