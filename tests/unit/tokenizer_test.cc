// Tokenizers: llama.cpp's published SPM test vectors, the llama2.c tokenizer against run.c's algorithm and the
// stories260K golden ids, streaming UTF-8 detokenization, hand-built byte-level BPE cases, and loader errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "converter/llama2c_reader.h"
#include "runtime/core/gguf.h"
#include "runtime/text/tokenizer.h"
#include "runtime/text/tokenizer_internal.h"
#include "tests/test_util.h"

namespace nflash {
namespace {

using nflash::testing::SharedPath;
using nflash::testing::TempDir;
using text_internal::PreTokenize;
using text_internal::PreTokenizer;

// The tokenizer the runtime gets for a llama2.c model: the converter's reading of tokenizer.bin, carried over field
// for field as a GGUF file carries it (tokens, scores, types, special ids, add_bos).
Result<std::unique_ptr<Tokenizer>> LoadLlama2cTokenizer(const std::string& path, int64_t n_vocab = 512) {
  NF_ASSIGN_OR_RETURN(converter::TokenizerData t, converter::ReadLlama2cTokenizer(path, n_vocab));
  VocabData v;
  v.model = t.model;
  v.tokens = t.tokens;
  v.scores = t.scores;
  for (int32_t type : t.token_types) v.types.push_back(static_cast<TokenType>(type));
  v.bos_id = t.bos_id;
  v.eos_id = t.eos_id;
  v.unk_id = t.unk_id;
  v.add_bos = t.add_bos.value_or(true);
  v.source = path;
  return MakeTokenizer(std::move(v));
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << "cannot open " << path;
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::string Ids(const std::vector<int32_t>& ids) {
  std::string s = "[";
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? ", " : "") + std::to_string(ids[i]);
  return s + "]";
}

std::unique_ptr<Tokenizer> LoadGgufTokenizer(const std::string& path) {
  auto f = GgufFile::OpenPath(path);
  EXPECT_TRUE(f.ok()) << f.status().ToString();
  if (!f.ok()) return nullptr;
  auto t = LoadTokenizer(*f);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() ? std::move(t).value() : nullptr;
}

// llama.cpp tests/test-tokenizer-0.cpp: the .inp strings are separated by "\n__ggml_vocab_test__\n" (so a string's
// own trailing newlines are kept), .out has one line of space-separated ids per string, encoded without BOS.
void CheckVocabVectors(const std::string& vocab_file) {
  std::unique_ptr<Tokenizer> tok = LoadGgufTokenizer(SharedPath(vocab_file));
  ASSERT_NE(tok, nullptr);
  const std::string raw = ReadAll(SharedPath(vocab_file + ".inp"));
  const std::string sep = "\n__ggml_vocab_test__\n";
  std::vector<std::string> inputs;
  for (size_t pos = 0; pos < raw.size();) {
    const size_t next = raw.find(sep, pos);
    if (next == std::string::npos) {
      inputs.push_back(raw.substr(pos));
      break;
    }
    inputs.push_back(raw.substr(pos, next - pos));
    pos = next + sep.size();
  }
  std::vector<std::vector<int32_t>> expected;
  std::istringstream out(ReadAll(SharedPath(vocab_file + ".out")));
  for (std::string line; std::getline(out, line);) {
    std::istringstream ls(line);
    std::vector<int32_t> ids;
    for (int32_t id; ls >> id;) ids.push_back(id);
    expected.push_back(ids);
  }
  ASSERT_EQ(inputs.size(), expected.size()) << "test strings and id lines differ in number";
  ASSERT_GE(inputs.size(), 30u);
  int failed = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const std::vector<int32_t> got = tok->Encode(inputs[i], /*add_bos=*/false);
    if (got != expected[i]) {
      ++failed;
      ADD_FAILURE() << vocab_file << " case " << i << ": \"" << inputs[i] << "\"\n  expected " << Ids(expected[i])
                    << "\n  got      " << Ids(got);
    }
    // Decoding what the reference produced gives the text back (byte fallback keeps every byte).
    EXPECT_EQ(tok->Decode(expected[i]), inputs[i]) << vocab_file << " case " << i;
  }
  std::printf("%s: %zu cases, %d failed\n", vocab_file.c_str(), inputs.size(), failed);
}

TEST(TokenizerVocab, LlamaSpm) { CheckVocabVectors("models/vocab/ggml-vocab-llama-spm.gguf"); }

// A tokenizer's heap estimate (what the offloaded runtime counts in its memory budget) against the allocator's own
// count of what building it kept (testing::HeapInUse): llama's SPM vocabulary from ../shared (32000 tokens, read from
// its GGUF); a BPE one below (BpeTokenizer.HeapEstimateMatchesTheAllocator).
TEST(SpmTokenizer, HeapEstimateMatchesTheAllocator) {
  auto file = GgufFile::OpenPathUncached(testing::SharedPath("models/vocab/ggml-vocab-llama-spm.gguf"));
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  const size_t before = testing::HeapInUse();
  auto spm = LoadTokenizer(*file);
  const size_t after = testing::HeapInUse();
  ASSERT_TRUE(spm.ok()) << spm.status().ToString();
  ASSERT_EQ((*spm)->n_vocab(), 32000);
  const double held = static_cast<double>(after - before), estimate = static_cast<double>((*spm)->HeapBytes());
  std::printf("SPM tokenizer heap: estimate %.0f, allocator %.0f bytes\n", estimate, held);
  EXPECT_GT(estimate, testing::kHeapEstimateLow * held);
  EXPECT_LT(estimate, testing::kHeapEstimateHigh * held);
}

TEST(SpmTokenizer, SpecialTokensOnlyWhenParsed) {
  std::unique_ptr<Tokenizer> tok = LoadGgufTokenizer(SharedPath("models/vocab/ggml-vocab-llama-spm.gguf"));
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->model(), "llama");
  EXPECT_EQ(tok->n_vocab(), 32000);
  EXPECT_EQ(tok->bos_id(), 1);
  EXPECT_EQ(tok->eos_id(), 2);
  EXPECT_TRUE(tok->add_bos());
  // "Hello" is 15043 with the space prefix (test vector " Hello" / "Hello"): after a parsed <s> the prefix applies.
  EXPECT_EQ(tok->Encode("Hello", true), (std::vector<int32_t>{1, 15043}));
  EXPECT_EQ(tok->Encode("<s>Hello", false, /*parse_special=*/true), (std::vector<int32_t>{1, 15043}));
  const std::vector<int32_t> spelled = tok->Encode("<s>Hello", false);
  EXPECT_EQ(std::count(spelled.begin(), spelled.end(), 1), 0) << Ids(spelled);
  EXPECT_EQ(tok->Decode(spelled), "<s>Hello");
  // The unknown token's text too, as llama.cpp's tokenizer_st_partition matches control and unknown tokens only with
  // parse_special (user-defined ones always).
  EXPECT_EQ(tok->Encode("<unk>Hello", false, /*parse_special=*/true), (std::vector<int32_t>{0, 15043}));
  const std::vector<int32_t> unk_spelled = tok->Encode("<unk>Hello", false);
  EXPECT_EQ(std::count(unk_spelled.begin(), unk_spelled.end(), 0), 0) << Ids(unk_spelled);
  EXPECT_EQ(tok->Decode(std::vector<int32_t>{1, 15043, 2}), "Hello");
  EXPECT_EQ(tok->Decode(std::vector<int32_t>{1, 15043, 2}, /*render_special=*/true), "<s>Hello</s>");
  EXPECT_EQ(tok->Encode("", true), (std::vector<int32_t>{1}));
  EXPECT_TRUE(tok->Encode("", false).empty());
}

// A vocabulary broken in one field is refused with that field's own message (ValidateVocab, run by every tokenizer).
TEST(TokenizerVocab, EachInconsistentFieldIsNamed) {
  auto base = [] {
    VocabData v;
    v.model = "llama";
    v.source = "v.gguf";
    v.tokens = {"<unk>", "<s>", "</s>", "a", "<0x41>"};
    v.scores = {0, 0, 0, -1, -2};
    v.types = {TokenType::kUnknown, TokenType::kControl, TokenType::kControl, TokenType::kNormal, TokenType::kByte};
    v.unk_id = 0;
    v.bos_id = 1;
    v.eos_id = 2;
    return v;
  };
  ASSERT_TRUE(MakeTokenizer(base()).ok());
  struct Case {
    const char* what;
    std::function<void(VocabData&)> change;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"no tokens", [](VocabData& v) { v.tokens.clear(), v.scores.clear(), v.types.clear(); },
       "tokenizer.ggml.tokens is empty"},
      {"scores short", [](VocabData& v) { v.scores.pop_back(); }, "tokenizer.ggml.scores has 4 entries"},
      {"types short", [](VocabData& v) { v.types.pop_back(); }, "tokenizer.ggml.token_type has 4 entries"},
      {"type 7", [](VocabData& v) { v.types[3] = static_cast<TokenType>(7); },
       "tokenizer.ggml.token_type[3] is 7, expected 0..6"},
      {"byte type on a normal spelling", [](VocabData& v) { v.types[3] = TokenType::kByte; },
       "tokenizer.ggml.tokens[3] is \"a\" but tokenizer.ggml.token_type marks it a byte token"},
      {"bos past the vocabulary", [](VocabData& v) { v.bos_id = 5; },
       "tokenizer.ggml.bos_token_id is 5, expected an id below 5"},
      {"eot past the vocabulary", [](VocabData& v) { v.eot_id = 7; },
       "tokenizer.ggml.eot_token_id is 7, expected an id below 5"},
      {"eom below -1", [](VocabData& v) { v.eom_id = -2; }, "tokenizer.ggml.eom_token_id is -2"},
  };
  for (const Case& c : cases) {
    VocabData v = base();
    c.change(v);
    auto tok = MakeTokenizer(std::move(v));
    ASSERT_FALSE(tok.ok()) << c.what;
    EXPECT_EQ(tok.status().code(), StatusCode::kCorruption) << c.what;
    EXPECT_NE(tok.status().message().find(c.message), std::string::npos) << c.what << ": " << tok.status().message();
  }
}

// The tokens that end generation: EOS, the eot and eom ids, and instruct vocabularies' end-of-turn markers when they
// are special (control or user-defined) tokens; a normal token spelled like one is text, and so is a marker with
// another spelling.
TEST(TokenizerVocab, EndOfTurnMarkersEndGeneration) {
  VocabData v;
  v.model = "llama";
  v.source = "v.gguf";
  v.tokens = {"<unk>", "<s>", "</s>", "a", "<|end|>", "<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|END|>", "b"};
  v.scores.assign(v.tokens.size(), 0.0f);
  v.types = {TokenType::kUnknown, TokenType::kControl,     TokenType::kControl, TokenType::kNormal,
             TokenType::kControl, TokenType::kNormal,      TokenType::kUserDefined, TokenType::kControl,
             TokenType::kControl, TokenType::kNormal};
  v.unk_id = 0;
  v.bos_id = 1;
  v.eos_id = 2;
  v.eom_id = 9;
  auto tok = MakeTokenizer(v);
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  EXPECT_EQ((*tok)->end_of_generation_ids(), (std::vector<int32_t>{2, 4, 6, 7, 9}));
  for (int32_t id = 0; id < 10; ++id) {
    const bool ends = id == 2 || id == 4 || id == 6 || id == 7 || id == 9;
    EXPECT_EQ((*tok)->IsEndOfGeneration(id), ends) << v.tokens[id];
  }
  // No markers and no eot: EOS alone (a llama2.c vocabulary).
  auto stories = LoadLlama2cTokenizer(testing::SharedPath("models/stories260K/tok512.bin"));
  ASSERT_TRUE(stories.ok()) << stories.status().ToString();
  EXPECT_EQ((*stories)->end_of_generation_ids(), (std::vector<int32_t>{2}));
  // The eot id from its GGUF key (llama.cpp's), on the shared llama vocabulary.
  testing::TempDir tmp;
  const std::string path = tmp.File("eot.gguf");
  ASSERT_EQ(testing::RewriteGguf(testing::SharedPath("models/vocab/ggml-vocab-llama-spm.gguf"), path,
                                 testing::SetGgufKey("tokenizer.ggml.eot_token_id", GgufValue(uint32_t{13})), nullptr),
            "");
  auto file = GgufFile::OpenPath(path);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  auto eot = LoadTokenizer(*file);
  ASSERT_TRUE(eot.ok()) << eot.status().ToString();
  EXPECT_TRUE((*eot)->IsEndOfGeneration(13));
  EXPECT_TRUE((*eot)->IsEndOfGeneration((*eot)->eos_id()));
  EXPECT_FALSE((*eot)->IsEndOfGeneration(14));
}

// The GGUF reader's own checks, on the shared llama vocabulary with one key changed (testing::RewriteGguf).
TEST(TokenizerVocab, GgufKeysOfTheWrongKindAreNamed) {
  TempDir dir;
  const std::string good = SharedPath("models/vocab/ggml-vocab-llama-spm.gguf");
  using testing::EditGgufKey;
  struct Case {
    const char* what;
    testing::GgufKvEdit edit;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"tokens as numbers",
       EditGgufKey("tokenizer.ggml.tokens", [](GgufValue& v) { v = GgufArray{GgufType::kInt32, {int32_t{1}}}; }),
       "tokenizer.ggml.tokens is an array of int32, expected an array of string"},
      {"a score as text",
       EditGgufKey("tokenizer.ggml.scores",
                [](GgufValue& v) { std::get<GgufArray>(v.v) = GgufArray{GgufType::kString, {std::string("x")}}; }),
       "tokenizer.ggml.scores[0] has type string, expected a number"},
      {"a fractional token type",
       EditGgufKey("tokenizer.ggml.token_type",
                [](GgufValue& v) { std::get<GgufArray>(v.v) = GgufArray{GgufType::kFloat32, {1.5f}}; }),
       "tokenizer.ggml.token_type[0] is 1.500000, expected an integer 0..6"},
      {"bos beyond int32", EditGgufKey("tokenizer.ggml.bos_token_id", [](GgufValue& v) { v = int64_t{1} << 40; }),
       "tokenizer.ggml.bos_token_id is 1099511627776, expected a token id"},
  };
  for (const Case& c : cases) {
    const std::string bad = dir.File("bad.gguf");
    ASSERT_EQ(testing::RewriteGguf(good, bad, c.edit, nullptr), "") << c.what;
    auto f = GgufFile::OpenPath(bad);
    ASSERT_TRUE(f.ok()) << c.what << ": " << f.status().ToString();
    auto v = ReadGgufVocab(*f);
    ASSERT_FALSE(v.ok()) << c.what;
    EXPECT_NE(v.status().message().find(c.message), std::string::npos) << c.what << ": " << v.status().message();
  }
}

// SentencePiece never spells a control token out of text, even when the merges could build it: here "<" + "s" makes
// the normal piece "<s", and "<s" + ">" would be the control token <s> (id 1), which must stay two pieces.
TEST(SpmTokenizer, MergesNeverProduceAControlToken) {
  VocabData v;
  v.model = "llama";
  v.tokens = {"<unk>", "<s>", "</s>", "<", "s", ">", "<s"};
  v.scores = {0, 0, 0, -3, -3, -3, -1};
  v.types = {TokenType::kUnknown, TokenType::kControl, TokenType::kControl, TokenType::kNormal,
             TokenType::kNormal,  TokenType::kNormal,  TokenType::kNormal};
  v.unk_id = 0;
  v.bos_id = 1;
  v.eos_id = 2;
  v.add_space_prefix = false;
  auto tok = MakeTokenizer(v);
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  EXPECT_EQ((*tok)->Encode("<s>", false), (std::vector<int32_t>{6, 5}));
  EXPECT_EQ((*tok)->Encode("<s>", false, /*parse_special=*/true), (std::vector<int32_t>{1}));
}

// Random valid UTF-8 (ASCII, Latin, Cyrillic, CJK, emoji, spaces, newlines) survives encode + decode.
std::string RandomUtf8(std::mt19937& rng, int n_chars) {
  static constexpr uint32_t kPool[][2] = {{0x20, 0x7E}, {0x20, 0x20}, {0x0A, 0x0A}, {0xA0, 0x17F}, {0x400, 0x4FF},
                                          {0x4E00, 0x9FFF}, {0x1F300, 0x1F64F}, {0x3000, 0x303F}};
  std::string s;
  for (int i = 0; i < n_chars; ++i) {
    const auto& r = kPool[rng() % std::size(kPool)];
    text_internal::AppendUtf8(r[0] + rng() % (r[1] - r[0] + 1), &s);
  }
  return s;
}

TEST(SpmTokenizer, RoundTripsArbitraryUtf8) {
  std::unique_ptr<Tokenizer> tok = LoadGgufTokenizer(SharedPath("models/vocab/ggml-vocab-llama-spm.gguf"));
  ASSERT_NE(tok, nullptr);
  std::mt19937 rng(7);
  for (int i = 0; i < 200; ++i) {
    const std::string s = RandomUtf8(rng, 1 + static_cast<int>(rng() % 40));
    EXPECT_EQ(tok->Decode(tok->Encode(s, true)), s);
  }
}

// ----- llama2.c tokenizer.bin -------------------------------------------------------------------------------------

// llama2.c run.c encode() written out directly from its description: dummy-prefix " ", one id per UTF-8 character
// (bytes + 3 when the character is not a piece), then repeatedly merge the adjacent pair with the highest score
// (strictly greater wins, so the leftmost of equal scores), scanning the whole sequence each time (O(n^2)).
std::vector<int32_t> RunCEncode(const std::string& file, const std::string& text) {
  std::vector<std::string> pieces;
  std::vector<float> scores;
  const std::string bytes = ReadAll(file);
  for (size_t off = 4; off + 8 <= bytes.size();) {
    float score;
    int32_t len;
    std::memcpy(&score, bytes.data() + off, 4);
    std::memcpy(&len, bytes.data() + off + 4, 4);
    pieces.push_back(bytes.substr(off + 8, static_cast<size_t>(len)));
    scores.push_back(score);
    off += 8 + static_cast<size_t>(len);
  }
  std::map<std::string, int32_t> lookup;
  for (size_t i = 0; i < pieces.size(); ++i) lookup.emplace(pieces[i], static_cast<int32_t>(i));
  std::vector<int32_t> ids = {1};  // BOS
  if (!text.empty()) ids.push_back(lookup.at(" "));
  for (size_t i = 0; i < text.size();) {
    size_t n = 1;
    while (i + n < text.size() && (static_cast<uint8_t>(text[i + n]) & 0xC0) == 0x80 && n < 4) ++n;
    auto it = lookup.find(text.substr(i, n));
    if (it != lookup.end()) {
      ids.push_back(it->second);
    } else {
      for (size_t k = 0; k < n; ++k) ids.push_back(static_cast<uint8_t>(text[i + k]) + 3);
    }
    i += n;
  }
  while (true) {
    float best = -1e10f;
    int best_id = -1;
    size_t best_i = 0;
    for (size_t i = 1; i + 1 < ids.size(); ++i) {
      auto it = lookup.find(pieces[ids[i]] + pieces[ids[i + 1]]);
      if (it != lookup.end() && scores[it->second] > best) {
        best = scores[it->second];
        best_id = it->second;
        best_i = i;
      }
    }
    if (best_id < 0) break;
    ids[best_i] = best_id;
    ids.erase(ids.begin() + static_cast<std::ptrdiff_t>(best_i) + 1);
  }
  return ids;
}

TEST(Llama2cTokenizer, EncodesLikeRunC) {
  const std::string path = SharedPath("models/stories260K/tok512.bin");
  auto tok = LoadLlama2cTokenizer(path, 512);
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  // The golden prompt of ../shared/models/stories260K-relu/README.md.
  EXPECT_EQ((*tok)->Encode("Once upon a time", true), (std::vector<int32_t>{1, 403, 407, 261, 378}));
  EXPECT_EQ(RunCEncode(path, "Once upon a time"), (std::vector<int32_t>{1, 403, 407, 261, 378}));
  // A stretch of real text (with quotes, apostrophes, newlines and some mojibake) id for id.
  const std::string text = ReadAll(SharedPath("text/tinystories_cased_197K.txt"));
  for (size_t start : {size_t{0}, size_t{50000}, size_t{120000}}) {
    size_t s = start;
    while (s < text.size() && (static_cast<uint8_t>(text[s]) & 0xC0) == 0x80) ++s;  // start on a character
    size_t e = std::min(text.size(), s + 2500);
    while (e < text.size() && (static_cast<uint8_t>(text[e]) & 0xC0) == 0x80) ++e;
    const std::string chunk = text.substr(s, e - s);
    EXPECT_EQ((*tok)->Encode(chunk, true), RunCEncode(path, chunk)) << "chunk at " << s;
  }
}

TEST(Llama2cTokenizer, WholeFileTokenCountMatchesReference) {
  // ../shared/models/stories260K/README.md: BOS + encode(whole file) is 100,708 ids (an independent implementation).
  auto tok = LoadLlama2cTokenizer(SharedPath("models/stories260K/tok512.bin"));
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  const std::string text = ReadAll(SharedPath("text/tinystories_cased_197K.txt"));
  EXPECT_EQ((*tok)->Encode(text, true).size(), 100708u);
}

TEST(Llama2cTokenizer, DecodesGoldenSample) {
  auto tok = LoadLlama2cTokenizer(SharedPath("models/stories260K/tok512.bin"));
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  // stories260K-relu README: prompt + the first 100 greedy ids and their published decoding.
  const std::vector<int32_t> ids = {
      1,   403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337,
      335, 311, 267, 422, 419, 269, 344, 444, 427, 421, 414, 276, 265, 263, 304, 341, 426, 385, 328, 432, 358,
      263, 377, 267, 265, 282, 295, 433, 335, 311, 357, 343, 426, 338, 394, 261, 370, 268, 414, 444, 269, 391,
      266, 267, 337, 335, 312, 426, 13,  13,  438, 310, 439, 419, 357, 343, 336, 432, 313, 438, 316, 439, 419,
      298, 414, 267, 265, 282, 295, 433, 432, 317, 426, 410, 448, 411, 280, 303, 281, 421, 427, 265, 268, 414};
  EXPECT_EQ((*tok)->Decode(ids),
            "Once upon a time, there was a little girl named Lily. She loved to play with her toys and explore the "
            "world. One day, she went to the park with her mommy. She saw a big box and wanted to play with it.\n\n"
            "Lily's mommy said, \"Let's go to the park, Lily. We can help the bo");
  EXPECT_EQ((*tok)->TokenText(1), "<s>");
  EXPECT_EQ((*tok)->token_type(1), TokenType::kControl);
  EXPECT_EQ((*tok)->token_type(13), TokenType::kByte);  // "<0x0A>"
  EXPECT_EQ((*tok)->TokenText(403), "\xE2\x96\x81Once");  // spaces normalised to U+2581
}

// ----- UTF-8 streaming -------------------------------------------------------------------------------------------

const std::string kFffd = "\xEF\xBF\xBD";

TEST(Utf8Stream, HoldsBackIncompleteAndReplacesInvalid) {
  Utf8Stream u;
  EXPECT_EQ(u.Push("a\xE2\x82"), "a");  // the euro sign's first two bytes wait
  EXPECT_TRUE(u.has_pending());
  EXPECT_EQ(u.Push("\xAC"), "\xE2\x82\xAC");
  EXPECT_EQ(u.Push("\xF0\x9F"), "");
  EXPECT_EQ(u.Finish(), kFffd);  // never completed
  EXPECT_EQ(u.Push("\xC0\xAF"), kFffd + kFffd);                  // overlong lead, stray continuation
  EXPECT_EQ(u.Push("\xED\xA0\x80"), kFffd + kFffd + kFffd);      // a UTF-16 surrogate is not UTF-8
  EXPECT_EQ(u.Push("\xE2\x82x"), kFffd + "x");                   // a truncated sequence then ASCII
  EXPECT_EQ(u.Push("\xF4\x90\x80\x80"), kFffd + kFffd + kFffd + kFffd);  // above U+10FFFF
  EXPECT_EQ(u.Finish(), "");
}

TEST(Detokenizer, ReassemblesByteTokens) {
  std::unique_ptr<Tokenizer> tok = LoadGgufTokenizer(SharedPath("models/vocab/ggml-vocab-llama-spm.gguf"));
  ASSERT_NE(tok, nullptr);
  // Test vector " this is 🦙.cpp": the llama is byte tokens 243 162 169 156 (= bytes F0 9F A6 99, ids byte + 3).
  Detokenizer d(*tok);
  EXPECT_EQ(d.Push(29871), "");  // the lone "▁" is the stripped space prefix
  EXPECT_EQ(d.Push(445), " this");
  EXPECT_EQ(d.Push(243), "");
  EXPECT_EQ(d.Push(162), "");
  EXPECT_EQ(d.Push(169), "");
  EXPECT_EQ(d.Push(156), "\xF0\x9F\xA6\x99");
  EXPECT_EQ(d.Finish(), "");
  Detokenizer cut(*tok);
  EXPECT_EQ(cut.Push(445), "this");
  EXPECT_EQ(cut.Push(243), "");
  EXPECT_EQ(cut.Push(162), "");
  EXPECT_EQ(cut.Finish(), kFffd);
  // An incomplete sequence interrupted by a normal token: U+FFFD, then the token's text.
  EXPECT_EQ(tok->Decode(std::vector<int32_t>{445, 243, 162, 445}), "this" + kFffd + " this");
  // A mid-sequence detokenizer does not strip the leading space.
  Detokenizer mid(*tok, false, /*sequence_start=*/false);
  EXPECT_EQ(mid.Push(445), " this");
}

// ----- byte-level BPE ----------------------------------------------------------------------------------------------

TEST(ByteLevel, ByteToUnicodeIsGpt2Table) {
  EXPECT_EQ(text_internal::ByteToUnicode('a'), "a");
  EXPECT_EQ(text_internal::ByteToUnicode(' '), "\xC4\xA0");   // U+0120 'Ġ' (byte 32 is the 33rd non-printable)
  EXPECT_EQ(text_internal::ByteToUnicode('\n'), "\xC4\x8A");  // U+010A 'Ċ'
  EXPECT_EQ(text_internal::ByteToUnicode(0), "\xC4\x80");     // U+0100
  EXPECT_EQ(text_internal::ByteToUnicode(0xAD), "\xC5\x83");  // U+0143, the last one
  for (int b = 0; b < 256; ++b) {
    const std::string& u = text_internal::ByteToUnicode(static_cast<uint8_t>(b));
    uint32_t cp = static_cast<uint8_t>(u[0]);
    if (u.size() == 2) cp = ((cp & 0x1F) << 6) | (static_cast<uint8_t>(u[1]) & 0x3F);
    EXPECT_EQ(text_internal::UnicodeToByte(cp), b);
  }
}

using Words = std::vector<std::string_view>;

TEST(PreTokenizer, Gpt2Pattern) {
  EXPECT_EQ(PreTokenize("Hello world", PreTokenizer::kGpt2), (Words{"Hello", " world"}));
  EXPECT_EQ(PreTokenize("don't IT'S", PreTokenizer::kGpt2), (Words{"don", "'t", " IT", "'", "S"}));
  EXPECT_EQ(PreTokenize("abc123 45", PreTokenizer::kGpt2), (Words{"abc", "123", " 45"}));
  EXPECT_EQ(PreTokenize("hello  world!!\n", PreTokenizer::kGpt2), (Words{"hello", " ", " world", "!!", "\n"}));
  EXPECT_EQ(PreTokenize("(x) ", PreTokenizer::kGpt2), (Words{"(", "x", ")", " "}));
  EXPECT_EQ(PreTokenize("héllo wörld", PreTokenizer::kGpt2), (Words{"héllo", " wörld"}));
  EXPECT_EQ(PreTokenize("你好，世界", PreTokenizer::kGpt2), (Words{"你好", "，", "世界"}));
  EXPECT_EQ(PreTokenize("hi 😀!", PreTokenizer::kGpt2), (Words{"hi", " 😀!"}));
  EXPECT_EQ(PreTokenize("x\xFF" "y", PreTokenizer::kGpt2), (Words{"x", "\xFF", "y"}));  // an invalid byte
  EXPECT_TRUE(PreTokenize("", PreTokenizer::kGpt2).empty());
}

TEST(PreTokenizer, Llama3Pattern) {
  EXPECT_EQ(PreTokenize("Hello world", PreTokenizer::kLlama3), (Words{"Hello", " world"}));
  EXPECT_EQ(PreTokenize("IT'S", PreTokenizer::kLlama3), (Words{"IT", "'S"}));  // case-insensitive contractions
  EXPECT_EQ(PreTokenize("12345", PreTokenizer::kLlama3), (Words{"123", "45"}));
  EXPECT_EQ(PreTokenize("(hello", PreTokenizer::kLlama3), (Words{"(hello"}));
  EXPECT_EQ(PreTokenize("Hello\n\nworld", PreTokenizer::kLlama3), (Words{"Hello", "\n\n", "world"}));
  EXPECT_EQ(PreTokenize("a  \n b", PreTokenizer::kLlama3), (Words{"a", "  \n", " b"}));
  EXPECT_EQ(PreTokenize("x ...\n\ny", PreTokenizer::kLlama3), (Words{"x", " ...\n\n", "y"}));
  EXPECT_EQ(PreTokenize("    Hello", PreTokenizer::kLlama3), (Words{"   ", " Hello"}));
}

// Expected splits from Python's `regex` module running the two patterns of tokenizer_internal.h (regex.findall), not
// from this code. Each line pins one rule the cases above leave open.
TEST(PreTokenizer, Gpt2ContractionsWhitespaceAndLatin1) {
  // 'll 'd 've 'm are contractions (lowercase only in GPT-2); "'vx" is not one ('v' needs 'e').
  EXPECT_EQ(PreTokenize("we'll they'd you've I'm", PreTokenizer::kGpt2),
            (Words{"we", "'ll", " they", "'d", " you", "'ve", " I", "'m"}));
  EXPECT_EQ(PreTokenize("x'vx", PreTokenizer::kGpt2), (Words{"x", "'", "vx"}));
  // Only ' ' (not a tab) joins the following word: " ?\p{L}+".
  EXPECT_EQ(PreTokenize("a\tb", PreTokenizer::kGpt2), (Words{"a", "\t", "b"}));
  // Trailing whitespace at the end of the text stays one word: \s+(?!\S) has nothing to leave a space for.
  EXPECT_EQ(PreTokenize("end.  ", PreTokenizer::kGpt2), (Words{"end", ".", "  "}));
  // U+00BF is punctuation (Po), not a letter: it does not join "Qué".
  EXPECT_EQ(PreTokenize("\xC2\xBFQu\xC3\xA9?", PreTokenizer::kGpt2), (Words{"\xC2\xBF", "Qu\xC3\xA9", "?"}));
}

TEST(PreTokenizer, Llama3CaseDigitsAndLineBreaks) {
  // (?i:...) contractions win over "[^\r\n\p{L}\p{N}]?\p{L}+" even when letters follow, in either case.
  EXPECT_EQ(PreTokenize("'Twas", PreTokenizer::kLlama3), (Words{"'T", "was"}));
  EXPECT_EQ(PreTokenize("X'LLAMAS", PreTokenizer::kLlama3), (Words{"X", "'LL", "AMAS"}));
  // A digit or a line break never prefixes a letter run.
  EXPECT_EQ(PreTokenize("3rd 2nd\n\nx", PreTokenizer::kLlama3), (Words{"3", "rd", " ", "2", "nd", "\n\n", "x"}));
  EXPECT_EQ(PreTokenize("a\nb", PreTokenizer::kLlama3), (Words{"a", "\n", "b"}));
  // '\r' is a line break of "\s*[\r\n]+" as much as '\n' is.
  EXPECT_EQ(PreTokenize("a\r\rb", PreTokenizer::kLlama3), (Words{"a", "\r\r", "b"}));
  EXPECT_EQ(PreTokenize("end.  ", PreTokenizer::kLlama3), (Words{"end", ".", "  "}));
}

// Qwen2's pattern is Llama 3's with single digits (\p{N} for \p{N}{1,3}): the same splits everywhere but in digit runs.
TEST(PreTokenizer, Qwen2PatternSplitsEveryDigit) {
  EXPECT_EQ(PreTokenize("12345", PreTokenizer::kQwen2), (Words{"1", "2", "3", "4", "5"}));
  EXPECT_EQ(PreTokenize("a 2024.", PreTokenizer::kQwen2), (Words{"a", " ", "2", "0", "2", "4", "."}));
  EXPECT_EQ(PreTokenize("3rd 2nd\n\nx", PreTokenizer::kQwen2), (Words{"3", "rd", " ", "2", "nd", "\n\n", "x"}));
  for (const char* text : {"Hello world", "IT'S", "(hello", "a  \n b", "x ...\n\ny", "    Hello", "'Twas"}) {
    EXPECT_EQ(PreTokenize(text, PreTokenizer::kQwen2), PreTokenize(text, PreTokenizer::kLlama3)) << text;
  }
}

// A byte-level vocabulary built here: ids 0..255 are the bytes (in byte_to_unicode spelling), then one token per merge.
VocabData HandBuiltBpe(const std::vector<std::pair<std::string, std::string>>& merges, std::string pre = "gpt2") {
  VocabData v;
  v.model = "gpt2";
  v.pre = std::move(pre);
  v.source = "hand-built";
  for (int b = 0; b < 256; ++b) v.tokens.push_back(text_internal::ByteToUnicode(static_cast<uint8_t>(b)));
  for (const auto& [l, r] : merges) {
    v.merges.push_back(l + " " + r);
    v.tokens.push_back(l + r);
  }
  v.tokens.push_back("<|end|>");
  v.types.assign(v.tokens.size(), TokenType::kNormal);
  v.types.back() = TokenType::kControl;
  v.eos_id = static_cast<int32_t>(v.tokens.size()) - 1;
  v.add_bos = false;
  v.add_space_prefix = false;
  return v;
}

const std::string kG = "\xC4\xA0";  // 'Ġ', the space byte

// As SpmTokenizer.HeapEstimateMatchesTheAllocator, for a BPE vocabulary of 60000 merges and their tokens, half of
// them too long to be stored inline, counted from before the vocabulary is built.
TEST(BpeTokenizer, HeapEstimateMatchesTheAllocator) {
  const size_t before = testing::HeapInUse();
  std::unique_ptr<Tokenizer> bpe;
  {
    std::vector<std::pair<std::string, std::string>> merges;
    for (int i = 0; i < 60000; ++i) {
      merges.emplace_back(i % 2 ? "a" + std::to_string(i) : "a-longer-left-part-" + std::to_string(i),
                          "b" + std::to_string(i % 977));
    }
    auto made = MakeTokenizer(HandBuiltBpe(merges, "qwen2"));
    ASSERT_TRUE(made.ok()) << made.status().ToString();
    bpe = std::move(made).value();
  }
  const size_t after = testing::HeapInUse();
  const double held = static_cast<double>(after - before), estimate = static_cast<double>(bpe->HeapBytes());
  std::printf("BPE tokenizer heap: estimate %.0f, allocator %.0f bytes\n", estimate, held);
  EXPECT_GT(estimate, testing::kHeapEstimateLow * held);
  EXPECT_LT(estimate, testing::kHeapEstimateHigh * held);
}

TEST(BpeTokenizer, HandBuiltMerges) {
  auto tok = MakeTokenizer(HandBuiltBpe({{"h", "e"},         // 256
                                         {"l", "l"},         // 257
                                         {"he", "ll"},       // 258
                                         {"hell", "o"},      // 259
                                         {kG, "w"},          // 260
                                         {kG + "w", "o"},    // 261
                                         {"r", "l"},         // 262
                                         {kG + "wo", "rl"},  // 263
                                         {kG + "worl", "d"}, // 264
                                         {"b", "c"},         // 265 (ranked before "a b")
                                         {"a", "b"},         // 266
                                         {"x", "x"}}));      // 267
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  const Tokenizer& t = **tok;
  EXPECT_EQ(t.Encode("hello world", false), (std::vector<int32_t>{259, 264}));
  // "  world": the first space stands alone (\s+(?!\S)), the second starts " world"; '!' is byte 33.
  EXPECT_EQ(t.Encode("hello  world!", false), (std::vector<int32_t>{259, 32, 264, 33}));
  EXPECT_EQ(t.Encode("abc", false), (std::vector<int32_t>{'a', 265}));  // lower rank first: "b c" before "a b"
  EXPECT_EQ(t.Encode("xxx", false), (std::vector<int32_t>{267, 'x'}));  // equal ranks: leftmost first
  EXPECT_EQ(t.Encode("held", false), (std::vector<int32_t>{256, 'l', 'd'}));
  // Words never merge across pre-tokenizer boundaries: "x x" is "x", " x".
  EXPECT_EQ(t.Encode("x x", false), (std::vector<int32_t>{'x', 32, 'x'}));
  // UTF-8 bytes: é = C3 A9.
  EXPECT_EQ(t.Encode("é", false), (std::vector<int32_t>{0xC3, 0xA9}));
  EXPECT_EQ(t.Encode("<|end|>", false, /*parse_special=*/true), (std::vector<int32_t>{268}));
  EXPECT_EQ(t.Encode("<|end|>", false).size(), 7u);
  EXPECT_EQ(t.Decode(std::vector<int32_t>{259, 264, 268}), "hello world");
  EXPECT_EQ(t.DecodeToken(264), " world");
}

TEST(BpeTokenizer, MergeMissingFromVocabFallsBackToBytes) {
  VocabData v = HandBuiltBpe({{"a", "b"}});
  v.tokens[256] = "zz";  // the merge "a b" exists but its result "ab" is not a token
  auto tok = MakeTokenizer(std::move(v));
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  EXPECT_EQ((*tok)->Encode("ab", false), (std::vector<int32_t>{'a', 'b'}));
}

// The byte fallback goes through the byte_to_unicode spelling: "Ġ" (U+0120, UTF-8 C4 A0) is the space byte 0x20, "Ã"
// (U+00C3) and "©" (U+00A9) are the bytes C3 and A9 of "é". The ids are the bytes (HandBuiltBpe's ids 0..255).
TEST(BpeTokenizer, FallbackSpellsTwoByteCharactersAsTheirBytes) {
  const std::string c3 = "\xC3\x83", a9 = "\xC2\xA9";  // byte_to_unicode(0xC3) = U+00C3, (0xA9) = U+00A9
  ASSERT_EQ(text_internal::ByteToUnicode(0xC3), c3);
  ASSERT_EQ(text_internal::ByteToUnicode(0xA9), a9);
  VocabData v = HandBuiltBpe({{kG, "a"}, {c3, a9}});
  v.tokens[256] = "zz";  // neither merge's result is a token
  v.tokens[257] = "zy";
  auto tok = MakeTokenizer(std::move(v));
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  EXPECT_EQ((*tok)->Encode(" a", false), (std::vector<int32_t>{0x20, 'a'}));
  EXPECT_EQ((*tok)->Encode("\xC3\xA9", false), (std::vector<int32_t>{0xC3, 0xA9}));
}

// A stale queue entry must not merge: for "xabc" with ranks "x a" 0, "b c" 1, "a b" 2, by hand: "x a" gives "xa", then
// "b c" gives "bc"; the pair "a b" no longer exists (a is inside "xa", b inside "bc") and "xa bc" is no merge, so the
// result is "xa" "bc". The queued "a b" entry then has an empty left symbol and a right one of the queued length 2.
TEST(BpeTokenizer, StaleBigramIsSkipped) {
  auto tok = MakeTokenizer(HandBuiltBpe({{"x", "a"}, {"b", "c"}, {"a", "b"}}));  // 256 "xa", 257 "bc", 258 "ab"
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  EXPECT_EQ((*tok)->Encode("xabc", false), (std::vector<int32_t>{256, 257}));
}

// llama.cpp keeps the first rank of a merge listed twice (bpe_ranks.emplace): "a b" ranks 0, before "b c" (1), so
// "abc" is "ab" "c". (Hugging Face tokenizers would keep the last rank, 2, and give "a" "bc".)
TEST(BpeTokenizer, DuplicateMergeKeepsItsFirstRank) {
  auto tok = MakeTokenizer(HandBuiltBpe({{"a", "b"}, {"b", "c"}, {"a", "b"}}));  // 256 "ab", 257 "bc", 258 "ab"
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  EXPECT_EQ((*tok)->Encode("abc", false), (std::vector<int32_t>{256, 'c'}));
}

// Added (user-defined) tokens: split out of the text even without parse_special, longest first (llama.cpp's
// tokenizer_st_partition sorts by length and skips only control/unknown tokens unless parse_special), and decoded as
// the plain text they are stored as. A normal token's characters outside byte_to_unicode are kept as they are.
TEST(BpeTokenizer, AddedTokensAndUnmappedCharacters) {
  VocabData v = HandBuiltBpe({});  // 0..255 bytes, 256 <|end|>
  for (const char* t : {"  ", "    ", "<|\xC3\xA9|>"}) {  // 257, 258, 259
    v.tokens.push_back(t);
    v.types.push_back(TokenType::kUserDefined);
  }
  v.tokens.push_back("\xC5\x90\xE2\x86\x92");  // 260: U+0150 (just past byte_to_unicode's U+0143) and U+2192
  v.types.push_back(TokenType::kNormal);
  auto tok = MakeTokenizer(std::move(v));
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  EXPECT_EQ((*tok)->Encode("a    b", false), (std::vector<int32_t>{'a', 258, 'b'}));
  EXPECT_EQ((*tok)->Encode("a  b", false), (std::vector<int32_t>{'a', 257, 'b'}));
  EXPECT_EQ((*tok)->Encode("x<|\xC3\xA9|>", false), (std::vector<int32_t>{'x', 259}));
  EXPECT_EQ((*tok)->DecodeToken(259), "<|\xC3\xA9|>");  // not "<|" + byte E9 + "|>"
  EXPECT_EQ((*tok)->DecodeToken(260), "\xC5\x90\xE2\x86\x92");
}

TEST(BpeTokenizer, Llama3WholeWordTokenSkipsMerges) {
  VocabData v = HandBuiltBpe({{"h", "i"}}, "llama-bpe");
  v.tokens.push_back("hello");  // reachable by no merge; Llama 3 emits a word that is a token as it is
  v.types.push_back(TokenType::kNormal);
  auto tok = MakeTokenizer(v);
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  EXPECT_EQ((*tok)->Encode("hello hi", false), (std::vector<int32_t>{258, 32, 256}));
  v.pre = "gpt2";
  auto gpt2 = MakeTokenizer(v);
  ASSERT_TRUE(gpt2.ok());
  EXPECT_EQ((*gpt2)->Encode("hello", false), (std::vector<int32_t>{'h', 'e', 'l', 'l', 'o'}));
  // "llama3" is the other name llama.cpp gives the same pre-tokenizer (llama-vocab.cpp: "llama3", "llama-bpe", ...).
  v.pre = "llama3";
  auto llama3 = MakeTokenizer(v);
  ASSERT_TRUE(llama3.ok()) << llama3.status().ToString();
  EXPECT_EQ((*llama3)->Encode("hello hi", false), (std::vector<int32_t>{258, 32, 256}));
  // Qwen2 splits like Llama 3 but merges every word (llama.cpp keeps ignore_merges to Llama 3).
  v.pre = "qwen2";
  auto qwen2 = MakeTokenizer(v);
  ASSERT_TRUE(qwen2.ok()) << qwen2.status().ToString();
  EXPECT_EQ((*qwen2)->Encode("hello hi", false), (std::vector<int32_t>{'h', 'e', 'l', 'l', 'o', 32, 256}));
}

// Digit runs: Llama 3 keeps up to three digits in a word, so the merge "1 2" applies inside "123"; Qwen2 makes each
// digit a word of its own, so it never does.
TEST(BpeTokenizer, Qwen2DigitsAreWordsOfTheirOwn) {
  auto llama3 = MakeTokenizer(HandBuiltBpe({{"1", "2"}}, "llama-bpe"));
  auto qwen2 = MakeTokenizer(HandBuiltBpe({{"1", "2"}}, "qwen2"));
  ASSERT_TRUE(llama3.ok() && qwen2.ok());
  EXPECT_EQ((*llama3)->Encode("123", false), (std::vector<int32_t>{256, '3'}));
  EXPECT_EQ((*qwen2)->Encode("123", false), (std::vector<int32_t>{'1', '2', '3'}));
}

// tokenizer.ggml.pre names a split pattern; one this code does not implement must fail, not fall back to GPT-2's. A merge
// is two non-empty pieces and exactly one space (byte-level pieces spell the space byte as U+0120, never as ' ').
TEST(BpeTokenizer, RejectsUnknownPreAndMalformedMerges) {
  for (const char* pre : {"", "gpt2", "default", "llama-bpe", "llama3", "qwen2"}) {
    EXPECT_TRUE(MakeTokenizer(HandBuiltBpe({}, pre)).ok()) << pre;
  }
  auto other = MakeTokenizer(HandBuiltBpe({}, "deepseek-llm"));
  ASSERT_FALSE(other.ok());
  EXPECT_EQ(other.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(other.status().message().find("\"deepseek-llm\""), std::string::npos) << other.status().message();
  for (const char* merge : {"ab", "a ", " a", "a b c"}) {
    VocabData v = HandBuiltBpe({});
    v.merges = {merge};
    auto tok = MakeTokenizer(std::move(v));
    ASSERT_FALSE(tok.ok()) << '"' << merge << '"';
    EXPECT_EQ(tok.status().code(), StatusCode::kCorruption);
    EXPECT_NE(tok.status().message().find("tokenizer.ggml.merges[0]"), std::string::npos) << tok.status().message();
  }
}

TEST(BpeTokenizer, RoundTripsArbitraryUtf8) {
  // "你" is E4 BD A0: two merges build it from its bytes' byte_to_unicode spellings.
  const std::string e4 = text_internal::ByteToUnicode(0xE4), bd = text_internal::ByteToUnicode(0xBD),
                    a0 = text_internal::ByteToUnicode(0xA0);
  auto tok = MakeTokenizer(HandBuiltBpe({{kG, "t"}, {"h", "e"}, {kG + "t", "he"}, {e4, bd}, {e4 + bd, a0}}));
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  std::mt19937 rng(11);
  for (int i = 0; i < 300; ++i) {
    const std::string s = RandomUtf8(rng, 1 + static_cast<int>(rng() % 40));
    EXPECT_EQ((*tok)->Decode((*tok)->Encode(s, false)), s);
  }
  EXPECT_EQ((*tok)->Encode("你", false), (std::vector<int32_t>{260}));
  const std::string fixed = "the 🚀 (normal) 😶‍🌫️ 我想在apple工作1314151天～\n\t end";
  EXPECT_EQ((*tok)->Decode((*tok)->Encode(fixed, false)), fixed);
}

// ----- loader validation ---------------------------------------------------------------------------------------

Result<std::unique_ptr<Tokenizer>> LoadFromWrittenGguf(const TempDir& dir,
                                                       const std::vector<std::pair<std::string, GgufValue>>& kv) {
  const std::string path = dir.File("tok.gguf");
  GgufWriter w;
  for (const auto& [k, v] : kv) w.Set(k, v);
  Status s = w.Begin(path, /*overwrite=*/true);
  if (s.ok()) s = w.Finish();
  if (!s.ok()) return s;
  NF_ASSIGN_OR_RETURN(GgufFile f, GgufFile::OpenPath(path));
  return LoadTokenizer(f);
}

GgufValue StringList(std::vector<std::string> items) {
  GgufArray a;
  a.element_type = GgufType::kString;
  for (auto& s : items) a.items.emplace_back(std::move(s));
  return GgufValue(std::move(a));
}

GgufValue FloatList(std::vector<float> items) {
  GgufArray a;
  a.element_type = GgufType::kFloat32;
  for (float f : items) a.items.emplace_back(f);
  return GgufValue(std::move(a));
}

TEST(LoadTokenizer, ErrorsNameTheKey) {
  TempDir dir;
  auto unsupported = LoadFromWrittenGguf(dir, {{"tokenizer.ggml.model", "bert"},
                                               {"tokenizer.ggml.tokens", StringList({"a", "b"})}});
  ASSERT_FALSE(unsupported.ok());
  EXPECT_EQ(unsupported.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(unsupported.status().message().find("\"bert\""), std::string::npos) << unsupported.status().message();

  auto scores = LoadFromWrittenGguf(dir, {{"tokenizer.ggml.model", "llama"},
                                          {"tokenizer.ggml.tokens", StringList({"<unk>", "a", "b"})},
                                          {"tokenizer.ggml.scores", FloatList({0, 1})},
                                          {"tokenizer.ggml.unknown_token_id", uint32_t{0}}});
  ASSERT_FALSE(scores.ok());
  EXPECT_EQ(scores.status().code(), StatusCode::kCorruption);
  EXPECT_NE(scores.status().message().find("tokenizer.ggml.scores has 2"), std::string::npos)
      << scores.status().message();

  auto missing = LoadFromWrittenGguf(dir, {{"tokenizer.ggml.model", "llama"}});
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("tokenizer.ggml.tokens"), std::string::npos)
      << missing.status().message();

  auto bos = LoadFromWrittenGguf(dir, {{"tokenizer.ggml.model", "llama"},
                                       {"tokenizer.ggml.tokens", StringList({"<unk>", "a"})},
                                       {"tokenizer.ggml.scores", FloatList({0, 0})},
                                       {"tokenizer.ggml.unknown_token_id", uint32_t{0}},
                                       {"tokenizer.ggml.bos_token_id", uint32_t{5}}});
  ASSERT_FALSE(bos.ok());
  EXPECT_NE(bos.status().message().find("tokenizer.ggml.bos_token_id is 5"), std::string::npos)
      << bos.status().message();

  auto bytes = LoadFromWrittenGguf(dir, {{"tokenizer.ggml.model", "gpt2"},
                                         {"tokenizer.ggml.tokens", StringList({"a", "b"})}});
  ASSERT_FALSE(bytes.ok());
  EXPECT_NE(bytes.status().message().find("no token for byte"), std::string::npos) << bytes.status().message();

  // A minimal valid SPM vocabulary without token types: byte tokens are recognised by spelling, <unk> by its id.
  auto ok = LoadFromWrittenGguf(dir, {{"tokenizer.ggml.model", "llama"},
                                      {"tokenizer.ggml.tokens", StringList({"<unk>", "\xE2\x96\x81" "a", "a", "<0x62>"})},
                                      {"tokenizer.ggml.scores", FloatList({0, -1, -2, 0})},
                                      {"tokenizer.ggml.unknown_token_id", uint32_t{0}}});
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ((*ok)->Encode("a b", false), (std::vector<int32_t>{1, 0, 3}));  // "▁" is not a piece: <unk>; b: <0x62>
  EXPECT_EQ((*ok)->token_type(3), TokenType::kByte);
}

}  // namespace
}  // namespace nflash
