// Opens a model for the CLI's inference commands: a GGUF file directly, or a llama2.c checkpoint converted on the fly
// (to an unlinked temporary F32 GGUF, mapped, so nothing is left behind).
#pragma once

#include <memory>
#include <string>

#include "runtime/core/ffn_activation.h"
#include "runtime/engine/model.h"
#include "runtime/text/sampler.h"
#include "runtime/text/tokenizer.h"

namespace CLI {
class App;
class Option;
}

namespace nflash::cli {

struct LoadedModel {
  std::unique_ptr<Model> model;
  std::unique_ptr<Tokenizer> tokenizer;
  std::string description;  // "GGUF", "llama2.c (converted in memory)"
};

struct ModelSource {
  std::string path;
  std::string tokenizer;       // llama2.c only; empty: tokenizer.bin or tok*.bin beside the checkpoint
  std::string activation;      // llama2.c only ("silu", "relu", "drelu"); empty: silu
  bool use_mmap = true;
};

Result<LoadedModel> LoadModelForInference(const ModelSource& source);

// The options of a command that loads a model this way: -m (required or not), --tokenizer, --activation, -t (compute
// threads) and --no-mmap.
void AddModelOptions(CLI::App* sub, ModelSource* src, int* threads, bool* no_mmap, bool model_required = true);
// Refuses AddModelOptions' -m-only options (--tokenizer, --activation, --no-mmap) beside `deploy`, the option of a
// deployment directory, which brings its own tokenizer and activation and reads its weights itself: CLI11 names both
// ("--no-mmap excludes --deploy"), where the options were ignored before.
void ExcludeModelOnlyOptions(CLI::App* sub, CLI::Option* deploy);

// --kv-type (KvType: f32 or f16, ParseKvType's names) with `what` ahead of the shared explanation; callers chain
// capture_default_str() when their default is a type rather than "not given".
CLI::Option* AddKvTypeOption(CLI::App* sub, std::string* kv_type, const std::string& what);

// --batch (InferenceContext::SetMaxBatch, default kDefaultMaxBatch) with `what` after the shared explanation.
CLI::Option* AddBatchOption(CLI::App* sub, int64_t* max_batch, const std::string& what);

// The sampler's options: --temp, --top-k, --top-p, --min-p, --repeat-penalty, --repeat-last-n, -s/--seed.
void AddSamplerOptions(CLI::App* sub, SamplerConfig* sampler);

}  // namespace nflash::cli
