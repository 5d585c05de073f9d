// Slow benchmark test (label slow, not in CI): pack a synthetic llama-7b-shape Q4_0 model, full 32 layers (~3.6 GB),
// with a seeded in-memory profile; verify it; print pack/verify time and MB/s. Synthesizes the model into a temporary
// directory unless `--model=PATH` (an existing `nflash synth --shape llama-7b --type q4_0` file) is given.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <random>

#include "packer/deployment.h"
#include "packer/pack.h"
#include "packer/verify.h"
#include "profiler/profile.h"
#include "runtime/core/checksum.h"
#include "runtime/core/gguf.h"
#include "runtime/core/thread_pool.h"
#include "runtime/engine/model.h"
#include "tests/test_util.h"

namespace nflash::packer {
namespace {

std::string g_model;  // from --model=PATH

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

TEST(PackSlowTest, Llama7bQ4_0Full32Layers) {
  nflash::testing::TempDir tmp;
  std::string model = g_model;
  if (model.empty()) {
    model = tmp.File("llama7b-q4_0.gguf");
    const auto t0 = std::chrono::steady_clock::now();
    auto r = nflash::testing::RunCommand(nflash::testing::NflashBinary() +
                                         " -q synth --shape llama-7b --type q4_0 --activation relu --sparsity 0.9 -o " +
                                         model);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    std::printf("synth: %.1f s\n", Seconds(t0));
  }
  auto gguf = GgufFile::OpenPath(model);
  ASSERT_TRUE(gguf.ok()) << gguf.status().ToString();
  auto hp = ReadLlamaHparams(*gguf);
  ASSERT_TRUE(hp.ok());
  if (g_model.empty()) {
    ASSERT_EQ(hp->n_layers, 32);
  }
  std::printf("model %s: %lld layers\n", model.c_str(), static_cast<long long>(hp->n_layers));
  ASSERT_EQ(hp->dim, 4096);
  // Popularity: a seeded power law (what the synthetic model is built to follow), 16 co-activation partners.
  profiler::ModelProfile p;
  p.model_hash = HashToHex(*HashFile(model));
  p.n_layers = hp->n_layers;
  p.n_ff = hp->n_ff;
  p.dim = hp->dim;
  std::mt19937_64 rng(1);
  for (int64_t l = 0; l < hp->n_layers; ++l) {
    profiler::FfnProfile f;
    f.layer = l;
    f.n_neurons = hp->n_ff;
    f.coact_k = 16;
    for (int64_t i = 0; i < hp->n_ff; ++i) {
      f.count_bs1.push_back(static_cast<uint32_t>(100000.0 / std::pow(1.0 + static_cast<double>(rng() % hp->n_ff), 0.8)));
      for (int j = 0; j < 16; ++j) {
        f.coact_partner.push_back(static_cast<int32_t>(rng() % static_cast<uint64_t>(hp->n_ff)));
        f.coact_count.push_back(1 + static_cast<uint32_t>(rng() % 100));
      }
    }
    f.mean_active_fraction = 0.1;
    p.ffns.push_back(std::move(f));
  }
  ThreadPool pool(2);
  PackOptions o;
  o.hot_fraction = 0.2;
  const std::string dir = tmp.File("deploy");
  auto s = PackDeployment(model, p, "seeded", dir, o, &pool);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  const double written = static_cast<double>(s->flash_bytes + s->resident_bytes);
  std::printf("pack: %.1f s, %.1f MB written (ffn.bin %.1f MB, padding %.1f MB), %.1f MB/s\n", s->seconds, written / 1e6,
              static_cast<double>(s->flash_bytes) / 1e6, static_cast<double>(s->padding_bytes) / 1e6,
              written / 1e6 / s->seconds);
  auto v = VerifyDeployment(dir, false);
  ASSERT_TRUE(v.ok()) << v.status().ToString();
  std::printf("verify: %.1f s, %.1f MB/s\n", v->seconds, static_cast<double>(v->flash_bytes) / 1e6 / v->seconds);
}

}  // namespace
}  // namespace nflash::packer

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--model=", 0) == 0) nflash::packer::g_model = a.substr(8);
  }
  return RUN_ALL_TESTS();
}
