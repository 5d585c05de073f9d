// Rounding of sizes and offsets to a multiple (alignment, blocks, kernel grains).
#pragma once

#include <concepts>

namespace nflash {

// The smallest multiple of `a` that is >= x (a > 0; x + a - 1 must not overflow T).
template <std::integral T>
constexpr T RoundUp(T x, T a) {
  return (x + a - 1) / a * a;
}

}  // namespace nflash
