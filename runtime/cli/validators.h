// Number checks for CLI11 options with messages that name the bound. CLI11's PositiveNumber and NonNegativeNumber
// refuse 0 with "Value 0 not in range 0.000000 to 1.797693e+308", which shows neither the bound's strictness nor a
// readable upper end; these say "must be > 0 (got 0)" and "must be >= 0 (got -1)".
#pragma once

#include <CLI/CLI.hpp>

#include <string>

namespace nflash::cli {

namespace detail {
// Accepts numbers above 0 (strict) or from 0 on.
inline CLI::Validator NumberFromZero(bool strict) {
  const std::string bound = strict ? "> 0" : ">= 0";
  return CLI::Validator(
      [strict, bound](std::string& input) -> std::string {
        double v = 0;
        if (!CLI::detail::lexical_cast(input, v)) return "must be a number " + bound + " (got '" + input + "')";
        return (strict ? v > 0 : v >= 0) ? std::string() : "must be " + bound + " (got " + input + ")";
      },
      strict ? "POSITIVE" : "NONNEGATIVE");
}
}  // namespace detail

// For counts and sizes that must be at least 1 (above 0), and those that may be 0.
inline const CLI::Validator kPositive = detail::NumberFromZero(/*strict=*/true);
inline const CLI::Validator kNonNegative = detail::NumberFromZero(/*strict=*/false);

}  // namespace nflash::cli
