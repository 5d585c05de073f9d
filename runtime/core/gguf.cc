// GGUF reader and writer: one encode/decode pair per primitive, a buffered cursor over ReadableFile, full validation.
#include "runtime/core/gguf.h"

#include <algorithm>
#include <bit>
#include <cctype>
#include <cstdio>
#include <cstring>
#include <limits>
#include <new>
#include <stdexcept>

#include "runtime/core/heap_bytes.h"
#include "runtime/core/round.h"

namespace nflash {
namespace {

// The cursor's read buffer: a 32000-string vocabulary (~700 KB) costs a dozen ReadAt calls instead of 64000.
constexpr size_t kCursorBufferBytes = 64 * 1024;
// Smallest encodings, used to bound counts by the bytes left in the file before anything is allocated.
// A KV: key length (8) + at least one key byte + value type (4) + the smallest value (u8/i8/bool: 1).
constexpr uint64_t kMinKvBytes = 8 + 1 + 4 + 1;
// A tensor info: name length (8) + at least one name byte + n_dims (4) + one dim (8) + type (4) + offset (8).
constexpr uint64_t kMinTensorInfoBytes = 8 + 1 + 4 + 8 + 4 + 8;
// Counts from the file only pre-size vectors up to this; beyond it they grow as entries actually parse.
constexpr uint64_t kMaxReserve = 4096;
constexpr uint32_t kGgufTypeCount = 13;  // value type ids 0..12 in GGUF v2/v3
constexpr const char* kAlignmentKey = "general.alignment";

// ---- Primitives: one encoder and one decoder each, shared by reader and writer. All little-endian. ----

template <size_t N> struct UnsignedOfSize;
template <> struct UnsignedOfSize<1> { using type = uint8_t; };
template <> struct UnsignedOfSize<2> { using type = uint16_t; };
template <> struct UnsignedOfSize<4> { using type = uint32_t; };
template <> struct UnsignedOfSize<8> { using type = uint64_t; };

// Integers and floats (bit pattern) of any width; bool as one byte 0/1.
template <typename T>
void PutFixed(std::vector<uint8_t>* dst, T v) {
  using U = typename UnsignedOfSize<sizeof(T)>::type;
  U u;
  if constexpr (std::is_same_v<T, bool>) {
    u = v ? 1 : 0;
  } else {
    u = std::bit_cast<U>(v);
  }
  for (size_t i = 0; i < sizeof(T); ++i) dst->push_back(static_cast<uint8_t>(u >> (8 * i)));
}

// Decodes what PutFixed wrote; not for bool (a byte other than 0/1 must be rejected, see Parser::ReadScalar).
template <typename T>
T DecodeFixed(const uint8_t* p) {
  static_assert(!std::is_same_v<T, bool>);
  using U = typename UnsignedOfSize<sizeof(T)>::type;
  U u = 0;
  for (size_t i = 0; i < sizeof(T); ++i) u = static_cast<U>(u | (static_cast<U>(p[i]) << (8 * i)));
  return std::bit_cast<T>(u);
}

// gguf string: u64 length + bytes, no terminator.
void PutString(std::vector<uint8_t>* dst, std::string_view s) {
  PutFixed<uint64_t>(dst, s.size());
  dst->insert(dst->end(), s.begin(), s.end());
}

// A value without its type tag (the tag precedes it in a KV; array elements carry none).
void PutValue(std::vector<uint8_t>* dst, const GgufValue& value) {
  std::visit(
      [dst](const auto& x) {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, std::string>) {
          PutString(dst, x);
        } else if constexpr (std::is_same_v<T, GgufArray>) {
          PutFixed<uint32_t>(dst, static_cast<uint32_t>(x.element_type));
          PutFixed<uint64_t>(dst, x.items.size());
          for (const GgufValue& item : x.items) PutValue(dst, item);
        } else {
          PutFixed<T>(dst, x);
        }
      },
      value.v);
}

// Smallest encoding of one value of each type, indexed by type id: bounds array counts by the bytes left. A string
// needs at least its u64 length, an array its element type and count (12).
constexpr uint64_t kMinEncodedBytes[kGgufTypeCount] = {1, 1, 2, 2, 4, 4, 4, 1, 8, 12, 8, 8, 8};
uint64_t MinEncodedBytes(GgufType type) { return kMinEncodedBytes[static_cast<uint32_t>(type)]; }

bool IsPowerOfTwo(uint64_t x) { return x != 0 && (x & (x - 1)) == 0; }

// A name or key from the file, quoted for a message: at most 80 bytes, non-printable bytes escaped.
std::string Quote(std::string_view s) {
  constexpr size_t kMaxQuoted = 80;  // keeps a hostile 1 MB key out of the message
  std::string out = "'";
  for (size_t i = 0; i < s.size() && i < kMaxQuoted; ++i) {
    auto c = static_cast<unsigned char>(s[i]);
    if (std::isprint(c) && c != '\'') {
      out += static_cast<char>(c);
    } else {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", c);
      out += buf;
    }
  }
  if (s.size() > kMaxQuoted) out += "...";
  return out + "'";
}

// ---- Reader ----

// Parses one file front to back through ReadAt with a small read buffer (Data() is never needed). Errors name the
// file, the item being parsed (context_ + array indices), the field, its absolute byte offset, and the expected vs.
// found value. Thread-safety: one Parser per Open call, used by one thread.
class Parser {
 public:
  explicit Parser(const ReadableFile& file)
      : file_(file), size_(file.Size()), buf_(static_cast<size_t>(std::min<uint64_t>(kCursorBufferBytes, size_))) {}

  Status Parse(uint32_t* version, uint32_t* alignment, uint64_t* data_offset,
               std::vector<std::pair<std::string, GgufValue>>* kv,
               std::map<std::string, size_t, std::less<>>* kv_index, std::vector<GgufTensorInfo>* tensors,
               std::map<std::string, size_t, std::less<>>* tensor_index);

 private:
  Status Corrupt(std::string_view field, uint64_t at, const std::string& expected, const std::string& found) const {
    return Status::Corruption(Where(field, at) + ": expected " + expected + ", found " + found);
  }
  std::string Where(std::string_view field, uint64_t at) const {
    std::string s = file_.Path() + ": ";
    if (!context_.empty()) {
      s += context_;
      for (uint64_t i : indices_) s.append("[").append(std::to_string(i)).append("]");
      s += " ";
    }
    return s.append(field).append(" at offset ").append(std::to_string(at));
  }

  // Copies n bytes at the cursor and advances; a read past the end names the field.
  Status ReadBytes(void* dst, uint64_t n, std::string_view field) {
    if (n > size_ - pos_) {
      return Corrupt(field, pos_, std::to_string(n) + " bytes", "only " + std::to_string(size_ - pos_) +
                                                                    " left before the end of the file (truncated)");
    }
    auto* out = static_cast<uint8_t*>(dst);
    while (n > 0) {
      if (pos_ >= buf_start_ && pos_ < buf_start_ + buf_len_) {
        size_t off = static_cast<size_t>(pos_ - buf_start_);
        size_t take = static_cast<size_t>(std::min<uint64_t>(n, buf_len_ - off));
        std::memcpy(out, buf_.data() + off, take);
        out += take;
        pos_ += take;
        n -= take;
        continue;
      }
      if (n >= buf_.size()) {  // a large read goes straight to the file
        NF_RETURN_IF_ERROR(file_.ReadAt(pos_, static_cast<size_t>(n), out));
        pos_ += n;
        return Status::Ok();
      }
      size_t fill = static_cast<size_t>(std::min<uint64_t>(buf_.size(), size_ - pos_));
      NF_RETURN_IF_ERROR(file_.ReadAt(pos_, fill, buf_.data()));
      buf_start_ = pos_;
      buf_len_ = fill;
    }
    return Status::Ok();
  }

  template <typename T>
  Status ReadFixed(T* out, std::string_view field) {
    uint8_t bytes[sizeof(T)];
    NF_RETURN_IF_ERROR(ReadBytes(bytes, sizeof(T), field));
    *out = DecodeFixed<T>(bytes);
    return Status::Ok();
  }

  Status ReadString(std::string* out, std::string_view field) {
    uint64_t at = pos_;
    uint64_t len = 0;
    NF_RETURN_IF_ERROR(ReadFixed(&len, std::string(field) + " length"));
    if (len > size_ - pos_) {
      return Corrupt(std::string(field) + " length", at,
                     "at most " + std::to_string(size_ - pos_) + " (the bytes left in the file)", std::to_string(len));
    }
    out->resize(static_cast<size_t>(len));
    return ReadBytes(out->data(), len, field);
  }

  // Reads a GGUF type id (value or array element type).
  Status ReadTypeId(GgufType* out, std::string_view field) {
    uint64_t at = pos_;
    uint32_t id = 0;
    NF_RETURN_IF_ERROR(ReadFixed(&id, field));
    if (id >= kGgufTypeCount) {
      return Corrupt(field, at, "a GGUF value type id 0..12", std::to_string(id));
    }
    *out = static_cast<GgufType>(id);
    return Status::Ok();
  }

  template <typename T>
  Status ReadScalar(GgufValue* out) {
    if constexpr (std::is_same_v<T, bool>) {
      uint64_t at = pos_;
      uint8_t b = 0;
      NF_RETURN_IF_ERROR(ReadBytes(&b, 1, "bool value"));
      if (b > 1) return Corrupt("bool value", at, "0 or 1", std::to_string(b));
      out->v = b == 1;
    } else {
      T x{};
      NF_RETURN_IF_ERROR(ReadFixed(&x, "value"));
      out->v = x;
    }
    return Status::Ok();
  }

  Status ReadValue(GgufType type, int depth, GgufValue* out) {
    switch (type) {
      case GgufType::kUint8: return ReadScalar<uint8_t>(out);
      case GgufType::kInt8: return ReadScalar<int8_t>(out);
      case GgufType::kUint16: return ReadScalar<uint16_t>(out);
      case GgufType::kInt16: return ReadScalar<int16_t>(out);
      case GgufType::kUint32: return ReadScalar<uint32_t>(out);
      case GgufType::kInt32: return ReadScalar<int32_t>(out);
      case GgufType::kFloat32: return ReadScalar<float>(out);
      case GgufType::kBool: return ReadScalar<bool>(out);
      case GgufType::kUint64: return ReadScalar<uint64_t>(out);
      case GgufType::kInt64: return ReadScalar<int64_t>(out);
      case GgufType::kFloat64: return ReadScalar<double>(out);
      case GgufType::kString: {
        std::string s;
        NF_RETURN_IF_ERROR(ReadString(&s, "string"));
        out->v = std::move(s);
        return Status::Ok();
      }
      case GgufType::kArray: {
        GgufArray array;
        NF_RETURN_IF_ERROR(ReadArray(depth + 1, &array));
        out->v = std::move(array);
        return Status::Ok();
      }
    }
    return Status::Internal("unhandled GGUF type");
  }

  Status ReadArray(int depth, GgufArray* out) {
    uint64_t at = pos_;
    if (depth > kGgufMaxArrayDepth) {
      return Status::Unsupported(Where("array", at) + ": arrays nested more than " +
                                 std::to_string(kGgufMaxArrayDepth) + " deep are not supported");
    }
    NF_RETURN_IF_ERROR(ReadTypeId(&out->element_type, "array element type"));
    at = pos_;
    uint64_t count = 0;
    NF_RETURN_IF_ERROR(ReadFixed(&count, "array count"));
    uint64_t min_bytes = MinEncodedBytes(out->element_type);
    if (count > (size_ - pos_) / min_bytes) {
      return Corrupt("array count", at,
                     "at most " + std::to_string((size_ - pos_) / min_bytes) + " " +
                         std::string(GgufTypeName(out->element_type)) + " elements (the bytes left in the file)",
                     std::to_string(count));
    }
    values_ += count;
    if (values_ > kGgufMaxMetadataValues) {
      return Status::ResourceExhausted(Where("array count", at) + ": the metadata holds more than " +
                                       std::to_string(kGgufMaxMetadataValues) + " values, nflash's memory bound");
    }
    out->items.resize(static_cast<size_t>(count));
    indices_.push_back(0);
    for (uint64_t i = 0; i < count; ++i) {
      indices_.back() = i;
      NF_RETURN_IF_ERROR(ReadValue(out->element_type, depth, &out->items[i]));
    }
    indices_.pop_back();
    return Status::Ok();
  }

  const ReadableFile& file_;
  const uint64_t size_;
  uint64_t pos_ = 0;
  std::vector<uint8_t> buf_;
  uint64_t buf_start_ = 0;
  size_t buf_len_ = 0;
  std::string context_;           // the item being parsed, e.g. "metadata key 'general.name'"
  std::vector<uint64_t> indices_;  // array indices inside the current value
  uint64_t values_ = 0;           // metadata values read so far (memory bound)
};

Status Parser::Parse(uint32_t* version, uint32_t* alignment, uint64_t* data_offset,
                     std::vector<std::pair<std::string, GgufValue>>* kv,
                     std::map<std::string, size_t, std::less<>>* kv_index, std::vector<GgufTensorInfo>* tensors,
                     std::map<std::string, size_t, std::less<>>* tensor_index) {
  // 1. Header.
  uint8_t magic[4];
  NF_RETURN_IF_ERROR(ReadBytes(magic, 4, "magic"));
  if (DecodeFixed<uint32_t>(magic) != kGgufMagic) {
    char found[64];
    std::snprintf(found, sizeof(found), "%02x %02x %02x %02x", magic[0], magic[1], magic[2], magic[3]);
    return Corrupt("magic", 0, "\"GGUF\" (47 47 55 46)", found);
  }
  NF_RETURN_IF_ERROR(ReadFixed(version, "version"));
  if (*version != 2 && *version != 3) {
    std::string note = *version == 1 ? " (GGUF v1 used 32-bit counts and is not supported)" : "";
    // A v3 file written on a big-endian machine reads as 0x03000000: its low 16 bits are zero.
    if (*version != 0 && (*version & 0xFFFF) == 0) note = " (a big-endian file? only little-endian is supported)";
    return Status::Unsupported(Where("version", 4) + ": expected 2 or 3, found " + std::to_string(*version) + note);
  }
  uint64_t tensor_count = 0;
  uint64_t kv_count = 0;
  NF_RETURN_IF_ERROR(ReadFixed(&tensor_count, "tensor_count"));
  NF_RETURN_IF_ERROR(ReadFixed(&kv_count, "metadata_kv_count"));
  // Plausibility: every entry needs a minimum number of bytes, so a huge count fails here instead of allocating.
  const uint64_t left = size_ - pos_;
  if (kv_count > left / kMinKvBytes) {
    return Corrupt("metadata_kv_count", 16,
                   "at most " + std::to_string(left / kMinKvBytes) + " (" + std::to_string(left) +
                       " bytes left, at least " + std::to_string(kMinKvBytes) + " per entry)",
                   std::to_string(kv_count));
  }
  const uint64_t left_for_tensors = left - kv_count * kMinKvBytes;
  if (tensor_count > left_for_tensors / kMinTensorInfoBytes) {
    return Corrupt("tensor_count", 8,
                   "at most " + std::to_string(left_for_tensors / kMinTensorInfoBytes) + " (" +
                       std::to_string(left_for_tensors) + " bytes left after the metadata, at least " +
                       std::to_string(kMinTensorInfoBytes) + " per tensor info)",
                   std::to_string(tensor_count));
  }

  // 2. Metadata.
  kv->reserve(static_cast<size_t>(std::min(kv_count, kMaxReserve)));
  for (uint64_t i = 0; i < kv_count; ++i) {
    context_ = "metadata key #" + std::to_string(i);
    uint64_t key_at = pos_;
    std::string key;
    NF_RETURN_IF_ERROR(ReadString(&key, "key"));
    if (key.empty()) return Corrupt("key", key_at, "a non-empty key", "an empty key");
    context_ = "metadata key " + Quote(key);
    if (auto it = kv_index->find(key); it != kv_index->end()) {
      return Corrupt("key", key_at, "unique keys", "a duplicate of key #" + std::to_string(it->second));
    }
    GgufType type{};
    NF_RETURN_IF_ERROR(ReadTypeId(&type, "value type"));
    uint64_t value_at = pos_;
    GgufValue value;
    if (type == GgufType::kArray) {
      GgufArray array;
      NF_RETURN_IF_ERROR(ReadArray(1, &array));
      value.v = std::move(array);
    } else {
      ++values_;
      NF_RETURN_IF_ERROR(ReadValue(type, 0, &value));
    }
    if (key == kAlignmentKey) {
      if (type != GgufType::kUint32) {
        return Corrupt("value type", value_at - 4, "uint32 (ggml reads general.alignment as one)",
                       std::string(GgufTypeName(type)));
      }
      uint32_t a = std::get<uint32_t>(value.v);
      if (!IsPowerOfTwo(a)) return Corrupt("value", value_at, "a nonzero power of two", std::to_string(a));
      *alignment = a;
    }
    (*kv_index)[key] = kv->size();
    kv->emplace_back(std::move(key), std::move(value));
  }

  // 3. Tensor directory. ggml requires the tensors to be packed in directory order: each offset equals the sum of
  // the padded sizes of the tensors before it (llama.cpp's gguf.cpp: `ti.offset != ctx->size`), which also rules
  // out overlaps and gaps.
  tensors->reserve(static_cast<size_t>(std::min(tensor_count, kMaxReserve)));
  std::vector<uint64_t> offset_field_at;
  uint64_t expected_offset = 0;
  for (uint64_t i = 0; i < tensor_count; ++i) {
    context_ = "tensor #" + std::to_string(i);
    GgufTensorInfo t;
    uint64_t at = pos_;
    NF_RETURN_IF_ERROR(ReadString(&t.name, "name"));
    if (t.name.empty()) return Corrupt("name", at, "a non-empty name", "an empty name");
    if (t.name.size() > kGgufMaxTensorNameBytes) {
      return Corrupt("name", at,
                     "at most " + std::to_string(kGgufMaxTensorNameBytes) + " bytes (ggml's GGML_MAX_NAME - 1)",
                     std::to_string(t.name.size()) + " bytes");
    }
    context_ = "tensor " + Quote(t.name);
    if (auto it = tensor_index->find(t.name); it != tensor_index->end()) {
      return Corrupt("name", at, "unique tensor names", "a duplicate of tensor #" + std::to_string(it->second));
    }
    at = pos_;
    uint32_t n_dims = 0;
    NF_RETURN_IF_ERROR(ReadFixed(&n_dims, "n_dims"));
    if (n_dims == 0 || n_dims > kGgufMaxDims) {
      return Corrupt("n_dims", at, "1.." + std::to_string(kGgufMaxDims), std::to_string(n_dims));
    }
    const uint64_t dims_at = pos_;
    t.dims.resize(n_dims);
    t.n_elements = 1;
    bool overflow = false;
    for (uint32_t j = 0; j < n_dims; ++j) {
      at = pos_;
      std::string field = "dims[" + std::to_string(j) + "]";
      NF_RETURN_IF_ERROR(ReadFixed(&t.dims[j], field));
      if (t.dims[j] > static_cast<uint64_t>(INT64_MAX)) {
        return Corrupt(field, at, "at most INT64_MAX (ggml reads dims as int64)", std::to_string(t.dims[j]));
      }
      overflow = overflow || __builtin_mul_overflow(t.n_elements, t.dims[j], &t.n_elements);
    }
    if (overflow || t.n_elements > static_cast<uint64_t>(INT64_MAX)) {
      std::string shape;
      for (uint64_t d : t.dims) shape += (shape.empty() ? "" : " x ") + std::to_string(d);
      return Corrupt("dims", dims_at, "an element count of at most INT64_MAX (as ggml requires)",
                     shape + (overflow ? ", whose product overflows 64 bits" : ""));
    }
    at = pos_;
    uint32_t type_id = 0;
    NF_RETURN_IF_ERROR(ReadFixed(&type_id, "type"));
    std::optional<GgmlTypeInfo> type_info = LookupGgmlType(type_id);
    if (!type_info) {
      return Status::Unsupported(Where("type", at) + ": ggml type id " + std::to_string(type_id) +
                                 " is not supported by nflash (its block size is unknown)");
    }
    t.type = type_info->type;
    if (t.dims[0] % type_info->block_size != 0) {
      return Corrupt("dims[0] (row length)", dims_at,
                     "a multiple of the " + std::string(type_info->name) + " block size " +
                         std::to_string(type_info->block_size),
                     std::to_string(t.dims[0]));
    }
    std::optional<uint64_t> n_bytes = RowBytes(t.type, t.n_elements);
    uint64_t padded = 0;
    if (!n_bytes || __builtin_add_overflow(*n_bytes, uint64_t{*alignment - 1}, &padded)) {
      return Corrupt("dims", dims_at, "a byte size below 2^64", std::to_string(t.n_elements) + " elements of " +
                                                                    std::string(type_info->name));
    }
    t.n_bytes = *n_bytes;
    padded = padded / *alignment * *alignment;
    at = pos_;
    NF_RETURN_IF_ERROR(ReadFixed(&t.offset, "offset"));
    if (t.offset % *alignment != 0) {
      return Corrupt("offset", at, "a multiple of the alignment " + std::to_string(*alignment),
                     std::to_string(t.offset));
    }
    if (t.offset != expected_offset) {
      return Corrupt("offset", at,
                     std::to_string(expected_offset) +
                         " (the sum of the padded sizes of the tensors before it: ggml requires tensors packed in "
                         "directory order, without overlaps or gaps)",
                     std::to_string(t.offset));
    }
    if (__builtin_add_overflow(expected_offset, padded, &expected_offset)) {
      return Corrupt("dims", dims_at, "a data section smaller than 2^64 bytes", "a sum that overflows");
    }
    offset_field_at.push_back(at);
    (*tensor_index)[t.name] = tensors->size();
    tensors->push_back(std::move(t));
  }
  context_.clear();

  // 4. Padding, 5. data: the data section starts at the next multiple of the alignment. Every tensor must lie inside
  // the file; the padding after the last tensor (and after the directory when there is no data) is not required.
  *data_offset = RoundUp<uint64_t>(pos_, *alignment);
  for (size_t i = 0; i < tensors->size(); ++i) {
    const GgufTensorInfo& t = (*tensors)[i];
    if (t.n_bytes == 0) continue;  // a zero-size tensor has no bytes to check
    uint64_t start = 0;
    uint64_t end = 0;
    if (__builtin_add_overflow(*data_offset, t.offset, &start) || __builtin_add_overflow(start, t.n_bytes, &end) ||
        end > size_) {
      context_ = "tensor " + Quote(t.name);
      return Corrupt("data", start,
                     std::to_string(t.n_bytes) + " bytes ending within the file (size " + std::to_string(size_) + ")",
                     "an end at " + (end < start ? std::string("an offset beyond 2^64") : std::to_string(end)) +
                         " (offset field at " + std::to_string(offset_field_at[i]) + ")");
    }
  }
  return Status::Ok();
}

}  // namespace

std::string_view GgufTypeName(GgufType type) {
  static constexpr std::string_view kNames[kGgufTypeCount] = {"uint8", "int8",   "uint16", "int16", "uint32",
                                                              "int32", "float32", "bool",  "string", "array",
                                                              "uint64", "int64", "float64"};
  auto id = static_cast<uint32_t>(type);
  return id < kGgufTypeCount ? kNames[id] : "unknown";
}

Result<GgufFile> GgufFile::Open(std::shared_ptr<const ReadableFile> file) {
  if (!file) return Status::InvalidArgument("GgufFile::Open: null file");
  GgufFile g;
  g.file_ = std::move(file);
  try {
    Parser parser(*g.file_);
    NF_RETURN_IF_ERROR(parser.Parse(&g.version_, &g.alignment_, &g.data_offset_, &g.kv_, &g.kv_index_,
                                    &g.tensors_, &g.tensor_index_));
  } catch (const std::bad_alloc&) {
    return Status::ResourceExhausted(g.file_->Path() + ": out of memory while parsing the GGUF metadata");
  } catch (const std::length_error&) {
    return Status::ResourceExhausted(g.file_->Path() + ": a GGUF metadata value is too large to hold in memory");
  }
  return g;
}

Result<GgufFile> GgufFile::OpenPath(const std::string& path, bool use_mmap) {
  std::unique_ptr<ReadableFile> file;
  if (use_mmap) {
    NF_ASSIGN_OR_RETURN(file, OpenMmapFile(path));
  } else {
    NF_ASSIGN_OR_RETURN(file, OpenPreadFile(path));
  }
  return Open(std::shared_ptr<const ReadableFile>(std::move(file)));
}

Result<GgufFile> GgufFile::OpenPathUncached(const std::string& path) {
  NF_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file, OpenUncachedPreadFile(path));
  return Open(std::shared_ptr<const ReadableFile>(std::move(file)));
}

Result<GgufFile> GgufFile::Rebind(std::shared_ptr<const ReadableFile> file) && {
  if (file->Size() != file_->Size()) {
    return Status::Corruption(file->Path() + ": " + std::to_string(file->Size()) +
                              " bytes, but its directory was parsed from " + file_->Path() + " of " +
                              std::to_string(file_->Size()) + " bytes");
  }
  file_ = std::move(file);
  return std::move(*this);
}

const GgufValue* GgufFile::Find(std::string_view key) const {
  auto it = kv_index_.find(key);
  return it == kv_index_.end() ? nullptr : &kv_[it->second].second;
}

namespace {

Status MissingKey(const std::string& path, std::string_view key) {
  return Status::NotFound(path + ": metadata key " + Quote(key) + " not found");
}

Status WrongType(const std::string& path, std::string_view key, std::string_view expected, const GgufValue& v,
                 const std::string& detail = "") {
  return Status::Corruption(path + ": metadata key " + Quote(key) + ": expected " + std::string(expected) +
                            ", found " + std::string(GgufTypeName(v.type())) + detail);
}

}  // namespace

Result<std::string> GgufFile::GetString(std::string_view key) const {
  const GgufValue* v = Find(key);
  if (!v) return MissingKey(path(), key);
  if (const auto* s = std::get_if<std::string>(&v->v)) return *s;
  return WrongType(path(), key, "string", *v);
}

Result<uint64_t> GgufFile::GetUint(std::string_view key) const {
  const GgufValue* v = Find(key);
  if (!v) return MissingKey(path(), key);
  return std::visit(
      [&](const auto& x) -> Result<uint64_t> {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
          if constexpr (std::is_signed_v<T>) {
            if (x < 0) return WrongType(path(), key, "an unsigned integer", *v, " " + std::to_string(x));
          }
          return static_cast<uint64_t>(x);
        } else {
          return WrongType(path(), key, "an integer type", *v);
        }
      },
      v->v);
}

Result<int64_t> GgufFile::GetInt(std::string_view key) const {
  const GgufValue* v = Find(key);
  if (!v) return MissingKey(path(), key);
  return std::visit(
      [&](const auto& x) -> Result<int64_t> {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
          if constexpr (std::is_same_v<T, uint64_t>) {
            if (x > static_cast<uint64_t>(INT64_MAX)) {
              return WrongType(path(), key, "an integer that fits int64", *v, " " + std::to_string(x));
            }
          }
          return static_cast<int64_t>(x);
        } else {
          return WrongType(path(), key, "an integer type", *v);
        }
      },
      v->v);
}

Result<double> GgufFile::GetFloat(std::string_view key) const {
  const GgufValue* v = Find(key);
  if (!v) return MissingKey(path(), key);
  if (const auto* f = std::get_if<float>(&v->v)) return static_cast<double>(*f);
  if (const auto* d = std::get_if<double>(&v->v)) return *d;
  return WrongType(path(), key, "float32 or float64", *v);
}

Result<bool> GgufFile::GetBool(std::string_view key) const {
  const GgufValue* v = Find(key);
  if (!v) return MissingKey(path(), key);
  if (const auto* b = std::get_if<bool>(&v->v)) return *b;
  return WrongType(path(), key, "bool", *v);
}

Result<const GgufArray*> GgufFile::GetArray(std::string_view key) const {
  const GgufValue* v = Find(key);
  if (!v) return MissingKey(path(), key);
  if (const auto* a = std::get_if<GgufArray>(&v->v)) return a;
  return WrongType(path(), key, "array", *v);
}

const GgufTensorInfo* GgufFile::FindTensor(std::string_view name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

Result<std::span<const uint8_t>> GgufFile::TensorData(const GgufTensorInfo& info,
                                                      std::vector<uint8_t>* scratch) const {
  // Open validated every tensor of this file; this guards against an info from another file.
  uint64_t start = 0;
  uint64_t end = 0;
  if (__builtin_add_overflow(data_offset_, info.offset, &start) || __builtin_add_overflow(start, info.n_bytes, &end) ||
      (info.n_bytes > 0 && end > file_->Size())) {
    return Status::InvalidArgument(path() + ": tensor " + Quote(info.name) + " data [" + std::to_string(start) +
                                   ", +" + std::to_string(info.n_bytes) + ") is outside the file (size " +
                                   std::to_string(file_->Size()) + ")");
  }
  if (info.n_bytes == 0) return std::span<const uint8_t>();
  if (const uint8_t* data = file_->Data()) return std::span<const uint8_t>(data + start, info.n_bytes);
  scratch->resize(static_cast<size_t>(info.n_bytes));
  NF_RETURN_IF_ERROR(file_->ReadAt(start, scratch->size(), scratch->data()));
  return std::span<const uint8_t>(scratch->data(), scratch->size());
}

// ---- Writer ----

namespace {

// A value the writer can encode so that the reader accepts it: arrays homogeneous and not nested too deep.
Status CheckValue(std::string_view key, const GgufValue& v, int depth) {
  const auto* array = std::get_if<GgufArray>(&v.v);
  if (!array) return Status::Ok();
  if (depth > kGgufMaxArrayDepth) {
    return Status::InvalidArgument("metadata key " + Quote(key) + ": arrays nested more than " +
                                   std::to_string(kGgufMaxArrayDepth) + " deep cannot be read back");
  }
  for (size_t i = 0; i < array->items.size(); ++i) {
    if (array->items[i].type() != array->element_type) {
      return Status::InvalidArgument("metadata key " + Quote(key) + ": element " + std::to_string(i) + " is " +
                                     std::string(GgufTypeName(array->items[i].type())) + ", the array holds " +
                                     std::string(GgufTypeName(array->element_type)));
    }
    NF_RETURN_IF_ERROR(CheckValue(key, array->items[i], depth + 1));
  }
  return Status::Ok();
}

}  // namespace

GgufWriter::GgufWriter() = default;
GgufWriter::~GgufWriter() = default;

void GgufWriter::Set(std::string key, GgufValue value) {
  if (begun_) {
    if (misuse_.ok()) misuse_ = Status::InvalidArgument("GgufWriter: Set(" + Quote(key) + ") after Begin");
    return;
  }
  for (auto& [k, v] : kv_) {
    if (k == key) {
      v = std::move(value);
      return;
    }
  }
  kv_.emplace_back(std::move(key), std::move(value));
}

Status GgufWriter::AddTensor(std::string name, GgmlType type, std::vector<uint64_t> dims) {
  if (begun_) return Status::InvalidArgument("GgufWriter: AddTensor(" + Quote(name) + ") after Begin");
  if (name.empty()) return Status::InvalidArgument("GgufWriter: a tensor name must not be empty");
  if (name.size() > kGgufMaxTensorNameBytes) {
    return Status::InvalidArgument("GgufWriter: tensor name " + Quote(name) + " has " + std::to_string(name.size()) +
                                   " bytes, at most " + std::to_string(kGgufMaxTensorNameBytes) +
                                   " (ggml's GGML_MAX_NAME - 1)");
  }
  for (const GgufTensorInfo& t : tensors_) {
    if (t.name == name) return Status::InvalidArgument("GgufWriter: duplicate tensor name " + Quote(name));
  }
  if (dims.empty() || dims.size() > kGgufMaxDims) {
    return Status::InvalidArgument("GgufWriter: tensor " + Quote(name) + " has " + std::to_string(dims.size()) +
                                   " dims, expected 1.." + std::to_string(kGgufMaxDims));
  }
  const GgmlTypeInfo& info = TypeInfo(type);
  if (dims[0] % info.block_size != 0) {
    return Status::InvalidArgument("GgufWriter: tensor " + Quote(name) + " row length " + std::to_string(dims[0]) +
                                   " is not a multiple of the " + std::string(info.name) + " block size " +
                                   std::to_string(info.block_size));
  }
  uint64_t n = 1;
  for (uint64_t d : dims) {
    if (__builtin_mul_overflow(n, d, &n) || n > static_cast<uint64_t>(INT64_MAX)) {
      return Status::InvalidArgument("GgufWriter: tensor " + Quote(name) + " has more than INT64_MAX elements");
    }
  }
  std::optional<uint64_t> bytes = RowBytes(type, n);
  if (!bytes) return Status::InvalidArgument("GgufWriter: tensor " + Quote(name) + " byte size overflows");
  GgufTensorInfo t;
  t.name = std::move(name);
  t.dims = std::move(dims);
  t.type = type;
  t.n_elements = n;
  t.n_bytes = *bytes;
  tensors_.push_back(std::move(t));
  return Status::Ok();
}

Status GgufWriter::Begin(const std::string& path, bool overwrite) {
  if (begun_) return Status::InvalidArgument("GgufWriter: Begin(" + path + ") called twice");
  begun_ = true;
  alignment_ = kGgufDefaultAlignment;
  for (const auto& [key, value] : kv_) {
    if (key.empty()) return Status::InvalidArgument(path + ": metadata keys must not be empty");
    NF_RETURN_IF_ERROR(CheckValue(key, value, 1).WithContext(path));
    if (key == kAlignmentKey) {
      const auto* a = std::get_if<uint32_t>(&value.v);
      if (!a) {
        return Status::InvalidArgument(path + ": general.alignment must be a uint32 (ggml reads it as one), given " +
                                       std::string(GgufTypeName(value.type())));
      }
      if (!IsPowerOfTwo(*a)) {
        return Status::InvalidArgument(path + ": general.alignment must be a nonzero power of two, given " +
                                       std::to_string(*a));
      }
      alignment_ = *a;
    }
  }
  // Offsets: the running sum of padded sizes, exactly what the reader (and ggml) requires.
  uint64_t offset = 0;
  for (GgufTensorInfo& t : tensors_) {
    t.offset = offset;
    if (t.n_bytes > UINT64_MAX - offset - alignment_) {
      return Status::InvalidArgument(path + ": the data section would exceed 2^64 bytes at tensor " + Quote(t.name));
    }
    offset += RoundUp<uint64_t>(t.n_bytes, alignment_);
  }

  std::vector<uint8_t> head;
  PutFixed<uint32_t>(&head, kGgufMagic);
  PutFixed<uint32_t>(&head, kGgufVersion);
  PutFixed<uint64_t>(&head, tensors_.size());
  PutFixed<uint64_t>(&head, kv_.size());
  for (const auto& [key, value] : kv_) {
    PutString(&head, key);
    PutFixed<uint32_t>(&head, static_cast<uint32_t>(value.type()));
    PutValue(&head, value);
  }
  for (const GgufTensorInfo& t : tensors_) {
    PutString(&head, t.name);
    PutFixed<uint32_t>(&head, static_cast<uint32_t>(t.dims.size()));
    for (uint64_t d : t.dims) PutFixed<uint64_t>(&head, d);
    PutFixed<uint32_t>(&head, static_cast<uint32_t>(t.type));
    PutFixed<uint64_t>(&head, t.offset);
  }
  NF_ASSIGN_OR_RETURN(out_, AtomicFileWriter::Create(path, overwrite));
  Status s = out_->Append(head.data(), head.size());
  if (s.ok()) s = out_->PadTo(alignment_);
  if (!s.ok()) {
    out_.reset();  // removes the temporary file
    return s;
  }
  data_start_ = out_->Offset();
  next_tensor_ = 0;
  return Status::Ok();
}

Status GgufWriter::WriteTensorData(std::string_view name, std::span<const uint8_t> bytes) {
  NF_RETURN_IF_ERROR(misuse_);
  if (!out_) return Status::InvalidArgument("GgufWriter: WriteTensorData(" + Quote(name) + ") without a successful Begin");
  const std::string& path = out_->path();
  if (next_tensor_ >= tensors_.size()) {
    return Status::InvalidArgument(path + ": tensor " + Quote(name) + " written, but all " +
                                   std::to_string(tensors_.size()) + " declared tensors were already written");
  }
  const GgufTensorInfo& t = tensors_[next_tensor_];
  if (name != t.name) {
    return Status::InvalidArgument(path + ": expected tensor " + Quote(t.name) + " next (declaration order), given " +
                                   Quote(name));
  }
  if (bytes.size() != t.n_bytes) {
    return Status::InvalidArgument(path + ": tensor " + Quote(t.name) + ": expected " + std::to_string(t.n_bytes) +
                                   " bytes, given " + std::to_string(bytes.size()));
  }
  if (out_->Offset() != data_start_ + t.offset) {
    return Status::Internal(path + ": tensor " + Quote(t.name) + " would land at " + std::to_string(out_->Offset()) +
                            ", its directory entry says " + std::to_string(data_start_ + t.offset));
  }
  NF_RETURN_IF_ERROR(out_->Append(bytes.data(), bytes.size()));
  NF_RETURN_IF_ERROR(out_->PadTo(alignment_));
  ++next_tensor_;
  return Status::Ok();
}

Status GgufWriter::Finish() {
  NF_RETURN_IF_ERROR(misuse_);
  if (!out_) return Status::InvalidArgument("GgufWriter: Finish without a successful Begin");
  if (next_tensor_ < tensors_.size()) {
    return Status::InvalidArgument(out_->path() + ": tensor " + Quote(tensors_[next_tensor_].name) + " (#" +
                                   std::to_string(next_tensor_) + " of " + std::to_string(tensors_.size()) +
                                   ") was never written");
  }
  NF_RETURN_IF_ERROR(out_->Commit());
  out_.reset();
  return Status::Ok();
}

namespace {

// The heap `v` holds beyond its own sizeof: a string's buffer, an array's items and theirs.
uint64_t ValueHeapBytes(const GgufValue& v) {
  if (const std::string* str = std::get_if<std::string>(&v.v)) return StringHeapBytes(*str);
  if (const GgufArray* a = std::get_if<GgufArray>(&v.v)) {
    uint64_t bytes = HeapChunk(a->items.capacity() * sizeof(GgufValue));
    for (const GgufValue& item : a->items) bytes += ValueHeapBytes(item);
    return bytes;
  }
  return 0;
}

}  // namespace

uint64_t GgufFile::MetadataHeapBytes() const {
  uint64_t bytes = HeapChunk(kv_.capacity() * sizeof(kv_[0]));
  for (const auto& [key, value] : kv_) bytes += StringHeapBytes(key) + ValueHeapBytes(value);
  return bytes;
}

}  // namespace nflash
