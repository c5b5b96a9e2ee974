// Binding of csrc/cpu_adam: tensors in, checks at the boundary, GIL released for the step.
#include <pybind11/pybind11.h>

#include <string>

#include "cpu_adam/cpu_adam.h"
#include "tensor_arg.h"

namespace py = pybind11;
using zk::DType;
using zk::py_binding::TensorArg;
using zk::py_binding::tensor_arg;

namespace {

TensorArg fp32_buffer(const py::handle& obj, const char* name) {
  TensorArg t = tensor_arg(obj, name);
  zk::py_binding::float_dtype(t, /*allow_half=*/false);
  zk::py_binding::require_device(t, "cpu");
  zk::py_binding::require_contiguous(t);
  return t;
}

std::string adamw_step(const py::object& param, const py::object& grad, const py::object& exp_avg,
                       const py::object& exp_avg_sq, double lr, double beta1, double beta2,
                       double eps, double weight_decay, double step, bool decoupled,
                       double grad_scale, const py::object& found_inf, const py::object& out,
                       const std::string& isa, int num_threads) {
  using namespace zk::py_binding;
  const TensorArg p = fp32_buffer(param, "param");
  const TensorArg m = fp32_buffer(exp_avg, "exp_avg");
  const TensorArg v = fp32_buffer(exp_avg_sq, "exp_avg_sq");
  TensorArg g = tensor_arg(grad, "grad");
  const DType grad_dtype = float_dtype(g, /*allow_half=*/true);
  require_device(g, "cpu");
  require_contiguous(g);
  const std::string same = "the numel of param";
  require_numel(g, p.numel, same);
  require_numel(m, p.numel, same);
  require_numel(v, p.numel, same);

  zk::cpu::AdamWBuffers b;
  b.param = reinterpret_cast<float*>(p.data_ptr);
  b.grad = reinterpret_cast<const void*>(g.data_ptr);
  b.grad_dtype = grad_dtype;
  b.exp_avg = reinterpret_cast<float*>(m.data_ptr);
  b.exp_avg_sq = reinterpret_cast<float*>(v.data_ptr);
  b.numel = p.numel;
  if (!found_inf.is_none()) {
    const TensorArg f = fp32_buffer(found_inf, "found_inf");
    require_numel(f, 1, "a flag");
    b.found_inf = reinterpret_cast<const float*>(f.data_ptr);
  }
  if (!out.is_none()) {
    const TensorArg o = tensor_arg(out, "out");
    b.out_dtype = float_dtype(o, /*allow_half=*/true);
    require_device(o, "cpu");
    require_contiguous(o);
    require_numel(o, p.numel, same);
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
    ran = zk::cpu::adamw_step(b, cfg, wanted, num_threads);
  }
  return zk::cpu::isa_name(ran);
}

}  // namespace

void init_cpu_adam(py::module_& m) {
  m.def("cpu_adamw_step", &adamw_step, py::arg("param"), py::arg("grad"), py::arg("exp_avg"),
        py::arg("exp_avg_sq"), py::kw_only(), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
        py::arg("eps"), py::arg("weight_decay") = 0.0, py::arg("step"),
        py::arg("decoupled") = true, py::arg("grad_scale") = 1.0,
        py::arg("found_inf") = py::none(), py::arg("out") = py::none(),
        py::arg("isa") = "auto", py::arg("num_threads") = 0,
        R"doc(One AdamW step in place over flat contiguous CPU buffers.

Args:
    param, exp_avg, exp_avg_sq: fp32, numel n. grad: fp32/bf16/fp16, numel n.
    lr, beta1, beta2, eps, weight_decay, step, decoupled: as zkernels.reference.adamw_step.
    grad_scale: the gradient is divided by it (> 0).
    found_inf: optional fp32 1-element CPU tensor; nonzero -> nothing changes.
    out: optional fp32/bf16/fp16 buffer, numel n, receiving the updated params (RNE cast).
    isa: "auto", "scalar", "avx2" or "avx512" (forcing an unsupported one raises).
    num_threads: OpenMP threads, 0 for OpenMP's default.

Returns:
    The name of the path that ran.)doc");
  m.def("cpu_best_isa", [] { return std::string(zk::cpu::isa_name(zk::cpu::best_isa())); },
        "The fastest path this CPU supports.");
  m.def("cpu_isa_supported",
        [](const std::string& name) { return zk::cpu::isa_supported(zk::cpu::parse_isa(name)); },
        py::arg("isa"), "Whether this CPU can run the path named `isa`.");
}
