// Low-rank predictors fitted in closed form from the model's own gate weights (`train-predictor --method lowrank`).
//
// A neuron's gate pre-activation over the calibration tokens is G = X W^T (tokens x n_ff). The best rank-r linear
// predictor of the centred G from the FFN input (reduced-rank regression, whose full-rank solution is W itself) is
// G_c ~= G_c Q Q^T, where Q (n_ff x r) spans the top r principal directions of G_c's columns; as a function of x:
//
//     g~(x) = Q (Q^T W) x + (I - Q Q^T) g_mean
//
// Q is found by subspace iteration on G_c^T G_c with Rayleigh-Ritz (no LAPACK); Q^T W uses the dequantized gate.
// Each neuron's score is (g~_i - c) / s_i, with c the pre-activation at which the neuron turns active (0 for ReLU and
// dReLU's gate; for SiLU the positive root of silu(g) = threshold) and s_i the residual's RMS on the training tokens,
// so one logit threshold per layer suits every neuron. The score is linear in x; the file format's
// fc2 . relu(fc1 . x) + bias holds it exactly as fc1 = [P; -P], fc2 = [A, -A] (relu(a) - relu(-a) = a), so the
// file rank is 2r and the runtime needs nothing new. The logit threshold is set on the validation split as for the
// trained MLP (SetThresholdForRecall).
#pragma once

#include <cstdint>
#include <vector>

#include "profiler/predictor_train.h"
#include "runtime/core/kernels.h"
#include "runtime/core/status.h"
#include "runtime/core/thread_pool.h"
#include "runtime/engine/predictor.h"

namespace nflash::profiler {

struct LowRankOptions {
  std::vector<int64_t> ranks = {16, 32, 64};  // subspace ranks r (the file rank is 2r), tried in increasing order
  int iterations = 6;                          // subspace iterations (each: two GEMMs over the training tokens)
  int64_t oversample = 8;                      // extra directions iterated beyond the largest rank
  float target_recall = 0.98f;
  float max_predicted_ratio = 1.5f;
  uint64_t seed = 1;
};

// The top-k principal directions of the columns of `g` (n x m, row-major, centred by the caller): k orthonormal
// rows of m floats (k x m, row-major), in decreasing order of variance, and their variances (eigenvalues of
// g^T g / n) in `variances`. k <= min(n, m). Subspace iteration from a seeded random start.
std::vector<float> PrincipalDirections(const float* g, int64_t n, int64_t m, int64_t k, int iterations,
                                       int64_t oversample, uint64_t seed, std::vector<double>* variances,
                                       ThreadPool* pool);

// Eigen-decomposition of a symmetric k x k matrix (row-major, double) by cyclic Jacobi rotations: eigenvalues in
// decreasing order and the matching eigenvectors as the rows of `vectors` (k x k).
void SymmetricEigen(std::vector<double> a, int64_t k, std::vector<double>* values, std::vector<double>* vectors);

// The pre-activation at which a neuron turns active for the model's activation and the layer's threshold on
// |act(gate)|: 0 for ReLU/dReLU, the positive root of silu(g) = threshold for SiLU.
float ActivationBoundary(FfnActivation activation, float threshold);

// Fits one layer for each candidate rank (increasing) and returns the first that reaches the recall target on the
// validation tokens with predicted <= max_predicted_ratio x true; else the one predicting least, with *fallback set.
// `gate` is the layer's gate weight (n_ff x dim, any kernel type); x: n_train + n_val tokens of dim floats; mask:
// their active masks (n_ff bytes per token).
Result<PredictorLayerData> FitLowRankLayer(const MatrixView& gate, const float* x, const uint8_t* mask, int64_t n_train,
                                           int64_t n_val, float boundary, const LowRankOptions& options,
                                           ThreadPool* pool, bool* fallback);

}  // namespace nflash::profiler
