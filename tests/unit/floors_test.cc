// The speed floors (planner/floors.h) on a tiny hand-made hardware profile whose figures make every term a round
// number, and the dense bytes counted from a hand-written resident GGUF.
#include <gtest/gtest.h>

#include <vector>

#include "planner/floors.h"
#include "tests/test_util.h"

namespace nflash::planner {
namespace {

// GEMV 2 GB/s at 1 thread, 3 at 2; sparse rows 1 and 1.5 GB/s; reads at queue depth 1: 50 MB/s at 4 KiB, 200 MB/s at
// 64 KiB; at queue depth 8: 100 and 400 MB/s.
HardwareParams TinyHardware() {
  HardwareParams hw;
  hw.cores = 2;
  hw.dense_gemv_gbs = {2.0, 3.0};
  hw.sparse_ffn_gbs = {1.0, 1.5};
  hw.random_reads = {{4096, 1, 50.0, 80.0}, {65536, 1, 200.0, 300.0}, {4096, 8, 100.0, 300.0}, {65536, 8, 400.0, 1200.0}};
  return hw;
}

DecodeWork TinyWork() {
  DecodeWork w;
  w.threads = 2;
  w.dense_bytes = 3'000'000;      // / 3 GB/s = 1 ms
  w.predictor_bytes = 1'500'000;  // / 3 GB/s = 0.5 ms
  w.ffn_bytes = 3'000'000;        // / 1.5 GB/s = 2 ms
  // 125 requests of 16 KiB: log2 14, halfway between the 4 KiB (12) and 64 KiB (16) points.
  w.read_bytes = 125.0 * 16384.0;
  w.read_requests = 125;
  w.queue_depth = 4;  // the largest measured depth not above 4 is 1: 50 + (200 - 50) / 2 = 125 MB/s
  w.token_ms = 20;
  return w;
}

TEST(Floors, HandComputedTerms) {
  auto f = ComputeFloors(TinyHardware(), TinyWork());
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_NEAR(f->dense_ms, 1.0, 1e-12);
  EXPECT_NEAR(f->predictor_ms, 0.5, 1e-12);
  EXPECT_NEAR(f->ffn_ms, 2.0, 1e-12);
  EXPECT_NEAR(f->compute_ms, 3.5, 1e-12);
  // 2,048,000 bytes at 125 MB/s = 16.384 ms.
  EXPECT_NEAR(f->io_ms, 16.384, 1e-9);
  EXPECT_NEAR(f->floor_ms, 16.384, 1e-9);
  EXPECT_NEAR(f->ratio, 20.0 / 16.384, 1e-9);
}

TEST(Floors, QueueDepthThreadsAndComputeBound) {
  DecodeWork w = TinyWork();
  w.queue_depth = 32;  // depth 8's points: 100 + (400 - 100) / 2 = 250 MB/s -> 8.192 ms
  auto deep = ComputeFloors(TinyHardware(), w);
  ASSERT_TRUE(deep.ok());
  EXPECT_NEAR(deep->io_ms, 8.192, 1e-9);

  w.threads = 1;  // 2 GB/s and 1 GB/s: 1.5 + 0.75 + 3 ms
  auto one = ComputeFloors(TinyHardware(), w);
  ASSERT_TRUE(one.ok());
  EXPECT_NEAR(one->compute_ms, 5.25, 1e-12);
  w.threads = 8;  // beyond the measured counts: the largest measured (2 threads)
  auto many = ComputeFloors(TinyHardware(), w);
  ASSERT_TRUE(many.ok());
  EXPECT_NEAR(many->compute_ms, 3.5, 1e-12);

  // Nothing read (everything cached): the compute floor is the floor.
  w.read_bytes = 0;
  w.read_requests = 0;
  w.token_ms = 7;
  auto cached = ComputeFloors(TinyHardware(), w);
  ASSERT_TRUE(cached.ok());
  EXPECT_EQ(cached->io_ms, 0.0);
  EXPECT_NEAR(cached->floor_ms, 3.5, 1e-12);
  EXPECT_NEAR(cached->ratio, 2.0, 1e-12);
}

TEST(Floors, RejectsMissingFigures) {
  HardwareParams no_kernels = TinyHardware();
  no_kernels.dense_gemv_gbs.clear();
  EXPECT_EQ(ComputeFloors(no_kernels, TinyWork()).status().code(), StatusCode::kInvalidArgument);
  HardwareParams zero = TinyHardware();
  zero.sparse_ffn_gbs = {0.0, 0.0};
  EXPECT_EQ(ComputeFloors(zero, TinyWork()).status().code(), StatusCode::kInvalidArgument);
  HardwareParams no_reads = TinyHardware();
  no_reads.random_reads.clear();
  auto r = ComputeFloors(no_reads, TinyWork());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("random-read"), std::string::npos) << r.status().ToString();
}

// A resident image: embedding (8 x 20 F32), output head (8 x 16), one attention matrix (8 x 8), a norm and an index
// table; tied when the head is left out.
std::string WriteResident(const testing::TempDir& dir, const std::string& name, bool with_output) {
  GgufWriter w;
  struct T {
    const char* name;
    std::vector<uint64_t> dims;
  };
  std::vector<T> tensors = {{"token_embd.weight", {8, 20}},
                            {"blk.0.attn_q.weight", {8, 8}},
                            {"blk.0.attn_norm.weight", {8}},
                            {"nflash.deploy.blk.0.table", {4, 4}}};
  if (with_output) tensors.push_back({"output.weight", {8, 16}});
  for (const T& t : tensors) EXPECT_TRUE(w.AddTensor(t.name, GgmlType::kF32, t.dims).ok());
  const std::string path = dir.File(name);
  EXPECT_TRUE(w.Begin(path, true).ok());
  for (const T& t : tensors) {
    uint64_t n = 1;
    for (uint64_t d : t.dims) n *= d;
    const std::vector<uint8_t> zeros(n * 4, 0);
    EXPECT_TRUE(w.WriteTensorData(t.name, zeros).ok());
  }
  EXPECT_TRUE(w.Finish().ok());
  return path;
}

TEST(Floors, ResidentDenseWeightsCountsMatrixProducts) {
  testing::TempDir dir;
  auto untied = GgufFile::OpenPath(WriteResident(dir, "untied.gguf", true));
  ASSERT_TRUE(untied.ok()) << untied.status().ToString();
  // attn_q 64 + output 128 elements: the embedding is a lookup, the norm and the index table are not products.
  DenseWeights u = ResidentDenseWeights(*untied);
  EXPECT_EQ(u.params, 64u + 128u);
  EXPECT_EQ(u.bytes, (64u + 128u) * 4u);
  auto tied = GgufFile::OpenPath(WriteResident(dir, "tied.gguf", false));
  ASSERT_TRUE(tied.ok()) << tied.status().ToString();
  // No output head: the embedding doubles as the head.
  DenseWeights t = ResidentDenseWeights(*tied);
  EXPECT_EQ(t.params, 64u + 160u);
  EXPECT_EQ(t.bytes, (64u + 160u) * 4u);
}

}  // namespace
}  // namespace nflash::planner
