// pagedllm/errors.h — how the native core reports bad input.
//
// Every public entry point validates its arguments and throws pagedllm::InvalidArgument
// (a std::invalid_argument) whose message names the bad value; it never aborts the process
// and never leaves a data structure half-changed. The pybind11 bindings turn
// std::invalid_argument into Python ValueError and std::runtime_error into RuntimeError.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace pagedllm {

/// Bad input from the caller (a wrong id, size, dtype, shape...). Maps to Python ValueError.
class InvalidArgument : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

namespace detail {
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

}  // namespace pagedllm

/// PAGEDLLM_CHECK(cond, "message parts", value, ...): throw InvalidArgument when cond is false.
#define PAGEDLLM_CHECK(cond, ...)                                                  \
  do {                                                                             \
    if (!(cond)) throw ::pagedllm::InvalidArgument(::pagedllm::detail::concat(__VA_ARGS__)); \
  } while (0)
