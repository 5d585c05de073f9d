// Placeholder while the packer issue is built; replaced by its implementation.
#include "packer/commands.h"
namespace nflash::packer {
void RegisterPackCommand(CLI::App&, cli::CommandAction*) {}
void RegisterVerifyCommand(CLI::App&, cli::CommandAction*) {}
Status InspectDeployment(const std::string&) { return Status::Unsupported("deployment"); }
}  // namespace nflash::packer
