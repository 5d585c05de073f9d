// Typed JSON field access with precise errors (see json_fields.h).
#include "runtime/core/json_fields.h"

namespace nflash {

std::string JsonFound(const nlohmann::json& v) {
  constexpr size_t kMaxShown = 80;
  std::string s = v.dump();
  if (s.size() > kMaxShown) s = s.substr(0, kMaxShown) + "...";
  return s;
}

Status JsonWrongType(const JsonLocation& where, std::string_view expected, const nlohmann::json& found) {
  return Status::Corruption(where.Describe() + " has the wrong type: expected " + std::string(expected) + ", found " +
                            JsonFound(found));
}

JsonLocation JsonLocation::Field(std::string_view key) const {
  return JsonLocation(source_, path_.empty() ? std::string(key) : path_ + "." + std::string(key));
}

JsonLocation JsonLocation::Index(size_t i) const {
  return JsonLocation(source_, path_ + "[" + std::to_string(i) + "]");
}

std::string JsonLocation::Describe() const { return path_.empty() ? source_ : source_ + ": field '" + path_ + "'"; }

Result<JsonFields> JsonFields::Of(const nlohmann::json& value, JsonLocation where) {
  if (!value.is_object()) {
    return Status::Corruption(where.Describe() + (where.path().empty() ? ": expected a JSON object" : ": expected an object") +
                              ", found " + JsonFound(value));
  }
  return JsonFields(value, std::move(where));
}

bool JsonFields::Has(std::string_view key) const { return obj_->find(key) != obj_->end(); }

Result<const nlohmann::json*> JsonFields::Find(std::string_view key) const {
  auto it = obj_->find(key);
  if (it == obj_->end()) return Status::Corruption(where_.source() + ": missing field '" + where_.Field(key).path() + "'");
  return &*it;
}

Status JsonFields::WrongType(std::string_view key, const char* expected, const nlohmann::json& found) const {
  return JsonWrongType(where_.Field(key), expected, found);
}

Status JsonFields::IntegerField(std::string_view key, bool is_signed, int64_t min, uint64_t max, int64_t* s,
                                uint64_t* u) const {
  NF_ASSIGN_OR_RETURN(const nlohmann::json* v, Find(key));
  if (!v->is_number_integer()) return WrongType(key, is_signed ? "an integer" : "a non-negative integer", *v);
  bool in_range;
  if (v->is_number_unsigned()) {
    *u = v->get<uint64_t>();
    in_range = *u <= max;
    *s = static_cast<int64_t>(*u);
  } else {
    *s = v->get<int64_t>();
    in_range = *s >= min && (*s < 0 || static_cast<uint64_t>(*s) <= max);
    *u = static_cast<uint64_t>(*s);
  }
  if (!in_range) {
    return Status::Corruption(where_.Field(key).Describe() + " is out of range: expected an integer in [" +
                              std::to_string(min) + ", " + std::to_string(max) + "], found " + v->dump());
  }
  return Status::Ok();
}

Result<JsonFields> JsonFields::Object(std::string_view key) const {
  NF_ASSIGN_OR_RETURN(const nlohmann::json* v, Find(key));
  if (!v->is_object()) return WrongType(key, "an object", *v);
  return JsonFields(*v, where_.Field(key));
}

Result<const nlohmann::json*> JsonFields::Array(std::string_view key, size_t min_size) const {
  NF_ASSIGN_OR_RETURN(const nlohmann::json* v, Find(key));
  if (!v->is_array()) return WrongType(key, min_size > 0 ? "a non-empty array" : "an array", *v);
  if (v->size() < min_size) {
    return Status::Corruption(where_.Field(key).Describe() + ": expected at least " + std::to_string(min_size) +
                              " element(s), found " + std::to_string(v->size()));
  }
  return v;
}

}  // namespace nflash
