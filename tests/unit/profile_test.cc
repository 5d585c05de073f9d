// Profile file round trip and rejection of corrupt or foreign files; activation statistics checked against
// independent brute-force computations on seeded random streams.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <list>
#include <optional>
#include <random>
#include <set>
#include <thread>

#include "profiler/activation_stats.h"
#include "profiler/median_timing.h"
#include "profiler/profile.h"
#include "runtime/core/gguf.h"
#include "tests/test_util.h"

namespace nflash::profiler {
namespace {

using testing::TempDir;

FfnProfile RandomFfn(std::mt19937* rng, int64_t layer, int64_t expert, int64_t n, int64_t k, size_t n_report) {
  std::uniform_int_distribution<uint32_t> u(0, 1000);
  FfnProfile f;
  f.layer = layer;
  f.expert = expert;
  f.n_neurons = n;
  f.threshold = 0.25f;
  f.tokens = 1000;
  for (int64_t i = 0; i < n; ++i) {
    f.count_bs1.push_back(u(*rng));
    f.count_bs2.push_back(u(*rng));
    f.count_bs4.push_back(u(*rng));
  }
  f.groups2 = 500;
  f.groups4 = 250;
  for (int b = 0; b < kActiveHistBins; ++b) f.active_hist.push_back(u(*rng));
  for (int i = 0; i < kCurvePoints; ++i) {
    f.popularity.push_back(i / 16.0f);
    f.lru_hit_rate.push_back(i / 32.0f);
  }
  f.mean_active_fraction = 0.123;
  f.up_given_gate = 0.9;
  f.down_given_gate = 0.8;
  f.coact_k = k;
  for (int64_t i = 0; i < n * k; ++i) {
    f.coact_partner.push_back(static_cast<int32_t>(u(*rng) % n));
    f.coact_count.push_back(u(*rng));
  }
  for (size_t i = 0; i < n_report; ++i) f.report_thresholds.push_back(0.1f * static_cast<float>(i));
  return f;
}

ModelProfile RandomProfile() {
  std::mt19937 rng(42);
  ModelProfile p;
  p.model_hash = "0123456789abcdef";
  p.model_name = "test-model";
  p.activation = "silu";
  p.n_layers = 2;
  p.n_ff = 100;
  p.n_experts = 2;
  p.dim = 16;
  p.tokens = 1000;
  p.text_path = "calib.txt";
  p.ctx = 256;
  p.target_sparsity = 0.5;
  p.report_sparsities = {0.0f, 0.5f, 0.9f};
  for (int64_t l = 0; l < 2; ++l) {
    for (int64_t e = 0; e < 2; ++e) p.ffns.push_back(RandomFfn(&rng, l, e, 100, 4, 3));
  }
  return p;
}

void ExpectSame(const FfnProfile& a, const FfnProfile& b) {
  EXPECT_EQ(a.layer, b.layer);
  EXPECT_EQ(a.expert, b.expert);
  EXPECT_EQ(a.n_neurons, b.n_neurons);
  EXPECT_EQ(a.threshold, b.threshold);
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(a.count_bs1, b.count_bs1);
  EXPECT_EQ(a.count_bs2, b.count_bs2);
  EXPECT_EQ(a.count_bs4, b.count_bs4);
  EXPECT_EQ(a.groups2, b.groups2);
  EXPECT_EQ(a.groups4, b.groups4);
  EXPECT_EQ(a.active_hist, b.active_hist);
  EXPECT_EQ(a.mean_active_fraction, b.mean_active_fraction);
  EXPECT_EQ(a.popularity, b.popularity);
  EXPECT_EQ(a.popularity_heldout, b.popularity_heldout);
  EXPECT_EQ(a.lru_hit_rate, b.lru_hit_rate);
  EXPECT_EQ(a.up_given_gate, b.up_given_gate);
  EXPECT_EQ(a.down_given_gate, b.down_given_gate);
  EXPECT_EQ(a.coact_k, b.coact_k);
  EXPECT_EQ(a.coact_partner, b.coact_partner);
  EXPECT_EQ(a.coact_count, b.coact_count);
  EXPECT_EQ(a.report_thresholds, b.report_thresholds);
}

// Flips bit 4 of the byte `offset` bytes into tensor `name` of the GGUF file at `path`.
void FlipTensorByte(const std::string& path, const std::string& name, uint64_t offset) {
  uint64_t at = 0;
  {
    auto g = GgufFile::OpenPath(path);
    ASSERT_TRUE(g.ok());
    const GgufTensorInfo* t = g->FindTensor(name);
    ASSERT_NE(t, nullptr) << name;
    at = g->data_offset() + t->offset + offset;
  }
  std::fstream io(path, std::ios::in | std::ios::out | std::ios::binary);
  io.seekg(static_cast<std::streamoff>(at));
  char c = 0;
  io.read(&c, 1);
  c ^= 0x10;
  io.seekp(static_cast<std::streamoff>(at));
  io.write(&c, 1);
}

// profile-hw's cells time their thread counts in turns: after one warm-up call each, every round calls each variant
// once in order, and each median is its own variant's (here a variant that sleeps longer has the larger median).
TEST(MedianTiming, VariantsRunInTurnsWithTheirOwnMedians) {
  std::vector<size_t> calls;
  const std::vector<double> med = MedianSecondsEach(0.02, 3, [&](size_t i) {
    calls.push_back(i);
    std::this_thread::sleep_for(std::chrono::microseconds(200 + 1500 * i));
  });
  ASSERT_EQ(med.size(), 3u);
  ASSERT_GE(calls.size(), 6u);  // warm-up round plus at least one timed round
  ASSERT_EQ(calls.size() % 3, 0u);
  for (size_t k = 0; k < calls.size(); ++k) EXPECT_EQ(calls[k], k % 3) << k;
  EXPECT_GE(med[0], 200e-6);
  EXPECT_GT(med[1], med[0] + 1e-3);
  EXPECT_GT(med[2], med[1] + 1e-3);
  // The single-variant form is the same loop.
  size_t n1 = 0;
  EXPECT_GE(MedianSeconds(0.005, [&] {
              ++n1;
              std::this_thread::sleep_for(std::chrono::microseconds(500));
            }),
            500e-6);
  EXPECT_GE(n1, 2u);
}

TEST(ProfileFile, RoundTrip) {
  TempDir dir;
  const ModelProfile p = RandomProfile();
  ASSERT_TRUE(SaveProfile(p, dir.File("p.prof"), false).ok());
  auto loaded = LoadProfile(dir.File("p.prof"));
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ(loaded->model_hash, p.model_hash);
  EXPECT_EQ(loaded->model_name, p.model_name);
  EXPECT_EQ(loaded->activation, p.activation);
  EXPECT_EQ(loaded->n_layers, 2);
  EXPECT_EQ(loaded->n_ff, 100);
  EXPECT_EQ(loaded->n_experts, 2);
  EXPECT_EQ(loaded->dim, 16);
  EXPECT_EQ(loaded->tokens, 1000);
  EXPECT_EQ(loaded->ctx, 256);
  EXPECT_EQ(loaded->target_sparsity, 0.5);
  EXPECT_EQ(loaded->report_sparsities, p.report_sparsities);
  ASSERT_EQ(loaded->ffns.size(), p.ffns.size());
  for (size_t i = 0; i < p.ffns.size(); ++i) ExpectSame(loaded->ffns[i], p.ffns[i]);
  const FfnProfile* f = loaded->Find(1, 0);
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(f->count_bs1, p.ffns[2].count_bs1);
  EXPECT_EQ(loaded->Find(2, 0), nullptr);
  EXPECT_EQ(loaded->Find(0, -1), nullptr);
  EXPECT_EQ(loaded->decode_tokens, 0);  // a text profile
}

// A profile with no report sparsities (so empty threshold tables, as `nflash profile` writes for some models) reads
// back the same. Its empty fields have no storage: the sanitizer suite (scripts/asan_test.sh) fails this test if the
// loader hands memcpy their null pointers.
TEST(ProfileFile, RoundTripWithoutReportSparsities) {
  TempDir dir;
  ModelProfile p = RandomProfile();
  p.report_sparsities.clear();
  for (FfnProfile& f : p.ffns) f.report_thresholds.clear();
  ASSERT_TRUE(SaveProfile(p, dir.File("p.prof"), false).ok());
  auto loaded = LoadProfile(dir.File("p.prof"));
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_TRUE(loaded->report_sparsities.empty());
  ASSERT_EQ(loaded->ffns.size(), p.ffns.size());
  for (size_t i = 0; i < p.ffns.size(); ++i) ExpectSame(loaded->ffns[i], p.ffns[i]);
}

// The held-out popularity curve is optional: a profile with it on some FFNs (and not on others, as files written
// before it) reads back the same, and its bytes are covered by the data checksum.
TEST(ProfileFile, HeldOutPopularityIsOptionalAndChecksummed) {
  TempDir dir;
  ModelProfile p = RandomProfile();
  for (int i = 0; i < kCurvePoints; ++i) p.ffns[1].popularity_heldout.push_back(i / 20.0f);
  ASSERT_TRUE(SaveProfile(p, dir.File("p.prof"), false).ok());
  auto loaded = LoadProfile(dir.File("p.prof"));
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  ASSERT_EQ(loaded->ffns.size(), p.ffns.size());
  for (size_t i = 0; i < p.ffns.size(); ++i) ExpectSame(loaded->ffns[i], p.ffns[i]);
  EXPECT_TRUE(loaded->ffns[0].popularity_heldout.empty());
  EXPECT_TRUE(loaded->lru_hit_rate_shared.empty());
  // The model-level shared-pool curve: optional too, and read back.
  ModelProfile with_shared = p;
  for (int i = 0; i < kSharedCurvePoints; ++i) with_shared.lru_hit_rate_shared.push_back(i / 64.0f);
  ASSERT_TRUE(SaveProfile(with_shared, dir.File("s.prof"), false).ok());
  auto shared = LoadProfile(dir.File("s.prof"));
  ASSERT_TRUE(shared.ok()) << shared.status().ToString();
  EXPECT_EQ(shared->lru_hit_rate_shared, with_shared.lru_hit_rate_shared);
  with_shared.lru_hit_rate_shared.pop_back();
  EXPECT_FALSE(SaveProfile(with_shared, dir.File("s2.prof"), false).ok());
  // A wrong length is refused at save.
  p.ffns[1].popularity_heldout.pop_back();
  EXPECT_FALSE(SaveProfile(p, dir.File("q.prof"), false).ok());
  // One flipped byte of the curve fails the checksum.
  ASSERT_NO_FATAL_FAILURE(FlipTensorByte(dir.File("p.prof"), "prof.blk.0.exp.1.popularity_heldout", 9));
  auto bad = LoadProfile(dir.File("p.prof"));
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("checksum"), std::string::npos) << bad.status().ToString();
}

TEST(ProfileFile, DecodeSourceRoundTripsAndIsValidated) {
  TempDir dir;
  ModelProfile p = RandomProfile();
  p.decode_tokens = 48;
  p.decode_prompt_tokens = 16;
  p.decode_temperature = 0.5;
  ASSERT_TRUE(SaveProfile(p, dir.File("d.prof"), false).ok());
  auto loaded = LoadProfile(dir.File("d.prof"));
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ(loaded->decode_tokens, 48);
  EXPECT_EQ(loaded->decode_prompt_tokens, 16);
  EXPECT_EQ(loaded->decode_temperature, 0.5);
  // Prompt + decode longer than the window it claims to have run in.
  p.decode_tokens = 250;
  ASSERT_TRUE(SaveProfile(p, dir.File("bad.prof"), false).ok());
  auto bad = LoadProfile(dir.File("bad.prof"));
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("decode_tokens 250"), std::string::npos) << bad.status().ToString();
}

TEST(ProfileFile, RefusesOverwriteWithoutForce) {
  TempDir dir;
  const ModelProfile p = RandomProfile();
  ASSERT_TRUE(SaveProfile(p, dir.File("p.prof"), false).ok());
  Status s = SaveProfile(p, dir.File("p.prof"), false);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("--force"), std::string::npos) << s.message();
  EXPECT_TRUE(SaveProfile(p, dir.File("p.prof"), true).ok());
}

TEST(ProfileFile, SaveRejectsWrongSizes) {
  TempDir dir;
  ModelProfile p = RandomProfile();
  p.ffns[1].count_bs2.pop_back();
  Status s = SaveProfile(p, dir.File("p.prof"), false);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("count_bs2"), std::string::npos) << s.message();
  EXPECT_FALSE(std::ifstream(dir.File("p.prof")).good());
}

// Copies the profile at `src` to `dst` with metadata key `key` set to `value` (when `key` is not empty) and tensor
// `tensor` renamed to `new_name` or stored as `new_type` (same dims; its bytes zeroed to the new size).
void RewriteProfile(const std::string& src, const std::string& dst, const std::string& key, const GgufValue& value,
                    const std::string& tensor = "", const std::string& new_name = "",
                    std::optional<GgmlType> new_type = std::nullopt) {
  const std::string error = testing::RewriteGguf(
      src, dst, testing::EditGgufKey(key, [&](GgufValue& v) { v = value; }),
      [&](testing::GgufTensorCopy* t) {
        if (t->name != tensor) return;
        if (!new_name.empty()) t->name = new_name;
        if (new_type) {
          t->type = *new_type;
          t->ZeroData();
        }
      });
  ASSERT_EQ(error, "");
}

// Each structural check of the reader, one damaged field at a time: the message names the key, FFN or tensor. The
// data checksum covers tensor bytes only, so these checks are what stands between edited metadata and the packer.
TEST(ProfileFile, EachStructuralCheckNamesTheField) {
  TempDir dir;
  ModelProfile p = RandomProfile();
  p.lru_hit_rate_shared.assign(kSharedCurvePoints, 0.5f);
  const std::string good = dir.File("p.prof");
  ASSERT_TRUE(SaveProfile(p, good, false).ok());
  ASSERT_TRUE(LoadProfile(good).ok());
  auto numbers = [](std::vector<double> v) {
    GgufArray a;
    a.element_type = GgufType::kFloat64;
    for (double x : v) a.items.emplace_back(x);
    return GgufValue(std::move(a));
  };
  GgufArray words;
  words.element_type = GgufType::kString;
  for (int i = 0; i < 4; ++i) words.items.emplace_back(std::string("x"));
  struct Case {
    const char* what;
    std::string key;
    GgufValue value;
    std::string tensor, new_name;
    std::optional<GgmlType> new_type;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"n_ffns", "nflash.profile.n_ffns", GgufValue(uint64_t{1000}), "", "", {},
       "nflash.profile.n_ffns is 1000 but the file has"},
      {"report_sparsities", "nflash.profile.report_sparsities", numbers({0.0, 0.5, 0.9}), "", "", {},
       "nflash.profile.report_sparsities has type float64 elements, expected f32"},
      {"layer count", "nflash.profile.ffn.layer", numbers({0, 0, 1}), "", "", {},
       "nflash.profile.ffn.layer has 3 entries, expected 4"},
      {"layer type", "nflash.profile.ffn.layer", GgufValue(words), "", "", {},
       "nflash.profile.ffn.layer[0] has type string, expected a number"},
      {"layer range", "nflash.profile.ffn.layer", numbers({0, 0, 1, 7}), "", "", {},
       "ffn 3 (layer 7, expert 1): layer out of range [0, 2)"},
      {"expert range", "nflash.profile.ffn.expert", numbers({0, 1, 0, 5}), "", "", {},
       "ffn 3 (layer 1, expert 5): expert out of range [-1, 2)"},
      {"n_neurons", "nflash.profile.ffn.n_neurons", numbers({100, 100, 101, 100}), "", "", {},
       "ffn 2 (layer 1, expert 0): n_neurons 101 / coact_k 4 out of range (n_ff 100)"},
      {"tokens", "nflash.profile.ffn.tokens", numbers({10, -5, 10, 10}), "", "", {},
       "ffn 1 (layer 0, expert 1): negative token count"},
      {"missing tensor", "", GgufValue(uint8_t{0}), "prof.blk.1.exp.0.count_bs2", "prof.blk.1.exp.0.count_bsx", {},
       "ffn 2 (layer 1, expert 0): tensor prof.blk.1.exp.0.count_bs2 is missing"},
      {"tensor type", "", GgufValue(uint8_t{0}), "prof.blk.0.exp.1.popularity", "", GgmlType::kI32,
       "tensor prof.blk.0.exp.1.popularity has type i32"},
      {"shared curve type", "", GgufValue(uint8_t{0}), "prof.lru_hit_rate_shared", "", GgmlType::kF16,
       "tensor prof.lru_hit_rate_shared has type f16"},
      // An optional tensor under a name this reader does not know (a newer writer's field, say): named, not reported
      // as a checksum mismatch.
      {"unknown tensor", "", GgufValue(uint8_t{0}), "prof.lru_hit_rate_shared", "prof.lru_served_mixed", {},
       "tensor prof.lru_served_mixed is not one this nflash reads"},
  };
  for (const Case& c : cases) {
    const std::string bad = dir.File("bad.prof");
    RewriteProfile(good, bad, c.key, c.value, c.tensor, c.new_name, c.new_type);
    auto loaded = LoadProfile(bad);
    ASSERT_FALSE(loaded.ok()) << c.what;
    EXPECT_EQ(loaded.status().code(), StatusCode::kCorruption) << c.what << ": " << loaded.status().ToString();
    EXPECT_NE(loaded.status().message().find(c.message), std::string::npos) << c.what << ": "
                                                                            << loaded.status().ToString();
  }
}

// A partner index outside the FFN (hashed correctly: written by a buggy writer) is refused after the checksum passes;
// the writer refuses non-positive n_neurons and negative coact_k.
TEST(ProfileFile, PartnersAndSizesAreBounded) {
  TempDir dir;
  ModelProfile p = RandomProfile();
  p.ffns[2].coact_partner[5] = 100;
  ASSERT_TRUE(SaveProfile(p, dir.File("p.prof"), false).ok());
  auto loaded = LoadProfile(dir.File("p.prof"));
  ASSERT_FALSE(loaded.ok());
  EXPECT_NE(loaded.status().message().find("ffn 2: co-activation partner 100 out of range [-1, 100)"),
            std::string::npos)
      << loaded.status().ToString();
  ModelProfile zero = RandomProfile();
  zero.ffns[0].n_neurons = 0;
  EXPECT_NE(SaveProfile(zero, dir.File("z.prof"), false).message().find("n_neurons must be > 0"), std::string::npos);
  ModelProfile negative = RandomProfile();
  negative.ffns[0].coact_k = -1;
  EXPECT_NE(SaveProfile(negative, dir.File("n.prof"), false).message().find("coact_k must be >= 0"),
            std::string::npos);
}

TEST(ProfileFile, RejectsOtherSchemaVersion) {
  TempDir dir;
  ModelProfile p = RandomProfile();
  p.schema_version = kProfileSchemaVersion + 1;
  ASSERT_TRUE(SaveProfile(p, dir.File("p.prof"), false).ok());
  auto loaded = LoadProfile(dir.File("p.prof"));
  ASSERT_FALSE(loaded.ok());
  EXPECT_EQ(loaded.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(loaded.status().message().find("schema version 2"), std::string::npos) << loaded.status().message();
}

TEST(ProfileFile, RejectsAGgufThatIsNotAProfile) {
  TempDir dir;
  GgufWriter w;
  w.Set("general.type", "model");
  ASSERT_TRUE(w.Begin(dir.File("m.gguf"), false).ok());
  ASSERT_TRUE(w.Finish().ok());
  auto loaded = LoadProfile(dir.File("m.gguf"));
  ASSERT_FALSE(loaded.ok());
  EXPECT_NE(loaded.status().message().find("not an nflash profile"), std::string::npos);
}

TEST(ProfileFile, DetectsFlippedDataByte) {
  TempDir dir;
  const ModelProfile p = RandomProfile();
  const std::string path = dir.File("p.prof");
  ASSERT_TRUE(SaveProfile(p, path, false).ok());
  ASSERT_NO_FATAL_FAILURE(FlipTensorByte(path, "prof.blk.1.exp.0.count_bs4", 5));
  auto loaded = LoadProfile(path);
  ASSERT_FALSE(loaded.ok());
  EXPECT_EQ(loaded.status().code(), StatusCode::kCorruption);
  EXPECT_NE(loaded.status().message().find("checksum"), std::string::npos) << loaded.status().message();
}

TEST(ProfileFile, DetectsTruncation) {
  TempDir dir;
  const std::string path = dir.File("p.prof");
  ASSERT_TRUE(SaveProfile(RandomProfile(), path, false).ok());
  std::ifstream in(path, std::ios::binary);
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (size_t keep : {bytes.size() - 100, bytes.size() / 2, size_t{10}}) {
    testing::WriteBytes(dir.File("t.prof"), std::vector<uint8_t>(bytes.begin(), bytes.begin() + keep));
    EXPECT_FALSE(LoadProfile(dir.File("t.prof")).ok()) << "kept " << keep;
  }
}

TEST(ProfileFile, CheckProfileForModelNamesBothHashes) {
  const ModelProfile p = RandomProfile();
  EXPECT_TRUE(CheckProfileForModel(p, "0123456789abcdef", "m.gguf").ok());
  Status s = CheckProfileForModel(p, "fedcba9876543210", "m.gguf");
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("0123456789abcdef"), std::string::npos);
  EXPECT_NE(s.message().find("fedcba9876543210"), std::string::npos);
}

// ---- statistics ----

// Hits of an LRU cache of `capacity` items on `trace`, simulated directly.
uint64_t BruteForceLruHits(const std::vector<int32_t>& trace, size_t capacity) {
  std::list<int32_t> lru;  // front: most recent
  uint64_t hits = 0;
  for (int32_t x : trace) {
    auto it = std::find(lru.begin(), lru.end(), x);
    if (it != lru.end()) {
      ++hits;
      lru.erase(it);
    } else if (capacity > 0 && lru.size() == capacity) {
      lru.pop_back();
    }
    if (capacity > 0) lru.push_front(x);
  }
  return hits;
}

// Hits of caches of `capacity` items on `steps` (sets of distinct items) under the offloaded runtime's policy, from
// its definition on a recency list (front: most recent): an item hits iff it is among the first `capacity` at its
// step's start; after the step its items lead the list in their previous order, the never used ones after them
// (the first of them last).
uint64_t BruteForceSetLruHits(const std::vector<std::vector<int32_t>>& steps, size_t capacity) {
  std::list<int32_t> lru;
  uint64_t hits = 0;
  for (const std::vector<int32_t>& a : steps) {
    std::vector<std::pair<size_t, int32_t>> used;  // (position, item)
    std::vector<int32_t> fresh;
    for (int32_t x : a) {
      const auto it = std::find(lru.begin(), lru.end(), x);
      if (it == lru.end()) {
        fresh.push_back(x);
        continue;
      }
      const size_t pos = static_cast<size_t>(std::distance(lru.begin(), it));
      if (pos < capacity) ++hits;
      used.emplace_back(pos, x);
    }
    std::sort(used.begin(), used.end());
    for (const auto& [pos, x] : used) lru.remove(x);
    for (int32_t x : fresh) lru.push_front(x);
    for (auto it = used.rbegin(); it != used.rend(); ++it) lru.push_front(it->second);
  }
  return hits;
}

TEST(StackDistance, SetAccessMatchesTheRuntimePolicy) {
  std::mt19937 rng(9);
  const int64_t n = 50;
  std::vector<std::vector<int32_t>> steps;
  std::bernoulli_distribution hot(0.5), cold(0.08);
  StackDistanceCounter c(n);
  uint64_t accesses = 0;
  for (int t = 0; t < 3000; ++t) {  // > 4n + 1024 accesses: compaction runs
    std::vector<int32_t> a;
    for (int32_t i = 0; i < n; ++i) {
      if (i % 7 == 0 ? hot(rng) : cold(rng)) a.push_back(i);
    }
    c.AccessSet(a);
    accesses += a.size();
    steps.push_back(std::move(a));
  }
  EXPECT_EQ(c.accesses(), accesses);
  bool differs = false;  // from accessing each set in ascending order: else the test would not tell them apart
  std::vector<int32_t> flat;
  for (const auto& a : steps) flat.insert(flat.end(), a.begin(), a.end());
  for (int64_t cap : {0, 1, 3, 8, 12, 20, 35, 49, 50}) {
    const uint64_t want = BruteForceSetLruHits(steps, static_cast<size_t>(cap));
    EXPECT_EQ(c.Hits(cap), want) << "capacity " << cap;
    differs = differs || want != BruteForceLruHits(flat, static_cast<size_t>(cap));
  }
  EXPECT_TRUE(differs);
}

TEST(StackDistance, MatchesBruteForceLru) {
  std::mt19937 rng(7);
  const int64_t n = 60;
  // Skewed: a hot set plus a uniform tail, so hit rates vary across sizes. 20000 accesses > 4n + 1024 slots, so
  // compaction runs several times.
  std::vector<int32_t> trace;
  std::uniform_int_distribution<int32_t> hot(0, 9), all(0, n - 1);
  std::bernoulli_distribution pick_hot(0.6);
  for (int i = 0; i < 20000; ++i) trace.push_back(pick_hot(rng) ? hot(rng) : all(rng));
  StackDistanceCounter c(n);
  for (int32_t x : trace) c.Access(x);
  EXPECT_EQ(c.accesses(), trace.size());
  for (int64_t cap : {0, 1, 2, 5, 10, 11, 30, 59, 60}) {
    EXPECT_EQ(c.Hits(cap), BruteForceLruHits(trace, static_cast<size_t>(cap))) << "capacity " << cap;
  }
  const std::vector<float> curve = c.HitRateCurve();
  ASSERT_EQ(curve.size(), static_cast<size_t>(kCurvePoints));
  for (int i = 0; i < kCurvePoints; ++i) {
    const size_t cap = static_cast<size_t>(std::llround(i * n / 16.0));
    EXPECT_NEAR(curve[i], static_cast<double>(BruteForceLruHits(trace, cap)) / trace.size(), 1e-6) << i;
  }
}

TEST(Popularity, CurveOfKnownCounts) {
  // 16 neurons: counts 16..1 (total 136): top k hold sum of the k largest.
  std::vector<uint32_t> counts;
  for (uint32_t c = 1; c <= 16; ++c) counts.push_back(c);
  std::shuffle(counts.begin(), counts.end(), std::mt19937(3));
  const std::vector<float> curve = PopularityCurve(counts);
  for (int i = 0; i <= 16; ++i) {
    const double top = i * 16 - i * (i - 1) / 2.0;  // 16 + 15 + ... (i terms)
    EXPECT_NEAR(curve[i], top / 136.0, 1e-6) << i;
  }
  EXPECT_EQ(PopularityCurve(std::vector<uint32_t>(8, 0))[16], 0.0f);
}

// Hand-computed: neurons ranked by `rank` (ties to the smaller index), shares of `eval`'s total.
TEST(Popularity, HeldOutCurveRanksOnOneCountAndMeasuresTheOther) {
  const std::vector<uint32_t> rank = {0, 5, 5, 1};  // order 1, 2, 3, 0
  const std::vector<uint32_t> eval = {4, 0, 2, 2};  // total 8
  const std::vector<float> c = HeldOutPopularityCurve(rank, eval, 5);  // points at 0, 1, 2, 3, 4 neurons
  ASSERT_EQ(c.size(), 5u);
  EXPECT_FLOAT_EQ(c[0], 0.0f);
  EXPECT_FLOAT_EQ(c[1], 0.0f / 8);
  EXPECT_FLOAT_EQ(c[2], 2.0f / 8);
  EXPECT_FLOAT_EQ(c[3], 4.0f / 8);
  EXPECT_FLOAT_EQ(c[4], 1.0f);
  EXPECT_EQ(HeldOutPopularityCurve(rank, std::vector<uint32_t>(4, 0), 5), std::vector<float>(5, 0.0f));
}

// The shared-pool curve replays every window in decode order (token by token, FFNs in index order) whatever order the
// sets arrived in (a batched window arrives FFN by FFN), and equals the runtime's policy simulated directly over keys
// ffn * n + i, one step per (token, FFN).
TEST(SharedLru, ReplaysInDecodeOrderAndMatchesBruteForce) {
  std::mt19937 rng(5);
  const int64_t n_ffns = 3, n = 10, windows = 4, ctx = 6;
  SharedLruStats st(n_ffns, n);
  std::vector<std::vector<int32_t>> steps;  // key sets in decode order
  size_t n_keys = 0;
  std::bernoulli_distribution on(0.3);
  for (int64_t w = 0; w < windows; ++w) {
    std::vector<std::vector<std::vector<int32_t>>> sets(ctx, std::vector<std::vector<int32_t>>(n_ffns));
    for (int64_t p = 0; p < ctx; ++p) {
      for (int64_t f = 0; f < n_ffns; ++f) {
        for (int32_t i = 0; i < n; ++i) {
          if (on(rng)) sets[p][f].push_back(i);
        }
        steps.emplace_back();
        for (int32_t i : sets[p][f]) steps.back().push_back(static_cast<int32_t>(f * n + i));
        n_keys += sets[p][f].size();
      }
    }
    // Arrival: FFN-major in even windows (a batched prefill), reversed positions in odd ones.
    for (int64_t f = 0; f < n_ffns; ++f) {
      for (int64_t k = 0; k < ctx; ++k) {
        const int64_t p = w % 2 == 0 ? k : ctx - 1 - k;
        st.Add(f, w, p, sets[p][f]);
      }
    }
  }
  const int points = 16 + 1;
  const std::vector<float> curve = st.Finish(points);
  ASSERT_EQ(curve.size(), static_cast<size_t>(points));
  for (int i = 0; i < points; ++i) {
    const size_t capacity = static_cast<size_t>(std::llround(static_cast<double>(i) * n_ffns * n / (points - 1)));
    EXPECT_NEAR(curve[i], static_cast<double>(BruteForceSetLruHits(steps, capacity)) / n_keys, 1e-6) << i;
  }
}

// Window 0 activates neurons {0, 1} on each of its tokens, window 1 {0, 2}: in sample the 2 hottest (0 and 1) hold
// 3/4 of the activations, but ranked on one window they hold only 1/2 of the other's.
TEST(FfnStats, HeldOutPopularitySplitsByWindow) {
  FfnStatsOptions opt;
  opt.ctx = 10;
  opt.coact_k = 0;
  FfnStats st(0, 3, 4, 0.0f, opt);
  for (int64_t p = 0; p < 10; ++p) st.AddToken(std::vector<int32_t>{0, 1}, 0, p, false);
  for (int64_t p = 0; p < 10; ++p) st.AddToken(std::vector<int32_t>{0, 2}, 1, p, false);
  ThreadPool pool(1);
  const FfnProfile f = st.Finish(&pool);
  ASSERT_EQ(f.popularity_heldout.size(), static_cast<size_t>(kCurvePoints));
  EXPECT_FLOAT_EQ(f.popularity[8], 0.75f);          // 2 of 4 neurons, in sample
  EXPECT_FLOAT_EQ(f.popularity_heldout[8], 0.5f);   // held out
  EXPECT_FLOAT_EQ(f.popularity[4], 0.5f);           // neuron 0 alone
  EXPECT_FLOAT_EQ(f.popularity_heldout[4], 0.5f);
  EXPECT_FLOAT_EQ(f.popularity_heldout[16], 1.0f);
  // Every token in one window: halves by position parity (even positions {0, 1}, odd {0, 3}): the same shares.
  FfnStats one(0, -1, 4, 0.0f, opt);
  for (int64_t p = 0; p < 10; ++p) {
    one.AddToken(p % 2 == 0 ? std::vector<int32_t>{0, 1} : std::vector<int32_t>{0, 3}, 0, p, false);
  }
  const FfnProfile g = one.Finish(&pool);
  ASSERT_EQ(g.popularity_heldout.size(), static_cast<size_t>(kCurvePoints));
  EXPECT_FLOAT_EQ(g.popularity[8], 0.75f);
  EXPECT_FLOAT_EQ(g.popularity_heldout[8], 0.5f);
  // Asymmetric halves average both ways: window 0 {0, 1}, window 1 {2}. Ranked on window 0 (order 0, 1, 2, 3) the
  // top 2 hold 0 of window 1's activations; ranked on window 1 (order 2, 0, 1, 3) they hold 10 of window 0's 20.
  FfnStats asym(0, -1, 4, 0.0f, opt);
  for (int64_t p = 0; p < 10; ++p) asym.AddToken(std::vector<int32_t>{0, 1}, 0, p, false);
  for (int64_t p = 0; p < 10; ++p) asym.AddToken(std::vector<int32_t>{2}, 1, p, false);
  const FfnProfile h = asym.Finish(&pool);
  ASSERT_EQ(h.popularity_heldout.size(), static_cast<size_t>(kCurvePoints));
  EXPECT_FLOAT_EQ(h.popularity_heldout[8], 0.25f);   // (0 + 1/2) / 2
  EXPECT_FLOAT_EQ(h.popularity_heldout[12], 1.0f);   // 3 neurons: (1 + 1) / 2
  // Fewer than 2 tokens: no held-out curve.
  FfnStats single(0, -1, 4, 0.0f, opt);
  single.AddToken(std::vector<int32_t>{1}, 0, 0, false);
  EXPECT_TRUE(single.Finish(&pool).popularity_heldout.empty());
}

TEST(Quantile, NearestRank) {
  std::vector<float> v;
  for (int i = 100; i >= 1; --i) v.push_back(static_cast<float>(i));
  auto copy = v;
  EXPECT_EQ(QuantileThreshold(&copy, 0.3), 30.0f);
  copy = v;
  EXPECT_EQ(QuantileThreshold(&copy, 0.9), 90.0f);
  copy = v;
  EXPECT_EQ(QuantileThreshold(&copy, 0.0), 0.0f);
  // A fractional rank rounds up: at least 25.5 % of the values lie at or below 26, not at 25.
  copy = v;
  EXPECT_EQ(QuantileThreshold(&copy, 0.255), 26.0f);
  copy = v;
  EXPECT_EQ(QuantileThreshold(&copy, 1.0), 100.0f);
}

TEST(FfnStats, MatchesIndependentCounts) {
  std::mt19937 rng(11);
  const int64_t n = 70;  // two bitset words
  const int64_t ctx = 5;
  const int64_t n_windows = 7;  // groups of 2: {0,1},{2,3},{4,5},{6}; of 4: {0..3},{4..6}
  const int64_t last_len = 3;   // the last window is short
  FfnStatsOptions opt;
  opt.ctx = ctx;
  opt.coact_k = 3;
  opt.coact_tokens = 1000;  // every token sampled: pair counts are exact
  FfnStats st(2, -1, n, 0.0f, opt);
  std::vector<std::vector<std::vector<int32_t>>> sets(n_windows);  // [window][pos] -> active set
  std::vector<int32_t> trace;
  std::vector<std::vector<int32_t>> steps;  // the active sets in order
  std::bernoulli_distribution hot(0.7), cold(0.1);
  for (int64_t w = 0; w < n_windows; ++w) {
    const int64_t len = w == n_windows - 1 ? last_len : ctx;
    for (int64_t p = 0; p < len; ++p) {
      std::vector<int32_t> a;
      for (int32_t i = 0; i < n; ++i) {
        if (i < 8 ? hot(rng) : cold(rng)) a.push_back(i);
      }
      st.AddToken(a, w, p, true);
      st.AddGateCoactivation(static_cast<int64_t>(a.size()), static_cast<int64_t>(a.size()) / 2, 1);
      trace.insert(trace.end(), a.begin(), a.end());
      steps.push_back(a);
      sets[w].push_back(a);
    }
  }
  ThreadPool pool(2);
  const FfnProfile f = st.Finish(&pool);
  EXPECT_EQ(f.layer, 2);
  EXPECT_EQ(f.tokens, (n_windows - 1) * ctx + last_len);
  // Independent: counts at batch 1, unions over window groups at each position, histogram, mean.
  std::vector<uint32_t> c1(n, 0), c2(n, 0), c4(n, 0);
  std::vector<uint32_t> hist(kActiveHistBins, 0);
  double sum_frac = 0;
  int64_t total_active = 0;
  for (const auto& win : sets) {
    for (const auto& a : win) {
      for (int32_t i : a) ++c1[i];
      const double frac = static_cast<double>(a.size()) / n;
      sum_frac += frac;
      ++hist[std::min<int>(kActiveHistBins - 1, static_cast<int>(frac * kActiveHistBins))];
      total_active += static_cast<int64_t>(a.size());
    }
  }
  int64_t g2 = 0, g4 = 0;
  for (int64_t group_size : {2, 4}) {
    for (int64_t g0 = 0; g0 < n_windows; g0 += group_size) {
      for (int64_t p = 0; p < ctx; ++p) {
        std::set<int32_t> u;
        bool any = false;
        for (int64_t w = g0; w < std::min(n_windows, g0 + group_size); ++w) {
          if (p < static_cast<int64_t>(sets[w].size())) {
            any = true;
            u.insert(sets[w][p].begin(), sets[w][p].end());
          }
        }
        if (!any) continue;
        (group_size == 2 ? g2 : g4)++;
        for (int32_t i : u) ++(group_size == 2 ? c2 : c4)[i];
      }
    }
  }
  EXPECT_EQ(f.count_bs1, c1);
  EXPECT_EQ(f.count_bs2, c2);
  EXPECT_EQ(f.count_bs4, c4);
  EXPECT_EQ(f.groups2, g2);
  EXPECT_EQ(f.groups4, g4);
  EXPECT_EQ(f.active_hist, hist);
  EXPECT_NEAR(f.mean_active_fraction, sum_frac / static_cast<double>(f.tokens), 1e-12);
  EXPECT_EQ(f.popularity, PopularityCurve(c1));
  for (int i = 0; i < kCurvePoints; ++i) {
    const size_t cap = static_cast<size_t>(std::llround(i * n / 16.0));
    EXPECT_NEAR(f.lru_hit_rate[i], static_cast<double>(BruteForceSetLruHits(steps, cap)) / trace.size(), 1e-6);
  }
  int64_t up_ok = 0;
  for (const auto& win : sets) {
    for (const auto& a : win) up_ok += static_cast<int64_t>(a.size()) / 2;
  }
  EXPECT_NEAR(f.up_given_gate, static_cast<double>(up_ok) / total_active, 1e-12);
  // Co-activation: exact pair counts; top-3 partners by Jaccard similarity joint / (c1[i] + c1[j] - joint) (every
  // token is sampled, so c1 are the sample counts), ties to the larger count, then the smaller index.
  ASSERT_EQ(f.coact_k, 3);
  for (int32_t i = 0; i < n; ++i) {
    std::vector<std::pair<uint32_t, int32_t>> pairs;
    for (int32_t j = 0; j < n; ++j) {
      if (j == i) continue;
      uint32_t c = 0;
      for (const auto& win : sets) {
        for (const auto& a : win) {
          const bool hi = std::binary_search(a.begin(), a.end(), i), hj = std::binary_search(a.begin(), a.end(), j);
          c += hi && hj;
        }
      }
      if (c > 0) pairs.emplace_back(c, j);
    }
    auto jaccard = [&](const std::pair<uint32_t, int32_t>& p) {
      return static_cast<double>(p.first) / static_cast<double>(c1[i] + c1[p.second] - p.first);
    };
    std::sort(pairs.begin(), pairs.end(), [&](auto x, auto y) {
      if (jaccard(x) != jaccard(y)) return jaccard(x) > jaccard(y);
      return x.first != y.first ? x.first > y.first : x.second < y.second;
    });
    for (size_t r = 0; r < 3; ++r) {
      const int32_t want_partner = r < pairs.size() ? pairs[r].second : -1;
      const uint32_t want_count = r < pairs.size() ? pairs[r].first : 0;
      EXPECT_EQ(f.coact_partner[i * 3 + r], want_partner) << "neuron " << i << " rank " << r;
      EXPECT_EQ(f.coact_count[i * 3 + r], want_count) << "neuron " << i << " rank " << r;
    }
  }
}

}  // namespace
}  // namespace nflash::profiler
