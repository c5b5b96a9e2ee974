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
#include <string>
#include <vector>

#include "cpu_ops/cpu_ops.h"
#include "tensor_arg.h"

namespace py = pybind11;
using zk::DType;
using zk::py_binding::TensorArg;
using zk::py_binding::tensor_arg;

namespace {

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

// `isa` as given, or (None) ZKERNELS_CPU_ISA read now, stripped and lower-cased as
// zkernels._cpu reads it; unset or empty means auto.
zk::cpu::Isa isa_arg(const py::object& isa) {
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
  zk::cpu::CopySpec spec;
  spec.src = to_flat ? list_dtype : flat_dtype;
  spec.dst = to_flat ? flat_dtype : list_dtype;
  spec.scaled = scale != 1.0;
  spec.scale = static_cast<float>(scale);
  const bool plain_half_to_bf16 =
      !spec.scaled && !fp32_route && spec.src == DType::kFloat16 && spec.dst == DType::kBFloat16;
  spec.bf16_nan = plain_half_to_bf16 ? 0x7FC0 : 0xFFFF;
  zk::cpu::Isa ran;
  {
    py::gil_scoped_release release;
    ran = zk::cpu::copy_segments(segs.data(), static_cast<int64_t>(segs.size()), spec, wanted,
                                 num_threads);
  }
  return zk::cpu::isa_name(ran);
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

}  // namespace

void init_cpu_ops(py::module_& m) {
  m.def("cpu_copy_segments", &copy_segments, py::arg("tensors"), py::arg("flat"),
        py::arg("offsets"), py::arg("to_flat"), py::arg("scale") = 1.0,
        py::arg("fp32_route") = false, py::arg("isa") = py::none(), py::arg("num_threads") = 0,
        R"doc(Copy each tensor to (to_flat) or from its offset in `flat`, times `scale` in fp32
(skipped when scale == 1), rounded to the destination dtype (RNE, torch's CPU NaN patterns;
fp32_route: the bucket ops' (x.float() * scale).to(dst) NaN pattern even when scale == 1).

tensors: list/tuple of CPU tensors of one dtype, contiguous (checked by zkernels.ops; see
[Note: per-tensor cost of the multi-tensor bindings]). flat: contiguous CPU tensor (checked).
isa: "auto", "scalar", "avx2", "avx512", or None: ZKERNELS_CPU_ISA read now (unset: auto).
Returns the name of the path that ran.)doc");
  m.def("cpu_unscale_and_check", &unscale_and_check, py::arg("x"), py::arg("inv_scale"),
        py::arg("found_inf"), py::arg("isa") = py::none(), py::arg("num_threads") = 0,
        R"doc(In place x = (x.float() * inv_scale).to(x.dtype); found_inf = 1 if x held inf/NaN.
Returns whether it did.)doc");
  m.def("cpu_sum_squares", &sum_squares, py::arg("tensors"), py::arg("out"),
        py::arg("isa") = py::none(), py::arg("num_threads") = 0,
        "out (1-element fp32) = the sum of squares of every element of every tensor (fp64 "
        "accumulation in a fixed order, rounded once).");
}
