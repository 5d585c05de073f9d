// The profiler stage's subcommands for the `nflash` CLI: profile, train-predictor, profile-hw.
#pragma once

#include <string>

#include "runtime/cli/command.h"
#include "runtime/core/status.h"

namespace nflash::profiler {

void RegisterProfileCommand(CLI::App& app, cli::CommandAction* action);
void RegisterTrainPredictorCommand(CLI::App& app, cli::CommandAction* action);
void RegisterProfileHwCommand(CLI::App& app, cli::CommandAction* action);

// `nflash inspect PROFILE`: a summary of a profile file; with `plot_path`, also the popularity and hit-rate curves
// drawn by gnuplot (PNG or SVG by the extension).
Status InspectProfile(const std::string& path, const std::string& plot_path);

struct ModelProfile;
// The --report-thresholds table (threshold on |act(gate)| per FFN and sparsity) on stdout; nothing when the profile
// has none. Printed by `profile` and by `inspect`.
void PrintThresholdTable(const ModelProfile& profile);

}  // namespace nflash::profiler
