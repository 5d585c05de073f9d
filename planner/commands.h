// The planner's subcommand for the nflash CLI.
#pragma once

#include "runtime/cli/command.h"

namespace nflash::planner {

void RegisterPlanCommand(CLI::App& app, cli::CommandAction* action);

}  // namespace nflash::planner
