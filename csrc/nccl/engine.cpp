// NCCL engine: see [Note: engine streams and events] and [Note: engine timeout] in engine.h.
#include "nccl/engine.h"

#include <chrono>
#include <cstring>
#include <utility>

#include "nccl/detail.h"

namespace zk::nccl {

using detail::Clock;
using detail::cuda_check;
using detail::DeviceGuard;
using detail::nccl_dtype;
using detail::nccl_message;
using detail::nccl_op;
using detail::seconds;

std::string make_unique_id() {
  ncclUniqueId id;
  const ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) throw Error(nccl_message("ncclGetUniqueId", r, nullptr));
  return std::string(id.internal, sizeof(id.internal));
}

// ---- Engine -------------------------------------------------------------------------------

Engine::Engine(const std::string& unique_id, int rank, int world_size, int device,
               double timeout_s)
    : rank_(rank), world_size_(world_size), device_(device), timeout_s_(timeout_s) {
  if (unique_id.size() != NCCL_UNIQUE_ID_BYTES) {
    throw std::invalid_argument("unique_id must be " + std::to_string(NCCL_UNIQUE_ID_BYTES) +
                                " bytes, got " + std::to_string(unique_id.size()));
  }
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    throw std::invalid_argument("rank must be in [0, world_size), got rank " +
                                std::to_string(rank) + " of " + std::to_string(world_size));
  }
  if (!(timeout_s > 0)) throw std::invalid_argument("timeout_s must be > 0");
  DeviceGuard guard(device);
  int lo = 0, hi = 0;
  cuda_check("cudaDeviceGetStreamPriorityRange", cudaDeviceGetStreamPriorityRange(&lo, &hi));
  cuda_check("cudaStreamCreateWithPriority",
             cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, hi));
  ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data(), NCCL_UNIQUE_ID_BYTES);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // every call returns at once; we poll with a deadline
  try {
    std::lock_guard<std::mutex> lock(mu_);
    wait_for_comm("ncclCommInitRankConfig",
                  ncclCommInitRankConfig(&comm_, world_size, id, rank, &config));
  } catch (...) {
    if (comm_ != nullptr) ncclCommAbort(comm_);
    cudaStreamDestroy(stream_);
    throw;
  }
  watchdog_ = std::thread([this] { watchdog_loop(); });
}

Engine::~Engine() {
  stop_ = true;
  cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  try {
    DeviceGuard guard(device_);
    std::lock_guard<std::mutex> lock(mu_);
    bool flushed = false;
    if (!failure_ && comm_ != nullptr) {
      // Flush outstanding collectives, bounded; a stuck peer gets the communicator aborted.
      try {
        wait_for_comm("ncclCommFinalize", ncclCommFinalize(comm_));
        ncclCommDestroy(comm_);
        flushed = cudaStreamSynchronize(stream_) == cudaSuccess;
      } catch (const Error&) {
        ncclCommAbort(comm_);
      }
    }
    comm_ = nullptr;
    for (auto& w : pending_) {
      w->finish(flushed ? "" : "engine destroyed before " + w->name + " completed", false);
    }
    cudaStreamDestroy(stream_);
  } catch (...) {
    // A destructor must not throw; the process is tearing the engine down anyway.
  }
}

void Engine::wait_for_comm(const char* call, ncclResult_t result) {
  const auto deadline = Clock::now() + seconds(timeout_s_);
  while (result == ncclInProgress) {
    if (Clock::now() > deadline) {
      throw TimeoutError(std::string(call) + " did not complete within " +
                         std::to_string(timeout_s_) + " s on rank " + std::to_string(rank_) +
                         " (a peer did not join or died)");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
    const ncclResult_t q = ncclCommGetAsyncError(comm_, &result);
    if (q != ncclSuccess) result = q;
  }
  if (result != ncclSuccess) throw Error(nccl_message(call, result, comm_));
}

void Engine::check_failed() const {
  if (!failure_) return;
  if (failure_is_timeout_) throw TimeoutError("NCCL engine failed earlier: " + *failure_);
  throw Error("NCCL engine failed earlier: " + *failure_);
}

void Engine::fail(const std::string& message, bool timeout) {
  if (failure_) return;
  failure_ = std::make_shared<std::string>(message);
  failure_is_timeout_ = timeout;
  if (comm_ != nullptr) ncclCommAbort(comm_);  // stuck NCCL kernels exit
  comm_ = nullptr;
  for (auto& w : pending_) w->finish(message, timeout);
  pending_.clear();
}

void Engine::abort(const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  fail("aborted: " + reason, false);
}

template <typename Launch>
Handle Engine::launch(const char* name, cudaStream_t caller, Launch&& launch_fn) {
  DeviceGuard guard(device_);
  std::lock_guard<std::mutex> lock(mu_);
  check_failed();
  auto state = std::make_shared<detail::WorkState>();
  state->name = std::string(name) + " #" + std::to_string(next_seq_++);
  state->device = device_;
  state->timeout_s = timeout_s_;
  cudaEvent_t ready = nullptr;
  cuda_check("cudaEventCreateWithFlags",
             cudaEventCreateWithFlags(&state->done, cudaEventDisableTiming));
  cuda_check("cudaEventCreateWithFlags", cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
  try {
    cuda_check("cudaEventRecord", cudaEventRecord(ready, caller));
    cuda_check("cudaStreamWaitEvent", cudaStreamWaitEvent(stream_, ready, 0));
    try {
      wait_for_comm(name, launch_fn(comm_, stream_));
    } catch (const TimeoutError& e) {
      fail(e.what(), true);
      throw;
    }
    cuda_check("cudaEventRecord", cudaEventRecord(state->done, stream_));
  } catch (...) {
    cudaEventDestroy(ready);
    throw;
  }
  cudaEventDestroy(ready);  // released once the comm stream has passed it
  state->deadline = Clock::now() + seconds(timeout_s_);
  pending_.push_back(state);
  cv_.notify_all();
  return Handle(state);
}

Handle Engine::reduce_scatter(void* output, const void* input, size_t out_count, DType dtype,
                              RedOp op, cudaStream_t caller) {
  return launch("ncclReduceScatter", caller, [&](ncclComm_t comm, cudaStream_t s) {
    return ncclReduceScatter(input, output, out_count, nccl_dtype(dtype), nccl_op(op), comm, s);
  });
}

Handle Engine::all_gather(void* output, const void* input, size_t in_count, DType dtype,
                          cudaStream_t caller) {
  return launch("ncclAllGather", caller, [&](ncclComm_t comm, cudaStream_t s) {
    return ncclAllGather(input, output, in_count, nccl_dtype(dtype), comm, s);
  });
}

Handle Engine::all_reduce(void* buffer, size_t count, DType dtype, RedOp op,
                          cudaStream_t caller) {
  return launch("ncclAllReduce", caller, [&](ncclComm_t comm, cudaStream_t s) {
    return ncclAllReduce(buffer, buffer, count, nccl_dtype(dtype), nccl_op(op), comm, s);
  });
}

void Engine::watchdog_loop() {
  if (cudaSetDevice(device_) != cudaSuccess) return;  // then synchronize()'s margin applies
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    cv_.wait_for(lock, std::chrono::milliseconds(pending_.empty() ? 100 : 1));
    if (stop_ || failure_) continue;
    ncclResult_t async = ncclSuccess;
    if (comm_ != nullptr && ncclCommGetAsyncError(comm_, &async) == ncclSuccess &&
        async != ncclSuccess && async != ncclInProgress) {
      fail(nccl_message("ncclCommGetAsyncError", async, comm_), false);
      continue;
    }
    const auto now = Clock::now();
    while (!pending_.empty()) {
      auto& w = pending_.front();
      const cudaError_t q = cudaEventQuery(w->done);
      if (q == cudaSuccess) {
        w->finish("", false);
        pending_.pop_front();
        continue;
      }
      if (q != cudaErrorNotReady) {
        fail(w->name + ": CUDA error in cudaEventQuery: " + cudaGetErrorString(q), false);
      } else if (now > w->deadline) {
        fail(w->name + " did not complete within " + std::to_string(timeout_s_) + " s on rank " +
                 std::to_string(rank_) + "; communicator aborted (a peer died or hangs)",
             true);
      }
      break;  // in-order stream: later works cannot be done before this one
    }
  }
}

}  // namespace zk::nccl
