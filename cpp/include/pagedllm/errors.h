// pagedllm/errors.h — how the native core reports bad input.
//
// Every public entry point validates its arguments and throws pagedllm::InvalidArgument
// (a std::invalid_argument) whose message names the bad value; it never aborts the process
// and never leaves a data structure half-changed. The pybind11 bindings turn
// std::invalid_argument into Python ValueError and std::runtime_error into RuntimeError.
#pragma once

#include <cstdio>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>

namespace pagedllm {

/// Bad input from the caller (a wrong id, size, dtype, shape...). Maps to Python ValueError.
class InvalidArgument : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

namespace detail {
// Message pieces are appended with std::to_string / snprintf, never through iostreams: in a
// process that also holds another copy of libstdc++'s locale machinery (seen on the H200 image
// once PyTorch had initialised CUDA), formatting a number with an ostringstream inside
// pagedllm._C crashed (segfault in num_put) instead of raising the error.
inline void append_part(std::string& s, const std::string& v) { s += v; }
inline void append_part(std::string& s, std::string_view v) { s += v; }
inline void append_part(std::string& s, const char* v) { s += v != nullptr ? v : "(null)"; }
inline void append_part(std::string& s, char v) { s += v; }
template <typename T>
  requires std::is_arithmetic_v<T>
void append_part(std::string& s, T v) {
  if constexpr (std::is_same_v<T, bool>) {
    s += v ? "1" : "0";  // as an ostream prints a bool
  } else if constexpr (std::is_integral_v<T>) {
    s += std::to_string(v);
  } else {  // "%g": an ostream's default floating-point format
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", static_cast<double>(v));
    s += buf;
  }
}

template <typename... Args>
std::string concat(const Args&... args) {
  std::string s;
  (append_part(s, args), ...);
  return s;
}
}  // namespace detail

}  // namespace pagedllm

/// PAGEDLLM_CHECK(cond, "message parts", value, ...): throw InvalidArgument when cond is false.
#define PAGEDLLM_CHECK(cond, ...)                                                  \
  do {                                                                             \
    if (!(cond)) throw ::pagedllm::InvalidArgument(::pagedllm::detail::concat(__VA_ARGS__)); \
  } while (0)
