// Status and Result<T>: the error type every nflash library function returns.
// Messages are meant for users: they name the file, the field or tensor, the offset, and the expected vs. found value.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace nflash {

enum class StatusCode : uint8_t {
  kOk = 0,
  kInvalidArgument,   // the caller (or the user, through a flag) asked for something impossible
  kNotFound,          // a file, key or tensor that should exist does not
  kCorruption,        // input data violates its format
  kIOError,           // the OS reported an error
  kUnsupported,       // valid input that nflash does not handle (yet)
  kResourceExhausted, // a memory or size budget would be exceeded
  kInternal,          // a broken invariant that is not the user's fault
};

// Thread-safety: a Status is a value; distinct objects may be used from distinct threads.
class Status {
 public:
  Status() = default;  // ok
  static Status Ok() { return Status(); }
  static Status InvalidArgument(std::string msg) { return Status(StatusCode::kInvalidArgument, std::move(msg)); }
  static Status NotFound(std::string msg) { return Status(StatusCode::kNotFound, std::move(msg)); }
  static Status Corruption(std::string msg) { return Status(StatusCode::kCorruption, std::move(msg)); }
  static Status IOError(std::string msg) { return Status(StatusCode::kIOError, std::move(msg)); }
  static Status Unsupported(std::string msg) { return Status(StatusCode::kUnsupported, std::move(msg)); }
  static Status ResourceExhausted(std::string msg) { return Status(StatusCode::kResourceExhausted, std::move(msg)); }
  static Status Internal(std::string msg) { return Status(StatusCode::kInternal, std::move(msg)); }
  // An IOError with strerror(err) appended: "<what>: <strerror>".
  static Status FromErrno(std::string_view what, int err);

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "Corruption: <message>", or "OK".
  std::string ToString() const;
  // Returns a copy whose message is "<context>: <message>" (ok stays ok).
  Status WithContext(std::string_view context) const;

 private:
  Status(StatusCode code, std::string msg) : code_(code), message_(std::move(msg)) {}
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

const char* StatusCodeName(StatusCode code);

// Result<T>: a T or a non-ok Status.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {  // NOLINT: implicit by design
    if (std::get<Status>(v_).ok()) v_ = Status::Internal("Result constructed from an ok Status without a value");
  }
  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOkStatus;
    return ok() ? kOkStatus : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &std::get<T>(v_); }
  const T* operator->() const { return &std::get<T>(v_); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace nflash

#define NF_CONCAT_INNER_(a, b) a##b
#define NF_CONCAT_(a, b) NF_CONCAT_INNER_(a, b)

// Returns the Status from the enclosing function if `expr` (a Status) is not ok.
#define NF_RETURN_IF_ERROR(expr)                       \
  do {                                                 \
    ::nflash::Status nf_status_ = (expr);              \
    if (!nf_status_.ok()) return nf_status_;           \
  } while (0)

// `lhs = value of expr` (a Result<T>), or returns its Status from the enclosing function. Expands to several
// statements: not usable as the body of an unbraced if/for.
#define NF_ASSIGN_OR_RETURN(lhs, expr) NF_ASSIGN_OR_RETURN_IMPL_(NF_CONCAT_(nf_result_, __LINE__), lhs, expr)
#define NF_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                              \
  if (!tmp.ok()) return tmp.status();             \
  lhs = std::move(tmp).value()
