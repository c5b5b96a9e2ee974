// Binding of csrc/nccl: tensors checked at the boundary (CUDA, the engine's device,
// contiguous, one dtype, sizes), streams passed as integers (torch's `cuda_stream`), the GIL
// released around every call that can wait.
#include <pybind11/pybind11.h>

#include <string>

#include "nccl/engine.h"
#include "tensor_arg.h"

namespace py = pybind11;
using zk::DType;
using zk::nccl::Engine;
using zk::nccl::Handle;
using zk::nccl::RedOp;
using zk::py_binding::TensorArg;

namespace {

TensorArg comm_tensor(const Engine& engine, const py::handle& obj, const char* name) {
  TensorArg t = zk::py_binding::tensor_arg(obj, name);
  zk::py_binding::float_dtype(t, /*allow_half=*/true);
  zk::py_binding::require_device(t, "cuda");
  if (t.device_index != engine.device()) {
    throw py::value_error(t.name + " is on " + zk::py_binding::device_str(t) +
                          " but the engine runs on cuda:" + std::to_string(engine.device()));
  }
  zk::py_binding::require_contiguous(t);
  return t;
}

void same_dtype(const TensorArg& a, const TensorArg& b) {
  if (a.dtype != b.dtype) {
    throw py::type_error(a.name + " has dtype " + a.dtype + " but " + b.name + " has " + b.dtype +
                         ": a collective moves one dtype");
  }
}

RedOp parse_op(const std::string& op) {
  if (op == "sum") return RedOp::kSum;
  if (op == "avg") return RedOp::kAvg;
  if (op == "max") return RedOp::kMax;
  throw py::value_error("op must be 'sum', 'avg' or 'max', got '" + op + "'");
}

cudaStream_t as_stream(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

Handle reduce_scatter(Engine& e, const py::object& output, const py::object& input,
                      const std::string& op, uintptr_t stream) {
  const TensorArg out = comm_tensor(e, output, "output");
  const TensorArg in = comm_tensor(e, input, "input");
  same_dtype(out, in);
  zk::py_binding::require_numel(in, out.numel * e.world_size(), "output's numel * world_size");
  const RedOp red = parse_op(op);
  const DType dtype = zk::py_binding::float_dtype(out, true);
  py::gil_scoped_release release;
  return e.reduce_scatter(reinterpret_cast<void*>(out.data_ptr),
                          reinterpret_cast<const void*>(in.data_ptr), out.numel, dtype, red,
                          as_stream(stream));
}

Handle all_gather(Engine& e, const py::object& output, const py::object& input,
                  uintptr_t stream) {
  const TensorArg out = comm_tensor(e, output, "output");
  const TensorArg in = comm_tensor(e, input, "input");
  same_dtype(out, in);
  zk::py_binding::require_numel(out, in.numel * e.world_size(), "input's numel * world_size");
  const DType dtype = zk::py_binding::float_dtype(out, true);
  py::gil_scoped_release release;
  return e.all_gather(reinterpret_cast<void*>(out.data_ptr),
                      reinterpret_cast<const void*>(in.data_ptr), in.numel, dtype,
                      as_stream(stream));
}

Handle all_reduce(Engine& e, const py::object& tensor, const std::string& op, uintptr_t stream) {
  const TensorArg t = comm_tensor(e, tensor, "tensor");
  const RedOp red = parse_op(op);
  const DType dtype = zk::py_binding::float_dtype(t, true);
  py::gil_scoped_release release;
  return e.all_reduce(reinterpret_cast<void*>(t.data_ptr), t.numel, dtype, red,
                      as_stream(stream));
}

}  // namespace

void init_nccl(py::module_& m) {
  auto error = py::register_exception<zk::nccl::Error>(m, "NcclError", PyExc_RuntimeError);
  py::register_exception<zk::nccl::TimeoutError>(m, "NcclTimeoutError", error.ptr());

  m.def("unique_id", [] { return py::bytes(zk::nccl::make_unique_id()); },
        "A fresh ncclUniqueId as bytes (made on rank 0, sent to the others).");

  py::class_<Handle>(m, "Work", "One launched collective.")
      .def("wait", [](const Handle& h, uintptr_t stream) {
             py::gil_scoped_release release;
             h.wait(as_stream(stream));
           }, py::arg("stream"), "Make `stream` (an integer cudaStream_t) wait for it.")
      .def("synchronize", [](const Handle& h) {
             py::gil_scoped_release release;
             h.synchronize();
           }, "Block until it is done; raises NcclError/NcclTimeoutError on failure.")
      .def("is_completed", &Handle::is_completed);

  py::class_<Engine>(m, "Engine", "An NCCL communicator with its own comm stream.")
      .def(py::init([](const py::bytes& unique_id, int rank, int world_size, int device,
                       double timeout_s) {
             std::string id = unique_id;
             py::gil_scoped_release release;  // init waits for the peers
             return new Engine(id, rank, world_size, device, timeout_s);
           }),
           py::arg("unique_id"), py::arg("rank"), py::arg("world_size"), py::arg("device"),
           py::arg("timeout_s"))
      .def("reduce_scatter", &reduce_scatter, py::arg("output"), py::arg("input"),
           py::arg("op"), py::arg("stream"))
      .def("all_gather", &all_gather, py::arg("output"), py::arg("input"), py::arg("stream"))
      .def("all_reduce", &all_reduce, py::arg("tensor"), py::arg("op"), py::arg("stream"))
      .def("abort", [](Engine& e, const std::string& reason) { e.abort(reason); },
           py::arg("reason") = "requested")
      .def_property_readonly("rank", &Engine::rank)
      .def_property_readonly("world_size", &Engine::world_size)
      .def_property_readonly("device", &Engine::device)
      .def_property_readonly("stream", [](const Engine& e) {
        return reinterpret_cast<uintptr_t>(e.stream());
      });
}
