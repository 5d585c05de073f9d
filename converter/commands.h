// The converter stage's subcommands for the `nflash` CLI: convert, inspect, synth.
#pragma once

#include "runtime/cli/command.h"

namespace nflash::converter {

void RegisterConvertCommand(CLI::App& app, cli::CommandAction* action);
void RegisterInspectCommand(CLI::App& app, cli::CommandAction* action);
void RegisterSynthCommand(CLI::App& app, cli::CommandAction* action);

}  // namespace nflash::converter
