// Row specification, statistics, list parsing and the md / json / csv formatters of `nflash bench` (see
// bench_report.h).
#include "runtime/bench/bench_report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "runtime/sparse/memory_budget.h"

namespace nflash::bench {
namespace {

std::string Basename(const std::string& path) {
  const size_t s = path.find_last_of('/');
  return s == std::string::npos ? path : path.substr(s + 1);
}

std::string Fixed(double v, int decimals) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", decimals, v);
  return buf;
}

std::string CsvField(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) {
    if (c == '"') out += '"';
    out += c;
  }
  return out + "\"";
}

// A markdown cell: a '|' inside (an error message) would end the cell.
std::string MdCell(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '|') out += '\\';
    out += c;
  }
  return out;
}

std::string MemoryColumn(const RowSpec& s) {
  if (s.memory_budget == 0) return "-";
  std::string m = sparse::FormatBytes(s.memory_budget);
  if (s.offload >= 0) m += " (offload " + Fixed(s.offload, 2) + ")";
  return m;
}

}  // namespace

const char* BenchModeName(BenchMode mode) {
  switch (mode) {
    case BenchMode::kFull: return "full";
    case BenchMode::kLlmFlash: return "llmflash";
    case BenchMode::kDenseMmap: return "dense-mmap";
    case BenchMode::kInMemory: return "in-memory";
    case BenchMode::kBundles: return "bundles";
  }
  return "?";
}

Result<BenchMode> ParseBenchMode(std::string_view name) {
  for (BenchMode m :
       {BenchMode::kFull, BenchMode::kLlmFlash, BenchMode::kDenseMmap, BenchMode::kInMemory, BenchMode::kBundles}) {
    if (name == BenchModeName(m)) return m;
  }
  return Status::InvalidArgument("--modes: unknown mode '" + std::string(name) +
                                 "' (expected full, llmflash, dense-mmap, in-memory or bundles)");
}

Result<BenchTest> ParseBenchTest(std::string_view text) {
  const std::string t(text);
  BenchTest out;
  if (t.size() > 2 && (t.rfind("pp", 0) == 0 || t.rfind("tg", 0) == 0)) {
    out.decode = t[0] == 't';
    const std::string digits = t.substr(2);
    if (std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }) && digits.size() < 10) {
      out.n_tokens = std::stoll(digits);
      if (out.n_tokens > 0) return out;
    }
  }
  return Status::InvalidArgument("--tests: '" + t + "' is not a test (expected ppN or tgN with N > 0, e.g. pp128, tg64)");
}

std::vector<std::string> SplitList(std::string_view text) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = text.find(',', start);
    const size_t end = comma == std::string_view::npos ? text.size() : comma;
    out.emplace_back(text.substr(start, end - start));
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  return out;
}

Result<std::vector<BenchMode>> ParseModeList(std::string_view text) {
  std::vector<BenchMode> out;
  for (const std::string& item : SplitList(text)) {
    NF_ASSIGN_OR_RETURN(BenchMode m, ParseBenchMode(item));
    out.push_back(m);
  }
  return out;
}

Result<std::vector<BenchTest>> ParseTestList(std::string_view text) {
  std::vector<BenchTest> out;
  for (const std::string& item : SplitList(text)) {
    NF_ASSIGN_OR_RETURN(BenchTest t, ParseBenchTest(item));
    out.push_back(t);
  }
  return out;
}

Result<std::vector<uint64_t>> ParseSizeList(std::string_view text) {
  std::vector<uint64_t> out;
  for (const std::string& item : SplitList(text)) {
    if (item.empty()) return Status::InvalidArgument("--memory: empty item in '" + std::string(text) + "'");
    NF_ASSIGN_OR_RETURN(uint64_t v, sparse::ParseMemorySize(item));
    if (v == 0) return Status::InvalidArgument("--memory: '" + item + "' is zero; give a budget or leave --memory out");
    out.push_back(v);
  }
  return out;
}

MeanSd ComputeMeanSd(const std::vector<double>& v) {
  MeanSd out;
  if (v.empty()) return out;
  double sum = 0;
  for (double x : v) sum += x;
  out.mean = sum / static_cast<double>(v.size());
  if (v.size() < 2) return out;
  double ss = 0;
  for (double x : v) ss += (x - out.mean) * (x - out.mean);
  out.sd = std::sqrt(ss / static_cast<double>(v.size() - 1));
  return out;
}

nlohmann::json RowSpec::ToJson() const {
  return {{"model", model},
          {"deploy", deploy},
          {"tokenizer", tokenizer},
          {"activation", activation},
          {"mode", BenchModeName(mode)},
          {"memory_budget", memory_budget},
          {"offload", offload},
          {"test", test.Name()},
          {"prompt_tokens", prompt_tokens},
          {"repetitions", repetitions},
          {"warmup", warmup},
          {"threads", threads},
          {"use_cgroup", use_cgroup},
          {"drop_all_caches", drop_all_caches},
          {"hw", hw},
          {"lookahead", lookahead},
          {"kv_type", kv_type}};
}

Result<RowSpec> RowSpec::FromJson(const nlohmann::json& j) {
  RowSpec s;
  try {
    s.model = j.at("model").get<std::string>();
    s.deploy = j.value("deploy", "");
    s.tokenizer = j.value("tokenizer", "");
    s.activation = j.value("activation", "");
    NF_ASSIGN_OR_RETURN(s.mode, ParseBenchMode(j.at("mode").get<std::string>()));
    s.memory_budget = j.value("memory_budget", uint64_t{0});
    s.offload = j.value("offload", -1.0);
    NF_ASSIGN_OR_RETURN(s.test, ParseBenchTest(j.at("test").get<std::string>()));
    s.prompt_tokens = j.value("prompt_tokens", int64_t{32});
    s.repetitions = j.value("repetitions", 3);
    s.warmup = j.value("warmup", 1);
    s.threads = j.value("threads", 2);
    s.use_cgroup = j.value("use_cgroup", true);
    s.drop_all_caches = j.value("drop_all_caches", false);
    s.hw = j.value("hw", "");
    s.lookahead = j.value("lookahead", int64_t{-1});
    s.kv_type = j.value("kv_type", std::string("f32"));
  } catch (const nlohmann::json::exception& e) {
    return Status::InvalidArgument(std::string("bench row spec: ") + e.what());
  }
  if (s.warmup < 0) return Status::InvalidArgument("bench row spec: warmup must be >= 0");
  if (s.repetitions < 1) return Status::InvalidArgument("bench row spec: repetitions must be >= 1");
  return s;
}

nlohmann::json RowResult::ToJson() const {
  nlohmann::json j = spec.ToJson();
  j["model_name"] = Basename(spec.model);
  j["n_tokens"] = spec.test.n_tokens;
  j["status"] = status;
  j["tok_s"] = tok_s;
  j["tok_s_mean"] = speed.mean;
  j["tok_s_sd"] = speed.sd;
  j["token_ms_p50"] = p50_ms;
  j["token_ms_p90"] = p90_ms;
  j["token_ms_p99"] = p99_ms;
  j["hit_rate"] = hit_rate;
  j["hot_hit_rate"] = hot_hit_rate;
  j["cold_hit_rate"] = cold_hit_rate;
  j["mb_read_per_token"] = mb_read_per_token;
  j["reads_per_token"] = reads_per_token;
  j["miss_rate_mean"] = miss_rate_mean;
  j["miss_rate_p99"] = miss_rate_p99;
  j["peak_rss_bytes"] = peak_rss_bytes;
  j["cgroup_peak_bytes"] = cgroup_peak_bytes;
  j["cpu_util"] = cpu_util;
  j["constraint"] = constraint;
  j["floor_compute_ms"] = floor_compute_ms;
  j["floor_io_ms"] = floor_io_ms;
  j["floor_ratio"] = floor_ratio;
  return j;
}

Result<RowResult> RowResult::FromJson(const nlohmann::json& j) {
  RowResult r;
  NF_ASSIGN_OR_RETURN(r.spec, RowSpec::FromJson(j));
  try {
    r.status = j.at("status").get<std::string>();
    r.tok_s = j.value("tok_s", std::vector<double>{});
    r.speed.mean = j.value("tok_s_mean", 0.0);
    r.speed.sd = j.value("tok_s_sd", 0.0);
    r.p50_ms = j.value("token_ms_p50", 0.0);
    r.p90_ms = j.value("token_ms_p90", 0.0);
    r.p99_ms = j.value("token_ms_p99", 0.0);
    r.hit_rate = j.value("hit_rate", -1.0);
    r.hot_hit_rate = j.value("hot_hit_rate", -1.0);
    r.cold_hit_rate = j.value("cold_hit_rate", -1.0);
    r.mb_read_per_token = j.value("mb_read_per_token", 0.0);
    r.reads_per_token = j.value("reads_per_token", 0.0);
    r.miss_rate_mean = j.value("miss_rate_mean", -1.0);
    r.miss_rate_p99 = j.value("miss_rate_p99", -1.0);
    r.peak_rss_bytes = j.value("peak_rss_bytes", uint64_t{0});
    r.cgroup_peak_bytes = j.value("cgroup_peak_bytes", uint64_t{0});
    r.cpu_util = j.value("cpu_util", 0.0);
    r.constraint = j.value("constraint", "-");
    r.floor_compute_ms = j.value("floor_compute_ms", -1.0);
    r.floor_io_ms = j.value("floor_io_ms", -1.0);
    r.floor_ratio = j.value("floor_ratio", -1.0);
  } catch (const nlohmann::json::exception& e) {
    return Status::InvalidArgument(std::string("bench row result: ") + e.what());
  }
  return r;
}

namespace {
bool AnyFloors(const std::vector<RowResult>& rows) {
  return std::any_of(rows.begin(), rows.end(), [](const RowResult& r) { return r.has_floors(); });
}
}  // namespace

std::string FormatMarkdown(const std::vector<RowResult>& rows) {
  const bool floors = AnyFloors(rows);
  std::vector<std::string> header = {"model", "mode", "memory", "test", "t/s", "P50 ms", "P90 ms", "P99 ms",
                                     "hit rate", "miss/tok mean", "miss/tok P99", "MB/tok", "reads/tok",
                                     "peak RSS", "CPU", "constraint"};
  if (floors) header.insert(header.end() - 1, {"compute floor ms", "I/O floor ms", "x floor"});
  std::vector<std::vector<std::string>> cells;
  for (const RowResult& r : rows) {
    const RowSpec& s = r.spec;
    std::vector<std::string> c = {Basename(s.model), BenchModeName(s.mode), MemoryColumn(s), s.test.Name()};
    if (!r.ok()) {
      c.push_back(r.status);
      for (size_t i = c.size(); i + 1 < header.size(); ++i) c.push_back("");
      c.push_back(r.constraint);
    } else {
      c.push_back(Fixed(r.speed.mean, 2) + " ± " + Fixed(r.speed.sd, 2));
      const bool tg = s.test.decode;
      c.push_back(tg ? Fixed(r.p50_ms, 2) : "-");
      c.push_back(tg ? Fixed(r.p90_ms, 2) : "-");
      c.push_back(tg ? Fixed(r.p99_ms, 2) : "-");
      c.push_back(r.hit_rate < 0 ? "-" : Fixed(r.hit_rate, 3));
      c.push_back(r.miss_rate_mean < 0 ? "-" : Fixed(r.miss_rate_mean, 3));
      c.push_back(r.miss_rate_p99 < 0 ? "-" : Fixed(r.miss_rate_p99, 3));
      c.push_back(Fixed(r.mb_read_per_token, 3));
      c.push_back(Fixed(r.reads_per_token, 1));
      c.push_back(sparse::FormatBytes(r.peak_rss_bytes));
      c.push_back(Fixed(r.cpu_util * 100.0, 0) + "%");
      if (floors) {
        c.push_back(r.has_floors() ? Fixed(r.floor_compute_ms, 3) : "-");
        c.push_back(r.has_floors() ? Fixed(r.floor_io_ms, 3) : "-");
        c.push_back(r.has_floors() ? Fixed(r.floor_ratio, 2) : "-");
      }
      c.push_back(r.constraint);
    }
    cells.push_back(std::move(c));
  }
  std::string out = "|";
  for (const std::string& h : header) out += " " + h + " |";
  out += "\n|";
  for (size_t i = 0; i < header.size(); ++i) out += i < 4 || i == header.size() - 1 ? " --- |" : " ---: |";
  out += "\n";
  for (const auto& c : cells) {
    out += "|";
    for (const std::string& v : c) out += " " + MdCell(v) + " |";
    out += "\n";
  }
  return out;
}

std::string FormatJson(const std::vector<RowResult>& rows) {
  nlohmann::json a = nlohmann::json::array();
  for (const RowResult& r : rows) a.push_back(r.ToJson());
  return a.dump(2) + "\n";
}

std::string FormatCsv(const std::vector<RowResult>& rows) {
  std::string out =
      "model,mode,memory_budget_bytes,offload,test,n_tokens,prompt_tokens,repetitions,threads,tok_s_mean,tok_s_sd,"
      "token_ms_p50,token_ms_p90,token_ms_p99,hit_rate,hot_hit_rate,cold_hit_rate,miss_rate_mean,miss_rate_p99,"
      "mb_read_per_token,reads_per_token,"
      "peak_rss_bytes,"
      "cgroup_peak_bytes,cpu_util,constraint,status";
  const bool floors = AnyFloors(rows);
  out += floors ? ",floor_compute_ms,floor_io_ms,floor_ratio\n" : "\n";
  for (const RowResult& r : rows) {
    const RowSpec& s = r.spec;
    const std::vector<std::string> f = {CsvField(Basename(s.model)), BenchModeName(s.mode),
                                        std::to_string(s.memory_budget), Fixed(s.offload, 3), s.test.Name(),
                                        std::to_string(s.test.n_tokens), std::to_string(s.prompt_tokens),
                                        std::to_string(s.repetitions), std::to_string(s.threads),
                                        Fixed(r.speed.mean, 4), Fixed(r.speed.sd, 4), Fixed(r.p50_ms, 4),
                                        Fixed(r.p90_ms, 4), Fixed(r.p99_ms, 4), Fixed(r.hit_rate, 4),
                                        Fixed(r.hot_hit_rate, 4), Fixed(r.cold_hit_rate, 4),
                                        Fixed(r.miss_rate_mean, 4), Fixed(r.miss_rate_p99, 4),
                                        Fixed(r.mb_read_per_token, 6), Fixed(r.reads_per_token, 3),
                                        std::to_string(r.peak_rss_bytes), std::to_string(r.cgroup_peak_bytes),
                                        Fixed(r.cpu_util, 4), CsvField(r.constraint), CsvField(r.status)};
    for (size_t i = 0; i < f.size(); ++i) out += (i ? "," : "") + f[i];
    if (floors) out += "," + Fixed(r.floor_compute_ms, 6) + "," + Fixed(r.floor_io_ms, 6) + "," + Fixed(r.floor_ratio, 4);
    out += "\n";
  }
  return out;
}

}  // namespace nflash::bench
