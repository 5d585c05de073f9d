// Packer: neuron ordering, bit-exact bundles for every quant type (dense and MoE), the reader API, the per-neuron
// checksums (XXH3 in new packs, xxHash64 in old ones), and the corrupt / truncated / mismatched deployment suite.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <xxhash.h>

#include <cstring>
#include <filesystem>
#include <functional>
#include <fstream>
#include <map>
#include <random>
#include <set>

#include "packer/deployment.h"
#include "packer/lookahead_table.h"
#include "packer/pack.h"
#include "packer/replay.h"
#include "packer/verify.h"
#include "runtime/cli/model_loader.h"
#include "runtime/core/checksum.h"
#include "runtime/core/file.h"
#include "runtime/core/float16.h"
#include "runtime/core/gguf.h"
#include "runtime/core/quant.h"
#include "runtime/engine/context.h"
#include "runtime/engine/predictor.h"
#include "tests/test_util.h"
#include "tests/unit/small_model.h"

namespace nflash::packer {
namespace {

namespace fs = std::filesystem;
using nflash::testing::TempDir;
using nflash::testing::WriteText;

std::string WriteModel(const std::string& path, GgmlType type, int64_t experts = 0) {
  return nflash::testing::WriteSmallModel(path, type, experts);
}

// A profile with seeded random popularity and co-activation partners, bound to the model by its hash.
profiler::ModelProfile MakeProfile(const std::string& model_path, int64_t experts, uint64_t seed) {
  auto gguf = GgufFile::OpenPath(model_path);
  EXPECT_TRUE(gguf.ok());
  profiler::ModelProfile p;
  p.model_hash = HashToHex(*HashFile(model_path));
  p.model_name = "test";
  p.activation = "relu";
  p.n_layers = 2;
  p.n_ff = 96;
  p.dim = 64;
  p.n_experts = experts;
  p.tokens = 1000;
  std::mt19937_64 rng(seed);
  for (int64_t l = 0; l < 2; ++l) {
    for (int64_t e = experts > 0 ? 0 : -1; e < std::max<int64_t>(0, experts); ++e) {
      profiler::FfnProfile f;
      f.layer = l;
      f.expert = e;
      f.n_neurons = 96;
      f.tokens = 1000;
      f.coact_k = 3;
      for (int i = 0; i < 96; ++i) {
        f.count_bs1.push_back(static_cast<uint32_t>(rng() % 1000));
        for (int j = 0; j < 3; ++j) {
          f.coact_partner.push_back(static_cast<int32_t>(rng() % 96));
          f.coact_count.push_back(static_cast<uint32_t>(1 + rng() % 50));
        }
      }
      f.mean_active_fraction = 0.1;
      p.ffns.push_back(std::move(f));
    }
  }
  return p;
}

struct Packed {
  std::string model, dir;
  profiler::ModelProfile profile;
};

Packed PackSmall(const TempDir& tmp, GgmlType type, int64_t experts, NeuronOrder order, const std::string& name) {
  Packed p;
  p.model = tmp.File(name + ".gguf");
  EXPECT_EQ(WriteModel(p.model, type, experts), "");
  p.profile = MakeProfile(p.model, experts, 7);
  p.dir = tmp.File(name + ".deploy");
  PackOptions o;
  o.order = order;
  o.progress = false;
  ThreadPool pool(2);
  auto s = PackDeployment(p.model, p.profile, "0123456789abcdef", p.dir, o, &pool);
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return p;
}

// Checks every neuron of every region against the source model, computing the expected down column independently.
void ExpectBundlesMatchSource(const Packed& p) {
  auto d = Deployment::Open(p.dir);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  auto model = GgufFile::OpenPath(p.model);
  ASSERT_TRUE(model.ok());
  auto flash = ReadWholeFile((*d)->flash_path());
  ASSERT_TRUE(flash.ok());
  const Manifest& m = (*d)->manifest();
  const BundleLayout& l = m.layout;
  std::vector<uint8_t> scratch;
  for (const RegionInfo& r : m.regions) {
    const std::string b = "blk." + std::to_string(r.layer) + ".";
    const bool moe = r.expert >= 0;
    const GgufTensorInfo* g = model->FindTensor(b + (moe ? "ffn_gate_exps.weight" : "ffn_gate.weight"));
    const GgufTensorInfo* u = model->FindTensor(b + (moe ? "ffn_up_exps.weight" : "ffn_up.weight"));
    const GgufTensorInfo* dn = model->FindTensor(b + (moe ? "ffn_down_exps.weight" : "ffn_down.weight"));
    ASSERT_TRUE(g && u && dn);
    const size_t e = moe ? static_cast<size_t>(r.expert) : 0;
    std::vector<uint8_t> gs, us, ds;
    const uint8_t* gate = model->TensorData(*g, &gs)->data() + e * g->n_bytes / std::max<uint64_t>(1, g->dims.size() > 2 ? g->dims[2] : 1);
    const uint8_t* up = model->TensorData(*u, &us)->data() + e * u->n_bytes / std::max<uint64_t>(1, u->dims.size() > 2 ? u->dims[2] : 1);
    const uint8_t* down = model->TensorData(*dn, &ds)->data() + e * dn->n_bytes / std::max<uint64_t>(1, dn->dims.size() > 2 ? dn->dims[2] : 1);
    const size_t grow = *RowBytes(g->type, 64), urow = *RowBytes(u->type, 64), drow = *RowBytes(dn->type, 96);
    // The whole down matrix as floats (independent of the packer's code path).
    std::vector<float> down_f(64 * 96);
    for (int row = 0; row < 64; ++row) ASSERT_TRUE(DequantizeRow(dn->type, down + row * drow, &down_f[row * 96], 96).ok());
    for (int64_t n = 0; n < r.n_neurons; ++n) {
      const ByteRange br = (*d)->BundleRange(r.layer, r.expert, n);
      ASSERT_LE(br.offset + br.size, flash->size());
      const uint8_t* bundle = flash->data() + br.offset;
      ASSERT_TRUE((*d)->VerifyBundle(r.layer, r.expert, n, {bundle, br.size}).ok());
      ASSERT_EQ(0, std::memcmp(bundle + l.gate_offset, gate + n * grow, grow)) << "gate, layer " << r.layer << " neuron " << n;
      ASSERT_EQ(0, std::memcmp(bundle + l.up_offset, up + n * urow, urow)) << "up, layer " << r.layer << " neuron " << n;
      std::vector<uint8_t> want(l.down_bytes);
      if (dn->type == GgmlType::kF32 || dn->type == GgmlType::kF16) {
        // Exact: the column's raw elements.
        const size_t es = dn->type == GgmlType::kF32 ? 4 : 2;
        for (int row = 0; row < 64; ++row) std::memcpy(&want[row * es], down + row * drow + n * es, es);
      } else {
        std::vector<float> col(64);
        for (int row = 0; row < 64; ++row) col[row] = down_f[row * 96 + n];
        ASSERT_TRUE(QuantizeRow(dn->type, col.data(), want.data(), 64).ok());
      }
      ASSERT_EQ(0, std::memcmp(bundle + l.down_offset, want.data(), want.size())) << "down, layer " << r.layer << " neuron " << n;
      // Views point at the parts with the stored type.
      const BundleView v = ViewBundle(l, bundle, l.bundle_bytes);
      ASSERT_EQ(v.gate.data, bundle);
      ASSERT_EQ(v.down.type, l.down_type);
      ASSERT_EQ(v.down.cols, 64);
    }
    // Hot slots hold the most popular neurons in descending order.
    const profiler::FfnProfile* fp = p.profile.Find(r.layer, r.expert);
    for (int64_t s = 1; s < r.hot_count; ++s) {
      EXPECT_GE(fp->count_bs1[r.neuron_of_slot[s - 1]], fp->count_bs1[r.neuron_of_slot[s]]);
    }
  }
}

TEST(PackerLayoutTest, SmallBundlesSharePagesBigOnesArePadded) {
  auto small = MakeBundleLayout(64, GgmlType::kF32, GgmlType::kF32, GgmlType::kF32);
  ASSERT_TRUE(small.ok());
  EXPECT_EQ(small->bundle_bytes, 768u);
  EXPECT_EQ(small->slots_per_group, 5);  // floor(4096 / 768)
  EXPECT_EQ(small->group_bytes, 4096u);
  EXPECT_EQ(small->SlotOffset(6), 4096u + 768u);
  // llama-7b Q4_0: 3 x 2304 = 6912 bytes, one bundle per 8 KiB group.
  auto big = MakeBundleLayout(4096, GgmlType::kQ4_0, GgmlType::kQ4_0, GgmlType::kQ4_0);
  ASSERT_TRUE(big.ok());
  EXPECT_EQ(big->bundle_bytes, 6912u);
  EXPECT_EQ(big->slots_per_group, 1);
  EXPECT_EQ(big->group_bytes, 8192u);
  EXPECT_EQ(ColumnType(GgmlType::kQ4_0, 48), GgmlType::kF32);
  EXPECT_EQ(ColumnType(GgmlType::kQ8_0, 64), GgmlType::kQ8_0);
  EXPECT_FALSE(MakeBundleLayout(48, GgmlType::kQ8_0, GgmlType::kQ8_0, GgmlType::kF32).ok());
}

TEST(PackerOrderTest, HotCountAndOrders) {
  profiler::FfnProfile f;
  f.n_neurons = 6;
  f.count_bs1 = {1, 50, 10, 30, 0, 9};  // total 100; 50 alone covers half
  EXPECT_EQ(HotCount(f, -1), 1);
  EXPECT_EQ(HotCount(f, 0.5), 3);
  EXPECT_EQ(OrderNeurons(f, 1, NeuronOrder::kHotness), (std::vector<int32_t>{1, 3, 2, 5, 0, 4}));
  // Co-activation: chains start at the most popular cold neuron (3), follow its strongest unplaced partner.
  f.coact_k = 2;
  f.coact_partner = {-1, -1, /*1*/ 3, 2, /*2*/ -1, -1, /*3*/ 1, 4, /*4*/ 0, -1, /*5*/ -1, -1};
  f.coact_count = {0, 0, 9, 8, 0, 0, 9, 5, 3, 0, 0, 0};
  // hot = {1}; chain 3 -> (1 is hot) 4 -> 0; then 2; then 5.
  EXPECT_EQ(OrderNeurons(f, 1, NeuronOrder::kCoactivation), (std::vector<int32_t>{1, 3, 4, 0, 2, 5}));
}

// The ordering rules the example above does not reach: equal counts in index order, a hot fraction rounded to the
// nearest count, no hot neuron for a profile that saw nothing, and of a neuron's partners the first (strongest)
// unplaced one with a count, never one outside the region.
TEST(PackerOrderTest, TiesRoundingAndPartnerRules) {
  profiler::FfnProfile f;
  f.n_neurons = 6;
  f.count_bs1 = {4, 7, 4, 7, 4, 0};
  EXPECT_EQ(OrderNeurons(f, 0, NeuronOrder::kHotness), (std::vector<int32_t>{1, 3, 0, 2, 4, 5}));
  EXPECT_EQ(HotCount(f, 0.45), 3);  // 2.7 neurons
  EXPECT_EQ(HotCount(f, 0.40), 2);  // 2.4
  EXPECT_EQ(HotCount(f, 0.0), 0);
  EXPECT_EQ(HotCount(f, 1.0), 6);
  profiler::FfnProfile silent = f;
  silent.count_bs1.assign(6, 0);
  EXPECT_EQ(HotCount(silent, -1), 0);

  // hot = {1}. Neuron 3 (the first cold one) lists 0 (count 0: never seen together), 2, then 4: the chain takes 2.
  // Neuron 2 lists 6 (outside the region) and 3 (placed): the chain ends. Next chain: 0 -> 4 (strongest) -> 5.
  f.coact_k = 3;
  f.coact_partner = {/*0*/ 4, 5, -1, /*1*/ 0, -1, -1, /*2*/ 6, 3, -1, /*3*/ 0, 2, 4, /*4*/ 5, 0, -1, /*5*/ -1, -1, -1};
  f.coact_count = {/*0*/ 6, 5, 0, /*1*/ 9, 0, 0, /*2*/ 9, 8, 0, /*3*/ 0, 7, 6, /*4*/ 3, 2, 0, /*5*/ 0, 0, 0};
  EXPECT_EQ(OrderNeurons(f, 1, NeuronOrder::kCoactivation), (std::vector<int32_t>{1, 3, 2, 0, 4, 5}));
}

class PackerTypeTest : public ::testing::TestWithParam<GgmlType> {};

TEST_P(PackerTypeTest, EveryNeuronMatchesTheSource) {
  TempDir tmp;
  Packed p = PackSmall(tmp, GetParam(), 0, NeuronOrder::kCoactivation, "m");
  ExpectBundlesMatchSource(p);
  auto v = VerifyDeployment(p.dir, false);
  EXPECT_TRUE(v.ok()) << v.status().ToString();
  // resident.gguf keeps attention and metadata, drops FFN neuron tensors.
  auto r = GgufFile::OpenPath(p.dir + "/resident.gguf");
  ASSERT_TRUE(r.ok());
  EXPECT_NE(r->FindTensor("blk.0.attn_q.weight"), nullptr);
  EXPECT_NE(r->FindTensor("blk.1.ffn_norm.weight"), nullptr);
  EXPECT_EQ(r->FindTensor("blk.0.ffn_gate.weight"), nullptr);
  EXPECT_TRUE(r->GetUint("llama.block_count").ok());
}

INSTANTIATE_TEST_SUITE_P(Types, PackerTypeTest,
                         ::testing::Values(GgmlType::kF32, GgmlType::kF16, GgmlType::kQ8_0, GgmlType::kQ4_0),
                         [](const auto& info) { return std::string(GgmlTypeName(info.param)); });

TEST(PackerTest, MoeExpertsAreSeparateRegions) {
  TempDir tmp;
  Packed p = PackSmall(tmp, GgmlType::kQ8_0, 4, NeuronOrder::kHotness, "moe");
  ExpectBundlesMatchSource(p);
  auto d = Deployment::Open(p.dir);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ((*d)->manifest().regions.size(), 8u);
  EXPECT_NE((*d)->Region(1, 3), nullptr);
  EXPECT_EQ((*d)->Region(1, -1), nullptr);
}

// An expert's active neurons per token count the tokens routed to it: an expert that 250 of 1000 tokens ran, with 20%
// of its 96 neurons active on each, expects 0.25 * 0.2 * 96 = 4.8 per token of the model.
TEST(PackerTest, MoeActivePerTokenCountsTheRouting) {
  TempDir tmp;
  ThreadPool pool(2);
  const std::string model = tmp.File("moe.gguf");
  ASSERT_EQ(WriteModel(model, GgmlType::kQ8_0, 4), "");
  profiler::ModelProfile prof = MakeProfile(model, 4, 7);
  const int64_t routed[4] = {250, 1000, 0, 600};
  const double fraction[4] = {0.2, 0.05, 0.5, 0.125};
  for (profiler::FfnProfile& f : prof.ffns) {
    f.tokens = routed[f.expert];
    f.mean_active_fraction = fraction[f.expert];
  }
  PackOptions o;
  o.progress = false;
  ASSERT_TRUE(PackDeployment(model, prof, "x", tmp.File("d"), o, &pool).ok());
  auto d = Deployment::Open(tmp.File("d"));
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  const double expected[4] = {4.8, 4.8, 0.0, 7.2};
  for (const RegionInfo& r : (*d)->manifest().regions) {
    EXPECT_NEAR(r.active_per_token, expected[r.expert], 1e-12) << "layer " << r.layer << " expert " << r.expert;
  }
  // The bundles a token needs with no cache: 2 layers of 16.8 routed active neurons, not every expert's fraction.
  const Manifest& m = (*d)->manifest();
  EXPECT_NEAR(m.expected_bytes_per_token, 2 * 16.8 * static_cast<double>(m.layout.bundle_bytes), 1e-9);
}

// --- corrupt / truncated / mismatched deployments ---------------------------------------------------------------

void FlipByte(const std::string& path, uint64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x40);
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(&c, 1);
}

TEST(PackerCorruptionTest, FlippedBundleByteNamesLayerNeuronOffset) {
  TempDir tmp;
  Packed p = PackSmall(tmp, GgmlType::kF16, 0, NeuronOrder::kHotness, "c");
  auto d = Deployment::Open(p.dir);
  ASSERT_TRUE(d.ok());
  const ByteRange br = (*d)->UpDownRange(1, -1, 17);
  FlipByte((*d)->flash_path(), br.offset + 5);
  auto v = VerifyDeployment(p.dir, false);
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.status().code(), StatusCode::kCorruption);
  const std::string msg = v.status().message();
  EXPECT_NE(msg.find("layer 1 neuron 17"), std::string::npos) << msg;
  EXPECT_NE(msg.find("offset " + std::to_string(br.offset)), std::string::npos) << msg;
  EXPECT_NE(msg.find(": xxh3 "), std::string::npos) << msg;  // names the function it checked with
}

TEST(PackerCorruptionTest, NonZeroPaddingIsDetected) {
  TempDir tmp;
  Packed p = PackSmall(tmp, GgmlType::kF32, 0, NeuronOrder::kHotness, "pad");
  auto d = Deployment::Open(p.dir);
  ASSERT_TRUE(d.ok());
  const BundleLayout& l = (*d)->layout();
  ASSERT_GT(l.group_bytes, l.slots_per_group * l.bundle_bytes);
  FlipByte((*d)->flash_path(), l.group_bytes - 1);
  auto v = VerifyDeployment(p.dir, false);
  ASSERT_FALSE(v.ok());
  EXPECT_NE(v.status().message().find("padding byte at offset " + std::to_string(l.group_bytes - 1)), std::string::npos)
      << v.status().message();
}

TEST(PackerCorruptionTest, TruncatedWrongVersionOtherModelResident) {
  TempDir tmp;
  Packed a = PackSmall(tmp, GgmlType::kF32, 0, NeuronOrder::kHotness, "a");
  Packed b = PackSmall(tmp, GgmlType::kQ8_0, 0, NeuronOrder::kHotness, "b");
  // Manifest of another model's deployment dropped in: ffn.bin size disagrees.
  fs::copy(a.dir, tmp.File("a2.deploy"));
  fs::copy_file(b.dir + "/manifest.json", tmp.File("a2.deploy/manifest.json"), fs::copy_options::overwrite_existing);
  auto other = Deployment::Open(tmp.File("a2.deploy"));
  ASSERT_FALSE(other.ok());
  EXPECT_NE(other.status().message().find("flash_bytes"), std::string::npos) << other.status().message();
  // Truncated ffn.bin.
  fs::resize_file(a.dir + "/ffn.bin", fs::file_size(a.dir + "/ffn.bin") - 4096);
  auto t = Deployment::Open(a.dir);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("truncated"), std::string::npos) << t.status().message();
  // Wrong schema version.
  auto text = ReadWholeFile(b.dir + "/manifest.json");
  std::string s(text->begin(), text->end());
  const size_t at = s.find("\"schema_version\": 1");
  ASSERT_NE(at, std::string::npos);
  std::string bumped = s;
  bumped.replace(at, 19, "\"schema_version\": 9");
  WriteText(b.dir + "/manifest.json", bumped);
  auto w = Deployment::Open(b.dir);
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(w.status().message().find("schema_version 9"), std::string::npos) << w.status().message();
  // resident.gguf modified: verify's hash check catches it.
  WriteText(b.dir + "/manifest.json", s);
  ASSERT_TRUE(VerifyDeployment(b.dir, false).ok());
  FlipByte(b.dir + "/resident.gguf", fs::file_size(b.dir + "/resident.gguf") - 3);
  auto r = VerifyDeployment(b.dir, false);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("resident.gguf: xxHash64"), std::string::npos) << r.status().message();
}

TEST(PackerCorruptionTest, ProfileOfAnotherModelAndOverwriteRefused) {
  TempDir tmp;
  Packed a = PackSmall(tmp, GgmlType::kF32, 0, NeuronOrder::kHotness, "a");
  const std::string other = tmp.File("other.gguf");
  ASSERT_EQ(WriteModel(other, GgmlType::kF16), "");
  ThreadPool pool(1);
  PackOptions o;
  o.progress = false;
  auto s = PackDeployment(other, a.profile, "x", tmp.File("o.deploy"), o, &pool);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find(a.profile.model_hash), std::string::npos) << s.status().message();
  EXPECT_FALSE(fs::exists(tmp.File("o.deploy")));
  auto again = PackDeployment(a.model, a.profile, "x", a.dir, o, &pool);
  ASSERT_FALSE(again.ok());
  EXPECT_NE(again.status().message().find("--force"), std::string::npos);
  o.overwrite = true;
  o.hot_fraction = 0.25;
  auto forced = PackDeployment(a.model, a.profile, "x", a.dir, o, &pool);
  ASSERT_TRUE(forced.ok()) << forced.status().ToString();
  auto d = Deployment::Open(a.dir);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ((*d)->Region(0, -1)->hot_count, 24);
}

// --- per-neuron checksums: XXH3 (new packs) and xxHash64 (packs made before manifest field bundle_hash) ---------

TEST(ChecksumTest, Xxh3IsLibxxhashXxh3) {
  // Published values for empty input (xxHash's test vectors): XXH64 seed 0 and XXH3_64bits.
  EXPECT_EQ(Xxh64(nullptr, 0), 0xEF46DB3751D8E999ull);
  EXPECT_EQ(Xxh3(nullptr, 0), 0x2D06800538D394C2ull);
  // Xxh3 goes through libxxhash's run-time dispatch (AVX-512/AVX2 here); XXH3_64bits is its baseline SSE2 build: the
  // two must agree on every length class (0-16, 17-128, 129-240, long) and alignment.
  std::vector<uint8_t> buf(10000 + 64);
  std::mt19937_64 rng(3);
  for (auto& b : buf) b = static_cast<uint8_t>(rng());
  for (size_t n : {size_t{1}, size_t{3}, size_t{16}, size_t{17}, size_t{128}, size_t{129}, size_t{240}, size_t{241},
                   size_t{1024}, size_t{2304}, size_t{4608}, size_t{6912}, size_t{8192}, size_t{10000}}) {
    for (size_t misalign : {size_t{0}, size_t{1}, size_t{7}, size_t{32}}) {
      const uint8_t* p = buf.data() + misalign;
      ASSERT_EQ(Xxh3(p, n), XXH3_64bits(p, n)) << n << " bytes at +" << misalign;
      ASSERT_NE(Xxh3(p, n), Xxh64(p, n));
    }
  }
  EXPECT_EQ(*ParseBundleHash("xxh3"), BundleHash::kXxh3);
  EXPECT_EQ(*ParseBundleHash("xxh64"), BundleHash::kXxh64);
  EXPECT_STREQ(BundleHashName(BundleHash::kXxh3), "xxh3");
  EXPECT_STREQ(BundleHashName(BundleHash::kXxh64), "xxh64");
  EXPECT_FALSE(ParseBundleHash("XXH3").ok());
}

nlohmann::json ReadJson(const std::string& path) {
  auto text = ReadWholeFile(path);
  EXPECT_TRUE(text.ok()) << path;
  return nlohmann::json::parse(std::string(text->begin(), text->end()));
}

// Hashes of every neuron's gate part and up+down part, computed here from ffn.bin and resident.gguf's slot table
// with `hash_fn` (libxxhash called directly, not the code under test). Indexed [region][neuron].
struct PartHashes {
  std::vector<std::vector<uint64_t>> gate, updown;
};
PartHashes HashParts(const std::string& dir, uint64_t (*hash_fn)(const void*, size_t)) {
  PartHashes h;
  const nlohmann::json m = ReadJson(dir + "/manifest.json");
  auto flash = ReadWholeFile(dir + "/ffn.bin");
  EXPECT_TRUE(flash.ok());
  auto resident = GgufFile::OpenPath(dir + "/resident.gguf");
  EXPECT_TRUE(resident.ok());
  const auto& b = m["bundle"];
  const uint64_t spg = b["slots_per_group"], group = b["group_bytes"], bundle = b["bundle_bytes"];
  const uint64_t gate_bytes = b["gate_bytes"], up_offset = b["up_offset"];
  for (const auto& r : m["regions"]) {
    const std::string prefix = IndexTensorPrefix(r["layer"], r["expert"]);
    const GgufTensorInfo* t = resident->FindTensor(prefix + ".slot_of_neuron");
    EXPECT_NE(t, nullptr) << prefix;
    if (!t) return h;
    std::vector<uint8_t> scratch;
    const auto* slots = reinterpret_cast<const int32_t*>(resident->TensorData(*t, &scratch)->data());
    std::vector<uint64_t> g, ud;
    for (int64_t n = 0; n < r["n_neurons"].get<int64_t>(); ++n) {
      const auto slot = static_cast<uint64_t>(slots[n]);
      const uint8_t* at = flash->data() + r["offset"].get<uint64_t>() + slot / spg * group + slot % spg * bundle;
      g.push_back(hash_fn(at, gate_bytes));
      ud.push_back(hash_fn(at + up_offset, bundle - up_offset));
    }
    h.gate.push_back(std::move(g));
    h.updown.push_back(std::move(ud));
  }
  return h;
}
uint64_t LibXxh3(const void* p, size_t n) { return XXH3_64bits(p, n); }
uint64_t LibXxh64(const void* p, size_t n) { return XXH64(p, n, 0); }

// The I64 table `name` of resident.gguf as uint64 bit patterns (empty when missing).
std::vector<uint64_t> ReadTable(const GgufFile& f, const std::string& name) {
  const GgufTensorInfo* t = f.FindTensor(name);
  if (!t || t->type != GgmlType::kI64) return {};
  std::vector<uint8_t> scratch;
  auto bytes = f.TensorData(*t, &scratch);
  std::vector<uint64_t> v(bytes->size() / 8);
  std::memcpy(v.data(), bytes->data(), bytes->size());
  return v;
}

// Rewrites a deployment packed by this nflash into what `nflash pack` wrote before bundle_hash existed: index tables
// <prefix>.gate_xxh64 / .updown_xxh64 holding xxHash64 values (computed here with libxxhash), a manifest without
// bundle_hash, resident_hash and resident_bytes updated.
void MakeLegacy(const std::string& dir) {
  const PartHashes old = HashParts(dir, LibXxh64);
  nlohmann::json m = ReadJson(dir + "/manifest.json");
  const std::string resident_path = dir + "/resident.gguf";
  std::map<std::string, std::pair<std::string, const std::vector<uint64_t>*>> renamed;
  for (size_t i = 0; i < m["regions"].size(); ++i) {
    const auto& r = m["regions"][i];
    const std::string prefix = IndexTensorPrefix(r["layer"], r["expert"]);
    renamed[prefix + ".gate_xxh3"] = {prefix + ".gate_xxh64", &old.gate[i]};
    renamed[prefix + ".updown_xxh3"] = {prefix + ".updown_xxh64", &old.updown[i]};
  }
  int replaced = 0;
  ASSERT_EQ(nflash::testing::RewriteGguf(resident_path, resident_path, nullptr,
                                         [&](nflash::testing::GgufTensorCopy* t) {
                                           auto it = renamed.find(t->name);
                                           if (it == renamed.end()) return;
                                           const std::vector<uint64_t>& v = *it->second.second;
                                           t->name = it->second.first;
                                           const auto* p = reinterpret_cast<const uint8_t*>(v.data());
                                           t->bytes.assign(p, p + v.size() * 8);
                                           ++replaced;
                                         }),
            "");
  ASSERT_EQ(replaced, static_cast<int>(2 * m["regions"].size()));
  m.erase("bundle_hash");
  m["resident_hash"] = HashToHex(*HashFile(resident_path));
  m["resident_bytes"] = fs::file_size(resident_path);
  WriteText(dir + "/manifest.json", m.dump(1) + "\n");
}

// Flips single bytes in an in-memory copy of one bundle: the gate part, the up part and the down part are each
// caught by the deployment's own hash function, named in the message.
void ExpectFlipsDetected(const Deployment& d, const std::string& hash_name) {
  auto flash = ReadWholeFile(d.flash_path());
  ASSERT_TRUE(flash.ok());
  const BundleLayout& l = d.layout();
  const ByteRange br = d.BundleRange(1, -1, 17);
  std::vector<uint8_t> bundle(flash->begin() + br.offset, flash->begin() + br.offset + br.size);
  ASSERT_TRUE(d.VerifyBundle(1, -1, 17, bundle).ok());
  for (uint64_t at : {l.gate_offset + 3, l.up_offset + 1, l.down_offset + l.down_bytes - 1}) {
    std::vector<uint8_t> bad = bundle;
    bad[at] ^= 0x01;
    const Status s = d.VerifyBundle(1, -1, 17, bad);
    ASSERT_FALSE(s.ok()) << "byte " << at;
    EXPECT_EQ(s.code(), StatusCode::kCorruption);
    EXPECT_NE(s.message().find(": " + hash_name + " "), std::string::npos) << s.message();
    const bool in_gate = at < l.gate_bytes;
    const std::span<const uint8_t> all(bad);
    EXPECT_EQ(d.VerifyGate(1, -1, 17, all.subspan(0, l.gate_bytes)).ok(), !in_gate);
    EXPECT_EQ(d.VerifyUpDown(1, -1, 17, all.subspan(l.up_offset)).ok(), in_gate);
  }
}

TEST(PackerHashTest, NewPackRecordsXxh3AndItsTablesAreXxh3) {
  TempDir tmp;
  Packed p = PackSmall(tmp, GgmlType::kQ8_0, 0, NeuronOrder::kCoactivation, "x3");
  const nlohmann::json m = ReadJson(p.dir + "/manifest.json");
  EXPECT_EQ(m["bundle_hash"], "xxh3");
  EXPECT_EQ(m["schema_version"], 1);
  const PartHashes want = HashParts(p.dir, LibXxh3);
  ASSERT_EQ(want.gate.size(), 2u);
  auto resident = GgufFile::OpenPath(p.dir + "/resident.gguf");
  ASSERT_TRUE(resident.ok());
  for (int64_t layer = 0; layer < 2; ++layer) {
    const std::string prefix = IndexTensorPrefix(layer, -1);
    EXPECT_EQ(ReadTable(*resident, prefix + ".gate_xxh3"), want.gate[layer]) << prefix;
    EXPECT_EQ(ReadTable(*resident, prefix + ".updown_xxh3"), want.updown[layer]) << prefix;
    // The names must not lie: no *_xxh64 tables in an XXH3 pack.
    EXPECT_EQ(resident->FindTensor(prefix + ".gate_xxh64"), nullptr);
    EXPECT_EQ(resident->FindTensor(prefix + ".updown_xxh64"), nullptr);
  }
  // And the values really are XXH3, not xxHash64.
  EXPECT_NE(HashParts(p.dir, LibXxh64).gate[0], want.gate[0]);
  auto d = Deployment::Open(p.dir);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ((*d)->manifest().bundle_hash, BundleHash::kXxh3);
  ExpectFlipsDetected(**d, "xxh3");
}

TEST(PackerHashTest, OldDeploymentWithoutBundleHashStillVerifies) {
  TempDir tmp;
  Packed p = PackSmall(tmp, GgmlType::kF16, 0, NeuronOrder::kHotness, "old");
  MakeLegacy(p.dir);
  ASSERT_FALSE(ReadJson(p.dir + "/manifest.json").contains("bundle_hash"));
  {
    auto d = Deployment::Open(p.dir);
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    EXPECT_EQ((*d)->manifest().bundle_hash, BundleHash::kXxh64);
    ExpectFlipsDetected(**d, "xxh64");
  }
  ExpectBundlesMatchSource(p);  // VerifyBundle on every neuron
  auto v = VerifyDeployment(p.dir, false);
  ASSERT_TRUE(v.ok()) << v.status().ToString();
  // A flipped byte on disk under xxHash64.
  const ByteRange br = (*Deployment::Open(p.dir))->GateRange(0, -1, 40);
  FlipByte(p.dir + "/ffn.bin", br.offset + 2);
  auto bad = VerifyDeployment(p.dir, false);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kCorruption);
  EXPECT_NE(bad.status().message().find("layer 0 neuron 40"), std::string::npos) << bad.status().message();
  EXPECT_NE(bad.status().message().find(": xxh64 "), std::string::npos) << bad.status().message();
}

TEST(PackerHashTest, ManifestAndTableNamesMustAgree) {
  TempDir tmp;
  Packed p = PackSmall(tmp, GgmlType::kF32, 0, NeuronOrder::kHotness, "mix");
  const std::string manifest = p.dir + "/manifest.json";
  const nlohmann::json good = ReadJson(manifest);
  // XXH3 tables under a manifest without the field (= xxh64): refused, never checked with the wrong function.
  nlohmann::json m = good;
  m.erase("bundle_hash");
  WriteText(manifest, m.dump(1));
  auto d = Deployment::Open(p.dir);
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("missing index tensor \"nflash.deploy.blk.0.gate_xxh64\""), std::string::npos)
      << d.status().message();
  // An old deployment whose manifest claims xxh3.
  WriteText(manifest, good.dump(1));
  MakeLegacy(p.dir);
  m = ReadJson(manifest);
  m["bundle_hash"] = "xxh3";
  WriteText(manifest, m.dump(1));
  d = Deployment::Open(p.dir);
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("gate_xxh3"), std::string::npos) << d.status().message();
}

TEST(PackerHashTest, UnknownBundleHashIsAClearError) {
  TempDir tmp;
  Packed p = PackSmall(tmp, GgmlType::kF32, 0, NeuronOrder::kHotness, "unk");
  const std::string manifest = p.dir + "/manifest.json";
  nlohmann::json m = ReadJson(manifest);
  m["bundle_hash"] = "sha256";
  WriteText(manifest, m.dump(1));
  auto d = Deployment::Open(p.dir);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), StatusCode::kUnsupported);
  const std::string msg = d.status().message();
  for (const char* want : {"manifest.json", "bundle_hash", "\"xxh3\"", "\"xxh64\"", "found \"sha256\""}) {
    EXPECT_NE(msg.find(want), std::string::npos) << want << " in: " << msg;
  }
  m["bundle_hash"] = 3;  // wrong JSON type
  WriteText(manifest, m.dump(1));
  d = Deployment::Open(p.dir);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), StatusCode::kCorruption);
  EXPECT_NE(d.status().message().find("bundle_hash"), std::string::npos) << d.status().message();
}


// The default order is co-activation chains; the manifest names the order the layout really has, so a profile
// without co-activation partners gives (and records) popularity order.
TEST(PackerOrderTest, DefaultChainsAndFallsBackToPopularityWithoutPartners) {
  TempDir tmp;
  ThreadPool pool(2);
  const std::string model = tmp.File("m.gguf");
  ASSERT_EQ(WriteModel(model, GgmlType::kF32), "");
  profiler::ModelProfile with = MakeProfile(model, 0, 7);
  ASSERT_GT(with.ffns.at(0).coact_k, 0);
  profiler::ModelProfile without = with;
  for (auto& f : without.ffns) {
    f.coact_k = 0;
    f.coact_partner.clear();
    f.coact_count.clear();
  }
  PackOptions o;  // defaults
  o.progress = false;
  ASSERT_TRUE(PackDeployment(model, with, "x", tmp.File("with.deploy"), o, &pool).ok());
  ASSERT_TRUE(PackDeployment(model, without, "x", tmp.File("without.deploy"), o, &pool).ok());
  auto dw = Deployment::Open(tmp.File("with.deploy"));
  auto dn = Deployment::Open(tmp.File("without.deploy"));
  ASSERT_TRUE(dw.ok() && dn.ok());
  EXPECT_EQ((*dw)->manifest().order, "coactivation");
  EXPECT_EQ((*dn)->manifest().order, "hotness");
  // Each layout is what OrderNeurons gives for that order, and the two differ (the partners changed the chains).
  const profiler::FfnProfile& f = *with.Find(0);
  const RegionInfo& rw = *(*dw)->Region(0, -1);
  const RegionInfo& rn = *(*dn)->Region(0, -1);
  EXPECT_EQ(rw.neuron_of_slot, OrderNeurons(f, rw.hot_count, NeuronOrder::kCoactivation));
  EXPECT_EQ(rn.neuron_of_slot, OrderNeurons(f, rn.hot_count, NeuronOrder::kHotness));
  EXPECT_NE(rw.neuron_of_slot, rn.neuron_of_slot);
}

}  // namespace
}  // namespace nflash::packer

namespace nflash::packer {
namespace {

// A predictor of dim 64 with normal(0, 0.3) weights: one layer per rank of `ranks`, `n_ff` outputs each.
PredictorData RandomPredictor(const std::string& model_hash, uint64_t seed, int64_t n_ff,
                              const std::vector<int64_t>& ranks) {
  PredictorData pd;
  pd.model_hash = model_hash;
  pd.model_name = "test";
  pd.activation = "relu";
  pd.dim = 64;
  pd.n_ff = n_ff;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.3f);
  for (int64_t rank : ranks) {
    PredictorLayerData ld;
    ld.info.rank = rank;
    ld.fc1.resize(static_cast<size_t>(rank * 64));
    ld.fc2.resize(static_cast<size_t>(n_ff * rank));
    for (float& w : ld.fc1) w = normal(rng);
    for (float& w : ld.fc2) w = normal(rng);
    pd.layers.push_back(std::move(ld));
  }
  return pd;
}

// A predictor for PackSmall's 2-layer model (dim 64, n_ff 96) with ranks 8 and 16, weights N(0, 0.3) from `seed`.
PredictorData SmallPredictor(const std::string& model_path, uint64_t seed) {
  return RandomPredictor(HashToHex(*HashFile(model_path)), seed, 96, {8, 16});
}

// A pack with a predictor writes lookahead.gguf (manifest: hash and size): row k of layer 0's table is layer 1's fc1
// times (layer 1's ffn_norm * layer 0's down column k), computed here in double from the source model's down matrix
// (an F32 model: the bundles hold the columns exactly); the hits' share of the guess through the table equals the
// same product of their down sum.
TEST(PackerLookaheadTest, TableRowsAreTheNextFc1OfTheNormalisedDownColumns) {
  TempDir tmp;
  const std::string model_path = tmp.File("m.gguf");
  ASSERT_EQ(WriteModel(model_path, GgmlType::kF32), "");
  const PredictorData pd = SmallPredictor(model_path, 5);
  ASSERT_TRUE(SavePredictor(pd, tmp.File("p.gguf"), false).ok());
  PackOptions o;
  o.progress = false;
  o.predictor_path = tmp.File("p.gguf");
  ThreadPool pool(2);
  auto packed = PackDeployment(model_path, MakeProfile(model_path, 0, 3), "x", tmp.File("d"), o, &pool);
  ASSERT_TRUE(packed.ok()) << packed.status().ToString();
  auto d = Deployment::Open(tmp.File("d"), Deployment::Options{.verify_resident_hash = true});
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  const Manifest& m = (*d)->manifest();
  ASSERT_FALSE(m.lookahead_hash.empty());
  EXPECT_EQ(m.lookahead_bytes, fs::file_size((*d)->lookahead_path()));
  auto pred = Predictor::Load((*d)->predictor_path());
  ASSERT_TRUE(pred.ok()) << pred.status().ToString();
  auto table = LookaheadTable::Load((*d)->lookahead_path(), **pred);
  ASSERT_TRUE(table.ok()) << table.status().ToString();
  EXPECT_EQ((*table)->bytes(), 96u * 16u * 2u) << "one layer (the last has no next), rank 16, F16";
  const MatrixView& t = (*table)->layer(0);
  ASSERT_EQ(t.rows, 96);
  ASSERT_EQ(t.cols, 16);

  auto model = GgufFile::OpenPath(model_path);
  ASSERT_TRUE(model.ok());
  std::vector<uint8_t> s1, s2;
  const GgufTensorInfo* down = model->FindTensor("blk.0.ffn_down.weight");  // 64 rows of 96
  const GgufTensorInfo* norm = model->FindTensor("blk.1.ffn_norm.weight");
  ASSERT_TRUE(down && norm && down->type == GgmlType::kF32 && norm->type == GgmlType::kF32);
  const float* dn = reinterpret_cast<const float*>(model->TensorData(*down, &s1)->data());
  const float* w = reinterpret_cast<const float*>(model->TensorData(*norm, &s2)->data());
  const std::vector<float>& fc1 = pd.layers[1].fc1;  // 16 x 64
  auto row = [&](int64_t k, int64_t r) {
    return Fp16ToFp32(reinterpret_cast<const uint16_t*>(static_cast<const uint8_t*>(t.data) + k * t.row_bytes)[r]);
  };
  for (int64_t k = 0; k < 96; ++k) {
    for (int64_t r = 0; r < 16; ++r) {
      double want = 0.0;
      for (int64_t i = 0; i < 64; ++i) want += static_cast<double>(fc1[r * 64 + i]) * w[i] * dn[i * 96 + k];
      ASSERT_NEAR(row(k, r), want, 2e-3 * (1.0 + std::fabs(want))) << "neuron " << k << " unit " << r;
    }
  }
  // The guess's hidden layer: fc1 . (w * residual) + sum over hits of h * row == fc1 . (w * (residual + sum h down)).
  std::mt19937_64 rng(9);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> resid(64), v(64), wr(64);
  for (float& x : resid) x = normal(rng);
  v = resid;
  std::vector<int32_t> hits;
  std::vector<float> h;
  for (int32_t k = 0; k < 96; k += 7) {
    hits.push_back(k);
    h.push_back(normal(rng));
    for (int64_t i = 0; i < 64; ++i) v[i] += h.back() * dn[i * 96 + k];
  }
  for (int64_t i = 0; i < 64; ++i) wr[i] = w[i] * resid[i];
  PredictorScratch scratch;
  (*pred)->PrepareScratch(&scratch);
  (*pred)->Hidden(1, wr.data(), &scratch, nullptr);
  AccumulateRows(t, hits, h.data(), scratch.hidden.data(), nullptr);
  for (int64_t r = 0; r < 16; ++r) {
    double want = 0.0;
    for (int64_t i = 0; i < 64; ++i) want += static_cast<double>(fc1[r * 64 + i]) * w[i] * v[i];
    EXPECT_NEAR(scratch.hidden[r], want, 5e-3 * (1.0 + std::fabs(want))) << "unit " << r;
  }
}

// The table is checked against the predictor it serves and against corruption: another predictor's ranks, a file
// that is not a table, a modified or truncated file (manifest hash and size), a MoE predictor, layers out of order.
TEST(PackerLookaheadTest, MismatchesAndCorruptionAreClearErrors) {
  TempDir tmp;
  const std::string model_path = tmp.File("m.gguf");
  ASSERT_EQ(WriteModel(model_path, GgmlType::kQ8_0), "");
  ASSERT_TRUE(SavePredictor(SmallPredictor(model_path, 5), tmp.File("p.gguf"), false).ok());
  PackOptions o;
  o.progress = false;
  o.predictor_path = tmp.File("p.gguf");
  ThreadPool pool(2);
  ASSERT_TRUE(PackDeployment(model_path, MakeProfile(model_path, 0, 3), "x", tmp.File("d"), o, &pool).ok());
  const std::string table_path = tmp.File("d/lookahead.gguf");
  ASSERT_TRUE(fs::exists(table_path));

  PredictorData wider = SmallPredictor(model_path, 5);
  wider.layers[1].info.rank = 8;
  wider.layers[1].fc1.resize(8 * 64);
  wider.layers[1].fc2.resize(96 * 8);
  auto other = Predictor::FromData(wider);
  ASSERT_TRUE(other.ok()) << other.status().ToString();
  auto mismatch = LookaheadTable::Load(table_path, **other);
  ASSERT_FALSE(mismatch.ok());
  EXPECT_NE(mismatch.status().message().find("blk.0.proj is f16 [16 x 96], expected f16 [8 x 96]"), std::string::npos)
      << mismatch.status().message();
  auto own = Predictor::Load(tmp.File("p.gguf"));
  ASSERT_TRUE(own.ok());
  auto not_table = LookaheadTable::Load(tmp.File("p.gguf"), **own);
  ASSERT_FALSE(not_table.ok());
  EXPECT_NE(not_table.status().message().find("expected \"nflash-lookahead\""), std::string::npos)
      << not_table.status().message();
  // A table of another schema version, and one missing a layer's projection.
  ASSERT_EQ(nflash::testing::RewriteGguf(
                table_path, tmp.File("v9.gguf"),
                nflash::testing::EditGgufKey("nflash.lookahead.schema_version", [](GgufValue& v) { v = uint32_t{9}; }),
                nullptr),
            "");
  auto v9 = LookaheadTable::Load(tmp.File("v9.gguf"), **own);
  ASSERT_FALSE(v9.ok());
  EXPECT_EQ(v9.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(v9.status().message().find("nflash.lookahead.schema_version 9"), std::string::npos)
      << v9.status().message();
  std::string renamed;
  ASSERT_EQ(nflash::testing::RewriteGguf(table_path, tmp.File("hole.gguf"), nullptr,
                                         [&](nflash::testing::GgufTensorCopy* t) {
                                           if (!t->name.ends_with("blk.0.proj")) return;
                                           renamed = t->name;
                                           t->name += "x";
                                         }),
            "");
  ASSERT_FALSE(renamed.empty());
  auto hole = LookaheadTable::Load(tmp.File("hole.gguf"), **own);
  ASSERT_FALSE(hole.ok());
  EXPECT_NE(hole.status().message().find("no tensor " + renamed), std::string::npos) << hole.status().message();

  FlipByte(table_path, fs::file_size(table_path) - 5);
  auto flipped = VerifyDeployment(tmp.File("d"), false);
  ASSERT_FALSE(flipped.ok());
  EXPECT_NE(flipped.status().message().find("lookahead.gguf"), std::string::npos) << flipped.status().message();
  fs::resize_file(table_path, fs::file_size(table_path) - 2);
  auto cut = Deployment::Open(tmp.File("d"));
  ASSERT_FALSE(cut.ok());
  EXPECT_NE(cut.status().message().find("records lookahead_bytes"), std::string::npos) << cut.status().message();

  // A mixture of experts gets no table; layers are written in order.
  PredictorData moe = SmallPredictor(model_path, 5);
  moe.n_experts = 2;
  moe.layers.push_back(moe.layers[0]);
  moe.layers.push_back(moe.layers[1]);
  auto moe_pred = Predictor::FromData(moe);
  ASSERT_TRUE(moe_pred.ok()) << moe_pred.status().ToString();
  auto moe_writer = LookaheadTableWriter::Begin(tmp.File("moe.gguf"), **moe_pred);
  ASSERT_FALSE(moe_writer.ok());
  EXPECT_EQ(moe_writer.status().code(), StatusCode::kUnsupported);
  auto writer = LookaheadTableWriter::Begin(tmp.File("t.gguf"), **own);
  ASSERT_TRUE(writer.ok()) << writer.status().ToString();
  std::vector<float> ones(64, 1.0f);
  auto column = [](int64_t, float* dst) {
    std::fill(dst, dst + 64, 0.5f);
    return Status::Ok();
  };
  EXPECT_FALSE((*writer)->WriteLayer(1, ones.data(), column, nullptr).ok()) << "the last layer has no table";
  EXPECT_TRUE((*writer)->WriteLayer(0, ones.data(), column, nullptr).ok());
  EXPECT_TRUE((*writer)->Finish().ok());
}

// Regions of more neurons than one projection call takes (256 columns): 600 neurons in calls of 256, 256 and 88, for
// two tables of different ranks (the next layer's: 16 and 12), each row against a double-precision product.
TEST(PackerLookaheadTest, WideRegionsAreProjectedInSeveralCalls) {
  TempDir tmp;
  const PredictorData pd = RandomPredictor("0000000000000000", 11, 600, {8, 16, 12});
  auto pred = Predictor::FromData(pd);
  ASSERT_TRUE(pred.ok()) << pred.status().ToString();
  const std::string path = tmp.File("t.gguf");
  auto writer = LookaheadTableWriter::Begin(path, **pred);
  ASSERT_TRUE(writer.ok()) << writer.status().ToString();
  auto value = [](int64_t l, int64_t k, int64_t i) {
    return std::sin(0.37 * static_cast<double>(k) + 0.11 * static_cast<double>(i) + static_cast<double>(l));
  };
  std::vector<std::vector<float>> norms(2);
  ThreadPool pool(2);
  {
    // Layers in order only, and a column that cannot be read fails the layer.
    auto other = LookaheadTableWriter::Begin(tmp.File("other.gguf"), **pred);
    ASSERT_TRUE(other.ok()) << other.status().ToString();
    std::vector<float> ones(64, 1.0f);
    auto zeros = [](int64_t, float* dst) {
      std::fill(dst, dst + 64, 0.0f);
      return Status::Ok();
    };
    auto early = (*other)->WriteLayer(1, ones.data(), zeros, &pool);
    ASSERT_FALSE(early.ok());
    EXPECT_NE(early.message().find("layer 1 written, expected 0"), std::string::npos) << early.ToString();
    auto failing = [](int64_t k, float* dst) {
      std::fill(dst, dst + 64, 0.0f);
      return k == 300 ? Status::IOError("column 300 unreadable") : Status::Ok();
    };
    auto bad = (*other)->WriteLayer(0, ones.data(), failing, &pool);
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.message().find("column 300 unreadable"), std::string::npos) << bad.ToString();
  }
  for (int64_t l = 0; l < 2; ++l) {
    for (int64_t i = 0; i < 64; ++i) norms[l].push_back(1.0f + 0.01f * static_cast<float>(i + l));
    int64_t expected_k = 0;
    auto column = [&](int64_t k, float* dst) {
      EXPECT_EQ(k, expected_k++) << "columns are asked for once each, in order";
      for (int64_t i = 0; i < 64; ++i) dst[i] = static_cast<float>(value(l, k, i));
      return Status::Ok();
    };
    ASSERT_TRUE((*writer)->WriteLayer(l, norms[l].data(), column, &pool).ok());
    EXPECT_EQ(expected_k, 600);
  }
  ASSERT_TRUE((*writer)->Finish().ok());
  auto table = LookaheadTable::Load(path, **pred);
  ASSERT_TRUE(table.ok()) << table.status().ToString();
  EXPECT_EQ((*table)->bytes(), 600u * 16 * 2 + 600u * 12 * 2);
  for (int64_t l = 0; l < 2; ++l) {
    const MatrixView& t = (*table)->layer(l);
    const int64_t rank = pd.layers[static_cast<size_t>(l + 1)].info.rank;
    ASSERT_EQ(t.rows, 600);
    ASSERT_EQ(t.cols, rank);
    const std::vector<float>& fc1 = pd.layers[static_cast<size_t>(l + 1)].fc1;
    for (int64_t k = 0; k < 600; ++k) {
      for (int64_t r = 0; r < rank; ++r) {
        double want = 0.0;
        for (int64_t i = 0; i < 64; ++i) want += static_cast<double>(fc1[r * 64 + i]) * norms[l][i] * value(l, k, i);
        const float got =
            Fp16ToFp32(reinterpret_cast<const uint16_t*>(static_cast<const uint8_t*>(t.data) + k * t.row_bytes)[r]);
        ASSERT_NEAR(got, want, 2e-3 * (1.0 + std::fabs(want))) << "layer " << l << " neuron " << k << " unit " << r;
      }
    }
  }
}

// The manifest's summary figures, computed here from the profile and the layout's arithmetic (F32, dim 64: bundles of
// 3 x 256 bytes, five to a 4 KiB group): the active fraction weighted by neurons, the bytes a token is expected to read,
// the read amplification of whole groups, the padding, each region's hot prefix in whole groups.
TEST(PackerTest, ManifestFiguresFollowTheProfileAndTheLayout) {
  TempDir tmp;
  ThreadPool pool(2);
  const std::string model = tmp.File("m.gguf");
  ASSERT_EQ(WriteModel(model, GgmlType::kF32), "");
  profiler::ModelProfile prof = MakeProfile(model, 0, 7);
  prof.ffns.at(0).mean_active_fraction = 0.1;
  prof.ffns.at(1).mean_active_fraction = 0.3;
  PackOptions o;
  o.progress = false;
  o.hot_fraction = 25.0 / 96;  // 25 hot neurons fill 5 groups exactly: one more would need a sixth
  ASSERT_TRUE(PackDeployment(model, prof, "x", tmp.File("d"), o, &pool).ok());
  auto d = Deployment::Open(tmp.File("d"));
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  const Manifest& m = (*d)->manifest();
  ASSERT_EQ(m.layout.bundle_bytes, 768u);
  ASSERT_EQ(m.layout.slots_per_group, 5);
  EXPECT_DOUBLE_EQ(m.mean_active_fraction, 0.2);
  EXPECT_DOUBLE_EQ(m.expected_bytes_per_token, (0.1 * 96 + 0.3 * 96) * 768);
  EXPECT_DOUBLE_EQ(m.read_amplification, 4096.0 / (5 * 768));
  // Active neurons per token, per region: the profile's mean active fraction times n_ff (a dense FFN runs every token).
  EXPECT_DOUBLE_EQ(m.regions.at(0).active_per_token, 0.1 * 96);
  EXPECT_DOUBLE_EQ(m.regions.at(1).active_per_token, 0.3 * 96);
  const uint64_t groups = 2 * ((96 + 4) / 5);  // 20 groups per region
  EXPECT_EQ(m.flash_bytes, groups * 4096);
  EXPECT_EQ(m.padding_bytes, groups * 4096 - 2 * 96 * 768);
  for (const RegionInfo& r : m.regions) {
    EXPECT_EQ(r.hot_count, 25);
    EXPECT_EQ(r.hot_bytes, 5u * 4096) << "layer " << r.layer;
    EXPECT_EQ(r.offset, static_cast<uint64_t>(r.layer) * 20 * 4096);
  }
}

// The held-out replay against a count of its own: the same text in the same windows through the dense engine, each
// token's active neurons (output > 0) mapped through the deployment's slot table to 4 KiB groups of five bundles,
// groups and runs of adjacent groups counted per region. With no hot neuron every read is cold; with every neuron hot
// none is, and the layout (popularity order) is the same, so "all" agrees between the two.
TEST(PackerReplayTest, CountsWholeGroupsAndRunsOfTheLayout) {
  TempDir tmp;
  ThreadPool pool(2);
  const std::string model = tmp.File("m.gguf");
  ASSERT_EQ(WriteModel(model, GgmlType::kF32), "");
  const profiler::ModelProfile prof = MakeProfile(model, 0, 7);
  std::unique_ptr<Deployment> d[2];
  for (int hot = 0; hot < 2; ++hot) {
    PackOptions o;
    o.progress = false;
    o.order = NeuronOrder::kHotness;
    o.hot_fraction = hot;
    const std::string dir = tmp.File("d" + std::to_string(hot));
    ASSERT_TRUE(PackDeployment(model, prof, "x", dir, o, &pool).ok());
    auto opened = Deployment::Open(dir);
    ASSERT_TRUE(opened.ok()) << opened.status().ToString();
    d[hot] = std::move(*opened);
  }
  const std::string text = tmp.File("held_out.txt");
  WriteText(text, "Once upon a time there was a little cat. The cat saw a big red ball and ran to it. \"Look!\" "
                  "said the cat, and they played in the sun all day long until the moon came out.");
  ReplayOptions ro;
  ro.model_path = model;
  ro.text_path = text;
  ro.tokens = 70;
  ro.window = 16;  // five windows, the last one short

  // The count of its own.
  const Deployment& cold = *d[0];
  const BundleLayout& l = cold.layout();
  ASSERT_EQ(l.slots_per_group, 5);
  cli::ModelSource src;
  src.path = model;
  auto lm = cli::LoadModelForInference(src);
  ASSERT_TRUE(lm.ok()) << lm.status().ToString();
  auto bytes = ReadWholeFile(text);
  ASSERT_TRUE(bytes.ok());
  std::vector<int32_t> ids = lm->tokenizer->Encode(std::string(bytes->begin(), bytes->end()), true);
  ASSERT_GT(ids.size(), 70u);
  ids.resize(70);
  double active = 0, groups = 0, runs = 0;
  InferenceContext ctx(*lm->model, &pool, 16);
  ctx.SetFfnObserver([&](const FfnObservation& o) {
    const RegionInfo* r = cold.Region(o.layer, o.expert);
    ASSERT_NE(r, nullptr);
    for (int64_t t = 0; t < o.n_tokens; ++t) {
      std::set<int64_t> touched;
      for (int64_t k = 0; k < 96; ++k) {
        if (o.gate_act[t * 96 + k] > 0) {
          active += 1;
          touched.insert(r->slot_of_neuron[static_cast<size_t>(k)] / 5);
        }
      }
      groups += static_cast<double>(touched.size());
      for (int64_t g : touched) runs += touched.count(g - 1) ? 0 : 1;
    }
  });
  for (size_t start = 0; start < ids.size(); start += 16) {
    ctx.Reset();
    ASSERT_TRUE(ctx.Eval(std::span<const int32_t>(ids.data() + start, std::min<size_t>(16, ids.size() - start)), false).ok());
  }
  active /= 70;
  groups /= 70;
  runs /= 70;
  ASSERT_GT(runs, 0);
  ASSERT_LT(runs, groups) << "some neighbouring groups merge into one request";
  ASSERT_LT(groups, active) << "some groups serve several active neurons";

  auto all_cold = ReplayHeldOut(cold, ro, &pool);
  ASSERT_TRUE(all_cold.ok()) << all_cold.status().ToString();
  auto all_hot = ReplayHeldOut(*d[1], ro, &pool);
  ASSERT_TRUE(all_hot.ok()) << all_hot.status().ToString();
  for (const ReplayStats* st : {&*all_cold, &*all_hot}) {
    EXPECT_EQ(st->tokens, 70);
    EXPECT_NEAR(st->active, active, 1e-9);
    EXPECT_NEAR(st->groups, groups, 1e-9);
    EXPECT_NEAR(st->requests, runs, 1e-9);
    EXPECT_NEAR(st->bundle_bytes, active * 768, 1e-6);
    EXPECT_NEAR(st->read_bytes, groups * 4096, 1e-6);
  }
  EXPECT_NEAR(all_cold->active_cold, active, 1e-9);
  EXPECT_NEAR(all_cold->groups_cold, groups, 1e-9);
  EXPECT_NEAR(all_cold->requests_cold, runs, 1e-9);
  EXPECT_NEAR(all_cold->bundle_bytes_cold, active * 768, 1e-6);
  EXPECT_NEAR(all_cold->read_bytes_cold, groups * 4096, 1e-6);
  EXPECT_EQ(all_hot->active_cold, 0);
  EXPECT_EQ(all_hot->groups_cold, 0);
  EXPECT_EQ(all_hot->requests_cold, 0);
  EXPECT_EQ(all_hot->read_bytes_cold, 0);
  EXPECT_EQ(all_hot->bundle_bytes_cold, 0);
}

// Every manifest field the reader derives or bounds, changed one at a time: Deployment::Open names the field, what it
// found and what it expected (the reader never trusts stored layout numbers alone).
TEST(PackerCorruptionTest, EachManifestFieldIsCheckedByName) {
  TempDir tmp;
  Packed a = PackSmall(tmp, GgmlType::kF32, 0, NeuronOrder::kHotness, "a");
  const nlohmann::json good = ReadJson(a.dir + "/manifest.json");
  ASSERT_EQ(good["regions"].size(), 2u);
  const uint64_t r1_offset = good["regions"][1]["offset"];
  const uint64_t region_size = good["regions"][0]["size"];
  struct Case {
    const char* what;
    std::function<void(nlohmann::json*)> edit;
    std::vector<std::string> message;
  };
  const std::vector<Case> cases = {
      {"alignment", [](nlohmann::json* m) { (*m)["alignment"] = 512; }, {"alignment 512, expected 4096"}},
      {"dim", [](nlohmann::json* m) { (*m)["dim"] = 0; }, {"dim/n_ff/n_layers must be positive", "found 0/96/2/0"}},
      {"unknown type", [](nlohmann::json* m) { (*m)["bundle"]["up_type"] = "q9_z"; },
       {"bundle: unknown tensor type \"q9_z\""}},
      {"not a bundle type", [](nlohmann::json* m) { (*m)["bundle"]["down_type"] = "i32"; },
       {"bundle: tensor type \"i32\" is not a bundle type"}},
      {"layout", [](nlohmann::json* m) {
         (*m)["dim"] = 48;
         (*m)["bundle"]["gate_type"] = "q8_0";
       },
       {"bundle layout: dim 48 is not a multiple of the block size of q8_0/f32/f32"}},
      {"up_offset", [](nlohmann::json* m) { (*m)["bundle"]["up_offset"] = 300; },
       {"bundle: up_offset is 300, expected 256 for dim 64 and types f32/f32/f32"}},
      {"regions", [](nlohmann::json* m) { (*m)["regions"].erase(1); }, {"1 regions, expected 2"}},
      {"region order", [](nlohmann::json* m) { std::swap((*m)["regions"][0]["layer"], (*m)["regions"][1]["layer"]); },
       {"regions[0]: is layer 1, expected layer 0 (regions are layer-major)"}},
      {"n_neurons", [](nlohmann::json* m) { (*m)["regions"][0]["n_neurons"] = 95; },
       {"regions[0]: n_neurons 95 (expected n_ff 96)"}},
      {"hot_count", [](nlohmann::json* m) { (*m)["regions"][1]["hot_count"] = 97; },
       {"regions[1]", "hot_count 97 must be in [0, n_neurons]"}},
      {"unaligned", [&](nlohmann::json* m) { (*m)["regions"][1]["offset"] = r1_offset + 8; },
       {"regions[1]: offset " + std::to_string(r1_offset + 8) + " is not a multiple of 4096"}},
      {"overlap", [&](nlohmann::json* m) { (*m)["regions"][1]["offset"] = r1_offset - 4096; },
       {"regions[1]", "overlaps the previous region (ending at " + std::to_string(region_size) + ")"}},
      {"size", [&](nlohmann::json* m) { (*m)["regions"][1]["size"] = region_size + 4096; },
       {"regions[1]: size " + std::to_string(region_size + 4096) + " (expected " + std::to_string(region_size) + ")"}},
      {"past flash_bytes", [&](nlohmann::json* m) { (*m)["regions"][1]["offset"] = r1_offset + 4096; },
       {"regions[1]", "does not fit in flash_bytes"}},
      {"active_per_token < 0", [](nlohmann::json* m) { (*m)["regions"][1]["active_per_token"] = -0.5; },
       {"regions[1]: active_per_token -0.5", "must be in [0, n_neurons 96]"}},
      {"active_per_token > n_neurons", [](nlohmann::json* m) { (*m)["regions"][0]["active_per_token"] = 97; },
       {"regions[0]: active_per_token 97", "must be in [0, n_neurons 96]"}},
      {"active_per_token not a number", [](nlohmann::json* m) { (*m)["regions"][0]["active_per_token"] = "many"; },
       {"active_per_token"}},
      {"hot_bytes", [](nlohmann::json* m) { (*m)["regions"][0]["hot_bytes"] = (*m)["regions"][0]["hot_bytes"].get<uint64_t>() + 4096; },
       {"regions[0]: hot_bytes", "expected"}},
      {"padding_bytes", [](nlohmann::json* m) { (*m)["padding_bytes"] = (*m)["padding_bytes"].get<uint64_t>() + 1; },
       {"padding_bytes", "expected flash_bytes minus the bundles' " + std::to_string(2 * 96 * 768) + " bytes"}},
      {"resident_bytes", [](nlohmann::json* m) { (*m)["resident_bytes"] = (*m)["resident_bytes"].get<uint64_t>() + 1; },
       {"resident.gguf", "records resident_bytes"}},
  };
  for (const Case& c : cases) {
    nlohmann::json m = good;
    c.edit(&m);
    WriteText(a.dir + "/manifest.json", m.dump(1) + "\n");
    auto d = Deployment::Open(a.dir);
    ASSERT_FALSE(d.ok()) << c.what;
    EXPECT_EQ(d.status().code(), StatusCode::kCorruption) << c.what << ": " << d.status().ToString();
    for (const std::string& part : c.message) {
      EXPECT_NE(d.status().message().find(part), std::string::npos) << c.what << ": " << d.status().ToString();
    }
  }
  WriteText(a.dir + "/manifest.json", good.dump(1) + "\n");
  EXPECT_TRUE(Deployment::Open(a.dir).ok());
  // Optional: a manifest packed before active_per_token existed opens with the figure unknown (-1).
  nlohmann::json old_manifest = good;
  for (auto& r : old_manifest["regions"]) {
    ASSERT_TRUE(r.contains("active_per_token"));
    r.erase("active_per_token");
  }
  WriteText(a.dir + "/manifest.json", old_manifest.dump(1) + "\n");
  auto old_d = Deployment::Open(a.dir);
  ASSERT_TRUE(old_d.ok()) << old_d.status().ToString();
  EXPECT_EQ((*old_d)->manifest().regions.at(0).active_per_token, -1.0);
  auto none = Deployment::Open(tmp.path());
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), StatusCode::kNotFound);
  EXPECT_NE(none.status().message().find("not a deployment directory (no manifest.json"), std::string::npos)
      << none.status().ToString();
}

// ffn.bin must be exactly its regions, in order: verify refuses a gap before a region and bytes after the last one
// (Deployment::Open allows both: the bounds hold, only the tiling does not).
TEST(PackerCorruptionTest, VerifyRefusesGapsAndTrailingBytes) {
  TempDir tmp;
  Packed a = PackSmall(tmp, GgmlType::kF32, 0, NeuronOrder::kHotness, "a");
  const nlohmann::json good = ReadJson(a.dir + "/manifest.json");
  const uint64_t flash = good["flash_bytes"], r1_offset = good["regions"][1]["offset"];
  fs::resize_file(a.dir + "/ffn.bin", flash + 4096);
  nlohmann::json m = good;
  m["flash_bytes"] = flash + 4096;
  m["padding_bytes"] = good["padding_bytes"].get<uint64_t>() + 4096;  // bytes of no bundle: padding
  WriteText(a.dir + "/manifest.json", m.dump(1) + "\n");
  ASSERT_TRUE(Deployment::Open(a.dir).ok());
  auto trailing = VerifyDeployment(a.dir, false);
  ASSERT_FALSE(trailing.ok());
  EXPECT_NE(trailing.status().message().find("regions end at " + std::to_string(flash) + ", file has " +
                                             std::to_string(flash + 4096) + " bytes"),
            std::string::npos)
      << trailing.status().ToString();

  m["regions"][1]["offset"] = r1_offset + 4096;  // a gap of one page before layer 1
  WriteText(a.dir + "/manifest.json", m.dump(1) + "\n");
  ASSERT_TRUE(Deployment::Open(a.dir).ok());
  auto gap = VerifyDeployment(a.dir, false);
  ASSERT_FALSE(gap.ok());
  EXPECT_NE(gap.status().message().find("region of layer 1 starts at " + std::to_string(r1_offset + 4096) +
                                        ", expected " + std::to_string(r1_offset)),
            std::string::npos)
      << gap.status().ToString();
}

// A slot table that is not a permutation (two neurons in one slot) is refused when the deployment opens, naming the
// table entry; without the check two neurons would read the same bundle.
TEST(PackerCorruptionTest, SlotTableMustBeAPermutation) {
  TempDir tmp;
  Packed a = PackSmall(tmp, GgmlType::kF32, 0, NeuronOrder::kHotness, "a");
  const std::string resident_path = a.dir + "/resident.gguf";
  const std::string table = IndexTensorPrefix(1, -1) + ".slot_of_neuron";
  ASSERT_EQ(nflash::testing::RewriteGguf(resident_path, resident_path, nullptr,
                                         [&](nflash::testing::GgufTensorCopy* t) {
                                           if (t->name != table) return;
                                           ASSERT_EQ(t->type, GgmlType::kI32);
                                           // neuron 5 takes neuron 4's slot
                                           std::memcpy(t->bytes.data() + 5 * 4, t->bytes.data() + 4 * 4, 4);
                                         }),
            "");
  auto d = Deployment::Open(a.dir);
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find(table + "[5] = "), std::string::npos) << d.status().ToString();
  EXPECT_NE(d.status().message().find("out of range or repeated"), std::string::npos) << d.status().ToString();
}

// A profile whose per-layer entries disagree with the model (edited by hand, or a bug) is refused by name even when
// its header matches.
TEST(PackerCorruptionTest, ProfileEntriesMustMatchTheModel) {
  TempDir tmp;
  Packed a = PackSmall(tmp, GgmlType::kF32, 0, NeuronOrder::kHotness, "a");
  ThreadPool pool(1);
  PackOptions o;
  o.progress = false;
  profiler::ModelProfile short_counts = a.profile;
  short_counts.ffns[1].count_bs1.pop_back();
  auto s = PackDeployment(a.model, short_counts, "x", tmp.File("b.deploy"), o, &pool);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("profile layer 1: n_neurons 96, count_bs1 length 95, expected n_ff 96"),
            std::string::npos)
      << s.status().ToString();
  profiler::ModelProfile missing = a.profile;
  missing.ffns[1].layer = 7;
  s = PackDeployment(a.model, missing, "x", tmp.File("b.deploy"), o, &pool);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("profile has no entry for layer 1"), std::string::npos) << s.status().ToString();
  EXPECT_FALSE(fs::exists(tmp.File("b.deploy")));
}

}  // namespace
}  // namespace nflash::packer
