// Byte-level BPE pre-tokenizers (GPT-2 and Llama-3 split patterns) written by hand over coarse Unicode classes,
// since std::regex has no \p{L}/\p{N}.
#include <algorithm>
#include <cstdint>
#include <iterator>
#include <string_view>
#include <vector>

#include "runtime/text/tokenizer_internal.h"

namespace nflash::text_internal {
namespace {

struct Range {
  uint32_t lo, hi;
  CharClass cls;
};

constexpr CharClass L = CharClass::kLetter, N = CharClass::kNumber, O = CharClass::kOther, W = CharClass::kWhitespace;

// Code points from U+0080 up that are not letters, sorted and disjoint; everything from U+00C0 up that is not listed
// counts as a letter (see ClassifyCodePoint). Below U+00C0 unlisted code points are "other".
constexpr Range kRanges[] = {
    {0x0085, 0x0085, W}, {0x00A0, 0x00A0, W}, {0x00AA, 0x00AA, L}, {0x00B2, 0x00B3, N}, {0x00B5, 0x00B5, L},
    {0x00B9, 0x00B9, N}, {0x00BA, 0x00BA, L}, {0x00BC, 0x00BE, N}, {0x00D7, 0x00D7, O}, {0x00F7, 0x00F7, O},
    {0x02C2, 0x02C5, O}, {0x02D2, 0x02DF, O}, {0x02E5, 0x02EB, O}, {0x02ED, 0x02ED, O}, {0x02EF, 0x036F, O},
    {0x0375, 0x0375, O}, {0x037E, 0x037E, O}, {0x0384, 0x0385, O}, {0x0387, 0x0387, O}, {0x03F6, 0x03F6, O},
    {0x0482, 0x0489, O}, {0x055A, 0x055F, O}, {0x0589, 0x058A, O}, {0x058D, 0x058F, O}, {0x0591, 0x05C7, O},
    {0x05F3, 0x05F4, O}, {0x0600, 0x061F, O}, {0x064B, 0x065F, O}, {0x0660, 0x0669, N}, {0x066A, 0x066D, O},
    {0x0670, 0x0670, O}, {0x06D4, 0x06D4, O}, {0x06D6, 0x06ED, O}, {0x06F0, 0x06F9, N}, {0x07C0, 0x07C9, N},
    {0x0964, 0x0965, O}, {0x0966, 0x096F, N}, {0x09E6, 0x09EF, N}, {0x0A66, 0x0A6F, N}, {0x0AE6, 0x0AEF, N},
    {0x0B66, 0x0B6F, N}, {0x0BE6, 0x0BF2, N}, {0x0C66, 0x0C6F, N}, {0x0CE6, 0x0CEF, N}, {0x0D66, 0x0D78, N},
    {0x0E3F, 0x0E3F, O}, {0x0E4F, 0x0E4F, O}, {0x0E50, 0x0E59, N}, {0x0E5A, 0x0E5B, O}, {0x0ED0, 0x0ED9, N},
    {0x0F20, 0x0F33, N}, {0x1040, 0x1049, N}, {0x10FB, 0x10FB, O}, {0x1360, 0x1368, O}, {0x1369, 0x137C, N},
    {0x1680, 0x1680, W}, {0x16EE, 0x16F0, N}, {0x17D4, 0x17DA, O}, {0x17E0, 0x17E9, N}, {0x1800, 0x180F, O},
    {0x1810, 0x1819, N}, {0x1AB0, 0x1AFF, O}, {0x1DC0, 0x1DFF, O}, {0x2000, 0x200A, W}, {0x200B, 0x2027, O},
    {0x2028, 0x2029, W}, {0x202A, 0x202E, O}, {0x202F, 0x202F, W}, {0x2030, 0x205E, O}, {0x205F, 0x205F, W},
    {0x2060, 0x206F, O}, {0x2070, 0x2070, N}, {0x2074, 0x2079, N}, {0x207A, 0x207E, O}, {0x2080, 0x2089, N},
    {0x208A, 0x208E, O}, {0x20A0, 0x20FF, O}, {0x2100, 0x2101, O}, {0x2103, 0x2106, O}, {0x2108, 0x2109, O},
    {0x2114, 0x2114, O}, {0x2116, 0x2118, O}, {0x211E, 0x2123, O}, {0x2125, 0x2125, O}, {0x2127, 0x2127, O},
    {0x2129, 0x2129, O}, {0x212E, 0x212E, O}, {0x213A, 0x213B, O}, {0x2140, 0x2144, O}, {0x214A, 0x214D, O},
    {0x214F, 0x214F, O}, {0x2150, 0x2182, N}, {0x2185, 0x2189, N}, {0x218A, 0x245F, O}, {0x2460, 0x249B, N},
    {0x249C, 0x24E9, O}, {0x24EA, 0x24FF, N}, {0x2500, 0x2775, O}, {0x2776, 0x2793, N}, {0x2794, 0x2BFF, O},
    {0x2CE5, 0x2CEA, O}, {0x2CEF, 0x2CF1, O}, {0x2CF9, 0x2CFF, O}, {0x2DE0, 0x2E2E, O}, {0x2E30, 0x2E7F, O},
    {0x2E80, 0x2FFF, O}, {0x3000, 0x3000, W}, {0x3001, 0x3004, O}, {0x3007, 0x3007, N}, {0x3008, 0x3020, O},
    {0x3021, 0x3029, N}, {0x302A, 0x3030, O}, {0x3036, 0x3037, O}, {0x3038, 0x303A, N}, {0x303D, 0x303F, O},
    {0x3099, 0x309C, O}, {0x30A0, 0x30A0, O}, {0x30FB, 0x30FB, O}, {0x3190, 0x3191, O}, {0x3192, 0x3195, N},
    {0x3196, 0x319F, O}, {0x31C0, 0x31E3, O}, {0x3200, 0x321E, O}, {0x3220, 0x3229, N}, {0x322A, 0x3247, O},
    {0x3248, 0x324F, N}, {0x3250, 0x3250, O}, {0x3251, 0x325F, N}, {0x3260, 0x327F, O}, {0x3280, 0x3289, N},
    {0x328A, 0x32B0, O}, {0x32B1, 0x32BF, N}, {0x32C0, 0x33FF, O}, {0x4DC0, 0x4DFF, O}, {0xA490, 0xA4C6, O},
    {0xA620, 0xA629, N}, {0xA670, 0xA67E, O}, {0xA8D0, 0xA8D9, N}, {0xA900, 0xA909, N}, {0xD800, 0xF8FF, O},
    {0xFB29, 0xFB29, O}, {0xFD3E, 0xFD3F, O}, {0xFDFC, 0xFDFF, O}, {0xFE00, 0xFE6F, O}, {0xFEFF, 0xFEFF, O},
    {0xFF01, 0xFF0F, O}, {0xFF10, 0xFF19, N}, {0xFF1A, 0xFF20, O}, {0xFF3B, 0xFF40, O}, {0xFF5B, 0xFF65, O},
    {0xFFE0, 0xFFFF, O}, {0x10100, 0x1013F, O}, {0x104A0, 0x104A9, N}, {0x1D000, 0x1D24F, O},
    {0x1D300, 0x1D37F, O}, {0x1D7CE, 0x1D7FF, N}, {0x1F000, 0x1F0FF, O}, {0x1F100, 0x1F10C, N},
    {0x1F10D, 0x1FBFF, O}, {0xE0000, 0xE01EF, O}, {0xF0000, 0x10FFFF, O},
};

}  // namespace

CharClass ClassifyCodePoint(uint32_t cp) {
  if (cp < 0x80) {
    if ((cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z')) return CharClass::kLetter;
    if (cp >= '0' && cp <= '9') return CharClass::kNumber;
    if (cp == ' ' || (cp >= 0x09 && cp <= 0x0D)) return CharClass::kWhitespace;
    return CharClass::kOther;
  }
  if (cp > 0x10FFFF) return CharClass::kOther;
  const auto it = std::upper_bound(std::begin(kRanges), std::end(kRanges), cp,
                                   [](uint32_t c, const Range& r) { return c < r.lo; });
  if (it != std::begin(kRanges)) {
    const Range& r = *std::prev(it);
    if (cp <= r.hi) return r.cls;
  }
  return cp >= 0xC0 ? CharClass::kLetter : CharClass::kOther;
}

namespace {

constexpr uint32_t kOutOfRange = 0xFFFFFFFF;  // the code point "after the end" (never equal to a real one)

// The text as code points with their byte offsets; invalid UTF-8 bytes are single "other" code points (U+FFFD).
struct CodePoints {
  std::vector<uint32_t> cp;
  std::vector<size_t> offset;  // cp.size() + 1 entries; the last is text.size()
  std::vector<CharClass> cls;

  explicit CodePoints(std::string_view text) {
    for (size_t i = 0; i < text.size();) {
      const uint8_t b = static_cast<uint8_t>(text[i]);
      uint32_t c = 0xFFFD;
      size_t len = 1;
      if (b < 0x80) {
        c = b;
      } else {
        const int n = b >= 0xF0 && b <= 0xF4 ? 4 : b >= 0xE0 ? (b <= 0xEF ? 3 : 0) : b >= 0xC2 ? 2 : 0;
        if (n > 0 && i + n <= text.size()) {
          uint32_t v = b & (0x7F >> n);
          bool ok = true;
          for (int k = 1; k < n && ok; ++k) {
            const uint8_t cb = static_cast<uint8_t>(text[i + k]);
            ok = (cb & 0xC0) == 0x80;
            v = (v << 6) | (cb & 0x3F);
          }
          const uint32_t min = n == 2 ? 0x80 : n == 3 ? 0x800 : 0x10000;
          if (ok && v >= min && v <= 0x10FFFF && !(v >= 0xD800 && v <= 0xDFFF)) {
            c = v;
            len = static_cast<size_t>(n);
          }
        }
      }
      cp.push_back(c);
      offset.push_back(i);
      cls.push_back(ClassifyCodePoint(c));
      i += len;
    }
    offset.push_back(text.size());
  }
  size_t size() const { return cp.size(); }
  uint32_t At(size_t i) const { return i < cp.size() ? cp[i] : kOutOfRange; }
  CharClass ClassAt(size_t i) const { return i < cls.size() ? cls[i] : CharClass::kNone; }
};

bool IsLetter(CharClass c) { return c == CharClass::kLetter; }
bool IsNumber(CharClass c) { return c == CharClass::kNumber; }
bool IsSpace(CharClass c) { return c == CharClass::kWhitespace; }
// [^\s\p{L}\p{N}] for a code point that exists.
bool IsOther(CharClass c) { return c == CharClass::kOther; }
uint32_t AsciiLower(uint32_t c) { return c >= 'A' && c <= 'Z' ? c + 32 : c; }

// Length (in code points) of a contraction ('s 't 're 've 'm 'll 'd) at `pos`, or 0. `fold`: case-insensitive.
size_t ContractionAt(const CodePoints& t, size_t pos, bool fold) {
  if (t.At(pos) != '\'') return 0;
  auto low = [&](size_t i) { return fold ? AsciiLower(t.At(i)) : t.At(i); };
  const uint32_t c1 = low(pos + 1);
  if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') return 2;
  const uint32_t c2 = low(pos + 2);
  if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) return 3;
  return 0;
}

// Returns the end (in code points) of the word starting at `pos` under the GPT-2 pattern.
size_t Gpt2WordEnd(const CodePoints& t, size_t pos) {
  if (size_t n = ContractionAt(t, pos, false)) return pos + n;
  const uint32_t c = t.At(pos);
  // " ?X+" alternatives: classify by the character after an optional leading space.
  const CharClass c2 = c == ' ' ? t.ClassAt(pos + 1) : t.ClassAt(pos);
  const size_t body = pos + (c == ' ' && c2 != CharClass::kNone ? 1 : 0);
  if (IsLetter(c2) || IsNumber(c2) || IsOther(c2)) {
    size_t e = body;
    while (t.ClassAt(e) == c2) ++e;
    return e;
  }
  // Whitespace: "\s+(?!\S)" leaves the last space to start the next word when a non-space follows.
  size_t e = pos;
  while (IsSpace(t.ClassAt(e))) ++e;
  const size_t n = e - pos;
  if (n > 1 && e < t.size()) return e - 1;
  return n > 0 ? e : pos + 1;
}

// Returns the end of the word starting at `pos` under the Llama-3 pattern, whose digit runs are cut every
// `max_digits` (3; Qwen2's pattern: 1).
size_t Llama3WordEnd(const CodePoints& t, size_t pos, size_t max_digits) {
  if (size_t n = ContractionAt(t, pos, true)) return pos + n;
  const uint32_t c = t.At(pos);
  const CharClass cls = t.ClassAt(pos);
  // [^\r\n\p{L}\p{N}]?\p{L}+
  if (!(c == '\r' || c == '\n' || IsNumber(cls)) && (IsLetter(cls) || IsLetter(t.ClassAt(pos + 1)))) {
    size_t e = pos + 1;
    while (IsLetter(t.ClassAt(e))) ++e;
    return e;
  }
  // \p{N}{1,3} (Qwen2: \p{N})
  if (IsNumber(cls)) {
    size_t e = pos;
    while (e < pos + max_digits && IsNumber(t.ClassAt(e))) ++e;
    return e;
  }
  // " ?[^\s\p{L}\p{N}]+[\r\n]*"
  const CharClass c2 = c == ' ' ? t.ClassAt(pos + 1) : cls;
  if (IsOther(c2)) {
    size_t e = pos + (c == ' ' ? 1 : 0);
    while (IsOther(t.ClassAt(e))) ++e;
    while (t.At(e) == '\r' || t.At(e) == '\n') ++e;
    return e;
  }
  // \s*[\r\n]+ (up to the last line break in the whitespace run), then \s+(?!\S), then \s+.
  size_t e = pos;
  size_t after_last_break = 0;
  while (IsSpace(t.ClassAt(e))) {
    if (t.At(e) == '\r' || t.At(e) == '\n') after_last_break = e + 1;
    ++e;
  }
  if (after_last_break > 0) return after_last_break;
  const size_t n = e - pos;
  if (n > 1 && e < t.size()) return e - 1;
  return n > 0 ? e : pos + 1;
}

}  // namespace

std::vector<std::string_view> PreTokenize(std::string_view text, PreTokenizer kind) {
  const CodePoints t(text);
  std::vector<std::string_view> words;
  for (size_t pos = 0; pos < t.size();) {
    const size_t end = kind == PreTokenizer::kGpt2 ? Gpt2WordEnd(t, pos)
                                                   : Llama3WordEnd(t, pos, kind == PreTokenizer::kQwen2 ? 1 : 3);
    words.push_back(text.substr(t.offset[pos], t.offset[end] - t.offset[pos]));
    pos = end;
  }
  return words;
}

}  // namespace nflash::text_internal
