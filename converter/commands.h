// The converter stage's subcommands for the `nflash` CLI: convert, inspect, synth.
#pragma once

#include <functional>
#include <string>

#include "runtime/cli/command.h"

namespace nflash::converter {

void RegisterConvertCommand(CLI::App& app, cli::CommandAction* action);
// Readers of the later stages' outputs that `inspect` hands a file to (the converter does not depend on them).
struct InspectDelegates {
  std::function<Status(const std::string& path, const std::string& plot_path)> profile;  // GGUF with nflash.profile.*
  std::function<Status(const std::string& dir)> deployment;                              // a directory
};
void RegisterInspectCommand(CLI::App& app, cli::CommandAction* action, const InspectDelegates& delegates = {});
void RegisterSynthCommand(CLI::App& app, cli::CommandAction* action);

}  // namespace nflash::converter
