// The `isa` argument of the CPU bindings (cpu_ops.cpp, cpu_quant.cpp): the one place that
// reads ZKERNELS_CPU_ISA for the native paths.
#pragma once

#include <pybind11/pybind11.h>

#include <cctype>
#include <cstdlib>
#include <string>

#include "simd/isa.h"

namespace zk::py_binding {

// `isa` as given, or (None) ZKERNELS_CPU_ISA read now, stripped and lower-cased as
// zkernels._cpu reads it; unset or empty means auto.
inline zk::cpu::Isa isa_arg(const pybind11::object& isa) {
  std::string name;
  if (!isa.is_none()) {
    name = isa.cast<std::string>();
  } else if (const char* env = std::getenv("ZKERNELS_CPU_ISA")) {
    name = env;
    const auto first = name.find_first_not_of(" \t\n\r\f\v");
    const auto last = name.find_last_not_of(" \t\n\r\f\v");
    name = first == std::string::npos ? "" : name.substr(first, last - first + 1);
    for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  }
  return zk::cpu::parse_isa(name.empty() ? "auto" : name);
}

}  // namespace zk::py_binding
