// Segmented sum over a packed batch, on the GPU.
//
// values [T] (float32, float16 or bfloat16), cu_seqlens [B + 1] int32 with
// cu_seqlens[0] = 0, non-decreasing, cu_seqlens[B] = T  ->  out [B] float32,
// out[b] = sum(values[cu_seqlens[b] : cu_seqlens[b + 1]]) accumulated in fp32
// (0 for an empty segment). All pointers are device pointers; the caller
// validates cu_seqlens. The kernel runs on `stream` (the caller's current
// stream) and nothing here synchronizes.
//
// This header needs no CUDA headers, so host-only code (the bindings) can
// include it; cudaStream_t is declared exactly as the CUDA runtime declares it.
#pragma once

#include <cstdint>

typedef struct CUstream_st* cudaStream_t;

namespace areal_fast {

// dtype_code values accepted by launch_segment_sum.
enum SegmentSumDType : int {
  kSegmentSumFloat32 = 0,
  kSegmentSumFloat16 = 1,
  kSegmentSumBFloat16 = 2,
};

// Launches one thread block per segment. Returns 0 (cudaSuccess) or the
// cudaError_t code of the failure; an unknown dtype_code, a negative
// num_segments or more than 2^31 - 1 segments give cudaErrorInvalidValue.
// num_segments == 0 launches nothing.
int launch_segment_sum(const void* values, int dtype_code, const int32_t* cu_seqlens,
                       int64_t num_segments, float* out, cudaStream_t stream);

// Text for an error code returned by launch_segment_sum.
const char* cuda_error_string(int code);

// Version of the CUDA runtime compiled in (CUDART_VERSION, e.g. 13000).
int cuda_runtime_version();

}  // namespace areal_fast
