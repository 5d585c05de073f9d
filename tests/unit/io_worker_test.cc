// The pipeline's I/O thread: chunks complete as their reads land; with idle work set, a caller waiting for a chunk
// runs the work's steps until the chunk arrives (or the work runs out, then it blocks).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/core/file.h"
#include "runtime/core/stats.h"
#include "runtime/sparse/event_trace.h"
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

// An empty chunk is done at once, before any read of its stream lands (the caller need not wait for the reads of
// other chunks), and Ok.
TEST(IoWorkerTest, AnEmptyChunkIsDoneAtOnce) {
  GatedFile file;
  IoWorker worker(&file);
  std::vector<uint8_t> buf(2 * 64);
  const std::vector<ReadRequest> reqs = {{0, 64, buf.data()}, {64, 64, buf.data() + 64}};
  const std::vector<size_t> ends = {0, 2};  // chunk 0 empty, chunk 1 both reads
  std::atomic<bool> waited_out{false};
  std::thread opener([&] {  // a fallback, so that a worker that makes chunk 0 wait for the reads does not hang
    for (int i = 0; i < 40 && !waited_out; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    file.Open();
  });
  const size_t first = worker.Start(reqs, ends, "empty");
  const auto t0 = std::chrono::steady_clock::now();
  const Status s = worker.WaitChunk(first);
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  waited_out = true;
  EXPECT_TRUE(s.ok()) << s.ToString();
  EXPECT_LT(waited, 1.0) << "the empty chunk waited for the gated reads";
  EXPECT_TRUE(worker.WaitChunk(first + 1).ok());
  opener.join();
}

// A read that fails is not reported: its chunk carries the stream's error, the other chunks arrive Ok.
TEST(IoWorkerTest, AFailedReadFailsItsChunkOnly) {
  auto base = std::make_shared<MemoryFile>("mem.bin", std::vector<uint8_t>(4096, 7));
  FaultInjectingFile file(base);
  file.AddRule({FaultInjectingFile::Fault::kEio, 1024, 64, -1});  // every read of [1024, 1088)
  IoWorker worker(&file);
  std::vector<uint8_t> buf(3 * 64);
  const std::vector<ReadRequest> reqs = {
      {0, 64, buf.data()}, {1024, 64, buf.data() + 64}, {2048, 64, buf.data() + 128}};
  const std::vector<size_t> ends = {1, 2, 3};
  const size_t first = worker.Start(reqs, ends, "faulty");
  EXPECT_TRUE(worker.WaitChunk(first).ok());
  const Status s = worker.WaitChunk(first + 1);
  EXPECT_EQ(s.code(), StatusCode::kIOError) << s.ToString();
  EXPECT_TRUE(worker.WaitChunk(first + 2).ok());
  EXPECT_EQ(buf[0], 7);
  EXPECT_EQ(buf[128], 7);
}

// The event trace and the busy time: one span per stream on the I/O lane (its label and request count), whose
// duration is exactly what busy_ns() adds; a "wait" span on the compute lane only for a WaitChunk that blocked.
TEST(IoWorkerTest, TraceAndBusyTimeCoverEachStream) {
  GatedFile file;
  IoWorker worker(&file);
  EventTrace trace;
  worker.SetTrace(&trace);
  std::vector<uint8_t> buf(3 * 512, 0);
  const ReadRequest rs[] = {{0, 512, buf.data()}, {512, 512, buf.data() + 512}, {1024, 512, buf.data() + 1024}};
  const size_t ends[] = {2, 3};
  const uint64_t busy0 = worker.busy_ns();
  const size_t c = worker.Start(rs, ends, "reads ahead");
  std::atomic<uint64_t> opened_ns{0};
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    opened_ns = SteadyNowNs();
    file.Open();
  });
  ASSERT_TRUE(worker.WaitChunk(c).ok());
  ASSERT_TRUE(worker.WaitChunk(c + 1).ok());
  opener.join();
  worker.Drain();  // the stream's span is added when the whole stream is read
  // A chunk already read when waited for: no span.
  const ReadRequest again{2048, 512, buf.data()};
  const size_t one[] = {1};
  const size_t d = worker.Start(std::span<const ReadRequest>(&again, 1), one);
  worker.Drain();
  const size_t before = trace.Spans().size();
  ASSERT_TRUE(worker.WaitChunk(d).ok());
  EXPECT_EQ(trace.Spans().size(), before) << "a wait that did not block";
  const std::vector<TraceSpan> spans = trace.Spans();
  std::vector<TraceSpan> io, waits;
  for (const TraceSpan& s : spans) (s.lane == TraceLane::kIo ? io : waits).push_back(s);
  ASSERT_EQ(io.size(), 2u);
  EXPECT_STREQ(io[0].name, "reads ahead");
  EXPECT_EQ(io[0].count, 3);
  EXPECT_GE(io[0].end_ns, opened_ns.load()) << "the reads could not land before the file opened";
  EXPECT_STREQ(io[1].name, "reads");
  EXPECT_EQ(io[1].count, 1);
  EXPECT_EQ(worker.busy_ns() - busy0, (io[0].end_ns - io[0].begin_ns) + (io[1].end_ns - io[1].begin_ns));
  ASSERT_GE(waits.size(), 1u);
  ASSERT_LE(waits.size(), 2u) << "chunk 1 lands right after chunk 0; the third stream was read before its wait";
  EXPECT_STREQ(waits[0].name, "wait");
  EXPECT_EQ(waits[0].count, static_cast<int64_t>(c));
  EXPECT_LE(waits[0].begin_ns, opened_ns.load()) << "the caller blocked before the file opened";
  EXPECT_GE(waits[0].end_ns, opened_ns.load());
  worker.SetTrace(nullptr);
}

// Spans beyond the capacity are counted, not kept; the JSON is the Chrome Trace Event Format, times in microseconds
// from the earliest span, in begin order, with the two lanes named.
TEST(EventTraceTest, CapacityAndChromeFormat) {
  EventTrace trace(3);
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&trace, t] {
      for (int i = 0; i < 2; ++i) {
        const uint64_t b = 1'000'000 + static_cast<uint64_t>(t * 10 + i) * 1000;
        trace.Add(TraceSpan{t == 0 ? "ffn" : "reads", t == 0 ? TraceLane::kCompute : TraceLane::kIo, b, b + 2500,
                            t == 0 ? i : -1, 7});
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(trace.Spans().size(), 3u);
  EXPECT_EQ(trace.dropped(), 1u);
  const auto j = nlohmann::json::parse(trace.ToJson());
  EXPECT_EQ(j["otherData"]["dropped_spans"].get<int>(), 1);
  const auto& ev = j["traceEvents"];
  ASSERT_EQ(ev.size(), 5u);  // 2 thread names + 3 spans
  // The metadata events name each lane's thread id: the spans' tid 1 is compute, 2 the I/O thread.
  std::map<int, std::string> lane_names;
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(ev[i]["ph"], "M");
    EXPECT_EQ(ev[i]["name"], "thread_name");
    lane_names[ev[i]["tid"].get<int>()] = ev[i]["args"]["name"].get<std::string>();
  }
  EXPECT_EQ(lane_names, (std::map<int, std::string>{{1, "compute"}, {2, "io"}}));
  double last = -1;
  for (size_t i = 2; i < ev.size(); ++i) {
    EXPECT_EQ(ev[i]["ph"], "X");
    EXPECT_DOUBLE_EQ(ev[i]["dur"].get<double>(), 2.5);
    EXPECT_EQ(ev[i]["args"]["count"].get<int>(), 7);
    EXPECT_GE(ev[i]["ts"].get<double>(), last);
    last = ev[i]["ts"].get<double>();
    const bool ffn = ev[i]["name"] == "ffn";
    EXPECT_EQ(ev[i]["tid"].get<int>(), ffn ? 1 : 2);
    EXPECT_EQ(ev[i]["args"].contains("layer"), ffn);
  }
  EXPECT_DOUBLE_EQ(ev[2]["ts"].get<double>(), 0.0);
}

}  // namespace
}  // namespace nflash::sparse
