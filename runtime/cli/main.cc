// Entry point of the `nflash` CLI: global flags, the subcommands of every stage, exit codes 0 ok / 1 failure / 2 usage.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>

#include "converter/commands.h"
#include "packer/commands.h"
#include "planner/commands.h"
#include "runtime/bench/commands.h"
#include "profiler/commands.h"
#include "runtime/cli/command.h"
#include "runtime/cli/run_command.h"
#include "runtime/core/log.h"
#include "runtime/server/chat_command.h"
#include "runtime/server/serve_command.h"
#include "runtime/sparse/commands.h"

int main(int argc, char** argv) {
  using namespace nflash;
  CLI::App app{"nflash: LLM inference on memory-poor devices (activation sparsity, FFN on flash)", "nflash"};
  app.require_subcommand(1);
  app.get_formatter()->column_width(36);
  app.option_defaults()->always_capture_default();
  bool verbose = false;
  bool quiet = false;
  app.add_flag("-v,--verbose", verbose, "Print debug messages");
  app.add_flag("-q,--quiet", quiet, "Print only errors (no progress bars)");

  cli::CommandAction action;
  converter::RegisterConvertCommand(app, &action);
  converter::RegisterInspectCommand(app, &action, {profiler::InspectProfile, packer::InspectDeployment});
  converter::RegisterSynthCommand(app, &action);
  cli::RegisterRunCommand(app, &action);
  cli::RegisterPerplexityCommand(app, &action);
  profiler::RegisterProfileCommand(app, &action);
  profiler::RegisterTrainPredictorCommand(app, &action);
  profiler::RegisterProfileHwCommand(app, &action);
  packer::RegisterPackCommand(app, &action);
  packer::RegisterVerifyCommand(app, &action);
  planner::RegisterPlanCommand(app, &action);
  sparse::RegisterOffloadCommand(app, &action);
  bench::RegisterBenchCommand(app, &action);
  server::RegisterServeCommand(app, &action);
  server::RegisterChatCommand(app, &action);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int rc = app.exit(e);
    return rc == 0 ? cli::kExitOk : cli::kExitUsage;
  }
  SetLogLevel(quiet ? LogLevel::kError : verbose ? LogLevel::kDebug : LogLevel::kInfo);
  if (!action) return cli::kExitUsage;
  Status status;
  try {
    status = action();
  } catch (const std::exception& e) {  // third-party exceptions stop here
    status = Status::Internal(std::string("unexpected exception: ") + e.what());
  }
  if (!status.ok()) {
    std::fprintf(stderr, "nflash: error: %s\n", status.ToString().c_str());
    return status.code() == StatusCode::kInvalidArgument ? cli::kExitUsage : cli::kExitFailure;
  }
  return cli::kExitOk;
}
