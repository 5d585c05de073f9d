// Speed floors of a measured decode run (docs/planner.md, "Floors"): the least time a token can take on this machine
// for the work the run actually did, from the hardware profile (hw.json). The compute floor streams every weight byte
// the token multiplies with at the measured kernel throughputs; the I/O floor reads the bytes the run read from flash
// at the measured random-read throughput of its request size and queue depth. A run within a small factor of the
// larger floor has little left to gain from overheads (issue 6: within 1.3x).
#pragma once

#include <cstdint>

#include "planner/cost_model.h"
#include "runtime/core/gguf.h"
#include "runtime/core/status.h"

namespace nflash::planner {

// The resident matrices a decode token multiplies with: attention projections, MoE router, output head (the embedding
// table when it doubles as the head; otherwise it is a one-row lookup). Norms (1-D) and the deployment's index tables
// (`nflash.*`) are not matrix products. `bytes` as stored, `params` their element count.
struct DenseWeights {
  uint64_t bytes = 0;
  uint64_t params = 0;
};
DenseWeights ResidentDenseWeights(const GgufFile& resident);

// What one measured decode run did, per token (counters over the decode steps divided by their number).
struct DecodeWork {
  int threads = 1;                    // compute threads
  uint64_t dense_bytes = 0;           // ResidentDenseWeights().bytes
  uint64_t predictor_bytes = 0;       // read per token by the active-set source: predictor, or the oracle's gate rows
  // FFN weight bytes that must be computed per token, all layers: the gate row of every predicted neuron (none when
  // the oracle already has every gate value) and the up row and down column of those with h != 0; at most
  // (neurons computed) x (bundle bytes).
  double ffn_bytes = 0;
  double read_bytes = 0;              // flash bytes read per token
  double read_requests = 0;           // read requests per token (after coalescing)
  int queue_depth = 1;                // io_uring queue depth of the run
  double token_ms = 0;                // measured mean time per decode token
};

// Floors in milliseconds per token. compute_ms = dense_ms + predictor_ms + ffn_ms.
struct Floors {
  double dense_ms = 0, predictor_ms = 0, ffn_ms = 0;
  double compute_ms = 0;
  double io_ms = 0;
  double floor_ms = 0;  // max(compute_ms, io_ms)
  double ratio = 0;     // token_ms / floor_ms (0 when the floor is 0)
};

// InvalidArgument when `hw` has no kernel throughput (no hw.json results for the model's type) or a non-positive one,
// or when the run read bytes but the hardware profile has no random reads. Thread counts beyond those measured use
// the largest measured count (hw.json may stop early; more threads than measured cannot be assumed faster).
Result<Floors> ComputeFloors(const HardwareParams& hw, const DecodeWork& work);

}  // namespace nflash::planner
