// Memory budget: size parsing (units, fractions, rejects), KV cache arithmetic, the refusal message and the default
// hot/cold split, with expected values computed by hand.
#include <gtest/gtest.h>

#include <string>

#include "runtime/engine/context.h"
#include "runtime/sparse/memory_budget.h"

namespace nflash::sparse {
namespace {

TEST(MemoryBudgetTest, ParsesSizes) {
  struct Case {
    const char* text;
    uint64_t bytes;
  };
  const Case cases[] = {
      {"1.5G", 1610612736ull},  {"1.5g", 1610612736ull}, {"1.5GiB", 1610612736ull}, {"512M", 536870912ull},
      {"512MiB", 536870912ull}, {"4k", 4096},            {"4KiB", 4096},            {"800MB", 800000000ull},
      {"2GB", 2000000000ull},   {"1000", 1000},          {"1000B", 1000},           {" 3G ", 3221225472ull},
      {"0", 0},                 {".5K", 512},            {"1.", 1},                 {"1T", 1099511627776ull},
      {"0.001K", 1},  // 1.024 bytes, rounded down
      {"18446744073709551615", UINT64_MAX},
      {"3kb", 3000},            {"3KB", 3000},           {"2tb", 2000000000000ull}, {"2TiB", 2199023255552ull},
      // Fraction digits past the ninth are read and ignored (far below a byte at TiB); 45 of them: 10^45 does not fit
      // in 128 bits either.
      {"1.000000000000000000000000000000000000000000009G", 1073741824ull},
      {"1.500000000000000000000000000000000000000000000G", 1610612736ull},
  };
  for (const Case& c : cases) {
    auto r = ParseMemorySize(c.text);
    ASSERT_TRUE(r.ok()) << c.text << ": " << r.status().ToString();
    EXPECT_EQ(*r, c.bytes) << c.text;
  }
}

TEST(MemoryBudgetTest, RejectsBadSizes) {
  for (const char* text : {"", "G", "-1G", "1.5X", "1.5 Gigs", "abc", "1e9", "18446744073709551616", "16777216T",
                           "1..5G", "1,5G",
                           // 2^128 + 5: a sum checked only at the end would wrap to 5 bytes
                           "340282366920938463463374607431768211461"}) {
    auto r = ParseMemorySize(text);
    ASSERT_FALSE(r.ok()) << "'" << text << "' parsed as " << *r;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(std::string("'") + text + "'"), std::string::npos) << r.status().message();
  }
}

TEST(MemoryBudgetTest, FormatsBytes) {
  EXPECT_EQ(FormatBytes(0), "0 B");
  EXPECT_EQ(FormatBytes(1023), "1023 B");
  EXPECT_EQ(FormatBytes(1536), "1.50 KiB");
  EXPECT_EQ(FormatBytes(1610612736ull), "1.50 GiB");
  EXPECT_EQ(FormatBytes(1024), "1.00 KiB");
  EXPECT_EQ(FormatBytes(3ull << 50), "3.00 PiB");
  EXPECT_EQ(FormatBytes(3ull << 60), "3.00 EiB");
}

TEST(MemoryBudgetTest, KvCacheBytes) {
  // stories260K: 5 layers, kv_dim 32 (4 kv heads x 8), n_ctx 512: 5 * 512 * 32 * 2 * 4.
  EXPECT_EQ(KvCacheBytes(5, 512, 32, 4), 655360u);
  // llama-7b: 32 layers x 2048 x 4096 x 2 x 4 = 2 GiB; half of it as F16.
  EXPECT_EQ(KvCacheBytes(32, 2048, 4096, KvElementBytes(KvType::kF32)), 2ull << 30);
  EXPECT_EQ(KvCacheBytes(32, 2048, 4096, KvElementBytes(KvType::kF16)), 1ull << 30);
}

TEST(MemoryBudgetTest, RefusesWithTheMinimum) {
  FixedMemory f;
  f.resident_weights = 1ull << 30;  // 1 GiB
  f.kv_cache = 256ull << 20;        // 256 MiB
  f.scratch = 256ull << 20;
  EXPECT_EQ(f.Total(), 1610612736ull);
  EXPECT_TRUE(CheckFixedFits(1610612736ull, f).ok());
  Status s = CheckFixedFits(1ull << 30, f);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "memory budget 1.00 GiB is below the fixed part 1.50 GiB (resident weights 1.00 GiB, KV cache 256.00 MiB, "
            "scratch 256.00 MiB); the minimum is 1.50 GiB (1610612736 bytes)");
  f.predictor = 1ull << 20;
  s = CheckFixedFits(1ull << 30, f);
  EXPECT_NE(s.message().find("predictor 1.00 MiB"), std::string::npos) << s.message();
  // The lookahead table is part of the fixed part: the budget that held everything else no longer does.
  f.lookahead = 2ull << 20;
  EXPECT_EQ(f.Total(), 1610612736ull + (3ull << 20));
  EXPECT_FALSE(CheckFixedFits(1610612736ull + (1ull << 20), f).ok());
  s = CheckFixedFits(1ull << 30, f);
  EXPECT_NE(s.message().find("predictor 1.00 MiB, lookahead table 2.00 MiB); the minimum is 1.50 GiB (1613758464 bytes)"),
            std::string::npos)
      << s.message();
  // So are the parsed metadata and the tokenizer.
  f.vocabulary = 4ull << 20;
  EXPECT_EQ(f.Total(), 1610612736ull + (7ull << 20));
  s = CheckFixedFits(1ull << 30, f);
  EXPECT_NE(s.message().find("lookahead table 2.00 MiB, metadata and tokenizer 4.00 MiB); the minimum is 1.51 GiB "
                             "(1617952768 bytes)"),
            std::string::npos)
      << s.message();
}

TEST(MemoryBudgetTest, DefaultSplitHotFirstThenCold) {
  FixedMemory f;
  f.resident_weights = 1000;
  CacheShape shape;
  shape.n_groups = 4;
  shape.hot_slot_bytes = 32768;  // 8 neurons x 4 KiB
  shape.hot_clusters = 10;
  shape.cold_slot_bytes = 4096;
  shape.cold_neurons = 100;
  // 200 KiB for the caches: hot gets up to 100 KiB = 3 clusters (96 KiB), cold the remaining 104 KiB = 26 slots.
  auto split = SplitBudget(1000 + 200 * 1024, f, shape);
  ASSERT_TRUE(split.ok()) << split.status().ToString();
  EXPECT_EQ(split->hot_slots, 3);
  EXPECT_EQ(split->cold_slots, 26);
  EXPECT_EQ(split->hot_bytes, 3u * 32768);
  EXPECT_EQ(split->cold_bytes, 26u * 4096);
  EXPECT_EQ(split->unused_bytes, 0u);
  // Huge budget: both regions capped at the whole FFN; the rest unused.
  split = SplitBudget(1000 + (100ull << 20), f, shape);
  ASSERT_TRUE(split.ok());
  EXPECT_EQ(split->hot_slots, 10);
  EXPECT_EQ(split->cold_slots, 100);
  EXPECT_EQ(split->unused_bytes, (100ull << 20) - 10 * 32768 - 100 * 4096);
  // Cold region full before the hot fraction is reached: the rest flows back to hot.
  shape.cold_neurons = 5;
  split = SplitBudget(1000 + 200 * 1024, f, shape);
  ASSERT_TRUE(split.ok());
  EXPECT_EQ(split->cold_slots, 5);
  EXPECT_EQ(split->hot_slots, 5);  // 3 first, then (200 KiB - 96 KiB - 20 KiB) / 32 KiB = 2 more
  // hot_fraction 0: everything cold.
  shape.cold_neurons = 1000;
  split = SplitBudget(1000 + 200 * 1024, f, shape, 0.0);
  ASSERT_TRUE(split.ok());
  EXPECT_EQ(split->hot_slots, 0);
  EXPECT_EQ(split->cold_slots, 50);
  // Exactly the fixed part: empty caches (every miss reads into scratch), not an error.
  split = SplitBudget(1000, f, shape);
  ASSERT_TRUE(split.ok());
  EXPECT_EQ(split->hot_slots + split->cold_slots, 0);
  // Below the fixed part: the refusal.
  split = SplitBudget(999, f, shape);
  ASSERT_FALSE(split.ok());
  EXPECT_NE(split.status().message().find("the minimum is 1000 B"), std::string::npos) << split.status().message();
  split = SplitBudget(2000, f, shape, 1.5);
  ASSERT_FALSE(split.ok());
  EXPECT_NE(split.status().message().find("hot fraction 1.5"), std::string::npos) << split.status().message();
  EXPECT_NE(split.status().message().find("outside [0, 1]"), std::string::npos) << split.status().message();
  // A shape with negative unit counts or a zero slot size for units it has is refused.
  for (const auto& edit : {+[](CacheShape* c) { c->hot_clusters = -1; }, +[](CacheShape* c) { c->cold_neurons = -1; },
                           +[](CacheShape* c) { c->cold_slot_bytes = 0; }, +[](CacheShape* c) { c->hot_slot_bytes = 0; }}) {
    CacheShape bad = shape;
    edit(&bad);
    split = SplitBudget(1000 + 200 * 1024, f, bad);
    ASSERT_FALSE(split.ok());
    EXPECT_NE(split.status().message().find("slot sizes must be > 0 and unit counts >= 0"), std::string::npos)
        << split.status().message();
  }
}

TEST(MemoryBudgetTest, AccountingTableListsEveryPart) {
  FixedMemory f;
  f.resident_weights = 1 << 20;
  f.kv_cache = 2 << 20;
  CacheSplit split;
  split.hot_bytes = 4096;
  split.cold_bytes = 8192;
  const std::string t = DescribeAccounting(4 << 20, f, split);
  for (const char* needle : {"resident weights", "KV cache", "scratch", "predictor", "hot region", "cold region",
                             "total", "budget", "3158016 B", "4194304 B"}) {
    EXPECT_NE(t.find(needle), std::string::npos) << needle << " missing from\n" << t;
  }
}

}  // namespace
}  // namespace nflash::sparse
