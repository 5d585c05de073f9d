// Typed fields of a parsed JSON document (nlohmann::json) with errors that name the file, the full field path
// ("regions[3].hot_count"), the type expected and the value found: the one reader behind manifest.json, plan.json and
// hw.json.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>

#include <nlohmann/json.hpp>

#include "runtime/core/status.h"

namespace nflash {

// Where a JSON value sits: its source (a file path, or any name for the text) and its field path inside the document
// ("" for the root, "settings.queue_depth", "regions[3]"). Thread-safety: a value type.
class JsonLocation {
 public:
  explicit JsonLocation(std::string source, std::string path = "")
      : source_(std::move(source)), path_(std::move(path)) {}
  JsonLocation Field(std::string_view key) const;
  JsonLocation Index(size_t i) const;
  const std::string& source() const { return source_; }
  const std::string& path() const { return path_; }
  // "SOURCE: field 'PATH'" ("SOURCE" at the root): the prefix of every error about this value.
  std::string Describe() const;

 private:
  std::string source_;
  std::string path_;
};

// A found value as error messages show it: its JSON text, cut at 80 characters (any scalar in full, enough of an object
// or array to recognise it).
std::string JsonFound(const nlohmann::json& v);
// Corruption "SOURCE: field 'PATH' has the wrong type: expected EXPECTED, found VALUE" for the value at `where`.
Status JsonWrongType(const JsonLocation& where, std::string_view expected, const nlohmann::json& found);

// The fields of one JSON object. Every error is Status::Corruption (the document violates its format) and names the
// source, the field's full path, what was expected and what was found (or that the field is missing). Integers must be
// JSON integers (1.0 is the wrong type) within the range of the destination type (out of range is an error, never a
// silent wrap); floating-point fields accept any JSON number. Thread-safety: holds a reference to the document,
// which must outlive it; const methods only, safe to share.
class JsonFields {
 public:
  // Corruption when `value` is not an object ("SOURCE: field 'PATH': expected an object, found ...").
  static Result<JsonFields> Of(const nlohmann::json& value, JsonLocation where);

  bool Has(std::string_view key) const;
  // T: std::string, bool, float/double, or any integer type.
  template <typename T>
  Status Get(std::string_view key, T* out) const;
  // A nested object, as a reader whose location continues the path.
  Result<JsonFields> Object(std::string_view key) const;
  // A nested array with at least `min_size` elements; its elements' locations are Field(key).Index(i).
  Result<const nlohmann::json*> Array(std::string_view key, size_t min_size = 0) const;

  const nlohmann::json& value() const { return *obj_; }
  const JsonLocation& where() const { return where_; }

 private:
  JsonFields(const nlohmann::json& obj, JsonLocation where) : obj_(&obj), where_(std::move(where)) {}
  // The field's value, or Corruption naming it as missing.
  Result<const nlohmann::json*> Find(std::string_view key) const;
  Status IntegerField(std::string_view key, bool is_signed, int64_t min, uint64_t max, int64_t* s, uint64_t* u) const;
  Status WrongType(std::string_view key, const char* expected, const nlohmann::json& found) const;

  const nlohmann::json* obj_;
  JsonLocation where_;
};

template <typename T>
Status JsonFields::Get(std::string_view key, T* out) const {
  if constexpr (std::is_same_v<T, std::string>) {
    NF_ASSIGN_OR_RETURN(const nlohmann::json* v, Find(key));
    if (!v->is_string()) return WrongType(key, "a string", *v);
    *out = v->get<std::string>();
  } else if constexpr (std::is_same_v<T, bool>) {
    NF_ASSIGN_OR_RETURN(const nlohmann::json* v, Find(key));
    if (!v->is_boolean()) return WrongType(key, "true or false", *v);
    *out = v->get<bool>();
  } else if constexpr (std::is_floating_point_v<T>) {
    NF_ASSIGN_OR_RETURN(const nlohmann::json* v, Find(key));
    if (!v->is_number()) return WrongType(key, "a number", *v);
    *out = v->get<T>();
  } else {
    static_assert(std::is_integral_v<T>, "JsonFields::Get: unsupported field type");
    int64_t s = 0;
    uint64_t u = 0;
    NF_RETURN_IF_ERROR(IntegerField(key, std::is_signed_v<T>, static_cast<int64_t>(std::numeric_limits<T>::min()),
                                    static_cast<uint64_t>(std::numeric_limits<T>::max()), &s, &u));
    *out = std::is_signed_v<T> ? static_cast<T>(s) : static_cast<T>(u);
  }
  return Status::Ok();
}

}  // namespace nflash
