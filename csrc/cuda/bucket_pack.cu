// Bucket pack/unpack kernel: one launch copies (and casts) every chunk of a
// bucket. See include/areal_fast/bucket_pack_cuda.h for the contract.
//
// Each copy is cut into tiles of kTileBytes destination bytes; a copy's first
// tile index is the prefix sum of the tile counts before it. Blocks walk the
// tiles grid-stride and find a tile's copy by binary search over those
// prefixes (the descriptors sit in the kernel parameter space, read by all
// threads of a block at the same address). Inside a tile each thread moves
// 16-byte vectors of the destination when both pointers are suitably aligned,
// loading all of its vectors before storing any, and falls back to narrower
// units (byte copies) or scalar elements (casts) otherwise. The conversions are
// the bit-level functions of buckets.h, shared with the CPU copy.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <vector>

#include "areal_fast/bucket_pack_cuda.h"

namespace areal_fast {
namespace {

// Tuning knobs (compile definitions; the CMake build passes environment
// variables of the same names): destination bytes per tile and resident blocks
// per SM. Each thread keeps kTileBytes / 16 / kThreads 16-byte loads in flight.
#ifndef AREAL_FAST_BUCKET_TILE_BYTES
#define AREAL_FAST_BUCKET_TILE_BYTES 16384
#endif
#ifndef AREAL_FAST_BUCKET_BLOCKS_PER_SM
#define AREAL_FAST_BUCKET_BLOCKS_PER_SM 8
#endif

constexpr int kThreads = 256;
constexpr int64_t kTileBytes = AREAL_FAST_BUCKET_TILE_BYTES;  // destination bytes per tile
constexpr int kVecPerThread = static_cast<int>(kTileBytes / 16 / kThreads);
static_assert(kTileBytes % (16 * kThreads) == 0, "a tile is a whole number of 16-byte rows");
// Resident blocks per SM the kernel is built for (8: full occupancy, a register
// cap of 32 per thread); the grid is capped at that many blocks per SM. Measured
// on an H200 (3.1 GB state dict): 8 blocks moved bf16 copies at 0.82-0.83 of a
// device-to-device copy against 0.74-0.75 with 4 (64 registers); 32 KiB tiles
// with 4 blocks gave 0.65-0.71, 8 KiB tiles with 8 blocks 0.49.
constexpr int kBlocksPerSm = AREAL_FAST_BUCKET_BLOCKS_PER_SM;
// Small launches use a descriptor array that fits the classic 4 KiB of
// kernel parameters; larger ones the 32 KiB of CUDA >= 12.1.
constexpr int kSmallCap = 96;

enum CopyKind : int32_t {
  kRawBytes = 0,
  kF32ToBF16 = 1,
  kF32ToF16 = 2,
  kBF16ToF32 = 3,
  kF16ToF32 = 4,
  kBF16ToF16 = 5,
  kF16ToBF16 = 6,
};

struct DeviceCopy {
  const void* src;
  void* dst;
  int64_t count;       // elements (bytes for kRawBytes)
  int64_t tile_begin;  // index of this copy's first tile in the launch
  int32_t kind;        // CopyKind
  int32_t width;       // kRawBytes: unit in bytes (16/8/4/2/1); casts: 1 = vectorised, 0 = not
};

template <int kCap>
struct CopyBatch {
  int64_t num_tiles;
  int32_t n;
  int32_t unused;
  DeviceCopy copies[kCap];
};

static_assert(sizeof(CopyBatch<kSmallCap>) <= 4096, "small batch must fit 4 KiB of parameters");
static_assert(sizeof(CopyBatch<kBucketCopiesPerLaunch>) <= 32764,
              "batch must fit 32 KiB of kernel parameters");

struct F32ToBF16 {
  using Src = uint32_t;
  using Dst = uint16_t;
  __device__ static Dst convert(Src s) { return f32_bits_to_bf16(s); }
};
struct F32ToF16 {
  using Src = uint32_t;
  using Dst = uint16_t;
  __device__ static Dst convert(Src s) { return f32_bits_to_f16(s); }
};
struct BF16ToF32 {
  using Src = uint16_t;
  using Dst = uint32_t;
  __device__ static Dst convert(Src s) { return bf16_bits_to_f32(s); }
};
struct F16ToF32 {
  using Src = uint16_t;
  using Dst = uint32_t;
  __device__ static Dst convert(Src s) { return f16_bits_to_f32(s); }
};
struct BF16ToF16 {
  using Src = uint16_t;
  using Dst = uint16_t;
  __device__ static Dst convert(Src s) { return f32_bits_to_f16(bf16_bits_to_f32(s)); }
};
struct F16ToBF16 {
  using Src = uint16_t;
  using Dst = uint16_t;
  __device__ static Dst convert(Src s) { return f32_bits_to_bf16(f16_bits_to_f32(s)); }
};

__host__ __device__ __forceinline__ int64_t dst_size_of(int32_t kind) {
  return kind == kRawBytes ? 1 : (kind == kBF16ToF32 || kind == kF16ToF32) ? 4 : 2;
}

__host__ __device__ __forceinline__ int64_t tile_elems(int32_t kind) {
  return kTileBytes / dst_size_of(kind);
}

// Elements [begin, end) of a cast; begin is a multiple of the tile size, so a
// vectorised copy stays aligned.
template <typename Op>
__device__ __forceinline__ void cast_tile(const DeviceCopy& c, int64_t begin, int64_t end) {
  using Src = typename Op::Src;
  using Dst = typename Op::Dst;
  const Src* __restrict__ src = static_cast<const Src*>(c.src);
  Dst* __restrict__ dst = static_cast<Dst*>(c.dst);
  int64_t rest = begin;
  if (c.width) {
    constexpr int kGroup = 16 / sizeof(Dst);  // elements per 16-byte store
    struct alignas(kGroup * sizeof(Src)) SrcVec { Src v[kGroup]; };
    struct alignas(16) DstVec { Dst v[kGroup]; };
    const SrcVec* s = reinterpret_cast<const SrcVec*>(src + begin);
    DstVec* d = reinterpret_cast<DstVec*>(dst + begin);
    const int64_t groups = (end - begin) / kGroup;
    if (groups == int64_t{kVecPerThread} * kThreads) {  // a full tile
      SrcVec in[kVecPerThread];
#pragma unroll
      for (int u = 0; u < kVecPerThread; ++u) in[u] = s[threadIdx.x + u * kThreads];
#pragma unroll
      for (int u = 0; u < kVecPerThread; ++u) {
        DstVec out;
#pragma unroll
        for (int k = 0; k < kGroup; ++k) out.v[k] = Op::convert(in[u].v[k]);
        d[threadIdx.x + u * kThreads] = out;
      }
    } else {
      for (int64_t g = threadIdx.x; g < groups; g += kThreads) {
        const SrcVec in = s[g];
        DstVec out;
#pragma unroll
        for (int k = 0; k < kGroup; ++k) out.v[k] = Op::convert(in.v[k]);
        d[g] = out;
      }
    }
    rest = begin + groups * kGroup;
  }
  for (int64_t i = rest + threadIdx.x; i < end; i += kThreads) dst[i] = Op::convert(src[i]);
}

// Bytes [begin, end) moved in units of U (both pointers aligned to sizeof(U)).
template <typename U>
__device__ __forceinline__ void raw_tile(const DeviceCopy& c, int64_t begin, int64_t end) {
  const auto* __restrict__ src = static_cast<const unsigned char*>(c.src);
  auto* __restrict__ dst = static_cast<unsigned char*>(c.dst);
  const U* s = reinterpret_cast<const U*>(src + begin);
  U* d = reinterpret_cast<U*>(dst + begin);
  const int64_t units = (end - begin) / static_cast<int64_t>(sizeof(U));
  if (sizeof(U) == 16 && units == int64_t{kVecPerThread} * kThreads) {
    U in[kVecPerThread];
#pragma unroll
    for (int u = 0; u < kVecPerThread; ++u) in[u] = s[threadIdx.x + u * kThreads];
#pragma unroll
    for (int u = 0; u < kVecPerThread; ++u) d[threadIdx.x + u * kThreads] = in[u];
  } else {
    for (int64_t i = threadIdx.x; i < units; i += kThreads) d[i] = s[i];
  }
  for (int64_t i = begin + units * static_cast<int64_t>(sizeof(U)) + threadIdx.x; i < end;
       i += kThreads) {
    dst[i] = src[i];
  }
}

template <int kCap>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    bucket_copy_kernel(const __grid_constant__ CopyBatch<kCap> batch) {
  for (int64_t tile = blockIdx.x; tile < batch.num_tiles; tile += gridDim.x) {
    int lo = 0, hi = batch.n - 1;  // last copy whose first tile is <= tile
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (batch.copies[mid].tile_begin <= tile) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    const DeviceCopy& c = batch.copies[lo];
    const int64_t per = tile_elems(c.kind);
    const int64_t begin = (tile - c.tile_begin) * per;
    const int64_t end = begin + per < c.count ? begin + per : c.count;
    switch (c.kind) {
      case kRawBytes:
        switch (c.width) {
          case 16: raw_tile<uint4>(c, begin, end); break;
          case 8: raw_tile<uint2>(c, begin, end); break;
          case 4: raw_tile<uint32_t>(c, begin, end); break;
          case 2: raw_tile<uint16_t>(c, begin, end); break;
          default: raw_tile<unsigned char>(c, begin, end); break;
        }
        break;
      case kF32ToBF16: cast_tile<F32ToBF16>(c, begin, end); break;
      case kF32ToF16: cast_tile<F32ToF16>(c, begin, end); break;
      case kBF16ToF32: cast_tile<BF16ToF32>(c, begin, end); break;
      case kF16ToF32: cast_tile<F16ToF32>(c, begin, end); break;
      case kBF16ToF16: cast_tile<BF16ToF16>(c, begin, end); break;
      case kF16ToBF16: cast_tile<F16ToBF16>(c, begin, end); break;
      default: break;
    }
  }
}

bool aligned(const void* p, uintptr_t alignment) {
  return reinterpret_cast<uintptr_t>(p) % alignment == 0;
}

// The descriptor of one validated copy with count > 0.
DeviceCopy describe(const BucketCopy& c) {
  DeviceCopy d{c.src, c.dst, c.count, 0, kRawBytes, 1};
  if (c.src_dtype == c.dst_dtype) {  // same dtype: move bytes
    d.count = c.count * bucket_dtype_size(c.src_dtype);
    const uintptr_t both = reinterpret_cast<uintptr_t>(c.src) | reinterpret_cast<uintptr_t>(c.dst);
    d.width = both % 16 == 0 ? 16 : both % 8 == 0 ? 8 : both % 4 == 0 ? 4 : both % 2 == 0 ? 2 : 1;
    return d;
  }
  const int32_t pair = c.src_dtype * 4 + c.dst_dtype;
  d.kind = pair == kBucketFloat32 * 4 + kBucketBFloat16   ? kF32ToBF16
           : pair == kBucketFloat32 * 4 + kBucketFloat16  ? kF32ToF16
           : pair == kBucketBFloat16 * 4 + kBucketFloat32 ? kBF16ToF32
           : pair == kBucketFloat16 * 4 + kBucketFloat32  ? kF16ToF32
           : pair == kBucketBFloat16 * 4 + kBucketFloat16 ? kBF16ToF16
                                                          : kF16ToBF16;
  // A 16-byte store covers 16 / dst_size elements, read as one aligned load.
  const int64_t dst_size = dst_size_of(d.kind);
  const int64_t src_bytes = 16 / dst_size * bucket_dtype_size(c.src_dtype);
  d.width = aligned(c.dst, 16) && aligned(c.src, static_cast<uintptr_t>(src_bytes)) ? 1 : 0;
  return d;
}

template <int kCap>
int launch_batch(const DeviceCopy* copies, int n, int grid_cap, cudaStream_t stream) {
  CopyBatch<kCap> batch{};
  batch.n = n;
  int64_t tiles = 0;
  for (int i = 0; i < n; ++i) {
    batch.copies[i] = copies[i];
    batch.copies[i].tile_begin = tiles;
    const int64_t per = tile_elems(copies[i].kind);
    tiles += (copies[i].count + per - 1) / per;
  }
  batch.num_tiles = tiles;
  const int64_t grid = std::max<int64_t>(1, std::min<int64_t>(tiles, grid_cap));
  bucket_copy_kernel<kCap><<<static_cast<unsigned int>(grid), kThreads, 0, stream>>>(batch);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int launch_bucket_copy(const BucketCopy* copies, int64_t n, cudaStream_t stream) {
  if (n < 0) return cudaErrorInvalidValue;
  std::vector<DeviceCopy> work;
  work.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    if (copies[i].count > 0) work.push_back(describe(copies[i]));
  }
  if (work.empty()) return cudaSuccess;
  int device = 0, sms = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status != cudaSuccess) return static_cast<int>(status);
  status = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (status != cudaSuccess) return static_cast<int>(status);
  const int grid_cap = std::max(1, sms) * kBlocksPerSm;
  const int64_t total = static_cast<int64_t>(work.size());
  for (int64_t first = 0; first < total; first += kBucketCopiesPerLaunch) {
    const int count = static_cast<int>(std::min<int64_t>(kBucketCopiesPerLaunch, total - first));
    const int code = count <= kSmallCap
                         ? launch_batch<kSmallCap>(work.data() + first, count, grid_cap, stream)
                         : launch_batch<kBucketCopiesPerLaunch>(work.data() + first, count,
                                                                grid_cap, stream);
    if (code != cudaSuccess) return code;
  }
  return cudaSuccess;
}

}  // namespace areal_fast
