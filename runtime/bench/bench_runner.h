// Running one `nflash bench` row: in this process (the hidden `bench-row` subcommand: load, run the test
// `repetitions` times, measure), or in a child process (a re-exec of the nflash binary running `bench-row`), so that
// the peak RSS and the memory cgroup of the dense-mmap baseline belong to that row alone.
#pragma once

#include <cstdint>
#include <string>

#include "runtime/bench/bench_report.h"
#include "runtime/bench/cgroup.h"
#include "runtime/core/status.h"
#include "runtime/core/subprocess.h"  // SelfExecutable: rows re-run this binary

namespace nflash::bench {

// Runs `spec` in this process. Errors of the row itself (a budget below the minimum, a model that does not load)
// come back as a RowResult whose status says "error: ..." or "unavailable: ...", so a grid keeps going; the Status
// is an error only for a spec that cannot be run at all.
Result<RowResult> RunRow(const RowSpec& spec);

// Runs `spec` as `<binary> [-q] bench-row --spec <json>` in a child process, reading its one JSON line from stdout.
// dense-mmap rows first drop the model file's cached pages; with a budget they run in a memory cgroup of that budget
// when `cgroups` allows it (the child is moved in before it execs, so before it loads the model), otherwise the row's
// constraint says "unconstrained: <why>". The peak RSS is the child's (wait4). A crash or an OOM kill becomes the
// row's status, and so does running past `timeout_s` seconds (> 0; the child is then killed). Not thread-safe (fork).
RowResult RunRowInChild(const std::string& binary, const RowSpec& spec, const CgroupSupport& cgroups, bool quiet,
                        double timeout_s = 0);

// The memory budget that leaves `fraction` of the FFN weights of `model` on flash: every non-FFN weight byte, the
// other (1 - fraction) of the FFN bytes, the F32 KV cache of `n_ctx` positions, plus kOffloadOverheadBytes.
Result<uint64_t> OffloadBudget(const RowSpec& model_spec, double fraction, int64_t n_ctx);

// What a process running a row needs besides weights and KV cache (binary, libraries, stacks, activations, logits):
// ~10 MiB measured for stories260K on x86-64 Linux, rounded up so a budget derived from --offload is not dominated by
// it for small models yet is not below what the process needs.
inline constexpr uint64_t kOffloadOverheadBytes = uint64_t{16} << 20;

}  // namespace nflash::bench
