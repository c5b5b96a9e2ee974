// zkernels._C: the CPU part of the native core.
//
// [Note: no torch headers]
// The bindings never include torch headers nor link libtorch: a tensor arrives as a Python
// object and tensor_arg.h reads data_ptr()/numel()/dtype/device/is_contiguous() through
// attribute access, checks them (messages name the argument), then the GIL is released around
// the compute. Each TU builds in seconds, `pip install` builds under build isolation with only
// setuptools/pybind11/cmake/ninja, and one binary works with any torch version.
//
// The NCCL engine lives in a separate module, zkernels._C_nccl (main_nccl.cpp), so that this
// one never depends on libcudart/libnccl being loadable: a CPU-only machine, or a CUDA build
// imported where NCCL is missing, still gets the CPU Adam.
#include <pybind11/pybind11.h>

namespace py = pybind11;

void init_cpu_adam(py::module_& m);
void init_cpu_ops(py::module_& m);
void init_cpu_quant(py::module_& m);
void init_optimizer(py::module_& m);
void init_cpu_adam_lowbit(py::module_& m);

PYBIND11_MODULE(_C, m) {
  m.doc() = "zkernels native core: CPU AdamW (fp32, bf16 and int8 moments), the element-wise optimizers (Lion, SGD, AdEMAMix), and the CPU copy/cast/unscale/sum-of-squares and quantization ops (SIMD + OpenMP)";
  init_cpu_adam(m);
  init_cpu_ops(m);
  init_cpu_quant(m);
  init_optimizer(m);
  init_cpu_adam_lowbit(m);
}
