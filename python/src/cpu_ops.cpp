// Binding of csrc/cpu_ops: the copy-scale-cast, unscale + check and sum of squares.
//
// [Note: per-tensor cost of the multi-tensor bindings]
// A list op's fixed cost is what decides it against torch at 256K elements in 32 tensors:
// every tensor attribute read from Python costs ~0.1 us, as much as copying a few hundred
// bytes. So the lists are read here with interned names and vectorcall, and each list tensor
// only for what the copy needs: data_ptr() and numel() (sum_squares: also its dtype); a
// single tensor costs ~0.5 us in full (tensor_arg.h). The rest
// of their contract (one dtype, CPU, contiguous) was checked once by zkernels.ops, which is the
// only caller of zkernels._cpu (the same split as the Triton launchers); the first tensor and
// every single tensor (flat buffer, bucket, out, x, found_inf) are still checked in full here,
// and every offset + numel is checked against the flat buffer, so that no offset can write
// outside it.
#include <Python.h>
#include <pybind11/pybind11.h>

#include <cctype>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu_ops/cpu_ops.h"
#include "isa_arg.h"
#include "tensor_arg.h"
#include "tensor_fast.h"

namespace py = pybind11;
using zk::DType;
using zk::py_binding::TensorArg;
using zk::py_binding::tensor_arg;

namespace {

using zk::py_binding::isa_arg;

int64_t int_method(PyObject* obj, const py::str& name) {
  const py::object r = zk::py_binding::call_method(obj, name);
  const long long v = PyLong_AsLongLong(r.ptr());
  if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
  return v;
}

uintptr_t data_ptr(PyObject* obj, const py::str& name) {
  const py::object r = zk::py_binding::call_method(obj, name);
  const unsigned long long v = PyLong_AsUnsignedLongLong(r.ptr());
  if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) throw py::error_already_set();
  return static_cast<uintptr_t>(v);
}

// ZKERNELS_BACKEND (read now, as zkernels.ops reads it: stripped, lower case) leaves the choice
// to the default (unset or empty; the cpp backend for CPU tensors where it is built) or names
// cpp itself.
bool env_allows_cpp() {
  const char* env = std::getenv("ZKERNELS_BACKEND");
  if (env == nullptr) return true;
  std::string name = env;
  const auto first = name.find_first_not_of(" \t\n\r\f\v");
  if (first == std::string::npos) return true;
  const auto last = name.find_last_not_of(" \t\n\r\f\v");
  name = name.substr(first, last - first + 1);
  for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return name == "cpp";
}

// ZKERNELS_CPU_ISA as isa_arg reads it; false (nothing raised) when it names no path.
bool env_isa(zk::cpu::Isa* isa) {
  try {
    *isa = isa_arg(py::none());
  } catch (const std::invalid_argument&) {
    return false;
  }
  return true;
}

// How a copy from `src` to `dst` dtype converts: times `scale` when it is not 1, the NaN
// pattern of the plain cast or of the bucket ops' fp32 route (see cpu_copy_segments' doc).
zk::cpu::CopySpec copy_spec(DType src, DType dst, double scale, bool fp32_route) {
  zk::cpu::CopySpec spec;
  spec.src = src;
  spec.dst = dst;
  spec.scaled = scale != 1.0;
  spec.scale = static_cast<float>(scale);
  const bool plain_half_to_bf16 =
      !spec.scaled && !fp32_route && spec.src == DType::kFloat16 && spec.dst == DType::kBFloat16;
  spec.bf16_nan = plain_half_to_bf16 ? 0x7FC0 : 0xFFFF;
  return spec;
}

TensorArg cpu_tensor(const py::handle& obj, const char* name) {
  TensorArg t = tensor_arg(obj, name);
  zk::py_binding::float_dtype(t, /*allow_half=*/true);
  zk::py_binding::require_device(t, "cpu");
  zk::py_binding::require_contiguous(t);
  return t;
}

// A list or tuple, as a borrowed fast sequence.
struct Items {
  py::object seq;
  Py_ssize_t size = 0;
  PyObject** items = nullptr;
  Items(const py::handle& obj, const char* name) {
    if (!PyList_Check(obj.ptr()) && !PyTuple_Check(obj.ptr())) {
      throw py::type_error(std::string(name) + " must be a list or tuple");
    }
    seq = py::reinterpret_steal<py::object>(PySequence_Fast(obj.ptr(), name));
    if (!seq) throw py::error_already_set();
    size = PySequence_Fast_GET_SIZE(seq.ptr());
    items = PySequence_Fast_ITEMS(seq.ptr());
  }
};

std::string copy_segments(const py::object& tensors, const py::object& flat,
                          const py::object& offsets, bool to_flat, double scale, bool fp32_route,
                          const py::object& isa, int num_threads) {
  const Items ts(tensors, "tensors");
  const Items offs(offsets, "offsets");
  if (offs.size != ts.size) {
    throw py::value_error("offsets has " + std::to_string(offs.size) + " entries for " +
                          std::to_string(ts.size) + " tensors");
  }
  const zk::cpu::Isa wanted = isa_arg(isa);
  if (ts.size == 0) return zk::cpu::isa_name(wanted);
  const zk::py_binding::TorchTypes& tt = zk::py_binding::torch_types();
  const TensorArg f = cpu_tensor(flat, "flat");
  const TensorArg first = cpu_tensor(ts.items[0], "tensors[0]");
  const DType flat_dtype = zk::py_binding::float_dtype(f, true);
  const DType list_dtype = zk::py_binding::float_dtype(first, true);
  const int64_t flat_bytes = zk::dtype_bytes(flat_dtype);

  std::vector<zk::cpu::Segment> segs(static_cast<size_t>(ts.size));
  for (Py_ssize_t i = 0; i < ts.size; ++i) {
    PyObject* t = ts.items[i];
    const int64_t n = i == 0 ? first.numel : int_method(t, tt.numel);
    const uintptr_t p = i == 0 ? first.data_ptr : data_ptr(t, tt.data_ptr);
    const long long o = PyLong_AsLongLong(offs.items[i]);
    if (o == -1 && PyErr_Occurred()) throw py::error_already_set();
    if (o < 0 || o + n > f.numel) {
      throw py::value_error("flat is too small or offsets[" + std::to_string(i) +
                            "] is out of range: tensor " + std::to_string(i) + " needs elements [" +
                            std::to_string(o) + ", " + std::to_string(o + n) + ") of " +
                            std::to_string(f.numel));
    }
    char* at = reinterpret_cast<char*>(f.data_ptr) + o * flat_bytes;
    zk::cpu::Segment& s = segs[static_cast<size_t>(i)];
    s.numel = n;
    s.src = to_flat ? reinterpret_cast<const void*>(p) : at;
    s.dst = to_flat ? at : reinterpret_cast<void*>(p);
  }
  const zk::cpu::CopySpec spec = copy_spec(to_flat ? list_dtype : flat_dtype,
                                           to_flat ? flat_dtype : list_dtype, scale, fp32_route);
  zk::cpu::Isa ran;
  {
    py::gil_scoped_release release;
    ran = zk::cpu::copy_segments(segs.data(), static_cast<int64_t>(segs.size()), spec, wanted,
                                 num_threads);
  }
  return zk::cpu::isa_name(ran);
}


// What every checked fast path asks first: the tensor reader resolved, ZKERNELS_BACKEND
// allowing cpp (with obey_env) and ZKERNELS_CPU_ISA valid. Fills the ISA asked for and whether
// this call reads through the shim (tensor_fast.h's use_shim); false: decline the call.
bool fast_call_open(const zk::py_binding::FastTensor& ft, bool obey_env, zk::cpu::Isa* wanted,
                    bool* shim) {
  if (!ft.ok) return false;
  if (obey_env && !env_allows_cpp()) return false;
  if (!env_isa(wanted)) return false;
  *shim = zk::py_binding::use_shim(ft);
  return true;
}

// [Note: checked fast path of the copy ops]
// On one thread at 256K elements in 32 tensors, flatten's copy takes ~23 us and torch.cat
// spends ~4.5 us on everything else (~0.11 us a tensor in C++). The checked Python path
// (zkernels.ops: list and offset checks, backend choice, then the binding above) cost ~20 us
// of that kind, so the public ops and OpSet first offer every call to cpu_copy_checked: it
// checks in C everything the Python path checks, reading each tensor through torch's stable
// C shim (tensor_fast.h, [Note: tensor fields through the stable C shim]: ~60 ns a tensor),
// or, where that is not available or a torch-function mode is active, through torch's own
// getter and method functions called straight through their C pointers (five reads, ~0.17 us
// a tensor), and runs the copy when all of it holds. When anything does not hold (a non-exact
// tensor type, another device or dtype, a non-contiguous tensor, an offset that is not an int
// in range, a forced backend or ISA it does not take, an empty list) it copies nothing and
// returns False, and the caller runs the checked Python path, which raises the error that
// names the argument, or runs the backend chosen there. So the fast path changes no result
// and no message; it only skips the Python work when the call is valid. The cast (one tensor
// into an `out` of its numel, whole_flat) and the unscale (cpu_unscale_checked, below) take
// the same kind of path. Nothing read is kept between calls: caching it would be unsound
// (`t.data = other` changes a tensor's dtype, device, size and strides in place without
// bumping its version).
bool copy_checked(PyObject* tensors, PyObject* flat, PyObject* offsets, bool to_flat,
                  double scale, bool fp32_route, int num_threads, bool obey_env,
                  bool whole_flat) {
  const zk::py_binding::FastTensor& ft = zk::py_binding::fast_tensor();
  zk::cpu::Isa wanted;
  bool shim = false;
  if (!fast_call_open(ft, obey_env, &wanted, &shim)) return false;
  if (!PyList_CheckExact(tensors) && !PyTuple_CheckExact(tensors)) return false;
  const Py_ssize_t count = PySequence_Fast_GET_SIZE(tensors);
  PyObject** items = PySequence_Fast_ITEMS(tensors);
  if (count == 0) return false;
  PyObject** offs = nullptr;
  if (offsets != Py_None) {
    if (!PyList_CheckExact(offsets) && !PyTuple_CheckExact(offsets)) return false;
    if (PySequence_Fast_GET_SIZE(offsets) != count) return false;
    offs = PySequence_Fast_ITEMS(offsets);
  }
  zk::py_binding::FastFields f;
  if (!zk::py_binding::exact_tensor(ft, flat) ||
      !zk::py_binding::read_fast(ft, flat, /*want_dim=*/!whole_flat, &f, shim) ||
      (!whole_flat && f.dim != 1) || (whole_flat && offsets != Py_None)) {
    return false;
  }
  const int64_t flat_bytes = zk::dtype_bytes(f.dtype);
  std::vector<zk::cpu::Segment> segs(static_cast<size_t>(count));
  DType list_dtype = DType::kFloat32;
  int64_t pos = 0;  // back-to-back offsets when none are given
  for (Py_ssize_t i = 0; i < count; ++i) {
    PyObject* t = items[i];
    zk::py_binding::FastFields g;
    if (!zk::py_binding::exact_tensor(ft, t) ||
        !zk::py_binding::read_fast(ft, t, /*want_dim=*/false, &g, shim)) {
      return false;
    }
    if (i == 0) list_dtype = g.dtype;
    if (g.dtype != list_dtype) return false;
    int64_t o = pos;
    if (offs != nullptr) {
      if (!PyLong_CheckExact(offs[i])) return false;
      int overflow = 0;
      o = PyLong_AsLongLongAndOverflow(offs[i], &overflow);
      if (overflow != 0 || (o == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return false;
      }
    }
    if (o < 0 || o > f.numel || g.numel > f.numel - o) return false;
    pos = o + g.numel;
    if (whole_flat && (count != 1 || g.numel != f.numel)) return false;
    char* at = reinterpret_cast<char*>(f.data_ptr) + o * flat_bytes;
    zk::cpu::Segment& s = segs[static_cast<size_t>(i)];
    s.numel = g.numel;
    s.src = to_flat ? reinterpret_cast<const void*>(g.data_ptr) : at;
    s.dst = to_flat ? at : reinterpret_cast<void*>(g.data_ptr);
  }
  const zk::cpu::CopySpec spec = copy_spec(to_flat ? list_dtype : f.dtype,
                                           to_flat ? f.dtype : list_dtype, scale, fp32_route);
  {
    py::gil_scoped_release release;
    zk::cpu::copy_segments(segs.data(), static_cast<int64_t>(segs.size()), spec, wanted,
                           num_threads);
  }
  return true;
}

// The unscale's fast path, as copy_checked: every check of zkernels.ops.unscale_and_check_
// here (x a contiguous CPU float tensor with elements, found_inf and a tensor inv_scale
// 1-element fp32 CPU tensors, or inv_scale an exact float/int); runs it and returns true, or
// does nothing and returns false.
bool unscale_checked(PyObject* x, PyObject* inv_scale, PyObject* found_inf, int num_threads,
                     bool obey_env) {
  const zk::py_binding::FastTensor& ft = zk::py_binding::fast_tensor();
  zk::cpu::Isa wanted;
  bool shim = false;
  if (!fast_call_open(ft, obey_env, &wanted, &shim)) return false;
  zk::py_binding::FastFields t, f, s;
  if (!zk::py_binding::exact_tensor(ft, x) ||
      !zk::py_binding::read_fast(ft, x, false, &t, shim) ||
      t.numel == 0) {
    return false;
  }
  if (!zk::py_binding::exact_tensor(ft, found_inf) ||
      !zk::py_binding::read_fast(ft, found_inf, false, &f, shim) || f.dtype != DType::kFloat32 ||
      f.numel != 1) {
    return false;
  }
  float inv;
  if (PyFloat_CheckExact(inv_scale) || PyLong_CheckExact(inv_scale)) {
    const double v = PyFloat_AsDouble(inv_scale);
    if (v == -1.0 && PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
    inv = static_cast<float>(v);
  } else if (zk::py_binding::exact_tensor(ft, inv_scale) &&
             zk::py_binding::read_fast(ft, inv_scale, false, &s, shim) &&
             s.dtype == DType::kFloat32 && s.numel == 1) {
    std::memcpy(&inv, reinterpret_cast<const void*>(s.data_ptr), sizeof inv);
  } else {
    return false;
  }
  {
    py::gil_scoped_release release;
    if (zk::cpu::unscale_and_check(reinterpret_cast<void*>(t.data_ptr), t.dtype, t.numel, inv,
                                   wanted, num_threads)) {
      *reinterpret_cast<float*>(f.data_ptr) = 1.0f;
    }
  }
  return true;
}

bool unscale_and_check(const py::object& x, const py::object& inv_scale,
                       const py::object& found_inf, const py::object& isa, int num_threads) {
  const TensorArg t = cpu_tensor(x, "x");
  const DType dtype = zk::py_binding::float_dtype(t, true);
  const TensorArg f = cpu_tensor(found_inf, "found_inf");
  if (f.dtype != "float32") throw py::type_error("found_inf must be float32, got " + f.dtype);
  zk::py_binding::require_numel(f, 1, "a flag");
  float inv;
  if (py::isinstance(inv_scale, zk::py_binding::torch_types().tensor)) {
    const TensorArg s = cpu_tensor(inv_scale, "inv_scale");
    if (s.dtype != "float32") throw py::type_error("inv_scale must be float32, got " + s.dtype);
    zk::py_binding::require_numel(s, 1, "a scalar");
    std::memcpy(&inv, reinterpret_cast<const void*>(s.data_ptr), sizeof inv);
  } else {
    inv = static_cast<float>(inv_scale.cast<double>());
  }
  const zk::cpu::Isa wanted = isa_arg(isa);
  bool bad;
  {
    py::gil_scoped_release release;
    bad = zk::cpu::unscale_and_check(reinterpret_cast<void*>(t.data_ptr), dtype, t.numel, inv,
                                     wanted, num_threads);
    if (bad) *reinterpret_cast<float*>(f.data_ptr) = 1.0f;
  }
  return bad;
}

void sum_squares(const py::object& tensors, const py::object& out, const py::object& isa,
                 int num_threads) {
  const TensorArg o = cpu_tensor(out, "out");
  if (o.dtype != "float32") throw py::type_error("out must be float32, got " + o.dtype);
  zk::py_binding::require_numel(o, 1, "the sum");
  const Items ts(tensors, "tensors");
  const zk::py_binding::TorchTypes& tt = zk::py_binding::torch_types();
  std::vector<zk::cpu::Span> spans(static_cast<size_t>(ts.size));
  for (Py_ssize_t i = 0; i < ts.size; ++i) {
    PyObject* t = ts.items[i];
    PyObject* dt = PyObject_GetAttr(t, tt.dtype.ptr());
    if (dt == nullptr) throw py::error_already_set();
    zk::cpu::Span& s = spans[static_cast<size_t>(i)];
    s.dtype = dt == tt.float32.ptr() ? DType::kFloat32
              : dt == tt.bfloat16.ptr() ? DType::kBFloat16
              : dt == tt.float16.ptr() ? DType::kFloat16 : static_cast<DType>(-1);
    Py_DECREF(dt);
    if (static_cast<int>(s.dtype) < 0) {
      throw py::type_error("tensors[" + std::to_string(i) +
                           "] must be float32, bfloat16 or float16");
    }
    s.numel = int_method(t, tt.numel);
    s.data = reinterpret_cast<const void*>(data_ptr(t, tt.data_ptr));
  }
  const zk::cpu::Isa wanted = isa_arg(isa);
  {
    py::gil_scoped_release release;
    const double total = zk::cpu::sum_squares(spans.data(), static_cast<int64_t>(spans.size()),
                                              wanted, num_threads);
    *reinterpret_cast<float*>(o.data_ptr) = static_cast<float>(total);
  }
}


// ---- entry points ----------------------------------------------------------------------
// Plain METH_FASTCALL functions, positional arguments only: pybind11's dispatcher costs ~1 us
// a call (argument vectors, casters), which at 256K elements is several percent of an op (see
// [Note: per-tensor cost of the multi-tensor bindings]). Errors map as pybind11's would:
// py::type_error / value_error to TypeError / ValueError, std::invalid_argument to ValueError.

template <typename Fn>
PyObject* guarded(Fn&& fn) {
  try {
    return fn();
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const py::builtin_exception& e) {
    e.set_error();
  } catch (const std::invalid_argument& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

struct Args {
  PyObject* const* args;
  Py_ssize_t nargs;
  Args(PyObject* const* a, Py_ssize_t n, Py_ssize_t required, Py_ssize_t most,
       const char* signature)
      : args(a), nargs(n) {
    if (n < required || n > most) {
      throw py::type_error(std::string(signature) + ": takes " + std::to_string(required) +
                           " to " + std::to_string(most) + " positional arguments, got " +
                           std::to_string(n));
    }
  }
  bool given(Py_ssize_t i) const { return i < nargs; }
  py::object object(Py_ssize_t i) const {
    return given(i) ? py::reinterpret_borrow<py::object>(args[i]) : py::none();
  }
  bool boolean(Py_ssize_t i, bool otherwise) const {
    if (!given(i)) return otherwise;
    const int r = PyObject_IsTrue(args[i]);
    if (r < 0) throw py::error_already_set();
    return r != 0;
  }
  double real(Py_ssize_t i, double otherwise) const {
    if (!given(i)) return otherwise;
    const double v = PyFloat_AsDouble(args[i]);
    if (v == -1.0 && PyErr_Occurred()) throw py::error_already_set();
    return v;
  }
  int integer(Py_ssize_t i, int otherwise) const {
    if (!given(i)) return otherwise;
    const long v = PyLong_AsLong(args[i]);
    if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
    return static_cast<int>(v);
  }
};

constexpr const char* kCopySig =
    "cpu_copy_segments(tensors, flat, offsets, to_flat, scale=1.0, fp32_route=False, "
    "isa=None, num_threads=0)";
constexpr const char* kUnscaleSig =
    "cpu_unscale_and_check(x, inv_scale, found_inf, isa=None, num_threads=0)";
constexpr const char* kSumSig = "cpu_sum_squares(tensors, out, isa=None, num_threads=0)";

PyObject* copy_segments_entry(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return guarded([&] {
    const Args a(args, nargs, 4, 8, kCopySig);
    const std::string ran = copy_segments(a.object(0), a.object(1), a.object(2),
                                          a.boolean(3, true), a.real(4, 1.0),
                                          a.boolean(5, false), a.object(6), a.integer(7, 0));
    return PyUnicode_FromString(ran.c_str());
  });
}


constexpr const char* kCheckedSig =
    "cpu_copy_checked(tensors, flat, offsets, to_flat, scale, fp32_route, num_threads, "
    "obey_env, whole_flat)";

PyObject* copy_checked_entry(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return guarded([&] {
    const Args a(args, nargs, 9, 9, kCheckedSig);
    const bool ran = copy_checked(args[0], args[1], args[2], a.boolean(3, true),
                                  a.real(4, 1.0), a.boolean(5, false), a.integer(6, 0),
                                  a.boolean(7, true), a.boolean(8, false));
    return py::bool_(ran).release().ptr();
  });
}

constexpr const char* kUnscaleCheckedSig =
    "cpu_unscale_checked(x, inv_scale, found_inf, num_threads, obey_env)";

PyObject* unscale_checked_entry(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return guarded([&] {
    const Args a(args, nargs, 5, 5, kUnscaleCheckedSig);
    const bool ran = unscale_checked(args[0], args[1], args[2], a.integer(3, 0),
                                     a.boolean(4, true));
    return py::bool_(ran).release().ptr();
  });
}

PyObject* unscale_entry(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return guarded([&] {
    const Args a(args, nargs, 3, 5, kUnscaleSig);
    const bool bad = unscale_and_check(a.object(0), a.object(1), a.object(2), a.object(3),
                                       a.integer(4, 0));
    return py::bool_(bad).release().ptr();
  });
}

PyObject* sum_squares_entry(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return guarded([&] {
    const Args a(args, nargs, 2, 4, kSumSig);
    sum_squares(a.object(0), a.object(1), a.object(2), a.integer(3, 0));
    return py::none().release().ptr();
  });
}

PyObject* fast_reads_entry(PyObject*, PyObject*) {
  return guarded([&] {
    const zk::py_binding::FastTensor& ft = zk::py_binding::fast_tensor();
    return PyUnicode_FromString(!ft.ok ? "none" : ft.shim_ok ? "shim" : "getters");
  });
}

PyMethodDef g_methods[] = {
    {"cpu_fast_reads", fast_reads_entry, METH_NOARGS,
     "cpu_fast_reads()\n--\n\n"
     "How the checked fast paths read tensors in this process: 'shim' (torch's stable C shim,\n"
     "checked against the getters; see [Note: tensor fields through the stable C shim]),\n"
     "'getters' (torch's getter and method functions), or 'none' (the fast paths decline\n"
     "every call)."},
    {"cpu_copy_segments", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(
                              copy_segments_entry)),
     METH_FASTCALL,
     "cpu_copy_segments(tensors, flat, offsets, to_flat, scale=1.0, fp32_route=False, "
     "isa=None, num_threads=0)\n--\n\n"
     "Copy each tensor to (to_flat) or from its offset in `flat`, times `scale` in fp32\n"
     "(skipped when scale == 1), rounded to the destination dtype (RNE, torch's CPU NaN\n"
     "patterns; fp32_route: the bucket ops' (x.float() * scale).to(dst) NaN pattern even when\n"
     "scale == 1).\n\n"
     "tensors: list/tuple of CPU tensors of one dtype, contiguous (checked by zkernels.ops;\n"
     "see [Note: per-tensor cost of the multi-tensor bindings]). flat: contiguous CPU tensor\n"
     "(checked). isa: 'auto', 'scalar', 'avx2', 'avx512', or None: ZKERNELS_CPU_ISA read now\n"
     "(unset: auto). Positional arguments only. Returns the name of the path that ran."},
    {"cpu_copy_checked",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(copy_checked_entry)),
     METH_FASTCALL,
     "cpu_copy_checked(tensors, flat, offsets, to_flat, scale, fp32_route, num_threads, "
     "obey_env, whole_flat)\n--\n\n"
     "cpu_copy_segments with every check of zkernels.ops done here: runs the copy and returns\n"
     "True when the call is valid for this backend (exact torch.Tensor/Parameter objects, CPU,\n"
     "contiguous, one float dtype per side, flat 1-D, offsets a list/tuple of ints in range or\n"
     "None for back to back, ZKERNELS_CPU_ISA valid and, with obey_env, ZKERNELS_BACKEND unset,\n"
     "empty or cpp; whole_flat: one tensor, flat of any shape with exactly its numel, offsets\n"
     "None: the cast); else copies nothing and returns False (see [Note: checked fast path of\n"
     "the copy ops]). Positional arguments only, all nine."},
    {"cpu_unscale_checked",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(unscale_checked_entry)),
     METH_FASTCALL,
     "cpu_unscale_checked(x, inv_scale, found_inf, num_threads, obey_env)\n--\n\n"
     "cpu_unscale_and_check with every check of zkernels.ops done here: runs it and returns\n"
     "True when the call is valid for this backend (as cpu_copy_checked; x non-empty), else\n"
     "does nothing and returns False. Positional arguments only, all five."},
    {"cpu_unscale_and_check",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(unscale_entry)), METH_FASTCALL,
     "cpu_unscale_and_check(x, inv_scale, found_inf, isa=None, num_threads=0)\n--\n\n"
     "In place x = (x.float() * inv_scale).to(x.dtype); found_inf = 1 if x held inf/NaN.\n"
     "Positional arguments only. Returns whether it did."},
    {"cpu_sum_squares",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(sum_squares_entry)),
     METH_FASTCALL,
     "cpu_sum_squares(tensors, out, isa=None, num_threads=0)\n--\n\n"
     "out (1-element fp32) = the sum of squares of every element of every tensor (fp64\n"
     "accumulation in a fixed order, rounded once). Positional arguments only."},
};

}  // namespace

void init_cpu_ops(py::module_& m) {
  const py::object name = m.attr("__name__");
  for (PyMethodDef& def : g_methods) {
    PyObject* fn = PyCFunction_NewEx(&def, nullptr, name.ptr());
    if (fn == nullptr) throw py::error_already_set();
    m.add_object(def.ml_name, py::reinterpret_steal<py::object>(fn));
  }
}
