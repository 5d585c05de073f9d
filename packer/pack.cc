// PackDeployment and neuron ordering (packer/pack.h): model + profile -> DEPLOY_DIR (manifest.json, resident.gguf,
// ffn.bin, optional predictor.gguf), streamed one FFN region at a time.
#include "packer/pack.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <numeric>

#include "packer/deployment.h"
#include "packer/lookahead_table.h"
#include "runtime/core/checksum.h"
#include "runtime/core/file.h"
#include "runtime/core/gguf.h"
#include "runtime/core/log.h"
#include "runtime/core/quant.h"
#include "runtime/engine/model.h"
#include "runtime/engine/predictor.h"

namespace nflash::packer {
namespace fs = std::filesystem;

Result<NeuronOrder> ParseNeuronOrder(const std::string& name) {
  if (name == "hotness") return NeuronOrder::kHotness;
  if (name == "coactivation") return NeuronOrder::kCoactivation;
  return Status::InvalidArgument("--order \"" + name + "\": expected hotness or coactivation");
}

const char* NeuronOrderName(NeuronOrder order) {
  return order == NeuronOrder::kHotness ? "hotness" : "coactivation";
}

namespace {
// Neurons by popularity: count desc, index asc (a deterministic order for equal counts).
std::vector<int32_t> ByPopularity(const profiler::FfnProfile& ffn) {
  std::vector<int32_t> rank(static_cast<size_t>(ffn.n_neurons));
  std::iota(rank.begin(), rank.end(), 0);
  std::stable_sort(rank.begin(), rank.end(), [&](int32_t a, int32_t b) {
    return ffn.count_bs1[static_cast<size_t>(a)] > ffn.count_bs1[static_cast<size_t>(b)];
  });
  return rank;
}
}  // namespace

int64_t HotCount(const profiler::FfnProfile& ffn, double hot_fraction) {
  const int64_t n = ffn.n_neurons;
  if (hot_fraction >= 0) {
    return std::clamp<int64_t>(std::llround(hot_fraction * static_cast<double>(n)), 0, n);
  }
  const std::vector<int32_t> rank = ByPopularity(ffn);
  uint64_t total = 0;
  for (uint32_t c : ffn.count_bs1) total += c;
  if (total == 0) return 0;
  uint64_t covered = 0;
  for (int64_t k = 0; k < n; ++k) {
    covered += ffn.count_bs1[static_cast<size_t>(rank[static_cast<size_t>(k)])];
    if (static_cast<double>(covered) >= kDefaultHotActivationShare * static_cast<double>(total)) return k + 1;
  }
  return n;
}

NeuronOrder EffectiveOrder(const profiler::FfnProfile& ffn, NeuronOrder order) {
  return ffn.coact_k > 0 ? order : NeuronOrder::kHotness;
}

std::vector<int32_t> OrderNeurons(const profiler::FfnProfile& ffn, int64_t hot_count, NeuronOrder order) {
  const std::vector<int32_t> rank = ByPopularity(ffn);
  const auto n = static_cast<size_t>(ffn.n_neurons);
  const auto hot = static_cast<size_t>(std::clamp<int64_t>(hot_count, 0, ffn.n_neurons));
  if (EffectiveOrder(ffn, order) == NeuronOrder::kHotness) return rank;
  std::vector<int32_t> out(rank.begin(), rank.begin() + static_cast<std::ptrdiff_t>(hot));
  std::vector<uint8_t> placed(n, 0);  // hot neurons count as placed: chains run over cold neurons only
  for (size_t k = 0; k < hot; ++k) placed[static_cast<size_t>(rank[k])] = 1;
  const auto K = static_cast<size_t>(ffn.coact_k);
  for (size_t k = hot; k < n; ++k) {
    int32_t cur = rank[k];
    if (placed[static_cast<size_t>(cur)]) continue;
    for (;;) {
      placed[static_cast<size_t>(cur)] = 1;
      out.push_back(cur);
      int32_t next = -1;
      for (size_t j = 0; j < K; ++j) {
        const size_t at = static_cast<size_t>(cur) * K + j;
        const int32_t p = ffn.coact_partner[at];
        if (p >= 0 && static_cast<size_t>(p) < n && ffn.coact_count[at] > 0 && !placed[static_cast<size_t>(p)]) {
          next = p;
          break;
        }
      }
      if (next < 0) break;
      cur = next;
    }
  }
  return out;
}

namespace {

bool IsFfnNeuronTensor(const std::string& name) {
  static const char* kSuffixes[] = {".ffn_gate.weight",      ".ffn_up.weight",      ".ffn_down.weight",
                                    ".ffn_gate_exps.weight", ".ffn_up_exps.weight", ".ffn_down_exps.weight"};
  if (name.rfind("blk.", 0) != 0) return false;
  for (const char* s : kSuffixes) {
    const size_t len = std::strlen(s);
    if (name.size() > len && name.compare(name.size() - len, len, s) == 0) return true;
  }
  return false;
}

// The source matrices of one region: gate/up (n_ff rows of dim), down (dim rows of n_ff), as raw bytes.
struct RegionSource {
  // Owned copies, read with three large sequential reads: bundles take rows in slot (permuted) order, which on a
  // mapping would fault pages in at random.
  std::vector<uint8_t> gate_buf, up_buf, down_buf;
  const uint8_t* gate = nullptr;
  const uint8_t* up = nullptr;
  const uint8_t* down = nullptr;
  GgmlType gate_type{}, up_type{}, down_type{};
  size_t gate_row = 0, up_row = 0, down_row = 0;  // bytes per row
};

Result<const GgufTensorInfo*> FindShaped(const GgufFile& f, const std::string& name, std::vector<uint64_t> dims) {
  const GgufTensorInfo* t = f.FindTensor(name);
  if (!t) return Status::NotFound(f.path() + ": tensor " + name + " is missing");
  if (t->dims != dims) {
    return Status::Corruption(f.path() + ": tensor " + name + " has shape " + ShapeToString(t->dims) + ", expected " +
                              ShapeToString(dims));
  }
  if (!IsRowType(t->type)) {
    return Status::Unsupported(f.path() + ": tensor " + name + " has type " + std::string(GgmlTypeName(t->type)) +
                               "; the packer handles f32, f16, bf16, q8_0, q4_0");
  }
  return t;
}

// Layer `layer`'s FFN norm weights as floats (the lookahead table's input).
Result<std::vector<float>> ReadNormWeights(const GgufFile& f, int64_t layer, int64_t dim, std::vector<uint8_t>* scratch) {
  NF_ASSIGN_OR_RETURN(const GgufTensorInfo* t, FindShaped(f, "blk." + std::to_string(layer) + ".ffn_norm.weight",
                                                          {static_cast<uint64_t>(dim)}));
  NF_ASSIGN_OR_RETURN(std::span<const uint8_t> bytes, f.TensorData(*t, scratch));
  std::vector<float> w(static_cast<size_t>(dim));
  NF_RETURN_IF_ERROR(DequantizeRow(t->type, bytes.data(), w.data(), dim));
  return w;
}

Result<RegionSource> FindRegionSource(const GgufFile& f, int64_t layer, int64_t expert, int64_t n_experts, int64_t dim,
                                      int64_t n_ff, bool read_data) {
  const std::string p = "blk." + std::to_string(layer) + ".";
  const auto D = static_cast<uint64_t>(dim), F = static_cast<uint64_t>(n_ff), E = static_cast<uint64_t>(n_experts);
  const bool moe = n_experts > 0;
  NF_ASSIGN_OR_RETURN(const GgufTensorInfo* g, FindShaped(f, p + (moe ? "ffn_gate_exps.weight" : "ffn_gate.weight"),
                                                          moe ? std::vector<uint64_t>{D, F, E} : std::vector<uint64_t>{D, F}));
  NF_ASSIGN_OR_RETURN(const GgufTensorInfo* u, FindShaped(f, p + (moe ? "ffn_up_exps.weight" : "ffn_up.weight"),
                                                          moe ? std::vector<uint64_t>{D, F, E} : std::vector<uint64_t>{D, F}));
  NF_ASSIGN_OR_RETURN(const GgufTensorInfo* d, FindShaped(f, p + (moe ? "ffn_down_exps.weight" : "ffn_down.weight"),
                                                          moe ? std::vector<uint64_t>{F, D, E} : std::vector<uint64_t>{F, D}));
  RegionSource s;
  s.gate_type = g->type;
  s.up_type = u->type;
  s.down_type = d->type;
  s.gate_row = *RowBytes(g->type, D);
  s.up_row = *RowBytes(u->type, D);
  s.down_row = *RowBytes(d->type, F);
  const size_t e = moe ? static_cast<size_t>(expert) : 0;
  if (!read_data) return s;
  auto read = [&](const GgufTensorInfo* t, size_t row_bytes, uint64_t rows, std::vector<uint8_t>* buf) -> Status {
    buf->resize(row_bytes * rows);
    return f.file().ReadAt(f.data_offset() + t->offset + e * row_bytes * rows, buf->size(), buf->data());
  };
  NF_RETURN_IF_ERROR(read(g, s.gate_row, F, &s.gate_buf));
  NF_RETURN_IF_ERROR(read(u, s.up_row, F, &s.up_buf));
  NF_RETURN_IF_ERROR(read(d, s.down_row, D, &s.down_buf));
  s.gate = s.gate_buf.data();
  s.up = s.up_buf.data();
  s.down = s.down_buf.data();
  return s;
}

size_t ElementBytes(GgmlType t) { return t == GgmlType::kF32 ? 4 : 2; }  // F32 / F16 / BF16 only

// Fills `region` (layout.RegionBytes(n) zeroed bytes) with the bundles of `src` in slot order and computes the
// per-neuron hashes with `hash`. Down columns: raw element copies for F32/F16/BF16 (exact); for Q8_0/Q4_0 the rows are
// dequantized and each column requantized with QuantizeRow (ggml's reference quantizer) or stored as F32.
Status FillRegion(const RegionSource& src, const BundleLayout& layout, int64_t n_ff,
                  const std::vector<int32_t>& neuron_of_slot, BundleHash hash, ThreadPool* pool,
                  std::vector<uint8_t>* region, std::vector<uint64_t>* gate_hash, std::vector<uint64_t>* updown_hash) {
  const int64_t dim = layout.dim;
  const bool raw_down = src.down_type == layout.down_type &&
                        (src.down_type == GgmlType::kF32 || src.down_type == GgmlType::kF16 ||
                         src.down_type == GgmlType::kBF16);
  std::vector<float> down_f32;  // (dim, n_ff) when the column is requantized
  std::vector<Status> errors(static_cast<size_t>(std::max(1, pool->NumThreads())));
  if (!raw_down) {
    down_f32.resize(static_cast<size_t>(dim * n_ff));
    pool->ParallelFor(dim, 16, [&](int64_t b, int64_t e, int t) {
      for (int64_t r = b; r < e; ++r) {
        Status s = DequantizeRow(src.down_type, src.down + static_cast<size_t>(r) * src.down_row,
                                 down_f32.data() + r * n_ff, n_ff);
        if (!s.ok()) errors[static_cast<size_t>(t)] = s;
      }
    });
  }
  // Down columns in neuron order, transposed in tiles of kTile neurons: each pass over the dim rows reads kTile
  // contiguous elements per row instead of one element per cache line.
  constexpr int64_t kTile = 32;
  const size_t ebytes = raw_down ? ElementBytes(src.down_type) : 0;
  std::vector<uint8_t> down_cols(static_cast<size_t>(n_ff) * layout.down_bytes);
  pool->ParallelFor((n_ff + kTile - 1) / kTile, 1, [&](int64_t tb, int64_t te, int t) {
    std::vector<float> tile(static_cast<size_t>(kTile * dim));
    for (int64_t tile_i = tb; tile_i < te; ++tile_i) {
      const int64_t n0 = tile_i * kTile, n1 = std::min(n_ff, n0 + kTile);
      for (int64_t r = 0; r < dim; ++r) {
        for (int64_t n = n0; n < n1; ++n) {
          if (raw_down) {
            std::memcpy(down_cols.data() + static_cast<size_t>(n) * layout.down_bytes + static_cast<size_t>(r) * ebytes,
                        src.down + static_cast<size_t>(r) * src.down_row + static_cast<size_t>(n) * ebytes, ebytes);
          } else {
            tile[static_cast<size_t>((n - n0) * dim + r)] = down_f32[static_cast<size_t>(r * n_ff + n)];
          }
        }
      }
      if (raw_down) continue;
      for (int64_t n = n0; n < n1; ++n) {
        Status s = QuantizeRow(layout.down_type, tile.data() + (n - n0) * dim,
                               down_cols.data() + static_cast<size_t>(n) * layout.down_bytes, dim);
        if (!s.ok()) errors[static_cast<size_t>(t)] = s;
      }
    }
  });
  pool->ParallelFor(n_ff, 64, [&](int64_t b, int64_t e, int) {
    for (int64_t slot = b; slot < e; ++slot) {
      const auto neuron = static_cast<size_t>(neuron_of_slot[static_cast<size_t>(slot)]);
      uint8_t* bundle = region->data() + layout.SlotOffset(slot);
      std::memcpy(bundle + layout.gate_offset, src.gate + neuron * src.gate_row, layout.gate_bytes);
      std::memcpy(bundle + layout.up_offset, src.up + neuron * src.up_row, layout.up_bytes);
      std::memcpy(bundle + layout.down_offset, down_cols.data() + neuron * layout.down_bytes, layout.down_bytes);
      (*gate_hash)[neuron] = HashBundlePart(hash, bundle + layout.gate_offset, layout.gate_bytes);
      (*updown_hash)[neuron] = HashBundlePart(hash, bundle + layout.up_offset, layout.up_bytes + layout.down_bytes);
    }
  });
  for (const Status& s : errors) NF_RETURN_IF_ERROR(s);
  return Status::Ok();
}

// Checks that the profile describes this model's FFNs (shapes and per-neuron arrays), naming the mismatch.
Status CheckProfileShape(const profiler::ModelProfile& p, const LlamaHparams& hp, const std::string& model_path) {
  auto mismatch = [&](const char* what, int64_t prof, int64_t model) {
    return Status::InvalidArgument("profile " + std::string(what) + " is " + std::to_string(prof) + " but " +
                                   model_path + " has " + std::to_string(model) + " (profile made for another model?)");
  };
  if (p.n_layers != hp.n_layers) return mismatch("n_layers", p.n_layers, hp.n_layers);
  if (p.n_ff != hp.n_ff) return mismatch("n_ff", p.n_ff, hp.n_ff);
  if (p.n_experts != hp.n_experts) return mismatch("n_experts", p.n_experts, hp.n_experts);
  if (p.dim != hp.dim) return mismatch("dim", p.dim, hp.dim);
  for (int64_t l = 0; l < hp.n_layers; ++l) {
    for (int64_t e = hp.n_experts > 0 ? 0 : -1; e < std::max<int64_t>(0, hp.n_experts); ++e) {
      const profiler::FfnProfile* f = p.Find(l, e);
      if (!f) {
        return Status::InvalidArgument("profile has no entry for layer " + std::to_string(l) + " expert " +
                                       std::to_string(e) + " of " + model_path);
      }
      if (f->n_neurons != hp.n_ff || static_cast<int64_t>(f->count_bs1.size()) != hp.n_ff) {
        return Status::InvalidArgument("profile layer " + std::to_string(l) + ": n_neurons " +
                                       std::to_string(f->n_neurons) + ", count_bs1 length " +
                                       std::to_string(f->count_bs1.size()) + ", expected n_ff " + std::to_string(hp.n_ff));
      }
      if (f->coact_k > 0 && (static_cast<int64_t>(f->coact_partner.size()) != f->coact_k * hp.n_ff ||
                             f->coact_count.size() != f->coact_partner.size())) {
        return Status::InvalidArgument("profile layer " + std::to_string(l) + ": coact arrays of length " +
                                       std::to_string(f->coact_partner.size()) + "/" +
                                       std::to_string(f->coact_count.size()) + ", expected coact_k * n_ff = " +
                                       std::to_string(f->coact_k * hp.n_ff));
      }
    }
  }
  return Status::Ok();
}

// Copies a file in large chunks through an AtomicFileWriter.
Status CopyFile(const std::string& from, const std::string& to) {
  NF_ASSIGN_OR_RETURN(auto in, OpenPreadFile(from));
  NF_ASSIGN_OR_RETURN(auto out, AtomicFileWriter::Create(to, false));
  constexpr size_t kChunk = size_t{8} << 20;  // large sequential reads; the size does not matter much
  std::vector<uint8_t> buf(kChunk);
  for (uint64_t off = 0; off < in->Size(); off += kChunk) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(kChunk, in->Size() - off));
    NF_RETURN_IF_ERROR(in->ReadAt(off, n, buf.data()));
    NF_RETURN_IF_ERROR(out->Append(buf.data(), n));
  }
  return out->Commit();
}

// Removes the temporary directory unless released (a failed pack leaves nothing behind). Thread-safety: not
// thread-safe (one per pack).
class TempDirGuard {
 public:
  explicit TempDirGuard(std::string path) : path_(std::move(path)) {}
  ~TempDirGuard() {
    if (!path_.empty()) {
      std::error_code ec;
      fs::remove_all(path_, ec);
    }
  }
  void Release() { path_.clear(); }

 private:
  std::string path_;
};

}  // namespace

Result<PackStats> PackDeployment(const std::string& model_path, const profiler::ModelProfile& profile,
                                 const std::string& profile_hash, const std::string& out_dir,
                                 const PackOptions& options, ThreadPool* pool) {
  const auto start = std::chrono::steady_clock::now();
  std::error_code ec;
  if (fs::exists(out_dir, ec) && !options.overwrite) {
    return Status::InvalidArgument(out_dir + " exists; pass --force to overwrite");
  }
  NF_ASSIGN_OR_RETURN(uint64_t model_hash_value, HashFile(model_path));
  const std::string model_hash = HashToHex(model_hash_value);
  NF_RETURN_IF_ERROR(profiler::CheckProfileForModel(profile, model_hash, model_path));
  NF_ASSIGN_OR_RETURN(GgufFile model, GgufFile::OpenPath(model_path, /*use_mmap=*/false));
  NF_ASSIGN_OR_RETURN(LlamaHparams hp, ReadLlamaHparams(model));
  NF_RETURN_IF_ERROR(CheckProfileShape(profile, hp, model_path));

  NF_ASSIGN_OR_RETURN(RegionSource first, FindRegionSource(model, 0, hp.n_experts > 0 ? 0 : -1, hp.n_experts, hp.dim, hp.n_ff, false));
  NF_ASSIGN_OR_RETURN(BundleLayout layout, MakeBundleLayout(hp.dim, first.gate_type, first.up_type,
                                                            ColumnType(first.down_type, hp.dim)));
  Manifest m;
  m.model_name = hp.name;
  m.model_hash = model_hash;
  m.profile_hash = profile_hash;
  m.activation = std::string(FfnActivationName(hp.activation));
  m.dim = hp.dim;
  m.n_ff = hp.n_ff;
  m.n_layers = hp.n_layers;
  m.n_experts = hp.n_experts;
  m.layout = layout;
  m.bundle_hash = kDefaultBundleHash;
  m.hot_fraction = options.hot_fraction;

  const std::string tmp = out_dir + ".tmp-" + std::to_string(::getpid());
  fs::remove_all(tmp, ec);
  if (!fs::create_directories(tmp, ec)) {
    return Status::IOError("cannot create " + tmp + ": " + ec.message());
  }
  TempDirGuard guard(tmp);

  // resident.gguf: all metadata and every non-FFN tensor; the index tables are declared now, written last.
  GgufWriter resident;
  for (const auto& [key, value] : model.metadata()) {
    if (key != "general.alignment") resident.Set(key, value);
  }
  // Tensor data 4 KiB aligned, so the runtime can read resident tensors with O_DIRECT too.
  resident.Set("general.alignment", static_cast<uint32_t>(kDeployAlignment));
  resident.Set("nflash.deploy.schema_version", static_cast<uint32_t>(kDeploymentSchemaVersion));
  std::vector<const GgufTensorInfo*> kept;
  for (const auto& t : model.tensors()) {
    if (IsFfnNeuronTensor(t.name)) continue;
    NF_RETURN_IF_ERROR(resident.AddTensor(t.name, t.type, t.dims));
    kept.push_back(&t);
  }
  const int64_t per_layer = std::max<int64_t>(1, hp.n_experts);
  const auto n_regions = static_cast<size_t>(hp.n_layers * per_layer);
  for (size_t i = 0; i < n_regions; ++i) {
    const int64_t layer = static_cast<int64_t>(i) / per_layer;
    const int64_t expert = hp.n_experts > 0 ? static_cast<int64_t>(i) % per_layer : -1;
    const std::string prefix = IndexTensorPrefix(layer, expert);
    const std::vector<uint64_t> dims = {static_cast<uint64_t>(hp.n_ff)};
    NF_RETURN_IF_ERROR(resident.AddTensor(prefix + ".slot_of_neuron", GgmlType::kI32, dims));
    NF_RETURN_IF_ERROR(resident.AddTensor(GateHashTensorName(prefix, m.bundle_hash), GgmlType::kI64, dims));
    NF_RETURN_IF_ERROR(resident.AddTensor(UpDownHashTensorName(prefix, m.bundle_hash), GgmlType::kI64, dims));
  }
  const std::string resident_path = tmp + "/" + kResidentFileName;
  NF_RETURN_IF_ERROR(resident.Begin(resident_path, false));
  {
    std::vector<uint8_t> scratch;
    for (const GgufTensorInfo* t : kept) {
      NF_ASSIGN_OR_RETURN(auto bytes, model.TensorData(*t, &scratch));
      NF_RETURN_IF_ERROR(resident.WriteTensorData(t->name, bytes));
    }
  }

  // lookahead.gguf (dense models with a predictor): layer l's table from its down columns, while its region is in
  // memory.
  std::unique_ptr<Predictor> predictor;
  std::unique_ptr<LookaheadTableWriter> lookahead;
  const std::string lookahead_path = tmp + "/" + kLookaheadFileName;
  if (!options.predictor_path.empty() && hp.n_experts == 0 && hp.n_layers >= 2) {
    NF_ASSIGN_OR_RETURN(predictor, Predictor::Load(options.predictor_path));
    // The runtime's own check (without the model hash, which only the runtime's loader enforces).
    NF_RETURN_IF_ERROR(predictor->CheckForModel(hp, "", model_path));
    NF_ASSIGN_OR_RETURN(lookahead, LookaheadTableWriter::Begin(lookahead_path, *predictor));
  }
  std::vector<float> norm_next;
  std::vector<uint8_t> norm_scratch;

  // ffn.bin, one region at a time.
  NF_ASSIGN_OR_RETURN(auto flash, AtomicFileWriter::Create(tmp + "/" + kFlashFileName, false));
  const uint64_t region_bytes = layout.RegionBytes(hp.n_ff);
  std::unique_ptr<ProgressBar> bar;
  if (options.progress) bar = std::make_unique<ProgressBar>("pack", region_bytes * n_regions);
  std::vector<uint8_t> region_buf;
  struct Tables {
    std::vector<int32_t> slot_of_neuron;
    std::vector<uint64_t> gate_hash, updown_hash;
  };
  std::vector<Tables> tables(n_regions);
  double active_weighted = 0.0;  // sum of the regions' active fraction x n_ff (per run of each FFN)
  double active_per_token = 0.0;  // sum of the regions' active_per_token (routing included)
  PackStats stats;
  bool chained = false;  // some region's cold neurons were chained (its profile has co-activation partners)
  for (size_t i = 0; i < n_regions; ++i) {
    const int64_t layer = static_cast<int64_t>(i) / per_layer;
    const int64_t expert = hp.n_experts > 0 ? static_cast<int64_t>(i) % per_layer : -1;
    const profiler::FfnProfile& fp = *profile.Find(layer, expert);
    NF_ASSIGN_OR_RETURN(RegionSource src, FindRegionSource(model, layer, expert, hp.n_experts, hp.dim, hp.n_ff, true));
    if (src.gate_type != layout.gate_type || src.up_type != layout.up_type ||
        ColumnType(src.down_type, hp.dim) != layout.down_type) {
      return Status::Unsupported(model_path + ": layer " + std::to_string(layer) +
                                 " FFN types differ from layer 0's; a deployment has one bundle layout");
    }
    RegionInfo r;
    r.layer = layer;
    r.expert = expert;
    r.n_neurons = hp.n_ff;
    r.hot_count = HotCount(fp, options.hot_fraction);
    NF_RETURN_IF_ERROR(flash->PadTo(kDeployAlignment));
    r.offset = flash->Offset();
    r.size = region_bytes;
    r.hot_bytes = layout.RegionBytes(r.hot_count);
    r.active_per_token =
        std::min(1.0, profile.RoutedShare(fp)) * fp.mean_active_fraction * static_cast<double>(hp.n_ff);
    const std::vector<int32_t> neuron_of_slot = OrderNeurons(fp, r.hot_count, options.order);
    chained = chained || EffectiveOrder(fp, options.order) == NeuronOrder::kCoactivation;
    Tables& tb = tables[i];
    tb.slot_of_neuron.assign(static_cast<size_t>(hp.n_ff), -1);
    for (size_t s = 0; s < neuron_of_slot.size(); ++s) tb.slot_of_neuron[static_cast<size_t>(neuron_of_slot[s])] = static_cast<int32_t>(s);
    tb.gate_hash.assign(static_cast<size_t>(hp.n_ff), 0);
    tb.updown_hash.assign(static_cast<size_t>(hp.n_ff), 0);
    region_buf.assign(region_bytes, 0);
    NF_RETURN_IF_ERROR(FillRegion(src, layout, hp.n_ff, neuron_of_slot, m.bundle_hash, pool, &region_buf,
                                  &tb.gate_hash, &tb.updown_hash));
    NF_RETURN_IF_ERROR(flash->Append(region_buf.data(), region_buf.size()));
    if (lookahead && layer + 1 < hp.n_layers) {
      NF_ASSIGN_OR_RETURN(norm_next, ReadNormWeights(model, layer + 1, hp.dim, &norm_scratch));
      auto column = [&](int64_t k, float* dst) {
        const int64_t slot = tb.slot_of_neuron[static_cast<size_t>(k)];
        const BundleView v = ViewBundle(layout, region_buf.data() + layout.SlotOffset(slot), layout.bundle_bytes);
        return DequantizeRow(v.down.type, v.down.data, dst, hp.dim);
      };
      NF_RETURN_IF_ERROR(lookahead->WriteLayer(layer, norm_next.data(), column, pool));
    }
    active_weighted += fp.mean_active_fraction * static_cast<double>(hp.n_ff);
    active_per_token += r.active_per_token;
    stats.hot_neurons += r.hot_count;
    stats.neurons += r.n_neurons;
    m.regions.push_back(r);
    if (bar) bar->Update(region_bytes * (i + 1));
  }
  if (bar) bar->Finish();
  m.flash_bytes = flash->Offset();
  NF_RETURN_IF_ERROR(flash->Commit());
  for (size_t i = 0; i < n_regions; ++i) {
    const std::string prefix = IndexTensorPrefix(m.regions[i].layer, m.regions[i].expert);
    const Tables& tb = tables[i];
    auto bytes = [](const auto& v) {
      return std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(v.data()), v.size() * sizeof(v[0]));
    };
    NF_RETURN_IF_ERROR(resident.WriteTensorData(prefix + ".slot_of_neuron", bytes(tb.slot_of_neuron)));
    NF_RETURN_IF_ERROR(resident.WriteTensorData(GateHashTensorName(prefix, m.bundle_hash), bytes(tb.gate_hash)));
    NF_RETURN_IF_ERROR(resident.WriteTensorData(UpDownHashTensorName(prefix, m.bundle_hash), bytes(tb.updown_hash)));
  }
  NF_RETURN_IF_ERROR(resident.Finish());

  if (!options.predictor_path.empty()) {
    // Copied verbatim rather than merged into resident.gguf: Predictor::Load reads a file with its own
    // general.architecture and schema keys, so a copy keeps one loader; its hash guards it like the rest.
    NF_ASSIGN_OR_RETURN(GgufFile pred, GgufFile::OpenPath(options.predictor_path, true));
    (void)pred;  // opened only to reject a non-GGUF file early with GgufFile's message
    const std::string dst = tmp + "/" + kPredictorFileName;
    NF_RETURN_IF_ERROR(CopyFile(options.predictor_path, dst));
    NF_ASSIGN_OR_RETURN(uint64_t ph, HashFile(dst));
    m.predictor_hash = HashToHex(ph);
    m.predictor_bytes = fs::file_size(dst, ec);
  }
  if (lookahead) {
    NF_RETURN_IF_ERROR(lookahead->Finish());
    NF_ASSIGN_OR_RETURN(uint64_t lh, HashFile(lookahead_path));
    m.lookahead_hash = HashToHex(lh);
    m.lookahead_bytes = fs::file_size(lookahead_path, ec);
  }
  if (!options.profile_path.empty()) {
    const std::string dst = tmp + "/" + kProfileFileName;
    NF_RETURN_IF_ERROR(CopyFile(options.profile_path, dst));
    NF_ASSIGN_OR_RETURN(uint64_t copied, HashFile(dst));
    if (HashToHex(copied) != profile_hash) {
      return Status::IOError(dst + ": the copy of " + options.profile_path + " hashes to " + HashToHex(copied) +
                             ", expected " + profile_hash + " (changed while packing?)");
    }
  }
  NF_ASSIGN_OR_RETURN(uint64_t rh, HashFile(resident_path));
  m.resident_hash = HashToHex(rh);
  m.resident_bytes = fs::file_size(resident_path, ec);
  const uint64_t bundles = static_cast<uint64_t>(stats.neurons);
  m.padding_bytes = m.flash_bytes - bundles * layout.bundle_bytes;
  m.mean_active_fraction = stats.neurons > 0 ? active_weighted / static_cast<double>(stats.neurons) : 0.0;
  m.expected_bytes_per_token = active_per_token * static_cast<double>(layout.bundle_bytes);
  m.read_amplification = static_cast<double>(layout.group_bytes) /
                         static_cast<double>(static_cast<uint64_t>(layout.slots_per_group) * layout.bundle_bytes);
  {
    NF_ASSIGN_OR_RETURN(auto w, AtomicFileWriter::Create(tmp + "/" + kManifestFileName, false));
    // The order the layout really has: co-activation falls back to popularity for a profile without partners.
    m.order = NeuronOrderName(chained ? NeuronOrder::kCoactivation : NeuronOrder::kHotness);
    const std::string json = ManifestToJson(m);
    NF_RETURN_IF_ERROR(w->Append(json.data(), json.size()));
    NF_RETURN_IF_ERROR(w->Commit());
  }

  // Swap the finished directory into place; an existing one (--force) is moved aside first and removed after.
  std::string old;
  if (fs::exists(out_dir, ec)) {
    old = out_dir + ".old-" + std::to_string(::getpid());
    fs::remove_all(old, ec);
    fs::rename(out_dir, old, ec);
    if (ec) return Status::IOError("cannot move the existing " + out_dir + " aside: " + ec.message());
  }
  fs::rename(tmp, out_dir, ec);
  if (ec) return Status::IOError("cannot rename " + tmp + " to " + out_dir + ": " + ec.message());
  guard.Release();
  if (!old.empty()) fs::remove_all(old, ec);

  stats.flash_bytes = m.flash_bytes;
  stats.resident_bytes = m.resident_bytes;
  stats.padding_bytes = m.padding_bytes;
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return stats;
}

}  // namespace nflash::packer
