// VerifyDeployment (packer/verify.h): re-derives every checksum of a deployment from its files.
#include "packer/verify.h"

#include <chrono>
#include <memory>
#include <span>
#include <vector>

#include "packer/deployment.h"
#include "runtime/core/file.h"
#include "runtime/core/log.h"

namespace nflash::packer {

Result<VerifyReport> VerifyDeployment(const std::string& dir, bool progress) {
  const auto start = std::chrono::steady_clock::now();
  Deployment::Options options;
  options.verify_resident_hash = true;
  NF_ASSIGN_OR_RETURN(auto d, Deployment::Open(dir, options));
  const Manifest& m = d->manifest();
  const BundleLayout& l = d->layout();
  NF_ASSIGN_OR_RETURN(auto flash, OpenPreadFile(d->flash_path()));
  VerifyReport report;
  report.flash_bytes = m.flash_bytes;
  std::unique_ptr<ProgressBar> bar;
  if (progress) bar = std::make_unique<ProgressBar>("verify", m.flash_bytes);
  std::vector<uint8_t> buf;
  uint64_t expected_offset = 0;  // regions tile ffn.bin: anything between them would be unaccounted bytes
  for (const RegionInfo& r : m.regions) {
    if (r.offset != expected_offset) {
      return Status::Corruption(d->flash_path() + ": region of layer " + std::to_string(r.layer) + " starts at " +
                                std::to_string(r.offset) + ", expected " + std::to_string(expected_offset));
    }
    buf.resize(r.size);
    NF_RETURN_IF_ERROR(flash->ReadAt(r.offset, r.size, buf.data()));
    const std::span<const uint8_t> all(buf);
    for (int64_t slot = 0; slot < r.n_neurons; ++slot) {
      const int32_t neuron = r.neuron_of_slot[static_cast<size_t>(slot)];
      NF_RETURN_IF_ERROR(d->VerifyBundle(r.layer, r.expert, neuron, all.subspan(l.SlotOffset(slot), l.bundle_bytes)));
    }
    // Padding: the tail of every group after its bundles (and of the last, partly filled group) must be zero.
    const int64_t groups = (r.n_neurons + l.slots_per_group - 1) / l.slots_per_group;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t used = std::min<int64_t>(l.slots_per_group, r.n_neurons - g * l.slots_per_group);
      const uint64_t from = static_cast<uint64_t>(g) * l.group_bytes + static_cast<uint64_t>(used) * l.bundle_bytes;
      const uint64_t to = static_cast<uint64_t>(g + 1) * l.group_bytes;
      for (uint64_t i = from; i < to; ++i) {
        if (buf[i] != 0) {
          return Status::Corruption(d->flash_path() + ": non-zero padding byte at offset " + std::to_string(r.offset + i) +
                                    " (layer " + std::to_string(r.layer) +
                                    (r.expert >= 0 ? " expert " + std::to_string(r.expert) : std::string()) +
                                    ", slot group " + std::to_string(g) + ")");
        }
      }
    }
    expected_offset = r.offset + r.size;
    report.regions += 1;
    report.bundles += r.n_neurons;
    if (bar) bar->Update(expected_offset);
  }
  if (expected_offset != m.flash_bytes) {
    return Status::Corruption(d->flash_path() + ": regions end at " + std::to_string(expected_offset) +
                              ", file has " + std::to_string(m.flash_bytes) + " bytes");
  }
  if (bar) bar->Finish();
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return report;
}

}  // namespace nflash::packer
