// SentencePiece-style BPE ("llama"): score-ordered merges of UTF-8 characters with a priority queue, byte fallback.
#include <algorithm>
#include <array>
#include <cctype>
#include <cstdint>
#include <queue>
#include <string>
#include <vector>

#include "runtime/core/heap_bytes.h"
#include "runtime/text/tokenizer.h"
#include "runtime/text/tokenizer_internal.h"

namespace nflash::text_internal {
namespace {

// Thread-safety: immutable after construction (see Tokenizer).
class SpmTokenizer final : public Tokenizer {
 public:
  explicit SpmTokenizer(VocabData vocab) : Tokenizer(std::move(vocab)) {
    byte_token_.fill(-1);
    for (int32_t id = 0; id < n_vocab(); ++id) {
      const int b = ByteValue(id);
      if (b >= 0 && byte_token_[b] < 0) byte_token_[b] = id;
    }
  }

 protected:
  void EncodeFragment(std::string_view text, bool after_special, std::vector<int32_t>* out) const override;
  std::string PieceBytes(int32_t id) const override;
  uint64_t DerivedHeapBytes() const override { return HeapChunk(sizeof(*this)); }

 private:
  // The id of a piece the merges may produce or the output may use as is: normal, user-defined and undefined
  // tokens. Control, unknown, unused and byte tokens are never spelled out by text (SentencePiece's rule), so "<s>"
  // or "<0x41>" in the input stay characters.
  int32_t PieceId(std::string_view piece) const {
    const int32_t id = FindToken(piece);
    if (id < 0) return -1;
    const TokenType t = vocab_.types[id];
    return t == TokenType::kNormal || t == TokenType::kUserDefined || t == TokenType::kUndefined ? id : -1;
  }

  std::array<int32_t, 256> byte_token_;  // byte value -> its <0xXX> token, or -1
};

// One symbol of the working sequence: a run of bytes of the normalised text, linked to its neighbours. A merged-away
// symbol keeps len 0.
struct Symbol {
  size_t offset = 0;
  size_t len = 0;
  int prev = -1;
  int next = -1;
};

// A candidate merge of symbols left and right. `len` is their combined length when the candidate was made: if either
// side has changed since, the candidate is stale and skipped.
struct Bigram {
  int left = 0;
  int right = 0;
  float score = 0;
  size_t len = 0;
};

// Highest score first; equal scores: the leftmost pair first (as SentencePiece and llama.cpp).
struct BigramLess {
  bool operator()(const Bigram& a, const Bigram& b) const {
    return a.score < b.score || (a.score == b.score && a.left > b.left);
  }
};

void SpmTokenizer::EncodeFragment(std::string_view text, bool after_special, std::vector<int32_t>* out) const {
  // Normalise: the dummy prefix, then spaces as U+2581.
  std::string s;
  s.reserve(text.size() + 8);
  if (add_space_prefix() && after_special) s += kSpmSpace;
  for (char c : text) {
    if (c == ' ') s += kSpmSpace;
    else s.push_back(c);
  }

  std::vector<Symbol> sym;
  sym.reserve(s.size());
  for (size_t off = 0; off < s.size();) {
    const size_t len = std::min<size_t>(Utf8LengthFromLead(static_cast<uint8_t>(s[off])), s.size() - off);
    Symbol x;
    x.offset = off;
    x.len = len;
    x.prev = static_cast<int>(sym.size()) - 1;
    x.next = off + len < s.size() ? static_cast<int>(sym.size()) + 1 : -1;
    sym.push_back(x);
    off += len;
  }

  std::priority_queue<Bigram, std::vector<Bigram>, BigramLess> queue;
  auto try_add = [&](int left, int right) {
    if (left < 0 || right < 0) return;
    const size_t len = sym[left].len + sym[right].len;
    const int32_t id = PieceId(std::string_view(s).substr(sym[left].offset, len));
    if (id < 0) return;
    queue.push(Bigram{left, right, vocab_.scores[id], len});
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

  for (int i = sym.empty() ? -1 : 0; i >= 0; i = sym[i].next) {
    const std::string_view piece = std::string_view(s).substr(sym[i].offset, sym[i].len);
    const int32_t id = PieceId(piece);
    if (id >= 0) {
      out->push_back(id);
      continue;
    }
    // Byte fallback; when a byte has no token, the whole character becomes one <unk> (MakeSpmTokenizer checked
    // that there is one then).
    bool all_bytes = true;
    for (char c : piece) all_bytes = all_bytes && byte_token_[static_cast<uint8_t>(c)] >= 0;
    if (!all_bytes) {
      out->push_back(unk_id());
      continue;
    }
    for (char c : piece) out->push_back(byte_token_[static_cast<uint8_t>(c)]);
  }
}

std::string SpmTokenizer::PieceBytes(int32_t id) const {
  const std::string& t = vocab_.tokens[id];
  std::string out;
  out.reserve(t.size());
  for (size_t i = 0; i < t.size();) {
    if (t.compare(i, kSpmSpace.size(), kSpmSpace) == 0) {
      out.push_back(' ');
      i += kSpmSpace.size();
    } else {
      out.push_back(t[i++]);
    }
  }
  return out;
}

}  // namespace

Result<std::unique_ptr<Tokenizer>> MakeSpmTokenizer(VocabData vocab) {
  NF_RETURN_IF_ERROR(Tokenizer::ValidateVocab(vocab));
  if (vocab.types.empty()) {
    // No tokenizer.ggml.token_type: infer what the encoder depends on from the spelling and the special ids.
    vocab.types.assign(vocab.tokens.size(), TokenType::kNormal);
    for (size_t i = 0; i < vocab.tokens.size(); ++i) {
      const std::string& t = vocab.tokens[i];
      if (t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>' && std::isxdigit(static_cast<uint8_t>(t[3])) &&
          std::isxdigit(static_cast<uint8_t>(t[4]))) {
        vocab.types[i] = TokenType::kByte;
      }
    }
    if (vocab.unk_id >= 0) vocab.types[vocab.unk_id] = TokenType::kUnknown;
    if (vocab.bos_id >= 0) vocab.types[vocab.bos_id] = TokenType::kControl;
    if (vocab.eos_id >= 0) vocab.types[vocab.eos_id] = TokenType::kControl;
  }
  if (vocab.scores.empty()) {
    return Status::Corruption(vocab.source + ": tokenizer.ggml.scores is missing; the \"llama\" tokenizer merges by "
                              "score and needs one per token");
  }
  // Every byte must be representable: by its <0xXX> token, or at least by <unk>.
  int n_byte_tokens = 0;
  std::array<bool, 256> seen{};
  for (size_t i = 0; i < vocab.types.size(); ++i) {
    if (vocab.types[i] != TokenType::kByte) continue;
    const std::string& t = vocab.tokens[i];
    const int b = std::stoi(t.substr(3, 2), nullptr, 16);
    if (!seen[b]) ++n_byte_tokens;
    seen[b] = true;
  }
  if (n_byte_tokens < 256 && vocab.unk_id < 0) {
    return Status::Corruption(vocab.source + ": tokenizer.ggml.tokens has " + std::to_string(n_byte_tokens) +
                              " of the 256 <0xXX> byte tokens and tokenizer.ggml.unknown_token_id is not set: "
                              "some text could not be encoded");
  }
  return std::unique_ptr<Tokenizer>(new SpmTokenizer(std::move(vocab)));
}

}  // namespace nflash::text_internal
