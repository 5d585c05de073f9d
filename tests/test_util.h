// Helpers shared by the test suites: temporary directories, paths into ../shared, running the nflash binary.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "runtime/core/gguf.h"

namespace nflash::testing {

// A fresh directory under $TMPDIR (or /tmp), removed with its contents when the object dies.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// NFLASH_SHARED_DIR + "/" + relative (the read-only models and text beside the repository).
std::string SharedPath(const std::string& relative);
// The path of the built `nflash` binary.
std::string NflashBinary();

struct CommandResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr, interleaved
};
// Runs `command` through /bin/sh, capturing stdout and stderr interleaved (or stdout only, stderr passed through).
CommandResult RunCommand(const std::string& command, bool capture_stderr = true);
// Runs `command` (stdout and stderr captured): success when it exits with 2, a usage error, and its output contains
// `message`; the failure shows the command, its exit code and its output.
::testing::AssertionResult FailsAsUsageError(const std::string& command, const std::string& message);

// The deployment of the offloaded-runtime tests: stories260K-relu converted to an F32 GGUF at `model`, profiled on
// 4000 tokens of the calibration text (`profile`), packed into the directory `deploy`. "" when it worked, else the
// failing command's output.
std::string MakeReluDeployment(const std::string& model, const std::string& profile, const std::string& deploy);

// Pages of `path` in the page cache, by mincore on a shared mapping of it (the kernel's view, independent of how the
// code under test reads); -1 when it cannot tell.
int64_t CachedPages(const std::string& path);
// Drops `path`'s pages from the page cache (fsync, then POSIX_FADV_DONTNEED); "" when done, else why not.
std::string DropFromPageCache(const std::string& path);

// One tensor as RewriteGguf copies it: the callback may rename it, change its type or dims, or its bytes (which must
// then match the new type and dims).
struct GgufTensorCopy {
  std::string name;
  GgmlType type;
  std::vector<uint64_t> dims;
  std::vector<uint8_t> bytes;
  // Replaces the bytes with zeros of the size `type` and `dims` now take (after the callback changed either).
  void ZeroData();
};
// Copies the GGUF `src` to `dst` (may be the same path) through GgufWriter, in the source's order, after `edit_kv`
// has changed, added or erased metadata and `edit_tensor` each tensor (either may be null): corrupt-input tests
// change one field of a valid file this way. "" when written, else what failed.
std::string RewriteGguf(const std::string& src, const std::string& dst,
                        const std::function<void(std::vector<std::pair<std::string, GgufValue>>*)>& edit_kv,
                        const std::function<void(GgufTensorCopy*)>& edit_tensor);
// Callbacks for RewriteGguf. SetGgufKey: `key` erased, then set to `value` when there is one (added if it was
// missing). EditGgufKey: `edit` applied to `key`'s value in place (nothing when the key is missing).
// RetypeGgufTensor: tensor `name` stored as `type`, same dims, its bytes zeroed to the new size.
using GgufKvEdit = std::function<void(std::vector<std::pair<std::string, GgufValue>>*)>;
GgufKvEdit SetGgufKey(std::string key, std::optional<GgufValue> value);
GgufKvEdit EditGgufKey(std::string key, std::function<void(GgufValue&)> edit);
std::function<void(GgufTensorCopy*)> RetypeGgufTensor(std::string name, GgmlType type);

void WriteBytes(const std::string& path, const std::vector<uint8_t>& bytes);
void WriteText(const std::string& path, const std::string& text);
// The whole file at `path` ("" when it cannot be read).
std::string ReadText(const std::string& path);
// A float32 .npy file (the NumPy reference's --logits-out) of `expected` values: EXPECT failures when its header or
// size is not that.
std::vector<float> ReadNpyF32(const std::string& path, size_t expected);
// The lines of `text`, without their line breaks (an unterminated last line included).
std::vector<std::string> Lines(const std::string& text);

// The heap in use by the allocator's own count: glibc's (mallinfo2, chunks with their headers, mapped ones too), or
// under AddressSanitizer, which replaces the allocator and leaves mallinfo2 at 0, ASan's (the bytes asked for, without
// headers). An estimate in glibc's chunks (runtime/core/heap_bytes.h) of what a step allocates must lie within
// [kHeapEstimateLow, kHeapEstimateHigh] x the count's growth over it: 2% either way with glibc; under ASan the
// estimate exceeds the bytes asked for by the chunks' headers and rounding, by up to 2x for requests of 16 bytes or
// more (9% for the GGUF test's strings and arrays).
size_t HeapInUse();
#if defined(__SANITIZE_ADDRESS__)
inline constexpr double kHeapEstimateLow = 1.0, kHeapEstimateHigh = 2.0;
#else
inline constexpr double kHeapEstimateLow = 0.98, kHeapEstimateHigh = 1.02;
#endif

}  // namespace nflash::testing
