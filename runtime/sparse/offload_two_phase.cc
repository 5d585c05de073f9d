// OffloadFfn's two-phase decode path (see "Two-phase loading" in offload_ffn.h): gate pages first, up+down parts only
// for neurons whose gate passes the activation test, the same fixed-order arithmetic as the whole-bundle path.
#include <algorithm>
#include <cmath>
#include <string>

#include "runtime/core/ffn_activation.h"
#include "runtime/core/kernels.h"
#include "runtime/core/log.h"
#include "runtime/core/stats.h"
#include "runtime/sparse/offload_ffn.h"

namespace nflash::sparse {

std::string OffloadFfn::TwoPhaseUnusable(const packer::Deployment& deployment, bool oracle, uint64_t dio_alignment) {
  const packer::BundleLayout& lay = deployment.layout();
  if (oracle) {
    return "the oracle's active set holds only neurons whose exact gate passes: every one needs its up+down part";
  }
  if (lay.slots_per_group != 1) {
    return std::to_string(lay.slots_per_group) + " bundles of " + std::to_string(lay.bundle_bytes) +
           " bytes share each flash page, so a gate part has no page of its own";
  }
  if (lay.gate_offset + lay.gate_bytes > kTwoPhasePageBytes) {
    return "the gate part (" + std::to_string(lay.gate_bytes) + " bytes) does not fit the group's first page";
  }
  if (ColdReadBytes(lay, dio_alignment) <= kTwoPhasePageBytes) {
    return "a whole bundle (" + std::to_string(lay.bundle_bytes) + " bytes) is one page: the gate page is the bundle";
  }
  return "";
}

void OffloadFfn::InitTwoPhase() {
  two_phase_ = false;
  if (!options_.two_phase) return;
  const std::string why = TwoPhaseUnusable(deploy_, oracle_, options_.dio_alignment);
  if (!why.empty()) {
    NF_LOG(Info) << "two-phase loading off (whole bundles are read): " << why;
    return;
  }
  two_phase_ = true;
  NF_LOG(Info) << "two-phase loading: gate page " << kTwoPhasePageBytes << " bytes, then up+down "
               << cold_read_ - kTwoPhasePageBytes << " bytes for neurons whose gate passes";
}

void OffloadFfn::MarkComplete(const Unit& u) {
  if (!u.hot && u.cache_slot >= 0 && u.phase != Phase::kGate) cold_complete_[static_cast<size_t>(u.cache_slot)] = 1;
}

void OffloadFfn::ComputeGates(std::span<const int32_t> items, const Activation& x, float threshold, int64_t group,
                              const packer::RegionInfo& region) {
  const packer::BundleLayout& lay = deploy_.layout();
  const FfnActivation act = model_.hparams().activation;
  // The gate rows by address in one GemvRowPtrs call (the same per-row arithmetic as RowDot and as ComputeItems).
  if (items.empty()) return;
  gate_ptrs_.clear();
  for (int32_t k : items) gate_ptrs_.push_back(bundle_[k] + lay.gate_offset);
  GemvRowPtrs(PartShape(lay, lay.gate_type, lay.gate_bytes), gate_ptrs_, x, gate_out_.data(), pool_);
  for (size_t j = 0; j < items.size(); ++j) {
    gate_item_[items[j]] = gate_out_[j];
    gate_known_[items[j]] = 1;
  }
  OffloadGroupStats& st = stats_[static_cast<size_t>(group)];
  const size_t rest = static_cast<size_t>(cold_read_ - kTwoPhasePageBytes);
  for (int32_t k : items) {
    float ga = 0.0f;
    ActivateNeuron(act, gate_item_[k], 0.0f, &ga);
    if (!(std::fabs(ga) > threshold)) {
      // ComputeItems' test fails whatever up is: the neuron adds nothing and its up+down part is not needed.
      used_flag_[k] = 0;
      hidden_[k] = 0.0f;
      ++st.updown_skipped;
      continue;
    }
    const uint64_t offset = region.offset + lay.SlotOffset(region.slot_of_neuron[active_[k]]) + kTwoPhasePageBytes;
    // A cold-path item's bundle_ is its read destination (cache slot or staging): memory this backend writes.
    uint8_t* dst = const_cast<uint8_t*>(bundle_[k]) + kTwoPhasePageBytes;
    units_.push_back(Unit{offset, rest, dst, item_slot_[k], false, active_[k], item_acq_[k], Phase::kUpDown, k});
    phase2_units_.push_back(static_cast<int32_t>(units_.size() - 1));
    phase2_items_.push_back(k);
    requests2_.push_back(ReadRequest{offset, rest, dst});
    ++st.updown_requests;
    st.updown_bytes += rest;
    ++st.requests;
    st.bytes_read += rest;
  }
}

void OffloadFfn::CutPhase2Chunks(bool flush) {
  const size_t step = static_cast<size_t>(options_.chunk_requests);
  size_t r = chunks2_end_.empty() ? 0 : chunks2_end_.back();
  for (; r + step <= requests2_.size(); r += step) chunks2_end_.push_back(r + step);
  if (flush && r < requests2_.size()) chunks2_end_.push_back(requests2_.size());
}

Status OffloadFfn::ForwardTokenTwoPhase(int64_t group, int64_t layer, int64_t expert, const packer::RegionInfo& region,
                                        const Activation& x, float threshold) {
  OffloadGroupStats& st = stats_[static_cast<size_t>(group)];
  for (const Unit& u : units_) {
    if (u.phase != Phase::kGate) continue;
    ++st.gate_requests;  // gate pages are never merged: one request each
    st.gate_bytes += u.size;
  }
  requests2_.clear();
  phase2_items_.clear();
  phase2_units_.clear();
  chunks2_end_.clear();
  // Items of phase-1 chunk c whose unit has phase `p`.
  auto chunk_items = [&](size_t c, Phase p) {
    scratch_items_.clear();
    for (size_t i = chunk_item_begin_[c]; i < chunk_item_begin_[c + 1]; ++i) {
      const int32_t k = items_by_chunk_[i];
      if (units_[static_cast<size_t>(item_unit_[k])].phase == p) scratch_items_.push_back(k);
    }
    return std::span<const int32_t>(scratch_items_);
  };
  auto phase2_chunk = [&](size_t j) {
    const size_t begin = j == 0 ? 0 : chunks2_end_[j - 1];
    return std::pair<size_t, size_t>(begin, chunks2_end_[j]);
  };
  Status status;
  if (options_.mode == OffloadMode::kFull) {
    const size_t n1 = chunk_ends_.size();
    size_t issued = 0;  // phase-2 chunks handed to the I/O thread
    auto issue = [&] {
      for (; issued < chunks2_end_.size(); ++issued) {
        const auto [b, e] = phase2_chunk(issued);
        const size_t n = e - b;
        io_->Append(std::span<const ReadRequest>(requests2_.data() + b, n), std::span<const size_t>(&n, 1));
      }
    };
    io_->Start(requests_, chunk_ends_);  // possibly no chunk: phase-2 reads are appended to this job
    // Gates of gate-only hits first (one dot each), so their phase-2 reads are queued before the hits' full compute.
    // Phase-2 reads are handed over in whole chunks of chunk_requests: a phase-1 chunk yields only a few (the share
    // of its neurons whose gate passes), and a batch of one or two reads would pay a round trip each without the
    // queue depth that hides it (measured: 2x the I/O wait at 7B).
    ComputeGates(gate_hit_items_, x, threshold, group, region);
    CutPhase2Chunks(n1 == 0);
    issue();
    ComputeItems(ready_items_, x, threshold);
    size_t pos = 0;  // in unit_order_
    for (size_t c = 0; c < n1 && status.ok(); ++c) {
      Status read = io_->WaitChunk(c);
      for (; pos < unit_order_.size() && static_cast<size_t>(request_of_unit_[unit_order_[pos]]) < chunk_ends_[c];
           ++pos) {
        status = CheckArrival(layer, expert, region, units_[static_cast<size_t>(unit_order_[pos])], read);
        if (!status.ok()) break;
      }
      if (!status.ok()) break;
      // Gates first, so that this chunk's phase-2 reads queue behind the phase-1 reads still in flight.
      ComputeGates(chunk_items(c, Phase::kGate), x, threshold, group, region);
      CutPhase2Chunks(c + 1 == n1);  // the last phase-1 chunk flushes the remainder
      issue();
      ComputeItems(chunk_items(c, Phase::kWhole), x, threshold);  // hot clusters
    }
    for (size_t j = 0; j < chunks2_end_.size() && status.ok(); ++j) {
      Status read = io_->WaitChunk(n1 + j);
      const auto [b, e] = phase2_chunk(j);
      for (size_t r = b; r < e && status.ok(); ++r) {
        status = CheckArrival(layer, expert, region, units_[static_cast<size_t>(phase2_units_[r])], read);
      }
      if (!status.ok()) break;
      ComputeItems(std::span<const int32_t>(phase2_items_).subspan(b, e - b), x, threshold);
    }
    if (!status.ok()) io_->Drain();
    return status;
  }
  // llmflash: blocking reads of phase 1, gates, blocking reads of phase 2, then the rest (no overlap).
  uint64_t t0 = SteadyNowNs();
  for (int32_t u : unit_order_) {
    const Unit& unit = units_[static_cast<size_t>(u)];
    Status read = flash_->ReadAt(unit.offset, unit.size, unit.dst);
    status = CheckArrival(layer, expert, region, units_[static_cast<size_t>(u)], read);
    if (!status.ok()) break;
  }
  sync_wait_ns_ += SteadyNowNs() - t0;
  if (!status.ok()) return status;
  ComputeGates(gate_hit_items_, x, threshold, group, region);
  for (size_t c = 0; c < chunk_ends_.size(); ++c) {
    ComputeGates(chunk_items(c, Phase::kGate), x, threshold, group, region);
  }
  t0 = SteadyNowNs();
  for (size_t r = 0; r < requests2_.size() && status.ok(); ++r) {
    const ReadRequest& q = requests2_[r];
    Status read = flash_->ReadAt(q.offset, q.size, q.dst);
    status = CheckArrival(layer, expert, region, units_[static_cast<size_t>(phase2_units_[r])], read);
  }
  sync_wait_ns_ += SteadyNowNs() - t0;
  if (!status.ok()) return status;
  ComputeItems(ready_items_, x, threshold);
  for (size_t c = 0; c < chunk_ends_.size(); ++c) ComputeItems(chunk_items(c, Phase::kWhole), x, threshold);
  ComputeItems(phase2_items_, x, threshold);
  return status;
}

}  // namespace nflash::sparse
