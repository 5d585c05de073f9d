// Memory budget: size parsing, fixed-part accounting, the refusal message and the default cache split.
#include "runtime/sparse/memory_budget.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <string>

namespace nflash::sparse {

namespace {

Status BadSize(std::string_view text, std::string_view why) {
  return Status::InvalidArgument("memory size '" + std::string(text) + "': " + std::string(why) +
                                 " (expected a size like 1.5G, 512M, 2GiB, 800MB or a number of bytes)");
}

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

}  // namespace

Result<uint64_t> ParseMemorySize(std::string_view text) {
  std::string_view s = text;
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  size_t i = 0;
  unsigned __int128 whole = 0;
  size_t int_digits = 0;
  while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) {
    whole = whole * 10 + static_cast<unsigned>(s[i] - '0');
    if (whole > UINT64_MAX) return BadSize(text, "larger than 2^64 - 1 bytes");
    ++i, ++int_digits;
  }
  // The fraction is kept as an integer over 10^digits so that "1.5G" is exact; 9 digits are far below a byte at TiB.
  constexpr size_t kMaxFractionDigits = 9;
  unsigned __int128 frac = 0, frac_scale = 1;
  size_t frac_digits = 0;
  if (i < s.size() && s[i] == '.') {
    ++i;
    while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) {
      if (frac_digits < kMaxFractionDigits) {
        frac = frac * 10 + static_cast<unsigned>(s[i] - '0');
        frac_scale *= 10;
      }
      ++i, ++frac_digits;
    }
  }
  if (int_digits == 0 && frac_digits == 0) {
    return BadSize(text, s.empty() ? "empty" : (s[0] == '-' ? "negative" : "no number"));
  }
  const std::string unit = Lower(s.substr(i));
  uint64_t mult = 0;
  if (unit.empty() || unit == "b") mult = 1;
  else if (unit == "k" || unit == "kib") mult = 1ull << 10;
  else if (unit == "m" || unit == "mib") mult = 1ull << 20;
  else if (unit == "g" || unit == "gib") mult = 1ull << 30;
  else if (unit == "t" || unit == "tib") mult = 1ull << 40;
  else if (unit == "kb") mult = 1000ull;
  else if (unit == "mb") mult = 1000ull * 1000;
  else if (unit == "gb") mult = 1000ull * 1000 * 1000;
  else if (unit == "tb") mult = 1000ull * 1000 * 1000 * 1000;
  else return BadSize(text, "unknown unit '" + std::string(s.substr(i)) + "'");
  const unsigned __int128 total = whole * mult + frac * mult / frac_scale;
  if (total > UINT64_MAX) return BadSize(text, "larger than 2^64 - 1 bytes");
  return static_cast<uint64_t>(total);
}

std::string FormatBytes(uint64_t bytes) {
  static const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (bytes < 1024) return std::to_string(bytes) + " B";
  double v = static_cast<double>(bytes) / 1024.0;
  int u = 0;
  while (v >= 1024.0 && u < 5) v /= 1024.0, ++u;
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f %s", v, kUnits[u]);
  return buf;
}

uint64_t KvCacheBytes(int64_t n_layers, int64_t n_ctx, int64_t kv_dim, uint64_t element_bytes) {
  constexpr uint64_t kKAndV = 2;
  return static_cast<uint64_t>(n_layers) * static_cast<uint64_t>(n_ctx) * static_cast<uint64_t>(kv_dim) * kKAndV *
         element_bytes;
}

std::string FixedMemory::Describe() const {
  std::string s = "resident weights " + FormatBytes(resident_weights) + ", KV cache " + FormatBytes(kv_cache) +
                  ", scratch " + FormatBytes(scratch);
  if (predictor > 0) s += ", predictor " + FormatBytes(predictor);
  if (lookahead > 0) s += ", lookahead table " + FormatBytes(lookahead);
  if (vocabulary > 0) s += ", metadata and tokenizer " + FormatBytes(vocabulary);
  return s;
}

Status CheckFixedFits(uint64_t budget, const FixedMemory& fixed) {
  const uint64_t need = fixed.Total();
  if (budget >= need) return Status::Ok();
  return Status::InvalidArgument("memory budget " + FormatBytes(budget) + " is below the fixed part " +
                                 FormatBytes(need) + " (" + fixed.Describe() + "); the minimum is " + FormatBytes(need) +
                                 " (" + std::to_string(need) + " bytes)");
}

Result<CacheSplit> SplitBudget(uint64_t budget, const FixedMemory& fixed, const CacheShape& shape, double hot_fraction) {
  NF_RETURN_IF_ERROR(CheckFixedFits(budget, fixed));
  if (!(hot_fraction >= 0.0 && hot_fraction <= 1.0)) {
    return Status::InvalidArgument("hot fraction " + std::to_string(hot_fraction) + " is outside [0, 1]");
  }
  if ((shape.hot_clusters > 0 && shape.hot_slot_bytes == 0) || (shape.cold_neurons > 0 && shape.cold_slot_bytes == 0) ||
      shape.hot_clusters < 0 || shape.cold_neurons < 0) {
    return Status::InvalidArgument("cache shape: slot sizes must be > 0 and unit counts >= 0");
  }
  const uint64_t avail = budget - fixed.Total();
  CacheSplit split;
  auto slots_for = [](uint64_t bytes, uint64_t slot_bytes, int64_t cap) -> int64_t {
    if (slot_bytes == 0) return 0;
    return static_cast<int64_t>(std::min<uint64_t>(bytes / slot_bytes, static_cast<uint64_t>(cap)));
  };
  split.hot_slots = slots_for(static_cast<uint64_t>(static_cast<long double>(avail) * hot_fraction),
                              shape.hot_slot_bytes, shape.hot_clusters);
  split.hot_bytes = static_cast<uint64_t>(split.hot_slots) * shape.hot_slot_bytes;
  split.cold_slots = slots_for(avail - split.hot_bytes, shape.cold_slot_bytes, shape.cold_neurons);
  split.cold_bytes = static_cast<uint64_t>(split.cold_slots) * shape.cold_slot_bytes;
  // The cold region is full (the whole cold FFN is cached): give what is left back to the hot region.
  const int64_t more_hot = slots_for(avail - split.hot_bytes - split.cold_bytes, shape.hot_slot_bytes,
                                     shape.hot_clusters - split.hot_slots);
  split.hot_slots += more_hot;
  split.hot_bytes += static_cast<uint64_t>(more_hot) * shape.hot_slot_bytes;
  split.unused_bytes = avail - split.hot_bytes - split.cold_bytes;
  return split;
}

std::string DescribeAccounting(uint64_t budget, const FixedMemory& fixed, const CacheSplit& split) {
  auto row = [](const char* name, uint64_t bytes) {
    char buf[96];
    std::snprintf(buf, sizeof(buf), "  %-18s %12s  %14llu B\n", name, FormatBytes(bytes).c_str(),
                  static_cast<unsigned long long>(bytes));
    return std::string(buf);
  };
  std::string s = "memory accounting:\n";
  s += row("resident weights", fixed.resident_weights);
  s += row("KV cache", fixed.kv_cache);
  s += row("scratch", fixed.scratch);
  s += row("predictor", fixed.predictor);
  if (fixed.lookahead > 0) s += row("lookahead table", fixed.lookahead);
  if (fixed.vocabulary > 0) s += row("metadata, tokenizer", fixed.vocabulary);
  s += row("hot region", split.hot_bytes);
  s += row("cold region", split.cold_bytes);
  s += row("total", fixed.Total() + split.hot_bytes + split.cold_bytes);
  s += row("budget", budget);
  return s;
}

}  // namespace nflash::sparse
