// zkernels._C_nccl: the NCCL engine (CUDA builds only). A module of its own so that
// zkernels._C (CPU Adam) never needs libcudart/libnccl to import; see main.cpp.
#include <pybind11/pybind11.h>

namespace py = pybind11;

void init_nccl(py::module_& m);

PYBIND11_MODULE(_C_nccl, m) {
  m.doc() = "zkernels native core: NCCL communicator and async reduce-scatter/all-gather engine";
  init_nccl(m);
}
