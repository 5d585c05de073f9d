// `nflash profile-hw`: measures this machine (kernels, memory bandwidth, flash through io_uring O_DIRECT) and writes
// the hardware profile JSON (docs/hw-profile.md) atomically, printing the same numbers as tables.
#include <CLI/CLI.hpp>
#include <sys/statfs.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>

#include "profiler/commands.h"
#include "profiler/hw_profile.h"
#include "runtime/core/file.h"
#include "runtime/core/log.h"
#include "runtime/core/thread_placement.h"

namespace nflash::profiler {
namespace {

namespace fs = std::filesystem;

struct HwFlags {
  std::string output;
  std::string dir;
  bool quick = false;
  bool force = false;
  std::vector<int> threads;
  std::string pin_threads = "auto";
};

// The default test directory: the current one, else /var/tmp; never a tmpfs (/tmp often is), which holds RAM.
std::string DefaultDir() {
  for (const char* d : {".", "/var/tmp"}) {
    if (::access(d, W_OK) == 0 && !DescribeFilesystem(d).tmpfs) return d;
  }
  return ".";
}

Status RunProfileHw(const HwFlags& flags) {
  HwProfileOptions options;
  options.quick = flags.quick;
  options.threads = flags.threads;
  NF_ASSIGN_OR_RETURN(options.pin_threads, ParsePinThreads(flags.pin_threads));
  options.dir = flags.dir.empty() ? DefaultDir() : flags.dir;
  std::error_code ec;
  if (!fs::exists(options.dir, ec)) return Status::InvalidArgument("--dir " + options.dir + " does not exist");
  if (!fs::is_directory(options.dir, ec)) return Status::InvalidArgument("--dir " + options.dir + " is not a directory");
  if (::access(options.dir.c_str(), W_OK) != 0) {
    return Status::InvalidArgument("--dir " + options.dir + " is not writable");
  }
  for (int t : flags.threads) {
    if (t < 1 || t > 1024) return Status::InvalidArgument("--threads-list: thread count " + std::to_string(t) +
                                                          " is not in [1, 1024]");
  }
  // Create the writer first: an existing output without --force fails before minutes of measurement.
  NF_ASSIGN_OR_RETURN(auto writer, AtomicFileWriter::Create(flags.output, flags.force));
  NF_ASSIGN_OR_RETURN(nlohmann::json profile, MeasureHardware(options));
  const std::string text = profile.dump(2) + "\n";
  NF_RETURN_IF_ERROR(writer->Append(text.data(), text.size()));
  NF_RETURN_IF_ERROR(writer->Commit());
  std::fputs(FormatHwProfile(profile).c_str(), stdout);
  std::printf("wrote %s\n", flags.output.c_str());
  return Status::Ok();
}

}  // namespace

void RegisterProfileHwCommand(CLI::App& app, cli::CommandAction* action) {
  auto flags = std::make_shared<HwFlags>();
  CLI::App* cmd = app.add_subcommand(
      "profile-hw", "Measure this machine: kernel throughput per thread count, memory bandwidth, flash random and "
                    "sequential I/O (io_uring, O_DIRECT); writes a hardware profile JSON");
  cmd->add_option("-o,--output", flags->output, "Output JSON path")->required();
  cmd->add_option("--dir", flags->dir,
                  "Directory on the flash device for the temporary test file (default: current dir or /var/tmp, "
                  "never tmpfs)");
  cmd->add_flag("--quick", flags->quick, "Small sizes and short cells (< 30 s; numbers indicative only)");
  cmd->add_option("--threads-list", flags->threads, "Thread counts to measure, e.g. 1,2 (default: 1..cores)")
      ->delimiter(',');
  cmd->add_option("--pin-threads", flags->pin_threads,
                  "Where each thread count's threads run while timed: auto (default), on, off; the rule of `nflash "
                  "offload --pin-threads`, so each count is measured on the CPUs the decode would use");
  cmd->add_flag("--force", flags->force, "Overwrite the output if it exists");
  cmd->callback([flags, action] { *action = [flags] { return RunProfileHw(*flags); }; });
}

}  // namespace nflash::profiler
