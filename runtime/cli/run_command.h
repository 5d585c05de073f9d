// The dense engine's subcommands: `nflash run` (generate text) and `nflash perplexity`.
#pragma once

#include "runtime/cli/command.h"

namespace nflash::cli {

void RegisterRunCommand(CLI::App& app, CommandAction* action);
void RegisterPerplexityCommand(CLI::App& app, CommandAction* action);

}  // namespace nflash::cli
