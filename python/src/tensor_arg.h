// Reading torch tensors without torch headers: the bindings see a tensor as a Python object
// and take what the native core needs (pointer, count, dtype, device, contiguity) through
// attribute access, so the extension builds in seconds against pybind11 alone and never
// links libtorch (see [Note: no torch headers] in main.cpp).
#pragma once

#include <pybind11/gil_safe_call_once.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "dtype.h"

namespace zk::py_binding {

namespace py = pybind11;

struct TensorArg {
  std::string name;
  uintptr_t data_ptr = 0;
  int64_t numel = 0;
  std::string dtype;        // "float32", "bfloat16", ... (torch's name without "torch.")
  std::string device_type;  // "cpu", "cuda", ...
  int device_index = -1;    // -1 when the device has no index
  bool contiguous = false;
};

// torch.Tensor, the float dtypes and the attribute names the bindings read, looked up (and
// interned) once per process: the dtype of every argument is then an identity comparison, and
// each attribute read a dictionary hit instead of a string conversion plus lookup.
struct TorchTypes {
  py::object tensor, float32, bfloat16, float16;
  py::str data_ptr, numel, dtype, device, type, index, is_contiguous, is_cpu;
};

inline const TorchTypes& torch_types() {
  PYBIND11_CONSTINIT static py::gil_safe_call_once_and_store<TorchTypes> storage;
  return storage
      .call_once_and_store_result([] {
        const py::module_ torch = py::module_::import("torch");
        auto name = [](const char* s) {
          return py::reinterpret_steal<py::str>(PyUnicode_InternFromString(s));
        };
        return TorchTypes{torch.attr("Tensor"), torch.attr("float32"), torch.attr("bfloat16"),
                          torch.attr("float16"),   name("data_ptr"),    name("numel"),
                          name("dtype"),           name("device"),      name("type"),
                          name("index"),           name("is_contiguous"), name("is_cpu")};
      })
      .get_stored();
}

inline std::string dtype_str(const py::object& dtype) {
  const TorchTypes& tt = torch_types();
  if (dtype.is(tt.float32)) return "float32";
  if (dtype.is(tt.bfloat16)) return "bfloat16";
  if (dtype.is(tt.float16)) return "float16";
  const std::string s = py::str(dtype).cast<std::string>();
  return s.rfind("torch.", 0) == 0 ? s.substr(6) : s;
}

// obj.name() for a method without arguments (vectorcall: no argument tuple is built).
inline py::object call_method(const py::handle& obj, const py::str& name) {
  PyObject* args[1] = {obj.ptr()};
  PyObject* r = PyObject_VectorcallMethod(name.ptr(), args,
                                          1 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
  if (r == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(r);
}

// Reads `obj` as a tensor; TypeError naming `name` when it is not a torch.Tensor.
inline TensorArg tensor_arg(const py::handle& obj, const char* name) {
  const TorchTypes& tt = torch_types();
  if (!py::isinstance(obj, tt.tensor)) {
    throw py::type_error(std::string(name) + " must be a torch.Tensor, got " +
                         py::str(py::type::of(obj).attr("__name__")).cast<std::string>());
  }
  TensorArg t;
  t.name = name;
  t.data_ptr = call_method(obj, tt.data_ptr).cast<uintptr_t>();
  t.numel = call_method(obj, tt.numel).cast<int64_t>();
  t.dtype = dtype_str(obj.attr(tt.dtype));
  if (obj.attr(tt.is_cpu).ptr() == Py_True) {  // no torch.device object built for CPU tensors
    t.device_type = "cpu";
  } else {
    const py::object device = obj.attr(tt.device);
    t.device_type = device.attr(tt.type).cast<std::string>();
    const py::object index = device.attr(tt.index);
    t.device_index = index.is_none() ? -1 : index.cast<int>();
  }
  t.contiguous = call_method(obj, tt.is_contiguous).ptr() == Py_True;
  return t;
}

inline std::string device_str(const TensorArg& t) {
  return t.device_index < 0 ? t.device_type : t.device_type + ":" + std::to_string(t.device_index);
}

inline void require_device(const TensorArg& t, const char* type) {
  if (t.device_type != type) {
    throw py::value_error(t.name + " must be a " + (std::string(type) == "cpu" ? "CPU" : "CUDA") +
                          " tensor, got device " + device_str(t));
  }
}

inline void require_contiguous(const TensorArg& t) {
  if (!t.contiguous) throw py::value_error(t.name + " must be contiguous");
}

inline void require_numel(const TensorArg& t, int64_t numel, const std::string& what) {
  if (t.numel != numel) {
    throw py::value_error(t.name + " must have " + std::to_string(numel) + " elements (" + what +
                          "), got " + std::to_string(t.numel));
  }
}

// The core's DType of `t`; TypeError naming the argument for any other dtype.
inline DType float_dtype(const TensorArg& t, bool allow_half) {
  if (t.dtype == "float32") return DType::kFloat32;
  if (allow_half && t.dtype == "bfloat16") return DType::kBFloat16;
  if (allow_half && t.dtype == "float16") return DType::kFloat16;
  throw py::type_error(t.name + (allow_half ? " must be float32, bfloat16 or float16"
                                            : " must be float32") +
                       ", got " + t.dtype);
}

}  // namespace zk::py_binding
