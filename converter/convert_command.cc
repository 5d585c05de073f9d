// `nflash convert`: any supported source (llama2.c, Hugging Face directory, GGUF) to a llama.cpp-compatible GGUF.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>

#include "converter/commands.h"
#include "converter/readers.h"
#include "runtime/core/file.h"
#include "runtime/core/gguf.h"
#include "runtime/core/log.h"

namespace nflash::converter {
namespace {

namespace fs = std::filesystem;

struct ConvertFlags {
  std::string input;
  std::string output;
  std::string type = "f32";
  std::string tokenizer;
  std::string activation;
  bool force = false;
  bool q4_reference = false;
};

enum class InputFormat { kHfDirectory, kGguf, kLlama2c };

Result<InputFormat> DetectFormat(const std::string& input) {
  std::error_code ec;
  const fs::file_status st = fs::status(input, ec);
  if (ec || !fs::exists(st)) return Status::NotFound("input " + input + " does not exist");
  if (fs::is_directory(st)) return InputFormat::kHfDirectory;
  NF_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> f, OpenPreadFile(input));
  if (f->Size() >= 4) {
    uint32_t magic = 0;
    NF_RETURN_IF_ERROR(f->ReadAt(0, 4, &magic));
    if (magic == kGgufMagic) return InputFormat::kGguf;
  }
  return InputFormat::kLlama2c;
}

std::string HumanBytes(uint64_t b) {
  char buf[32];
  if (b >= (uint64_t{1} << 30)) {
    std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(b) / (1 << 30));
  } else if (b >= (uint64_t{1} << 20)) {
    std::snprintf(buf, sizeof buf, "%.2f MiB", static_cast<double>(b) / (1 << 20));
  } else {
    std::snprintf(buf, sizeof buf, "%.1f KiB", static_cast<double>(b) / 1024);
  }
  return buf;
}

Status RunConvert(const ConvertFlags& flags) {
  const auto type = ParseGgmlType(flags.type);
  if (!type || (*type != GgmlType::kF32 && *type != GgmlType::kF16 && *type != GgmlType::kBF16 &&
                *type != GgmlType::kQ8_0 && *type != GgmlType::kQ4_0)) {
    return Status::InvalidArgument("--type " + flags.type + " is not supported; choose f32, f16, bf16, q8_0 or q4_0");
  }
  // The rounding choice exists for Q4_0 blocks only (the head stays Q8_0 even then): with another type the flag
  // would change nothing.
  if (flags.q4_reference && *type != GgmlType::kQ4_0) {
    return Status::InvalidArgument("--q4-reference applies to --type q4_0 only (the rounding of Q4_0 blocks); "
                                   "--type is " + flags.type);
  }
  std::optional<FfnActivation> activation;
  if (!flags.activation.empty()) {
    activation = ParseFfnActivation(flags.activation);
    if (!activation) {
      return Status::InvalidArgument("--activation " + flags.activation + " is not one of silu, relu, drelu");
    }
  }
  // Checked before any work, so a long conversion does not end in a refusal.
  if (!flags.force && FileExists(flags.output)) {
    return Status::InvalidArgument(flags.output + " exists; pass --force to overwrite");
  }

  NF_ASSIGN_OR_RETURN(InputFormat format, DetectFormat(flags.input));
  if (format != InputFormat::kLlama2c && !flags.tokenizer.empty()) {
    return Status::InvalidArgument("--tokenizer applies to llama2.c checkpoints only; " + flags.input +
                                   " carries its own tokenizer");
  }
  SourceModel model;
  switch (format) {
    case InputFormat::kHfDirectory: {
      NF_ASSIGN_OR_RETURN(model, ReadHfDirectory(flags.input));
      break;
    }
    case InputFormat::kGguf: {
      NF_ASSIGN_OR_RETURN(model, ReadGgufModel(flags.input));
      break;
    }
    case InputFormat::kLlama2c: {
      std::string tokenizer = flags.tokenizer;
      if (tokenizer.empty()) {
        NF_ASSIGN_OR_RETURN(tokenizer, FindLlama2cTokenizer(flags.input));
        NF_LOG(Info) << "tokenizer: " << tokenizer;
      }
      NF_ASSIGN_OR_RETURN(model, ReadLlama2c(flags.input, tokenizer, activation.value_or(FfnActivation::kSilu)));
      break;
    }
  }
  if (activation) model.config.activation = *activation;
  NF_LOG(Info) << "read " << flags.input << " (" << model.source_format << "): " << model.config.n_layers
               << " layers, dim " << model.config.dim << ", " << model.tensors.size() << " tensors, activation "
               << FfnActivationName(model.config.activation);

  WriteOptions options;
  options.path = flags.output;
  options.type = *type;
  options.overwrite = flags.force;
  options.q4_0_scale_search = !flags.q4_reference;
  options.progress = GetLogLevel() <= LogLevel::kInfo;
  WriteSummary summary;
  NF_RETURN_IF_ERROR(WriteModelGguf(model, options, &summary));

  std::string types;
  for (const auto& [t, count] : summary.tensors_by_type) {
    if (!types.empty()) types += ", ";
    types += std::string(GgmlTypeName(t)) + " x" + std::to_string(count) + " (" +
             HumanBytes(summary.bytes_by_type[t]) + ")";
  }
  std::printf("converted %s (%s) -> %s: %zu tensors, %s (%llu bytes), %s", flags.input.c_str(),
              model.source_format.c_str(), flags.output.c_str(), summary.n_tensors,
              HumanBytes(summary.file_bytes).c_str(), static_cast<unsigned long long>(summary.file_bytes),
              types.c_str());
  if (summary.f16_fallbacks > 0) {
    std::printf("; %zu tensors as f16 (row length not a multiple of %u)", summary.f16_fallbacks,
                TypeInfo(*type).block_size);
  }
  std::printf("; %.2f s\n", summary.seconds);
  return Status::Ok();
}

}  // namespace

void RegisterConvertCommand(CLI::App& app, cli::CommandAction* action) {
  auto flags = std::make_shared<ConvertFlags>();
  CLI::App* cmd = app.add_subcommand(
      "convert",
      "Convert a model (llama2.c checkpoint, Hugging Face directory, or GGUF) to a llama.cpp-compatible GGUF file");
  cmd->add_option("input", flags->input,
                  "Source: a llama2.c .bin checkpoint, a Hugging Face model directory, or a .gguf file")
      ->required();
  cmd->add_option("-o,--output", flags->output, "Output .gguf path")->required();
  cmd->add_option("--type", flags->type, "Type of 2-D weights: f32, f16, bf16, q8_0, q4_0 (norms stay f32)")
      ->capture_default_str();
  cmd->add_option("--tokenizer", flags->tokenizer,
                  "llama2.c tokenizer .bin (default: tokenizer.bin or tok*.bin beside the checkpoint)");
  cmd->add_option("--activation", flags->activation,
                  "FFN activation silu|relu|drelu (default: what the input says; silu for llama2.c)");
  cmd->add_flag("--force", flags->force, "Overwrite the output if it exists");
  cmd->add_flag("--q4-reference", flags->q4_reference,
                "--type q4_0 only: ggml's reference rounding (bit-identical to llama.cpp) instead of error-minimising "
                "scales");
  cmd->callback([flags, action] { *action = [flags] { return RunConvert(*flags); }; });
}

}  // namespace nflash::converter
