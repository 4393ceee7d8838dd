// tests/cpp/test_util.h — helpers shared by the GoogleTest suites in tests/cpp/.
#pragma once

#include <string>

#include "pagedllm/errors.h"

namespace pagedllm::test_util {

/// The message of the pagedllm::InvalidArgument that f() throws, or "<no InvalidArgument thrown>"
/// (any other exception propagates), so a test can assert that an error names the bad value.
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "<no InvalidArgument thrown>";
}

}  // namespace pagedllm::test_util
