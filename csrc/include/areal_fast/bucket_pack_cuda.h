// Weight-sync bucket copies on the GPU: one kernel launch moves (and casts)
// every chunk of a bucket, from many source tensors into the bucket (pack) or
// from the bucket into many target tensors (unpack).
//
// The copies are BucketCopy descriptors (areal_fast/buckets.h) in host memory
// whose src/dst are device pointers of one device. They travel to the GPU as a
// __grid_constant__ kernel parameter (no upload, no allocation, nothing that
// synchronises), up to kBucketCopiesPerLaunch descriptors per launch; a bucket
// with more chunks than that takes ceil(n / kBucketCopiesPerLaunch) launches.
// Everything runs on `stream` (the caller's current stream); nothing here
// synchronises. Conversions produce the same bits as bucket_copy_cpu.
//
// This header needs no CUDA headers (cudaStream_t is declared exactly as the
// CUDA runtime declares it), so host-only code such as the bindings can include it.
#pragma once

#include <cstdint>

#include "areal_fast/buckets.h"

typedef struct CUstream_st* cudaStream_t;

namespace areal_fast {

// Descriptors carried by one launch (the kernel parameter stays under the
// 32 KiB limit of CUDA >= 12.1 on sm_70 and newer).
constexpr int64_t kBucketCopiesPerLaunch = 800;

// Launches the copies on `stream`. The caller validates them first
// (validate_bucket_copies). Returns 0 (cudaSuccess) or the cudaError_t code of
// the failure (cudaErrorInvalidValue for n < 0). Copies of 0 elements are
// skipped; n == 0 launches nothing.
int launch_bucket_copy(const BucketCopy* copies, int64_t n, cudaStream_t stream);

}  // namespace areal_fast
