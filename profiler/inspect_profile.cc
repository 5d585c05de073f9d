// `nflash inspect PROFILE [--plot out.png|svg]`: a per-FFN summary table of a profile file, and the popularity and
// LRU hit-rate curves drawn by gnuplot.
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "profiler/activation_stats.h"
#include "profiler/commands.h"
#include "profiler/profile.h"

namespace nflash::profiler {
namespace {

namespace fs = std::filesystem;

// Fraction of tokens at quantile q of the per-token active fraction, from the 20-bin histogram (bin upper edge).
double HistQuantile(const std::vector<uint32_t>& hist, double q) {
  uint64_t total = 0;
  for (uint32_t c : hist) total += c;
  if (total == 0) return 0;
  uint64_t acc = 0;
  for (size_t b = 0; b < hist.size(); ++b) {
    acc += hist[b];
    if (static_cast<double>(acc) >= q * static_cast<double>(total)) {
      return static_cast<double>(b + 1) / static_cast<double>(hist.size());
    }
  }
  return 1.0;
}

// gnuplot from PATH (Debian: gnuplot-nox), or empty.
std::string FindGnuplot() {
  const char* path = std::getenv("PATH");
  std::string p = path != nullptr ? path : "/usr/bin:/bin";
  size_t start = 0;
  while (start <= p.size()) {
    size_t end = p.find(':', start);
    if (end == std::string::npos) end = p.size();
    const std::string cand = p.substr(start, end - start) + "/gnuplot";
    if (access(cand.c_str(), X_OK) == 0) return cand;
    start = end + 1;
  }
  return "";
}

// Single-quoted for the shell.
std::string ShellQuote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// Single-quoted for a gnuplot script: a quote inside is doubled, and a control character (a line break would end the
// command) becomes a space; nothing else is special there.
std::string GnuplotQuote(const std::string& s) {
  std::string out = "'";
  for (char c : s) {
    if (c == '\'') {
      out += "''";
    } else {
      out += static_cast<unsigned char>(c) < 0x20 ? ' ' : c;
    }
  }
  return out + "'";
}

Status Plot(const ModelProfile& p, const std::string& plot_path) {
  const std::string ext = fs::path(plot_path).extension().string();
  std::string terminal;
  if (ext == ".png") {
    terminal = "pngcairo size 1200,500";
  } else if (ext == ".svg") {
    terminal = "svg size 1200,500";
  } else {
    return Status::InvalidArgument("--plot " + plot_path + ": the extension must be .png or .svg");
  }
  const std::string gnuplot = FindGnuplot();
  if (gnuplot.empty()) {
    return Status::NotFound("--plot needs gnuplot, which is not on PATH (Debian: apt-get install gnuplot-nox)");
  }
  char tmpl[] = "/tmp/nflash-plot-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) return Status::FromErrno("mkdtemp /tmp/nflash-plot-XXXXXX", errno);
  const fs::path dir = tmpl;
  const fs::path data = dir / "curves.dat";
  const fs::path script = dir / "plot.gp";
  const std::string tmp_out = plot_path + ".tmp";
  {
    std::ofstream d(data);
    // One gnuplot data block per FFN: x, popularity, hit rate.
    for (const FfnProfile& f : p.ffns) {
      d << "# layer " << f.layer << " expert " << f.expert << "\n";
      for (int i = 0; i < kCurvePoints; ++i) {
        d << static_cast<double>(i) / (kCurvePoints - 1) << " " << f.popularity[i] << " " << f.lru_hit_rate[i] << "\n";
      }
      d << "\n\n";
    }
    std::ofstream g(script);
    g << "set terminal " << terminal << "\nset output " << GnuplotQuote(tmp_out) << "\n"
      << "set multiplot layout 1,2 title " << GnuplotQuote("nflash profile: " + p.model_name) << "\n"
      << "set key outside right\nset grid\nset xrange [0:1]\nset yrange [0:1]\n"
      << "set xlabel 'share of neurons (most active first)'\nset ylabel 'share of activations'\n"
      << "set title 'Popularity'\n";
    auto plot_cmd = [&](int column) {
      g << "plot ";
      for (size_t i = 0; i < p.ffns.size(); ++i) {
        const FfnProfile& f = p.ffns[i];
        std::string title = "L" + std::to_string(f.layer) + (f.expert >= 0 ? "E" + std::to_string(f.expert) : "");
        g << (i ? ", " : "") << GnuplotQuote(data.string()) << " index " << i << " using 1:" << column
          << " with linespoints title '" << title << "'";
      }
      g << "\n";
    };
    plot_cmd(2);
    g << "set xlabel 'LRU cache size (share of neurons)'\nset ylabel 'hit rate'\nset title 'LRU hit rate'\n";
    plot_cmd(3);
    g << "unset multiplot\n";
    if (!d || !g) return Status::IOError("cannot write the plot data in " + dir.string());
  }
  const std::string cmd = ShellQuote(gnuplot) + " " + ShellQuote(script.string()) + " 2>&1";
  const int rc = std::system(cmd.c_str());
  std::error_code ec;
  fs::remove_all(dir, ec);
  if (rc != 0) {
    fs::remove(tmp_out, ec);
    return Status::IOError("gnuplot failed (exit status " + std::to_string(rc) + ") drawing " + plot_path);
  }
  fs::rename(tmp_out, plot_path, ec);
  if (ec) return Status::IOError("cannot rename " + tmp_out + " to " + plot_path + ": " + ec.message());
  std::printf("wrote %s\n", plot_path.c_str());
  return Status::Ok();
}

}  // namespace

void PrintThresholdTable(const ModelProfile& p) {
  if (p.report_sparsities.empty()) return;
  std::printf("thresholds on |act(gate)| by sparsity:\n%-6s %-6s", "layer", "expert");
  for (float s : p.report_sparsities) std::printf(" %9.2f", s);
  std::printf("\n");
  for (const FfnProfile& f : p.ffns) {
    std::printf("%-6lld %-6lld", static_cast<long long>(f.layer), static_cast<long long>(f.expert));
    for (float t : f.report_thresholds) std::printf(" %9.5f", t);
    std::printf("\n");
  }
}

Status InspectProfile(const std::string& path, const std::string& plot_path) {
  NF_ASSIGN_OR_RETURN(ModelProfile p, LoadProfile(path));
  std::printf("nflash profile %s (schema %d)\n", path.c_str(), p.schema_version);
  std::printf("model %s (hash %s), activation %s, %lld layers, n_ff %lld, %lld experts, dim %lld\n",
              p.model_name.c_str(), p.model_hash.c_str(), p.activation.c_str(), static_cast<long long>(p.n_layers),
              static_cast<long long>(p.n_ff), static_cast<long long>(p.n_experts), static_cast<long long>(p.dim));
  std::printf("calibration: %lld tokens of %s in windows of %lld; target sparsity %.3f\n",
              static_cast<long long>(p.tokens), p.text_path.c_str(), static_cast<long long>(p.ctx),
              p.target_sparsity);
  if (p.decode_tokens > 0) {
    std::printf("source: the model's own decode, %lld generated tokens per window after %lld prompt tokens, %s\n",
                static_cast<long long>(p.decode_tokens), static_cast<long long>(p.decode_prompt_tokens),
                p.decode_temperature > 0 ? ("temperature " + std::to_string(p.decode_temperature)).c_str() : "greedy");
  }
  std::printf("%-6s %-6s %8s %10s %7s %7s %7s %7s %7s %7s %7s %7s %7s %7s %7s %7s\n", "layer", "expert", "tokens",
              "threshold", "mean", "P50", "P90", "top10%", "top20%", "top50%", "ho50%", "hit25%", "hit50%", "bs2",
              "up|g", "down|g");
  // Curve index of 10%, 20%, 25%, 50% of the neurons: the curves have 17 points at i/16, so 10% and 20% interpolate.
  auto at = [](const std::vector<float>& c, double x) {
    const double pos = x * (kCurvePoints - 1);
    const int i = static_cast<int>(pos);
    const double frac = pos - i;
    return i + 1 < kCurvePoints ? c[i] * (1 - frac) + c[i + 1] * frac : c[kCurvePoints - 1];
  };
  for (const FfnProfile& f : p.ffns) {
    double bs2 = 0;
    if (f.groups2 > 0) {
      for (uint32_t c : f.count_bs2) bs2 += c;
      bs2 /= static_cast<double>(f.groups2) * static_cast<double>(f.n_neurons);
    }
    char heldout[16] = "-";
    if (f.popularity_heldout.size() == static_cast<size_t>(kCurvePoints)) {
      std::snprintf(heldout, sizeof(heldout), "%.3f", at(f.popularity_heldout, 0.5));
    }
    std::printf("%-6lld %-6lld %8lld %10.5f %7.4f %7.3f %7.3f %7.3f %7.3f %7.3f %7s %7.3f %7.3f %7.4f %7.4f %7.4f\n",
                static_cast<long long>(f.layer), static_cast<long long>(f.expert), static_cast<long long>(f.tokens),
                f.threshold, f.mean_active_fraction, HistQuantile(f.active_hist, 0.5),
                HistQuantile(f.active_hist, 0.9), at(f.popularity, 0.1), at(f.popularity, 0.2), at(f.popularity, 0.5),
                heldout, at(f.lru_hit_rate, 0.25), at(f.lru_hit_rate, 0.5), bs2, f.up_given_gate,
                f.down_given_gate);
  }
  std::printf("mean/P50/P90: per-token active fraction (P50/P90: upper edge of the 5%% bin); top10%%: share of\n"
              "activations on the 10%% most active neurons; ho50%%: the share the 50%% ranked most active on one half\n"
              "of the tokens hold of the other half's (held out; the planner's curve); hit25%%: LRU hit rate with 25%%\n"
              "of the neurons cached; bs2: active fraction of the union of 2 sequences' tokens\n");
  if (p.lru_hit_rate_shared.size() == static_cast<size_t>(kSharedCurvePoints)) {
    const auto shared = [&](double x) {
      return p.lru_hit_rate_shared[static_cast<size_t>(std::lround(x * (kSharedCurvePoints - 1)))];
    };
    std::printf("one LRU pool shared by every FFN (decode order), hit rate holding 10/25/50%% of all neurons: %.3f / "
                "%.3f / %.3f\n",
                shared(0.1), shared(0.25), shared(0.5));
  }
  PrintThresholdTable(p);
  if (!plot_path.empty()) NF_RETURN_IF_ERROR(Plot(p, plot_path));
  return Status::Ok();
}

}  // namespace nflash::profiler
