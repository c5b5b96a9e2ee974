// Reading a list of torch tensors at the cost torch itself pays per tensor (see [Note: checked
// fast path of the copy ops] in cpu_ops.cpp): torch's own getter and method functions, found
// once in torch._C.TensorBase and called straight through their C pointers, on exact
// torch.Tensor / torch.nn.Parameter objects only (no Python override can exist there).
#pragma once

#include <Python.h>
#include <pybind11/gil_safe_call_once.h>
#include <pybind11/pybind11.h>

#include <cstdint>

#include "dtype.h"

namespace zk::py_binding {

namespace py = pybind11;

// The C functions behind TensorBase.dtype / .is_cpu (getters) and .numel() / .data_ptr() /
// .is_contiguous() / .dim() (methods). `ok` is false where this torch exposes any of them
// differently (another descriptor type, a Python override on Tensor or Parameter, method flags
// not handled here): every caller then declines and the checked Python path runs instead.
struct FastTensor {
  bool ok = false;
  PyTypeObject* tensor = nullptr;
  PyTypeObject* parameter = nullptr;
  PyGetSetDef* dtype = nullptr;
  PyGetSetDef* is_cpu = nullptr;
  PyMethodDef* numel = nullptr;
  PyMethodDef* data_ptr = nullptr;
  PyMethodDef* is_contiguous = nullptr;
  PyMethodDef* dim = nullptr;
  PyObject* float32 = nullptr;
  PyObject* bfloat16 = nullptr;
  PyObject* float16 = nullptr;
  PyObject* no_args = nullptr;  // ()
};

namespace detail {

inline int call_flags(const PyMethodDef* m) {
  return m->ml_flags & ~(METH_COEXIST | METH_CLASS | METH_STATIC);
}

inline bool callable_without_args(const PyMethodDef* m) {
  const int f = call_flags(m);
  return f == METH_NOARGS || f == METH_VARARGS || f == (METH_VARARGS | METH_KEYWORDS) ||
         f == METH_FASTCALL || f == (METH_FASTCALL | METH_KEYWORDS);
}

// The descriptor `name` of TensorBase, provided torch.Tensor and torch.nn.Parameter resolve
// `name` to that very descriptor (nothing overrides it in Python); else nullptr.
inline PyObject* base_descriptor(const py::handle& base, const py::handle& tensor,
                                 const py::handle& parameter, const char* name) {
  PyObject* d = PyDict_GetItemString(reinterpret_cast<PyTypeObject*>(base.ptr())->tp_dict, name);
  if (d == nullptr) return nullptr;
  for (const py::handle& cls : {tensor, parameter}) {
    PyObject* seen = _PyType_Lookup(reinterpret_cast<PyTypeObject*>(cls.ptr()),
                                    py::str(name).ptr());
    if (seen != d) return nullptr;
  }
  return d;
}

inline FastTensor resolve_fast_tensor() {
  FastTensor ft;
  const py::module_ torch = py::module_::import("torch");
  const py::object tensor = torch.attr("Tensor");
  const py::object parameter = py::module_::import("torch.nn.parameter").attr("Parameter");
  // The C base class: the one in Tensor's MRO whose own dict defines the dtype getter.
  py::object base;
  for (const py::handle& cls : tensor.attr("__mro__")) {
    PyObject* dict = reinterpret_cast<PyTypeObject*>(cls.ptr())->tp_dict;
    PyObject* d = PyDict_GetItemString(dict, "dtype");
    if (d != nullptr && PyObject_TypeCheck(d, &PyGetSetDescr_Type)) {
      base = py::reinterpret_borrow<py::object>(cls);
      break;
    }
  }
  if (!base) return ft;
  auto getter = [&](const char* name) -> PyGetSetDef* {
    PyObject* d = base_descriptor(base, tensor, parameter, name);
    if (d == nullptr || !PyObject_TypeCheck(d, &PyGetSetDescr_Type)) return nullptr;
    PyGetSetDef* def = reinterpret_cast<PyGetSetDescrObject*>(d)->d_getset;
    return def->get != nullptr ? def : nullptr;
  };
  auto method = [&](const char* name) -> PyMethodDef* {
    PyObject* d = base_descriptor(base, tensor, parameter, name);
    if (d == nullptr || !PyObject_TypeCheck(d, &PyMethodDescr_Type)) return nullptr;
    PyMethodDef* def = reinterpret_cast<PyMethodDescrObject*>(d)->d_method;
    return callable_without_args(def) ? def : nullptr;
  };
  ft.dtype = getter("dtype");
  ft.is_cpu = getter("is_cpu");
  ft.numel = method("numel");
  ft.data_ptr = method("data_ptr");
  ft.is_contiguous = method("is_contiguous");
  ft.dim = method("dim");
  PyErr_Clear();  // PyDict_GetItemString / _PyType_Lookup misses set nothing, but be sure
  if (!ft.dtype || !ft.is_cpu || !ft.numel || !ft.data_ptr || !ft.is_contiguous || !ft.dim) {
    return ft;
  }
  // Kept alive for the process (the module objects of torch are never unloaded).
  ft.tensor = reinterpret_cast<PyTypeObject*>(tensor.inc_ref().ptr());
  ft.parameter = reinterpret_cast<PyTypeObject*>(parameter.inc_ref().ptr());
  ft.float32 = py::object(torch.attr("float32")).release().ptr();
  ft.bfloat16 = py::object(torch.attr("bfloat16")).release().ptr();
  ft.float16 = py::object(torch.attr("float16")).release().ptr();
  ft.no_args = PyTuple_New(0);
  if (ft.no_args == nullptr) throw py::error_already_set();
  base.inc_ref();
  ft.ok = true;
  return ft;
}

}  // namespace detail

inline const FastTensor& fast_tensor() {
  PYBIND11_CONSTINIT static py::gil_safe_call_once_and_store<FastTensor> storage;
  return storage.call_once_and_store_result(detail::resolve_fast_tensor).get_stored();
}

// Whether `obj` is exactly a torch.Tensor or torch.nn.Parameter (a subclass may override).
inline bool exact_tensor(const FastTensor& ft, PyObject* obj) {
  PyTypeObject* t = Py_TYPE(obj);
  return t == ft.tensor || t == ft.parameter;
}

// obj.<method>() through the method's C function; a new reference, or nullptr with the error
// set.
inline PyObject* call_plain(const FastTensor& ft, const PyMethodDef* m, PyObject* obj) {
  switch (detail::call_flags(m)) {
    case METH_NOARGS: return m->ml_meth(obj, nullptr);
    case METH_VARARGS: return m->ml_meth(obj, ft.no_args);
    case METH_VARARGS | METH_KEYWORDS:
      return reinterpret_cast<PyCFunctionWithKeywords>(reinterpret_cast<void (*)()>(m->ml_meth))(
          obj, ft.no_args, nullptr);
    case METH_FASTCALL:
      return reinterpret_cast<_PyCFunctionFast>(reinterpret_cast<void (*)()>(m->ml_meth))(
          obj, nullptr, 0);
    default:  // METH_FASTCALL | METH_KEYWORDS (the only other kind resolve accepts)
      return reinterpret_cast<_PyCFunctionFastWithKeywords>(
          reinterpret_cast<void (*)()>(m->ml_meth))(obj, nullptr, 0, nullptr);
  }
}

// What a copy needs of one exact tensor, read with five torch calls.
struct FastFields {
  DType dtype = DType::kFloat32;
  int64_t numel = 0;
  uintptr_t data_ptr = 0;
  int64_t dim = -1;  // read only when asked (want_dim)
};

// Reads `obj` (an exact tensor, see exact_tensor) when it is a contiguous CPU tensor of a float
// dtype: true and `out` filled; false when it is not (nothing raised); throws on a Python error.
// Plain C API reference handling: this runs five times per tensor of a list op.
inline bool read_fast(const FastTensor& ft, PyObject* obj, bool want_dim, FastFields* out) {
  PyObject* r = ft.is_cpu->get(obj, ft.is_cpu->closure);
  if (r == nullptr) throw py::error_already_set();
  const bool cpu = r == Py_True;
  Py_DECREF(r);
  if (!cpu) return false;
  r = ft.dtype->get(obj, ft.dtype->closure);
  if (r == nullptr) throw py::error_already_set();
  const bool is_float = r == ft.float32 || r == ft.bfloat16 || r == ft.float16;
  out->dtype = r == ft.float32 ? DType::kFloat32
               : r == ft.bfloat16 ? DType::kBFloat16 : DType::kFloat16;
  Py_DECREF(r);
  if (!is_float) return false;
  r = call_plain(ft, ft.is_contiguous, obj);
  if (r == nullptr) throw py::error_already_set();
  const bool contiguous = r == Py_True;
  Py_DECREF(r);
  if (!contiguous) return false;
  auto integer = [&](const PyMethodDef* m) -> long long {
    PyObject* v = call_plain(ft, m, obj);
    if (v == nullptr) throw py::error_already_set();
    const long long x = PyLong_AsLongLong(v);
    Py_DECREF(v);
    if (x == -1 && PyErr_Occurred()) throw py::error_already_set();
    return x;
  };
  out->numel = integer(ft.numel);
  {
    PyObject* v = call_plain(ft, ft.data_ptr, obj);
    if (v == nullptr) throw py::error_already_set();
    const unsigned long long x = PyLong_AsUnsignedLongLong(v);
    Py_DECREF(v);
    if (x == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
      throw py::error_already_set();
    }
    out->data_ptr = static_cast<uintptr_t>(x);
  }
  if (want_dim) out->dim = integer(ft.dim);
  return true;
}

}  // namespace zk::py_binding
