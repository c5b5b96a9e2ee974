// Reading a list of torch tensors for less than torch itself pays per tensor (see [Note: checked
// fast path of the copy ops] in cpu_ops.cpp), on exact torch.Tensor / torch.nn.Parameter
// objects only (no Python override can exist there), in one of two ways:
// - the stable C shim (see [Note: tensor fields through the stable C shim] below): one getter
//   call per tensor, then plain C calls into libtorch; ~60 ns a tensor;
// - else torch's own getter and method functions, found once in torch._C.TensorBase and
//   called straight through their C pointers: five binding calls, ~170 ns a tensor.
#pragma once

#include <Python.h>
#include <pybind11/gil_safe_call_once.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#if __has_include(<dlfcn.h>)
#include <dlfcn.h>
#define ZK_HAVE_DLFCN 1
#endif

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
  // The stable C shim ([Note: tensor fields through the stable C shim] below); shim_ok is
  // false where any part of it is missing here or its check against the getters failed.
  bool shim_ok = false;
  PyGetSetDef* cdata = nullptr;            // TensorBase._cdata: the TensorImpl's address
  PyObject* mode_enabled = nullptr;        // torch._C._is_torch_function_mode_enabled
  int32_t (*shim_data_ptr)(void*, void**) = nullptr;
  int32_t (*shim_numel)(void*, int64_t*) = nullptr;
  int32_t (*shim_dim)(void*, int64_t*) = nullptr;
  int32_t (*shim_dtype)(void*, int32_t*) = nullptr;
  int32_t (*shim_device_type)(void*, int32_t*) = nullptr;
  int32_t (*shim_is_contiguous)(void*, bool*) = nullptr;
  int32_t code_float32 = -1, code_bfloat16 = -1, code_float16 = -1, code_cpu = -1;
};

// What a copy needs of one exact tensor.
struct FastFields {
  DType dtype = DType::kFloat32;
  int64_t numel = 0;
  uintptr_t data_ptr = 0;
  int64_t dim = -1;  // read only when asked (want_dim)
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

}  // namespace detail

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

// Reads `obj` (an exact tensor, see exact_tensor) when it is a contiguous CPU tensor of a float
// dtype: true and `out` filled; false when it is not (nothing raised); throws on a Python error.
// Plain C API reference handling: this runs five times per tensor of a list op where the
// shim is not in use.
inline bool read_getters(const FastTensor& ft, PyObject* obj, bool want_dim,
                         FastFields* out) {
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

// Reads `obj` (an exact tensor) through the shim: 1 and `out` filled when it is a contiguous CPU
// tensor of a float dtype, 0 when it is not, -1 when the shim reported an error (the caller
// then reads it through the getters, which raise what torch raises). Needs ft.shim_ok.
inline int read_shim(const FastTensor& ft, PyObject* obj, bool want_dim, FastFields* out) {
  PyObject* r = ft.cdata->get(obj, ft.cdata->closure);
  if (r == nullptr) {
    PyErr_Clear();
    return -1;
  }
  void* impl = PyLong_CheckExact(r) ? PyLong_AsVoidPtr(r) : nullptr;
  Py_DECREF(r);
  if (impl == nullptr) {
    PyErr_Clear();
    return -1;
  }
  void* tensor = &impl;  // an at::Tensor: one pointer to its TensorImpl (see the note below)
  int32_t device = -1, dtype = -1;
  bool contiguous = false;
  if (ft.shim_device_type(tensor, &device) != 0) return -1;
  if (device != ft.code_cpu) return 0;
  if (ft.shim_dtype(tensor, &dtype) != 0) return -1;
  if (dtype != ft.code_float32 && dtype != ft.code_bfloat16 && dtype != ft.code_float16) return 0;
  out->dtype = dtype == ft.code_float32 ? DType::kFloat32
               : dtype == ft.code_bfloat16 ? DType::kBFloat16 : DType::kFloat16;
  if (ft.shim_is_contiguous(tensor, &contiguous) != 0) return -1;
  if (!contiguous) return 0;
  void* data = nullptr;
  if (ft.shim_numel(tensor, &out->numel) != 0 || ft.shim_data_ptr(tensor, &data) != 0) return -1;
  out->data_ptr = reinterpret_cast<uintptr_t>(data);
  if (want_dim && ft.shim_dim(tensor, &out->dim) != 0) return -1;
  return 1;
}

// Whether this call may read through the shim: it is there and checked, and no torch-function
// mode is active (a mode would see the getters' reads; see the note below). Once per call.
inline bool use_shim(const FastTensor& ft) {
  if (!ft.shim_ok) return false;
  PyObject* r = PyObject_CallNoArgs(ft.mode_enabled);
  if (r == nullptr) throw py::error_already_set();
  const bool mode = r != Py_False;
  Py_DECREF(r);
  return !mode;
}

// Reads `obj` (an exact tensor, see exact_tensor) when it is a contiguous CPU tensor of a float
// dtype: true and `out` filled; false when it is not (nothing raised); throws on a Python error.
// `shim`: what use_shim said for this call.
inline bool read_fast(const FastTensor& ft, PyObject* obj, bool want_dim, FastFields* out,
                      bool shim) {
  if (shim) {
    const int got = read_shim(ft, obj, want_dim, out);
    if (got >= 0) return got == 1;
  }
  return read_getters(ft, obj, want_dim, out);
}

// [Note: tensor fields through the stable C shim]
// libtorch exports a C interface whose signatures are part of torch's stable ABI (the AOTI
// shim, torch/csrc/inductor/aoti_torch/c/shim.h): aoti_torch_get_data_ptr, _get_numel,
// _get_dim, _get_dtype, _get_device_type and aoti_torch_is_contiguous take an
// AtenTensorHandle, which is an at::Tensor* (shim.h's own tensor_handle_to_tensor_pointer is a
// reinterpret_cast), and an at::Tensor is one intrusive pointer to its TensorImpl. The
// TensorImpl's address is what TensorBase._cdata returns. So one binding call per tensor
// (the _cdata getter, ~45 ns) and five C calls (~3 ns each) read what five binding calls
// (~170 ns) read otherwise; torch.cat pays ~110 ns a tensor for its own reads and checks.
// The functions are looked up once with dlsym in the libtorch_cpu that torch loaded (no torch
// header is included, no library linked: [Note: no torch headers]); the six prototypes and
// the dtype/device codes (read from the shim's own aoti_torch_dtype_* functions) are all this
// file assumes. It is checked before use: probe tensors of every kind the copies meet (each
// float dtype, a view at an offset, a transposed non-contiguous view, an empty and an integer
// tensor, a Parameter) must read the same through the shim as through the getters, or the
// getters stay in use. A torch-function mode sees _cdata reads like any other attribute, so
// while one is active the getters run instead (see use_shim), as they always did.
namespace detail {

#if defined(ZK_HAVE_DLFCN)
template <typename Fn>
inline bool shim_symbol(void* lib, const char* name, Fn* out) {
  void* sym = dlsym(lib, name);
  *out = reinterpret_cast<Fn>(sym);
  return sym != nullptr;
}
#endif

inline void resolve_shim(FastTensor* ft, const py::object& base, const py::object& tensor,
                         const py::object& parameter, const py::module_& torch) {
#if defined(ZK_HAVE_DLFCN)
  PyObject* d = base_descriptor(base, tensor, parameter, "_cdata");
  PyErr_Clear();
  if (d == nullptr || !PyObject_TypeCheck(d, &PyGetSetDescr_Type)) return;
  PyGetSetDef* cdata = reinterpret_cast<PyGetSetDescrObject*>(d)->d_getset;
  if (cdata->get == nullptr) return;
  const py::module_ C = torch.attr("_C");
  if (!py::hasattr(C, "_is_torch_function_mode_enabled")) return;
  std::string path;
  try {
    const py::module_ os_path = py::module_::import("os.path");
    path = py::str(os_path.attr("join")(os_path.attr("dirname")(torch.attr("__file__")), "lib",
                                        "libtorch_cpu.so"));
  } catch (const py::error_already_set&) {
    PyErr_Clear();
    return;
  }
  // Only the library torch already loaded: RTLD_NOLOAD never loads a second copy.
  void* lib = dlopen(path.c_str(), RTLD_LAZY | RTLD_LOCAL | RTLD_NOLOAD);
  if (lib == nullptr) lib = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_LOCAL | RTLD_NOLOAD);
  if (lib == nullptr) return;
  FastTensor f = *ft;
  int32_t (*dtype_f32)() = nullptr, (*dtype_bf16)() = nullptr, (*dtype_f16)() = nullptr,
          (*device_cpu)() = nullptr;
  const bool found = shim_symbol(lib, "aoti_torch_get_data_ptr", &f.shim_data_ptr) &&
                     shim_symbol(lib, "aoti_torch_get_numel", &f.shim_numel) &&
                     shim_symbol(lib, "aoti_torch_get_dim", &f.shim_dim) &&
                     shim_symbol(lib, "aoti_torch_get_dtype", &f.shim_dtype) &&
                     shim_symbol(lib, "aoti_torch_get_device_type", &f.shim_device_type) &&
                     shim_symbol(lib, "aoti_torch_is_contiguous", &f.shim_is_contiguous) &&
                     shim_symbol(lib, "aoti_torch_dtype_float32", &dtype_f32) &&
                     shim_symbol(lib, "aoti_torch_dtype_bfloat16", &dtype_bf16) &&
                     shim_symbol(lib, "aoti_torch_dtype_float16", &dtype_f16) &&
                     shim_symbol(lib, "aoti_torch_device_type_cpu", &device_cpu);
  dlclose(lib);  // torch keeps it loaded: the reference dlopen took is the only one dropped
  if (!found) return;
  f.cdata = cdata;
  f.code_float32 = dtype_f32();
  f.code_bfloat16 = dtype_bf16();
  f.code_float16 = dtype_f16();
  f.code_cpu = device_cpu();
  f.shim_ok = true;
  // The check: every probe reads alike both ways (read_shim: 1 read, 0 declined, -1 error).
  try {
    const py::object f32 = torch.attr("float32"), bf16 = torch.attr("bfloat16"),
                     f16 = torch.attr("float16");
    const py::object a = torch.attr("arange")(12, py::arg("dtype") = f32);
    const py::object h = torch.attr("ones")(7, py::arg("dtype") = f16);
    const py::object probes[] = {
        a, a[py::slice(3, 12, 1)], a.attr("view")(3, 4), a.attr("view")(3, 4).attr("t")(),
        a[py::slice(0, 12, 2)], torch.attr("zeros")(5, py::arg("dtype") = bf16),
        h[py::slice(2, 7, 1)], torch.attr("zeros")(0), torch.attr("arange")(4),
        parameter(torch.attr("ones")(3))};
    for (const py::object& p : probes) {
      if (!exact_tensor(f, p.ptr())) return;
      FastFields x, y;
      const bool by_getters = read_getters(f, p.ptr(), true, &x);
      const int by_shim = read_shim(f, p.ptr(), true, &y);
      if (by_shim < 0 || by_getters != (by_shim == 1)) return;
      if (by_getters && (x.dtype != y.dtype || x.numel != y.numel ||
                         x.data_ptr != y.data_ptr || x.dim != y.dim)) {
        return;
      }
    }
    f.mode_enabled = py::object(C.attr("_is_torch_function_mode_enabled")).release().ptr();
  } catch (const py::error_already_set&) {
    PyErr_Clear();
    return;
  }
  *ft = f;
#else
  (void)ft; (void)base; (void)tensor; (void)parameter; (void)torch;
#endif
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
  resolve_shim(&ft, base, tensor, parameter, torch);
  return ft;
}

}  // namespace detail

inline const FastTensor& fast_tensor() {
  PYBIND11_CONSTINIT static py::gil_safe_call_once_and_store<FastTensor> storage;
  return storage.call_once_and_store_result(detail::resolve_fast_tensor).get_stored();
}

}  // namespace zk::py_binding
