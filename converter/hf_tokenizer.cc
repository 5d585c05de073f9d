// Hugging Face tokenizers: SentencePiece protobuf decoding, tokenizer.json BPE parsing, tokenizer_config refinements.
#include "converter/hf_tokenizer.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include "runtime/core/file.h"
#include "runtime/core/json_fields.h"
#include "runtime/core/log.h"

namespace nflash::converter {
namespace {

using nlohmann::json;

// llama.cpp token types (llama_token_type); SentencePiece's piece types use the same numbers.
constexpr int32_t kTypeNormal = 1;
constexpr int32_t kTypeUnknown = 2;
constexpr int32_t kTypeControl = 3;
constexpr int32_t kTypeUserDefined = 4;
constexpr int32_t kTypeByte = 6;

// Protobuf wire types (https://protobuf.dev/programming-guides/encoding/).
constexpr uint32_t kWireVarint = 0;
constexpr uint32_t kWireFixed64 = 1;
constexpr uint32_t kWireLen = 2;
constexpr uint32_t kWireFixed32 = 5;

// A cursor over protobuf bytes; errors name the file and the absolute offset. Thread-safety: not thread-safe.
class WireReader {
 public:
  WireReader(std::span<const uint8_t> bytes, uint64_t base, const std::string& path)
      : bytes_(bytes), base_(base), path_(path) {}
  bool done() const { return pos_ >= bytes_.size(); }
  uint64_t offset() const { return base_ + pos_; }

  Result<uint64_t> Varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (pos_ >= bytes_.size()) return Error("truncated varint");
      const uint8_t b = bytes_[pos_++];
      v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if ((b & 0x80) == 0) return v;
    }
    return Error("varint longer than 10 bytes");
  }
  Result<std::span<const uint8_t>> Bytes(uint64_t n) {
    if (n > bytes_.size() - pos_) {
      return Error("length-delimited field of " + std::to_string(n) + " bytes, but only " +
                   std::to_string(bytes_.size() - pos_) + " remain");
    }
    auto s = bytes_.subspan(pos_, n);
    pos_ += n;
    return s;
  }
  Result<std::span<const uint8_t>> LenField() {
    NF_ASSIGN_OR_RETURN(uint64_t n, Varint());
    return Bytes(n);
  }
  Result<uint32_t> Fixed32() {
    NF_ASSIGN_OR_RETURN(auto b, Bytes(4));
    return uint32_t{b[0]} | uint32_t{b[1]} << 8 | uint32_t{b[2]} << 16 | uint32_t{b[3]} << 24;
  }
  Status Skip(uint32_t wire_type) {
    switch (wire_type) {
      case kWireVarint: return Varint().status();
      case kWireFixed64: return Bytes(8).status();
      case kWireLen: return LenField().status();
      case kWireFixed32: return Bytes(4).status();
      default: return Error("unsupported wire type " + std::to_string(wire_type));
    }
  }
  Status Error(const std::string& what) const {
    return Status::Corruption(path_ + ": protobuf at offset " + std::to_string(base_ + pos_) + ": " + what);
  }

 private:
  std::span<const uint8_t> bytes_;
  uint64_t base_;
  size_t pos_ = 0;
  const std::string& path_;
};

std::string JsonString(const json& v) { return v.is_string() ? v.get<std::string>() : std::string(); }

// obj[key] when it is a boolean, else `fallback` (absent, null, or another type: exporters are inconsistent).
bool BoolOr(const json& obj, const char* key, bool fallback) {
  if (!obj.is_object() || !obj.contains(key) || !obj[key].is_boolean()) return fallback;
  return obj[key].get<bool>();
}

// tokenizer_config's "bos_token" is either a string or an AddedToken object {"content": ...}.
std::string TokenText(const json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content")) return JsonString(v["content"]);
  return "";
}

bool IsByteToken(const std::string& t) {
  auto hex = [](char c) { return (c >= '0' && c <= '9') || (c >= 'A' && c <= 'F') || (c >= 'a' && c <= 'f'); };
  return t.size() == 6 && t.compare(0, 3, "<0x") == 0 && hex(t[3]) && hex(t[4]) && t[5] == '>';
}

int32_t FindToken(const TokenizerData& tok, const std::string& text) {
  for (size_t i = 0; i < tok.tokens.size(); ++i) {
    if (tok.tokens[i] == text) return static_cast<int32_t>(i);
  }
  return -1;
}

Result<json> ParseJson(std::string_view text, const std::string& path) {
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    return Status::Corruption(path + ": JSON does not parse: " + e.what());
  }
}

// Split regexes of known byte-level pre-tokenizers, mapped to llama.cpp's tokenizer.ggml.pre names.
// Llama-3 groups digits by up to three; Qwen2 splits every digit.
constexpr const char* kLlama3Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kQwen2Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// Whether the pre_tokenizer is (or contains) ByteLevel; sets *pre to a llama.cpp pre-tokenizer name when known.
bool DetectByteLevel(const json& pre_tokenizer, std::string* pre) {
  if (!pre_tokenizer.is_object()) return false;
  const std::string type = JsonString(pre_tokenizer.value("type", json()));
  if (type == "ByteLevel") {
    // ByteLevel with its own regex and nothing else is GPT-2's pre-tokenizer.
    if (BoolOr(pre_tokenizer, "use_regex", true)) *pre = "gpt-2";
    return true;
  }
  if (type != "Sequence" || !pre_tokenizer.contains("pretokenizers")) return false;
  bool byte_level = false;
  std::string regex;
  for (const json& p : pre_tokenizer["pretokenizers"]) {
    if (!p.is_object()) continue;
    const std::string t = JsonString(p.value("type", json()));
    if (t == "ByteLevel") byte_level = true;
    if (t == "Split" && p.contains("pattern") && p["pattern"].is_object()) {
      regex = JsonString(p["pattern"].value("Regex", json()));
    }
  }
  if (byte_level) {
    if (regex == kLlama3Regex) *pre = "llama-bpe";
    else if (regex == kQwen2Regex) *pre = "qwen2";
  }
  return byte_level;
}

// Reads a file if it exists; empty string when absent.
Result<std::string> ReadOptionalText(const std::string& path) {
  if (!FileExists(path)) return std::string();
  NF_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, ReadWholeFile(path));
  return std::string(bytes.begin(), bytes.end());
}

}  // namespace

Result<TokenizerData> ParseSentencePieceModel(std::span<const uint8_t> bytes, const std::string& path) {
  TokenizerData tok;
  tok.model = "llama";
  WireReader model(bytes, 0, path);
  while (!model.done()) {
    NF_ASSIGN_OR_RETURN(uint64_t key, model.Varint());
    const uint32_t field = static_cast<uint32_t>(key >> 3);
    const uint32_t wire = static_cast<uint32_t>(key & 7);
    if (field != 1) {
      NF_RETURN_IF_ERROR(model.Skip(wire));
      continue;
    }
    if (wire != kWireLen) return model.Error("ModelProto.pieces: expected wire type 2, found " + std::to_string(wire));
    const uint64_t piece_offset = model.offset();
    NF_ASSIGN_OR_RETURN(std::span<const uint8_t> piece_bytes, model.LenField());
    WireReader piece(piece_bytes, model.offset() - piece_bytes.size(), path);
    std::string text;
    bool has_text = false;
    float score = 0.0f;
    int32_t type = kTypeNormal;  // the proto default
    while (!piece.done()) {
      NF_ASSIGN_OR_RETURN(uint64_t pkey, piece.Varint());
      const uint32_t pf = static_cast<uint32_t>(pkey >> 3);
      const uint32_t pw = static_cast<uint32_t>(pkey & 7);
      if (pf == 1 && pw == kWireLen) {
        NF_ASSIGN_OR_RETURN(auto s, piece.LenField());
        text.assign(reinterpret_cast<const char*>(s.data()), s.size());
        has_text = true;
      } else if (pf == 2 && pw == kWireFixed32) {
        NF_ASSIGN_OR_RETURN(uint32_t u, piece.Fixed32());
        std::memcpy(&score, &u, 4);
      } else if (pf == 3 && pw == kWireVarint) {
        NF_ASSIGN_OR_RETURN(uint64_t t, piece.Varint());
        if (t < kTypeNormal || t > kTypeByte) {
          return piece.Error("piece " + std::to_string(tok.tokens.size()) + " type: expected 1..6, found " +
                             std::to_string(t));
        }
        type = static_cast<int32_t>(t);
      } else if (pf >= 1 && pf <= 3) {
        return piece.Error("piece " + std::to_string(tok.tokens.size()) + " field " + std::to_string(pf) +
                           ": unexpected wire type " + std::to_string(pw));
      } else {
        NF_RETURN_IF_ERROR(piece.Skip(pw));
      }
    }
    if (!has_text) {
      return Status::Corruption(path + ": piece " + std::to_string(tok.tokens.size()) + " at offset " +
                                std::to_string(piece_offset) + " has no piece string (field 1)");
    }
    const int32_t id = static_cast<int32_t>(tok.tokens.size());
    if (type == kTypeUnknown && tok.unk_id < 0) tok.unk_id = id;
    if (text == "<s>" && tok.bos_id < 0) tok.bos_id = id;
    if (text == "</s>" && tok.eos_id < 0) tok.eos_id = id;
    if (text == "<pad>" && tok.pad_id < 0) tok.pad_id = id;
    tok.tokens.push_back(std::move(text));
    tok.scores.push_back(score);
    tok.token_types.push_back(type);
  }
  if (tok.tokens.empty()) return Status::Corruption(path + ": SentencePiece model has no pieces (field 1)");
  return tok;
}

Result<TokenizerData> ParseTokenizerJson(std::string_view text, const std::string& path) {
  NF_ASSIGN_OR_RETURN(json doc, ParseJson(text, path));
  try {
    if (!doc.is_object() || !doc.contains("model") || !doc["model"].is_object()) {
      return Status::Corruption(path + ": missing object field \"model\"");
    }
    const json& model = doc["model"];
    const std::string type = JsonString(model.value("type", json()));
    if (type != "BPE") {
      return Status::Unsupported(path + ": model.type \"" + type + "\" is not supported (expected \"BPE\")");
    }
    if (!model.contains("vocab") || !model["vocab"].is_object()) {
      return Status::Corruption(path + ": model.vocab: expected an object of token -> id");
    }
    TokenizerData tok;
    const bool byte_fallback = BoolOr(model, "byte_fallback", false);
    std::string pre;
    const bool byte_level = DetectByteLevel(doc.value("pre_tokenizer", json()), &pre);
    if (byte_fallback) {
      tok.model = "llama";
    } else if (byte_level) {
      tok.model = "gpt2";
      tok.pre = pre;
      if (pre.empty()) {
        NF_LOG(Warning) << path << ": byte-level pre-tokenizer not recognised; tokenizer.ggml.pre left unset";
      }
    } else {
      return Status::Unsupported(path +
                                 ": BPE without byte_fallback and without a ByteLevel pre_tokenizer is not supported");
    }

    // id -> text, from the vocab and then the added tokens (which may repeat vocab entries).
    std::map<int64_t, std::string> by_id;
    for (auto it = model["vocab"].begin(); it != model["vocab"].end(); ++it) {
      if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0) {
        return Status::Corruption(path + ": model.vocab[\"" + it.key() + "\"]: expected a non-negative id, found " +
                                  it.value().dump());
      }
      by_id[it.value().get<int64_t>()] = it.key();
    }
    std::map<int64_t, bool> added;  // id -> special
    if (doc.contains("added_tokens") && doc["added_tokens"].is_array()) {
      for (const json& a : doc["added_tokens"]) {
        if (!a.is_object() || !a.contains("id") || !a["id"].is_number_integer() || !a.contains("content") ||
            !a["content"].is_string() || a["id"].get<int64_t>() < 0) {
          return Status::Corruption(path + ": added_tokens entry " + a.dump() + ": expected {id, content}");
        }
        const int64_t id = a["id"].get<int64_t>();
        by_id[id] = a["content"].get<std::string>();
        added[id] = BoolOr(a, "special", false);
      }
    }
    if (by_id.empty()) return Status::Corruption(path + ": model.vocab is empty");
    const int64_t n = by_id.rbegin()->first + 1;
    if (static_cast<int64_t>(by_id.size()) != n) {
      for (int64_t i = 0; i < n; ++i) {
        if (!by_id.count(i)) {
          return Status::Corruption(path + ": token ids are not contiguous: no token has id " + std::to_string(i) +
                                    " (largest id " + std::to_string(n - 1) + ")");
        }
      }
    }
    std::unordered_map<std::string, int64_t> id_of;
    for (const auto& [id, t] : by_id) {
      tok.tokens.push_back(t);
      id_of.emplace(t, id);
    }
    tok.token_types.assign(n, kTypeNormal);
    const std::string unk = JsonString(model.value("unk_token", json()));

    // Merges: "a b" strings (older files) or ["a", "b"] pairs (tokenizers >= 0.20).
    if (model.contains("merges") && model["merges"].is_array()) {
      size_t i = 0;
      for (const json& m : model["merges"]) {
        if (m.is_string()) {
          tok.merges.push_back(m.get<std::string>());
        } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
          tok.merges.push_back(m[0].get<std::string>() + " " + m[1].get<std::string>());
        } else {
          return Status::Corruption(path + ": model.merges[" + std::to_string(i) +
                                    "]: expected \"a b\" or [\"a\", \"b\"], found " + m.dump());
        }
        ++i;
      }
    }

    for (int64_t id = 0; id < n; ++id) {
      const std::string& t = tok.tokens[id];
      auto a = added.find(id);
      if (a != added.end()) {
        tok.token_types[id] = a->second ? kTypeControl : kTypeUserDefined;
      } else if (tok.model == "llama" && IsByteToken(t)) {
        tok.token_types[id] = kTypeByte;
      }
      if (!unk.empty() && t == unk) tok.token_types[id] = kTypeUnknown;
    }
    if (!unk.empty()) {
      auto u = id_of.find(unk);
      if (u != id_of.end()) tok.unk_id = static_cast<int32_t>(u->second);
    }

    if (tok.model == "llama") {
      // Scores from merge ranks (see the header): the token a merge produces scores -rank.
      const float unreached = -static_cast<float>(tok.merges.size()) - 1.0f;
      tok.scores.assign(n, unreached);
      for (int64_t id = 0; id < n; ++id) {
        const int32_t ty = tok.token_types[id];
        if (ty == kTypeByte || ty == kTypeControl || ty == kTypeUnknown) tok.scores[id] = 0.0f;
      }
      for (size_t r = 0; r < tok.merges.size(); ++r) {
        std::string joined = tok.merges[r];
        const size_t sp = joined.find(' ');
        if (sp != std::string::npos) joined.erase(sp, 1);
        auto it = id_of.find(joined);
        if (it != id_of.end() && tok.token_types[it->second] == kTypeNormal &&
            tok.scores[it->second] == unreached) {
          tok.scores[it->second] = -static_cast<float>(r);
        }
      }
      // SentencePiece BPE needs no merge list: the scores carry the order.
      tok.merges.clear();
      // The conventional names, refined later from tokenizer_config.json.
      tok.bos_id = FindToken(tok, "<s>");
      tok.eos_id = FindToken(tok, "</s>");
    }
    return tok;
  } catch (const json::exception& e) {
    return Status::Corruption(path + ": unexpected JSON structure: " + e.what());
  }
}

namespace {

// "chat_template": the Jinja source, or (tokenizers with several) a list of {"name", "template"} of which the one named
// "default" is the chat template, as transformers chooses it.
Result<std::string> ChatTemplateField(const json& v, const std::string& path) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_array()) {
    for (const json& item : v) {
      if (item.is_object() && item.contains("name") && item["name"] == "default" && item.contains("template") &&
          item["template"].is_string()) {
        return item["template"].get<std::string>();
      }
    }
    return Status::Corruption(path + ": chat_template: a list without a template named \"default\"");
  }
  return Status::Corruption(path + ": chat_template: expected a string or a list of {\"name\", \"template\"}, found " +
                            JsonFound(v));
}

}  // namespace

Status ApplyTokenizerConfig(std::string_view tokenizer_config_text, std::string_view config_text,
                            const std::string& dir, TokenizerData* tok) {
  try {
    if (!config_text.empty()) {
      NF_ASSIGN_OR_RETURN(json config, ParseJson(config_text, dir + "/config.json"));
      const auto n = static_cast<int64_t>(tok->tokens.size());
      // An id, or a list of ids (Llama-3.1 lists several end-of-turn ids as eos_token_id): the first one is used.
      auto id_field = [&](const char* key, int32_t* out) {
        if (!config.is_object() || !config.contains(key)) return;
        const json& v = config[key].is_array() && !config[key].empty() ? config[key][0] : config[key];
        if (v.is_number_integer()) {
          const int64_t id = v.get<int64_t>();
          if (id >= 0 && id < n) *out = static_cast<int32_t>(id);
        }
      };
      id_field("bos_token_id", &tok->bos_id);
      id_field("eos_token_id", &tok->eos_id);
      id_field("pad_token_id", &tok->pad_id);
    }
    if (tokenizer_config_text.empty()) return Status::Ok();
    const std::string path = dir + "/tokenizer_config.json";
    NF_ASSIGN_OR_RETURN(json tc, ParseJson(tokenizer_config_text, path));
    if (!tc.is_object()) return Status::Corruption(path + ": expected a JSON object");

    // SentencePiece files do not know about tokens added after training: take their types from the HF config.
    if (tc.contains("added_tokens_decoder") && tc["added_tokens_decoder"].is_object()) {
      for (auto it = tc["added_tokens_decoder"].begin(); it != tc["added_tokens_decoder"].end(); ++it) {
        int64_t id = -1;
        try {
          id = std::stoll(it.key());
        } catch (const std::exception&) {
          return Status::Corruption(path + ": added_tokens_decoder key \"" + it.key() + "\" is not a token id");
        }
        const std::string content = TokenText(it.value());
        if (id < 0 || id >= static_cast<int64_t>(tok->tokens.size()) || content.empty()) continue;
        if (tok->tokens[id] != content) {
          NF_LOG(Debug) << path << ": added token " << id << " \"" << content << "\" replaces \"" << tok->tokens[id]
                        << "\"";
          tok->tokens[id] = content;
        }
        const bool special = BoolOr(it.value(), "special", false);
        if (tok->token_types[id] != kTypeUnknown) tok->token_types[id] = special ? kTypeControl : kTypeUserDefined;
      }
    }
    for (const auto& [key, out] : {std::pair<const char*, int32_t*>{"bos_token", &tok->bos_id},
                                   std::pair<const char*, int32_t*>{"eos_token", &tok->eos_id},
                                   std::pair<const char*, int32_t*>{"unk_token", &tok->unk_id},
                                   std::pair<const char*, int32_t*>{"pad_token", &tok->pad_id}}) {
      if (!tc.contains(key)) continue;
      const std::string text = TokenText(tc[key]);
      if (text.empty()) continue;
      const int32_t id = FindToken(*tok, text);
      if (id >= 0) {
        *out = id;
      } else {
        NF_LOG(Warning) << path << ": " << key << " \"" << text << "\" is not in the vocabulary; ignored";
      }
    }
    if (tc.contains("add_bos_token") && tc["add_bos_token"].is_boolean()) tok->add_bos = tc["add_bos_token"].get<bool>();
    if (tc.contains("add_eos_token") && tc["add_eos_token"].is_boolean()) tok->add_eos = tc["add_eos_token"].get<bool>();
    if (tc.contains("chat_template") && !tc["chat_template"].is_null()) {
      NF_ASSIGN_OR_RETURN(tok->chat_template, ChatTemplateField(tc["chat_template"], path));
    }
    return Status::Ok();
  } catch (const json::exception& e) {
    return Status::Corruption(dir + ": tokenizer configuration: unexpected JSON structure: " + e.what());
  }
}

Result<TokenizerData> ReadHfTokenizer(const std::string& dir) {
  const std::string spm_path = dir + "/tokenizer.model";
  const std::string json_path = dir + "/tokenizer.json";
  TokenizerData tok;
  if (FileExists(spm_path)) {
    NF_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, ReadWholeFile(spm_path));
    NF_ASSIGN_OR_RETURN(tok, ParseSentencePieceModel(bytes, spm_path));
    // added_tokens.json (token -> id) extends a SentencePiece vocabulary, e.g. chat tokens appended after training.
    NF_ASSIGN_OR_RETURN(std::string added_text, ReadOptionalText(dir + "/added_tokens.json"));
    if (!added_text.empty()) {
      NF_ASSIGN_OR_RETURN(json added, ParseJson(added_text, dir + "/added_tokens.json"));
      std::map<int64_t, std::string> extra;
      if (added.is_object()) {
        for (auto it = added.begin(); it != added.end(); ++it) {
          if (it.value().is_number_integer()) extra[it.value().get<int64_t>()] = it.key();
        }
      }
      for (const auto& [id, text] : extra) {
        if (id < static_cast<int64_t>(tok.tokens.size())) continue;  // already a piece
        if (id != static_cast<int64_t>(tok.tokens.size())) {
          return Status::Corruption(dir + "/added_tokens.json: token \"" + text + "\" has id " + std::to_string(id) +
                                    ", expected the next id " + std::to_string(tok.tokens.size()));
        }
        tok.tokens.push_back(text);
        tok.scores.push_back(0.0f);
        tok.token_types.push_back(kTypeUserDefined);
      }
    }
  } else if (FileExists(json_path)) {
    NF_ASSIGN_OR_RETURN(std::string text, ReadOptionalText(json_path));
    NF_ASSIGN_OR_RETURN(tok, ParseTokenizerJson(text, json_path));
  } else {
    return Status::NotFound(dir + ": no tokenizer: neither tokenizer.model nor tokenizer.json exists");
  }
  NF_ASSIGN_OR_RETURN(std::string tc_text, ReadOptionalText(dir + "/tokenizer_config.json"));
  NF_ASSIGN_OR_RETURN(std::string config_text, ReadOptionalText(dir + "/config.json"));
  NF_RETURN_IF_ERROR(ApplyTokenizerConfig(tc_text, config_text, dir, &tok));
  // Newer transformers save the template beside the tokenizer config: chat_template.jinja (the source) or
  // chat_template.json ({"chat_template": ...}).
  if (tok.chat_template.empty()) {
    NF_ASSIGN_OR_RETURN(tok.chat_template, ReadOptionalText(dir + "/chat_template.jinja"));
  }
  if (tok.chat_template.empty()) {
    const std::string path = dir + "/chat_template.json";
    NF_ASSIGN_OR_RETURN(std::string text, ReadOptionalText(path));
    if (!text.empty()) {
      NF_ASSIGN_OR_RETURN(json doc, ParseJson(text, path));
      if (!doc.is_object() || !doc.contains("chat_template")) {
        return Status::Corruption(path + ": expected an object with a \"chat_template\" member");
      }
      NF_ASSIGN_OR_RETURN(tok.chat_template, ChatTemplateField(doc["chat_template"], path));
    }
  }
  return tok;
}

}  // namespace nflash::converter
