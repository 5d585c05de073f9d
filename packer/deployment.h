// The deployment directory written by `nflash pack` and read by the flash-offloaded runtime: format constants, the
// bundle layout of one FFN neuron on flash, the validated manifest, and the reader API (ranges to read, checksums,
// views of a bundle's gate row / up row / down column). Prose spec: docs/deployment-format.md.
//
// DEPLOY_DIR/
//   manifest.json   schema version, source model/profile hashes, shapes, bundle layout, regions, sizes (JSON)
//   resident.gguf   every tensor of the model except the FFN gate/up/down (llama.* metadata kept), plus per region the
//                   index tables: slot_of_neuron (I32), gate / up+down checksum per neuron (I64 bit patterns; XXH3-64,
//                   or xxHash64 in deployments packed before manifest field bundle_hash existed)
//   ffn.bin         the flash image: one region per (layer, expert), each starting at a multiple of kDeployAlignment;
//                   a region holds n_neurons bundles in slot order, hot neurons (most popular first) in the first slots
//   predictor.gguf  optional: the --predictor file, copied verbatim (Predictor::Load reads it as is)
//   lookahead.gguf  optional (dense models with a predictor): the lookahead projection table, computed from the
//                   predictor and the bundles' down columns (packer/lookahead_table.h)
//   profile.gguf    the profile packed from, copied verbatim (hash: manifest profile_hash): `nflash plan` reads it
//
// A bundle (neuron i of a region): [gate row i][up row i][down column i], parts back to back, gate first so that a
// two-phase load can read the gate part alone. Slots are grouped: `slots_per_group` bundles back to back at the start
// of a group of `group_bytes` (a multiple of kDeployAlignment), zero padding after them. Small bundles (far below
// 4 KiB) share a group; a bundle never straddles a group; bundles larger than half a page get one group each, padded.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "runtime/core/file.h"
#include "runtime/core/ggml_type.h"
#include "runtime/core/gguf.h"
#include "runtime/core/kernels.h"
#include "runtime/core/status.h"

namespace nflash::packer {

// Major version of the whole directory format; readers reject any other (no minor versions yet).
inline constexpr int kDeploymentSchemaVersion = 1;
// Every region (and every slot group) starts at a multiple of this and is a multiple of it long: O_DIRECT needs file
// offset, length and buffer aligned to the device's logical block size (512 B or 4 KiB on NVMe/UFS; 4 KiB covers
// both and is the page size, so registered io_uring buffers and page-granular caches line up).
inline constexpr uint64_t kDeployAlignment = 4096;
inline constexpr char kManifestFileName[] = "manifest.json";
inline constexpr char kResidentFileName[] = "resident.gguf";
inline constexpr char kFlashFileName[] = "ffn.bin";
inline constexpr char kPredictorFileName[] = "predictor.gguf";
inline constexpr char kLookaheadFileName[] = "lookahead.gguf";
// The profile the deployment was packed from (optional copy, hash = manifest profile_hash): the planner's input.
inline constexpr char kProfileFileName[] = "profile.gguf";

// The checksum function of the per-neuron part hashes (manifest field "bundle_hash"). It lives here, not in
// runtime/core/checksum.h, because it is a fact of this format: its names are manifest values and index tensor name
// suffixes that writer and reader must agree on; checksum.h only provides the hash primitives.
//   kXxh3  "xxh3"   XXH3_64bits, seed 0: what nflash pack writes (on 8 KiB: 4x xxHash64's speed in cache, 1.5x from
//                   DRAM; the runtime checks every bundle it reads on the scheduling thread)
//   kXxh64 "xxh64"  XXH64, seed 0: deployments whose manifest has no bundle_hash (packed before it existed)
// The enum values are not stored anywhere; only the names are.
enum class BundleHash { kXxh64, kXxh3 };
// What a manifest without "bundle_hash" means.
inline constexpr BundleHash kLegacyBundleHash = BundleHash::kXxh64;
// What PackDeployment writes.
inline constexpr BundleHash kDefaultBundleHash = BundleHash::kXxh3;
// "xxh64" / "xxh3": the manifest value and the index tensor name suffix.
const char* BundleHashName(BundleHash hash);
// Inverse of BundleHashName; InvalidArgument naming the expected values and what was found.
Result<BundleHash> ParseBundleHash(const std::string& name);
// The function itself (Xxh64 seed 0 or Xxh3) of `size` bytes.
uint64_t HashBundlePart(BundleHash hash, const void* data, size_t size);

// Names of the index tensors in resident.gguf for region (layer, expert); expert -1 is a dense FFN. H is
// BundleHashName(manifest bundle_hash): the name says which function made the values.
//   <prefix>.slot_of_neuron  I32 [n_neurons]   slot of each neuron (a permutation of 0..n-1)
//   <prefix>.gate_<H>        I64 [n_neurons]   hash (seed 0) of the neuron's gate part, per neuron
//   <prefix>.updown_<H>      I64 [n_neurons]   hash (seed 0) of its up part and down part (contiguous), per neuron
// prefix = "nflash.deploy.blk.<layer>" or "nflash.deploy.blk.<layer>.exp.<expert>"; e.g. "nflash.deploy.blk.3.gate_xxh3"
// (new packs) or "nflash.deploy.blk.3.gate_xxh64" (old ones).
std::string IndexTensorPrefix(int64_t layer, int64_t expert);
std::string GateHashTensorName(const std::string& prefix, BundleHash hash);
std::string UpDownHashTensorName(const std::string& prefix, BundleHash hash);

// The placement of one neuron's bundle. Identical for all regions of a deployment.
struct BundleLayout {
  int64_t dim = 0;  // elements of each part (gate row, up row, down column)
  GgmlType gate_type = GgmlType::kF32, up_type = GgmlType::kF32, down_type = GgmlType::kF32;
  // Byte offsets/sizes inside a bundle: gate at 0, up right after, down right after up.
  uint64_t gate_offset = 0, gate_bytes = 0;
  uint64_t up_offset = 0, up_bytes = 0;
  uint64_t down_offset = 0, down_bytes = 0;
  uint64_t bundle_bytes = 0;    // gate + up + down
  int64_t slots_per_group = 0;  // bundles per group (>= 1)
  uint64_t group_bytes = 0;     // bytes per group, a multiple of kDeployAlignment
  // Offset of slot `slot` from the start of its region.
  uint64_t SlotOffset(int64_t slot) const {
    return static_cast<uint64_t>(slot / slots_per_group) * group_bytes +
           static_cast<uint64_t>(slot % slots_per_group) * bundle_bytes;
  }
  // Bytes of a region of `n` neurons (whole groups).
  uint64_t RegionBytes(int64_t n) const {
    return static_cast<uint64_t>((n + slots_per_group - 1) / slots_per_group) * group_bytes;
  }
};
// Part sizes from the types; groups: floor(kDeployAlignment / bundle) bundles per page when the bundle is at most half
// a page, else one bundle per group padded up to a multiple of kDeployAlignment. InvalidArgument when a part's row
// length is not a multiple of its type's block size.
Result<BundleLayout> MakeBundleLayout(int64_t dim, GgmlType gate_type, GgmlType up_type, GgmlType down_type);

// One FFN neuron set on flash (a dense layer's FFN, or one expert).
struct RegionInfo {
  int64_t layer = 0;
  int64_t expert = -1;
  int64_t n_neurons = 0;
  int64_t hot_count = 0;    // slots [0, hot_count) hold the hot neurons, most popular first
  uint64_t offset = 0;      // in ffn.bin, multiple of kDeployAlignment
  uint64_t size = 0;        // layout.RegionBytes(n_neurons)
  uint64_t hot_bytes = 0;   // bytes of the groups that hold the hot slots (the region's prefix read as one run)
  // Neurons the profile found active per calibration token (MoE: times the share of tokens routed to the expert): what
  // one shared cold pool is shared out by when no plan says otherwise. -1: unknown (manifests packed before the field
  // existed; JSON "active_per_token", optional).
  double active_per_token = -1.0;
  // Index tables (from resident.gguf), n_neurons each.
  std::vector<int32_t> slot_of_neuron;
  std::vector<int32_t> neuron_of_slot;
  std::vector<uint64_t> gate_hash;    // per neuron, of Manifest::bundle_hash
  std::vector<uint64_t> updown_hash;  // per neuron, of Manifest::bundle_hash
};

struct Manifest {
  int schema_version = kDeploymentSchemaVersion;
  std::string model_name;
  std::string model_hash;      // HashToHex(HashFile(source model))
  std::string profile_hash;    // HashToHex(HashFile(profile))
  std::string resident_hash;   // HashToHex(HashFile(resident.gguf))
  std::string predictor_hash;  // "" when no predictor.gguf
  uint64_t resident_bytes = 0, flash_bytes = 0, predictor_bytes = 0;
  // lookahead.gguf (packer/lookahead_table.h): "" / 0 when absent (no predictor, a mixture of experts, or packed
  // before the file existed; manifest fields optional).
  std::string lookahead_hash;
  uint64_t lookahead_bytes = 0;
  std::string activation;      // silu / relu / drelu
  int64_t dim = 0, n_ff = 0, n_layers = 0, n_experts = 0;  // n_experts 0: dense
  uint64_t alignment = kDeployAlignment;
  BundleLayout layout;
  // Function of the per-neuron part hashes. JSON "bundle_hash"; absent in old manifests = kLegacyBundleHash (the
  // field is additive, so schema_version stays 1; an old reader ignores it and fails on the renamed index tensors).
  BundleHash bundle_hash = kDefaultBundleHash;
  std::string order;           // "hotness" or "coactivation"
  double hot_fraction = 0.0;   // requested share of hot neurons per region (-1: 50%-of-activations rule)
  uint64_t padding_bytes = 0;  // ffn.bin bytes that belong to no bundle
  // Mean (over regions, weighted by neurons) of the profile's active fraction (per run of each FFN), and what that
  // means per token: expected_bytes_per_token = sum over regions of active_per_token * bundle_bytes (bundle bytes
  // needed if no neuron is cached; an expert counts only the tokens routed to it since session 46, before which an
  // MoE's figure counted every expert on every token); read amplification = group_bytes / (slots_per_group *
  // bundle_bytes) for a reader that reads whole groups.
  double mean_active_fraction = 0.0;
  double expected_bytes_per_token = 0.0;
  double read_amplification = 1.0;
  std::vector<RegionInfo> regions;  // layer-major, experts in order; tables filled by Deployment::Open
};

// Byte ranges of ffn.bin: nflash::ByteRange (runtime/core/file.h).
// One bundle's parts as 1-row matrices (type = the part's type, cols = dim) pointing into a bundle buffer.
struct BundleView {
  MatrixView gate, up, down;
};
// `bundle` must hold layout.bundle_bytes bytes (or, for gate only, gate_bytes: then up/down are left empty when
// `bundle_size` is smaller than bundle_bytes).
BundleView ViewBundle(const BundleLayout& layout, const uint8_t* bundle, uint64_t bundle_size);

// An opened, validated deployment. Thread-safety: immutable after Open; all const methods may be called concurrently.
class Deployment {
 public:
  struct Options {
    // Re-hash resident.gguf (and predictor.gguf, lookahead.gguf) against the manifest: a full read; `nflash verify`
    // sets it.
    bool verify_resident_hash = false;
    // Read resident.gguf with O_DIRECT into anonymous memory (ReadFileDirect: what the runtime computes from) instead
    // of reading what is asked through pread that leaves nothing in the page cache (OpenUncachedPreadFile: enough for
    // tools that only read its metadata and index tensors, and no weight is cached behind the memory budget's back).
    bool resident_in_memory = false;
    // With resident_in_memory: leave token_embd.weight on flash when the model has its own output.weight (a token
    // needs one row of it; tied embeddings are the output head and stay in memory). embedding_range() says where.
    bool embedding_on_flash = false;
  };
  // Parses manifest.json, checks schema version, shapes, that every region lies inside ffn.bin (whose size must match
  // exactly), opens resident.gguf (uncached pread, or read into memory) and loads/validates the index tables (permutations, lengths). Errors name the
  // file, the field, expected and found.
  static Result<std::unique_ptr<Deployment>> Open(const std::string& dir, const Options& options);
  static Result<std::unique_ptr<Deployment>> Open(const std::string& dir) { return Open(dir, Options{}); }

  const Manifest& manifest() const { return manifest_; }
  const BundleLayout& layout() const { return manifest_.layout; }
  const std::string& dir() const { return dir_; }
  std::string resident_path() const { return dir_ + "/" + kResidentFileName; }
  std::string flash_path() const { return dir_ + "/" + kFlashFileName; }
  // "" when the deployment has no predictor.
  std::string predictor_path() const;
  // "" when the deployment has no lookahead table.
  std::string lookahead_path() const;
  // resident.gguf (mmapped): bind attention, embeddings, norms and output head from it like Model::Load does.
  const GgufFile& resident() const { return *resident_; }
  std::shared_ptr<const GgufFile> resident_shared() const { return resident_; }
  // token_embd.weight's bytes in resident.gguf when they were left on flash (Options::embedding_on_flash), else size 0.
  ByteRange embedding_range() const { return embedding_range_; }
  // Bytes of resident.gguf held in memory: the file less the whole pages of embedding_range.
  uint64_t resident_memory_bytes() const { return resident_memory_bytes_; }

  // The region of (layer, expert) (expert -1 for dense FFNs), or nullptr.
  const RegionInfo* Region(int64_t layer, int64_t expert) const;
  // Ranges in ffn.bin of neuron `neuron`'s whole bundle, its gate part, and its up+down parts. Preconditions (checked,
  // abort on violation: a caller bug): the region exists and 0 <= neuron < n_neurons.
  ByteRange BundleRange(int64_t layer, int64_t expert, int64_t neuron) const;
  ByteRange GateRange(int64_t layer, int64_t expert, int64_t neuron) const;
  ByteRange UpDownRange(int64_t layer, int64_t expert, int64_t neuron) const;
  // Checks bytes read from flash against the stored hash (function: manifest().bundle_hash): the whole bundle
  // (bundle_bytes), the gate part (gate_bytes) or the up+down parts (up_bytes + down_bytes). Corruption naming layer,
  // expert, neuron, slot, the ffn.bin offset and the hash function on mismatch; InvalidArgument on a wrong size.
  Status VerifyBundle(int64_t layer, int64_t expert, int64_t neuron, std::span<const uint8_t> bytes) const;
  Status VerifyGate(int64_t layer, int64_t expert, int64_t neuron, std::span<const uint8_t> bytes) const;
  Status VerifyUpDown(int64_t layer, int64_t expert, int64_t neuron, std::span<const uint8_t> bytes) const;

 private:
  Deployment() = default;
  const RegionInfo& RegionOrDie(int64_t layer, int64_t expert, int64_t neuron) const;
  std::string dir_;
  Manifest manifest_;
  std::shared_ptr<const GgufFile> resident_;
  ByteRange embedding_range_;
  uint64_t resident_memory_bytes_ = 0;
  std::vector<int64_t> region_index_;  // layer * max(1, n_experts) + max(0, expert) -> index in regions, or -1
};

// Manifest <-> JSON, one pair shared by writer and reader (tables are not part of the JSON). ParseManifest validates
// field presence/types, the schema version and internal consistency (layout recomputed from dim and types, regions
// aligned, non-overlapping, in bounds of flash_bytes); `source` names the file in errors.
std::string ManifestToJson(const Manifest& manifest);
Result<Manifest> ParseManifest(const std::string& json_text, const std::string& source);

}  // namespace nflash::packer
