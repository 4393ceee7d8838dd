// bindings/registry.h — lets each binding file (one per C++ header) register itself, so that
// module.cpp never changes when a binding file is added.
//
//   PAGEDLLM_BINDING(block_pool, m) { py::class_<BlockPool>(m, "BlockPool") ...; }
//
// Registrations run in name order when pagedllm._C is imported; a binding that needs types
// bound by another (e.g. a return type) names its file so that it sorts after it, or binds
// them lazily (pybind11 resolves types at call time, so order rarely matters).
#pragma once

#include <pybind11/pybind11.h>

#include <functional>
#include <map>
#include <string>

namespace pagedllm::bindings {

namespace py = pybind11;
using BindFn = std::function<void(py::module_&)>;

inline std::map<std::string, BindFn>& registry() {
  static std::map<std::string, BindFn> fns;
  return fns;
}

struct Registrar {
  Registrar(const char* name, BindFn fn) { registry().emplace(name, std::move(fn)); }
};

}  // namespace pagedllm::bindings

#define PAGEDLLM_BINDING(name, module_var)                                                 \
  static void pagedllm_bind_##name(::pybind11::module_& module_var);                       \
  static ::pagedllm::bindings::Registrar pagedllm_registrar_##name(#name, pagedllm_bind_##name); \
  static void pagedllm_bind_##name(::pybind11::module_& module_var)
