// Byte-level BPE ("gpt2"): GPT-2 byte_to_unicode, pre-tokenizer split, rank-ordered merges with a priority queue.
#include <array>
#include <cstdint>
#include <queue>
#include <string>
#include <unordered_map>
#include <vector>

#include "runtime/core/heap_bytes.h"
#include "runtime/text/tokenizer.h"
#include "runtime/text/tokenizer_internal.h"

namespace nflash::text_internal {
namespace {

// GPT-2's printable bytes map to themselves: '!'..'~', U+00A1..U+00AC, U+00AE..U+00FF.
bool IsPrintableByte(int b) { return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF); }

struct ByteTables {
  std::array<std::string, 256> to_unicode;
  std::array<int16_t, 0x200> from_unicode;  // code points used are below U+0144
  ByteTables() {
    from_unicode.fill(-1);
    uint32_t next = 0x100;  // non-printable bytes take U+0100, U+0101, ... in byte order
    for (int b = 0; b < 256; ++b) {
      const uint32_t cp = IsPrintableByte(b) ? static_cast<uint32_t>(b) : next++;
      AppendUtf8(cp, &to_unicode[b]);
      from_unicode[cp] = static_cast<int16_t>(b);
    }
  }
};

const ByteTables& Tables() {
  static const ByteTables kTables;
  return kTables;
}

}  // namespace

const std::string& ByteToUnicode(uint8_t byte) { return Tables().to_unicode[byte]; }

int UnicodeToByte(uint32_t cp) { return cp < Tables().from_unicode.size() ? Tables().from_unicode[cp] : -1; }

namespace {

struct Symbol {
  size_t offset = 0;
  size_t len = 0;
  int prev = -1;
  int next = -1;
};

struct Bigram {
  int left = 0;
  int right = 0;
  int32_t rank = 0;
  size_t len = 0;
};

// Lowest rank first; equal ranks (the same merge twice): the leftmost first.
struct BigramAfter {
  bool operator()(const Bigram& a, const Bigram& b) const {
    return a.rank > b.rank || (a.rank == b.rank && a.left > b.left);
  }
};

// Thread-safety: immutable after construction (see Tokenizer).
class BpeTokenizer final : public Tokenizer {
 public:
  BpeTokenizer(VocabData vocab, std::unordered_map<std::string, int32_t> merge_rank)
      : Tokenizer(std::move(vocab)), merge_rank_(std::move(merge_rank)) {
    const std::string& pre = vocab_.pre;
    pre_kind_ = pre == "llama-bpe" || pre == "llama3" ? PreTokenizer::kLlama3
                : pre == "qwen2"                        ? PreTokenizer::kQwen2
                                                        : PreTokenizer::kGpt2;
    for (int b = 0; b < 256; ++b) byte_token_[b] = FindToken(ByteToUnicode(static_cast<uint8_t>(b)));
  }

 protected:
  void EncodeFragment(std::string_view text, bool after_special, std::vector<int32_t>* out) const override;
  std::string PieceBytes(int32_t id) const override;
  uint64_t DerivedHeapBytes() const override {
    uint64_t bytes = HeapChunk(sizeof(*this)) + HashNodesHeapBytes(merge_rank_, /*cached_hash=*/true);
    for (const auto& [merge, rank] : merge_rank_) bytes += StringHeapBytes(merge);
    return bytes;
  }

 private:
  void EncodeWord(std::string_view word, std::vector<int32_t>* out) const;

  std::unordered_map<std::string, int32_t> merge_rank_;  // "left right" -> rank
  // The split pattern; kLlama3 also emits a word that is a token whole (llama.cpp's ignore_merges, Llama 3 only).
  PreTokenizer pre_kind_ = PreTokenizer::kGpt2;
  std::array<int32_t, 256> byte_token_{};  // byte -> the token of its byte_to_unicode character
};

void BpeTokenizer::EncodeFragment(std::string_view text, bool /*after_special*/, std::vector<int32_t>* out) const {
  for (std::string_view word : PreTokenize(text, pre_kind_)) {
    EncodeWord(word, out);
  }
}

void BpeTokenizer::EncodeWord(std::string_view word, std::vector<int32_t>* out) const {
  std::string s;  // the word in byte_to_unicode spelling
  std::vector<Symbol> sym;
  sym.reserve(word.size());
  for (char c : word) {
    const std::string& u = ByteToUnicode(static_cast<uint8_t>(c));
    Symbol x;
    x.offset = s.size();
    x.len = u.size();
    x.prev = static_cast<int>(sym.size()) - 1;
    x.next = static_cast<int>(sym.size()) + 1;
    sym.push_back(x);
    s += u;
  }
  if (sym.empty()) return;
  sym.back().next = -1;
  // Llama 3 (llama.cpp's ignore_merges): a word that is itself a token is emitted whole.
  if (pre_kind_ == PreTokenizer::kLlama3) {
    const int32_t id = FindToken(s);
    if (id >= 0) {
      out->push_back(id);
      return;
    }
  }

  std::priority_queue<Bigram, std::vector<Bigram>, BigramAfter> queue;
  std::string key;
  auto try_add = [&](int left, int right) {
    if (left < 0 || right < 0) return;
    key.assign(s, sym[left].offset, sym[left].len);
    key.push_back(' ');
    key.append(s, sym[right].offset, sym[right].len);
    auto it = merge_rank_.find(key);
    if (it == merge_rank_.end()) return;
    queue.push(Bigram{left, right, it->second, sym[left].len + sym[right].len});
  };
  for (int i = 1; i < static_cast<int>(sym.size()); ++i) try_add(i - 1, i);
  while (!queue.empty()) {
    const Bigram b = queue.top();
    queue.pop();
    Symbol& l = sym[b.left];
    Symbol& r = sym[b.right];
    if (l.len == 0 || r.len == 0 || l.len + r.len != b.len) continue;  // stale
    l.len += r.len;
    r.len = 0;
    l.next = r.next;
    if (r.next >= 0) sym[r.next].prev = b.left;
    try_add(l.prev, b.left);
    try_add(b.left, l.next);
  }

  for (int i = 0; i >= 0; i = sym[i].next) {
    const std::string_view piece = std::string_view(s).substr(sym[i].offset, sym[i].len);
    const int32_t id = FindToken(piece);
    if (id >= 0) {
      out->push_back(id);
      continue;
    }
    // A merge whose result is not in the vocabulary: spell the symbol byte by byte (every byte has a token, checked at
    // load). Each byte_to_unicode character is 1 or 2 UTF-8 bytes.
    for (size_t k = 0; k < piece.size();) {
      const uint8_t lead = static_cast<uint8_t>(piece[k]);
      const size_t n = lead < 0x80 ? 1 : 2;
      uint32_t cp = n == 1 ? lead : ((lead & 0x1Fu) << 6) | (static_cast<uint8_t>(piece[k + 1]) & 0x3Fu);
      out->push_back(byte_token_[UnicodeToByte(cp)]);
      k += n;
    }
  }
}

std::string BpeTokenizer::PieceBytes(int32_t id) const {
  const std::string& t = vocab_.tokens[id];
  if (vocab_.types[id] == TokenType::kUserDefined) return t;  // added tokens are stored as plain text
  std::string out;
  out.reserve(t.size());
  for (size_t i = 0; i < t.size();) {
    const uint8_t lead = static_cast<uint8_t>(t[i]);
    const size_t n = std::min<size_t>(Utf8LengthFromLead(lead), t.size() - i);
    uint32_t cp = lead;
    if (n == 2) cp = ((lead & 0x1Fu) << 6) | (static_cast<uint8_t>(t[i + 1]) & 0x3Fu);
    const int b = n <= 2 ? UnicodeToByte(cp) : -1;
    if (b >= 0) {
      out.push_back(static_cast<char>(b));
    } else {
      out.append(t, i, n);  // not a byte_to_unicode character: keep the text as it is
    }
    i += n;
  }
  return out;
}

}  // namespace

Result<std::unique_ptr<Tokenizer>> MakeBpeTokenizer(VocabData vocab) {
  NF_RETURN_IF_ERROR(Tokenizer::ValidateVocab(vocab));
  const std::string& src = vocab.source;
  if (!vocab.pre.empty() && vocab.pre != "gpt2" && vocab.pre != "default" && vocab.pre != "llama-bpe" &&
      vocab.pre != "llama3" && vocab.pre != "qwen2") {
    return Status::Unsupported(src + ": tokenizer.ggml.pre is \"" + vocab.pre +
                               "\"; supported pre-tokenizers: \"gpt2\"/\"default\", \"llama-bpe\"/\"llama3\" and "
                               "\"qwen2\"");
  }
  // Every byte must have a token, or some text could not be encoded at all.
  std::unordered_map<std::string_view, int32_t> ids;
  for (size_t i = 0; i < vocab.tokens.size(); ++i) ids.emplace(vocab.tokens[i], static_cast<int32_t>(i));
  for (int b = 0; b < 256; ++b) {
    if (!ids.count(ByteToUnicode(static_cast<uint8_t>(b)))) {
      return Status::Corruption(src + ": tokenizer.ggml.tokens has no token for byte " + std::to_string(b) + " (\"" +
                                ByteToUnicode(static_cast<uint8_t>(b)) +
                                "\"), which every byte-level BPE vocabulary must have");
    }
  }
  std::unordered_map<std::string, int32_t> rank;
  rank.reserve(vocab.merges.size());
  for (size_t i = 0; i < vocab.merges.size(); ++i) {
    const std::string& m = vocab.merges[i];
    // Search from 1: a merge's left side is never empty.
    const size_t sp = m.size() > 1 ? m.find(' ', 1) : std::string::npos;
    if (sp == std::string::npos || sp + 1 >= m.size() || m.find(' ', sp + 1) != std::string::npos) {
      return Status::Corruption(src + ": tokenizer.ggml.merges[" + std::to_string(i) + "] is \"" + m +
                                "\", expected two pieces separated by one space");
    }
    rank.emplace(m, static_cast<int32_t>(i));  // the first occurrence of a repeated merge keeps its rank
  }
  return std::unique_ptr<Tokenizer>(new BpeTokenizer(std::move(vocab), std::move(rank)));
}

}  // namespace nflash::text_internal
