// Model opening for the inference commands (GGUF or llama2.c converted on the fly).
#include "runtime/cli/model_loader.h"

#include <unistd.h>

#include <CLI/CLI.hpp>

#include <cstdlib>
#include <cstring>

#include "converter/readers.h"
#include "runtime/cli/validators.h"
#include "runtime/core/file.h"
#include "runtime/core/log.h"
#include "runtime/engine/context.h"

namespace nflash::cli {
namespace {

Result<bool> IsGguf(const std::string& path) {
  NF_ASSIGN_OR_RETURN(auto f, OpenPreadFile(path));
  if (f->Size() < 4) return false;
  char magic[4];
  NF_RETURN_IF_ERROR(f->ReadAt(0, 4, magic));
  return std::memcmp(magic, "GGUF", 4) == 0;
}

}  // namespace

Result<LoadedModel> LoadModelForInference(const ModelSource& source) {
  LoadedModel out;
  NF_ASSIGN_OR_RETURN(bool gguf, IsGguf(source.path));
  if (gguf) {
    if (!source.tokenizer.empty() || !source.activation.empty()) {
      return Status::InvalidArgument("--tokenizer and --activation apply to llama2.c checkpoints only; " +
                                     source.path + " is a GGUF file that carries both");
    }
    NF_ASSIGN_OR_RETURN(out.model, Model::Load(source.path, LoadOptions{source.use_mmap}));
    out.description = source.use_mmap ? "GGUF, mmap" : "GGUF, read into memory";
  } else {
    FfnActivation act = FfnActivation::kSilu;
    if (!source.activation.empty()) {
      auto a = ParseFfnActivation(source.activation);
      if (!a) return Status::InvalidArgument("--activation " + source.activation + ": expected silu, relu or drelu");
      act = *a;
    }
    std::string tokenizer = source.tokenizer;
    if (tokenizer.empty()) {
      NF_ASSIGN_OR_RETURN(tokenizer, converter::FindLlama2cTokenizer(source.path));
    }
    NF_ASSIGN_OR_RETURN(converter::SourceModel src, converter::ReadLlama2c(source.path, tokenizer, act));
    // The converted F32 file lives only in memory: written to a temporary name, read back, unlinked.
    const char* tmpdir = std::getenv("TMPDIR");
    std::string tmpl = std::string(tmpdir && *tmpdir ? tmpdir : "/tmp") + "/nflash-llama2c-XXXXXX";
    std::vector<char> name(tmpl.begin(), tmpl.end());
    name.push_back('\0');
    int fd = ::mkstemp(name.data());
    if (fd < 0) return Status::FromErrno("cannot create a temporary file " + tmpl, errno);
    ::close(fd);
    std::string tmp_path = name.data();
    converter::WriteOptions wo;
    wo.path = tmp_path;
    wo.type = GgmlType::kF32;
    wo.overwrite = true;
    wo.progress = false;
    Status written = converter::WriteModelGguf(src, wo);
    Result<std::unique_ptr<Model>> model = written.ok() ? Model::Load(tmp_path, LoadOptions{false}) : written;
    ::unlink(tmp_path.c_str());
    if (!model.ok()) return model.status().WithContext("converting " + source.path);
    out.model = std::move(model).value();
    out.description = "llama2.c, converted to F32 GGUF in memory";
  }
  NF_ASSIGN_OR_RETURN(out.tokenizer, LoadTokenizer(out.model->gguf()));
  return out;
}

CLI::Option* AddKvTypeOption(CLI::App* sub, std::string* kv_type, const std::string& what) {
  return sub
      ->add_option("--kv-type", *kv_type,
                   what + ": f32 (exact) or f16 (half the memory; keys and values rounded to half precision)")
      ->check(CLI::IsMember({KvTypeName(KvType::kF32), KvTypeName(KvType::kF16)}));
}

CLI::Option* AddBatchOption(CLI::App* sub, int64_t* max_batch, const std::string& what) {
  return sub
      ->add_option("--batch", *max_batch,
                   "Prompt tokens run through the layers at a time (longer prompts in chunks of near-equal size)" +
                       what)
      ->check(cli::kPositive)
      ->capture_default_str();
}

void AddSamplerOptions(CLI::App* sub, SamplerConfig* sampler) {
  sub->add_option("--temp", sampler->temperature, "Temperature (0: greedy)")->check(cli::kNonNegative);
  sub->add_option("--top-k", sampler->top_k, "Top-k (0: off)");
  sub->add_option("--top-p", sampler->top_p, "Top-p (1: off)");
  sub->add_option("--min-p", sampler->min_p, "Min-p (0: off)");
  sub->add_option("--repeat-penalty", sampler->repeat_penalty, "Repetition penalty (1: off)");
  sub->add_option("--repeat-last-n", sampler->repeat_last_n, "Tokens the repetition penalty looks back at");
  sub->add_option("-s,--seed", sampler->seed, "Random seed");
}

void AddModelOptions(CLI::App* sub, ModelSource* src, int* threads, bool* no_mmap, bool model_required) {
  sub->add_option("-m,--model", src->path, "Model: GGUF, or llama2.c checkpoint (converted in memory)")
      ->required(model_required)
      ->check(CLI::ExistingFile);
  sub->add_option("--tokenizer", src->tokenizer, "llama2.c only: tokenizer.bin (default: beside the checkpoint)");
  sub->add_option("--activation", src->activation, "llama2.c only: FFN activation silu|relu|drelu (default silu)");
  sub->add_option("-t,--threads", *threads, "Compute threads (0: all cores)");
  sub->add_flag("--no-mmap", *no_mmap, "Read the weights into memory instead of mapping the file");
}

void ExcludeModelOnlyOptions(CLI::App* sub, CLI::Option* deploy) {
  for (const char* name : {"--tokenizer", "--activation", "--no-mmap"}) sub->get_option(name)->excludes(deploy);
}

}  // namespace nflash::cli
