// Tokenizers (SentencePiece-style BPE "llama" and byte-level BPE "gpt2") and streaming detokenization to UTF-8.
//
// Encoding follows llama.cpp so that ids match its published test vectors:
//   "llama" (SPM): optional leading space, spaces -> U+2581, split into UTF-8 characters, repeatedly merge the adjacent
//     pair whose concatenation is a vocabulary piece with the highest score (ties: leftmost); characters that are not
//     pieces become <0xXX> byte tokens (or <unk> when the vocabulary has no byte tokens).
//   "gpt2" (byte-level BPE): pre-tokenizer split (GPT-2 or Llama-3 pattern by tokenizer.ggml.pre), bytes mapped to
//     printable code points (GPT-2 byte_to_unicode), then merges applied by rank (lowest first, ties: leftmost).
//     The pre-tokenizer's \p{L}/\p{N} classes are approximated by tables (see ClassifyCodePoint in
//     tokenizer_internal.h): exact for ASCII/Latin-1, close for other scripts.
// Control tokens (<s>, </s>) are matched in the input only when asked (parse_special); user-defined tokens always
// are (llama.cpp does the same).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "runtime/core/gguf.h"
#include "runtime/core/status.h"

namespace nflash {

// llama.cpp's token types (the values stored in tokenizer.ggml.token_type).
enum class TokenType : int32_t {
  kUndefined = 0,
  kNormal = 1,
  kUnknown = 2,
  kControl = 3,
  kUserDefined = 4,
  kUnused = 5,
  kByte = 6,
};

// Everything a tokenizer is built from; what a GGUF file's tokenizer.ggml.* keys (or a llama2.c tokenizer.bin) hold.
struct VocabData {
  std::string model;                  // "llama" or "gpt2"
  std::string pre;                    // gpt2 pre-tokenizer: "gpt2"/"default"/"" or "llama-bpe"/"llama3"
  std::vector<std::string> tokens;    // pieces: U+2581 for spaces (llama), byte_to_unicode form (gpt2)
  std::vector<float> scores;          // llama: merge priority, higher first; may be empty for gpt2
  std::vector<TokenType> types;       // empty: every token kNormal
  std::vector<std::string> merges;    // gpt2: "left right", rank = index
  int32_t bos_id = -1, eos_id = -1, unk_id = -1;  // -1: none
  // End of a turn and end of a message (tokenizer.ggml.eot_token_id / eom_token_id, llama.cpp's keys); -1: none.
  int32_t eot_id = -1, eom_id = -1;
  bool add_bos = true;                // what Encode callers should default to
  bool add_space_prefix = true;       // llama: prepend a space to the text (and strip it again when decoding)
  std::string chat_template;          // tokenizer.chat_template: the model's Jinja chat template; "" when none
  std::string source;                 // file name for error messages
};

class Tokenizer;

// Turns a stream of raw bytes into valid UTF-8, emitting only complete characters: an incomplete sequence is held back
// until the bytes that complete it arrive; invalid bytes become U+FFFD (one per maximal invalid subpart, as the
// WHATWG/Unicode "substitution of maximal subparts" practice); Finish() flushes a never-completed tail as U+FFFD.
// Thread-safety: not thread-safe (a value type; one per stream).
class Utf8Stream {
 public:
  // Appends `bytes`, returns the text that is now complete.
  std::string Push(std::string_view bytes);
  // Returns U+FFFD if an incomplete sequence is pending (and clears it), else "".
  std::string Finish();
  bool has_pending() const { return needed_ > 0; }

 private:
  std::string pending_;      // bytes of the current incomplete character
  int needed_ = 0;           // continuation bytes still expected
  uint8_t lower_ = 0x80, upper_ = 0xBF;  // allowed range of the next continuation byte
};

// Streaming detokenizer: Push(id) returns the complete UTF-8 text the token finishes (possibly "" while a multi-byte
// character is being assembled from byte tokens). Control tokens produce no text unless `render_special`.
// For a "llama" tokenizer with add_space_prefix, the single space that Encode prepended is removed from the first
// text-producing token, so Decode(Encode(s)) == s; pass `sequence_start` = false to a detokenizer that starts in the
// middle of a sequence (e.g. streaming only the continuation of a prompt) so that nothing is stripped.
// Thread-safety: not thread-safe; one per stream. The tokenizer must outlive it.
class Detokenizer {
 public:
  explicit Detokenizer(const Tokenizer& tokenizer, bool render_special = false, bool sequence_start = true);
  std::string Push(int32_t id);
  // Ends the stream: U+FFFD for an incomplete trailing character, else "".
  std::string Finish();

 private:
  const Tokenizer& tokenizer_;
  bool render_special_;
  bool at_start_ = true;  // no text-producing token seen yet
  Utf8Stream utf8_;
};

// A loaded vocabulary and its encoder. Thread-safety: immutable after construction; all const methods may be called
// concurrently.
class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  Tokenizer(const Tokenizer&) = delete;  // piece_to_id_ holds views into vocab_
  Tokenizer& operator=(const Tokenizer&) = delete;

  // Token ids of `text` (any bytes; invalid UTF-8 is kept byte for byte through byte tokens), BOS first when
  // `add_bos` and the vocabulary has one. `parse_special`: control-token texts in `text` (e.g. "<s>") become those
  // tokens instead of being spelled out.
  std::vector<int32_t> Encode(std::string_view text, bool add_bos, bool parse_special = false) const;
  // The raw bytes a token contributes to the output (possibly an incomplete UTF-8 sequence, e.g. one byte token);
  // "" for control and unused tokens and ids out of range; U+FFFD for the unknown token (its text is lost).
  std::string DecodeToken(int32_t id) const;
  // Whole-sequence decoding with the rules of Detokenizer (complete UTF-8; U+FFFD for an unfinished tail).
  std::string Decode(std::span<const int32_t> ids, bool render_special = false) const;

  const std::string& model() const { return vocab_.model; }
  int64_t n_vocab() const { return static_cast<int64_t>(vocab_.tokens.size()); }
  int32_t bos_id() const { return vocab_.bos_id; }
  int32_t eos_id() const { return vocab_.eos_id; }
  int32_t unk_id() const { return vocab_.unk_id; }
  // Tokens that end generation as EOS does: EOS, the eot/eom ids, and the control or user-defined tokens spelled as
  // an instruct model's end-of-turn marker (Phi-3's "<|end|>", Llama 3's "<|eot_id|>", ChatML's "<|im_end|>", ...,
  // the texts llama.cpp also recognises), so a chat turn ends where the model says it does. Sorted, unique.
  const std::vector<int32_t>& end_of_generation_ids() const { return end_of_generation_; }
  bool IsEndOfGeneration(int32_t id) const;
  bool add_bos() const { return vocab_.add_bos; }
  bool add_space_prefix() const { return vocab_.add_space_prefix; }
  // The model's Jinja chat template (GGUF tokenizer.chat_template); "" when it has none (runtime/text/chat_template.h
  // recognises its format).
  const std::string& chat_template() const { return vocab_.chat_template; }
  // The stored piece (U+2581 / byte_to_unicode spelling); "" for ids out of range.
  const std::string& TokenText(int32_t id) const;
  TokenType token_type(int32_t id) const;
  float score(int32_t id) const;
  // The id of a piece, or -1.
  int32_t FindToken(std::string_view piece) const;
  const VocabData& vocab() const { return vocab_; }
  // The heap this tokenizer holds, itself included, in glibc's chunks (runtime/core/heap_bytes.h): what a runtime
  // holding it counts in its memory budget (18 MB for a 151936-token vocabulary with its merges).
  uint64_t HeapBytes() const;

  // Checks what every model needs: tokens present, scores/token_type lengths equal to the token count, token types
  // in 0..6 and byte tokens spelled "<0xXX>", special ids in range. Errors name the tokenizer.ggml.* key.
  static Status ValidateVocab(const VocabData& vocab);

 protected:
  explicit Tokenizer(VocabData vocab);
  // Encodes a fragment of plain text (no special tokens inside). `after_special`: the fragment starts the text or
  // follows a special token (SPM adds its space prefix only there).
  virtual void EncodeFragment(std::string_view text, bool after_special, std::vector<int32_t>* out) const = 0;
  // The bytes of a normal/user-defined token's piece (SPM: U+2581 -> ' '; BPE: byte_to_unicode inverted).
  virtual std::string PieceBytes(int32_t id) const = 0;
  // Byte token id -> its byte value (0..255) or -1.
  int ByteValue(int32_t id) const;
  // HeapBytes' share of the derived class: its object and what its own members hold.
  virtual uint64_t DerivedHeapBytes() const = 0;

  VocabData vocab_;
  std::unordered_map<std::string_view, int32_t> piece_to_id_;  // views into vocab_.tokens (first id wins)
  std::vector<int32_t> end_of_generation_;
  // Per first byte: control and user-defined tokens with non-empty text starting with it, longest text first.
  std::vector<std::vector<int32_t>> special_by_byte_;
  std::vector<int16_t> byte_value_;   // per id: byte of a <0xXX> byte token, else -1
};

// Builds a tokenizer from vocabulary data; model "llama" -> SPM, "gpt2" -> byte-level BPE, else Unsupported.
Result<std::unique_ptr<Tokenizer>> MakeTokenizer(VocabData vocab);
// Reads tokenizer.ggml.* from a GGUF file (tokens, scores, token_type, merges, special ids, add_bos_token,
// add_space_prefix, pre) and builds the tokenizer. Errors name the file and the key.
Result<std::unique_ptr<Tokenizer>> LoadTokenizer(const GgufFile& gguf);
// Reads the vocabulary of a GGUF file without building a tokenizer.
Result<VocabData> ReadGgufVocab(const GgufFile& gguf);
// llama2.c's tokenizer.bin is read by the converter (converter::ReadLlama2cTokenizer) into the GGUF vocabulary
// that LoadTokenizer reads.

}  // namespace nflash
