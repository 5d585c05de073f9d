// Reader side of the deployment directory (packer/deployment.h): bundle layout arithmetic, manifest JSON encode/decode
// with validation, opening a deployment, byte ranges and checksum checks for the runtime.
#include "packer/deployment.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>

#include "runtime/core/checksum.h"
#include "runtime/core/file.h"
#include "runtime/core/json_fields.h"
#include "runtime/core/log.h"
#include "runtime/core/quant.h"
#include "runtime/core/round.h"

namespace nflash::packer {
namespace {

using Json = nlohmann::json;


std::string RegionName(int64_t layer, int64_t expert) {
  std::string s = "layer " + std::to_string(layer);
  if (expert >= 0) s += " expert " + std::to_string(expert);
  return s;
}

Result<GgmlType> ParseType(const std::string& name, const std::string& where) {
  auto t = ParseGgmlType(name);
  if (!t) return Status::Corruption(where + ": unknown tensor type \"" + name + "\" (expected f32, f16, bf16, q8_0, q4_0)");
  // A ggml type the bundle kernels do not handle (q5_K, i32, ...) is refused here, not left to RowBytes' block check.
  if (!IsRowType(*t)) {
    return Status::Corruption(where + ": tensor type \"" + name + "\" is not a bundle type (expected f32, f16, bf16, " +
                              "q8_0, q4_0)");
  }
  return *t;
}

}  // namespace

const char* BundleHashName(BundleHash hash) { return hash == BundleHash::kXxh3 ? "xxh3" : "xxh64"; }

Result<BundleHash> ParseBundleHash(const std::string& name) {
  if (name == "xxh3") return BundleHash::kXxh3;
  if (name == "xxh64") return BundleHash::kXxh64;
  return Status::InvalidArgument("bundle hash \"" + name + "\": expected \"xxh3\" or \"xxh64\"");
}

uint64_t HashBundlePart(BundleHash hash, const void* data, size_t size) {
  return hash == BundleHash::kXxh3 ? Xxh3(data, size) : Xxh64(data, size);
}

std::string GateHashTensorName(const std::string& prefix, BundleHash hash) {
  return prefix + ".gate_" + BundleHashName(hash);
}

std::string UpDownHashTensorName(const std::string& prefix, BundleHash hash) {
  return prefix + ".updown_" + BundleHashName(hash);
}

std::string IndexTensorPrefix(int64_t layer, int64_t expert) {
  std::string p = "nflash.deploy.blk." + std::to_string(layer);
  if (expert >= 0) p += ".exp." + std::to_string(expert);
  return p;
}

Result<BundleLayout> MakeBundleLayout(int64_t dim, GgmlType gate_type, GgmlType up_type, GgmlType down_type) {
  if (dim <= 0) return Status::InvalidArgument("bundle layout: dim " + std::to_string(dim) + " must be positive");
  BundleLayout l;
  l.dim = dim;
  l.gate_type = gate_type;
  l.up_type = up_type;
  l.down_type = down_type;
  auto g = RowBytes(gate_type, dim), u = RowBytes(up_type, dim), d = RowBytes(down_type, dim);
  if (!g || !u || !d) {
    return Status::InvalidArgument("bundle layout: dim " + std::to_string(dim) +
                                   " is not a multiple of the block size of " + std::string(GgmlTypeName(gate_type)) +
                                   "/" + std::string(GgmlTypeName(up_type)) + "/" + std::string(GgmlTypeName(down_type)));
  }
  l.gate_offset = 0;
  l.gate_bytes = *g;
  l.up_offset = *g;
  l.up_bytes = *u;
  l.down_offset = *g + *u;
  l.down_bytes = *d;
  l.bundle_bytes = *g + *u + *d;
  // Sharing a page pays only when at least two bundles fit; otherwise one bundle per padded group, so a bundle's
  // first page always starts with its gate part (two-phase loading reads that page alone).
  if (l.bundle_bytes * 2 <= kDeployAlignment) {
    l.slots_per_group = static_cast<int64_t>(kDeployAlignment / l.bundle_bytes);
    l.group_bytes = kDeployAlignment;
  } else {
    l.slots_per_group = 1;
    l.group_bytes = RoundUp<uint64_t>(l.bundle_bytes, kDeployAlignment);
  }
  return l;
}

BundleView ViewBundle(const BundleLayout& layout, const uint8_t* bundle, uint64_t bundle_size) {
  BundleView v;
  auto part = [&](GgmlType type, uint64_t offset, uint64_t bytes) {
    MatrixView m;
    m.type = type;
    if (offset + bytes > bundle_size) return m;
    m.data = bundle + offset;
    m.rows = 1;
    m.cols = layout.dim;
    m.row_bytes = bytes;
    return m;
  };
  v.gate = part(layout.gate_type, layout.gate_offset, layout.gate_bytes);
  v.up = part(layout.up_type, layout.up_offset, layout.up_bytes);
  v.down = part(layout.down_type, layout.down_offset, layout.down_bytes);
  return v;
}

std::string ManifestToJson(const Manifest& m) {
  Json j;
  j["schema_version"] = m.schema_version;
  j["format"] = "nflash-deployment";
  j["model_name"] = m.model_name;
  j["model_hash"] = m.model_hash;
  j["profile_hash"] = m.profile_hash;
  j["resident_hash"] = m.resident_hash;
  j["predictor_hash"] = m.predictor_hash;
  j["resident_bytes"] = m.resident_bytes;
  j["flash_bytes"] = m.flash_bytes;
  j["predictor_bytes"] = m.predictor_bytes;
  if (!m.lookahead_hash.empty()) {
    j["lookahead_hash"] = m.lookahead_hash;
    j["lookahead_bytes"] = m.lookahead_bytes;
  }
  j["activation"] = m.activation;
  j["dim"] = m.dim;
  j["n_ff"] = m.n_ff;
  j["n_layers"] = m.n_layers;
  j["n_experts"] = m.n_experts;
  j["alignment"] = m.alignment;
  j["bundle_hash"] = BundleHashName(m.bundle_hash);
  const BundleLayout& l = m.layout;
  j["bundle"] = {{"gate_type", std::string(GgmlTypeName(l.gate_type))},
                 {"up_type", std::string(GgmlTypeName(l.up_type))},
                 {"down_type", std::string(GgmlTypeName(l.down_type))},
                 {"gate_offset", l.gate_offset}, {"gate_bytes", l.gate_bytes},
                 {"up_offset", l.up_offset}, {"up_bytes", l.up_bytes},
                 {"down_offset", l.down_offset}, {"down_bytes", l.down_bytes},
                 {"bundle_bytes", l.bundle_bytes}, {"slots_per_group", l.slots_per_group},
                 {"group_bytes", l.group_bytes}};
  j["order"] = m.order;
  j["hot_fraction"] = m.hot_fraction;
  j["padding_bytes"] = m.padding_bytes;
  j["mean_active_fraction"] = m.mean_active_fraction;
  j["expected_bytes_per_token"] = m.expected_bytes_per_token;
  j["read_amplification"] = m.read_amplification;
  Json regions = Json::array();
  for (const RegionInfo& r : m.regions) {
    regions.push_back({{"layer", r.layer}, {"expert", r.expert}, {"n_neurons", r.n_neurons},
                       {"hot_count", r.hot_count}, {"offset", r.offset}, {"size", r.size},
                       {"hot_bytes", r.hot_bytes}});
    if (r.active_per_token >= 0) regions.back()["active_per_token"] = r.active_per_token;
  }
  j["regions"] = std::move(regions);
  return j.dump(1) + "\n";
}

Result<Manifest> ParseManifest(const std::string& text, const std::string& source) {
  Json j;
  try {
    j = Json::parse(text);
  } catch (const std::exception& e) {
    return Status::Corruption(source + ": not valid JSON: " + e.what());
  }
  NF_ASSIGN_OR_RETURN(const JsonFields root, JsonFields::Of(j, JsonLocation(source)));
  Manifest m;
  NF_RETURN_IF_ERROR(root.Get("schema_version", &m.schema_version));
  if (m.schema_version != kDeploymentSchemaVersion) {
    return Status::Unsupported(source + ": schema_version " + std::to_string(m.schema_version) + ", this nflash reads " +
                               std::to_string(kDeploymentSchemaVersion) + " (re-run nflash pack)");
  }
  NF_RETURN_IF_ERROR(root.Get("model_name", &m.model_name));
  NF_RETURN_IF_ERROR(root.Get("model_hash", &m.model_hash));
  NF_RETURN_IF_ERROR(root.Get("profile_hash", &m.profile_hash));
  NF_RETURN_IF_ERROR(root.Get("resident_hash", &m.resident_hash));
  NF_RETURN_IF_ERROR(root.Get("predictor_hash", &m.predictor_hash));
  NF_RETURN_IF_ERROR(root.Get("resident_bytes", &m.resident_bytes));
  NF_RETURN_IF_ERROR(root.Get("flash_bytes", &m.flash_bytes));
  NF_RETURN_IF_ERROR(root.Get("predictor_bytes", &m.predictor_bytes));
  if (root.Has("lookahead_hash")) {  // optional: deployments packed before lookahead.gguf existed have none
    NF_RETURN_IF_ERROR(root.Get("lookahead_hash", &m.lookahead_hash));
    NF_RETURN_IF_ERROR(root.Get("lookahead_bytes", &m.lookahead_bytes));
  }
  NF_RETURN_IF_ERROR(root.Get("activation", &m.activation));
  NF_RETURN_IF_ERROR(root.Get("dim", &m.dim));
  NF_RETURN_IF_ERROR(root.Get("n_ff", &m.n_ff));
  NF_RETURN_IF_ERROR(root.Get("n_layers", &m.n_layers));
  NF_RETURN_IF_ERROR(root.Get("n_experts", &m.n_experts));
  NF_RETURN_IF_ERROR(root.Get("alignment", &m.alignment));
  NF_RETURN_IF_ERROR(root.Get("order", &m.order));
  NF_RETURN_IF_ERROR(root.Get("hot_fraction", &m.hot_fraction));
  NF_RETURN_IF_ERROR(root.Get("padding_bytes", &m.padding_bytes));
  NF_RETURN_IF_ERROR(root.Get("mean_active_fraction", &m.mean_active_fraction));
  NF_RETURN_IF_ERROR(root.Get("expected_bytes_per_token", &m.expected_bytes_per_token));
  NF_RETURN_IF_ERROR(root.Get("read_amplification", &m.read_amplification));
  // Optional: manifests written before the field existed hash with xxHash64 (and name their tensors *_xxh64).
  m.bundle_hash = kLegacyBundleHash;
  if (root.Has("bundle_hash")) {
    std::string name;
    NF_RETURN_IF_ERROR(root.Get("bundle_hash", &name));
    auto hash = ParseBundleHash(name);
    if (!hash.ok()) {
      return Status::Unsupported(root.where().Field("bundle_hash").Describe() + ": expected \"xxh3\" or \"xxh64\" " +
                                 "(or no field: xxh64), found \"" + name +
                                 "\" (packed by a newer nflash? re-run nflash pack)");
    }
    m.bundle_hash = *hash;
  }
  if (m.alignment != kDeployAlignment) {
    return Status::Corruption(source + ": alignment " + std::to_string(m.alignment) + ", expected " +
                              std::to_string(kDeployAlignment));
  }
  if (m.dim <= 0 || m.n_ff <= 0 || m.n_layers <= 0 || m.n_experts < 0) {
    return Status::Corruption(source + ": dim/n_ff/n_layers must be positive and n_experts >= 0 (found " +
                              std::to_string(m.dim) + "/" + std::to_string(m.n_ff) + "/" + std::to_string(m.n_layers) +
                              "/" + std::to_string(m.n_experts) + ")");
  }
  NF_ASSIGN_OR_RETURN(const JsonFields b, root.Object("bundle"));
  std::string gt, ut, dt;
  const std::string bwhere = source + " bundle";
  NF_RETURN_IF_ERROR(b.Get("gate_type", &gt));
  NF_RETURN_IF_ERROR(b.Get("up_type", &ut));
  NF_RETURN_IF_ERROR(b.Get("down_type", &dt));
  NF_ASSIGN_OR_RETURN(GgmlType g, ParseType(gt, bwhere));
  NF_ASSIGN_OR_RETURN(GgmlType u, ParseType(ut, bwhere));
  NF_ASSIGN_OR_RETURN(GgmlType d, ParseType(dt, bwhere));
  auto layout = MakeBundleLayout(m.dim, g, u, d);
  if (!layout.ok()) return Status::Corruption(source + ": " + layout.status().message());
  m.layout = *layout;
  // The stored numbers must equal the ones derived from dim and types (the reader never trusts them alone).
  const std::pair<const char*, uint64_t> expect[] = {
      {"gate_offset", m.layout.gate_offset}, {"gate_bytes", m.layout.gate_bytes},   {"up_offset", m.layout.up_offset},
      {"up_bytes", m.layout.up_bytes},       {"down_offset", m.layout.down_offset}, {"down_bytes", m.layout.down_bytes},
      {"bundle_bytes", m.layout.bundle_bytes}, {"slots_per_group", static_cast<uint64_t>(m.layout.slots_per_group)},
      {"group_bytes", m.layout.group_bytes}};
  for (const auto& [key, want] : expect) {
    uint64_t found = 0;
    NF_RETURN_IF_ERROR(b.Get(key, &found));
    if (found != want) {
      return Status::Corruption(bwhere + ": " + key + " is " + std::to_string(found) + ", expected " +
                                std::to_string(want) + " for dim " + std::to_string(m.dim) + " and types " + gt + "/" +
                                ut + "/" + dt);
    }
  }
  NF_ASSIGN_OR_RETURN(const Json* regions, root.Array("regions"));
  const JsonLocation regions_at = root.where().Field("regions");
  const int64_t per_layer = std::max<int64_t>(1, m.n_experts);
  if (static_cast<int64_t>(regions->size()) != m.n_layers * per_layer) {
    return Status::Corruption(source + ": " + std::to_string(regions->size()) + " regions, expected " +
                              std::to_string(m.n_layers * per_layer) + " (n_layers x max(1, n_experts))");
  }
  uint64_t end_prev = 0;
  for (size_t i = 0; i < regions->size(); ++i) {
    NF_ASSIGN_OR_RETURN(const JsonFields rj, JsonFields::Of((*regions)[i], regions_at.Index(i)));
    const std::string where = source + " regions[" + std::to_string(i) + "]";
    RegionInfo r;
    NF_RETURN_IF_ERROR(rj.Get("layer", &r.layer));
    NF_RETURN_IF_ERROR(rj.Get("expert", &r.expert));
    NF_RETURN_IF_ERROR(rj.Get("n_neurons", &r.n_neurons));
    NF_RETURN_IF_ERROR(rj.Get("hot_count", &r.hot_count));
    NF_RETURN_IF_ERROR(rj.Get("offset", &r.offset));
    NF_RETURN_IF_ERROR(rj.Get("size", &r.size));
    NF_RETURN_IF_ERROR(rj.Get("hot_bytes", &r.hot_bytes));
    // Optional: manifests packed before it have none (-1).
    if (rj.Has("active_per_token")) NF_RETURN_IF_ERROR(rj.Get("active_per_token", &r.active_per_token));
    const int64_t want_layer = static_cast<int64_t>(i) / per_layer;
    const int64_t want_expert = m.n_experts > 0 ? static_cast<int64_t>(i) % per_layer : -1;
    if (r.layer != want_layer || r.expert != want_expert) {
      return Status::Corruption(where + ": is " + RegionName(r.layer, r.expert) + ", expected " +
                                RegionName(want_layer, want_expert) + " (regions are layer-major)");
    }
    if (r.n_neurons != m.n_ff || r.hot_count < 0 || r.hot_count > r.n_neurons) {
      return Status::Corruption(where + ": n_neurons " + std::to_string(r.n_neurons) + " (expected n_ff " +
                                std::to_string(m.n_ff) + "), hot_count " + std::to_string(r.hot_count) +
                                " must be in [0, n_neurons]");
    }
    if (rj.Has("active_per_token") &&
        !(r.active_per_token >= 0 && r.active_per_token <= static_cast<double>(r.n_neurons))) {
      return Status::Corruption(where + ": active_per_token " + Json(r.active_per_token).dump() +
                                " must be in [0, n_neurons " + std::to_string(r.n_neurons) + "]");
    }
    if (r.offset % kDeployAlignment != 0 || r.offset < end_prev) {
      return Status::Corruption(where + ": offset " + std::to_string(r.offset) + " is not a multiple of " +
                                std::to_string(kDeployAlignment) + " or overlaps the previous region (ending at " +
                                std::to_string(end_prev) + ")");
    }
    if (r.size != m.layout.RegionBytes(r.n_neurons) || r.offset + r.size > m.flash_bytes) {
      return Status::Corruption(where + ": size " + std::to_string(r.size) + " (expected " +
                                std::to_string(m.layout.RegionBytes(r.n_neurons)) + ") at offset " +
                                std::to_string(r.offset) + " does not fit in flash_bytes " +
                                std::to_string(m.flash_bytes));
    }
    if (r.hot_bytes != m.layout.RegionBytes(r.hot_count)) {
      return Status::Corruption(where + ": hot_bytes " + std::to_string(r.hot_bytes) + ", expected " +
                                std::to_string(m.layout.RegionBytes(r.hot_count)) + " (the groups of " +
                                std::to_string(r.hot_count) + " hot slots)");
    }
    end_prev = r.offset + r.size;
    m.regions.push_back(std::move(r));
  }
  // Every byte of ffn.bin that holds no bundle is padding.
  const uint64_t bundle_total = static_cast<uint64_t>(m.n_ff) * m.regions.size() * m.layout.bundle_bytes;
  if (m.flash_bytes < bundle_total || m.padding_bytes != m.flash_bytes - bundle_total) {
    return Status::Corruption(source + ": padding_bytes " + std::to_string(m.padding_bytes) + " with flash_bytes " +
                              std::to_string(m.flash_bytes) + ", expected flash_bytes minus the bundles' " +
                              std::to_string(bundle_total) + " bytes");
  }
  return m;
}

// ---------------------------------------------------------------------------------------------------------------------

namespace {

// Reads a 1-D index tensor of `n` elements of `type` from resident.gguf.
Status ReadIndexTensor(const GgufFile& f, const std::string& name, GgmlType type, int64_t n, void* dst) {
  const GgufTensorInfo* t = f.FindTensor(name);
  if (!t) return Status::Corruption(f.path() + ": missing index tensor \"" + name + "\"");
  if (t->type != type || t->dims.size() != 1 || t->dims[0] != static_cast<uint64_t>(n)) {
    return Status::Corruption(f.path() + ": index tensor \"" + name + "\" is " + std::string(GgmlTypeName(t->type)) +
                              " " + ShapeToString(t->dims) + ", expected " + std::string(GgmlTypeName(type)) + " [" +
                              std::to_string(n) + "]");
  }
  std::vector<uint8_t> scratch;
  NF_ASSIGN_OR_RETURN(auto bytes, f.TensorData(*t, &scratch));
  std::memcpy(dst, bytes.data(), bytes.size());
  return Status::Ok();
}

Status CheckFileHash(const std::string& path, const std::string& want, const std::string& manifest_path) {
  NF_ASSIGN_OR_RETURN(uint64_t h, HashFile(path));
  if (HashToHex(h) != want) {
    return Status::Corruption(path + ": xxHash64 is " + HashToHex(h) + ", " + manifest_path + " records " + want +
                              " (file modified or corrupt)");
  }
  return Status::Ok();
}

Result<uint64_t> FileSize(const std::string& path) {
  NF_ASSIGN_OR_RETURN(auto f, OpenPreadFile(path));
  return f->Size();
}

}  // namespace

Result<std::unique_ptr<Deployment>> Deployment::Open(const std::string& dir, const Options& options) {
  std::unique_ptr<Deployment> d(new Deployment());
  d->dir_ = dir;
  const std::string manifest_path = dir + "/" + kManifestFileName;
  if (!FileExists(manifest_path)) {
    return Status::NotFound(dir + ": not a deployment directory (no " + kManifestFileName + "; create one with nflash pack)");
  }
  NF_ASSIGN_OR_RETURN(auto text, ReadWholeFile(manifest_path));
  NF_ASSIGN_OR_RETURN(d->manifest_, ParseManifest(std::string(text.begin(), text.end()), manifest_path));
  Manifest& m = d->manifest_;

  // Sizes first (cheap), then hashes when asked.
  NF_ASSIGN_OR_RETURN(uint64_t flash_size, FileSize(d->flash_path()));
  if (flash_size != m.flash_bytes) {
    return Status::Corruption(d->flash_path() + ": " + std::to_string(flash_size) + " bytes, " + manifest_path +
                              " records flash_bytes " + std::to_string(m.flash_bytes) +
                              (flash_size < m.flash_bytes ? " (truncated)" : " (trailing data)"));
  }
  NF_ASSIGN_OR_RETURN(uint64_t resident_size, FileSize(d->resident_path()));
  if (resident_size != m.resident_bytes) {
    return Status::Corruption(d->resident_path() + ": " + std::to_string(resident_size) + " bytes, " + manifest_path +
                              " records resident_bytes " + std::to_string(m.resident_bytes));
  }
  if (!m.predictor_hash.empty()) {
    NF_ASSIGN_OR_RETURN(uint64_t psize, FileSize(d->predictor_path()));
    if (psize != m.predictor_bytes) {
      return Status::Corruption(d->predictor_path() + ": " + std::to_string(psize) + " bytes, " + manifest_path +
                                " records predictor_bytes " + std::to_string(m.predictor_bytes));
    }
  }
  if (!m.lookahead_hash.empty()) {
    NF_ASSIGN_OR_RETURN(uint64_t lsize, FileSize(d->lookahead_path()));
    if (lsize != m.lookahead_bytes) {
      return Status::Corruption(d->lookahead_path() + ": " + std::to_string(lsize) + " bytes, " + manifest_path +
                                " records lookahead_bytes " + std::to_string(m.lookahead_bytes));
    }
  }
  if (options.verify_resident_hash) {
    NF_RETURN_IF_ERROR(CheckFileHash(d->resident_path(), m.resident_hash, manifest_path));
    if (!m.predictor_hash.empty()) NF_RETURN_IF_ERROR(CheckFileHash(d->predictor_path(), m.predictor_hash, manifest_path));
    if (!m.lookahead_hash.empty()) NF_RETURN_IF_ERROR(CheckFileHash(d->lookahead_path(), m.lookahead_hash, manifest_path));
  }

  std::vector<ByteRange> holes;
  std::optional<GgufFile> probe;
  if (options.resident_in_memory && options.embedding_on_flash) {
    // Where token_embd.weight lies: the metadata only, through pread that leaves no page (nor readahead of weights)
    // in the page cache; the directory is kept for the copy in memory.
    NF_ASSIGN_OR_RETURN(probe, GgufFile::OpenPathUncached(d->resident_path()));
    const GgufTensorInfo* emb = probe->FindTensor("token_embd.weight");
    if (emb != nullptr && probe->FindTensor("output.weight") != nullptr) {
      d->embedding_range_ = ByteRange{probe->data_offset() + emb->offset, emb->n_bytes};
      holes.push_back(d->embedding_range_);
    }
  }
  NF_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> resident_file,
                      options.resident_in_memory ? ReadFileDirect(d->resident_path(), holes)
                                                 : OpenUncachedPreadFile(d->resident_path()));
  d->resident_memory_bytes_ = m.resident_bytes;
  d->resident_memory_bytes_ -= InnerBlocks(d->embedding_range_).size;  // the pages ReadFileDirect left out
  std::shared_ptr<const ReadableFile> resident_bytes(std::move(resident_file));
  NF_ASSIGN_OR_RETURN(GgufFile resident, probe ? std::move(*probe).Rebind(std::move(resident_bytes))
                                               : GgufFile::Open(std::move(resident_bytes)));
  d->resident_ = std::make_shared<const GgufFile>(std::move(resident));
  const GgufFile& rf = *d->resident_;

  const int64_t per_layer = std::max<int64_t>(1, m.n_experts);
  d->region_index_.assign(static_cast<size_t>(m.n_layers * per_layer), -1);
  for (size_t i = 0; i < m.regions.size(); ++i) {
    RegionInfo& r = m.regions[i];
    d->region_index_[static_cast<size_t>(r.layer * per_layer + std::max<int64_t>(0, r.expert))] = static_cast<int64_t>(i);
    const std::string prefix = IndexTensorPrefix(r.layer, r.expert);
    const auto n = static_cast<size_t>(r.n_neurons);
    r.slot_of_neuron.resize(n);
    r.gate_hash.resize(n);
    r.updown_hash.resize(n);
    NF_RETURN_IF_ERROR(ReadIndexTensor(rf, prefix + ".slot_of_neuron", GgmlType::kI32, r.n_neurons, r.slot_of_neuron.data()));
    NF_RETURN_IF_ERROR(ReadIndexTensor(rf, GateHashTensorName(prefix, m.bundle_hash), GgmlType::kI64, r.n_neurons,
                                       r.gate_hash.data()));
    NF_RETURN_IF_ERROR(ReadIndexTensor(rf, UpDownHashTensorName(prefix, m.bundle_hash), GgmlType::kI64, r.n_neurons,
                                       r.updown_hash.data()));
    r.neuron_of_slot.assign(n, -1);
    for (size_t k = 0; k < n; ++k) {
      const int32_t s = r.slot_of_neuron[k];
      if (s < 0 || s >= r.n_neurons || r.neuron_of_slot[static_cast<size_t>(s)] != -1) {
        return Status::Corruption(rf.path() + ": " + prefix + ".slot_of_neuron[" + std::to_string(k) + "] = " +
                                  std::to_string(s) + " is out of range or repeated (must be a permutation of 0.." +
                                  std::to_string(r.n_neurons - 1) + ")");
      }
      r.neuron_of_slot[static_cast<size_t>(s)] = static_cast<int32_t>(k);
    }
  }
  return d;
}

std::string Deployment::predictor_path() const {
  return manifest_.predictor_hash.empty() ? std::string() : dir_ + "/" + kPredictorFileName;
}

std::string Deployment::lookahead_path() const {
  return manifest_.lookahead_hash.empty() ? std::string() : dir_ + "/" + kLookaheadFileName;
}

const RegionInfo* Deployment::Region(int64_t layer, int64_t expert) const {
  const int64_t per_layer = std::max<int64_t>(1, manifest_.n_experts);
  if (layer < 0 || layer >= manifest_.n_layers) return nullptr;
  if (manifest_.n_experts > 0 ? (expert < 0 || expert >= manifest_.n_experts) : expert != -1) return nullptr;
  const int64_t idx = region_index_[static_cast<size_t>(layer * per_layer + std::max<int64_t>(0, expert))];
  return idx < 0 ? nullptr : &manifest_.regions[static_cast<size_t>(idx)];
}

const RegionInfo& Deployment::RegionOrDie(int64_t layer, int64_t expert, int64_t neuron) const {
  const RegionInfo* r = Region(layer, expert);
  if (!r || neuron < 0 || neuron >= r->n_neurons) {
    std::fprintf(stderr, "nflash: internal error: no neuron %lld in %s of deployment %s\n",
                 static_cast<long long>(neuron), RegionName(layer, expert).c_str(), dir_.c_str());
    std::abort();
  }
  return *r;
}

ByteRange Deployment::BundleRange(int64_t layer, int64_t expert, int64_t neuron) const {
  const RegionInfo& r = RegionOrDie(layer, expert, neuron);
  const int32_t slot = r.slot_of_neuron[static_cast<size_t>(neuron)];
  return {r.offset + layout().SlotOffset(slot), layout().bundle_bytes};
}

ByteRange Deployment::GateRange(int64_t layer, int64_t expert, int64_t neuron) const {
  ByteRange b = BundleRange(layer, expert, neuron);
  return {b.offset + layout().gate_offset, layout().gate_bytes};
}

ByteRange Deployment::UpDownRange(int64_t layer, int64_t expert, int64_t neuron) const {
  ByteRange b = BundleRange(layer, expert, neuron);
  return {b.offset + layout().up_offset, layout().up_bytes + layout().down_bytes};
}

namespace {
Status HashMismatch(const std::string& flash, const char* part, int64_t layer, int64_t expert, int64_t neuron,
                    int32_t slot, const ByteRange& range, BundleHash hash, uint64_t found, uint64_t want) {
  return Status::Corruption(flash + ": checksum mismatch in the " + part + " of " + RegionName(layer, expert) +
                            " neuron " + std::to_string(neuron) + " (slot " + std::to_string(slot) + ", offset " +
                            std::to_string(range.offset) + ", " + std::to_string(range.size) + " bytes): " +
                            BundleHashName(hash) + " " + HashToHex(found) + ", expected " + HashToHex(want));
}
Status SizeMismatch(const std::string& flash, const char* part, int64_t layer, int64_t expert, int64_t neuron,
                    size_t found, uint64_t want) {
  return Status::InvalidArgument(flash + ": " + part + " of " + RegionName(layer, expert) + " neuron " +
                                 std::to_string(neuron) + ": " + std::to_string(found) + " bytes given, expected " +
                                 std::to_string(want));
}
}  // namespace

Status Deployment::VerifyGate(int64_t layer, int64_t expert, int64_t neuron, std::span<const uint8_t> bytes) const {
  const RegionInfo& r = RegionOrDie(layer, expert, neuron);
  if (bytes.size() != layout().gate_bytes) {
    return SizeMismatch(flash_path(), "gate part", layer, expert, neuron, bytes.size(), layout().gate_bytes);
  }
  const uint64_t h = HashBundlePart(manifest_.bundle_hash, bytes.data(), bytes.size());
  const uint64_t want = r.gate_hash[static_cast<size_t>(neuron)];
  if (h != want) {
    return HashMismatch(flash_path(), "gate part", layer, expert, neuron, r.slot_of_neuron[static_cast<size_t>(neuron)],
                        GateRange(layer, expert, neuron), manifest_.bundle_hash, h, want);
  }
  return Status::Ok();
}

Status Deployment::VerifyUpDown(int64_t layer, int64_t expert, int64_t neuron, std::span<const uint8_t> bytes) const {
  const RegionInfo& r = RegionOrDie(layer, expert, neuron);
  const uint64_t want_size = layout().up_bytes + layout().down_bytes;
  if (bytes.size() != want_size) {
    return SizeMismatch(flash_path(), "up+down parts", layer, expert, neuron, bytes.size(), want_size);
  }
  const uint64_t h = HashBundlePart(manifest_.bundle_hash, bytes.data(), bytes.size());
  const uint64_t want = r.updown_hash[static_cast<size_t>(neuron)];
  if (h != want) {
    return HashMismatch(flash_path(), "up+down parts", layer, expert, neuron,
                        r.slot_of_neuron[static_cast<size_t>(neuron)], UpDownRange(layer, expert, neuron),
                        manifest_.bundle_hash, h, want);
  }
  return Status::Ok();
}

Status Deployment::VerifyBundle(int64_t layer, int64_t expert, int64_t neuron, std::span<const uint8_t> bytes) const {
  if (bytes.size() != layout().bundle_bytes) {
    return SizeMismatch(flash_path(), "bundle", layer, expert, neuron, bytes.size(), layout().bundle_bytes);
  }
  NF_RETURN_IF_ERROR(VerifyGate(layer, expert, neuron, bytes.subspan(0, layout().gate_bytes)));
  return VerifyUpDown(layer, expert, neuron, bytes.subspan(layout().up_offset));
}

}  // namespace nflash::packer
