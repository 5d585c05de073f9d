// A small hand-written hardware profile in the schema of docs/hw-profile.md, for the tests that price runs with it
// (plan, floors): figures round enough to compute expectations by hand.
#pragma once

#include <string>
#include <utility>

#include <nlohmann/json.hpp>

namespace nflash::testing {

// f32 kernels at 1 and 2 threads: GEMV and sparse rows 4 GB/s per thread, GEMM (128 tokens) 20 GFLOP/s per thread;
// memory 10 GB/s; random reads of 4 KiB only: 20 MB/s at queue depth 1, 100 at 8, 300 at 64 (every read of 4 KiB or
// more is priced at the depth's figure), 100 us mean latency, 3 us submit CPU per request; sequential 1000 MB/s.
inline std::string FakeHwProfileJson() {
  nlohmann::json j;
  j["format"] = "nflash.hw_profile";
  j["version"] = 1;
  j["machine"] = {{"hardware_threads", 2}};
  nlohmann::json results = nlohmann::json::array();
  for (int t : {1, 2}) {
    for (const char* k : {"gemv", "gemv_rows", "accumulate_rows"}) {
      results.push_back({{"threads", t}, {"kernel", k}, {"type", "f32"}, {"tokens", 1}, {"weight_gb_per_s", 4.0 * t},
                         {"gflop_per_s", 2.0 * t}});
    }
    results.push_back({{"threads", t}, {"kernel", "gemm"}, {"type", "f32"}, {"tokens", 128},
                       {"weight_gb_per_s", 1.0}, {"gflop_per_s", 20.0 * t}});
  }
  j["compute"] = {{"results", results}, {"memory", {{{"threads", 2}, {"read_gb_per_s", 10.0}}}}};
  nlohmann::json random = nlohmann::json::array();
  for (auto [qd, mbs] : {std::pair{1, 20.0}, {8, 100.0}, {64, 300.0}}) {
    random.push_back({{"block_bytes", 4096}, {"queue_depth", qd}, {"mb_per_s", mbs}, {"latency_mean_us", 100.0},
                      {"submit_cpu_us_per_request", 3.0}});
  }
  j["flash"] = {{"random_read", random}, {"sequential_read", {{{"block_bytes", 4194304}, {"mb_per_s", 1000.0}}}}};
  return j.dump(1);
}

}  // namespace nflash::testing
