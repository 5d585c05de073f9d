// Tokenizer base (special-token partitioning, decoding), streaming UTF-8 assembly, and the vocabulary loaders
// (GGUF tokenizer.ggml.* keys and llama2.c tokenizer.bin).
#include "runtime/text/tokenizer.h"

#include <algorithm>
#include <cstring>
#include <variant>

#include "runtime/core/file.h"
#include "runtime/core/heap_bytes.h"
#include "runtime/text/tokenizer_internal.h"

namespace nflash {

using text_internal::kReplacement;

namespace text_internal {

int Utf8LengthFromLead(uint8_t lead) {
  static constexpr int kByNibble[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
  return kByNibble[lead >> 4];
}

void AppendUtf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

}  // namespace text_internal

// ---------------------------------------------------------------------------------------------------------------
// Utf8Stream: the WHATWG UTF-8 decoder, run incrementally. A byte that cannot continue the pending sequence ends it
// (one U+FFFD for the pending prefix) and is then reconsidered as the start of a new sequence.

std::string Utf8Stream::Push(std::string_view bytes) {
  std::string out;
  for (size_t i = 0; i < bytes.size();) {
    const uint8_t b = static_cast<uint8_t>(bytes[i]);
    if (needed_ == 0) {
      ++i;
      if (b < 0x80) {
        out.push_back(static_cast<char>(b));
        continue;
      }
      if (b >= 0xC2 && b <= 0xDF) {
        needed_ = 1;
      } else if (b >= 0xE0 && b <= 0xEF) {
        if (b == 0xE0) lower_ = 0xA0;  // excludes overlong 3-byte forms
        if (b == 0xED) upper_ = 0x9F;  // excludes UTF-16 surrogates
        needed_ = 2;
      } else if (b >= 0xF0 && b <= 0xF4) {
        if (b == 0xF0) lower_ = 0x90;  // excludes overlong 4-byte forms
        if (b == 0xF4) upper_ = 0x8F;  // excludes code points above U+10FFFF
        needed_ = 3;
      } else {
        out += kReplacement;  // a stray continuation byte or a byte never valid in UTF-8
        continue;
      }
      pending_.assign(1, static_cast<char>(b));
      continue;
    }
    if (b < lower_ || b > upper_) {
      // The pending prefix can never complete; `b` is not consumed and starts over.
      out += kReplacement;
      pending_.clear();
      needed_ = 0;
      lower_ = 0x80;
      upper_ = 0xBF;
      continue;
    }
    ++i;
    lower_ = 0x80;
    upper_ = 0xBF;
    pending_.push_back(static_cast<char>(b));
    if (--needed_ == 0) {
      out += pending_;
      pending_.clear();
    }
  }
  return out;
}

std::string Utf8Stream::Finish() {
  if (needed_ == 0) return "";
  pending_.clear();
  needed_ = 0;
  lower_ = 0x80;
  upper_ = 0xBF;
  return std::string(kReplacement);
}

// ---------------------------------------------------------------------------------------------------------------
// Detokenizer

Detokenizer::Detokenizer(const Tokenizer& tokenizer, bool render_special, bool sequence_start)
    : tokenizer_(tokenizer), render_special_(render_special), at_start_(sequence_start) {}

std::string Detokenizer::Push(int32_t id) {
  if (tokenizer_.token_type(id) == TokenType::kControl) {
    return render_special_ ? utf8_.Push(tokenizer_.TokenText(id)) : std::string();
  }
  std::string bytes = tokenizer_.DecodeToken(id);
  if (bytes.empty()) return "";
  if (at_start_) {
    at_start_ = false;
    // Undo the space Encode prepends (SentencePiece's dummy prefix; llama2.c strips it after BOS the same way).
    if (tokenizer_.model() == "llama" && tokenizer_.add_space_prefix() && bytes[0] == ' ') bytes.erase(0, 1);
  }
  return utf8_.Push(bytes);
}

std::string Detokenizer::Finish() { return utf8_.Finish(); }

// ---------------------------------------------------------------------------------------------------------------
// Tokenizer base

Tokenizer::Tokenizer(VocabData vocab) : vocab_(std::move(vocab)) {
  const int32_t n = static_cast<int32_t>(vocab_.tokens.size());
  if (vocab_.types.empty()) vocab_.types.assign(n, TokenType::kNormal);
  if (vocab_.scores.empty()) vocab_.scores.assign(n, 0.0f);
  piece_to_id_.reserve(static_cast<size_t>(n));
  byte_value_.assign(static_cast<size_t>(n), -1);
  special_by_byte_.resize(256);
  for (int32_t id = 0; id < n; ++id) {
    const std::string& t = vocab_.tokens[id];
    piece_to_id_.emplace(std::string_view(t), id);  // emplace keeps the first id of a duplicated piece
    const TokenType type = vocab_.types[id];
    if (type == TokenType::kByte) {
      // ValidateVocab() checked the spelling "<0xXX>".
      byte_value_[id] = static_cast<int16_t>(std::stoi(t.substr(3, 2), nullptr, 16));
    }
    // llama.cpp's cache_special_tokens: control, user-defined and unknown tokens are matched in the text before it is
    // tokenized (control and unknown ones only with parse_special).
    if ((type == TokenType::kControl || type == TokenType::kUserDefined || type == TokenType::kUnknown) && !t.empty()) {
      special_by_byte_[static_cast<uint8_t>(t[0])].push_back(id);
    }
  }
  // Longest first, so "<|eot|>" wins over a shorter special token that is its prefix.
  for (auto& ids : special_by_byte_) {
    std::stable_sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) {
      return vocab_.tokens[a].size() > vocab_.tokens[b].size();
    });
  }
  // The end-of-turn markers of instruct vocabularies (as llama.cpp's vocabulary loader lists them), when they are
  // special tokens: a normal token that happens to be spelled so is text.
  static constexpr std::string_view kEndOfTurn[] = {"<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>",
                                                    "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>"};
  for (int32_t id : {vocab_.eos_id, vocab_.eot_id, vocab_.eom_id}) {
    if (id >= 0 && id < n) end_of_generation_.push_back(id);
  }
  for (std::string_view text : kEndOfTurn) {
    const auto it = piece_to_id_.find(text);
    if (it == piece_to_id_.end()) continue;
    const TokenType type = vocab_.types[it->second];
    if (type == TokenType::kControl || type == TokenType::kUserDefined) end_of_generation_.push_back(it->second);
  }
  std::sort(end_of_generation_.begin(), end_of_generation_.end());
  end_of_generation_.erase(std::unique(end_of_generation_.begin(), end_of_generation_.end()), end_of_generation_.end());
}

bool Tokenizer::IsEndOfGeneration(int32_t id) const {
  return std::binary_search(end_of_generation_.begin(), end_of_generation_.end(), id);
}

namespace {

// Parses "<0xXX>" (uppercase or lowercase hex); -1 if `t` is not spelled so.
int ParseByteToken(std::string_view t) {
  if (t.size() != 6 || t.substr(0, 3) != "<0x" || t[5] != '>') return -1;
  int v = 0;
  for (char c : t.substr(3, 2)) {
    int d;
    if (c >= '0' && c <= '9') d = c - '0';
    else if (c >= 'A' && c <= 'F') d = c - 'A' + 10;
    else if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
    else return -1;
    v = v * 16 + d;
  }
  return v;
}

}  // namespace

Status Tokenizer::ValidateVocab(const VocabData& v) {
  const std::string& src = v.source;
  const size_t n = v.tokens.size();
  if (n == 0) return Status::Corruption(src + ": tokenizer.ggml.tokens is empty, expected at least one token");
  if (n > static_cast<size_t>(INT32_MAX)) {
    return Status::Corruption(src + ": tokenizer.ggml.tokens has " + std::to_string(n) +
                              " entries, more than token ids (int32) can address");
  }
  if (!v.scores.empty() && v.scores.size() != n) {
    return Status::Corruption(src + ": tokenizer.ggml.scores has " + std::to_string(v.scores.size()) +
                              " entries, expected one per token (tokenizer.ggml.tokens has " + std::to_string(n) + ")");
  }
  if (!v.types.empty() && v.types.size() != n) {
    return Status::Corruption(src + ": tokenizer.ggml.token_type has " + std::to_string(v.types.size()) +
                              " entries, expected one per token (tokenizer.ggml.tokens has " + std::to_string(n) +
                              ")");
  }
  for (size_t i = 0; i < v.types.size(); ++i) {
    const auto t = static_cast<int32_t>(v.types[i]);
    if (t < 0 || t > static_cast<int32_t>(TokenType::kByte)) {
      return Status::Corruption(src + ": tokenizer.ggml.token_type[" + std::to_string(i) + "] is " +
                                std::to_string(t) + ", expected 0..6");
    }
    if (v.types[i] == TokenType::kByte && ParseByteToken(v.tokens[i]) < 0) {
      return Status::Corruption(src + ": tokenizer.ggml.tokens[" + std::to_string(i) + "] is \"" + v.tokens[i] +
                                "\" but tokenizer.ggml.token_type marks it a byte token (expected \"<0xXX>\")");
    }
  }
  struct IdKey {
    const char* key;
    int32_t id;
  };
  for (const IdKey& k : {IdKey{"tokenizer.ggml.bos_token_id", v.bos_id}, IdKey{"tokenizer.ggml.eos_token_id", v.eos_id},
                         IdKey{"tokenizer.ggml.unknown_token_id", v.unk_id},
                         IdKey{"tokenizer.ggml.eot_token_id", v.eot_id}, IdKey{"tokenizer.ggml.eom_token_id", v.eom_id}}) {
    if (k.id < -1 || k.id >= static_cast<int64_t>(n)) {
      return Status::Corruption(src + ": " + k.key + " is " + std::to_string(k.id) + ", expected an id below " +
                                std::to_string(n) + " (the vocabulary size)");
    }
  }
  return Status::Ok();
}

const std::string& Tokenizer::TokenText(int32_t id) const {
  static const std::string kEmpty;
  return id >= 0 && id < n_vocab() ? vocab_.tokens[id] : kEmpty;
}

TokenType Tokenizer::token_type(int32_t id) const {
  return id >= 0 && id < n_vocab() ? vocab_.types[id] : TokenType::kUndefined;
}

float Tokenizer::score(int32_t id) const { return id >= 0 && id < n_vocab() ? vocab_.scores[id] : 0.0f; }

int32_t Tokenizer::FindToken(std::string_view piece) const {
  auto it = piece_to_id_.find(piece);
  return it == piece_to_id_.end() ? -1 : it->second;
}

int Tokenizer::ByteValue(int32_t id) const { return id >= 0 && id < n_vocab() ? byte_value_[id] : -1; }

uint64_t Tokenizer::HeapBytes() const {
  uint64_t bytes = DerivedHeapBytes();
  for (const std::string* s : {&vocab_.model, &vocab_.pre, &vocab_.chat_template, &vocab_.source}) {
    bytes += StringHeapBytes(*s);
  }
  for (const std::vector<std::string>* v : {&vocab_.tokens, &vocab_.merges}) {
    bytes += VectorHeapBytes(*v);
    for (const std::string& s : *v) bytes += StringHeapBytes(s);
  }
  bytes += VectorHeapBytes(vocab_.scores) + VectorHeapBytes(vocab_.types);
  bytes += HashNodesHeapBytes(piece_to_id_, /*cached_hash=*/true);  // std::hash<string_view> is not "fast"
  bytes += VectorHeapBytes(end_of_generation_) + VectorHeapBytes(special_by_byte_) + VectorHeapBytes(byte_value_);
  for (const std::vector<int32_t>& v : special_by_byte_) bytes += VectorHeapBytes(v);
  return bytes;
}

std::vector<int32_t> Tokenizer::Encode(std::string_view text, bool add_bos, bool parse_special) const {
  std::vector<int32_t> out;
  if (add_bos && vocab_.bos_id >= 0) out.push_back(vocab_.bos_id);
  size_t start = 0;
  bool after_special = true;
  for (size_t pos = 0; pos < text.size();) {
    int32_t match = -1;
    for (int32_t id : special_by_byte_[static_cast<uint8_t>(text[pos])]) {
      const TokenType type = vocab_.types[id];
      if ((type == TokenType::kControl || type == TokenType::kUnknown) && !parse_special) continue;
      const std::string& t = vocab_.tokens[id];
      if (text.compare(pos, t.size(), t) == 0) {
        match = id;
        break;
      }
    }
    if (match < 0) {
      ++pos;
      continue;
    }
    if (pos > start) EncodeFragment(text.substr(start, pos - start), after_special, &out);
    out.push_back(match);
    after_special = true;
    pos += vocab_.tokens[match].size();
    start = pos;
  }
  if (start < text.size()) EncodeFragment(text.substr(start), after_special, &out);
  return out;
}

std::string Tokenizer::DecodeToken(int32_t id) const {
  switch (token_type(id)) {
    case TokenType::kNormal:
    case TokenType::kUserDefined:
    case TokenType::kUndefined:
      return id >= 0 && id < n_vocab() ? PieceBytes(id) : std::string();
    case TokenType::kByte:
      return std::string(1, static_cast<char>(byte_value_[id]));
    case TokenType::kUnknown:
      return std::string(kReplacement);  // what was there is not known; say so visibly
    case TokenType::kControl:
    case TokenType::kUnused:
      return "";
  }
  return "";
}

std::string Tokenizer::Decode(std::span<const int32_t> ids, bool render_special) const {
  Detokenizer d(*this, render_special);
  std::string out;
  for (int32_t id : ids) out += d.Push(id);
  out += d.Finish();
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// Factories and loaders

Result<std::unique_ptr<Tokenizer>> MakeTokenizer(VocabData vocab) {
  if (vocab.model == "llama") return text_internal::MakeSpmTokenizer(std::move(vocab));
  if (vocab.model == "gpt2") return text_internal::MakeBpeTokenizer(std::move(vocab));
  return Status::Unsupported(vocab.source + ": tokenizer.ggml.model is \"" + vocab.model +
                             "\"; supported: \"llama\" (SentencePiece BPE) and \"gpt2\" (byte-level BPE)");
}

namespace {

// A GGUF array of strings (element type string), or Corruption naming the key.
Result<std::vector<std::string>> StringArray(const GgufFile& f, std::string_view key) {
  NF_ASSIGN_OR_RETURN(const GgufArray* arr, f.GetArray(key));
  if (arr->element_type != GgufType::kString) {
    return Status::Corruption(f.path() + ": " + std::string(key) + " is an array of " +
                              std::string(GgufTypeName(arr->element_type)) + ", expected an array of string");
  }
  std::vector<std::string> out;
  out.reserve(arr->items.size());
  for (const GgufValue& v : arr->items) out.push_back(std::get<std::string>(v.v));
  return out;
}

// A GGUF array of numbers (any integer or float element type) as doubles, or Corruption naming the key.
Result<std::vector<double>> NumberArray(const GgufFile& f, std::string_view key) {
  NF_ASSIGN_OR_RETURN(const GgufArray* arr, f.GetArray(key));
  std::vector<double> out;
  out.reserve(arr->items.size());
  for (size_t i = 0; i < arr->items.size(); ++i) {
    const GgufValue& v = arr->items[i];
    double d = 0;
    const bool ok = std::visit(
        [&](const auto& x) {
          using T = std::decay_t<decltype(x)>;
          if constexpr (std::is_arithmetic_v<T> && !std::is_same_v<T, bool>) {
            d = static_cast<double>(x);
            return true;
          }
          return false;
        },
        v.v);
    if (!ok) {
      return Status::Corruption(f.path() + ": " + std::string(key) + "[" + std::to_string(i) + "] has type " +
                                std::string(GgufTypeName(v.type())) + ", expected a number");
    }
    out.push_back(d);
  }
  return out;
}

}  // namespace

Result<VocabData> ReadGgufVocab(const GgufFile& f) {
  VocabData v;
  v.source = f.path();
  NF_ASSIGN_OR_RETURN(v.model, f.GetString("tokenizer.ggml.model"));
  if (f.Find("tokenizer.ggml.pre")) {
    NF_ASSIGN_OR_RETURN(v.pre, f.GetString("tokenizer.ggml.pre"));
  }
  NF_ASSIGN_OR_RETURN(v.tokens, StringArray(f, "tokenizer.ggml.tokens"));
  if (f.Find("tokenizer.ggml.scores")) {
    NF_ASSIGN_OR_RETURN(std::vector<double> s, NumberArray(f, "tokenizer.ggml.scores"));
    v.scores.assign(s.begin(), s.end());
  }
  if (f.Find("tokenizer.ggml.token_type")) {
    NF_ASSIGN_OR_RETURN(std::vector<double> t, NumberArray(f, "tokenizer.ggml.token_type"));
    v.types.reserve(t.size());
    for (size_t i = 0; i < t.size(); ++i) {
      if (t[i] < 0 || t[i] > static_cast<double>(TokenType::kByte) || t[i] != static_cast<int32_t>(t[i])) {
        return Status::Corruption(f.path() + ": tokenizer.ggml.token_type[" + std::to_string(i) + "] is " +
                                  std::to_string(t[i]) + ", expected an integer 0..6");
      }
      v.types.push_back(static_cast<TokenType>(static_cast<int32_t>(t[i])));
    }
  }
  if (f.Find("tokenizer.ggml.merges")) {
    NF_ASSIGN_OR_RETURN(v.merges, StringArray(f, "tokenizer.ggml.merges"));
  }
  struct IdKey {
    const char* key;
    int32_t* id;
  };
  for (const IdKey& k : {IdKey{"tokenizer.ggml.bos_token_id", &v.bos_id}, IdKey{"tokenizer.ggml.eos_token_id", &v.eos_id},
                         IdKey{"tokenizer.ggml.unknown_token_id", &v.unk_id},
                         IdKey{"tokenizer.ggml.eot_token_id", &v.eot_id}, IdKey{"tokenizer.ggml.eom_token_id", &v.eom_id}}) {
    if (!f.Find(k.key)) continue;
    NF_ASSIGN_OR_RETURN(int64_t id, f.GetInt(k.key));
    if (id < -1 || id > INT32_MAX) {
      return Status::Corruption(f.path() + ": " + k.key + " is " + std::to_string(id) + ", expected a token id");
    }
    *k.id = static_cast<int32_t>(id);
  }
  // llama.cpp's defaults: SentencePiece models add BOS and a space prefix; byte-level BPE adds BOS only for Llama 3.
  const bool llama3 = v.pre == "llama-bpe" || v.pre == "llama3";
  v.add_bos = v.model == "llama" || llama3;
  v.add_space_prefix = v.model == "llama";
  if (f.Find("tokenizer.ggml.add_bos_token")) {
    NF_ASSIGN_OR_RETURN(v.add_bos, f.GetBool("tokenizer.ggml.add_bos_token"));
  }
  if (f.Find("tokenizer.ggml.add_space_prefix")) {
    NF_ASSIGN_OR_RETURN(v.add_space_prefix, f.GetBool("tokenizer.ggml.add_space_prefix"));
  }
  if (f.Find("tokenizer.chat_template")) {
    NF_ASSIGN_OR_RETURN(v.chat_template, f.GetString("tokenizer.chat_template"));
  }
  return v;
}

Result<std::unique_ptr<Tokenizer>> LoadTokenizer(const GgufFile& gguf) {
  NF_ASSIGN_OR_RETURN(VocabData v, ReadGgufVocab(gguf));
  return MakeTokenizer(std::move(v));
}

}  // namespace nflash
