// DirectReader (O_DIRECT + io_uring): bytes equal to what was written for aligned and unaligned random requests,
// batches larger than the queue depth, coalescing, short reads, EIO retry and failure, the page-cache fallback.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <random>
#include <thread>

#include "runtime/io/direct_reader.h"
#include "tests/test_util.h"

namespace nflash::io {
namespace {

using nflash::testing::TempDir;
using nflash::testing::WriteBytes;

// 1 MiB plus an odd tail, so the last block of the file is partial (O_DIRECT reads there come back short).
constexpr size_t kFileBytes = (1 << 20) + 1234;

std::vector<uint8_t> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

class DirectReaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    bytes_ = RandomBytes(kFileBytes, 42);
    path_ = dir_.File("data.bin");
    WriteBytes(path_, bytes_);
  }
  std::unique_ptr<DirectReader> Open(DirectReaderOptions options = {}) {
    auto r = DirectReader::Open(path_, options);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? std::move(r).value() : nullptr;
  }
  // Queue depth 4; every read covering byte `bad_offset` fails with EIO (the reader's own retry fails too).
  std::unique_ptr<DirectReader> OpenFailingAt(uint64_t bad_offset) {
    DirectReaderOptions opt;
    opt.queue_depth = 4;
    opt.completion_hook = [bad_offset](uint64_t offset, size_t size, int res) {
      return (offset <= bad_offset && bad_offset < offset + size) ? -EIO : res;
    };
    return Open(opt);
  }
  // One 4 KiB request per page of the first n pages, into consecutive pages of `out`.
  static std::vector<ReadRequest> PageRequests(std::vector<uint8_t>& out, int n) {
    std::vector<ReadRequest> reqs;
    for (int i = 0; i < n; ++i) reqs.push_back({static_cast<uint64_t>(i) * 4096, 4096, out.data() + i * 4096});
    return reqs;
  }
  TempDir dir_;
  std::string path_;
  std::vector<uint8_t> bytes_;
};

TEST_F(DirectReaderTest, RandomAlignedAndUnalignedReadsMatchTheFile) {
  DirectReaderOptions opt;
  opt.queue_depth = 8;
  auto reader = Open(opt);
  ASSERT_NE(reader, nullptr);
  const size_t a = reader->alignment();
  ASSERT_GE(a, 1u);
  constexpr size_t kSlot = 64 << 10;
  constexpr int kRequests = 200;
  auto arena = reader->CreateArena(kSlot, kRequests);
  ASSERT_TRUE(arena.ok()) << arena.status().ToString();

  std::mt19937 rng(7);
  std::vector<ReadRequest> reqs;
  std::vector<std::vector<uint8_t>> unaligned_dst(kRequests);
  for (int i = 0; i < kRequests; ++i) {
    ReadRequest r;
    if (i % 2 == 0) {  // aligned: offset and size multiples of 4096, destination an arena slot
      const size_t blocks = 1 + rng() % (kSlot / 4096);
      r.size = blocks * 4096;
      r.offset = (rng() % ((kFileBytes - r.size) / 4096)) * 4096;
      r.dst = (*arena)->Slot(i);
    } else {  // unaligned everything: odd offset, odd size, odd destination
      r.size = 1 + rng() % 20000;
      r.offset = rng() % (kFileBytes - r.size);
      unaligned_dst[i].resize(r.size + 3);
      r.dst = unaligned_dst[i].data() + 3;
    }
    reqs.push_back(r);
  }
  ASSERT_TRUE(reader->ReadBatch(reqs).ok());
  for (int i = 0; i < kRequests; ++i) {
    ASSERT_EQ(std::memcmp(reqs[i].dst, bytes_.data() + reqs[i].offset, reqs[i].size), 0) << "request " << i;
  }
  const IoCounters c = reader->Counters();
  EXPECT_EQ(c.requests, static_cast<uint64_t>(kRequests));
  EXPECT_LT(c.submit_calls, static_cast<uint64_t>(kRequests));  // batched: several reads per submit
  if (reader->direct_io()) {
    EXPECT_EQ(c.bounce_reads, static_cast<uint64_t>(kRequests / 2));
  }
  EXPECT_FALSE(reader->LatencySampleNs().empty());

  // The synchronous path returns the same bytes.
  for (int i = 0; i < 20; ++i) {
    std::vector<uint8_t> out(reqs[i].size);
    ASSERT_TRUE(reader->PreadAt(reqs[i].offset, reqs[i].size, out.data()).ok());
    ASSERT_EQ(std::memcmp(out.data(), bytes_.data() + reqs[i].offset, out.size()), 0);
  }
  EXPECT_EQ(reader->Counters().pread_requests, 20u);
}

TEST_F(DirectReaderTest, BatchLargerThanQueueDepth) {
  DirectReaderOptions opt;
  opt.queue_depth = 2;
  auto reader = Open(opt);
  ASSERT_NE(reader, nullptr);
  std::vector<uint8_t> out(100 * 1000);
  std::vector<ReadRequest> reqs;
  for (int i = 0; i < 100; ++i) reqs.push_back({static_cast<uint64_t>(i) * 7001, 1000, out.data() + i * 1000});
  ASSERT_TRUE(reader->ReadBatch(reqs).ok());
  for (int i = 0; i < 100; ++i) {
    ASSERT_EQ(std::memcmp(out.data() + i * 1000, bytes_.data() + i * 7001, 1000), 0) << i;
  }
  EXPECT_GE(reader->Counters().submit_calls, 50u);  // at most 2 in flight per submit
}

TEST_F(DirectReaderTest, TailOfFileAndPastTheEnd) {
  auto reader = Open();
  ASSERT_NE(reader, nullptr);
  EXPECT_EQ(reader->Size(), kFileBytes);
  std::vector<uint8_t> out(5000);
  ASSERT_TRUE(reader->ReadAt(kFileBytes - 5000, 5000, out.data()).ok());
  EXPECT_EQ(std::memcmp(out.data(), bytes_.data() + kFileBytes - 5000, 5000), 0);
  ASSERT_TRUE(reader->PreadAt(kFileBytes - 5000, 5000, out.data()).ok());
  EXPECT_EQ(std::memcmp(out.data(), bytes_.data() + kFileBytes - 5000, 5000), 0);
  const Status s = reader->ReadAt(kFileBytes - 10, 20, out.data());
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("past the end"), std::string::npos) << s.message();
}

TEST_F(DirectReaderTest, ConcurrentCallersAreSerialized) {
  auto reader = Open();
  ASSERT_NE(reader, nullptr);
  std::vector<std::thread> threads;
  std::vector<int> mismatches(3, 0);
  for (int t = 0; t < 3; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(100 + t);
      std::vector<uint8_t> out(3000);
      for (int i = 0; i < 50; ++i) {
        const uint64_t off = rng() % (kFileBytes - out.size());
        if (!reader->ReadAt(off, out.size(), out.data()).ok() ||
            std::memcmp(out.data(), bytes_.data() + off, out.size()) != 0) {
          ++mismatches[t];
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(mismatches, std::vector<int>(3, 0));
  EXPECT_EQ(reader->Counters().requests, 150u);
}

TEST(CoalesceRequestsTest, MergesOnlyFileAndMemoryAdjacentUpToTheLimit) {
  std::vector<uint8_t> buf(100);
  std::vector<ReadRequest> in = {
      {0, 10, buf.data()},        // merges with the next
      {10, 10, buf.data() + 10},  //
      {20, 10, buf.data() + 50},  // file-adjacent but memory is not: separate
      {30, 10, buf.data() + 60},  // merges with the previous
      {50, 10, buf.data() + 70},  // memory-adjacent but a file gap: separate
      {60, 10, buf.data() + 80},  // merges; then {70..} would reach 40 > 30: separate
      {70, 10, buf.data() + 90},
  };
  const auto out = CoalesceRequests(in, 20);
  ASSERT_EQ(out.size(), 4u);
  EXPECT_EQ(out[0].offset, 0u);
  EXPECT_EQ(out[0].size, 20u);
  EXPECT_EQ(out[1].offset, 20u);
  EXPECT_EQ(out[1].size, 20u);
  EXPECT_EQ(out[2].offset, 50u);
  EXPECT_EQ(out[2].size, 20u);
  EXPECT_EQ(out[3].offset, 70u);
  EXPECT_EQ(out[3].size, 10u);
  EXPECT_EQ(CoalesceRequests(in, 1000).size(), 3u);
}

TEST_F(DirectReaderTest, CoalescedReadDeliversTheSameBytes) {
  auto reader = Open();
  ASSERT_NE(reader, nullptr);
  std::vector<uint8_t> out(16 * 4096);
  std::vector<ReadRequest> in;
  for (int i = 0; i < 16; ++i) in.push_back({40960 + static_cast<uint64_t>(i) * 4096, 4096, out.data() + i * 4096});
  const auto merged = CoalesceRequests(in, 32 * 1024);
  EXPECT_EQ(merged.size(), 2u);
  ASSERT_TRUE(reader->ReadBatch(merged).ok());
  EXPECT_EQ(std::memcmp(out.data(), bytes_.data() + 40960, out.size()), 0);
}

TEST(RequestBuilderTest, MergesFlashNeighboursAsPiecesOrPlainReads) {
  std::vector<uint8_t> buf(200);
  uint8_t* b = buf.data();
  for (bool scatter : {true, false}) {
    SCOPED_TRACE(scatter ? "scatter" : "no scatter");
    RequestBuilder rb;
    rb.Reset(40, scatter);
    EXPECT_EQ(rb.Add(0, 10, b), 0u);
    EXPECT_EQ(rb.Add(10, 10, b + 10), 0u);                // file and memory adjacent: the same piece grows
    EXPECT_EQ(rb.Add(20, 10, b + 50), scatter ? 0u : 1u);  // file adjacent only: a second piece, or a new read
    EXPECT_EQ(rb.Add(30, 10, b + 60), scatter ? 0u : 1u);  // follows that piece in memory
    EXPECT_EQ(rb.Add(40, 10, b + 70), 1u);  // scatter: 50 > 40 bytes, a new read; else the second read's third range
    EXPECT_EQ(rb.Add(60, 10, b + 80), 2u);  // a file gap: a new read
    EXPECT_EQ(rb.Add(70, 10, b + 90, false), 3u);  // not mergeable: its own read (though adjacent everywhere)
    EXPECT_EQ(rb.Add(80, 10, b + 100), 4u);        // nor is the one after it merged into it
    const std::vector<ReadRequest>& r = rb.Finish();
    ASSERT_EQ(r.size(), 5u);
    if (scatter) {
      EXPECT_EQ(r[0].offset, 0u);
      EXPECT_EQ(r[0].size, 40u);
      ASSERT_EQ(r[0].n_pieces, 2u);
      EXPECT_EQ(r[0].pieces[0].dst, b);
      EXPECT_EQ(r[0].pieces[0].size, 20u);
      EXPECT_EQ(r[0].pieces[1].dst, b + 50);
      EXPECT_EQ(r[0].pieces[1].size, 20u);
    } else {
      EXPECT_EQ(r[0].size, 20u);
      EXPECT_EQ(r[1].offset, 20u);
      EXPECT_EQ(r[1].size, 30u);
      EXPECT_EQ(r[1].dst, b + 50);
    }
    // Every read of one piece comes out plain.
    for (size_t i = scatter ? 1 : 0; i < r.size(); ++i) {
      EXPECT_EQ(r[i].n_pieces, 0u) << i;
      EXPECT_EQ(r[i].pieces, nullptr) << i;
      EXPECT_NE(r[i].dst, nullptr) << i;
    }
    EXPECT_EQ(r.back().offset, 80u);
    EXPECT_EQ(r.back().dst, b + 100);
  }
}

// Ranges a short gap apart (the unread tail of a flash group) merge into one scattered read whose gap piece goes to
// the sink; longer gaps, a range beyond max_bytes and builders without a sink start new reads.
TEST(RequestBuilderTest, MergesAcrossGapsIntoTheSink) {
  std::vector<uint8_t> buf(300), sink(8);
  uint8_t* b = buf.data();
  RequestBuilder rb;
  rb.Reset(100, true, sink.data(), 8);
  EXPECT_EQ(rb.Add(0, 20, b + 100), 0u);
  EXPECT_EQ(rb.Add(28, 20, b), 0u);        // 8 bytes after: gap piece + piece
  EXPECT_EQ(rb.Add(48, 20, b + 20), 0u);   // adjacent in file and memory: the last piece grows
  EXPECT_EQ(rb.Add(77, 20, b + 200), 1u);  // 9 bytes after: too far
  EXPECT_EQ(rb.Add(100, 20, b + 50), 1u);  // 3 after
  EXPECT_EQ(rb.Add(125, 30, b + 250), 1u); // 5 after, 20 + 3 + 20 + 5 + 30 = 78 <= 100
  EXPECT_EQ(rb.Add(160, 30, b + 150), 2u); // 83 + 5 + 30 > 100: a new read
  const std::vector<ReadRequest>& r = rb.Finish();
  ASSERT_EQ(r.size(), 3u);
  EXPECT_EQ(r[0].offset, 0u);
  EXPECT_EQ(r[0].size, 68u);
  ASSERT_EQ(r[0].n_pieces, 3u);
  EXPECT_EQ(r[0].pieces[0].dst, b + 100);
  EXPECT_EQ(r[0].pieces[1].dst, sink.data());
  EXPECT_EQ(r[0].pieces[1].size, 8u);
  EXPECT_EQ(r[0].pieces[2].dst, b);
  EXPECT_EQ(r[0].pieces[2].size, 40u);
  EXPECT_EQ(r[1].offset, 77u);
  EXPECT_EQ(r[1].size, 78u);
  ASSERT_EQ(r[1].n_pieces, 5u);
  EXPECT_EQ(r[1].pieces[1].dst, sink.data());
  EXPECT_EQ(r[1].pieces[1].size, 3u);
  EXPECT_EQ(r[1].pieces[3].size, 5u);
  EXPECT_EQ(r[2].n_pieces, 0u);
  // Without scatter, a sink is ignored: gaps never merge.
  rb.Reset(100, false, sink.data(), 8);
  EXPECT_EQ(rb.Add(0, 20, b), 0u);
  EXPECT_EQ(rb.Add(28, 20, b + 20), 1u);
}

// Through the reader: 7168-byte bundles 8192 apart (512-byte aligned, as on a disk with 512-byte blocks), merged
// across their 1024-byte tails, land in their slots with the file's bytes.
TEST_F(DirectReaderTest, GapMergedReadsLandInTheirSlots) {
  auto reader = Open();
  ASSERT_NE(reader, nullptr);
  auto arena = reader->CreateArena(7168, 8);
  ASSERT_TRUE(arena.ok()) << arena.status().ToString();
  std::vector<uint8_t> tail(4096 + 4096);
  uint8_t* sink_buf = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(tail.data()) + 4095) & ~uintptr_t{4095});
  RequestBuilder rb;
  rb.Reset(size_t{256} << 10, true, sink_buf, 1024);
  const int order[] = {5, 0, 7, 2, 1, 6, 3, 4};  // slots: never adjacent in file order
  for (int i = 0; i < 8; ++i) rb.Add(16384 + static_cast<uint64_t>(i) * 8192, 7168, (*arena)->Slot(order[i]));
  const std::vector<ReadRequest>& reqs = rb.Finish();
  ASSERT_EQ(reqs.size(), 1u);
  EXPECT_EQ(reqs[0].size, 8u * 8192 - 1024);
  ASSERT_TRUE(reader->ReadBatch(reqs).ok());
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(std::memcmp((*arena)->Slot(order[i]), bytes_.data() + 16384 + i * 8192, 7168), 0) << i;
  }
  // Every piece is 512-byte aligned: straight into the slots where the device allows it, else bounced.
  const bool aligned = !reader->direct_io() || reader->alignment() <= 512;
  EXPECT_EQ(reader->Counters().bounce_reads == 0, aligned) << "direct-I/O alignment " << reader->alignment();
}

// Scattered reads (one readv into pieces anywhere in memory) deliver the file's bytes in order to each piece: aligned
// pieces straight into arena slots, unaligned ones through a bounce buffer; a short read that stops inside a piece
// and an EIO are resumed and retried; through the io_uring batch, the progress stream and ReadableFile's default.
TEST_F(DirectReaderTest, ScatteredReadsLandInTheirPieces) {
  int shortened = 0, failed = 0;
  DirectReaderOptions opt;
  opt.queue_depth = 4;
  opt.completion_hook = [&](uint64_t offset, size_t size, int res) {
    if (offset == 65536 && size == 5 * 4096 && shortened == 0) {
      ++shortened;
      return 8192;  // stops 4 KiB into the second piece
    }
    if (offset == 131072 && failed == 0) {
      ++failed;
      return -EIO;
    }
    return res;
  };
  auto reader = Open(opt);
  ASSERT_NE(reader, nullptr);
  auto arena = reader->CreateArena(8192, 32);
  ASSERT_TRUE(arena.ok()) << arena.status().ToString();
  std::mt19937 rng(3);
  std::vector<int> slots(32);
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), rng);
  // Request i: pieces of 4096 or 8192 bytes in arena slots taken in shuffled order (never adjacent in order).
  std::vector<std::vector<ReadPiece>> pieces;
  std::vector<ReadRequest> reqs;
  size_t next_slot = 0;
  const std::vector<std::pair<uint64_t, std::vector<size_t>>> shapes = {
      {65536, {4096, 8192, 8192}},  // 20 KiB: the short read stops 4 KiB into the second piece
      {131072, {8192, 4096}},       // EIO once
      {204800, {4096, 4096, 4096, 4096, 8192, 8192}},
      {409600, {8192}},  // one piece (allowed, though the builder would make it plain)
  };
  pieces.reserve(shapes.size() + 1);
  for (const auto& [offset, sizes] : shapes) {
    std::vector<ReadPiece> p;
    size_t total = 0;
    for (size_t sz : sizes) {
      p.push_back(ReadPiece{(*arena)->Slot(static_cast<size_t>(slots[next_slot++])), sz});
      total += sz;
    }
    pieces.push_back(std::move(p));
    reqs.push_back(ReadRequest{offset, total, nullptr, pieces.back().data(), static_cast<uint32_t>(sizes.size())});
  }
  // Unaligned pieces (odd sizes and addresses) at an odd offset: read through a bounce buffer and copied out.
  std::vector<uint8_t> odd(5000);
  pieces.push_back({ReadPiece{odd.data() + 1, 1000}, ReadPiece{odd.data() + 3001, 777}, ReadPiece{odd.data() + 2001, 3}});
  reqs.push_back(ReadRequest{300001, 1780, nullptr, pieces.back().data(), 3});
  auto check = [&](const char* how) {
    for (size_t i = 0; i < reqs.size(); ++i) {
      uint64_t offset = reqs[i].offset;
      for (uint32_t k = 0; k < reqs[i].n_pieces; ++k) {
        const ReadPiece& p = reqs[i].pieces[k];
        ASSERT_EQ(std::memcmp(p.dst, bytes_.data() + offset, p.size), 0) << how << ": request " << i << " piece " << k;
        std::memset(p.dst, 0, p.size);
        offset += p.size;
      }
    }
  };
  ASSERT_TRUE(reader->ReadBatch(reqs).ok());
  check("batch");
  EXPECT_EQ(shortened, 1);
  EXPECT_EQ(failed, 1);
  const IoCounters c = reader->Counters();
  EXPECT_EQ(c.requests, reqs.size());
  if (reader->direct_io()) {
    EXPECT_EQ(c.scattered_requests, 4u);
    EXPECT_EQ(c.bounce_reads, 1u);
    EXPECT_EQ(c.short_reads, 1u);
  }
  EXPECT_EQ(c.retries, 1u);
  std::vector<int> seen(reqs.size(), 0);
  ASSERT_TRUE(reader->ReadBatchProgress(reqs, [&](size_t i) { ++seen[i]; }).ok());
  EXPECT_EQ(seen, std::vector<int>(reqs.size(), 1));
  check("progress");
  auto plain = OpenPreadFile(path_);
  ASSERT_TRUE(plain.ok());
  ASSERT_TRUE((*plain)->ReadBatch(reqs).ok());
  check("pread default");
  // Pieces that do not add up to the request's size are refused before anything is read.
  ReadRequest bad = reqs[0];
  bad.size += 4096;
  const Status s = reader->ReadBatch(std::span<const ReadRequest>(&bad, 1));
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("pieces sum to 20480 bytes, expected 24576"), std::string::npos) << s.message();
}

TEST_F(DirectReaderTest, EioOnceIsRetriedAndSucceeds) {
  int injected = 0;
  DirectReaderOptions opt;
  opt.completion_hook = [&](uint64_t offset, size_t size, int res) {
    if (offset <= 81920 && 81920 < offset + size && injected == 0) {
      ++injected;
      return -EIO;
    }
    return res;
  };
  auto reader = Open(opt);
  ASSERT_NE(reader, nullptr);
  std::vector<uint8_t> out(8192);
  ASSERT_TRUE(reader->ReadAt(81920, 8192, out.data()).ok());
  EXPECT_EQ(std::memcmp(out.data(), bytes_.data() + 81920, 8192), 0);
  EXPECT_EQ(injected, 1);
  EXPECT_EQ(reader->Counters().retries, 1u);
}

TEST_F(DirectReaderTest, EioAlwaysFailsNamingPathOffsetAndSize) {
  auto reader = OpenFailingAt(200000);
  ASSERT_NE(reader, nullptr);
  std::vector<uint8_t> out(64 * 4096);
  const std::vector<ReadRequest> reqs = PageRequests(out, 64);
  const Status s = reader->ReadBatch(reqs);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kIOError);
  EXPECT_NE(s.message().find(path_), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("offset 196608"), std::string::npos) << s.message();  // 200000 rounded down to 4096
  EXPECT_NE(s.message().find("4096 bytes"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("after 1 retry"), std::string::npos) << s.message();
  EXPECT_EQ(reader->Counters().retries, 1u) << "retried once, not more";
  // The reader stays usable after a failed batch.
  ASSERT_TRUE(reader->ReadAt(0, 4096, out.data()).ok());
  EXPECT_EQ(std::memcmp(out.data(), bytes_.data(), 4096), 0);
}

// The I/O worker's stream: every request reported exactly once, as it lands; a failed one is not reported and does not
// stop the others (their bytes arrive), and the batch returns its error. Also through the default (one by one).
TEST_F(DirectReaderTest, ProgressReportsEachArrivalAndGoesOnAfterAFailure) {
  auto reader = OpenFailingAt(200000);
  ASSERT_NE(reader, nullptr);
  std::vector<uint8_t> out(64 * 4096);
  std::vector<ReadRequest> reqs = PageRequests(out, 64);
  reqs.push_back({0, 0, out.data()});  // empty: reported without a read
  const size_t bad = 200000 / 4096;
  std::vector<int> seen(reqs.size(), 0);
  const Status s = reader->ReadBatchProgress(reqs, [&](size_t i) {
    ASSERT_LT(i, reqs.size());
    ++seen[i];
    if (reqs[i].size > 0) {  // the bytes are there when the request is reported
      EXPECT_EQ(std::memcmp(reqs[i].dst, bytes_.data() + reqs[i].offset, reqs[i].size), 0) << i;
    }
  });
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("offset 196608"), std::string::npos) << s.message();
  for (size_t i = 0; i < reqs.size(); ++i) EXPECT_EQ(seen[i], i == bad ? 0 : 1) << i;
  std::fill(out.begin(), out.end(), 0);
  // Without faults, through ReadableFile's default (a pread file): each request once, in order.
  auto plain = OpenPreadFile(path_);
  ASSERT_TRUE(plain.ok());
  std::vector<size_t> order;
  ASSERT_TRUE((*plain)->ReadBatchProgress(reqs, [&](size_t i) { order.push_back(i); }).ok());
  ASSERT_EQ(order.size(), reqs.size());
  for (size_t i = 0; i < order.size(); ++i) EXPECT_EQ(order[i], i);
  EXPECT_EQ(std::memcmp(out.data(), bytes_.data(), out.size()), 0);
}

TEST_F(DirectReaderTest, ShortReadIsResubmittedForTheRemainder) {
  bool shortened = false;
  DirectReaderOptions opt;
  opt.completion_hook = [&](uint64_t, size_t size, int res) {
    if (!shortened && res == static_cast<int>(size) && size > 8192) {
      shortened = true;
      return 8192;  // the kernel read only the first two blocks
    }
    return res;
  };
  auto reader = Open(opt);
  ASSERT_NE(reader, nullptr);
  std::vector<uint8_t> out(65536);
  ASSERT_TRUE(reader->ReadAt(0, 65536, out.data()).ok());
  EXPECT_TRUE(shortened);
  EXPECT_EQ(std::memcmp(out.data(), bytes_.data(), 65536), 0);
  EXPECT_EQ(reader->Counters().short_reads, 1u);
}

// A short read is resumed where the data stopped: at the block below it with O_DIRECT (a resume must stay aligned),
// exactly there otherwise; each resubmission asks for the rest only.
TEST_F(DirectReaderTest, ShortReadResumesAtTheBlockWhereItStopped) {
  for (int stop : {8192, 5000}) {
    std::vector<std::pair<uint64_t, size_t>> calls;
    DirectReaderOptions opt;
    opt.completion_hook = [&](uint64_t offset, size_t size, int res) {
      calls.emplace_back(offset, size);
      return calls.size() == 1 ? stop : res;
    };
    auto reader = Open(opt);
    ASSERT_NE(reader, nullptr);
    std::vector<uint8_t> out(65536);
    ASSERT_TRUE(reader->ReadAt(0, 65536, out.data()).ok());
    EXPECT_EQ(std::memcmp(out.data(), bytes_.data(), 65536), 0);
    const uint64_t resume = static_cast<uint64_t>(stop) / reader->alignment() * reader->alignment();  // 1: buffered
    ASSERT_EQ(calls.size(), 2u) << "stop " << stop;
    EXPECT_EQ(calls[0], std::make_pair(uint64_t{0}, size_t{65536}));
    EXPECT_EQ(calls[1], std::make_pair(resume, static_cast<size_t>(65536 - resume))) << "stop " << stop;
  }
}

// The arena is registered in pieces of at most registered_buffer_bytes (the kernel's limit is 1 GiB; 64 KiB here):
// a read into one piece uses it as a fixed buffer with that piece's index, a read straddling two pieces goes without
// (either mistake makes the kernel refuse the read). Slots of 12 KiB: slots 5 and 10 straddle 64 and 128 KiB.
TEST_F(DirectReaderTest, ReadsIntoAnArenaRegisteredInPieces) {
  DirectReaderOptions opt;
  opt.registered_buffer_bytes = 65536;
  auto reader = Open(opt);
  ASSERT_NE(reader, nullptr);
  auto arena = reader->CreateArena(12288, 16);
  ASSERT_TRUE(arena.ok()) << arena.status().ToString();
  ASSERT_TRUE(reader->arena_registered()) << "io_uring_register_buffers refused (RLIMIT_MEMLOCK?)";
  std::vector<ReadRequest> reqs;
  for (size_t s = 0; s < 16; ++s) reqs.push_back({(15 - s) * 12288, 12288, (*arena)->Slot(s)});
  ASSERT_TRUE(reader->ReadBatch(reqs).ok());
  for (size_t s = 0; s < 16; ++s) {
    EXPECT_EQ(std::memcmp((*arena)->Slot(s), bytes_.data() + (15 - s) * 12288, 12288), 0) << "slot " << s;
  }
  EXPECT_EQ(reader->Counters().fixed_reads, 14u);
  opt.registered_buffer_bytes = 1000;
  EXPECT_FALSE(DirectReader::Open(path_, opt).ok()) << "not a multiple of 4096";
}

// A read that returns 0 bytes before the request is complete (the file shrank under the reader) is an error naming
// where the data stopped, not a read resubmitted for ever or reported complete.
TEST_F(DirectReaderTest, ZeroBytesBeforeTheEndIsAnError) {
  int zeroed = 0;
  DirectReaderOptions opt;
  opt.completion_hook = [&](uint64_t, size_t, int res) { return zeroed++ == 0 ? 0 : res; };
  auto reader = Open(opt);
  ASSERT_NE(reader, nullptr);
  std::vector<uint8_t> out(8192);
  const Status s = reader->ReadAt(16384, 8192, out.data());
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("unexpected end of file at offset 16384"), std::string::npos) << s.message();
  EXPECT_EQ(reader->Counters().requests, 0u);
}

// With O_DIRECT, less than a block where a block was asked means the same: the data ends inside that block (as if the
// file were truncated to 16484 bytes), and a resubmission from the block's start would come back as short for ever.
// Through io_uring and through pread.
TEST_F(DirectReaderTest, ShortReadInsideABlockIsTheEndOfTheFile) {
  std::vector<uint8_t> out(8192);
  if (!Open()->direct_io()) GTEST_SKIP() << "the file system of " << path_ << " refuses O_DIRECT";
  for (bool pread : {false, true}) {
    DirectReaderOptions o;
    o.completion_hook = [&](uint64_t offset, size_t size, int res) {
      return offset + size > 16484 && res > 0 ? static_cast<int>(std::max<int64_t>(0, 16484 - int64_t(offset))) : res;
    };
    auto shrunk = Open(o);
    ASSERT_NE(shrunk, nullptr);
    const Status t = pread ? shrunk->PreadAt(16384, 8192, out.data()) : shrunk->ReadAt(16384, 8192, out.data());
    ASSERT_FALSE(t.ok()) << (pread ? "pread" : "io_uring");
    EXPECT_NE(t.message().find("unexpected end of file at offset 16484"), std::string::npos) << t.message();
  }
}

// A plain batch stops starting reads at its first failure and returns that failure; a progress batch goes on but
// still returns the first failure, not the last. Queue depth 1 makes the order of reads the order of requests.
TEST_F(DirectReaderTest, ABatchReturnsItsFirstFailure) {
  std::vector<uint64_t> offsets;
  int page5_faults = 0;
  DirectReaderOptions opt;
  opt.queue_depth = 1;
  opt.completion_hook = [&](uint64_t offset, size_t, int res) {
    offsets.push_back(offset);
    // Page 2 always fails, retry included; page 5 fails page5_faults times.
    return offset == 2 * 4096 || (offset == 5 * 4096 && page5_faults-- > 0) ? -EIO : res;
  };
  auto reader = Open(opt);
  ASSERT_NE(reader, nullptr);
  std::vector<uint8_t> out(8 * 4096);
  const std::vector<ReadRequest> reqs = PageRequests(out, 8);
  Status s = reader->ReadBatch(reqs);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("offset 8192"), std::string::npos) << s.message();
  EXPECT_EQ(offsets, (std::vector<uint64_t>{0, 4096, 8192, 8192})) << "nothing read after the failed page's retry";
  EXPECT_EQ(reader->Counters().requests, 2u);
  EXPECT_EQ(reader->Counters().retries, 1u);
  // A progress batch after the failure of page 2: a transient EIO of page 5 is still retried and page 5 arrives;
  // with page 5 failing twice, the batch's error is still page 2's.
  for (int faults : {1, 2}) {
    offsets.clear();
    page5_faults = faults;
    std::vector<int> seen(reqs.size(), 0);
    s = reader->ReadBatchProgress(reqs, [&](size_t i) { ++seen[i]; });
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.message().find("offset 8192"), std::string::npos) << "the first failure: " << s.message();
    EXPECT_EQ(offsets.size(), 10u) << "every page, pages 2 and 5 twice: " << ::testing::PrintToString(offsets);
    EXPECT_EQ(seen, (std::vector<int>{1, 1, 0, 1, 1, faults == 1 ? 1 : 0, 1, 1})) << faults << " faults";
  }
}

// Counters count what the caller asked for: an unaligned read of 1000 bytes is 1000 bytes delivered, though a whole
// block was read into the bounce buffer.
TEST_F(DirectReaderTest, BytesCountedAreTheCallersNotTheBlocks) {
  auto reader = Open();
  ASSERT_NE(reader, nullptr);
  std::vector<uint8_t> out(1000);
  ASSERT_TRUE(reader->ReadAt(1, 1000, out.data()).ok());
  EXPECT_EQ(std::memcmp(out.data(), bytes_.data() + 1, 1000), 0);
  EXPECT_EQ(reader->Counters().bytes, 1000u);
  EXPECT_EQ(reader->Counters().requests, 1u);
  // An offset so large that offset + size wraps around is past the end, not a read.
  const Status s = reader->ReadAt(UINT64_MAX - 10, 100, out.data());
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("past the end"), std::string::npos) << s.message();
}

// The latency sample is a ring of the most recent kLatencySampleCapacity completions, oldest first: after more reads
// than it holds, the last three (slowed by 3 ms each in the completion hook, which runs before the latency is taken)
// come last.
TEST_F(DirectReaderTest, LatencySampleKeepsTheMostRecentOldestFirst) {
  bool slow = false;
  DirectReaderOptions opt;
  opt.buffered = true;  // page-cache reads: 65 k of them in well under a second
  opt.queue_depth = 64;
  opt.completion_hook = [&](uint64_t, size_t, int res) {
    if (slow) std::this_thread::sleep_for(std::chrono::milliseconds(3));
    return res;
  };
  auto reader = Open(opt);
  ASSERT_NE(reader, nullptr);
  std::vector<uint8_t> out(4096);
  std::vector<ReadRequest> reqs;
  for (size_t i = 0; i < kLatencySampleCapacity + 100; ++i) reqs.push_back({(i % 256) * 4096, 4096, out.data()});
  ASSERT_TRUE(reader->ReadBatch(reqs).ok());
  slow = true;
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(reader->ReadAt(4096 * static_cast<uint64_t>(i), 4096, out.data()).ok());
  const std::vector<uint32_t> sample = reader->LatencySampleNs();
  ASSERT_EQ(sample.size(), kLatencySampleCapacity);
  for (size_t i = sample.size() - 3; i < sample.size(); ++i) EXPECT_GE(sample[i], 3000000u) << i;
  EXPECT_LT(*std::min_element(sample.begin(), sample.end() - 3), 3000000u);
}

// PreadAt (the synchronous path of llmflash): EIO retried once, then an error saying so; a short read resumed at the
// block below where it stopped (O_DIRECT); a range past the end refused before any read.
TEST_F(DirectReaderTest, PreadRetriesOnceAndResumesShortReads) {
  std::vector<std::pair<uint64_t, size_t>> calls;
  int eio = 0, stop = 0;
  DirectReaderOptions opt;
  opt.completion_hook = [&](uint64_t offset, size_t size, int res) {
    calls.emplace_back(offset, size);
    if (eio > 0) {
      --eio;
      return -EIO;
    }
    if (stop > 0) {
      const int n = stop;
      stop = 0;
      return n;
    }
    return res;
  };
  auto reader = Open(opt);
  ASSERT_NE(reader, nullptr);
  std::vector<uint8_t> out(65536);
  eio = 1;
  ASSERT_TRUE(reader->PreadAt(8192, 8192, out.data()).ok());
  EXPECT_EQ(std::memcmp(out.data(), bytes_.data() + 8192, 8192), 0);
  EXPECT_EQ(calls.size(), 2u);
  EXPECT_EQ(reader->Counters().retries, 1u);
  calls.clear();
  eio = 2;
  Status s = reader->PreadAt(8192, 8192, out.data());
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("after 1 retry"), std::string::npos) << s.message();
  EXPECT_EQ(calls.size(), 2u) << "one retry, not more";
  calls.clear();
  stop = 5000;
  ASSERT_TRUE(reader->PreadAt(0, 65536, out.data()).ok());
  EXPECT_EQ(std::memcmp(out.data(), bytes_.data(), 65536), 0);
  const uint64_t resume = 5000 / reader->alignment() * reader->alignment();  // 4608 at 512-byte blocks
  ASSERT_EQ(calls.size(), 2u);
  EXPECT_EQ(calls[1], std::make_pair(resume, static_cast<size_t>(65536 - resume)));
  calls.clear();
  s = reader->PreadAt(kFileBytes - 10, 20, out.data());
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("past the end"), std::string::npos) << s.message();
  EXPECT_TRUE(calls.empty());
}

// A scattered read holds at most kMaxScatterPieces pieces: the builder starts a new read at the limit, also when a
// gap would need two more (the gap's piece and the range's).
TEST(RequestBuilderTest, ScatteredReadsStopAtThePieceLimit) {
  std::vector<uint8_t> buf(2 * (kMaxScatterPieces + 2));
  RequestBuilder rb;
  rb.Reset(SIZE_MAX, true);
  // Ranges of 1 byte, file-adjacent, each in memory 2 bytes after the last (never memory-adjacent): one piece each.
  for (uint32_t i = 0; i <= kMaxScatterPieces; ++i) {
    EXPECT_EQ(rb.Add(i, 1, buf.data() + 2 * i), i < kMaxScatterPieces ? 0u : 1u) << i;
  }
  const std::vector<ReadRequest>& r = rb.Finish();
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[0].n_pieces, kMaxScatterPieces);
  uint8_t sink[16];
  rb.Reset(SIZE_MAX, true, sink, 16);
  for (uint32_t i = 0; i + 1 < kMaxScatterPieces; ++i) ASSERT_EQ(rb.Add(i, 1, buf.data() + 2 * i), 0u);
  // 1023 pieces: a range after a gap needs 2 more, so it starts a new read.
  EXPECT_EQ(rb.Add(kMaxScatterPieces + 4, 1, buf.data()), 1u);
  EXPECT_EQ(rb.Finish()[0].n_pieces, kMaxScatterPieces - 1);
}

TEST_F(DirectReaderTest, FaultInjectingFileWrapsTheReader) {
  std::shared_ptr<const ReadableFile> reader = Open();
  ASSERT_NE(reader, nullptr);
  FaultInjectingFile faulty(reader);
  faulty.AddRule({FaultInjectingFile::Fault::kEio, 4096, 4096, 1});
  std::vector<uint8_t> out(4096);
  EXPECT_FALSE(faulty.ReadAt(4096, 4096, out.data()).ok());
  ASSERT_TRUE(faulty.ReadAt(4096, 4096, out.data()).ok());
  EXPECT_EQ(std::memcmp(out.data(), bytes_.data() + 4096, 4096), 0);
}

TEST_F(DirectReaderTest, BufferedModeSaysPageCacheInUse) {
  DirectReaderOptions opt;
  opt.buffered = true;
  auto reader = Open(opt);
  ASSERT_NE(reader, nullptr);
  EXPECT_FALSE(reader->direct_io());
  std::vector<uint8_t> out(777);
  ASSERT_TRUE(reader->ReadAt(12345, 777, out.data()).ok());
  EXPECT_EQ(std::memcmp(out.data(), bytes_.data() + 12345, 777), 0);
}

TEST(DirectReaderTmpfsTest, TmpfsIsReportedAsPageCache) {
  struct statfs sfs {};
  if (statfs("/dev/shm", &sfs) != 0 || sfs.f_type != 0x01021994) GTEST_SKIP() << "/dev/shm is not tmpfs here";
  const std::string path = "/dev/shm/nflash_direct_io_test_" + std::to_string(getpid());
  nflash::testing::WriteBytes(path, RandomBytes(10000, 3));
  auto r = DirectReader::Open(path);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_FALSE((*r)->direct_io());
  DirectReaderOptions strict;
  strict.allow_buffered_fallback = false;
  EXPECT_FALSE(DirectReader::Open(path, strict).ok());
  std::filesystem::remove(path);
}

// ReadFileDirect (resident weights): every size around the block and huge-page boundaries comes back byte for byte,
// from the disk (O_DIRECT) and from tmpfs (buffered fallback); Data() is 4 KiB-aligned (2 MiB once the file is that
// large); a missing file names its path.
TEST(ReadFileDirectTest, WholeFileIntoMemoryAtEverySize) {
  TempDir dir;
  const size_t sizes[] = {0, 1, 4095, 4096, 4097, (size_t{2} << 20) + 4097, (size_t{9} << 20) + 17};
  std::vector<std::string> folders = {dir.path()};
  struct statfs sfs {};
  if (statfs("/dev/shm", &sfs) == 0 && sfs.f_type == 0x01021994) folders.push_back("/dev/shm");
  for (const std::string& folder : folders) {
    for (size_t n : sizes) {
      SCOPED_TRACE(folder + " size " + std::to_string(n));
      const std::string path = folder + "/nflash_read_direct_" + std::to_string(getpid()) + "_" + std::to_string(n);
      const std::vector<uint8_t> bytes = RandomBytes(n, static_cast<uint32_t>(n));
      nflash::testing::WriteBytes(path, bytes);
      auto f = ReadFileDirect(path);
      std::filesystem::remove(path);
      ASSERT_TRUE(f.ok()) << f.status().ToString();
      ASSERT_EQ((*f)->Size(), n);
      if (n == 0) continue;
      ASSERT_NE((*f)->Data(), nullptr);
      EXPECT_EQ(reinterpret_cast<uintptr_t>((*f)->Data()) % (n >= (size_t{2} << 20) ? (size_t{2} << 20) : 4096), 0u);
      EXPECT_EQ(0, std::memcmp((*f)->Data(), bytes.data(), n));
      std::vector<uint8_t> tail(std::min<size_t>(n, 100));
      ASSERT_TRUE((*f)->ReadAt(n - tail.size(), tail.size(), tail.data()).ok());
      EXPECT_EQ(0, std::memcmp(tail.data(), bytes.data() + n - tail.size(), tail.size()));
      EXPECT_FALSE((*f)->ReadAt(n - tail.size(), tail.size() + 1, tail.data()).ok());
    }
  }
  auto missing = ReadFileDirect("/nonexistent/resident.gguf");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("/nonexistent/resident.gguf"), std::string::npos);
}

// ReadFileDirect with holes (a tensor left on flash): the bytes outside them are the file's; the whole pages inside are
// never resident (mincore, an independent view of the page tables); ReadAt across a hole still returns the file's
// bytes; partial pages at a hole's edges are read as usual; holes out of order are refused.
TEST(ReadFileDirectTest, HolesAreNeitherReadNorResident) {
  TempDir dir;
  const size_t n = (size_t{5} << 20) + 1234;
  const std::vector<uint8_t> bytes = RandomBytes(n, 99);
  const std::string path = dir.File("resident.bin");
  nflash::testing::WriteBytes(path, bytes);
  const ByteRange holes[] = {{100000, size_t{3} << 20}, {(size_t{4} << 20) + 10, 5000}};
  auto f = ReadFileDirect(path, holes);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  const uint8_t* data = (*f)->Data();
  ASSERT_NE(data, nullptr);
  const size_t page = 4096;
  auto outside = [&](size_t i) {
    for (const ByteRange& h : holes) {
      const size_t b = (h.offset + page - 1) / page * page, e = (h.offset + h.size) / page * page;
      if (i >= b && i < e) return false;
    }
    return true;
  };
  size_t compared = 0;
  for (size_t i = 0; i < n; i += 997) {
    if (!outside(i)) continue;
    ASSERT_EQ(data[i], bytes[i]) << "byte " << i;
    ++compared;
  }
  EXPECT_GT(compared, 1000u);
  // The first hole's whole pages: [102400, 3245728 rounded down) are not resident; a page just before is.
  const size_t b = (100000 + page - 1) / page * page, e = (100000 + (size_t{3} << 20)) / page * page;
  std::vector<unsigned char> vec((e - b) / page);
  ASSERT_EQ(mincore(const_cast<uint8_t*>(data + b), e - b, vec.data()), 0);
  EXPECT_EQ(std::count_if(vec.begin(), vec.end(), [](unsigned char c) { return (c & 1) != 0; }), 0);
  unsigned char before = 0;
  ASSERT_EQ(mincore(const_cast<uint8_t*>(data + b - page), page, &before), 0);
  EXPECT_EQ(before & 1, 1);
  // ReadAt across both edges of the first hole, and inside the second.
  for (auto [off, len] : {std::pair<size_t, size_t>{90000, 20000}, {e - 100, 5000}, {(size_t{4} << 20) + 5, 5010}}) {
    std::vector<uint8_t> out(len);
    ASSERT_TRUE((*f)->ReadAt(off, len, out.data()).ok()) << off;
    EXPECT_EQ(0, std::memcmp(out.data(), bytes.data() + off, len)) << off;
  }
  const ByteRange unsorted[] = {{8192, 4096}, {0, 4096}};
  EXPECT_FALSE(ReadFileDirect(path, unsorted).ok());
  const ByteRange beyond[] = {{n - 10, 100}};
  EXPECT_FALSE(ReadFileDirect(path, beyond).ok());
}

TEST(DirectReaderOpenTest, MissingFileAndBadQueueDepth) {
  auto r = DirectReader::Open("/nonexistent/nflash.bin");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("/nonexistent/nflash.bin"), std::string::npos);
  TempDir dir;
  nflash::testing::WriteBytes(dir.File("x"), {1, 2, 3});
  DirectReaderOptions opt;
  opt.queue_depth = 0;
  EXPECT_EQ(DirectReader::Open(dir.File("x"), opt).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace nflash::io
