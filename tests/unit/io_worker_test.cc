// The pipeline's I/O thread: chunks complete as their reads land; with idle work set, a caller waiting for a chunk
// runs the work's steps until the chunk arrives (or the work runs out, then it blocks).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "runtime/core/file.h"
#include "runtime/sparse/io_worker.h"

namespace nflash::sparse {
namespace {

// Reads block until Open() (then fill the destination with the low byte of the offset).
class GatedFile final : public ReadableFile {
 public:
  Status ReadAt(uint64_t offset, size_t size, void* dst) const override {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return open_; });
    std::memset(dst, static_cast<int>(offset & 0xff), size);
    return Status::Ok();
  }
  uint64_t Size() const override { return uint64_t{1} << 20; }
  const std::string& Path() const override { return path_; }
  void Open() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      open_ = true;
    }
    cv_.notify_all();
  }

 private:
  std::string path_ = "gated";
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  bool open_ = false;
};

TEST(IoWorkerTest, IdleWorkRunsUntilTheChunkArrives) {
  GatedFile file;
  IoWorker worker(&file);
  int steps = 0;
  // The read can only complete once the 100th step opened the file; a WaitChunk that ignored the idle work would
  // block until the fallback opener below (2 s) and see fewer steps.
  worker.SetIdleWork([&] {
    if (++steps == 100) file.Open();
    return true;
  });
  std::atomic<bool> finished{false};
  std::thread fallback([&] {
    for (int i = 0; i < 200 && !finished; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    file.Open();
  });
  std::vector<uint8_t> buf(4096, 0);
  const ReadRequest r{4096 + 7, buf.size(), buf.data()};
  const size_t ends[] = {1};
  const size_t c = worker.Start(std::span<const ReadRequest>(&r, 1), ends);
  ASSERT_TRUE(worker.WaitChunk(c).ok());
  EXPECT_GE(steps, 100);
  const int after = steps;
  EXPECT_EQ(buf[0], 7);
  EXPECT_EQ(buf.back(), 7);
  finished = true;
  fallback.join();
  EXPECT_EQ(steps, after) << "no step runs outside WaitChunk";
}

TEST(IoWorkerTest, WaitBlocksOnceTheIdleWorkRunsOut) {
  GatedFile file;
  IoWorker worker(&file);
  int steps = 0;
  worker.SetIdleWork([&] { return ++steps < 3; });  // three steps, the last one reports nothing left
  std::vector<uint8_t> buf(512, 0);
  const ReadRequest r{9, buf.size(), buf.data()};
  const size_t ends[] = {1};
  const size_t c = worker.Start(std::span<const ReadRequest>(&r, 1), ends);
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    file.Open();
  });
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(worker.WaitChunk(c).ok());
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(40)) << "returned before the read landed";
  EXPECT_EQ(steps, 3);
  EXPECT_EQ(buf[100], 9);
  opener.join();
  EXPECT_GE(worker.wait_ns(), uint64_t{40'000'000}) << "the time of the steps and the block counts as waiting";
}

}  // namespace
}  // namespace nflash::sparse
