// Binding of csrc/cpu_optim (Lion, SGD): tensors in, checks at the boundary, GIL released for
// the step.
#include <pybind11/pybind11.h>

#include <string>

#include "cpu_optim/cpu_optim.h"
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

// param, grad, the state buffer (None allowed when !needs_state), found_inf and out.
zk::cpu::OptimBuffers buffers(const py::object& param, const py::object& grad,
                              const py::object& state, const char* state_name, bool needs_state,
                              const py::object& found_inf, const py::object& out) {
  using namespace zk::py_binding;
  const TensorArg p = fp32_buffer(param, "param");
  TensorArg g = tensor_arg(grad, "grad");
  const DType grad_dtype = float_dtype(g, /*allow_half=*/true);
  require_device(g, "cpu");
  require_contiguous(g);
  const std::string same = "the numel of param";
  require_numel(g, p.numel, same);
  zk::cpu::OptimBuffers b;
  b.param = reinterpret_cast<float*>(p.data_ptr);
  b.grad = reinterpret_cast<const void*>(g.data_ptr);
  b.grad_dtype = grad_dtype;
  b.numel = p.numel;
  if (needs_state || !state.is_none()) {
    const TensorArg s = fp32_buffer(state, state_name);
    require_numel(s, p.numel, same);
    b.state = reinterpret_cast<float*>(s.data_ptr);
  }
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
  return b;
}

std::string lion_step(const py::object& param, const py::object& grad, const py::object& exp_avg,
                      double lr, double beta1, double beta2, double weight_decay,
                      double grad_scale, const py::object& found_inf, const py::object& out,
                      const std::string& isa, int num_threads) {
  const zk::cpu::OptimBuffers b =
      buffers(param, grad, exp_avg, "exp_avg", /*needs_state=*/true, found_inf, out);
  zk::cpu::LionConfig cfg;
  cfg.lr = lr;
  cfg.beta1 = beta1;
  cfg.beta2 = beta2;
  cfg.weight_decay = weight_decay;
  cfg.grad_scale = grad_scale;
  const zk::cpu::Isa wanted = zk::cpu::parse_isa(isa);
  zk::cpu::Isa ran;
  {
    py::gil_scoped_release release;
    ran = zk::cpu::lion_step(b, cfg, wanted, num_threads);
  }
  return zk::cpu::isa_name(ran);
}

std::string sgd_step(const py::object& param, const py::object& grad,
                     const py::object& momentum_buffer, double lr, double momentum,
                     double dampening, double weight_decay, bool nesterov, bool first_step,
                     double grad_scale, const py::object& found_inf, const py::object& out,
                     const std::string& isa, int num_threads) {
  const zk::cpu::OptimBuffers b = buffers(param, grad, momentum_buffer, "momentum_buffer",
                                          /*needs_state=*/momentum != 0.0, found_inf, out);
  zk::cpu::SgdConfig cfg;
  cfg.lr = lr;
  cfg.momentum = momentum;
  cfg.dampening = dampening;
  cfg.weight_decay = weight_decay;
  cfg.nesterov = nesterov;
  cfg.first_step = first_step;
  cfg.grad_scale = grad_scale;
  const zk::cpu::Isa wanted = zk::cpu::parse_isa(isa);
  zk::cpu::Isa ran;
  {
    py::gil_scoped_release release;
    ran = zk::cpu::sgd_step(b, cfg, wanted, num_threads);
  }
  return zk::cpu::isa_name(ran);
}

}  // namespace

void init_cpu_optim(py::module_& m) {
  m.def("cpu_lion_step", &lion_step, py::arg("param"), py::arg("grad"), py::arg("exp_avg"),
        py::kw_only(), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
        py::arg("weight_decay") = 0.0, py::arg("grad_scale") = 1.0,
        py::arg("found_inf") = py::none(), py::arg("out") = py::none(),
        py::arg("isa") = "auto", py::arg("num_threads") = 0,
        R"doc(One Lion step in place over flat contiguous CPU buffers.

Args:
    param, exp_avg: fp32, numel n. grad: fp32/bf16/fp16, numel n.
    lr, beta1, beta2, weight_decay: as zkernels.reference.lion_step.
    grad_scale: the gradient is divided by it (> 0).
    found_inf: optional fp32 1-element CPU tensor; nonzero -> nothing changes.
    out: optional fp32/bf16/fp16 buffer, numel n, receiving the updated params (RNE cast).
    isa: "auto", "scalar", "avx2" or "avx512" (forcing an unsupported one raises).
    num_threads: OpenMP threads, 0 for OpenMP's default.

Returns:
    The name of the path that ran.)doc");
  m.def("cpu_sgd_step", &sgd_step, py::arg("param"), py::arg("grad"),
        py::arg("momentum_buffer"), py::kw_only(), py::arg("lr"), py::arg("momentum") = 0.0,
        py::arg("dampening") = 0.0, py::arg("weight_decay") = 0.0,
        py::arg("nesterov") = false, py::arg("first_step") = false,
        py::arg("grad_scale") = 1.0, py::arg("found_inf") = py::none(),
        py::arg("out") = py::none(), py::arg("isa") = "auto", py::arg("num_threads") = 0,
        R"doc(One SGD step (torch.optim.SGD's rule) in place over flat contiguous CPU buffers.

Args:
    param: fp32, numel n. grad: fp32/bf16/fp16, numel n. momentum_buffer: fp32, numel n
        (None allowed when momentum == 0).
    lr, momentum, dampening, weight_decay, nesterov: as zkernels.reference.sgd_step.
    first_step: the momentum buffer is set to the gradient (torch's first step).
    grad_scale, found_inf, out, isa, num_threads: as cpu_lion_step.

Returns:
    The name of the path that ran.)doc");
}
