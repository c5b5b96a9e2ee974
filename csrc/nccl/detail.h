// Internal to csrc/nccl: CUDA/NCCL error helpers, the device guard and the shared state of
// one launched collective (written by the engine's watchdog, read by its Handle).
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>

#include "nccl/engine.h"

namespace zk::nccl::detail {

using Clock = std::chrono::steady_clock;

[[noreturn]] inline void throw_cuda(const char* call, cudaError_t err) {
  throw Error(std::string("CUDA error in ") + call + ": " + cudaGetErrorName(err) + ": " +
              cudaGetErrorString(err));
}

inline void cuda_check(const char* call, cudaError_t err) {
  if (err != cudaSuccess) throw_cuda(call, err);
}

inline std::string nccl_message(const char* call, ncclResult_t r, ncclComm_t comm) {
  std::string msg = std::string("NCCL error in ") + call + ": " + ncclGetErrorString(r);
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && last[0] != '\0') msg += std::string(" (") + last + ")";
  return msg;
}

// Makes `device` current for the scope and restores the caller's device after: the engine
// must not change which device torch's code on this thread sees.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cuda_check("cudaGetDevice", cudaGetDevice(&previous_));
    if (previous_ != device) cuda_check("cudaSetDevice", cudaSetDevice(device));
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }

 private:
  int previous_ = 0;
};

inline ncclDataType_t nccl_dtype(DType d) {
  switch (d) {
    case DType::kBFloat16: return ncclBfloat16;
    case DType::kFloat16: return ncclFloat16;
    default: return ncclFloat32;
  }
}

inline ncclRedOp_t nccl_op(RedOp op) {
  switch (op) {
    case RedOp::kAvg: return ncclAvg;
    case RedOp::kMax: return ncclMax;
    default: return ncclSum;
  }
}

inline Clock::duration seconds(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

struct WorkState {
  std::string name;
  int device = 0;
  cudaEvent_t done = nullptr;
  Clock::time_point deadline;
  double timeout_s = 0;
  std::mutex mu;
  std::condition_variable cv;
  bool completed = false;
  bool timed_out = false;
  std::string error;  // nonempty: failed

  ~WorkState() {
    if (done != nullptr) cudaEventDestroy(done);  // fine while pending: released when reached
  }
  void finish(const std::string& err, bool timeout) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (completed || !error.empty()) return;
      if (err.empty()) completed = true;
      error = err;
      timed_out = timeout;
    }
    cv.notify_all();
  }
  [[noreturn]] void raise_error() const {
    if (timed_out) throw TimeoutError(error);
    throw Error(error);
  }
};

}  // namespace zk::nccl::detail
