// The cost model's direct evaluation (equations in docs/planner.md).
#include "planner/cost_model.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>

#include "runtime/engine/context.h"  // kDefaultMaxBatch (a constant: the planner does not link the engine)

namespace nflash::planner {

double Curve::At(double v) const {
  if (x.empty()) return 0.0;
  if (v <= x.front()) return y.front();
  if (v >= x.back()) return y.back();
  const auto it = std::upper_bound(x.begin(), x.end(), v);
  const size_t i = static_cast<size_t>(it - x.begin());
  const double t = (v - x[i - 1]) / (x[i] - x[i - 1]);
  return y[i - 1] + t * (y[i] - y[i - 1]);
}

Curve UpperEnvelope(const Curve& a, const Curve& b) {
  if (a.x.empty()) return b;
  if (b.x.empty()) return a;
  std::vector<double> xs(a.x);
  xs.insert(xs.end(), b.x.begin(), b.x.end());
  std::sort(xs.begin(), xs.end());
  xs.erase(std::unique(xs.begin(), xs.end()), xs.end());
  Curve out;
  for (size_t i = 0; i < xs.size(); ++i) {
    if (i > 0) {
      // Between two breakpoints both are linear: they cross at most once.
      const double d0 = a.At(xs[i - 1]) - b.At(xs[i - 1]), d1 = a.At(xs[i]) - b.At(xs[i]);
      if ((d0 < 0 && d1 > 0) || (d0 > 0 && d1 < 0)) {
        const double xc = xs[i - 1] + (xs[i] - xs[i - 1]) * d0 / (d0 - d1);
        out.x.push_back(xc);
        out.y.push_back(std::max(a.At(xc), b.At(xc)));
      }
    }
    out.x.push_back(xs[i]);
    out.y.push_back(std::max(a.At(xs[i]), b.At(xs[i])));
  }
  return out;
}

std::vector<std::pair<double, double>> Curve::ConcaveSegments(size_t max_segments) const {
  // Upper hull of the points (Andrew's monotone chain, upper half), then one segment per hull edge.
  std::vector<size_t> hull;
  for (size_t i = 0; i < x.size(); ++i) {
    while (hull.size() >= 2) {
      const size_t a = hull[hull.size() - 2], b = hull.back();
      const double cross = (x[b] - x[a]) * (y[i] - y[a]) - (y[b] - y[a]) * (x[i] - x[a]);
      if (cross >= 0) {
        hull.pop_back();  // b lies on or below the chord a-i: not on the upper hull
      } else {
        break;
      }
    }
    hull.push_back(i);
  }
  std::vector<std::pair<double, double>> segments;
  for (size_t j = 1; j < hull.size(); ++j) {
    const size_t a = hull[j - 1], b = hull[j];
    if (x[b] == x[a]) continue;
    const double slope = (y[b] - y[a]) / (x[b] - x[a]);
    segments.push_back({slope, y[a] - slope * x[a]});
  }
  if (segments.empty() && !y.empty()) segments.push_back({0.0, *std::max_element(y.begin(), y.end())});
  if (max_segments > 0 && segments.size() > max_segments) {
    std::vector<std::pair<double, double>> kept;
    const size_t n = segments.size();
    for (size_t j = 0; j < max_segments; ++j) {
      const size_t at = max_segments == 1 ? 0 : (j * (n - 1) + (max_segments - 1) / 2) / (max_segments - 1);
      if (kept.empty() || kept.back() != segments[at]) kept.push_back(segments[at]);
    }
    return kept;
  }
  return segments;
}

namespace {

// Bytes per second of the dense GEMV and of the sparse FFN kernels with `threads` compute threads (the figure of the
// most threads measured when more are asked).
struct KernelRates {
  double gemv = 0, sparse = 0;
};
KernelRates RatesFor(const HardwareParams& hw, int threads) {
  const size_t ti = static_cast<size_t>(std::max(1, threads) - 1);
  return {hw.dense_gemv_gbs.at(std::min(ti, hw.dense_gemv_gbs.size() - 1)) * 1e9,
          hw.sparse_ffn_gbs.at(std::min(ti, hw.sparse_ffn_gbs.size() - 1)) * 1e9};
}

// Neurons of FFN `f` a token computes: A = route share x active share x neurons.
double ActiveNeurons(const FfnParams& f) {
  return f.route_fraction * f.active_fraction * static_cast<double>(f.n_neurons);
}

// A random-read figure (`field` of IoPoint) at `request_bytes` and `queue_depth`: the points at the largest measured
// queue depth <= queue_depth (or the smallest measured), interpolated linearly in log2 of the request size; below the
// smallest measured size `below(value, size ratio)` extrapolates.
template <typename Field, typename Below>
double Interpolate(const std::vector<IoPoint>& reads, uint64_t request_bytes, int queue_depth, Field field,
                   Below below) {
  int qd = -1, min_qd = INT32_MAX;
  for (const IoPoint& p : reads) {
    min_qd = std::min(min_qd, p.queue_depth);
    if (p.queue_depth <= queue_depth) qd = std::max(qd, p.queue_depth);
  }
  if (reads.empty()) return 0.0;
  if (qd < 0) qd = min_qd;
  std::vector<std::pair<double, double>> pts;  // (log2 size, value)
  for (const IoPoint& p : reads) {
    if (p.queue_depth == qd) pts.push_back({std::log2(static_cast<double>(p.request_bytes)), field(p)});
  }
  std::sort(pts.begin(), pts.end());
  const double s = std::log2(static_cast<double>(std::max<uint64_t>(request_bytes, 1)));
  if (s <= pts.front().first) return below(pts.front().second, std::exp2(s - pts.front().first));
  if (s >= pts.back().first) return pts.back().second;
  for (size_t i = 1; i < pts.size(); ++i) {
    if (s <= pts[i].first) {
      const double t = (s - pts[i - 1].first) / (pts[i].first - pts[i - 1].first);
      return pts[i - 1].second + t * (pts[i].second - pts[i - 1].second);
    }
  }
  return pts.back().second;
}

}  // namespace

double HardwareParams::ReadMbps(uint64_t request_bytes, int queue_depth) const {
  // Below the smallest measured size: the same IOPS, so throughput shrinks with the size.
  return Interpolate(random_reads, request_bytes, queue_depth, [](const IoPoint& p) { return p.mb_per_s; },
                     [](double v, double ratio) { return v * ratio; });
}

double HardwareParams::ReadLatencyUs(uint64_t request_bytes, int queue_depth) const {
  // Below the smallest measured size: no faster than the smallest size.
  return Interpolate(random_reads, request_bytes, queue_depth, [](const IoPoint& p) { return p.mean_latency_us; },
                     [](double v, double) { return v; });
}

Prediction Evaluate(const HardwareParams& hw, const ModelParams& model, const PlanSettings& s) {
  Prediction p;
  const auto [gemv, sparse] = RatesFor(hw, s.compute_threads);
  p.attention_s = static_cast<double>(model.dense_bytes_per_token) / gemv;
  p.predictor_s = static_cast<double>(model.predictor_bytes) / gemv;
  // The I/O thread's submission work lands on the compute cores when they are all busy computing.
  const bool io_shares_cores = s.compute_threads + s.io_threads > hw.cores;
  const int qd = s.queue_depth;
  p.memory_bytes = model.fixed_bytes;
  double active_total = 0, served_total = 0;
  const double pool_share =
      model.ffns.empty() ? 0.0 : static_cast<double>(model.overflow_pool_slots) / static_cast<double>(model.ffns.size());
  // A shared pool: one hit rate for every region, at the pool's share of all neurons.
  double shared_served = 0;
  if (s.shared_cold_pool) {
    double slots = 0, neurons = 0;
    for (size_t r = 0; r < model.ffns.size(); ++r) {
      slots += static_cast<double>(s.cold_slots.at(r));
      neurons += static_cast<double>(model.ffns[r].n_neurons);
    }
    // The runtime's shared pool takes the staging the fixed part reserved (sparse_runtime.cc) like the overflow pool.
    slots += static_cast<double>(model.overflow_pool_slots);
    shared_served = model.shared_lru.x.empty() || neurons <= 0
                        ? 0.0
                        : std::clamp(model.shared_lru.At(std::min(1.0, slots / neurons)), 0.0, 1.0);
  }
  for (size_t r = 0; r < model.ffns.size(); ++r) {
    const FfnParams& f = model.ffns[r];
    const double n = static_cast<double>(f.n_neurons);
    const double h = n > 0 ? static_cast<double>(s.hot_neurons.at(r)) / n : 0.0;
    const double c =
        n > 0 ? std::min(1.0 - h, (static_cast<double>(s.cold_slots.at(r)) + pool_share) / n) : 0.0;
    const double served =
        s.shared_cold_pool
            ? shared_served
            : std::clamp(std::min(UpperEnvelope(f.popularity, f.lru_hit).At(h + c), f.popularity.At(h) + f.lru_hit.At(c)),
                         0.0, 1.0);
    const double active = ActiveNeurons(f);                           // A
    const double missed = active * (1.0 - served);                    // M
    const double bw = hw.ReadMbps(f.read_bytes, qd) * 1e6;
    const double compute = active * static_cast<double>(f.ComputeBytes()) / sparse +
                           (io_shares_cores ? missed * hw.submit_us_per_request * 1e-6 / s.compute_threads : 0.0);
    const double io = bw > 0 ? missed * static_cast<double>(f.read_bytes) / bw : (missed > 0 ? INFINITY : 0.0);
    const double k = static_cast<double>(s.cluster_neurons);
    const double lat = hw.ReadLatencyUs(f.read_bytes, qd) * 1e-6;
    // The first cluster's reads, once per run of the FFN (an expert the router does not pick reads nothing).
    const double pipeline = (active / k) * hw.cluster_sync_us * 1e-6 / s.compute_threads +
                            f.Runs() * (1.0 - served) *
                                (lat + (bw > 0 ? k * static_cast<double>(f.read_bytes) / bw : 0.0));
    const double t = std::max(compute, io) + pipeline;
    p.ffn_compute_s += compute;
    p.io_s += io;
    p.io_exposed_s += std::max(0.0, io - compute);
    p.pipeline_s += pipeline;
    p.layer_token_s.push_back(t);
    p.layer_compute_s.push_back(compute);
    p.layer_io_s.push_back(io);
    p.layer_pipeline_s.push_back(pipeline);
    p.layer_served.push_back(served);
    p.read_mb_per_token += missed * static_cast<double>(f.read_bytes) / 1e6;
    p.reads_per_token += missed;
    active_total += active;
    served_total += active * served;
    p.memory_bytes += static_cast<uint64_t>(s.hot_neurons.at(r)) * f.HotSlotBytes() +
                      static_cast<uint64_t>(s.cold_slots.at(r)) * f.slot_bytes;
  }
  p.token_s = p.attention_s + p.predictor_s;
  for (double t : p.layer_token_s) p.token_s += t;
  p.tokens_per_s = p.token_s > 0 ? 1.0 / p.token_s : 0.0;
  p.served_fraction = active_total > 0 ? served_total / active_total : 1.0;
  return p;
}

PlanSettings PureRegionSplits(const ModelParams& model, const PlanSettings& settings) {
  PlanSettings out = settings;
  for (size_t r = 0; r < model.ffns.size(); ++r) {
    const FfnParams& f = model.ffns[r];
    const int64_t held = settings.hot_neurons.at(r) + settings.cold_slots.at(r);
    const double x = f.n_neurons > 0 ? static_cast<double>(held) / static_cast<double>(f.n_neurons) : 0.0;
    const bool lru = f.lru_hit.At(x) > f.popularity.At(x);
    // The region's memory, held in one way: as many neurons as it buys at that way's size (a hot neuron's share of
    // whole flash groups and a cold slot may differ), never more than the region has.
    const uint64_t bytes = static_cast<uint64_t>(settings.hot_neurons.at(r)) * f.HotSlotBytes() +
                           static_cast<uint64_t>(settings.cold_slots.at(r)) * f.slot_bytes;
    const uint64_t unit = lru ? f.slot_bytes : f.HotSlotBytes();
    const int64_t n = unit > 0 ? std::min<int64_t>(f.n_neurons, static_cast<int64_t>(bytes / unit)) : held;
    out.hot_neurons[r] = lru ? 0 : n;
    out.cold_slots[r] = lru ? n : 0;
  }
  return out;
}

PlanSettings SharedPoolSettings(const ModelParams& model, const PlanSettings& knobs, uint64_t memory_bytes) {
  PlanSettings s = knobs;
  s.shared_cold_pool = true;
  s.hot_neurons.assign(model.ffns.size(), 0);
  s.cold_slots.assign(model.ffns.size(), 0);
  if (model.ffns.empty() || model.ffns[0].slot_bytes == 0 || memory_bytes <= model.fixed_bytes) return s;
  int64_t neurons = 0;
  double weight = 0;
  for (const FfnParams& f : model.ffns) {
    neurons += f.n_neurons;
    weight += ActiveNeurons(f);
  }
  const int64_t pool = std::min<int64_t>(
      neurons, static_cast<int64_t>((memory_bytes - model.fixed_bytes) / model.ffns[0].slot_bytes));
  // By active neurons per token, rounded down, capped at each region's neurons; the remainder to the regions in order.
  int64_t given = 0;
  for (size_t r = 0; r < model.ffns.size(); ++r) {
    const FfnParams& f = model.ffns[r];
    const double share = weight > 0 ? ActiveNeurons(f) / weight : 1.0 / static_cast<double>(model.ffns.size());
    s.cold_slots[r] = std::min<int64_t>(f.n_neurons, static_cast<int64_t>(share * static_cast<double>(pool)));
    given += s.cold_slots[r];
  }
  for (size_t r = 0; r < model.ffns.size() && given < pool; ++r) {
    const int64_t add = std::min<int64_t>(pool - given, model.ffns[r].n_neurons - s.cold_slots[r]);
    s.cold_slots[r] += add;
    given += add;
  }
  return s;
}

PrefillPrediction EvaluatePrefill(const HardwareParams& hw, const ModelParams& model, const PlanSettings& s,
                                  int64_t n_tokens) {
  PrefillPrediction p;
  const double n = static_cast<double>(std::max<int64_t>(n_tokens, 1));
  const double gemm = hw.gemm_gflops * 1e9;
  if (model.predictor) {
    // Attention and the head by GEMM; each FFN computes every token's predicted neurons from the layer buffer, the
    // decode path's arithmetic with every neuron in memory (runtime/sparse/offload_prefill.cc), plus the predictor.
    const auto [gemv, sparse] = RatesFor(hw, s.compute_threads);
    double ffn = static_cast<double>(model.predictor_bytes) / gemv;  // per token
    for (const FfnParams& f : model.ffns) ffn += ActiveNeurons(f) * static_cast<double>(f.ComputeBytes()) / sparse;
    p.compute_s = (gemm > 0 ? 2.0 * static_cast<double>(model.dense_matmul_params) * n / gemm : 0.0) + ffn * n;
  } else {
    // Oracle: a GEMM over every neuron.
    p.compute_s = gemm > 0 ? 2.0 * static_cast<double>(model.matmul_params) * n / gemm : 0.0;
  }
  // Every region is read whole, once per chunk of kDefaultMaxBatch tokens (the runtime's default --batch).
  const double chunks = std::ceil(n / static_cast<double>(kDefaultMaxBatch));
  p.io_s = hw.seq_read_mbs > 0 ? chunks * static_cast<double>(model.ffn_bytes) / (hw.seq_read_mbs * 1e6) : 0.0;
  // Layer l + 1 is read while layer l computes; the first layer's read has nothing to hide behind.
  const double layers = static_cast<double>(std::max<int64_t>(model.n_layers, 1));
  p.exposed_io_s = p.io_s / layers;
  p.total_s = std::max(p.compute_s, p.io_s - p.exposed_io_s) + p.exposed_io_s;
  p.tokens_per_s = p.total_s > 0 ? n / p.total_s : 0.0;
  return p;
}

int BurstQueueDepth(const HardwareParams& hw, const ModelParams& model, const PlanSettings& settings,
                    const Prediction& prediction) {
  const int qd = settings.queue_depth;
  if (settings.compute_threads + settings.io_threads <= hw.cores) return qd;  // a spare core refills at once
  // Expected misses per layer (a layer's experts are read in one burst too).
  std::map<int64_t, double> per_layer;
  for (size_t r = 0; r < model.ffns.size() && r < prediction.layer_served.size(); ++r) {
    const FfnParams& f = model.ffns[r];
    const double active = ActiveNeurons(f);
    per_layer[f.layer] += active * (1.0 - prediction.layer_served[r]);
  }
  double burst = 0;
  for (const auto& [layer, misses] : per_layer) burst = std::max(burst, misses);
  int depth = qd;
  while (depth < kMaxBurstQueueDepth && depth < burst) depth *= 2;
  return std::max(qd, std::min(depth, kMaxBurstQueueDepth));
}

namespace {

// The upper hull's vertices of `c` (as ConcaveSegments' chain), from (0, 0) when the curve starts elsewhere (a start
// above 0 is then a first, vertical segment) and on to x = 1 (flat) when it ends earlier.
std::vector<std::pair<double, double>> HullPoints(const Curve& c) {
  std::vector<std::pair<double, double>> pts;
  if (c.x.empty() || c.x.front() > 0 || c.y.front() != 0) pts.push_back({0.0, 0.0});
  for (size_t i = 0; i < c.x.size(); ++i) {
    const std::pair<double, double> p = {c.x[i], c.y[i]};
    while (pts.size() >= 2) {
      const auto& a = pts[pts.size() - 2];
      const auto& b = pts.back();
      if ((b.first - a.first) * (p.second - a.second) - (b.second - a.second) * (p.first - a.first) < 0) break;
      pts.pop_back();  // b on or below the chord a-p
    }
    pts.push_back(p);
  }
  if (pts.back().first < 1.0) pts.push_back({1.0, pts.back().second});
  return pts;
}

// One layer's curve of `field` merged over its experts `regions`, and the order the segments fill in.
Curve MergeCurves(const ModelParams& model, const std::vector<size_t>& regions, Curve FfnParams::*field,
                  std::vector<ExpertLayers::Piece>* order) {
  struct Segment {
    size_t region;
    double neurons, mass, density;
  };
  std::vector<Segment> segs;
  double total_neurons = 0, total_mass = 0;
  for (size_t r : regions) {
    const FfnParams& f = model.ffns[r];
    const double n = static_cast<double>(f.n_neurons), a = ActiveNeurons(f);
    total_neurons += n;
    total_mass += a;
    const std::vector<std::pair<double, double>> pts = HullPoints(f.*field);
    for (size_t k = 1; k < pts.size(); ++k) {
      const double dn = (pts[k].first - pts[k - 1].first) * n, dm = std::max(0.0, pts[k].second - pts[k - 1].second) * a;
      if (dn <= 0 && dm <= 0) continue;
      segs.push_back({r, dn, dm, dn > 0 ? dm / dn : std::numeric_limits<double>::infinity()});
    }
  }
  std::stable_sort(segs.begin(), segs.end(), [](const Segment& a, const Segment& b) { return a.density > b.density; });
  Curve out;
  out.x.push_back(0.0);
  out.y.push_back(0.0);
  double n_cum = 0, m_cum = 0;
  order->clear();
  for (const Segment& s : segs) {
    n_cum += s.neurons;
    m_cum += s.mass;
    order->push_back({s.region, s.neurons});
    const double x = total_neurons > 0 ? n_cum / total_neurons : 0.0;
    const double y = total_mass > 0 ? m_cum / total_mass : 0.0;
    if (x == out.x.back()) {
      out.y.back() = y;  // a vertical step (mass at x = 0): the curve starts above 0
    } else {
      out.x.push_back(x);
      out.y.push_back(y);
    }
  }
  return out;
}

}  // namespace

bool GroupExpertsByLayer(const ModelParams& model, ExpertLayers* out) {
  std::vector<std::vector<size_t>> by_layer(static_cast<size_t>(std::max<int64_t>(model.n_layers, 0)));
  for (size_t r = 0; r < model.ffns.size(); ++r) {
    const FfnParams& f = model.ffns[r];
    if (f.expert < 0 || f.layer < 0 || f.layer >= model.n_layers) return false;
    const std::vector<size_t>& same = by_layer[static_cast<size_t>(f.layer)];
    if (!same.empty()) {
      const FfnParams& g = model.ffns[same.front()];
      if (f.bundle_bytes != g.bundle_bytes || f.ComputeBytes() != g.ComputeBytes() || f.read_bytes != g.read_bytes ||
          f.slot_bytes != g.slot_bytes || f.HotSlotBytes() != g.HotSlotBytes()) {
        return false;
      }
    }
    by_layer[static_cast<size_t>(f.layer)].push_back(r);
  }
  out->model = model;
  out->model.ffns.clear();
  out->hot_order.clear();
  out->cold_order.clear();
  for (size_t l = 0; l < by_layer.size(); ++l) {
    if (by_layer[l].empty()) return false;
    FfnParams layer = model.ffns[by_layer[l].front()];
    layer.expert = -1;
    layer.n_neurons = 0;
    double mass = 0;
    for (size_t r : by_layer[l]) {
      layer.n_neurons += model.ffns[r].n_neurons;
      mass += ActiveNeurons(model.ffns[r]);
    }
    layer.route_fraction = 1;
    layer.layer_runs = 0;
    for (size_t r : by_layer[l]) layer.layer_runs += model.ffns[r].Runs();
    layer.active_fraction = layer.n_neurons > 0 ? mass / static_cast<double>(layer.n_neurons) : 0.0;
    out->hot_order.emplace_back();
    out->cold_order.emplace_back();
    layer.popularity = MergeCurves(model, by_layer[l], &FfnParams::popularity, &out->hot_order.back());
    layer.lru_hit = MergeCurves(model, by_layer[l], &FfnParams::lru_hit, &out->cold_order.back());
    out->model.ffns.push_back(std::move(layer));
  }
  return true;
}

PlanSettings SpreadOverExperts(const ModelParams& model, const ExpertLayers& layers, const PlanSettings& per_layer) {
  PlanSettings s = per_layer;
  s.hot_neurons.assign(model.ffns.size(), 0);
  s.cold_slots.assign(model.ffns.size(), 0);
  auto spread = [&](const std::vector<ExpertLayers::Piece>& order, int64_t count, std::vector<int64_t>* to) {
    std::vector<double> share(model.ffns.size(), 0.0);
    double left = static_cast<double>(count);
    for (const ExpertLayers::Piece& p : order) {
      if (left <= 0) break;
      const double take = std::min(left, p.neurons);
      share[p.region] += take;
      left -= take;
    }
    for (size_t r = 0; r < share.size(); ++r) {
      (*to)[r] += std::min<int64_t>(model.ffns[r].n_neurons, static_cast<int64_t>(std::floor(share[r] + 1e-6)));
    }
  };
  for (size_t l = 0; l < layers.model.ffns.size(); ++l) {
    spread(layers.hot_order[l], per_layer.hot_neurons.at(l), &s.hot_neurons);
    spread(layers.cold_order[l], per_layer.cold_slots.at(l), &s.cold_slots);
  }
  // An expert whose hot and cold shares overlap holds at most all its neurons.
  for (size_t r = 0; r < model.ffns.size(); ++r) {
    s.cold_slots[r] = std::min(s.cold_slots[r], model.ffns[r].n_neurons - s.hot_neurons[r]);
  }
  return s;
}

}  // namespace nflash::planner
