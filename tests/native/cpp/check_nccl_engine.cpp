// World-size-1 check of the NCCL engine on a GPU (CTest label "gpu"; run by
// benchmarks/gpu_native.sh): reduce-scatter (sum, avg), all-gather and all-reduce (max) of
// known integer-valued buffers on the engine's stream, ordered after a producer stream and
// before a consumer stream through the handles' events; then a bounded failure: joining a
// 2-rank communicator nobody else joins must raise TimeoutError, not hang.
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "nccl/engine.h"

using zk::DType;
using namespace zk::nccl;

static int g_failures = 0;
#define CHECK(cond, ...)                                                 \
  do {                                                                   \
    if (!(cond)) {                                                       \
      ++g_failures;                                                      \
      std::fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                 \
      std::fprintf(stderr, "\n");                                        \
    }                                                                    \
  } while (0)

static void cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(2);
  }
}

int main() {
  int num_devices = 0;
  if (cudaGetDeviceCount(&num_devices) != cudaSuccess || num_devices == 0) {
    std::fprintf(stderr, "no CUDA device: this check needs a GPU\n");
    return 2;
  }
  const size_t n = (1u << 20) + 3;  // odd size: no vector-width luck
  std::vector<float> host(n), back(n);
  for (size_t i = 0; i < n; ++i) host[i] = static_cast<float>(static_cast<int>(i % 1000) - 500);
  float *in = nullptr, *out = nullptr, *gathered = nullptr;
  cuda(cudaMalloc(&in, n * 4), "cudaMalloc");
  cuda(cudaMalloc(&out, n * 4), "cudaMalloc");
  cuda(cudaMalloc(&gathered, n * 4), "cudaMalloc");
  cudaStream_t producer, consumer;
  cuda(cudaStreamCreateWithFlags(&producer, cudaStreamNonBlocking), "stream");
  cuda(cudaStreamCreateWithFlags(&consumer, cudaStreamNonBlocking), "stream");
  {
    Engine engine(make_unique_id(), 0, 1, 0, 30.0);
    const auto t0 = std::chrono::steady_clock::now();
    // the producer writes the bucket; the engine must order the collective after it
    cuda(cudaMemcpyAsync(in, host.data(), n * 4, cudaMemcpyHostToDevice, producer), "copy");
    Handle rs = engine.reduce_scatter(out, in, n, DType::kFloat32, RedOp::kSum, producer);
    rs.wait(consumer);
    Handle ag = engine.all_gather(gathered, out, n, DType::kFloat32, consumer);
    ag.wait(consumer);
    cuda(cudaMemcpyAsync(back.data(), gathered, n * 4, cudaMemcpyDeviceToHost, consumer), "copy");
    cuda(cudaStreamSynchronize(consumer), "sync");
    const double ms = std::chrono::duration<double, std::milli>(
                          std::chrono::steady_clock::now() - t0).count();
    size_t bad = 0;
    for (size_t i = 0; i < n; ++i) bad += back[i] != host[i];
    CHECK(bad == 0, "reduce_scatter+all_gather: %zu of %zu elements differ", bad, n);
    std::printf("reduce_scatter+all_gather of %zu fp32 (world 1): %.3f ms\n", n, ms);

    Handle avg = engine.reduce_scatter(out, in, n, DType::kFloat32, RedOp::kAvg, consumer);
    avg.synchronize();
    CHECK(avg.is_completed(), "synchronize() returned before completion");
    cuda(cudaMemcpy(back.data(), out, n * 4, cudaMemcpyDeviceToHost), "copy");
    bad = 0;
    for (size_t i = 0; i < n; ++i) bad += back[i] != host[i];
    CHECK(bad == 0, "reduce_scatter avg: %zu elements differ", bad);

    Handle mx = engine.all_reduce(in, n, DType::kFloat32, RedOp::kMax, consumer);
    mx.synchronize();
    cuda(cudaMemcpy(back.data(), in, n * 4, cudaMemcpyDeviceToHost), "copy");
    bad = 0;
    for (size_t i = 0; i < n; ++i) bad += back[i] != host[i];
    CHECK(bad == 0, "all_reduce max: %zu elements differ", bad);
  }
  {
    // Bounded failure: rank 0 of 2 with nobody joining must time out, not hang.
    const auto t0 = std::chrono::steady_clock::now();
    bool timed_out = false;
    try {
      Engine lonely(make_unique_id(), 0, 2, 0, 3.0);
    } catch (const TimeoutError& e) {
      timed_out = true;
      std::printf("lonely init raised as expected: %s\n", e.what());
    } catch (const Error& e) {
      std::printf("lonely init raised a non-timeout error: %s\n", e.what());
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    CHECK(timed_out, "joining a 2-rank communicator alone did not raise TimeoutError");
    CHECK(s < 20.0, "timeout took %.1f s for a 3 s limit", s);
  }
  cudaFree(in);
  cudaFree(out);
  cudaFree(gathered);
  if (g_failures == 0) std::printf("nccl engine check ok\n");
  return g_failures ? 1 : 0;
}
