// Placeholder while the profiler issue is built; replaced by its implementation.
#include "profiler/commands.h"
#include "profiler/profile.h"
namespace nflash::profiler {
void RegisterProfileCommand(CLI::App&, cli::CommandAction*) {}
Status InspectProfile(const std::string&, const std::string&) { return Status::Unsupported("profile"); }
}
