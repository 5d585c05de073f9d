// Reader for Hugging Face .safetensors files: a validated tensor directory and F32 reads of F32/F16/BF16 tensors.
//
// Format (all integers little-endian; https://github.com/huggingface/safetensors):
//   1. N: u64, the byte length of the JSON header
//   2. N bytes of UTF-8 JSON (may be padded with trailing spaces):
//        { "<tensor name>": {"dtype": "F32"|"F16"|"BF16"|..., "shape": [d0, d1, ...],
//                            "data_offsets": [begin, end]},
//          ...,
//          "__metadata__": {"<key>": "<string value>", ...} }      (optional)
//      shape is row-major with d0 outermost (a HF Linear weight is [out_features, in_features]);
//      data_offsets are relative to the start of the data section, end exclusive.
//   3. the data section, from byte 8 + N to the end of the file.
// Open() checks everything a reader relies on: the header length against the file size, the JSON, every field's
// type, known dtypes, non-negative shapes, offsets inside the data section, end - begin == product(shape) * dtype size,
// and that no two tensors overlap. Every error names the file, the tensor, the field, and the expected vs. found value.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "runtime/core/file.h"
#include "runtime/core/ggml_type.h"
#include "runtime/core/status.h"

namespace nflash::converter {

// The element types nflash converts from. Other safetensors dtypes (F64, I8, U8, F8_E4M3, ...) are rejected with
// Unsupported naming the dtype.
enum class SafetensorsDtype : uint8_t { kF32, kF16, kBF16 };
const char* SafetensorsDtypeName(SafetensorsDtype dtype);  // "F32", "F16", "BF16"
uint64_t SafetensorsDtypeSize(SafetensorsDtype dtype);     // bytes per element
GgmlType SafetensorsDtypeToGgml(SafetensorsDtype dtype);   // kF32, kF16, kBF16

struct SafetensorsTensor {
  std::string name;
  SafetensorsDtype dtype = SafetensorsDtype::kF32;
  std::vector<uint64_t> shape;  // row-major, shape[0] outermost (HF/PyTorch order: the reverse of GGUF dims)
  uint64_t offset = 0;          // absolute file offset of the first byte
  uint64_t n_bytes = 0;
  uint64_t n_elements = 0;
};

// A parsed, validated safetensors file. Thread-safety: immutable after Open; const methods may be called concurrently
// (reads go through ReadableFile::ReadAt, which keeps no cursor).
class SafetensorsFile {
 public:
  // Largest JSON header accepted; the reference implementation refuses headers above 100 MB as a guard against a
  // corrupt length field making the reader allocate absurd amounts of memory.
  static constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;

  static Result<SafetensorsFile> Open(std::shared_ptr<const ReadableFile> file);
  // Opens `path` with pread(2).
  static Result<SafetensorsFile> OpenPath(const std::string& path);

  const std::string& path() const { return file_->Path(); }
  uint64_t file_size() const { return file_->Size(); }
  uint64_t header_bytes() const { return header_bytes_; }    // N
  uint64_t data_offset() const { return 8 + header_bytes_; }  // absolute offset of the data section
  // Tensors in data-section order (ascending offset).
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  const SafetensorsTensor* Find(std::string_view name) const;
  // The "__metadata__" string map (non-string values are kept as their JSON text).
  const std::vector<std::pair<std::string, std::string>>& metadata() const { return metadata_; }
  // Sum of all tensors' bytes.
  uint64_t total_tensor_bytes() const;

  // The tensor's bytes as stored (little-endian elements of its dtype).
  Result<std::vector<uint8_t>> ReadRaw(const SafetensorsTensor& tensor) const;
  // The tensor as F32 (F16 and BF16 widened exactly), n_elements values in the stored row-major order.
  Result<std::vector<float>> ReadF32(const SafetensorsTensor& tensor) const;
  // As above by name; NotFound naming the file and tensor if absent.
  Result<std::vector<float>> ReadF32(std::string_view name) const;

 private:
  std::shared_ptr<const ReadableFile> file_;
  uint64_t header_bytes_ = 0;
  std::vector<SafetensorsTensor> tensors_;
  std::map<std::string, size_t, std::less<>> index_;
  std::vector<std::pair<std::string, std::string>> metadata_;
};

}  // namespace nflash::converter
