// `nflash pack`, `nflash verify` and `nflash inspect DEPLOY_DIR`: thin CLI entries over packer/pack.h, verify.h and
// deployment.h.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <memory>
#include <string>

#include "packer/commands.h"
#include "packer/deployment.h"
#include "packer/pack.h"
#include "packer/replay.h"
#include "packer/verify.h"
#include "profiler/profile.h"
#include "runtime/cli/validators.h"
#include "runtime/core/checksum.h"
#include "runtime/core/log.h"
#include "runtime/core/thread_pool.h"

namespace nflash::packer {
namespace {

struct PackFlags {
  std::string model, profile, output, order = "coactivation", predictor;
  double hot_fraction = -1.0;
  bool force = false;
  int threads = 0;
  bool order_given = false;  // --order on the command line (not the default)
};

std::string Mib(uint64_t b) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f MiB", static_cast<double>(b) / (1 << 20));
  return buf;
}

Status RunPack(const PackFlags& flags) {
  PackOptions options;
  NF_ASSIGN_OR_RETURN(options.order, ParseNeuronOrder(flags.order));
  if (flags.hot_fraction != -1.0 && (flags.hot_fraction < 0.0 || flags.hot_fraction > 1.0)) {
    return Status::InvalidArgument("--hot-fraction " + std::to_string(flags.hot_fraction) + " must be in [0, 1]");
  }
  options.hot_fraction = flags.hot_fraction;
  options.predictor_path = flags.predictor;
  options.profile_path = flags.profile;
  options.overwrite = flags.force;
  NF_ASSIGN_OR_RETURN(profiler::ModelProfile profile, profiler::LoadProfile(flags.profile));
  // Asked for by name, the co-activation order falls back to hotness where the profile has no partners (made with
  // --coact-k 0): said, since the layout is then the one --order hotness makes.
  if (flags.order_given && options.order == NeuronOrder::kCoactivation) {
    size_t without = 0;
    for (const profiler::FfnProfile& ffn : profile.ffns) without += EffectiveOrder(ffn, options.order) != options.order;
    if (without == profile.ffns.size()) {
      NF_LOG(Warning) << "--order coactivation: " << flags.profile
                      << " has no co-activation data (profiled with --coact-k 0); the hotness order is used";
    } else if (without > 0) {
      NF_LOG(Warning) << "--order coactivation: " << without << " of " << profile.ffns.size() << " FFNs of "
                      << flags.profile << " have no co-activation data; they use the hotness order";
    }
  }
  NF_ASSIGN_OR_RETURN(uint64_t profile_hash, HashFile(flags.profile));
  ThreadPool pool(flags.threads);
  NF_ASSIGN_OR_RETURN(PackStats s, PackDeployment(flags.model, profile, HashToHex(profile_hash), flags.output,
                                                  options, &pool));
  const double mb = static_cast<double>(s.flash_bytes + s.resident_bytes) / 1e6;
  std::printf("packed %s -> %s: ffn.bin %s (padding %s, %.1f%%), resident.gguf %s, hot neurons %lld of %lld, "
              "%.2f s (%.1f MB/s written)\n",
              flags.model.c_str(), flags.output.c_str(), Mib(s.flash_bytes).c_str(), Mib(s.padding_bytes).c_str(),
              s.flash_bytes ? 100.0 * static_cast<double>(s.padding_bytes) / static_cast<double>(s.flash_bytes) : 0.0,
              Mib(s.resident_bytes).c_str(), static_cast<long long>(s.hot_neurons), static_cast<long long>(s.neurons),
              s.seconds, s.seconds > 0 ? mb / s.seconds : 0.0);
  return Status::Ok();
}

struct VerifyFlags {
  std::string dir;
  ReplayOptions replay;
  int threads = 0;
};

Status RunVerify(const VerifyFlags& flags) {
  const std::string& dir = flags.dir;
  NF_ASSIGN_OR_RETURN(VerifyReport r, VerifyDeployment(dir, /*progress=*/true));
  std::printf("%s: OK (%lld regions, %lld bundles, %s of ffn.bin checked in %.2f s)\n", dir.c_str(),
              static_cast<long long>(r.regions), static_cast<long long>(r.bundles), Mib(r.flash_bytes).c_str(),
              r.seconds);
  if (flags.replay.text_path.empty()) return Status::Ok();
  if (flags.replay.model_path.empty()) return Status::InvalidArgument("--replay-text needs --model (the source model)");
  NF_ASSIGN_OR_RETURN(auto d, Deployment::Open(dir));
  ThreadPool pool(flags.threads);
  NF_ASSIGN_OR_RETURN(ReplayStats s, ReplayHeldOut(*d, flags.replay, &pool));
  std::printf("replay of %lld held-out tokens (%s order, no neuron cache; reads of whole %llu B groups, adjacent "
              "groups merged):\n",
              static_cast<long long>(s.tokens), d->manifest().order.c_str(),
              static_cast<unsigned long long>(d->layout().group_bytes));
  std::printf("  %-28s %10s %12s %12s %10s %10s\n", "per token", "active", "needed KiB", "read KiB", "groups",
              "requests");
  std::printf("  %-28s %10.2f %12.2f %12.2f %10.2f %10.2f\n", "all neurons from flash", s.active,
              s.bundle_bytes / 1024, s.read_bytes / 1024, s.groups, s.requests);
  std::printf("  %-28s %10.2f %12.2f %12.2f %10.2f %10.2f\n", "cold only (hot resident)", s.active_cold,
              s.bundle_bytes_cold / 1024, s.read_bytes_cold / 1024, s.groups_cold, s.requests_cold);
  return Status::Ok();
}

}  // namespace

void RegisterPackCommand(CLI::App& app, cli::CommandAction* action) {
  auto flags = std::make_shared<PackFlags>();
  CLI::App* cmd = app.add_subcommand("pack", "Lay out a model's FFN neurons on flash: DEPLOY_DIR with manifest.json, "
                                             "resident.gguf and ffn.bin (see docs/deployment-format.md)");
  cmd->add_option("-m,--model", flags->model, "Model GGUF (the one the profile was made from)")
      ->required()->check(CLI::ExistingFile);
  cmd->add_option("-p,--profile", flags->profile, "Profile from nflash profile")->required()->check(CLI::ExistingFile);
  cmd->add_option("-o,--output", flags->output, "Deployment directory to create")->required();
  CLI::Option* order = cmd->add_option("--order", flags->order,
                                       "Cold neuron order: coactivation (greedy chains of co-activation partners; "
                                       "popularity where the profile has none, with a warning when asked for) or "
                                       "hotness (popularity)");
  cmd->add_option("--hot-fraction", flags->hot_fraction,
                  "Share of each layer's neurons placed in the hot region (default: the most popular neurons that "
                  "cover 50% of the profile's activations)");
  cmd->add_option("--predictor", flags->predictor, "Predictor GGUF to ship in the deployment")->check(CLI::ExistingFile);
  cmd->add_option("--threads,-t", flags->threads, "Threads (0: all cores)");
  cmd->add_flag("--force", flags->force, "Replace DEPLOY_DIR if it exists");
  cmd->callback([flags, action, order] {
    flags->order_given = order->count() > 0;
    *action = [flags] { return RunPack(*flags); };
  });
}

void RegisterVerifyCommand(CLI::App& app, cli::CommandAction* action) {
  auto flags = std::make_shared<VerifyFlags>();
  CLI::App* cmd = app.add_subcommand("verify", "Check a deployment directory fully: manifest, sizes, hashes, every "
                                               "bundle checksum and the padding of ffn.bin");
  cmd->add_option("deploy_dir", flags->dir, "Deployment directory from nflash pack")->required();
  CLI::Option* replay = cmd->add_option("--replay-text", flags->replay.text_path,
                                        "Also replay the source model's activations on this held-out text through "
                                        "the layout and report bytes and read requests per token")
                            ->check(CLI::ExistingFile);
  // The replay's settings: the checks alone read none of them, so without --replay-text CLI11 refuses them by name.
  cmd->add_option("-m,--model", flags->replay.model_path, "Source model GGUF (for --replay-text)")
      ->check(CLI::ExistingFile)
      ->needs(replay);
  cmd->add_option("--tokens", flags->replay.tokens, "Tokens replayed (with --replay-text)")
      ->check(cli::kPositive)
      ->needs(replay);
  cmd->add_option("--threads,-t", flags->threads, "Threads of the replay (with --replay-text; 0: all cores)")
      ->needs(replay);
  cmd->callback([flags, action] { *action = [flags] { return RunVerify(*flags); }; });
}

Status InspectDeployment(const std::string& dir) {
  NF_ASSIGN_OR_RETURN(auto d, Deployment::Open(dir));
  const Manifest& m = d->manifest();
  const BundleLayout& l = m.layout;
  int64_t hot = 0, neurons = 0;
  uint64_t hot_bytes = 0;
  for (const RegionInfo& r : m.regions) {
    hot += r.hot_count;
    neurons += r.n_neurons;
    hot_bytes += r.hot_bytes;
  }
  std::printf("deployment %s (schema %d)\n", dir.c_str(), m.schema_version);
  std::printf("  model            %s (xxh64 %s), profile xxh64 %s\n", m.model_name.c_str(), m.model_hash.c_str(),
              m.profile_hash.c_str());
  std::printf("  shape            dim %lld, n_ff %lld, layers %lld, experts %lld, activation %s\n",
              static_cast<long long>(m.dim), static_cast<long long>(m.n_ff), static_cast<long long>(m.n_layers),
              static_cast<long long>(m.n_experts), m.activation.c_str());
  std::printf("  bundle           gate %s %llu B + up %s %llu B + down %s %llu B = %llu B\n",
              std::string(GgmlTypeName(l.gate_type)).c_str(), static_cast<unsigned long long>(l.gate_bytes),
              std::string(GgmlTypeName(l.up_type)).c_str(), static_cast<unsigned long long>(l.up_bytes),
              std::string(GgmlTypeName(l.down_type)).c_str(), static_cast<unsigned long long>(l.down_bytes),
              static_cast<unsigned long long>(l.bundle_bytes));
  std::printf("  placement        %lld bundle(s) per %llu B group (alignment %llu), read amplification %.3f\n",
              static_cast<long long>(l.slots_per_group), static_cast<unsigned long long>(l.group_bytes),
              static_cast<unsigned long long>(m.alignment), m.read_amplification);
  std::printf("  ffn.bin          %s, padding %s (%.1f%%)\n", Mib(m.flash_bytes).c_str(), Mib(m.padding_bytes).c_str(),
              m.flash_bytes ? 100.0 * static_cast<double>(m.padding_bytes) / static_cast<double>(m.flash_bytes) : 0.0);
  std::printf("  resident.gguf    %s%s%s\n", Mib(m.resident_bytes).c_str(),
              m.predictor_hash.empty() ? "" : (", predictor.gguf " + Mib(m.predictor_bytes)).c_str(),
              m.lookahead_hash.empty() ? "" : (", lookahead.gguf " + Mib(m.lookahead_bytes)).c_str());
  std::printf("  order            %s; hot neurons %lld of %lld (%.1f%%), hot regions %s\n", m.order.c_str(),
              static_cast<long long>(hot), static_cast<long long>(neurons),
              neurons ? 100.0 * static_cast<double>(hot) / static_cast<double>(neurons) : 0.0, Mib(hot_bytes).c_str());
  std::printf("  per token        mean active fraction %.4f%s -> %.1f KiB of bundles per token with no cache "
              "(%.1f KiB read at the group granularity)\n",
              m.mean_active_fraction, m.n_experts > 0 ? " of an expert's neurons when routed" : "",
              m.expected_bytes_per_token / 1024.0, m.expected_bytes_per_token * m.read_amplification / 1024.0);
  return Status::Ok();
}

}  // namespace nflash::packer
