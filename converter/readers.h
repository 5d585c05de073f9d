// Entry points of the converter: one reader per source format, and the GGUF model writer.
#pragma once

#include <string>

#include "converter/model_ir.h"
#include "runtime/core/ggml_type.h"
#include "runtime/core/status.h"

namespace nflash::converter {

// llama2.c checkpoint (legacy v0, or v1 "ak42" header) plus its tokenizer.bin. llama2.c files do not record the FFN
// activation, so the caller says it (default silu).
Result<SourceModel> ReadLlama2c(const std::string& path, const std::string& tokenizer_path, FfnActivation activation);
// Hugging Face directory: config.json, model.safetensors or sharded model-*-of-*.safetensors with
// model.safetensors.index.json, tokenizer.json and/or tokenizer.model. Llama/Mistral/Mixtral architectures.
Result<SourceModel> ReadHfDirectory(const std::string& dir);
// A GGUF llama-architecture model (any nflash-readable tensor types), including PowerInfer files with predictors.
Result<SourceModel> ReadGgufModel(const std::string& path);

struct WriteOptions {
  std::string path;
  GgmlType type = GgmlType::kF32;  // F32, F16, Q8_0 or Q4_0 for 2-D weights; norms stay F32
  bool overwrite = false;
  bool progress = true;
};
// Writes `model` as a llama.cpp-compatible GGUF v3 file (temporary name, renamed when complete).
Status WriteModelGguf(const SourceModel& model, const WriteOptions& options);

}  // namespace nflash::converter
