// `nflash synth`: writes a synthetic Llama/Mistral/Mixtral-shaped GGUF whose FFN is activation-sparse by construction.
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>

#include "converter/commands.h"
#include "converter/readers.h"
#include "converter/synth.h"
#include "runtime/core/file.h"
#include "runtime/core/log.h"

namespace nflash::converter {
namespace {

struct SynthFlags {
  SynthOptions options;
  std::string type = "f32";
  std::string activation = "relu";
  std::string output;
  bool force = false;
  bool gate_noise_given = false;  // --gate-noise on the command line (its default is not 0, so a count is needed)
};

Status RunSynth(SynthFlags flags) {
  const auto start = std::chrono::steady_clock::now();
  const auto type = ParseGgmlType(flags.type);
  if (!type || (*type != GgmlType::kF32 && *type != GgmlType::kF16 && *type != GgmlType::kQ8_0 &&
                *type != GgmlType::kQ4_0)) {
    return Status::InvalidArgument("--type " + flags.type + " is not supported; choose f32, f16, q8_0 or q4_0");
  }
  const auto activation = ParseFfnActivation(flags.activation);
  if (!activation) return Status::InvalidArgument("--activation " + flags.activation + " is not relu, drelu or silu");
  // The noise is that of the low-rank gates: without them the weights are i.i.d. and the value would be dropped.
  if (flags.gate_noise_given && flags.options.gate_rank == 0) {
    char noise[32];
    std::snprintf(noise, sizeof noise, "%g", flags.options.gate_noise);
    return Status::InvalidArgument("--gate-noise " + std::string(noise) +
                                   " applies to predictable gates only: it needs --gate-rank R > 0 (without it the "
                                   "weights are i.i.d.)");
  }
  flags.options.type = *type;
  flags.options.activation = *activation;
  if (!flags.force && FileExists(flags.output)) {
    return Status::InvalidArgument(flags.output + " exists; pass --force to overwrite");
  }
  if (*activation == FfnActivation::kSilu) {
    NF_LOG(Warning) << "--activation silu: SiLU is never exactly zero, so --sparsity and --hot-skew cannot apply; "
                       "the FFN is dense (no calibration)";
  }
  SynthReport report;
  NF_ASSIGN_OR_RETURN(SourceModel model, BuildSyntheticModel(flags.options, &report));
  WriteOptions options;
  options.path = flags.output;
  options.type = *type;
  // Synthetic weights carry no quality to preserve, and the calibration simulated them with QuantizeRow's rounding.
  options.q4_0_scale_search = false;
  options.overwrite = flags.force;
  options.progress = GetLogLevel() <= LogLevel::kInfo;
  WriteSummary summary;
  NF_RETURN_IF_ERROR(WriteModelGguf(model, options, &summary));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  const ModelConfig& c = model.config;
  std::printf("wrote %s: SYNTHETIC weights (random, not a trained model), \"%s\", %s, %lld layers, dim %lld, ffn %lld",
              flags.output.c_str(), c.name.c_str(), c.architecture.c_str(), static_cast<long long>(c.n_layers),
              static_cast<long long>(c.dim), static_cast<long long>(c.n_ff));
  if (c.n_experts > 0) {
    std::printf(", %lld experts top-%lld", static_cast<long long>(c.n_experts),
                static_cast<long long>(c.n_experts_used));
  }
  std::printf(", %s, %llu bytes, %.1f s (calibration %.1f s)\n", flags.type.c_str(),
              static_cast<unsigned long long>(summary.file_bytes), seconds, report.calibration_seconds);
  if (report.layers.empty()) {
    std::printf("activation silu: dense FFN, no sparsity target\n");
    return Status::Ok();
  }
  std::printf("simulated on a held-out random sequence of %d tokens (target active fraction %.3f):\n",
              flags.options.calib_tokens, 1.0 - flags.options.sparsity);
  std::printf("  layer  active  jaccard(t,t+1)  jaccard(independent)  residual_rms\n");
  for (size_t l = 0; l < report.layers.size(); ++l) {
    const SynthLayerReport& r = report.layers[l];
    std::printf("  %5zu  %6.3f  %14.3f  %20.3f  %12.2f\n", l, r.active_fraction, r.consecutive_jaccard,
                r.independent_jaccard, r.residual_rms);
  }
  return Status::Ok();
}

}  // namespace

void RegisterSynthCommand(CLI::App& app, cli::CommandAction* action) {
  auto flags = std::make_shared<SynthFlags>();
  SynthOptions& o = flags->options;
  CLI::App* cmd = app.add_subcommand(
      "synth",
      "Write a SYNTHETIC (random-weight) Llama/Mistral/Mixtral/Qwen3-shaped GGUF whose ReLU FFN is activation-sparse");
  cmd->add_option("--shape", o.shape,
                  "llama-7b | llama-13b | mistral-7b | mixtral-8x7b | qwen3-8b | qwen3-30b-a3b | custom")
      ->capture_default_str();
  cmd->add_option("--arch", o.arch,
                  "custom: GGUF architecture llama (default; Mixtral's experts) | qwen3 | qwen3moe (experts)");
  cmd->add_option("--layers", o.layers, "Number of layers (cuts the shape's depth; custom default 2)");
  cmd->add_option("--dim", o.dim, "custom: embedding width (multiple of 32)");
  cmd->add_option("--ffn", o.ffn, "custom: FFN width per expert (multiple of 32)");
  cmd->add_option("--heads", o.heads, "custom: attention heads");
  cmd->add_option("--kv-heads", o.kv_heads, "custom: key/value heads (default: heads)");
  cmd->add_option("--head-dim", o.head_dim, "custom: head size (default: dim / heads)");
  cmd->add_option("--experts", o.experts, "custom: MoE experts (0: dense FFN)");
  cmd->add_option("--top-k", o.top_k, "custom, with --experts: experts used per token (default 2)");
  cmd->add_option("--vocab", o.vocab, "custom: vocabulary size (>= 259)");
  cmd->add_option("--ctx", o.context, "Context length recorded in the file (default: the shape's)");
  cmd->add_option("--type", flags->type, "Weight type: f32, f16, q8_0, q4_0 (norms and routers stay f32)")
      ->capture_default_str();
  cmd->add_option("--seed", o.seed, "Seed: the same seed and flags give the same bytes")->capture_default_str();
  cmd->add_option("--activation", flags->activation,
                  "FFN activation relu | drelu | silu (silu cannot be sparse: --sparsity is then ignored)")
      ->capture_default_str();
  cmd->add_option("--sparsity", o.sparsity, "Fraction of FFN neurons inactive per token")->capture_default_str();
  cmd->add_option("--hot-skew", o.hot_skew, "Power-law exponent of neuron popularity over rank (0: uniform)")
      ->capture_default_str();
  cmd->add_option("--gate-rank", o.gate_rank,
                  "Gate/up weights = rank-R product + noise, so a low-rank predictor can learn activity (0: i.i.d.)")
      ->capture_default_str();
  CLI::Option* gate_noise =
      cmd->add_option("--gate-noise", o.gate_noise, "With --gate-rank only: relative std of the i.i.d. part")
          ->capture_default_str();
  cmd->add_option("--calib-tokens", o.calib_tokens, "Tokens per calibration sequence")->capture_default_str();
  cmd->add_option("--calib-sequences", o.calib_sequences, "Calibration sequences (the last one is held out)")
      ->capture_default_str();
  cmd->add_option("--threads", o.threads, "Threads (0: all)")->capture_default_str();
  cmd->add_option("-o,--output", flags->output, "Output .gguf path")->required();
  cmd->add_flag("--force", flags->force, "Overwrite the output if it exists");
  cmd->callback([flags, action, gate_noise] {
    flags->gate_noise_given = gate_noise->count() > 0;
    *action = [flags] { return RunSynth(*flags); };
  });
}

}  // namespace nflash::converter
