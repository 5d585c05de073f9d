// The `nflash bench` subcommand (and its hidden `bench-row` helper that runs one row in a child process).
#pragma once

#include "runtime/cli/command.h"

namespace nflash::bench {

// `nflash bench`: the models x modes x memory budgets x tests grid (docs/bench.md); `nflash bench-row` (hidden).
void RegisterBenchCommand(CLI::App& app, cli::CommandAction* action);

}  // namespace nflash::bench
