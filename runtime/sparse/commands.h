// The sparse runtime's subcommands of the `nflash` CLI.
#pragma once

#include "runtime/cli/command.h"

namespace nflash::sparse {

// `nflash offload`: greedy generation from a deployment directory with the FFN on flash.
void RegisterOffloadCommand(CLI::App& app, cli::CommandAction* action);

}  // namespace nflash::sparse
