// Binding of csrc/cpu_quant: blockwise int8/int4 quantize, dequantize, dequantize-and-sum.
// Every tensor is checked in full here (tensor_arg.h; messages name the argument), so no call
// can read or write outside its tensors; zkernels.ops checks the same things first and raises
// its own messages. A few tensors per call: pybind11's dispatcher (~1 us) is noise next to
// the work, unlike the list ops of cpu_ops.cpp.
#include <pybind11/pybind11.h>

#include <cctype>
#include <cstdlib>
#include <string>

#include "cpu_quant/cpu_quant.h"
#include "isa_arg.h"
#include "tensor_arg.h"

namespace py = pybind11;
using zk::DType;
using zk::py_binding::TensorArg;

namespace {

using zk::py_binding::isa_arg;

TensorArg cpu_tensor(const py::handle& obj, const char* name) {
  TensorArg t = zk::py_binding::tensor_arg(obj, name);
  zk::py_binding::require_device(t, "cpu");
  zk::py_binding::require_contiguous(t);
  return t;
}

void check_format(int bits, int64_t block) {
  if (!zk::cpu::quant_bits_ok(bits)) {
    throw py::value_error("bits must be 8 or 4, got " + std::to_string(bits));
  }
  if (!zk::cpu::quant_block_ok(block)) {
    throw py::value_error("block_size must be a power of two in [2, 8192], got " +
                          std::to_string(block));
  }
}

int64_t code_numel(int64_t numel, int bits) { return bits == 8 ? numel : (numel + 1) / 2; }

// The codes tensor: int8 (bits 8) or uint8 (bits 4).
TensorArg codes_tensor(const py::handle& obj, const char* name, int bits) {
  TensorArg t = cpu_tensor(obj, name);
  const char* want = bits == 8 ? "int8" : "uint8";
  if (t.dtype != want) {
    throw py::type_error(t.name + " must be " + want + " for bits=" + std::to_string(bits) +
                         ", got " + t.dtype);
  }
  return t;
}

TensorArg scales_tensor(const py::handle& obj) {
  TensorArg t = cpu_tensor(obj, "scales");
  if (t.dtype != "float32") throw py::type_error("scales must be float32, got " + t.dtype);
  return t;
}

std::string quantize(const py::object& x, const py::object& q, const py::object& scales,
                     int bits, int64_t block, const py::object& isa, int num_threads) {
  check_format(bits, block);
  const TensorArg xt = cpu_tensor(x, "x");
  zk::cpu::QuantizeArgs a;
  a.dtype = zk::py_binding::float_dtype(xt, /*allow_half=*/true);
  a.numel = xt.numel;
  a.bits = bits;
  a.block = block;
  const TensorArg qt = codes_tensor(q, "out", bits);
  zk::py_binding::require_numel(qt, code_numel(a.numel, bits), "the codes");
  const TensorArg st = scales_tensor(scales);
  zk::py_binding::require_numel(st, (a.numel + block - 1) / block, "one per block");
  a.x = reinterpret_cast<const void*>(xt.data_ptr);
  a.q = reinterpret_cast<void*>(qt.data_ptr);
  a.scales = reinterpret_cast<float*>(st.data_ptr);
  const zk::cpu::Isa wanted = isa_arg(isa);
  zk::cpu::Isa ran;
  {
    py::gil_scoped_release release;
    ran = zk::cpu::quantize(a, wanted, num_threads);
  }
  return zk::cpu::isa_name(ran);
}

// The dequantize (sum false: one chunk) and the dequantize-and-sum: q holds chunks of
// code_numel(out.numel()) codes back to back, scales as many chunks of block scales.
std::string dequantize(const py::object& q, const py::object& scales, const py::object& out,
                       int bits, int64_t block, bool sum, double scale, bool accumulate,
                       const py::object& isa, int num_threads) {
  check_format(bits, block);
  const TensorArg ot = cpu_tensor(out, "out");
  zk::cpu::DequantizeArgs a;
  a.out_dtype = zk::py_binding::float_dtype(ot, /*allow_half=*/true);
  a.numel = ot.numel;
  a.bits = bits;
  a.block = block;
  a.sum = sum;
  a.scale = static_cast<float>(scale);
  a.accumulate = accumulate;
  const TensorArg qt = codes_tensor(q, "q", bits);
  const int64_t per_chunk = code_numel(a.numel, bits);
  const int64_t num_blocks = (a.numel + block - 1) / block;
  if (!sum) {
    zk::py_binding::require_numel(qt, per_chunk, "the codes of out");
  } else if (per_chunk == 0 || qt.numel % per_chunk != 0 || qt.numel == 0) {
    throw py::value_error("q must hold a whole number (>= 1) of chunks of " +
                          std::to_string(per_chunk) + " codes, got " +
                          std::to_string(qt.numel));
  }
  a.chunks = sum ? qt.numel / per_chunk : 1;
  const TensorArg st = scales_tensor(scales);
  zk::py_binding::require_numel(st, a.chunks * num_blocks, "one per block per chunk");
  a.q = reinterpret_cast<const void*>(qt.data_ptr);
  a.q_row = per_chunk;
  a.scales = reinterpret_cast<const float*>(st.data_ptr);
  a.s_row = num_blocks;
  a.out = reinterpret_cast<void*>(ot.data_ptr);
  const zk::cpu::Isa wanted = isa_arg(isa);
  zk::cpu::Isa ran;
  {
    py::gil_scoped_release release;
    ran = zk::cpu::dequantize(a, wanted, num_threads);
  }
  return zk::cpu::isa_name(ran);
}

}  // namespace

void init_cpu_quant(py::module_& m) {
  m.def("cpu_quantize", &quantize, py::arg("x"), py::arg("out"), py::arg("scales"),
        py::arg("bits"), py::arg("block_size"), py::arg("isa") = py::none(),
        py::arg("num_threads") = 0,
        "Blockwise symmetric quantization of x (fp32/bf16/fp16) into out (int8 codes, or\n"
        "uint8 int4 pairs, low nibble first) and scales (fp32, one per block), as\n"
        "zkernels.reference.quantize. isa: 'auto', 'scalar', 'avx2', 'avx512', or None:\n"
        "ZKERNELS_CPU_ISA read now. Returns the name of the path that ran.");
  m.def("cpu_dequantize", &dequantize, py::arg("q"), py::arg("scales"), py::arg("out"),
        py::arg("bits"), py::arg("block_size"), py::arg("sum") = false,
        py::arg("scale") = 1.0, py::arg("accumulate") = false, py::arg("isa") = py::none(),
        py::arg("num_threads") = 0,
        "sum=False: out = round(float(q) * scale of its block), as\n"
        "zkernels.reference.dequantize. sum=True: q and scales hold N chunks of out's codes\n"
        "and scales back to back; out = round((+0 + chunk 0 + ... + chunk N-1) * scale\n"
        "[+ out when accumulate]) in fp32, as zkernels.reference.dequantize_sum. Returns the\n"
        "name of the path that ran.");
}
