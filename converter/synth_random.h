// Counter-based random weights for synthetic models: every value is a pure function of (seed, tensor name, row,
// column), so tensors are regenerated on demand, in any order and thread count, with the same bytes. Also the
// low-rank gate construction (--gate-rank, docs/synthetic.md "Predictable gates"). Header-only; thread-safe (pure).
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace nflash::converter::synth_random {

// splitmix64's finalizer: a bijective 64-bit mix, good enough to turn counters into independent-looking bits.
inline uint64_t Mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// An approximately standard normal value from 64 random bits: the sum of four 16-bit uniforms (Irwin-Hall, n = 4,
// variance 1/3) standardised. Bounded at +-3.46, which suits block quantization; cheap and branch-free.
inline float NormalFromBits(uint64_t h) {
  const uint32_t s = static_cast<uint32_t>(h & 0xffff) + static_cast<uint32_t>((h >> 16) & 0xffff) +
                     static_cast<uint32_t>((h >> 32) & 0xffff) + static_cast<uint32_t>(h >> 48);
  constexpr float kScale = 1.7320508f / 65536.0f;  // sqrt(3) / 2^16: unit variance
  return (static_cast<float>(s) + 2.0f - 2.0f * 65536.0f) * kScale;
}

inline uint64_t NameKey(uint64_t seed, const std::string& name) {
  uint64_t h = 0xcbf29ce484222325ULL;  // FNV-1a
  for (unsigned char ch : name) h = (h ^ ch) * 0x100000001b3ULL;
  return Mix64(h ^ Mix64(seed));
}

// Fills `out` with the row `row` of the stream `key`: value j depends only on (key, row, j).
inline void NormalRow(uint64_t key, uint64_t row, float scale, float* out, int64_t n) {
  const uint64_t row_key = Mix64(key ^ (row * 0xd1b54a32d192ed03ULL));
  for (int64_t j = 0; j < n; ++j) out[j] = scale * NormalFromBits(Mix64(row_key + static_cast<uint64_t>(j)));
}

// The shared factor V of a low-rank weight W = U V + noise: `groups` (MoE experts; 1 for dense) matrices of
// rank x n standard normal values, V[g][r][j] a function of (key of `name` + "#V", g * rank + r, j) only.
inline std::vector<float> LowRankBasis(uint64_t seed, const std::string& name, int64_t groups, int64_t rank,
                                       int64_t n) {
  std::vector<float> v(static_cast<size_t>(groups * rank * n));
  const uint64_t key = NameKey(seed, name + "#V");
  for (int64_t r = 0; r < groups * rank; ++r) NormalRow(key, static_cast<uint64_t>(r), 1.0f, v.data() + r * n, n);
  return v;
}

// Row `row` of a low-rank-plus-noise weight, scaled so each value's variance is scale^2 as for NormalRow:
//   out_j = scale * (sum_r U_row,r V_r,j / sqrt(rank) + noise * N_row,j) / sqrt(1 + noise^2)
// U_row,r ~ N(0,1) is a function of (key of `name` + "#U", row, r); N_row,j is exactly NormalRow(key, row) (the
// full-rank weight the flag replaces). `basis` is this row's group of LowRankBasis (rank x n). Cost rank x n.
inline void LowRankRow(uint64_t seed, const std::string& name, uint64_t key, uint64_t row, const float* basis,
                       int64_t rank, float noise, float scale, float* out, int64_t n) {
  std::vector<float> u(static_cast<size_t>(rank));
  NormalRow(NameKey(seed, name + "#U"), row, 1.0f, u.data(), rank);
  NormalRow(key, row, noise, out, n);
  for (int64_t r = 0; r < rank; ++r) {
    const float ur = u[r] / std::sqrt(static_cast<float>(rank));
    const float* vr = basis + r * n;
    for (int64_t j = 0; j < n; ++j) out[j] += ur * vr[j];
  }
  const float norm = scale / std::sqrt(1.0f + noise * noise);
  for (int64_t j = 0; j < n; ++j) out[j] *= norm;
}

}  // namespace nflash::converter::synth_random
