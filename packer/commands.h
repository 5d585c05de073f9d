// The packer stage's subcommands for the `nflash` CLI: pack, verify.
#pragma once

#include <string>

#include "runtime/cli/command.h"
#include "runtime/core/status.h"

namespace nflash::packer {

void RegisterPackCommand(CLI::App& app, cli::CommandAction* action);
void RegisterVerifyCommand(CLI::App& app, cli::CommandAction* action);
// `nflash inspect DEPLOY_DIR`: layout summary (sizes, padding, hot share, expected bytes per token).
Status InspectDeployment(const std::string& dir);

}  // namespace nflash::packer
