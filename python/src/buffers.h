// The buffer arguments every CPU optimizer binding takes, checked once here (messages name the
// argument): CPU, contiguous, the expected numel, and the dtype rules of each kind of buffer.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "dtype.h"
#include "tensor_arg.h"

namespace zk::py_binding {

// A contiguous CPU tensor of `numel` elements (`what` says why that many), any dtype.
inline TensorArg cpu_buffer(const py::handle& obj, const char* name, int64_t numel,
                            const std::string& what) {
  TensorArg t = tensor_arg(obj, name);
  require_device(t, "cpu");
  require_contiguous(t);
  require_numel(t, numel, what);
  return t;
}

// TypeError naming the argument unless it has `dtype` (`why`: what the dtype is for).
inline void require_dtype(const TensorArg& t, const char* dtype, const char* why) {
  if (t.dtype != dtype) {
    throw py::type_error(t.name + " must be " + dtype + " (" + why + "), got " + t.dtype);
  }
}

// An fp32 contiguous CPU tensor (dtype checked first); numel < 0: any numel.
inline TensorArg fp32_buffer(const py::handle& obj, const char* name, int64_t numel = -1,
                             const std::string& what = "the numel of param") {
  TensorArg t = tensor_arg(obj, name);
  float_dtype(t, /*allow_half=*/false);
  require_device(t, "cpu");
  require_contiguous(t);
  if (numel >= 0) require_numel(t, numel, what);
  return t;
}

// The optional arguments every step shares: found_inf (fp32, 1 element) and out (fp32, bf16
// or fp16, numel n). None leaves *flag / *out untouched.
inline void step_extras(const py::object& found_inf, const py::object& out, int64_t n,
                        const float** flag, void** out_ptr, DType* out_dtype) {
  if (!found_inf.is_none()) {
    const TensorArg f = fp32_buffer(found_inf, "found_inf", 1, "a flag");
    *flag = reinterpret_cast<const float*>(f.data_ptr);
  }
  if (!out.is_none()) {
    TensorArg o = tensor_arg(out, "out");
    *out_dtype = float_dtype(o, /*allow_half=*/true);
    require_device(o, "cpu");
    require_contiguous(o);
    require_numel(o, n, "the numel of param");
    *out_ptr = reinterpret_cast<void*>(o.data_ptr);
  }
}

// The grad: fp32, bf16 or fp16, numel n.
inline TensorArg grad_buffer(const py::handle& obj, int64_t n, DType* dtype) {
  TensorArg g = tensor_arg(obj, "grad");
  *dtype = float_dtype(g, /*allow_half=*/true);
  require_device(g, "cpu");
  require_contiguous(g);
  require_numel(g, n, "the numel of param");
  return g;
}

}  // namespace zk::py_binding
