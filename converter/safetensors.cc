// Safetensors reader: header parsing and validation, tensor reads with F16/BF16 widening.
#include "converter/safetensors.h"

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>

#include "runtime/core/float16.h"

namespace nflash::converter {
namespace {

using nlohmann::json;

// Every safetensors dtype name in the format's specification, so that a valid but unconverted dtype is reported as
// Unsupported and anything else as Corruption.
constexpr const char* kOtherKnownDtypes[] = {"F64", "I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8", "BOOL",
                                             "F8_E4M3", "F8_E5M2", "F8_E8M0", "F6_E2M3", "F6_E3M2", "F4", "C64"};

std::string Quote(std::string_view s) {
  std::string q;
  q.reserve(s.size() + 2);
  q.push_back('"');
  q.append(s);
  q.push_back('"');
  return q;
}

// Reads a non-negative JSON integer that fits u64; `what` names the field in errors.
Result<uint64_t> JsonUint(const json& v, const std::string& what) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer()) {
    return Status::Corruption(what + ": expected a non-negative integer, found " + v.dump());
  }
  return Status::Corruption(what + ": expected a non-negative integer, found " + std::string(v.type_name()) + " " +
                            v.dump());
}

Result<SafetensorsDtype> ParseDtype(const json& v, const std::string& what) {
  if (!v.is_string()) {
    return Status::Corruption(what + ": expected a string, found " + std::string(v.type_name()));
  }
  const std::string s = v.get<std::string>();
  if (s == "F32") return SafetensorsDtype::kF32;
  if (s == "F16") return SafetensorsDtype::kF16;
  if (s == "BF16") return SafetensorsDtype::kBF16;
  for (const char* known : kOtherKnownDtypes) {
    if (s == known) {
      return Status::Unsupported(what + ": dtype " + s + " is not supported (expected F32, F16 or BF16)");
    }
  }
  return Status::Corruption(what + ": unknown dtype " + Quote(s) + " (expected F32, F16 or BF16)");
}

}  // namespace

const char* SafetensorsDtypeName(SafetensorsDtype dtype) {
  switch (dtype) {
    case SafetensorsDtype::kF32: return "F32";
    case SafetensorsDtype::kF16: return "F16";
    case SafetensorsDtype::kBF16: return "BF16";
  }
  return "?";
}

uint64_t SafetensorsDtypeSize(SafetensorsDtype dtype) { return dtype == SafetensorsDtype::kF32 ? 4 : 2; }

GgmlType SafetensorsDtypeToGgml(SafetensorsDtype dtype) {
  switch (dtype) {
    case SafetensorsDtype::kF32: return GgmlType::kF32;
    case SafetensorsDtype::kF16: return GgmlType::kF16;
    case SafetensorsDtype::kBF16: return GgmlType::kBF16;
  }
  return GgmlType::kF32;
}


Result<SafetensorsFile> SafetensorsFile::OpenPath(const std::string& path) {
  NF_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file, OpenPreadFile(path));
  return Open(std::shared_ptr<const ReadableFile>(std::move(file)));
}

Result<SafetensorsFile> SafetensorsFile::Open(std::shared_ptr<const ReadableFile> file) {
  SafetensorsFile st;
  st.file_ = std::move(file);
  const std::string& path = st.file_->Path();
  const uint64_t size = st.file_->Size();
  if (size < 8) {
    return Status::Corruption(path + ": file is " + std::to_string(size) +
                              " bytes, too short for the 8-byte header length at offset 0");
  }
  uint8_t len_bytes[8];
  NF_RETURN_IF_ERROR(st.file_->ReadAt(0, 8, len_bytes));
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len_bytes[i];
  if (n > size - 8) {
    return Status::Corruption(path + ": header length (u64 at offset 0) is " + std::to_string(n) +
                              " bytes, but only " + std::to_string(size - 8) + " bytes follow it in the file");
  }
  if (n > kMaxHeaderBytes) {
    return Status::Corruption(path + ": header length (u64 at offset 0) is " + std::to_string(n) +
                              " bytes, above the " + std::to_string(kMaxHeaderBytes) + "-byte limit");
  }
  if (n < 2) {
    return Status::Corruption(path + ": header length (u64 at offset 0) is " + std::to_string(n) +
                              " bytes, too short for a JSON object");
  }
  st.header_bytes_ = n;
  std::string text(n, '\0');
  NF_RETURN_IF_ERROR(st.file_->ReadAt(8, n, text.data()));

  json header;
  try {
    header = json::parse(text);
  } catch (const json::exception& e) {
    return Status::Corruption(path + ": header JSON (offset 8, " + std::to_string(n) +
                              " bytes) does not parse: " + e.what());
  }
  if (!header.is_object()) {
    return Status::Corruption(path + ": header JSON: expected an object, found " + std::string(header.type_name()));
  }

  const uint64_t data_size = size - 8 - n;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const json& entry = it.value();
    if (name == "__metadata__") {
      if (!entry.is_object()) {
        return Status::Corruption(path + ": __metadata__: expected an object, found " +
                                  std::string(entry.type_name()));
      }
      for (auto m = entry.begin(); m != entry.end(); ++m) {
        st.metadata_.emplace_back(m.key(), m.value().is_string() ? m.value().get<std::string>() : m.value().dump());
      }
      continue;
    }
    const std::string where = path + ": tensor " + Quote(name);
    if (!entry.is_object()) {
      return Status::Corruption(where + ": expected an object, found " + std::string(entry.type_name()));
    }
    for (const char* field : {"dtype", "shape", "data_offsets"}) {
      if (!entry.contains(field)) return Status::Corruption(where + ": missing field \"" + field + "\"");
    }
    SafetensorsTensor t;
    t.name = name;
    NF_ASSIGN_OR_RETURN(t.dtype, ParseDtype(entry["dtype"], where + ": field \"dtype\""));

    const json& shape = entry["shape"];
    if (!shape.is_array()) {
      return Status::Corruption(where + ": field \"shape\": expected an array, found " +
                                std::string(shape.type_name()));
    }
    uint64_t count = 1;
    bool overflow = false;
    for (size_t i = 0; i < shape.size(); ++i) {
      NF_ASSIGN_OR_RETURN(uint64_t d, JsonUint(shape[i], where + ": field \"shape\"[" + std::to_string(i) + "]"));
      t.shape.push_back(d);
      if (d != 0 && count > UINT64_MAX / d) overflow = true;
      count *= d;
    }
    const uint64_t elem = SafetensorsDtypeSize(t.dtype);
    if (overflow || count > UINT64_MAX / elem) {
      return Status::Corruption(where + ": field \"shape\" " + ShapeToString(t.shape) + " overflows 64 bits");
    }
    t.n_elements = count;

    const json& offsets = entry["data_offsets"];
    if (!offsets.is_array() || offsets.size() != 2) {
      return Status::Corruption(where + ": field \"data_offsets\": expected an array [begin, end], found " +
                                offsets.dump());
    }
    NF_ASSIGN_OR_RETURN(uint64_t begin, JsonUint(offsets[0], where + ": field \"data_offsets\"[0]"));
    NF_ASSIGN_OR_RETURN(uint64_t end, JsonUint(offsets[1], where + ": field \"data_offsets\"[1]"));
    if (begin > end) {
      return Status::Corruption(where + ": field \"data_offsets\" [" + std::to_string(begin) + ", " +
                                std::to_string(end) + "]: begin is after end");
    }
    if (end > data_size) {
      return Status::Corruption(where + ": field \"data_offsets\" [" + std::to_string(begin) + ", " +
                                std::to_string(end) + "] goes past the data section (" + std::to_string(data_size) +
                                " bytes from offset " + std::to_string(8 + n) + ")");
    }
    if (end - begin != count * elem) {
      return Status::Corruption(where + ": field \"data_offsets\" [" + std::to_string(begin) + ", " +
                                std::to_string(end) + "] spans " + std::to_string(end - begin) +
                                " bytes, expected " + std::to_string(count * elem) + " for shape " +
                                ShapeToString(t.shape) + " of " + SafetensorsDtypeName(t.dtype));
    }
    t.offset = 8 + n + begin;
    t.n_bytes = end - begin;
    st.tensors_.push_back(std::move(t));
  }

  std::stable_sort(st.tensors_.begin(), st.tensors_.end(), [](const SafetensorsTensor& a, const SafetensorsTensor& b) {
    return a.offset < b.offset;
  });
  for (size_t i = 1; i < st.tensors_.size(); ++i) {
    const SafetensorsTensor& prev = st.tensors_[i - 1];
    const SafetensorsTensor& cur = st.tensors_[i];
    // Empty tensors occupy no bytes and cannot overlap anything.
    if (cur.n_bytes > 0 && prev.n_bytes > 0 && cur.offset < prev.offset + prev.n_bytes) {
      const uint64_t base = st.data_offset();
      return Status::Corruption(path + ": tensor " + Quote(cur.name) + ": field \"data_offsets\" begins at " +
                                std::to_string(cur.offset - base) + ", inside tensor " + Quote(prev.name) + " [" +
                                std::to_string(prev.offset - base) + ", " +
                                std::to_string(prev.offset - base + prev.n_bytes) + "): tensors overlap");
    }
  }
  for (size_t i = 0; i < st.tensors_.size(); ++i) st.index_.emplace(st.tensors_[i].name, i);
  return st;
}

const SafetensorsTensor* SafetensorsFile::Find(std::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

uint64_t SafetensorsFile::total_tensor_bytes() const {
  uint64_t total = 0;
  for (const SafetensorsTensor& t : tensors_) total += t.n_bytes;
  return total;
}

Result<std::vector<uint8_t>> SafetensorsFile::ReadRaw(const SafetensorsTensor& tensor) const {
  std::vector<uint8_t> bytes(tensor.n_bytes);
  if (!bytes.empty()) {
    Status s = file_->ReadAt(tensor.offset, bytes.size(), bytes.data());
    if (!s.ok()) return s.WithContext("tensor \"" + tensor.name + "\"");
  }
  return bytes;
}

Result<std::vector<float>> SafetensorsFile::ReadF32(const SafetensorsTensor& tensor) const {
  NF_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, ReadRaw(tensor));
  std::vector<float> out(tensor.n_elements);
  const uint8_t* p = bytes.data();
  switch (tensor.dtype) {
    case SafetensorsDtype::kF32:
      for (uint64_t i = 0; i < tensor.n_elements; ++i) {
        const uint32_t u = uint32_t{p[4 * i]} | uint32_t{p[4 * i + 1]} << 8 | uint32_t{p[4 * i + 2]} << 16 |
                           uint32_t{p[4 * i + 3]} << 24;
        out[i] = BitsToFloat(u);
      }
      break;
    case SafetensorsDtype::kF16:
      for (uint64_t i = 0; i < tensor.n_elements; ++i) {
        out[i] = Fp16ToFp32(static_cast<uint16_t>(p[2 * i] | p[2 * i + 1] << 8));
      }
      break;
    case SafetensorsDtype::kBF16:
      for (uint64_t i = 0; i < tensor.n_elements; ++i) {
        out[i] = Bf16ToFp32(static_cast<uint16_t>(p[2 * i] | p[2 * i + 1] << 8));
      }
      break;
  }
  return out;
}

Result<std::vector<float>> SafetensorsFile::ReadF32(std::string_view name) const {
  const SafetensorsTensor* t = Find(name);
  if (t == nullptr) return Status::NotFound(path() + ": no tensor named \"" + std::string(name) + "\"");
  return ReadF32(*t);
}

}  // namespace nflash::converter
