// Speed floors of a measured decode run (equations in docs/planner.md, "Floors").
#include "planner/floors.h"

#include <algorithm>
#include <string>

namespace nflash::planner {

DenseWeights ResidentDenseWeights(const GgufFile& resident) {
  DenseWeights w;
  const bool tied = resident.FindTensor("output.weight") == nullptr;
  for (const GgufTensorInfo& t : resident.tensors()) {
    if (t.name.rfind("nflash.", 0) == 0) continue;
    if (t.name == "token_embd.weight" && !tied) continue;
    if (t.dims.size() < 2) continue;  // norms: negligible, and not a matrix product
    w.bytes += t.n_bytes;
    w.params += t.n_elements;
  }
  return w;
}

Result<Floors> ComputeFloors(const HardwareParams& hw, const DecodeWork& work) {
  if (hw.dense_gemv_gbs.empty() || hw.sparse_ffn_gbs.empty()) {
    return Status::InvalidArgument("hardware profile: no gemv / sparse-row throughput for the model's weight type");
  }
  const size_t ti = static_cast<size_t>(std::max(work.threads, 1)) - 1;
  const double gemv = hw.dense_gemv_gbs[std::min(ti, hw.dense_gemv_gbs.size() - 1)];
  const double rows = hw.sparse_ffn_gbs[std::min(ti, hw.sparse_ffn_gbs.size() - 1)];
  if (!(gemv > 0) || !(rows > 0)) {
    return Status::InvalidArgument("hardware profile: kernel throughput at " + std::to_string(work.threads) +
                                   " thread(s) is not positive (gemv " + std::to_string(gemv) + " GB/s, sparse rows " +
                                   std::to_string(rows) + " GB/s)");
  }
  Floors f;
  // GB/s = 1e9 bytes/s, so bytes / (GB/s) / 1e6 is milliseconds.
  f.dense_ms = static_cast<double>(work.dense_bytes) / gemv / 1e6;
  f.predictor_ms = static_cast<double>(work.predictor_bytes) / gemv / 1e6;
  f.ffn_ms = work.ffn_bytes / rows / 1e6;
  f.compute_ms = f.dense_ms + f.predictor_ms + f.ffn_ms;
  if (work.read_bytes > 0) {
    if (hw.random_reads.empty()) {
      return Status::InvalidArgument("hardware profile: no random-read results, but the run read from flash");
    }
    // Per-token averages: fewer than one request a token is common with a warm cache (not clamped to 1, which made
    // the mean request smaller than any real one).
    const double mean_request = work.read_requests > 0 ? work.read_bytes / work.read_requests : work.read_bytes;
    const double mbs = hw.ReadMbps(static_cast<uint64_t>(mean_request + 0.5), std::max(work.queue_depth, 1));
    if (!(mbs > 0)) {
      return Status::InvalidArgument("hardware profile: random-read throughput at " +
                                     std::to_string(static_cast<uint64_t>(mean_request)) + " bytes, queue depth " +
                                     std::to_string(work.queue_depth) + " is not positive");
    }
    f.io_ms = work.read_bytes / mbs / 1e3;  // MB/s = 1e6 bytes/s: bytes / (MB/s) / 1e3 is milliseconds
  }
  f.floor_ms = std::max(f.compute_ms, f.io_ms);
  f.ratio = f.floor_ms > 0 ? work.token_ms / f.floor_ms : 0.0;
  return f;
}

}  // namespace nflash::planner
