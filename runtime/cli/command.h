// How stages plug their subcommands into the `nflash` CLI: each stage's Register*Command adds a CLI11 subcommand whose
// parse callback stores the work to run; main runs it once parsing succeeded and maps its Status to the exit code.
#pragma once

#include <functional>

#include "runtime/core/status.h"

namespace CLI {
class App;
}

namespace nflash::cli {

// The work a parsed subcommand asks for.
using CommandAction = std::function<Status()>;

// Exit codes of every nflash command.
inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;

}  // namespace nflash::cli
