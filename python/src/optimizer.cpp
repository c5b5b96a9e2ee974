// Binding of csrc/optim: every element-wise optimizer kind through one function, tensors in,
// checks at the boundary (messages name the argument), GIL released for the step.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "buffers.h"
#include "optim/optimizer.h"

namespace py = pybind11;
using zk::cpu::OptimizerKind;

namespace {

const OptimizerKind& find_kind(const std::string& kind) {
  int count = 0;
  const OptimizerKind* kinds = zk::cpu::optimizer_kinds(&count);
  std::string names;
  for (int i = 0; i < count; ++i) {
    if (kind == kinds[i].name) return kinds[i];
    names += (i ? ", " : "") + std::string(kinds[i].name);
  }
  throw py::value_error("kind must be one of " + names + "; got '" + kind + "'");
}

std::string optimizer_step(const std::string& kind, const py::object& param,
                           const py::object& grad, const py::sequence& states,
                           const std::vector<double>& coeffs, double grad_scale,
                           const py::object& found_inf, const py::object& out,
                           const std::string& isa, int num_threads) {
  using namespace zk::py_binding;
  const OptimizerKind& k = find_kind(kind);
  std::string names;
  for (int j = 0; j < k.num_states; ++j) names += (j ? ", " : "") + std::string(k.state_names[j]);
  if (static_cast<int>(py::len(states)) != k.num_states) {
    throw py::value_error("states must hold " + std::to_string(k.num_states) + " buffers for " +
                          kind + " (" + names + "), got " + std::to_string(py::len(states)));
  }
  if (static_cast<int>(coeffs.size()) != k.num_coeffs) {
    throw py::value_error("coeffs must hold " + std::to_string(k.num_coeffs) +
                          " coefficients for " + kind + ", got " +
                          std::to_string(coeffs.size()));
  }
  const TensorArg p = fp32_buffer(param, "param");
  zk::cpu::StepBuffers b;
  b.param = reinterpret_cast<float*>(p.data_ptr);
  b.numel = p.numel;
  b.grad = reinterpret_cast<const void*>(grad_buffer(grad, p.numel, &b.grad_dtype).data_ptr);
  for (int j = 0; j < k.num_states; ++j) {
    const py::object s = states[j];
    if (!s.is_none()) {
      b.states[j] = reinterpret_cast<float*>(fp32_buffer(s, k.state_names[j], p.numel).data_ptr);
    }
  }
  step_extras(found_inf, out, p.numel, &b.found_inf, &b.out, &b.out_dtype);
  const zk::cpu::Isa wanted = zk::cpu::parse_isa(isa);
  zk::cpu::Isa ran;
  {
    py::gil_scoped_release release;
    ran = zk::cpu::optimizer_step(kind, b, coeffs.data(), static_cast<int>(coeffs.size()),
                                  grad_scale, wanted, num_threads);
  }
  return zk::cpu::isa_name(ran);
}

py::dict optimizer_kinds() {
  int count = 0;
  const OptimizerKind* kinds = zk::cpu::optimizer_kinds(&count);
  py::dict d;
  for (int i = 0; i < count; ++i) {
    py::tuple names(kinds[i].num_states);
    for (int j = 0; j < kinds[i].num_states; ++j) names[j] = py::str(kinds[i].state_names[j]);
    d[py::str(kinds[i].name)] = py::make_tuple(names, kinds[i].num_coeffs);
  }
  return d;
}

}  // namespace

void init_optimizer(py::module_& m) {
  m.def("cpu_optimizer_step", &optimizer_step, py::arg("kind"), py::arg("param"),
        py::arg("grad"), py::arg("states"), py::arg("coeffs"), py::kw_only(),
        py::arg("grad_scale") = 1.0, py::arg("found_inf") = py::none(),
        py::arg("out") = py::none(), py::arg("isa") = "auto", py::arg("num_threads") = 0,
        R"doc(One step of the element-wise optimizer `kind` in place over flat contiguous CPU
buffers.

Args:
    kind: the definition's name (zkernels.optimizers.REGISTRY; cpu_optimizer_kinds()).
    param: fp32, numel n. grad: fp32/bf16/fp16, numel n.
    states: the definition's state buffers in its order, fp32, numel n each; None where the
        state is absent (only where the kind does not read it).
    coeffs: definition.coefficients(h, step), by position (each rounded to fp32 once).
    grad_scale: the gradient is multiplied by fp32(1 / grad_scale) (> 0).
    found_inf: optional fp32 1-element CPU tensor; nonzero -> nothing changes.
    out: optional fp32/bf16/fp16 buffer, numel n, receiving the updated params (RNE cast).
    isa: "auto", "scalar", "avx2" or "avx512" (forcing an unsupported one raises).
    num_threads: OpenMP threads, 0 for OpenMP's default.

Returns:
    The name of the path that ran.

Raises:
    ValueError: an unknown kind, a wrong number of states or coefficients (naming the kind),
        a missing state, a coefficient out of range, a bad grad_scale, isa or num_threads.
    TypeError: a buffer of the wrong type or dtype (naming it).)doc");
  m.def("cpu_optimizer_kinds", &optimizer_kinds,
        "kind -> (state names in order, number of coefficients), as registered in C++.");
}
