// GGUF v3 reader and writer (llama.cpp's model container), one header shared by both directions.
//
// Layout (all integers little-endian; see docs/formats.md for the full prose spec):
//   1. magic "GGUF" (4 bytes), version u32 (= 3; 2 is read too), tensor_count u64, metadata_kv_count u64
//   2. metadata_kv_count entries: key (gguf string), value type u32, value
//        gguf string = u64 length + bytes (no terminator); array = element type u32 + u64 count + elements
//   3. tensor_count infos: name (gguf string), n_dims u32 (1..4), dims u64[n_dims] (dims[0] is the contiguous row
//      length), type u32 (ggml type id), offset u64 (relative to the start of the data section, multiple of alignment)
//   4. padding to `general.alignment` (u32 metadata key, default 32, a power of two)
//   5. data section: tensor data at their offsets, each padded to the alignment
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <variant>
#include <vector>

#include "runtime/core/file.h"
#include "runtime/core/ggml_type.h"
#include "runtime/core/status.h"

namespace nflash {

inline constexpr uint32_t kGgufMagic = 0x46554747;  // "GGUF" read as little-endian u32
inline constexpr uint32_t kGgufVersion = 3;
// ggml's default when general.alignment is absent.
inline constexpr uint32_t kGgufDefaultAlignment = 32;
// ggml's GGML_MAX_NAME (64) counts the terminating NUL: longer tensor names cannot be loaded by llama.cpp.
inline constexpr size_t kGgufMaxTensorNameBytes = 63;
// ggml's GGML_MAX_DIMS.
inline constexpr uint32_t kGgufMaxDims = 4;
// Nested arrays are read recursively; the bound keeps a hostile file from exhausting the stack (real files nest at
// most once). A deeper file is Unsupported, not Corruption: the format itself sets no limit.
inline constexpr int kGgufMaxArrayDepth = 16;
// Metadata values held in memory (~40 bytes each, so ~640 MiB at the bound); the largest real vocabularies
// (262k tokens plus merges, scores and types) need ~2M. A file beyond it is ResourceExhausted.
inline constexpr uint64_t kGgufMaxMetadataValues = uint64_t{1} << 24;

enum class GgufType : uint32_t {
  kUint8 = 0,
  kInt8 = 1,
  kUint16 = 2,
  kInt16 = 3,
  kUint32 = 4,
  kInt32 = 5,
  kFloat32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kUint64 = 10,
  kInt64 = 11,
  kFloat64 = 12,
};
std::string_view GgufTypeName(GgufType type);

struct GgufValue;
// An array of values of one element type (nested arrays are allowed by the format).
struct GgufArray {
  GgufType element_type = GgufType::kUint8;
  std::vector<GgufValue> items;
};

// One metadata value. The variant alternative determines the GGUF type (see type()).
struct GgufValue {
  using Storage = std::variant<uint8_t, int8_t, uint16_t, int16_t, uint32_t, int32_t, float, bool, std::string,
                               GgufArray, uint64_t, int64_t, double>;
  Storage v;

  GgufValue() = default;
  template <typename T, typename = std::enable_if_t<!std::is_same_v<std::decay_t<T>, GgufValue> &&
                                                    std::is_constructible_v<Storage, T>>>
  GgufValue(T x) : v(std::move(x)) {}  // NOLINT: implicit by design
  GgufValue(const char* s) : v(std::string(s)) {}  // NOLINT
  GgufType type() const { return static_cast<GgufType>(v.index()); }
};

struct GgufTensorInfo {
  std::string name;
  std::vector<uint64_t> dims;  // dims[0] = elements per row (contiguous); at most 4
  GgmlType type = GgmlType::kF32;
  uint64_t offset = 0;         // relative to the data section
  uint64_t n_elements = 0;
  uint64_t n_bytes = 0;
};

// A parsed, validated GGUF file. Thread-safety: immutable after Open; all const methods may be called concurrently.
class GgufFile {
 public:
  // Parses and validates the header, metadata and tensor directory. Every violation is a Corruption (or Unsupported
  // for an unknown tensor type/version) whose message names the file, the field and its offset, and the expected and
  // found values. Nothing is read past the tensor directory except to check that every tensor lies inside the file.
  static Result<GgufFile> Open(std::shared_ptr<const ReadableFile> file);
  static Result<GgufFile> OpenPath(const std::string& path, bool use_mmap = true);
  // Through pread that leaves nothing of the file in the page cache (OpenUncachedPreadFile): for the metadata (e.g. the
  // tokenizer) of a file whose tensors are read with O_DIRECT, or not at all.
  static Result<GgufFile> OpenPathUncached(const std::string& path);
  // The same parsed directory over another copy of the file's bytes (e.g. the file read into memory after its metadata
  // was parsed through pread): nothing is parsed again. The copy must hold the same bytes; only its size is checked
  // (a Corruption naming both paths when it differs).
  Result<GgufFile> Rebind(std::shared_ptr<const ReadableFile> file) &&;

  uint32_t version() const { return version_; }
  uint32_t alignment() const { return alignment_; }
  uint64_t data_offset() const { return data_offset_; }  // absolute file offset of the data section
  const ReadableFile& file() const { return *file_; }
  const std::string& path() const { return file_->Path(); }

  // Metadata in file order.
  const std::vector<std::pair<std::string, GgufValue>>& metadata() const { return kv_; }
  // The heap the parsed metadata holds (values, strings, arrays: a tokenizer's vocabulary is most of it, ~18 MB for
  // 151936 tokens), an estimate from the containers' capacities for the sparse runtime's memory accounting.
  uint64_t MetadataHeapBytes() const;
  const GgufValue* Find(std::string_view key) const;
  // Typed getters: NotFound if absent, Corruption naming key, expected and found type otherwise.
  // Integer getters accept any integer type whose value fits.
  Result<std::string> GetString(std::string_view key) const;
  Result<uint64_t> GetUint(std::string_view key) const;
  Result<int64_t> GetInt(std::string_view key) const;
  Result<double> GetFloat(std::string_view key) const;  // float32 or float64
  Result<bool> GetBool(std::string_view key) const;
  Result<const GgufArray*> GetArray(std::string_view key) const;

  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
  const GgufTensorInfo* FindTensor(std::string_view name) const;
  // Bytes of a tensor: a view into the mapping when the file is mapped or in memory, else read into `scratch`.
  Result<std::span<const uint8_t>> TensorData(const GgufTensorInfo& info, std::vector<uint8_t>* scratch) const;

 private:
  std::shared_ptr<const ReadableFile> file_;
  uint32_t version_ = 0;
  uint32_t alignment_ = kGgufDefaultAlignment;
  uint64_t data_offset_ = 0;
  std::vector<std::pair<std::string, GgufValue>> kv_;
  std::map<std::string, size_t, std::less<>> kv_index_;
  std::vector<GgufTensorInfo> tensors_;
  std::map<std::string, size_t, std::less<>> tensor_index_;
};

// Writes a GGUF v3 file in two steps, so tensors of any size can be streamed without holding them in memory:
//   1. Set metadata and declare every tensor (name, type, dims) in file order;
//   2. Begin(): writes header, metadata and tensor directory to a temporary file;
//      then WriteTensorData() once per tensor, in declaration order, with exactly its byte size;
//      Finish(): pads, checks every tensor was written, and renames the file into place.
// Thread-safety: not thread-safe.
class GgufWriter {
 public:
  GgufWriter();
  ~GgufWriter();
  // Adds or replaces a key (replacing keeps the original position). general.alignment is honoured by the layout.
  void Set(std::string key, GgufValue value);
  // Declares a tensor; InvalidArgument for a duplicate name, bad dims count, or a row length not a multiple of the
  // type's block size.
  // Also InvalidArgument: an empty name, a name over kGgufMaxTensorNameBytes, more than INT64_MAX elements, AddTensor
  // after Begin. A zero dimension is allowed (a zero-byte tensor), as ggml allows it.
  Status AddTensor(std::string name, GgmlType type, std::vector<uint64_t> dims);
  Status Begin(const std::string& path, bool overwrite);
  Status WriteTensorData(std::string_view name, std::span<const uint8_t> bytes);
  Status Finish();

 private:
  std::vector<std::pair<std::string, GgufValue>> kv_;
  std::vector<GgufTensorInfo> tensors_;
  std::unique_ptr<AtomicFileWriter> out_;
  size_t next_tensor_ = 0;
  uint32_t alignment_ = kGgufDefaultAlignment;
  uint64_t data_start_ = 0;  // absolute file offset of the data section, known after Begin
  bool begun_ = false;       // Begin was called (successfully or not): metadata and tensors are frozen
  Status misuse_;            // a Set() after Begin, reported by WriteTensorData/Finish since Set returns nothing
};

}  // namespace nflash
