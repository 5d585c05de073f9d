// FlashEmbedding: token embedding rows read from the file on demand, checked against hashes taken at Create.
#include "runtime/sparse/flash_embedding.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "runtime/io/direct_reader.h"
#include "tests/test_util.h"

namespace nflash::sparse {
namespace {

using nflash::testing::TempDir;

constexpr size_t kRowBytes = 2304;  // one Q4_0 row of a 4096-wide model
constexpr int64_t kRows = 3000;     // 6.6 MiB: more than one of Create's 4 MiB passes
constexpr uint64_t kOffset = 12345;  // the tensor starts mid-block, as GGUF tensors do

class FlashEmbeddingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::mt19937 rng(5);
    bytes_.resize(kOffset + kRows * kRowBytes + 777);
    for (auto& b : bytes_) b = static_cast<uint8_t>(rng());
    path_ = dir_.File("resident.gguf");
    nflash::testing::WriteBytes(path_, bytes_);
    auto r = io::DirectReader::Open(path_);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    reader_ = std::move(r).value();
  }
  const uint8_t* RowInFile(int64_t token) const { return bytes_.data() + kOffset + token * kRowBytes; }
  TempDir dir_;
  std::string path_;
  std::vector<uint8_t> bytes_;
  std::shared_ptr<io::DirectReader> reader_;
};

TEST_F(FlashEmbeddingTest, RowsAreTheFilesBytes) {
  auto e = FlashEmbedding::Create(reader_, ByteRange{kOffset, kRows * kRowBytes}, kRows, kRowBytes);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  EXPECT_EQ((*e)->memory_bytes(), kRows * sizeof(uint64_t));
  std::vector<uint8_t> row(kRowBytes);
  for (int32_t t : {0, 1, 1777, 1778, static_cast<int32_t>(kRows - 1)}) {
    ASSERT_TRUE((*e)->Row(t, row.data()).ok()) << t;
    EXPECT_EQ(0, std::memcmp(row.data(), RowInFile(t), kRowBytes)) << t;
  }
  EXPECT_EQ((*e)->rows_read(), 5u);
  const Status bad = (*e)->Row(static_cast<int32_t>(kRows), row.data());
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("token id 3000"), std::string::npos) << bad.message();
  // A range that is not rows x row bytes, or ends past the file, is refused.
  EXPECT_FALSE(FlashEmbedding::Create(reader_, ByteRange{kOffset, kRows * kRowBytes - 1}, kRows, kRowBytes).ok());
  EXPECT_FALSE(FlashEmbedding::Create(reader_, ByteRange{bytes_.size() - 100, kRowBytes}, 1, kRowBytes).ok());
}

// Faults injected after Create (through the File abstraction): a flipped bit or an EIO once is read again; one that
// persists is an error naming the file, the row and its offset; never a wrong row.
TEST_F(FlashEmbeddingTest, FaultsAreRetriedOnceThenNamed) {
  auto faulty = std::make_shared<FaultInjectingFile>(reader_);
  auto e = FlashEmbedding::Create(faulty, ByteRange{kOffset, kRows * kRowBytes}, kRows, kRowBytes);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  auto at = [](int64_t token) { return kOffset + static_cast<uint64_t>(token) * kRowBytes; };
  using F = FaultInjectingFile::Fault;
  faulty->AddRule({F::kBitFlip, at(7), kRowBytes, 1});
  faulty->AddRule({F::kEio, at(8), kRowBytes, 1});
  faulty->AddRule({F::kBitFlip, at(9), kRowBytes, -1});
  faulty->AddRule({F::kEio, at(11), kRowBytes, -1});
  std::vector<uint8_t> row(kRowBytes);
  for (int32_t t : {7, 8}) {
    ASSERT_TRUE((*e)->Row(t, row.data()).ok()) << t;
    EXPECT_EQ(0, std::memcmp(row.data(), RowInFile(t), kRowBytes)) << t;
  }
  const Status corrupt = (*e)->Row(9, row.data());
  EXPECT_EQ(corrupt.code(), StatusCode::kCorruption) << corrupt.ToString();
  for (const std::string& needle : {path_, std::string("row 9 "), "offset " + std::to_string(at(9))}) {
    EXPECT_NE(corrupt.message().find(needle), std::string::npos) << corrupt.message();
  }
  const Status eio = (*e)->Row(11, row.data());
  EXPECT_EQ(eio.code(), StatusCode::kIOError) << eio.ToString();
  EXPECT_NE(eio.message().find("row 11 "), std::string::npos) << eio.message();
  EXPECT_EQ(faulty->InjectedCount(), 2 + 2 + 2);
  EXPECT_EQ((*e)->rows_read(), 2u);
}

}  // namespace
}  // namespace nflash::sparse
