// Reads llama2.c checkpoints (v0 legacy, v1 "ak42") and tokenizer.bin into the converter's SourceModel.
#include "converter/llama2c_reader.h"

#include <algorithm>
#include <bit>
#include <cctype>
#include <cstring>
#include <filesystem>
#include <memory>
#include <unordered_map>

#include "converter/readers.h"

namespace nflash::converter {
namespace {

static_assert(std::endian::native == std::endian::little, "llama2.c files are little-endian; so is every nflash host");

// A header value above this is not a real model (and keeps every size product far from overflowing u64).
constexpr int64_t kMaxDimension = int64_t{1} << 24;
// export.py version2_export: int8 Q8_0 weights with fp32 group scales.
constexpr int32_t kLlama2cQuantizedVersion = 2;
// U+2581 LOWER ONE EIGHTH BLOCK: SentencePiece's (and GGUF "llama" vocabularies') spelling of a space.
constexpr const char* kSpmSpace = "\xe2\x96\x81";
// llama.cpp token types (llama_token_type).
constexpr int32_t kTokenNormal = 1, kTokenUnknown = 2, kTokenControl = 3, kTokenByte = 6;
// llama2.c's fixed special ids (sentencepiece defaults of the Llama 2 tokenizer it was trained with).
constexpr int32_t kUnkId = 0, kBosId = 1, kEosId = 2;

int32_t LoadI32(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// "<0xAB>" with two upper- or lower-case hex digits: a SentencePiece byte-fallback token.
bool IsByteToken(const std::string& s) {
  if (s.size() != 6 || s.compare(0, 3, "<0x") != 0 || s[5] != '>') return false;
  for (int i = 3; i < 5; ++i) {
    if (!std::isxdigit(static_cast<unsigned char>(s[i]))) return false;
  }
  return true;
}

std::string SpacesToSpm(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    if (c == ' ') {
      out += kSpmSpace;
    } else {
      out += c;
    }
  }
  return out;
}

Status CheckField(const std::string& path, const char* field, int64_t value, bool allow_negative, const char* layout) {
  const int64_t magnitude = allow_negative && value < 0 ? -value : value;
  if (magnitude <= 0) {
    return Status::Corruption(path + ": llama2.c " + layout + " header field " + field + " is " +
                              std::to_string(value) + ", expected a positive value");
  }
  if (magnitude > kMaxDimension) {
    return Status::Corruption(path + ": llama2.c " + layout + " header field " + field + " is " +
                              std::to_string(value) + ", expected at most " + std::to_string(kMaxDimension));
  }
  return Status::Ok();
}

}  // namespace

Result<Llama2cHeader> ReadLlama2cHeader(const ReadableFile& file) {
  const std::string& path = file.Path();
  Llama2cHeader h;
  h.file_bytes = file.Size();
  uint8_t buf[kLlama2cV1HeaderBytes] = {};
  if (file.Size() < kLlama2cV0HeaderBytes) {
    return Status::Corruption(path + ": " + std::to_string(file.Size()) +
                              " bytes is too short for a llama2.c checkpoint (header needs at least " +
                              std::to_string(kLlama2cV0HeaderBytes) + ")");
  }
  const uint64_t head = std::min<uint64_t>(file.Size(), kLlama2cV1HeaderBytes);
  NF_RETURN_IF_ERROR(file.ReadAt(0, head, buf));

  uint32_t magic;
  std::memcpy(&magic, buf, 4);
  const uint8_t* params = buf;
  const char* layout = "v0 (legacy, no 'ak42' magic)";
  if (magic == kLlama2cMagic) {
    if (file.Size() < kLlama2cV1HeaderBytes) {
      return Status::Corruption(path + ": has the llama2.c 'ak42' magic but only " + std::to_string(file.Size()) +
                                " bytes, less than the " + std::to_string(kLlama2cV1HeaderBytes) + "-byte v1 header");
    }
    const int32_t version = LoadI32(buf + 4);
    if (version == kLlama2cQuantizedVersion) {
      return Status::Unsupported(path + ": llama2.c version 2 (int8 Q8_0 export) is not supported; export the model "
                                 "with export.py --version 1 (fp32) or convert from the original checkpoint");
    }
    if (version != 1) {
      return Status::Unsupported(path + ": unknown llama2.c checkpoint version " + std::to_string(version) +
                                 " at offset 4, expected 1 (or a legacy v0 file without magic)");
    }
    h.version = 1;
    h.header_bytes = kLlama2cV1HeaderBytes;
    params = buf + 8;
    layout = "v1";
  } else {
    h.version = 0;
    h.header_bytes = kLlama2cV0HeaderBytes;
  }

  const int64_t fields[7] = {LoadI32(params), LoadI32(params + 4), LoadI32(params + 8), LoadI32(params + 12),
                             LoadI32(params + 16), LoadI32(params + 20), LoadI32(params + 24)};
  static const char* kNames[7] = {"dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len"};
  for (int i = 0; i < 7; ++i) {
    // Only the v0 vocab_size carries a sign (negative: separate classifier).
    NF_RETURN_IF_ERROR(CheckField(path, kNames[i], fields[i], h.version == 0 && i == 5, layout));
  }
  h.dim = fields[0];
  h.hidden_dim = fields[1];
  h.n_layers = fields[2];
  h.n_heads = fields[3];
  h.n_kv_heads = fields[4];
  h.vocab_size = fields[5] < 0 ? -fields[5] : fields[5];
  h.seq_len = fields[6];
  h.shared_classifier = h.version == 0 ? fields[5] > 0 : buf[36] != 0;

  if (h.dim % h.n_heads != 0) {
    return Status::Corruption(path + ": llama2.c header: dim " + std::to_string(h.dim) +
                              " is not a multiple of n_heads " + std::to_string(h.n_heads));
  }
  if (h.n_kv_heads > h.n_heads || h.n_heads % h.n_kv_heads != 0) {
    return Status::Corruption(path + ": llama2.c header: n_heads " + std::to_string(h.n_heads) +
                              " is not a multiple of n_kv_heads " + std::to_string(h.n_kv_heads));
  }
  if (h.head_size() % 2 != 0) {
    return Status::Corruption(path + ": llama2.c header: head size dim/n_heads = " + std::to_string(h.head_size()) +
                              " is odd; RoPE rotates pairs and needs an even head size");
  }
  // The size grows linearly with n_layers: computed from the layouts of 0 and 1 layers, so a corrupt header's 2^24
  // layers cost nothing before the size check (the full layout would be 150 million entries). kMaxDimension bounds
  // every field by 2^24: one tensor is at most 2^50 bytes, but the file could reach 2^78, so 128-bit arithmetic and
  // sizes that do not fit in u64 rejected.
  auto end_with_layers = [&](int64_t n_layers) {
    Llama2cHeader one = h;
    one.n_layers = n_layers;
    unsigned __int128 end = h.header_bytes;
    for (const Llama2cTensor& t : Llama2cLayout(one)) {
      end = static_cast<unsigned __int128>(t.offset) + static_cast<unsigned __int128>(t.n_elements) * 4;
    }
    return end;
  };
  const unsigned __int128 base = end_with_layers(0);
  const unsigned __int128 total = base + static_cast<unsigned __int128>(h.n_layers) * (end_with_layers(1) - base);
  if (total > UINT64_MAX) {
    return Status::Corruption(path + ": llama2.c header (dim " + std::to_string(h.dim) + ", hidden_dim " +
                              std::to_string(h.hidden_dim) + ", n_layers " + std::to_string(h.n_layers) +
                              ", vocab_size " + std::to_string(h.vocab_size) +
                              ") implies a file larger than 2^64 bytes");
  }
  h.expected_file_bytes = static_cast<uint64_t>(total);
  return h;
}

std::vector<Llama2cTensor> Llama2cLayout(const Llama2cHeader& h) {
  std::vector<Llama2cTensor> out;
  // Products use 128-bit arithmetic: ReadLlama2cHeader checks the final size fits; before that check, wrapped values
  // must not be produced silently.
  uint64_t offset = h.header_bytes;
  const uint64_t dim = h.dim, hidden = h.hidden_dim, vocab = h.vocab_size, kv_dim = h.kv_dim();
  auto add = [&](std::string name, std::string source_name, std::vector<uint64_t> dims) {
    unsigned __int128 n = 1;
    for (uint64_t d : dims) n *= d;
    const uint64_t n64 = n > UINT64_MAX / 4 ? UINT64_MAX / 4 : static_cast<uint64_t>(n);
    out.push_back({std::move(name), std::move(source_name), std::move(dims), offset, n64});
    const unsigned __int128 next = static_cast<unsigned __int128>(offset) + static_cast<unsigned __int128>(n64) * 4;
    offset = next > UINT64_MAX ? UINT64_MAX : static_cast<uint64_t>(next);
  };
  auto per_layer = [&](const char* gguf, const char* src, std::vector<uint64_t> dims) {
    for (int64_t l = 0; l < h.n_layers; ++l) {
      add("blk." + std::to_string(l) + "." + gguf + ".weight", std::string(src) + "[" + std::to_string(l) + "]", dims);
    }
  };
  // GGUF dims are {row length, rows}: llama2.c's [out][in] matrices keep their bytes, dims just list in first.
  if (h.version == 0) {
    add("token_embd.weight", "token_embedding_table", {dim, vocab});
    per_layer("attn_norm", "rms_att_weight", {dim});
    per_layer("attn_q", "wq", {dim, dim});
    per_layer("attn_k", "wk", {dim, kv_dim});
    per_layer("attn_v", "wv", {dim, kv_dim});
    per_layer("attn_output", "wo", {dim, dim});
    per_layer("ffn_norm", "rms_ffn_weight", {dim});
    per_layer("ffn_gate", "w1", {dim, hidden});
    per_layer("ffn_down", "w2", {hidden, dim});
    per_layer("ffn_up", "w3", {dim, hidden});
    add("output_norm.weight", "rms_final_weight", {dim});
    // Precomputed RoPE tables: nflash recomputes RoPE, so these are skipped (empty gguf name).
    add("", "freq_cis_real", {static_cast<uint64_t>(h.head_size() / 2), static_cast<uint64_t>(h.seq_len)});
    add("", "freq_cis_imag", {static_cast<uint64_t>(h.head_size() / 2), static_cast<uint64_t>(h.seq_len)});
  } else {
    per_layer("attn_norm", "rms_att_weight", {dim});
    per_layer("ffn_norm", "rms_ffn_weight", {dim});
    add("output_norm.weight", "rms_final_weight", {dim});
    add("token_embd.weight", "token_embedding_table", {dim, vocab});
    per_layer("attn_q", "wq", {dim, dim});
    per_layer("attn_k", "wk", {dim, kv_dim});
    per_layer("attn_v", "wv", {dim, kv_dim});
    per_layer("attn_output", "wo", {dim, dim});
    per_layer("ffn_gate", "w1", {dim, hidden});
    per_layer("ffn_down", "w2", {hidden, dim});
    per_layer("ffn_up", "w3", {dim, hidden});
  }
  if (!h.shared_classifier) add("output.weight", "wcls", {dim, vocab});
  return out;
}

Result<TokenizerData> ReadLlama2cTokenizer(const std::string& path, int64_t n_vocab) {
  NF_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file, OpenPreadFile(path));
  const uint64_t size = file->Size();
  if (size < 4) {
    return Status::Corruption(path + ": " + std::to_string(size) +
                              " bytes is too short for a llama2.c tokenizer (int32 max_token_length expected)");
  }
  std::vector<uint8_t> bytes(size);
  NF_RETURN_IF_ERROR(file->ReadAt(0, size, bytes.data()));
  const int32_t max_len = LoadI32(bytes.data());
  if (max_len <= 0) {
    return Status::Corruption(path + ": llama2.c tokenizer max_token_length at offset 0 is " +
                              std::to_string(max_len) + ", expected a positive value");
  }

  TokenizerData tok;
  tok.model = "llama";
  tok.bos_id = kBosId;
  tok.eos_id = kEosId;
  tok.unk_id = kUnkId;
  tok.add_bos = true;
  tok.add_eos = false;
  uint64_t off = 4;
  for (int64_t id = 0; n_vocab > 0 ? id < n_vocab : off < size; ++id) {
    if (size - off < 8) {
      return Status::Corruption(path + ": llama2.c tokenizer ends at offset " + std::to_string(off) + " inside token " +
                                std::to_string(id) + "'s score/length" +
                                (n_vocab > 0 ? " (the model's vocab_size is " + std::to_string(n_vocab) + ")" : ""));
    }
    float score;
    std::memcpy(&score, bytes.data() + off, 4);
    const int32_t len = LoadI32(bytes.data() + off + 4);
    if (len < 0 || static_cast<uint64_t>(len) > size - off - 8) {
      return Status::Corruption(path + ": llama2.c tokenizer token " + std::to_string(id) + " at offset " +
                                std::to_string(off + 4) + " has length " + std::to_string(len) + ", but " +
                                std::to_string(size - off - 8) + " bytes remain");
    }
    std::string text(reinterpret_cast<const char*>(bytes.data() + off + 8), static_cast<size_t>(len));
    off += 8 + static_cast<uint64_t>(len);

    // Types and spellings as llama.cpp's convert-llama2c-to-ggml: llama2.c stores BOS/EOS as "\n<s>\n".
    int32_t type = kTokenNormal;
    if (id == kUnkId) {
      text = "<unk>";
      type = kTokenUnknown;
    } else if (id == kBosId) {
      text = "<s>";
      type = kTokenControl;
    } else if (id == kEosId) {
      text = "</s>";
      type = kTokenControl;
    } else if (text.empty()) {
      type = kTokenControl;
    } else if (IsByteToken(text)) {
      type = kTokenByte;
    }
    tok.tokens.push_back(SpacesToSpm(text));
    tok.scores.push_back(score);
    tok.token_types.push_back(type);
  }
  if (off != size) {
    return Status::Corruption(path + ": llama2.c tokenizer has " + std::to_string(size - off) +
                              " bytes after token " + std::to_string(tok.tokens.size() - 1) + " (offset " +
                              std::to_string(off) + "): it holds more tokens than the model's vocab_size " +
                              std::to_string(n_vocab) + "; is it the tokenizer of another model?");
  }
  if (tok.tokens.size() <= static_cast<size_t>(kEosId)) {
    return Status::Corruption(path + ": llama2.c tokenizer has " + std::to_string(tok.tokens.size()) +
                              " tokens; at least <unk>, <s>, </s> are required");
  }
  return tok;
}

// llama2.c keeps its tokenizer beside the checkpoint: tokenizer.bin, or tok<N>.bin for the custom-vocabulary models.
Result<std::string> FindLlama2cTokenizer(const std::string& checkpoint) {
  namespace fs = std::filesystem;
  // llama2.c keeps its tokenizer beside the checkpoint: tokenizer.bin, or tok<N>.bin for custom vocabularies.
  const fs::path parent = fs::path(checkpoint).parent_path();
  const fs::path dir = parent.empty() ? fs::path(".") : parent;
  if (fs::exists(dir / "tokenizer.bin")) return (dir / "tokenizer.bin").string();
  std::vector<std::string> candidates;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (e.is_regular_file() && name.starts_with("tok") && name.ends_with(".bin") &&
        !fs::equivalent(e.path(), checkpoint, ec)) {
      candidates.push_back(e.path().string());
    }
  }
  std::sort(candidates.begin(), candidates.end());
  if (candidates.empty()) {
    return Status::InvalidArgument("missing tokenizer: pass --tokenizer (no tokenizer.bin or tok*.bin next to " +
                                   checkpoint + ")");
  }
  if (candidates.size() > 1) {
    return Status::InvalidArgument("ambiguous tokenizer: " + std::to_string(candidates.size()) +
                                   " tok*.bin files in " + dir.string() + "; pass --tokenizer");
  }
  return candidates.front();
}

Result<SourceModel> ReadLlama2c(const std::string& path, const std::string& tokenizer_path, FfnActivation activation) {
  NF_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> opened, OpenPreadFile(path));
  std::shared_ptr<const ReadableFile> file(std::move(opened));
  NF_ASSIGN_OR_RETURN(Llama2cHeader h, ReadLlama2cHeader(*file));
  if (h.file_bytes != h.expected_file_bytes) {
    return Status::Corruption(path + ": llama2.c v" + std::to_string(h.version) + " header (dim " +
                              std::to_string(h.dim) + ", hidden_dim " + std::to_string(h.hidden_dim) + ", n_layers " +
                              std::to_string(h.n_layers) + ", vocab_size " + std::to_string(h.vocab_size) +
                              (h.shared_classifier ? ", shared classifier" : ", separate classifier") +
                              ") implies " + std::to_string(h.expected_file_bytes) + " bytes, found " +
                              std::to_string(h.file_bytes));
  }

  SourceModel model;
  model.source_path = path;
  model.source_format = h.version == 0 ? "llama2c-v0" : "llama2c-v1";
  ModelConfig& c = model.config;
  c.name = std::filesystem::path(path).stem().string();
  c.n_vocab = h.vocab_size;
  c.dim = h.dim;
  c.n_layers = h.n_layers;
  c.n_ff = h.hidden_dim;
  c.n_heads = h.n_heads;
  c.n_kv_heads = h.n_kv_heads;
  c.context_length = h.seq_len;
  // llama2.c's run.c hard-codes both (RoPE base 10000, RMSNorm eps 1e-5).
  c.rope_theta = 10000.0f;
  c.norm_eps = 1e-5f;
  c.activation = activation;
  c.tied_embeddings = h.shared_classifier;

  NF_ASSIGN_OR_RETURN(model.tokenizer, ReadLlama2cTokenizer(tokenizer_path, h.vocab_size));

  // Tensors in llama.cpp's usual order (embedding, each layer's attention then FFN, final norm, head), whatever the
  // file order, so v0 and v1 files of one model give identical GGUF files.
  std::vector<Llama2cTensor> layout = Llama2cLayout(h);
  std::vector<std::string> order = {"token_embd.weight"};
  for (int64_t l = 0; l < h.n_layers; ++l) {
    for (const char* part : {"attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate",
                             "ffn_down", "ffn_up"}) {
      order.push_back("blk." + std::to_string(l) + "." + part + ".weight");
    }
  }
  order.push_back("output_norm.weight");
  order.push_back("output.weight");
  std::unordered_map<std::string, size_t> rank;
  for (size_t i = 0; i < order.size(); ++i) rank.emplace(order[i], i);
  std::erase_if(layout, [](const Llama2cTensor& t) { return t.name.empty(); });
  std::stable_sort(layout.begin(), layout.end(), [&rank](const Llama2cTensor& a, const Llama2cTensor& b) {
    return rank.at(a.name) < rank.at(b.name);
  });
  for (const Llama2cTensor& t : layout) {
    SourceTensor st;
    st.name = t.name;
    st.dims = t.dims;
    st.source_type = GgmlType::kF32;
    const uint64_t offset = t.offset, n = t.n_elements;
    const std::string name = t.name;
    st.load_f32 = [file, offset, n, name]() -> Result<std::vector<float>> {
      std::vector<float> v(n);
      Status s = file->ReadAt(offset, n * sizeof(float), v.data());
      if (!s.ok()) return s.WithContext("tensor " + name);
      return v;
    };
    st.load_raw = [file, offset, n, name]() -> Result<std::vector<uint8_t>> {
      std::vector<uint8_t> v(n * sizeof(float));
      Status s = file->ReadAt(offset, v.size(), v.data());
      if (!s.ok()) return s.WithContext("tensor " + name);
      return v;
    };
    model.tensors.push_back(std::move(st));
  }
  return model;
}

}  // namespace nflash::converter
