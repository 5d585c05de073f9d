// The lookahead projection table (deployment file lookahead.gguf): what lets the offloaded runtime guess layer l+1's
// active neurons from layer l's cache hits without summing their down columns (docs/runtime.md, "Lookahead").
//
// The guess's input is v = r + sum_k h_k d_k (the FFN input residual r of layer l plus the hits' down columns d_k
// weighted by their activations h_k), normalised with layer l+1's ffn_norm w; the predictor of layer l+1 starts with
// fc1 . (w * v / rms(v)). fc1 is linear, so
//   fc1 . (w * v) = fc1 . (w * r) + sum_k h_k P_k,   P_k = fc1_{l+1} . (w_{l+1} * d_k)   (a rank-long vector)
// and the table holds P_k for every neuron k of every layer but the last: per hit, rank multiply-adds instead of a
// dim-long down column (at 7B Q4_0, 2.3 KB read per hit against ~0.1 KB). Only 1/rms(v) is not in the table; the
// runtime takes it as rms(r) times last token's ratio rms(layer output) / rms(r) of the same layer.
//
// File layout (GGUF v3, general.architecture = "nflash-lookahead"):
//   tensors  blk.N.proj  (n_ff rows of rank_{N+1}) F16, for N = 0 .. n_layers - 2; row k = P_k of layer N
//   metadata nflash.lookahead.schema_version u32 (kLookaheadSchemaVersion); nflash.lookahead.n_layers, .n_ff u64
// The manifest records its hash and size (lookahead_hash, lookahead_bytes) and the predictor's hash, which the table
// was computed from; dense models only (a mixture of experts guesses the next layer's experts first).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "runtime/core/gguf.h"
#include "runtime/core/kernels.h"
#include "runtime/core/status.h"
#include "runtime/core/thread_pool.h"
#include "runtime/engine/predictor.h"

namespace nflash::packer {

inline constexpr uint32_t kLookaheadSchemaVersion = 1;

// Rows n of `out` (n x fc1.rows, F16 bits) = fc1 . (norm * cols[n]) for the n columns in `cols` (n x fc1.cols floats,
// row-major; scaled in place by `norm`).
void ProjectColumns(const MatrixView& fc1, const float* norm, std::span<float> cols, int64_t n, uint16_t* out,
                    ThreadPool* pool);

// Writes lookahead.gguf layer by layer (the packer streams one FFN region at a time): Begin declares every tensor from
// the predictor's ranks, WriteLayer(l) must follow for l = 0 .. n_layers - 2 in order, then Finish.
class LookaheadTableWriter {
 public:
  static Result<std::unique_ptr<LookaheadTableWriter>> Begin(const std::string& path, const Predictor& pred);
  ~LookaheadTableWriter();
  // Layer l's rows: `column(k, dst)` writes neuron k's down column of layer l (dim floats; its error stops the layer);
  // `ffn_norm_next` is layer l+1's FFN norm (dim floats).
  Status WriteLayer(int64_t l, const float* ffn_norm_next, const std::function<Status(int64_t, float*)>& column,
                    ThreadPool* pool);
  Status Finish();

 private:
  explicit LookaheadTableWriter(const Predictor& pred) : pred_(pred) {}
  const Predictor& pred_;
  std::unique_ptr<GgufWriter> writer_;
  int64_t next_layer_ = 0;
};

// The table in memory, read from a deployment's lookahead.gguf and checked against the predictor it serves (layer
// count, n_ff, ranks).
class LookaheadTable {
 public:
  static Result<std::unique_ptr<LookaheadTable>> Load(const std::string& path, const Predictor& pred);
  // Layer l's P rows (n_ff rows of rank_{l+1}, F16), l < n_layers - 1.
  const MatrixView& layer(int64_t l) const { return views_[static_cast<size_t>(l)]; }
  uint64_t bytes() const;

 private:
  std::vector<std::vector<uint8_t>> data_;
  std::vector<MatrixView> views_;
};

}  // namespace nflash::packer
