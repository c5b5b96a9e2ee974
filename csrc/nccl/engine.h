// NCCL communicator and asynchronous reduce-scatter / all-gather engine.
//
// [Note: engine streams and events]
// The engine owns one CUDA stream (non-blocking, highest priority) on which every collective
// runs. A call records a "ready" event on the caller's stream (torch's current stream, passed
// as an integer cudaStream_t) and makes the comm stream wait on it: the bucket is launched
// only once the compute that wrote it has finished, without blocking the host. After the
// collective the engine records a "done" event on the comm stream; Handle::wait makes a
// consumer stream wait on it (no host block), Handle::synchronize blocks the host.
// The caller keeps the buffers alive until wait() returns (zkernels.comm.base [Note: comm
// handles]); the engine itself never frees or reuses them.
//
// [Note: engine timeout]
// The communicator is created non-blocking, so no NCCL call can hang the host: init and every
// enqueue poll ncclCommGetAsyncError against a deadline. A watchdog thread polls the done
// events of outstanding collectives and the communicator's async error; when one is older
// than the timeout (a peer died or never joined) or NCCL reports an error, it calls
// ncclCommAbort, which makes the stuck kernels exit, and marks the engine failed: every later
// call, wait() and synchronize() raises with the first error's message instead of hanging.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>

#include "dtype.h"

namespace zk::nccl {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class TimeoutError : public Error {
 public:
  using Error::Error;
};

enum class RedOp : int32_t { kSum = 0, kAvg = 1, kMax = 2 };

// ncclGetUniqueId as NCCL_UNIQUE_ID_BYTES raw bytes (rank 0 makes it, the others receive it).
std::string make_unique_id();

namespace detail {
struct WorkState;
}

// One launched collective.
class Handle {
 public:
  explicit Handle(std::shared_ptr<detail::WorkState> state) : state_(std::move(state)) {}
  // Makes `stream` wait for the collective (no host block). Raises if the engine failed.
  void wait(cudaStream_t stream) const;
  // Blocks the host until the collective is done; raises on failure or timeout.
  void synchronize() const;
  bool is_completed() const;

 private:
  std::shared_ptr<detail::WorkState> state_;
};

class Engine {
 public:
  // Joins the communicator of `world_size` ranks named by `unique_id`; `device` is the CUDA
  // device index of this rank. Raises TimeoutError if the others do not join in `timeout_s`.
  Engine(const std::string& unique_id, int rank, int world_size, int device, double timeout_s);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // output[out_count] = this rank's slice of reduce(op) over ranks of input[out_count * world].
  Handle reduce_scatter(void* output, const void* input, size_t out_count, DType dtype, RedOp op,
                        cudaStream_t caller);
  // output[in_count * world]: every rank's input[in_count], rank r's at r * in_count.
  Handle all_gather(void* output, const void* input, size_t in_count, DType dtype,
                    cudaStream_t caller);
  // In place reduce(op) over ranks of buffer[count].
  Handle all_reduce(void* buffer, size_t count, DType dtype, RedOp op, cudaStream_t caller);
  // Aborts the communicator now; later calls raise.
  void abort(const std::string& reason);

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  int device() const { return device_; }
  double timeout_s() const { return timeout_s_; }
  cudaStream_t stream() const { return stream_; }

 private:
  template <typename Launch>
  Handle launch(const char* name, cudaStream_t caller, Launch&& launch_fn);
  void wait_for_comm(const char* call, ncclResult_t result);  // enqueue/init polling
  void check_failed() const;
  void watchdog_loop();
  void fail(const std::string& message, bool timeout);  // abort + mark; caller holds mu_

  int rank_, world_size_, device_;
  double timeout_s_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  uint64_t next_seq_ = 0;

  mutable std::mutex mu_;  // guards comm_ calls, pending_, failure state
  std::condition_variable cv_;
  std::deque<std::shared_ptr<detail::WorkState>> pending_;
  std::shared_ptr<std::string> failure_;  // first error, shared with handles
  bool failure_is_timeout_ = false;
  std::atomic<bool> stop_{false};
  std::thread watchdog_;
};

}  // namespace zk::nccl
