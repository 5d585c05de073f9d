// A model with an end-of-turn marker it is sure to emit, for the tests of where generation stops: the token greedy
// decoding emits fifth after "Once upon a time", respelled "<|end|>" (Phi-3's marker) with a chosen token type.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include "runtime/core/gguf.h"
#include "runtime/core/thread_pool.h"
#include "runtime/engine/context.h"
#include "runtime/engine/model.h"
#include "runtime/text/tokenizer.h"
#include "tests/test_util.h"

namespace nflash::testing {

inline constexpr char kMarkerPrompt[] = "Once upon a time";

struct MarkedToken {
  int32_t id = -1;      // the token respelled (a normal token of the model)
  int64_t first = -1;   // the greedy step (from 0) at which it first appears
};

// The fifth greedy token of `gguf` after kMarkerPrompt, computed in-process (the dense engine, 1 thread). EXPECT
// failures (and id -1) when the model cannot be run.
inline MarkedToken FifthGreedyToken(const std::string& gguf) {
  MarkedToken m;
  auto model = Model::Load(gguf, {});
  EXPECT_TRUE(model.ok()) << model.status().ToString();
  if (!model.ok()) return m;
  auto tok = LoadTokenizer((*model)->gguf());
  EXPECT_TRUE(tok.ok()) << tok.status().ToString();
  if (!tok.ok()) return m;
  ThreadPool pool(1);
  InferenceContext ctx(**model, &pool, 64);
  EXPECT_TRUE(ctx.Eval((*tok)->Encode(kMarkerPrompt, true), false).ok());
  std::vector<int32_t> greedy;
  for (int i = 0; i < 5; ++i) {
    const float* lg = ctx.logits();
    greedy.push_back(static_cast<int32_t>(std::max_element(lg, lg + ctx.n_vocab()) - lg));
    EXPECT_TRUE(ctx.Eval(std::vector<int32_t>{greedy.back()}, false).ok());
  }
  m.id = greedy[4];
  m.first = std::find(greedy.begin(), greedy.end(), m.id) - greedy.begin();
  return m;
}

// `gguf` written to `out` with token `id` spelled "<|end|>" and typed `type` (llama.cpp's token types: 1 normal,
// 3 control). "" when written, else what failed.
inline std::string RespellAsEndMarker(const std::string& gguf, const std::string& out, int32_t id, int32_t type) {
  return RewriteGguf(
      gguf, out,
      [&](std::vector<std::pair<std::string, GgufValue>>* kv) {
        for (auto& [key, value] : *kv) {
          if (key == "tokenizer.ggml.tokens") {
            std::get<GgufArray>(value.v).items[static_cast<size_t>(id)] = GgufValue(std::string("<|end|>"));
          } else if (key == "tokenizer.ggml.token_type") {
            std::get<GgufArray>(value.v).items[static_cast<size_t>(id)] = GgufValue(type);
          }
        }
      },
      nullptr);
}

}  // namespace nflash::testing
