// llama2.c checkpoint and tokenizer formats: header parsing, the tensor layout shared by the reader and `inspect`,
// and the tokenizer.bin parser. ReadLlama2c (readers.h) builds a SourceModel from these.
//
// Checkpoint layouts (little-endian, fp32 arrays, row-major with the output dimension outermost):
//   v0 (legacy export): header = 7 x int32 {dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len};
//      vocab_size < 0 means "separate classifier". Then: tok_embeddings[vocab][dim], rms_att[L][dim], wq[L][dim][dim],
//      wk[L][kv_dim][dim], wv[L][kv_dim][dim], wo[L][dim][dim], rms_ffn[L][dim], w1[L][hidden][dim],
//      w2[L][dim][hidden], w3[L][hidden][dim], rms_final[dim], freq_cis_real[seq_len][head_size/2],
//      freq_cis_imag[seq_len][head_size/2], then wcls[vocab][dim] only when not shared.
//   v1 ("ak42" export): u32 magic 0x616b3432, int32 version = 1, the same 7 int32 (vocab_size positive),
//      u8 shared_classifier, zero padding to 256 bytes. Then: rms_att[L][dim], rms_ffn[L][dim], rms_final[dim],
//      tok_embeddings, wq, wk, wv, wo, w1, w2, w3 (all layers each), then wcls only when not shared.
//   v2 (int8 Q8_0 export) is recognised and rejected as Unsupported.
// tokenizer.bin: int32 max_token_length, then per token: f32 score, int32 byte length, the bytes (no terminator).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "converter/model_ir.h"
#include "runtime/core/file.h"
#include "runtime/core/status.h"

namespace nflash::converter {

// "ak42" read as a little-endian u32 (llama2.c export.py version1_export).
inline constexpr uint32_t kLlama2cMagic = 0x616b3432;
// v0 header: 7 int32 parameters.
inline constexpr uint64_t kLlama2cV0HeaderBytes = 7 * 4;
// v1 header: export.py pads magic + version + params + flag to 256 bytes (a cache-friendly start for the weights).
inline constexpr uint64_t kLlama2cV1HeaderBytes = 256;

struct Llama2cHeader {
  int version = 0;  // 0 (legacy) or 1
  int64_t dim = 0, hidden_dim = 0, n_layers = 0, n_heads = 0, n_kv_heads = 0;
  int64_t vocab_size = 0;  // always positive here (the v0 sign is turned into shared_classifier)
  int64_t seq_len = 0;
  bool shared_classifier = true;
  uint64_t header_bytes = 0;
  uint64_t expected_file_bytes = 0;  // what the header implies
  uint64_t file_bytes = 0;           // what the file has
  int64_t head_size() const { return dim / n_heads; }
  int64_t kv_dim() const { return dim * n_kv_heads / n_heads; }
};

// One fp32 array of the checkpoint, named and shaped in GGUF's convention (dims[0] = row length). Arrays llama2.c
// stores but nflash does not use (freq_cis) have an empty gguf name.
struct Llama2cTensor {
  std::string name;             // e.g. "blk.0.attn_q.weight"; empty for skipped arrays
  std::string source_name;      // llama2.c's name, e.g. "wq[0]"
  std::vector<uint64_t> dims;   // GGUF order
  uint64_t offset = 0;          // absolute byte offset in the checkpoint
  uint64_t n_elements = 0;
};

// Parses and validates the header (dims positive and consistent, no size overflow). Does not compare the file size
// with expected_file_bytes: the caller decides (ReadLlama2c requires equality; inspect reports it).
Result<Llama2cHeader> ReadLlama2cHeader(const ReadableFile& file);
// Every array in file order, with offsets. The header must come from ReadLlama2cHeader.
std::vector<Llama2cTensor> Llama2cLayout(const Llama2cHeader& header);

// Parses a llama2.c tokenizer.bin into GGUF "llama" tokenizer data (spaces as U+2581, llama.cpp token types, bos 1,
// eos 2, unk 0, add_bos). `n_vocab` > 0: exactly that many tokens are required (more or fewer is an error); 0: read
// tokens until the end of the file.
Result<TokenizerData> ReadLlama2cTokenizer(const std::string& path, int64_t n_vocab);

}  // namespace nflash::converter
