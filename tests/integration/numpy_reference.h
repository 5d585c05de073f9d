// The independent NumPy reference (tests/reference/llama_numpy.py) from C++ tests: its logits for a GGUF file, and
// how far the engine's are from them. The including test target defines NFLASH_PYTHON and NFLASH_SOURCE_DIR.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "runtime/core/thread_pool.h"
#include "runtime/engine/context.h"
#include "runtime/engine/model.h"
#include "tests/test_util.h"

namespace nflash::testing {

// The token ids the reference comparisons feed (32 tokens of a stories260K text).
inline const std::vector<int32_t> kReferenceIds = {1,   403, 407, 261, 378, 432, 383, 286, 261, 376, 298,
                                                   315, 421, 395, 317, 426, 338, 401, 396, 267, 337, 335,
                                                   311, 267, 422, 419, 269, 344, 444, 427, 421, 414};

// The logits of a reference script (tests/reference/`script` `source`: an F64 forward pass, written as F32 to `npy`)
// for `ids`, n_vocab per token. EXPECT failures when the reference fails or its output is not that size.
inline std::vector<float> ReferenceScriptLogits(const std::string& script, const std::string& source,
                                                const std::vector<int32_t>& ids, int64_t n_vocab,
                                                const std::string& npy) {
  std::string list;
  for (size_t i = 0; i < ids.size(); ++i) list += (i ? "," : "") + std::to_string(ids[i]);
  const CommandResult r = RunCommand(std::string(NFLASH_PYTHON) + " " + NFLASH_SOURCE_DIR + "/tests/reference/" +
                                     script + " " + source + " --tokens " + list + " --dtype f64 --logits-out " + npy);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return ReadNpyF32(npy, ids.size() * static_cast<size_t>(n_vocab));
}

// The GGUF reference's logits (llama_numpy.py) on `gguf`.
inline std::vector<float> NumpyReferenceLogits(const std::string& gguf, const std::vector<int32_t>& ids,
                                               int64_t n_vocab, const std::string& npy) {
  return ReferenceScriptLogits("llama_numpy.py", "--model " + gguf, ids, n_vocab, npy);
}

// The HF-directory reference's logits (hf_numpy.py: transformers' definitions on the safetensors as stored) on the
// model directory `dir`.
inline std::vector<float> HfReferenceLogits(const std::string& dir, const std::vector<int32_t>& ids, int64_t n_vocab,
                                            const std::string& npy) {
  return ReferenceScriptLogits("hf_numpy.py", "--dir " + dir, ids, n_vocab, npy);
}

// The engine's logits for `ids` on `gguf` (2 threads, one batch, a context of max(64, ids) positions) against `ref`:
// the largest difference, and the largest |ref|.
struct LogitGap {
  double max_diff = 0;
  double max_abs = 0;
};
inline LogitGap EngineLogitGap(const std::string& gguf, const std::vector<int32_t>& ids, const std::vector<float>& ref) {
  LogitGap gap;
  auto model = Model::Load(gguf, {});
  EXPECT_TRUE(model.ok()) << model.status().ToString();
  if (!model.ok()) return gap;
  const int64_t nv = (*model)->hparams().n_vocab;
  ThreadPool pool(2);
  InferenceContext ctx(**model, &pool, std::max<int64_t>(64, static_cast<int64_t>(ids.size())));
  EXPECT_TRUE(ctx.Eval(ids, true).ok());
  for (size_t t = 0; t < ids.size(); ++t) {
    for (int64_t v = 0; v < nv; ++v) {
      const double r = ref[t * static_cast<size_t>(nv) + static_cast<size_t>(v)];
      gap.max_diff = std::max(gap.max_diff, std::fabs(double(ctx.logits(int64_t(t))[v]) - r));
      gap.max_abs = std::max(gap.max_abs, std::fabs(r));
    }
  }
  return gap;
}

}  // namespace nflash::testing
