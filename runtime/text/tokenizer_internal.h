// Private to runtime/text: the tokenizer implementations' factories and the helpers tests exercise directly
// (UTF-8 splitting, GPT-2 byte_to_unicode, the pre-tokenizer splitters and their Unicode classes).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/core/status.h"
#include "runtime/text/tokenizer.h"

namespace nflash::text_internal {

// U+2581 LOWER ONE EIGHTH BLOCK: SentencePiece's visible stand-in for a space.
inline constexpr std::string_view kSpmSpace = "\xE2\x96\x81";
// U+FFFD REPLACEMENT CHARACTER, for bytes that are not (or never become) valid UTF-8.
inline constexpr std::string_view kReplacement = "\xEF\xBF\xBD";

// Byte length of the UTF-8 sequence a lead byte announces, by its high nibble (llama.cpp's rule, so that invalid
// input splits as in the reference): 0x0-0xB -> 1, 0xC-0xD -> 2, 0xE -> 3, 0xF -> 4.
int Utf8LengthFromLead(uint8_t lead);
// Appends the UTF-8 encoding of `cp` (<= 0x10FFFF) to `out`.
void AppendUtf8(uint32_t cp, std::string* out);

Result<std::unique_ptr<Tokenizer>> MakeSpmTokenizer(VocabData vocab);
Result<std::unique_ptr<Tokenizer>> MakeBpeTokenizer(VocabData vocab);

// GPT-2's byte_to_unicode: printable bytes ('!'..'~', 0xA1..0xAC, 0xAE..0xFF) map to themselves, the other 68 to
// U+0100 + n in byte order. Returns the UTF-8 of the code point for `byte`.
const std::string& ByteToUnicode(uint8_t byte);
// The inverse: the byte a code point stands for, or -1.
int UnicodeToByte(uint32_t cp);

// Coarse Unicode classes the pre-tokenizer patterns need (\p{L}, \p{N}, \s, and everything else).
enum class CharClass : uint8_t { kNone = 0, kLetter, kNumber, kWhitespace, kOther };
// Approximation (no Unicode database here): ASCII and Latin-1 exactly; whitespace as \s; a table of number ranges
// (the decimal digits of the major scripts, super/subscripts, number forms, circled and fullwidth digits); a table of
// punctuation, symbol, mark and format ranges (general punctuation, currency, arrows, math, box drawing, dingbats,
// CJK punctuation, fullwidth punctuation, emoji planes, combining marks, private use); any other code point from
// U+00C0 up counts as a letter. Known difference from full Unicode: spacing/non-spacing marks inside Indic and
// South-East Asian words (e.g. U+093F) count as letters, so such words are not split at their marks.
CharClass ClassifyCodePoint(uint32_t cp);

enum class PreTokenizer : uint8_t { kGpt2, kLlama3, kQwen2 };
// Splits `text` into pre-tokenizer words (views into `text`, covering it exactly, in order):
//   kGpt2:   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//   kLlama3: (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|
//            \s+(?!\S)|\s+
//   kQwen2:  kLlama3's with \p{N} for \p{N}{1,3} (every digit a word of its own)
// Invalid UTF-8 bytes are single code points of class kOther.
std::vector<std::string_view> PreTokenize(std::string_view text, PreTokenizer kind);

}  // namespace nflash::text_internal
