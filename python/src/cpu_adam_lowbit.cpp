// Binding of csrc/cpu_adam_lowbit (AdamW over bf16 or blockwise int8 moments): tensors in,
// checks at the boundary (messages name the argument), GIL released for the step.
#include <pybind11/pybind11.h>

#include <string>

#include "cpu_adam_lowbit/cpu_adam_lowbit.h"
#include "cpu_quant/cpu_quant.h"  // quant_block_ok
#include "tensor_arg.h"

namespace py = pybind11;
using zk::DType;
using zk::py_binding::TensorArg;
using zk::py_binding::tensor_arg;

namespace {

TensorArg cpu_buffer(const py::handle& obj, const char* name, int64_t numel,
                     const std::string& what) {
  using namespace zk::py_binding;
  TensorArg t = tensor_arg(obj, name);
  require_device(t, "cpu");
  require_contiguous(t);
  require_numel(t, numel, what);
  return t;
}

void require_dtype(const TensorArg& t, const char* dtype, const char* why) {
  if (t.dtype != dtype) {
    throw py::type_error(t.name + " must be " + dtype + " (" + why + "), got " + t.dtype);
  }
}

std::string adamw_step_lowbit(const py::object& param, const py::object& grad,
                              const py::object& exp_avg, const py::object& exp_avg_sq,
                              const py::object& exp_avg_scales,
                              const py::object& exp_avg_sq_scales, double lr, double beta1,
                              double beta2, double eps, double weight_decay, double step,
                              bool decoupled, double grad_scale, const py::object& found_inf,
                              const py::object& out, int64_t block_size,
                              const std::string& isa, int num_threads) {
  using namespace zk::py_binding;
  TensorArg p = tensor_arg(param, "param");
  require_device(p, "cpu");
  require_contiguous(p);
  if (p.dtype != "float32" && p.dtype != "bfloat16") {
    throw py::type_error("param must be float32 or bfloat16, got " + p.dtype);
  }
  const int64_t n = p.numel;
  const std::string same = "the numel of param";
  TensorArg g = cpu_buffer(grad, "grad", n, same);
  zk::cpu::LowbitBuffers b;
  b.param = reinterpret_cast<void*>(p.data_ptr);
  b.param_dtype = p.dtype == "float32" ? DType::kFloat32 : DType::kBFloat16;
  b.grad = reinterpret_cast<const void*>(g.data_ptr);
  b.grad_dtype = float_dtype(g, /*allow_half=*/true);
  b.numel = n;
  b.block_size = block_size;
  const TensorArg m = cpu_buffer(exp_avg, "exp_avg", n, same);
  const TensorArg v = cpu_buffer(exp_avg_sq, "exp_avg_sq", n, same);
  if (m.dtype == "bfloat16") {
    b.format = zk::cpu::MomentFormat::kBf16;
    require_dtype(v, "bfloat16", "bf16 moments");
    if (!exp_avg_scales.is_none() || !exp_avg_sq_scales.is_none()) {
      throw py::value_error("exp_avg_scales and exp_avg_sq_scales must be None for bf16 "
                            "moments (they have no scales)");
    }
  } else if (m.dtype == "int8") {
    b.format = zk::cpu::MomentFormat::kInt8;
    require_dtype(v, "uint8", "int8 moments: codes of sqrt(v)");
    if (!zk::cpu::quant_block_ok(block_size)) {
      throw py::value_error("block_size must be a power of two in [2, 8192], got " +
                            std::to_string(block_size));
    }
    const int64_t nb = (n + block_size - 1) / block_size;
    const std::string blocks = "one per block of " + std::to_string(block_size);
    struct Scales {
      const char* name;
      const py::object& obj;
      float*& dst;
    };
    for (const Scales& s : {Scales{"exp_avg_scales", exp_avg_scales, b.exp_avg_scales},
                            Scales{"exp_avg_sq_scales", exp_avg_sq_scales,
                                   b.exp_avg_sq_scales}}) {
      if (s.obj.is_none()) {
        throw py::value_error(std::string(s.name) + " is required with int8 moments (fp32, " +
                              blocks + ": " + std::to_string(nb) + ")");
      }
      const TensorArg t = cpu_buffer(s.obj, s.name, nb, blocks);
      require_dtype(t, "float32", "block scales");
      s.dst = reinterpret_cast<float*>(t.data_ptr);
    }
  } else {
    throw py::type_error("exp_avg must be bfloat16 (bf16 moments) or int8 (int8 moments), "
                         "got " + m.dtype);
  }
  b.exp_avg = reinterpret_cast<void*>(m.data_ptr);
  b.exp_avg_sq = reinterpret_cast<void*>(v.data_ptr);
  if (!found_inf.is_none()) {
    const TensorArg f = cpu_buffer(found_inf, "found_inf", 1, "a flag");
    require_dtype(f, "float32", "a flag");
    b.found_inf = reinterpret_cast<const float*>(f.data_ptr);
  }
  if (!out.is_none()) {
    const TensorArg o = cpu_buffer(out, "out", n, same);
    b.out_dtype = float_dtype(o, /*allow_half=*/true);
    b.out = reinterpret_cast<void*>(o.data_ptr);
  }
  zk::cpu::AdamWConfig cfg;
  cfg.lr = lr;
  cfg.beta1 = beta1;
  cfg.beta2 = beta2;
  cfg.eps = eps;
  cfg.weight_decay = weight_decay;
  cfg.step = step;
  cfg.decoupled = decoupled;
  cfg.grad_scale = grad_scale;
  const zk::cpu::Isa wanted = zk::cpu::parse_isa(isa);
  zk::cpu::Isa ran;
  {
    py::gil_scoped_release release;
    ran = zk::cpu::adamw_step_lowbit(b, cfg, wanted, num_threads);
  }
  return zk::cpu::isa_name(ran);
}

}  // namespace

void init_cpu_adam_lowbit(py::module_& m) {
  m.def("cpu_adamw_step_lowbit", &adamw_step_lowbit, py::arg("param"), py::arg("grad"),
        py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("exp_avg_scales") = py::none(),
        py::arg("exp_avg_sq_scales") = py::none(), py::kw_only(), py::arg("lr"),
        py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay") = 0.0,
        py::arg("step"), py::arg("decoupled") = true, py::arg("grad_scale") = 1.0,
        py::arg("found_inf") = py::none(), py::arg("out") = py::none(),
        py::arg("block_size") = 256, py::arg("isa") = "auto", py::arg("num_threads") = 0,
        R"doc(One AdamW step over low-bit moments in place, flat contiguous CPU buffers.

Args:
    param: fp32 or bf16 (bf16: stored rounded to nearest even), numel n.
    grad: fp32/bf16/fp16, numel n (divided by grad_scale when it is not 1).
    exp_avg, exp_avg_sq: bf16 and bf16 (bf16 moments), or int8 and uint8 codes (int8
        moments: absmax int8 exp_avg, uint8 codes of sqrt(exp_avg_sq)), numel n.
    exp_avg_scales, exp_avg_sq_scales: fp32, ceil(n / block_size) each (int8 moments), or
        None (bf16 moments).
    lr, beta1, beta2, eps, weight_decay, step, decoupled: as zkernels.reference.adamw_step.
    found_inf: optional fp32 1-element CPU tensor; nonzero -> nothing changes.
    out: optional fp32/bf16/fp16 buffer, numel n, receiving the updated params (RNE cast).
    block_size: elements per quantization block, a power of two in [2, 8192].
    isa: "auto", "scalar", "avx2" or "avx512" (forcing an unsupported one raises).
    num_threads: OpenMP threads (over whole blocks), 0 for OpenMP's default.

Returns:
    The name of the path that ran.)doc");
}
