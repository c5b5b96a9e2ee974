// Handle: waiting on one collective (see [Note: engine streams and events] in engine.h).
#include "nccl/detail.h"

namespace zk::nccl {

using detail::Clock;
using detail::cuda_check;
using detail::DeviceGuard;
using detail::seconds;

void Handle::wait(cudaStream_t stream) const {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (!state_->error.empty()) state_->raise_error();
  }
  DeviceGuard guard(state_->device);
  cuda_check("cudaStreamWaitEvent", cudaStreamWaitEvent(stream, state_->done, 0));
}

void Handle::synchronize() const {
  // The watchdog completes or fails every pending work within the timeout; the extra margin
  // only guards against a watchdog that cannot run at all.
  const auto limit = Clock::now() + seconds(2 * state_->timeout_s + 5.0);
  std::unique_lock<std::mutex> lock(state_->mu);
  while (!state_->completed && state_->error.empty()) {
    if (state_->cv.wait_until(lock, limit) == std::cv_status::timeout &&
        !state_->completed && state_->error.empty()) {
      throw TimeoutError(state_->name + ": no completion or failure reported within " +
                         std::to_string(2 * state_->timeout_s + 5.0) + " s");
    }
  }
  if (!state_->error.empty()) state_->raise_error();
}

bool Handle::is_completed() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  if (!state_->error.empty()) state_->raise_error();
  return state_->completed;
}

}  // namespace zk::nccl
