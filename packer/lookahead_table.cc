#include "packer/lookahead_table.h"

#include <algorithm>
#include <cstring>

#include "runtime/core/file.h"
#include "runtime/core/float16.h"

namespace nflash::packer {

namespace {
constexpr char kArch[] = "nflash-lookahead";
// Columns projected per Gemm call: 256 x dim floats (4 MiB at dim 4096) of scratch, and enough tokens per weight
// row for the Gemm tiles.
constexpr int64_t kColumnsPerCall = 256;

std::string ProjName(int64_t l) { return "blk." + std::to_string(l) + ".proj"; }
}  // namespace

void ProjectColumns(const MatrixView& fc1, const float* norm, std::span<float> cols, int64_t n, uint16_t* out,
                    ThreadPool* pool) {
  const int64_t dim = fc1.cols, rank = fc1.rows;
  for (int64_t k = 0; k < n; ++k) {
    float* c = cols.data() + k * dim;
    for (int64_t i = 0; i < dim; ++i) c[i] *= norm[i];
  }
  std::vector<float> y(static_cast<size_t>(n * rank));
  Gemm(fc1, cols.data(), n, y.data(), pool);
  for (size_t i = 0; i < y.size(); ++i) out[i] = Fp32ToFp16(y[i]);
}

Result<std::unique_ptr<LookaheadTableWriter>> LookaheadTableWriter::Begin(const std::string& path,
                                                                         const Predictor& pred) {
  if (pred.n_experts() > 0) {
    return Status::Unsupported(path + ": a lookahead table is for dense models (the predictor has " +
                               std::to_string(pred.n_experts()) + " experts)");
  }
  std::unique_ptr<LookaheadTableWriter> w(new LookaheadTableWriter(pred));
  w->writer_ = std::make_unique<GgufWriter>();
  GgufWriter& g = *w->writer_;
  g.Set("general.architecture", std::string(kArch));
  g.Set("nflash.lookahead.schema_version", kLookaheadSchemaVersion);
  g.Set("nflash.lookahead.n_layers", static_cast<uint64_t>(pred.n_layers()));
  g.Set("nflash.lookahead.n_ff", static_cast<uint64_t>(pred.n_ff()));
  for (int64_t l = 0; l + 1 < pred.n_layers(); ++l) {
    NF_RETURN_IF_ERROR(g.AddTensor(ProjName(l), GgmlType::kF16,
                                   {static_cast<uint64_t>(pred.info(l + 1).rank), static_cast<uint64_t>(pred.n_ff())}));
  }
  NF_RETURN_IF_ERROR(g.Begin(path, /*overwrite=*/false));
  return w;
}

LookaheadTableWriter::~LookaheadTableWriter() = default;

Status LookaheadTableWriter::WriteLayer(int64_t l, const float* ffn_norm_next,
                                        const std::function<Status(int64_t, float*)>& column, ThreadPool* pool) {
  if (l != next_layer_ || l + 1 >= pred_.n_layers()) {
    return Status::InvalidArgument("lookahead table: layer " + std::to_string(l) + " written, expected " +
                                   std::to_string(next_layer_) + " (of " + std::to_string(pred_.n_layers() - 1) + ")");
  }
  const MatrixView& fc1 = pred_.fc1(l + 1);
  const int64_t dim = fc1.cols, rank = fc1.rows, n_ff = pred_.n_ff();
  std::vector<uint16_t> rows(static_cast<size_t>(n_ff * rank));
  std::vector<float> cols(static_cast<size_t>(kColumnsPerCall * dim));
  for (int64_t first = 0; first < n_ff; first += kColumnsPerCall) {
    const int64_t n = std::min(kColumnsPerCall, n_ff - first);
    for (int64_t k = 0; k < n; ++k) NF_RETURN_IF_ERROR(column(first + k, cols.data() + k * dim));
    ProjectColumns(fc1, ffn_norm_next, cols, n, rows.data() + first * rank, pool);
  }
  ++next_layer_;
  return writer_->WriteTensorData(
      ProjName(l), std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(rows.data()), rows.size() * 2));
}

Status LookaheadTableWriter::Finish() { return writer_->Finish(); }

Result<std::unique_ptr<LookaheadTable>> LookaheadTable::Load(const std::string& path, const Predictor& pred) {
  // With O_DIRECT (weights never go through the page cache), into memory freed once the tensors are copied out.
  NF_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> bytes, ReadFileDirect(path));
  NF_ASSIGN_OR_RETURN(GgufFile f, GgufFile::Open(std::shared_ptr<const ReadableFile>(std::move(bytes))));
  NF_ASSIGN_OR_RETURN(std::string arch, f.GetString("general.architecture"));
  if (arch != kArch) {
    return Status::InvalidArgument(path + ": general.architecture \"" + arch + "\", expected \"" + kArch + "\"");
  }
  NF_ASSIGN_OR_RETURN(uint64_t version, f.GetUint("nflash.lookahead.schema_version"));
  if (version != kLookaheadSchemaVersion) {
    return Status::Unsupported(path + ": nflash.lookahead.schema_version " + std::to_string(version) +
                               ", this nflash reads " + std::to_string(kLookaheadSchemaVersion) + " (re-run nflash pack)");
  }
  NF_ASSIGN_OR_RETURN(uint64_t n_layers, f.GetUint("nflash.lookahead.n_layers"));
  NF_ASSIGN_OR_RETURN(uint64_t n_ff, f.GetUint("nflash.lookahead.n_ff"));
  if (static_cast<int64_t>(n_layers) != pred.n_layers() || static_cast<int64_t>(n_ff) != pred.n_ff() ||
      pred.n_experts() > 0) {
    return Status::InvalidArgument(path + ": a table for " + std::to_string(n_layers) + " layers of " +
                                   std::to_string(n_ff) + " neurons, the predictor has " +
                                   std::to_string(pred.n_layers()) + " of " + std::to_string(pred.n_ff()) +
                                   (pred.n_experts() > 0 ? " and experts" : ""));
  }
  std::unique_ptr<LookaheadTable> t(new LookaheadTable());
  std::vector<uint8_t> scratch;
  for (int64_t l = 0; l + 1 < pred.n_layers(); ++l) {
    const std::string name = ProjName(l);
    const GgufTensorInfo* info = f.FindTensor(name);
    const uint64_t rank = static_cast<uint64_t>(pred.info(l + 1).rank);
    if (info == nullptr) return Status::Corruption(path + ": no tensor " + name);
    if (info->type != GgmlType::kF16 || info->dims.size() != 2 || info->dims[0] != rank || info->dims[1] != n_ff) {
      std::string dims;
      for (uint64_t d : info->dims) dims += (dims.empty() ? "" : " x ") + std::to_string(d);
      return Status::Corruption(path + ": tensor " + name + " is " + std::string(GgmlTypeName(info->type)) + " [" +
                                dims + "], expected f16 [" + std::to_string(rank) + " x " + std::to_string(n_ff) +
                                "] (rank of the predictor's layer " + std::to_string(l + 1) + ")");
    }
    NF_ASSIGN_OR_RETURN(std::span<const uint8_t> bytes, f.TensorData(*info, &scratch));
    t->data_.emplace_back(bytes.begin(), bytes.end());
    t->views_.push_back(DenseMatrix(GgmlType::kF16, t->data_.back().data(), static_cast<int64_t>(n_ff),
                                    static_cast<int64_t>(rank)));
  }
  return t;
}

uint64_t LookaheadTable::bytes() const {
  uint64_t b = 0;
  for (const auto& d : data_) b += d.size();
  return b;
}

}  // namespace nflash::packer
