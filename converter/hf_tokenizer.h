// Hugging Face tokenizers to GGUF tokenizer data: SentencePiece tokenizer.model (protobuf) and tokenizer.json (BPE).
//
// tokenizer.model is a SentencePiece ModelProto, decoded here straight from the protobuf wire format:
//   ModelProto    field 1 (repeated, length-delimited): SentencePiece; fields 2..5 (trainer_spec, normalizer_spec,
//                 self_test_data, denormalizer_spec) are skipped by wire type.
//   SentencePiece field 1 piece (string), field 2 score (float, wire type 5), field 3 type (varint enum:
//                 1 normal (default), 2 unknown, 3 control, 4 user defined, 5 unused, 6 byte).
//   -> TokenizerData model "llama", one token per piece with its score and type (llama.cpp's token types use the same
//      numbers); unk = the UNKNOWN piece, bos = "<s>", eos = "</s>", pad = "<pad>" when present.
//
// tokenizer.json (the HF "fast" tokenizer) with model.type "BPE":
//   * byte_fallback true (Llama-2/Mistral SentencePiece BPE exported by HF) -> model "llama": tokens are model.vocab
//     ordered by id plus added_tokens; "<0xXX>" tokens are BYTE, special added tokens CONTROL, other added tokens
//     USER_DEFINED, model.unk_token UNKNOWN. Scores: llama.cpp (gguf-py LlamaHfVocab) writes a -1000 placeholder for
//     every token, which loses the merge priority that llama.cpp's SPM tokenizer needs (it merges the pair whose
//     result has the highest score). We write score = -(rank of the merge that produces the token), so "highest
//     score first" is exactly the BPE merge order; tokens no merge produces get -(number of merges) - 1, and
//     byte/control/unknown tokens 0 as in SentencePiece files.
//   * pre_tokenizer ByteLevel (alone or inside a Sequence; GPT-2, Llama-3, Qwen) -> model "gpt2": tokens by id,
//     merges as "a b" strings (read from either "a b" strings or [a, b] pairs), special added tokens CONTROL, other
//     added tokens USER_DEFINED, no scores; tokenizer.ggml.pre from the split regex when it is a known one.
//   Other model types (Unigram, WordPiece, WordLevel) are Unsupported.
//
// bos/eos/add_bos/add_eos are then refined from tokenizer_config.json ("bos_token"/"eos_token" as a string or
// {"content": ...}, "add_bos_token", "add_eos_token") and config.json ("bos_token_id", "eos_token_id") when present.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "converter/model_ir.h"
#include "runtime/core/status.h"

namespace nflash::converter {

// Decodes a SentencePiece ModelProto. `path` is used in messages only.
Result<TokenizerData> ParseSentencePieceModel(std::span<const uint8_t> bytes, const std::string& path);
// Parses a tokenizer.json document. `path` is used in messages only.
Result<TokenizerData> ParseTokenizerJson(std::string_view text, const std::string& path);

// Applies tokenizer_config.json text (may be empty) and config.json text (may be empty) to `tok`: bos/eos ids by
// token text or id, add_bos/add_eos flags, and SentencePiece added tokens (added_tokens_decoder) types.
Status ApplyTokenizerConfig(std::string_view tokenizer_config_text, std::string_view config_text,
                            const std::string& dir, TokenizerData* tok);

// Reads the tokenizer of a HF model directory: tokenizer.model when present (preferred, as llama.cpp does), else
// tokenizer.json; then tokenizer_config.json / added_tokens.json / config.json refinements. NotFound naming both file
// names when neither exists.
Result<TokenizerData> ReadHfTokenizer(const std::string& dir);

}  // namespace nflash::converter
