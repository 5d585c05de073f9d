// `nflash serve`: the HTTP server front end (docs/server.md).
#pragma once

#include "runtime/cli/command.h"

namespace nflash::server {

void RegisterServeCommand(CLI::App& app, cli::CommandAction* action);

}  // namespace nflash::server
