// Segmented sum kernel: one thread block per segment, fp32 accumulation,
// warp-shuffle reduction then a shared-memory pass across warps.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>

#include "areal_fast/segment_sum.h"

namespace areal_fast {
namespace {

constexpr int kBlockThreads = 256;
constexpr int kWarpSize = 32;
constexpr int kWarps = kBlockThreads / kWarpSize;

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) {
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  }
  return v;
}

template <typename T>
__global__ void __launch_bounds__(kBlockThreads)
    segment_sum_kernel(const T* __restrict__ values, const int32_t* __restrict__ cu_seqlens,
                       float* __restrict__ out) {
  const int64_t segment = blockIdx.x;
  const int64_t start = cu_seqlens[segment];
  const int64_t end = cu_seqlens[segment + 1];

  // Two independent accumulators keep two loads in flight per thread.
  float acc0 = 0.f, acc1 = 0.f;
  int64_t i = start + threadIdx.x;
  for (; i + kBlockThreads < end; i += 2 * kBlockThreads) {
    acc0 += to_float(values[i]);
    acc1 += to_float(values[i + kBlockThreads]);
  }
  if (i < end) acc0 += to_float(values[i]);
  float acc = warp_sum(acc0 + acc1);

  __shared__ float warp_totals[kWarps];
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  if (lane == 0) warp_totals[warp] = acc;
  __syncthreads();
  if (warp == 0) {
    acc = lane < kWarps ? warp_totals[lane] : 0.f;
    acc = warp_sum(acc);
    if (lane == 0) out[segment] = acc;
  }
}

template <typename T>
void launch(const void* values, const int32_t* cu_seqlens, int64_t num_segments, float* out,
            cudaStream_t stream) {
  segment_sum_kernel<T><<<static_cast<unsigned int>(num_segments), kBlockThreads, 0, stream>>>(
      static_cast<const T*>(values), cu_seqlens, out);
}

}  // namespace

int launch_segment_sum(const void* values, int dtype_code, const int32_t* cu_seqlens,
                       int64_t num_segments, float* out, cudaStream_t stream) {
  if (num_segments < 0 || num_segments > INT_MAX) return cudaErrorInvalidValue;
  if (num_segments == 0) return cudaSuccess;
  switch (dtype_code) {
    case kSegmentSumFloat32:
      launch<float>(values, cu_seqlens, num_segments, out, stream);
      break;
    case kSegmentSumFloat16:
      launch<__half>(values, cu_seqlens, num_segments, out, stream);
      break;
    case kSegmentSumBFloat16:
      launch<__nv_bfloat16>(values, cu_seqlens, num_segments, out, stream);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return static_cast<int>(cudaGetLastError());
}

const char* cuda_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

int cuda_runtime_version() { return CUDART_VERSION; }

}  // namespace areal_fast
