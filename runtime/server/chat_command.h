// `nflash chat`: a conversation in the terminal (docs/server.md, "nflash chat").
#pragma once

#include "runtime/cli/command.h"

namespace nflash::server {

void RegisterChatCommand(CLI::App& app, cli::CommandAction* action);

}  // namespace nflash::server
