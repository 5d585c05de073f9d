// `nflash bench` pieces without running a model: statistics against hand-computed values, list parsers, the md / csv /
// json formatters, the row JSON round trip, and memory cgroup detection on fake /proc files (and on this machine).
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <cmath>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "converter/readers.h"
#include "runtime/bench/bench_report.h"
#include "runtime/bench/bench_runner.h"
#include "runtime/bench/cgroup.h"
#include "tests/test_util.h"

namespace nflash::bench {
namespace {

TEST(BenchStats, MeanAndSampleSd) {
  // {2, 4, 4, 4, 5, 5, 7, 9}: mean 5, squared deviations sum 32, sample variance 32 / 7.
  const MeanSd m = ComputeMeanSd({2, 4, 4, 4, 5, 5, 7, 9});
  EXPECT_DOUBLE_EQ(m.mean, 5.0);
  EXPECT_NEAR(m.sd, std::sqrt(32.0 / 7.0), 1e-12);
  EXPECT_DOUBLE_EQ(ComputeMeanSd({3.5}).mean, 3.5);
  EXPECT_DOUBLE_EQ(ComputeMeanSd({3.5}).sd, 0.0);
  EXPECT_DOUBLE_EQ(ComputeMeanSd({}).mean, 0.0);
  // {10, 20}: mean 15, sample sd sqrt(50 + 50) / 1 = 7.0710678...
  EXPECT_NEAR(ComputeMeanSd({10, 20}).sd, 7.0710678118654755, 1e-12);
}

TEST(BenchStats, NearestRankPercentiles) {
  // 1..10 shuffled: nearest rank ceil(q * 10): P50 -> 5th = 5, P90 -> 9th = 9, P99 -> 10th = 10.
  const std::vector<double> v = {7, 3, 10, 1, 9, 2, 8, 5, 4, 6};
  EXPECT_DOUBLE_EQ(Percentile(v, 0.50), 5);
  EXPECT_DOUBLE_EQ(Percentile(v, 0.90), 9);
  EXPECT_DOUBLE_EQ(Percentile(v, 0.99), 10);
  EXPECT_DOUBLE_EQ(Percentile(v, 0.0), 1);
  // 100 values 1..100: P99 is the 99th.
  std::vector<double> h;
  for (int i = 100; i >= 1; --i) h.push_back(i);
  EXPECT_DOUBLE_EQ(Percentile(h, 0.99), 99);
  EXPECT_DOUBLE_EQ(Percentile(h, 0.90), 90);
  EXPECT_DOUBLE_EQ(Percentile({}, 0.5), 0);
  EXPECT_DOUBLE_EQ(Percentile({42}, 0.99), 42);
}

TEST(BenchParse, SizeLists) {
  auto v = ParseSizeList("1G,1.5G,800M,4096");
  ASSERT_TRUE(v.ok()) << v.status().ToString();
  ASSERT_EQ(v->size(), 4u);
  EXPECT_EQ((*v)[0], uint64_t{1} << 30);
  EXPECT_EQ((*v)[1], uint64_t{3} << 29);
  EXPECT_EQ((*v)[2], uint64_t{800} << 20);
  EXPECT_EQ((*v)[3], 4096u);
  EXPECT_FALSE(ParseSizeList("1G,,2G").ok());
  EXPECT_FALSE(ParseSizeList("1G,0").ok());
  EXPECT_FALSE(ParseSizeList("lots").ok());
  EXPECT_EQ(ParseSizeList("-1G").status().code(), StatusCode::kInvalidArgument);
}

TEST(BenchParse, TestsAndModes) {
  auto t = ParseTestList("pp128,tg64,pp1");
  ASSERT_TRUE(t.ok());
  ASSERT_EQ(t->size(), 3u);
  EXPECT_FALSE((*t)[0].decode);
  EXPECT_EQ((*t)[0].n_tokens, 128);
  EXPECT_TRUE((*t)[1].decode);
  EXPECT_EQ((*t)[1].n_tokens, 64);
  EXPECT_EQ((*t)[1].Name(), "tg64");
  for (const char* bad : {"pp", "tg0", "xx12", "pp12a", "pp-3", "", "tg99999999999"}) {
    EXPECT_FALSE(ParseBenchTest(bad).ok()) << bad;
  }
  auto m = ParseModeList("full,llmflash,dense-mmap,in-memory");
  ASSERT_TRUE(m.ok());
  EXPECT_EQ((*m)[2], BenchMode::kDenseMmap);
  EXPECT_FALSE(ParseModeList("full,dense").ok());
  EXPECT_EQ(SplitList("a,,b").size(), 3u);
}

RowResult SampleRow(BenchMode mode, bool decode) {
  RowResult r;
  r.spec.model = "/models/x, \"odd\".gguf";
  r.spec.mode = mode;
  r.spec.memory_budget = uint64_t{1} << 30;
  r.spec.offload = 0.5;
  r.spec.test = BenchTest{decode, 16};
  r.tok_s = {10, 20};
  r.speed = ComputeMeanSd(r.tok_s);
  r.p50_ms = 1.25;
  r.p90_ms = 2.5;
  r.p99_ms = 3.75;
  r.hit_rate = 0.875;
  r.hot_hit_rate = 0.75;
  r.cold_hit_rate = 0.9375;
  r.mb_read_per_token = 0.125;
  r.reads_per_token = 12.5;
  r.peak_rss_bytes = 3u << 20;
  r.cpu_util = 1.5;
  r.constraint = "cgroup v1 memory.limit_in_bytes=1.00 GiB";
  return r;
}

using nflash::testing::Lines;

TEST(BenchFormat, Markdown) {
  RowResult failed = SampleRow(BenchMode::kFull, false);
  failed.status = "unavailable: no --deploy directory for this model (a|b)";
  const std::string md = FormatMarkdown({SampleRow(BenchMode::kDenseMmap, true), failed});
  const std::vector<std::string> lines = Lines(md);
  ASSERT_EQ(lines.size(), 4u) << md;
  EXPECT_EQ(lines[0].rfind("| model | mode | memory | test | t/s |", 0), 0u) << lines[0];
  // Every line has the same number of cells (16 columns -> 17 bars not escaped as "\|").
  for (const std::string& l : lines) {
    int bars = 0;
    for (size_t i = 0; i < l.size(); ++i) bars += l[i] == '|' && (i == 0 || l[i - 1] != '\\');
    EXPECT_EQ(bars, 17) << l;
  }
  EXPECT_NE(lines[2].find("| dense-mmap | 1.00 GiB (offload 0.50) | tg16 | 15.00 ± 7.07 | 1.25 | 2.50 | 3.75 | 0.875 |"),
            std::string::npos)
      << lines[2];
  EXPECT_NE(lines[2].find("| 150% |"), std::string::npos) << lines[2];
  EXPECT_NE(lines[3].find("unavailable: no --deploy directory for this model (a\\|b)"), std::string::npos) << lines[3];
}

TEST(BenchFormat, CsvQuotesAndColumns) {
  const std::string csv = FormatCsv({SampleRow(BenchMode::kInMemory, false)});
  std::istringstream in(csv);
  std::string header, row;
  std::getline(in, header);
  std::getline(in, row);
  EXPECT_EQ(header.rfind("model,mode,memory_budget_bytes,", 0), 0u);
  const size_t n_header = static_cast<size_t>(std::count(header.begin(), header.end(), ',')) + 1;
  EXPECT_EQ(n_header, 26u);
  EXPECT_NE(header.find(",hit_rate,hot_hit_rate,cold_hit_rate,miss_rate_mean,"), std::string::npos) << header;
  // The model basename has a comma and quotes: one quoted field, quotes doubled.
  EXPECT_EQ(row.rfind("\"x, \"\"odd\"\".gguf\",in-memory,1073741824,0.500,pp16,16,", 0), 0u) << row;
  EXPECT_NE(row.find(",15.0000,7.0711,"), std::string::npos) << row;
  EXPECT_NE(row.find(",0.8750,0.7500,0.9375,"), std::string::npos) << row;
  EXPECT_EQ(row.substr(row.size() - 3), ",ok");
}

TEST(BenchFormat, JsonRoundTrip) {
  RowResult r = SampleRow(BenchMode::kLlmFlash, true);
  r.spec.kv_type = "f16";
  const auto j = nlohmann::json::parse(FormatJson({r}));
  ASSERT_TRUE(j.is_array());
  ASSERT_EQ(j.size(), 1u);
  EXPECT_EQ(j[0]["mode"], "llmflash");
  EXPECT_EQ(j[0]["test"], "tg16");
  EXPECT_DOUBLE_EQ(j[0]["tok_s_mean"].get<double>(), 15.0);
  auto back = RowResult::FromJson(j[0]);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->spec.model, r.spec.model);
  EXPECT_EQ(back->spec.memory_budget, r.spec.memory_budget);
  EXPECT_EQ(back->spec.test.n_tokens, 16);
  EXPECT_TRUE(back->spec.test.decode);
  EXPECT_DOUBLE_EQ(back->p99_ms, 3.75);
  EXPECT_EQ(back->tok_s, r.tok_s);
  EXPECT_EQ(back->constraint, r.constraint);
  EXPECT_EQ(back->spec.kv_type, "f16");
  EXPECT_EQ(RowSpec::FromJson(nlohmann::json{{"model", "m"}, {"mode", "full"}, {"test", "tg1"}})->kv_type, "f32");
  EXPECT_FALSE(RowSpec::FromJson(nlohmann::json{{"model", "m"}, {"mode", "warp"}, {"test", "tg1"}}).ok());
  EXPECT_FALSE(RowSpec::FromJson(nlohmann::json{{"mode", "full"}}).ok());
}

// Every field of a row survives the JSON the row's child process prints and the parent reads back
// (RowResult::ToJson / FromJson): each set to a value no default has, and checked one by one.
TEST(BenchFormat, JsonRoundTripKeepsEveryField) {
  RowResult r;
  RowSpec& s = r.spec;
  s.model = "m.gguf";
  s.deploy = "d.deploy";
  s.tokenizer = "tok.bin";
  s.activation = "relu";
  s.mode = BenchMode::kBundles;
  s.memory_budget = 123456789;
  s.offload = 0.375;
  s.test = BenchTest{true, 7};
  s.prompt_tokens = 11;
  s.repetitions = 5;
  s.warmup = 3;
  s.threads = 6;
  s.use_cgroup = false;
  s.drop_all_caches = true;
  s.hw = "hw.json";
  s.lookahead = 42;
  s.kv_type = "f16";
  r.status = "error: x";
  r.tok_s = {1.5, 2.5, 3.5};
  r.speed = {2.25, 0.125};  // not what the samples give: the stored figures are read back, not recomputed
  r.p50_ms = 4.5;
  r.p90_ms = 5.5;
  r.p99_ms = 6.5;
  r.hit_rate = 0.625;
  r.hot_hit_rate = 0.5;
  r.cold_hit_rate = 0.8125;
  r.mb_read_per_token = 7.25;
  r.reads_per_token = 8.75;
  r.miss_rate_mean = 0.0625;
  r.miss_rate_p99 = 0.1875;
  r.peak_rss_bytes = 987654321;
  r.cgroup_peak_bytes = 876543210;
  r.cpu_util = 1.75;
  r.constraint = "runtime budget";
  r.floor_compute_ms = 9.25;
  r.floor_io_ms = 10.75;
  r.floor_ratio = 1.3125;
  auto back = RowResult::FromJson(nlohmann::json::parse(r.ToJson().dump()));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  const RowSpec& b = back->spec;
  EXPECT_EQ(b.model, "m.gguf");
  EXPECT_EQ(b.deploy, "d.deploy");
  EXPECT_EQ(b.tokenizer, "tok.bin");
  EXPECT_EQ(b.activation, "relu");
  EXPECT_EQ(b.mode, BenchMode::kBundles);
  EXPECT_EQ(b.memory_budget, 123456789u);
  EXPECT_EQ(b.offload, 0.375);
  EXPECT_TRUE(b.test.decode);
  EXPECT_EQ(b.test.n_tokens, 7);
  EXPECT_EQ(b.prompt_tokens, 11);
  EXPECT_EQ(b.repetitions, 5);
  EXPECT_EQ(b.warmup, 3);
  EXPECT_EQ(b.threads, 6);
  EXPECT_FALSE(b.use_cgroup);
  EXPECT_TRUE(b.drop_all_caches);
  EXPECT_EQ(b.hw, "hw.json");
  EXPECT_EQ(b.lookahead, 42);
  EXPECT_EQ(b.kv_type, "f16");
  EXPECT_EQ(back->status, "error: x");
  EXPECT_EQ(back->tok_s, r.tok_s);
  EXPECT_EQ(back->speed.mean, 2.25);
  EXPECT_EQ(back->speed.sd, 0.125);
  EXPECT_EQ(back->p50_ms, 4.5);
  EXPECT_EQ(back->p90_ms, 5.5);
  EXPECT_EQ(back->p99_ms, 6.5);
  EXPECT_EQ(back->hit_rate, 0.625);
  EXPECT_EQ(back->hot_hit_rate, 0.5);
  EXPECT_EQ(back->cold_hit_rate, 0.8125);
  EXPECT_EQ(back->mb_read_per_token, 7.25);
  EXPECT_EQ(back->reads_per_token, 8.75);
  EXPECT_EQ(back->miss_rate_mean, 0.0625);
  EXPECT_EQ(back->miss_rate_p99, 0.1875);
  EXPECT_EQ(back->peak_rss_bytes, 987654321u);
  EXPECT_EQ(back->cgroup_peak_bytes, 876543210u);
  EXPECT_EQ(back->cpu_util, 1.75);
  EXPECT_EQ(back->constraint, "runtime budget");
  EXPECT_EQ(back->floor_compute_ms, 9.25);
  EXPECT_EQ(back->floor_io_ms, 10.75);
  EXPECT_EQ(back->floor_ratio, 1.3125);

  // Absent fields take the documented defaults ("not applicable" is -1 for rates and floors).
  auto bare = RowResult::FromJson(nlohmann::json{{"model", "m"}, {"mode", "full"}, {"test", "pp4"}, {"status", "ok"}});
  ASSERT_TRUE(bare.ok()) << bare.status().ToString();
  EXPECT_EQ(bare->spec.threads, 2);
  EXPECT_EQ(bare->spec.warmup, 1);
  EXPECT_EQ(bare->spec.repetitions, 3);
  EXPECT_EQ(bare->spec.prompt_tokens, 32);
  EXPECT_EQ(bare->spec.lookahead, -1);
  EXPECT_EQ(bare->spec.offload, -1.0);
  EXPECT_TRUE(bare->spec.use_cgroup);
  EXPECT_FALSE(bare->spec.drop_all_caches);
  EXPECT_EQ(bare->hit_rate, -1.0);
  EXPECT_EQ(bare->hot_hit_rate, -1.0);
  EXPECT_EQ(bare->cold_hit_rate, -1.0);
  EXPECT_EQ(bare->miss_rate_mean, -1.0);
  EXPECT_FALSE(bare->has_floors());
  // A row spec with no warmup or repetitions to run is refused, naming the field.
  for (const auto& [key, value] : {std::pair{"warmup", -1}, {"repetitions", 0}}) {
    nlohmann::json j = {{"model", "m"}, {"mode", "full"}, {"test", "tg1"}};
    j[key] = value;
    auto bad = RowSpec::FromJson(j);
    ASSERT_FALSE(bad.ok()) << key;
    EXPECT_NE(bad.status().ToString().find(key), std::string::npos) << bad.status().ToString();
    j[key] = value + 1;
    EXPECT_TRUE(RowSpec::FromJson(j).ok()) << key;
  }
}

// Splits a markdown table line into its cells (escaped bars stay inside a cell).
std::vector<std::string> MdCells(const std::string& line) {
  std::vector<std::string> cells;
  std::string cur;
  for (size_t i = 1; i < line.size(); ++i) {
    if (line[i] == '|' && line[i - 1] != '\\') {
      cells.push_back(cur.substr(1, cur.size() - 2));  // " text " -> "text"
      cur.clear();
    } else {
      cur += line[i];
    }
  }
  return cells;
}

TEST(BenchFormat, MarkdownColumnsDashesAndFloors) {
  // A decode row with floors, a prefill row without a budget, rates or floors (dense), both ok.
  RowResult tg = SampleRow(BenchMode::kFull, true);
  tg.miss_rate_mean = 0.07;
  tg.miss_rate_p99 = 0.25;
  tg.floor_compute_ms = 2.0;
  tg.floor_io_ms = 3.0;
  tg.floor_ratio = 1.5;
  RowResult pp = SampleRow(BenchMode::kDenseMmap, false);
  pp.spec.memory_budget = 0;
  pp.hit_rate = -1;
  const std::vector<std::string> lines = Lines(FormatMarkdown({tg, pp}));
  ASSERT_EQ(lines.size(), 4u);
  const std::vector<std::string> header = MdCells(lines[0]);
  const std::vector<std::string> want_header = {
      "model",    "mode",        "memory",         "test",     "t/s",              "P50 ms",       "P90 ms",  "P99 ms",
      "hit rate", "miss/tok mean", "miss/tok P99", "MB/tok",   "reads/tok",        "peak RSS",     "CPU",
      "compute floor ms", "I/O floor ms", "x floor", "constraint"};
  EXPECT_EQ(header, want_header);
  // Text columns (the first four and the constraint) left-aligned, numbers right-aligned.
  const std::vector<std::string> align = MdCells(lines[1]);
  ASSERT_EQ(align.size(), want_header.size());
  for (size_t i = 0; i < align.size(); ++i) {
    EXPECT_EQ(align[i], i < 4 || i + 1 == align.size() ? "---" : "---:") << want_header[i];
  }
  const std::vector<std::string> a = MdCells(lines[2]);
  const std::vector<std::string> want_a = {
      "x, \"odd\".gguf", "full", "1.00 GiB (offload 0.50)", "tg16", "15.00 ± 7.07", "1.25", "2.50", "3.75", "0.875",
      "0.070", "0.250", "0.125", "12.5", "3.00 MiB", "150%", "2.000", "3.000", "1.50",
      "cgroup v1 memory.limit_in_bytes=1.00 GiB"};
  EXPECT_EQ(a, want_a);
  // The prefill row: no latency percentiles, no rates, no budget, no floors.
  const std::vector<std::string> b = MdCells(lines[3]);
  ASSERT_EQ(b.size(), want_header.size());
  EXPECT_EQ(b[2], "-");
  for (size_t i : {5u, 6u, 7u, 8u, 9u, 10u, 15u, 16u, 17u}) EXPECT_EQ(b[i], "-") << want_header[i];
  // A budget not derived from --offload names no fraction.
  pp.spec.memory_budget = uint64_t{3} << 20;
  pp.spec.offload = -1;
  EXPECT_EQ(MdCells(Lines(FormatMarkdown({pp}))[2])[2], "3.00 MiB");
  // Without any row with floors, no floor columns at all.
  EXPECT_EQ(MdCells(Lines(FormatMarkdown({pp}))[0]).size(), want_header.size() - 3);
}

TEST(BenchFormat, CsvFloorsAndQuotedLines) {
  RowResult r = SampleRow(BenchMode::kFull, true);
  r.floor_compute_ms = 2.5;
  r.floor_io_ms = 4.25;
  r.floor_ratio = 1.125;
  r.status = "error: two\nlines";
  const std::string csv = FormatCsv({r});
  EXPECT_NE(csv.find(",constraint,status,floor_compute_ms,floor_io_ms,floor_ratio\n"), std::string::npos) << csv;
  // A field with a line break is quoted, so the row stays one record.
  EXPECT_NE(csv.find(",\"error: two\nlines\",2.500000,4.250000,1.1250\n"), std::string::npos) << csv;
}

TEST(BenchParse, ListItemsIncludeEmptyOnes) {
  EXPECT_EQ(SplitList("a,"), (std::vector<std::string>{"a", ""}));
  EXPECT_EQ(SplitList(""), (std::vector<std::string>{""}));
  EXPECT_EQ(SplitList("x"), (std::vector<std::string>{"x"}));
  EXPECT_FALSE(ParseModeList("full,").ok());
  EXPECT_FALSE(ParseTestList("tg4,").ok());
  EXPECT_FALSE(ParseSizeList("1G,").ok());
}

// A fake /proc/self/mountinfo + /proc/self/cgroup pointing at directories in a TempDir.
struct FakeCgroupFs {
  testing::TempDir dir;
  std::string mountinfo, self_cgroup;
  explicit FakeCgroupFs(const std::string& mounts, const std::string& groups) {
    mountinfo = dir.File("mountinfo");
    self_cgroup = dir.File("cgroup");
    testing::WriteText(mountinfo, mounts);
    testing::WriteText(self_cgroup, groups);
  }
};

TEST(BenchCgroup, DetectsV1MemoryHierarchy) {
  testing::TempDir root;
  const std::string mem = root.File("memory");
  ASSERT_EQ(::mkdir(mem.c_str(), 0755), 0);
  ASSERT_EQ(::mkdir((mem + "/job").c_str(), 0755), 0);
  testing::WriteText(mem + "/job/memory.limit_in_bytes", "9223372036854771712\n");
  FakeCgroupFs fs("30 25 0:26 / " + mem + " rw,relatime shared:9 - cgroup cgroup rw,memory\n"
                  "31 25 0:27 / " + root.File("cpu") + " rw,relatime - cgroup cgroup rw,cpu\n",
                  "4:memory:/job\n1:cpu:/\n0::/\n");
  const CgroupSupport s = DetectMemoryCgroup(fs.mountinfo, fs.self_cgroup);
  EXPECT_EQ(s.version, CgroupVersion::kV1) << s.reason;
  EXPECT_EQ(s.parent_dir, mem + "/job");
}

TEST(BenchCgroup, DetectsDelegatedV2) {
  testing::TempDir root;
  const std::string grp = root.File("user.slice");
  ASSERT_EQ(::mkdir(grp.c_str(), 0755), 0);
  testing::WriteText(root.File("cgroup.controllers"), "cpuset cpu io memory pids\n");
  testing::WriteText(root.File("cgroup.subtree_control"), "cpu\n");
  testing::WriteText(grp + "/cgroup.subtree_control", "cpu memory\n");
  FakeCgroupFs fs("22 1 0:21 / " + root.path() + " rw - cgroup2 cgroup2 rw,nsdelegate\n", "0::/user.slice\n");
  const CgroupSupport s = DetectMemoryCgroup(fs.mountinfo, fs.self_cgroup);
  EXPECT_EQ(s.version, CgroupVersion::kV2) << s.reason;
  EXPECT_EQ(s.parent_dir, grp);
}

TEST(BenchCgroup, UnavailableGivesAReasonNotACrash) {
  // No memory controller anywhere.
  testing::TempDir root;
  testing::WriteText(root.File("cgroup.controllers"), "cpu pids\n");
  FakeCgroupFs fs("22 1 0:21 / " + root.path() + " rw - cgroup2 cgroup2 rw\n", "0::/\n");
  CgroupSupport s = DetectMemoryCgroup(fs.mountinfo, fs.self_cgroup);
  EXPECT_EQ(s.version, CgroupVersion::kNone);
  EXPECT_NE(s.reason.find("no memory controller"), std::string::npos) << s.reason;
  // Missing and garbage files.
  s = DetectMemoryCgroup(root.File("absent"), root.File("absent2"));
  EXPECT_EQ(s.version, CgroupVersion::kNone);
  EXPECT_FALSE(s.reason.empty());
  FakeCgroupFs junk("garbage\n- - -\n\n1 2 3\n", "::::\nnonsense\n");
  s = DetectMemoryCgroup(junk.mountinfo, junk.self_cgroup);
  EXPECT_EQ(s.version, CgroupVersion::kNone);
  EXPECT_FALSE(s.reason.empty());
  // Creating a group without support is an error, not a crash.
  EXPECT_FALSE(MemoryCgroup::Create(s, "x", 1 << 20).ok());
}

TEST(BenchCgroup, ThisMachineDetectsWithoutCrashing) {
  const CgroupSupport s = DetectMemoryCgroup();
  if (s.version == CgroupVersion::kNone) {
    EXPECT_FALSE(s.reason.empty());
  } else {
    EXPECT_FALSE(s.parent_dir.empty());
  }
}

// Runs `bytes` of touched anonymous memory in a child process moved into `cg` first; returns its wait status.
int RunChildInCgroup(const MemoryCgroup& cg, size_t bytes) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    if (!cg.AddProcess(::getpid()).ok()) ::_exit(3);
    volatile char* p = static_cast<char*>(std::malloc(bytes));  // volatile: every page is really touched
    if (p == nullptr) ::_exit(4);
    for (size_t i = 0; i < bytes; i += 4096) p[i] = 1;
    ::_exit(0);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return status;
}

// On this machine's own memory cgroup, when it has one we may use (root, v1 or delegated v2; otherwise skipped, with
// the reason): the group gets the limit, the process moved into it is held to it (no swap here: a child touching twice
// the limit is killed, one touching an eighth of it exits normally), and the recorded peak covers what it touched.
TEST(BenchCgroup, TheLimitHoldsTheProcessMovedIntoTheGroup) {
  const CgroupSupport s = DetectMemoryCgroup();
  if (s.version == CgroupVersion::kNone) GTEST_SKIP() << "no usable memory cgroup here: " << s.reason;
  std::ifstream swaps("/proc/swaps");
  std::string line;
  int swap_lines = 0;
  while (std::getline(swaps, line)) ++swap_lines;
  if (swap_lines > 1) GTEST_SKIP() << "swap is on: a process over the limit would swap, not be killed";
  const uint64_t limit = uint64_t{64} << 20;
  EXPECT_EQ(MemoryCgroup::Create(s, "nflash-test-zero", 0).status().code(), StatusCode::kInvalidArgument);
  auto cg = MemoryCgroup::Create(s, "nflash-test-" + std::to_string(::getpid()), limit);
  ASSERT_TRUE(cg.ok()) << cg.status().ToString();
  const std::string limit_file =
      (*cg)->dir() + (s.version == CgroupVersion::kV2 ? "/memory.max" : "/memory.limit_in_bytes");
  EXPECT_EQ(std::stoull(testing::ReadText(limit_file)), limit);
  const char* want = s.version == CgroupVersion::kV2 ? "cgroup v2 memory.max=64.00 MiB"
                                                     : "cgroup v1 memory.limit_in_bytes=64.00 MiB";
  EXPECT_EQ((*cg)->Describe(), want);
  const int small = RunChildInCgroup(**cg, limit / 8);
  ASSERT_TRUE(WIFEXITED(small)) << small;
  EXPECT_EQ(WEXITSTATUS(small), 0);
  EXPECT_GE((*cg)->PeakBytes(), limit / 8);
  EXPECT_LE((*cg)->PeakBytes(), limit);
  const int big = RunChildInCgroup(**cg, 2 * limit);
  ASSERT_TRUE(WIFSIGNALED(big)) << "a child touching twice the limit was not killed: status " << big;
  EXPECT_EQ(WTERMSIG(big), SIGKILL);
  EXPECT_LE((*cg)->PeakBytes(), limit);
  const std::string dir = (*cg)->dir();
  cg->reset();
  EXPECT_FALSE(std::filesystem::exists(dir)) << "the group is removed with its object";
}

TEST(BenchCgroup, DropFileCache) {
  testing::TempDir dir;
  testing::WriteText(dir.File("f"), std::string(8192, 'x'));
  EXPECT_TRUE(DropFileCache(dir.File("f")).ok());
  EXPECT_FALSE(DropFileCache(dir.File("missing")).ok());
}

// bench's --offload budget counts the KV cache as the engine holds it: under a sliding window of 70, a ring of 192
// positions (70 + 64 rounded up to blocks of 64) instead of the 320 asked for.
TEST(BenchBudget, SlidingWindowCountsTheKvRing) {
  testing::TempDir tmp;
  const std::string plain = tmp.File("plain.gguf"), windowed = tmp.File("windowed.gguf");
  auto source = converter::ReadLlama2c(testing::SharedPath("models/stories260K/stories260K.bin"),
                                       testing::SharedPath("models/stories260K/tok512.bin"),
                                       converter::FfnActivation::kSilu);
  ASSERT_TRUE(source.ok()) << source.status().ToString();
  converter::WriteOptions options;
  options.path = plain;
  options.type = GgmlType::kF32;
  options.progress = false;
  ASSERT_TRUE(converter::WriteModelGguf(*source, options).ok());
  ASSERT_EQ(testing::RewriteGguf(plain, windowed,
                                 testing::SetGgufKey("llama.attention.sliding_window", GgufValue(uint32_t{70})),
                                 nullptr),
            "");
  RowSpec spec;
  spec.model = plain;
  auto full = OffloadBudget(spec, 0.5, 320);
  spec.model = windowed;
  auto ring = OffloadBudget(spec, 0.5, 320);
  ASSERT_TRUE(full.ok()) << full.status().ToString();
  ASSERT_TRUE(ring.ok()) << ring.status().ToString();
  // 5 layers x (320 - 192) positions x kv_dim 32 x (k and v) x 4 bytes (stories260K: 8 heads of 8, 4 KV heads).
  EXPECT_EQ(*full - *ring, uint64_t{5} * 128 * 32 * 2 * 4);
}

}  // namespace
}  // namespace nflash::bench
