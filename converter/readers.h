// Entry points of the converter: one reader per source format, and the GGUF model writer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>

#include "converter/model_ir.h"
#include "runtime/core/ggml_type.h"
#include "runtime/core/status.h"

namespace nflash::converter {

// llama2.c checkpoint (legacy v0, or v1 "ak42" header) plus its tokenizer.bin. llama2.c files do not record the FFN
// activation, so the caller says it (default silu).
Result<SourceModel> ReadLlama2c(const std::string& path, const std::string& tokenizer_path, FfnActivation activation);
// The tokenizer beside a llama2.c checkpoint: tokenizer.bin, else the only tok*.bin in its folder. InvalidArgument
// ("missing tokenizer: pass --tokenizer ...") when there is none, or when several tok*.bin make it ambiguous.
Result<std::string> FindLlama2cTokenizer(const std::string& checkpoint);
// Hugging Face directory: config.json, model.safetensors or sharded model-*-of-*.safetensors with
// model.safetensors.index.json, tokenizer.json and/or tokenizer.model. Llama, Mistral, Mixtral, Qwen2, Qwen3,
// Qwen3-MoE and Phi-3 architectures (hf_reader.h).
Result<SourceModel> ReadHfDirectory(const std::string& dir);
// A GGUF model (any nflash-readable tensor types) of llama.cpp's llama architecture (including PowerInfer files with
// predictors), or of its qwen2 or phi3 architecture, rearranged into the llama layout: q and k rows from rotate-half
// into pair order, Phi-3's fused attn_qkv and ffn_up split, LongRoPE's short factors as rope_freqs.weight with the
// attention factor folded into q and k. A qwen3 or qwen3moe model keeps its architecture (its tensors as they are).
Result<SourceModel> ReadGgufModel(const std::string& path);

struct WriteOptions {
  std::string path;
  GgmlType type = GgmlType::kF32;  // F32, F16, Q8_0 or Q4_0 for 2-D weights; norms stay F32
  bool overwrite = false;
  bool progress = true;
  int threads = 0;  // quantization threads (0: all cores)
  // Q4_0 with an error-minimising scale per block (QuantizeRowQ4_0Optimal); false: ggml's reference rounding,
  // bit-identical to llama.cpp's quantizer and ~20x faster.
  bool q4_0_scale_search = true;
};
// Writes `model` as a llama.cpp-compatible GGUF v3 file (temporary name, renamed when complete).
Status WriteModelGguf(const SourceModel& model, const WriteOptions& options);

// What WriteModelGguf wrote (for the convert command's summary line).
struct WriteSummary {
  size_t n_tensors = 0;
  uint64_t file_bytes = 0;
  std::map<GgmlType, size_t> tensors_by_type;
  std::map<GgmlType, uint64_t> bytes_by_type;
  // 2-D tensors written as F16 because their row length is not a multiple of the quantization block (32).
  size_t f16_fallbacks = 0;
  // Tensors whose bytes were copied unchanged from the source (same type, GGUF or fp32 source).
  size_t raw_copies = 0;
  double seconds = 0;
};
// As above, and fills `summary` (may be nullptr) when the file was written.
Status WriteModelGguf(const SourceModel& model, const WriteOptions& options, WriteSummary* summary);
// The type WriteModelGguf gives a tensor: 1-D tensors and MoE router weights F32; the output head (output.weight, or
// token_embd.weight when the embeddings are tied) Q8_0 when Q4_0 is requested (llama.cpp keeps the head at 6+ bits:
// Q6_K, which nflash does not implement; Q8_0 is the nearest); others `requested`, except F16 when `requested` is a
// block type whose block size does not divide the row length (dims[0]).
GgmlType OutputTensorType(const SourceTensor& tensor, GgmlType requested, bool tied_embeddings);

}  // namespace nflash::converter
