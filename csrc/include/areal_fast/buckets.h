// Weight-sync buckets: the layout planner and the element copies (with dtype
// casts) that pack tensors into fixed-size byte buckets and unpack them again.
//
// Pure C++17 on raw pointers: nothing here knows about Python or torch. Errors
// in the caller's input are std::invalid_argument with a one-line message that
// uses the names of the Python API (areal_fast/sync/buckets.py), whose
// pure-Python planner follows the same steps and gives the identical plan.
//
// The scalar dtype conversions are inline __host__ __device__ functions so the
// CPU copy (buckets.cpp) and the CUDA kernel (cuda/bucket_pack.cu) share one
// definition and produce identical bits.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__CUDACC__)
#define AREAL_FAST_HD __host__ __device__ __forceinline__
#else
#define AREAL_FAST_HD inline __attribute__((always_inline))
#endif

namespace areal_fast {

// Every chunk starts at a multiple of this many bytes inside its bucket.
constexpr int64_t kBucketAlignment = 256;

// ---------------------------------------------------------------------------
// Planner
// ---------------------------------------------------------------------------

// One contiguous element range [start, start + numel) of tensor `tensor`
// (flattened, row-major), stored at byte `offset` of bucket `bucket`.
struct BucketChunk {
  int64_t tensor;
  int64_t bucket;
  int64_t offset;
  int64_t start;
  int64_t numel;
};

struct BucketLayout {
  std::vector<BucketChunk> chunks;    // in placement order
  std::vector<int64_t> bucket_sizes;  // end of the last chunk of each bucket, bytes
};

// Places n tensors (numels[i] elements of itemsizes[i] bytes each) into
// buckets of bucket_bytes bytes, in the given order:
//   - every chunk starts at the first 256-byte aligned offset after the
//     previous chunk of its bucket (offset 0 in a fresh bucket);
//   - a tensor that fits in the rest of the current bucket goes there whole;
//   - a tensor that does not fit but is at most bucket_bytes opens a new bucket;
//   - a tensor larger than bucket_bytes opens a new bucket (unless the current
//     one holds no bytes yet) and is split into pieces of bucket_bytes /
//     itemsize elements over consecutive buckets; its last piece's bucket stays
//     open for the tensors that follow;
//   - a tensor with no elements gets a chunk of 0 elements at the current
//     aligned offset (receivers still learn about it).
//   - with solo_bytes > 0, a tensor of at least solo_bytes bytes starts in an
//     empty bucket and the tensor after it does too: such a tensor has its
//     buckets to itself, so a transport that can send from any memory moves it
//     without packing (0 turns the rule off);
// A bucket exists once it holds a chunk: n == 0 gives no buckets.
// Throws std::invalid_argument when bucket_bytes is not a positive multiple of
// 256, for a negative numel, an itemsize that does not divide 256, or a tensor
// whose byte size overflows int64.
BucketLayout plan_buckets(const int64_t* numels, const int64_t* itemsizes, int64_t n,
                          int64_t bucket_bytes, int64_t solo_bytes = 0);

// ---------------------------------------------------------------------------
// Copies
// ---------------------------------------------------------------------------

// Element types of a copy. kBucketBytes moves raw bytes (any dtype copied to
// the same dtype); the float codes may be converted into one another.
enum BucketDType : int32_t {
  kBucketBytes = 0,
  kBucketFloat32 = 1,
  kBucketFloat16 = 2,
  kBucketBFloat16 = 3,
};

// Size in bytes of one element of a BucketDType (1 for kBucketBytes), 0 for an
// unknown code.
AREAL_FAST_HD int64_t bucket_dtype_size(int32_t code) {
  return code == kBucketBytes     ? 1
         : code == kBucketFloat32 ? 4
         : (code == kBucketFloat16 || code == kBucketBFloat16) ? 2
                                                                : 0;
}

// One copy: `count` elements of src_dtype at `src` -> `count` elements of
// dst_dtype at `dst` (for kBucketBytes, `count` is in bytes). kBucketBytes
// pairs only with itself. Source and destination must not overlap.
struct BucketCopy {
  const void* src;
  void* dst;
  int64_t count;
  int32_t src_dtype;
  int32_t dst_dtype;
};

// Throws std::invalid_argument (naming copies[i]) for a negative count, an
// unknown dtype code, a kBucketBytes paired with a float code, or a null
// pointer with a non-zero count.
void validate_bucket_copies(const BucketCopy* copies, int64_t n);

// Runs the copies on the CPU with up to num_threads threads (the calling
// thread included). The work is split into equal ranges of destination bytes,
// so one large copy is shared by several threads; small totals use fewer
// threads. Validates first (see validate_bucket_copies).
void bucket_copy_cpu(const BucketCopy* copies, int64_t n, int num_threads);

// ---------------------------------------------------------------------------
// Scalar conversions (bit patterns in, bit patterns out)
// ---------------------------------------------------------------------------

AREAL_FAST_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

AREAL_FAST_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

// a + b rounded to nearest even (never contracted or reassociated).
AREAL_FAST_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// float32 -> bfloat16, round to nearest even, as c10::BFloat16's
// round_to_nearest_even (add 0x7FFF plus the lowest kept bit, truncate) for
// every non-NaN input; Inf stays Inf and values that round past the largest
// finite bfloat16 become Inf. A NaN keeps its sign and top 7 payload bits and
// gets the quiet bit (as the x86 VCVTNEPS2BF16 instruction does); torch itself
// writes 0x7FC0 (scalar c10 code), 0xFFFF (AVX2/AVX-512 CPU code) or 0x7FFF
// (CUDA) depending on the path, so NaN bits are not comparable across paths.
AREAL_FAST_HD uint16_t f32_bits_to_bf16(uint32_t u) {
  const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet = (u >> 16) | 0x0040u;
  return static_cast<uint16_t>(nan ? quiet : rounded);
}

AREAL_FAST_HD uint32_t bf16_bits_to_f32(uint16_t h) { return static_cast<uint32_t>(h) << 16; }

// float32 -> float16, IEEE 754 round to nearest even: subnormal results,
// overflow to Inf (from 65520 up), Inf. A NaN becomes sign | 0x7E00 | top 9
// payload bits, which is what torch's F16C CPU path (VCVTPS2PH) writes.
// Normal results are rounded on the bits; subnormal ones by one float32
// addition whose result is >= 0.5 (so FTZ cannot flush it, and DAZ only zeroes
// float32 denormal inputs, which round to 0 in float16 anyway). Needs the
// default round-to-nearest mode.
AREAL_FAST_HD uint16_t f32_bits_to_f16(uint32_t u) {
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  // Normal half results: rebias the exponent (127 -> 15) and round the 13
  // dropped mantissa bits to nearest even; a carry out of the mantissa bumps
  // the exponent, which is what rounding up to the next binade means.
  const uint32_t normal = (a - (112u << 23) + 0x0FFFu + ((a >> 13) & 1u)) >> 13;
  // Subnormal half results (|x| < 2^-14): in [0.5, 1) a float32 ulp is 2^-24,
  // the float16 subnormal step, so |x| + 0.5 rounds |x| to that step and the
  // bits above those of 0.5 are the float16 bits (0x400 when it rounds up to
  // the smallest normal).
  const uint32_t sub = float_bits(add_rn(bits_float(a), 0.5f)) - 0x3F000000u;
  const uint32_t nan = 0x7E00u | ((a >> 13) & 0x03FFu);
  // Branch-free select with all-ones masks (keeps the float addition
  // unconditional, so the CPU loops vectorise).
  const uint32_t is_nan = 0u - static_cast<uint32_t>(a > 0x7F800000u);
  const uint32_t is_inf = ~is_nan & (0u - static_cast<uint32_t>(a >= 0x477FF000u));  // >= 65520
  const uint32_t is_sub = 0u - static_cast<uint32_t>(a < 0x38800000u);               // < 2^-14
  const uint32_t is_normal = ~(is_nan | is_inf | is_sub);
  const uint32_t bits =
      (nan & is_nan) | (0x7C00u & is_inf) | (sub & is_sub) | (normal & is_normal);
  return static_cast<uint16_t>(sign | bits);
}

// float16 -> float32, exact. A NaN keeps sign and payload and gets the quiet
// bit (as torch's F16C CPU path, VCVTPH2PS).
AREAL_FAST_HD uint32_t f16_bits_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu;
  const uint32_t m = h & 0x3FFu;
  // Subnormal halves are m * 2^-24: exact as a float32 product of two exact
  // values, and a normal float32, so FTZ/DAZ cannot touch it.
  const uint32_t sub = float_bits(static_cast<float>(static_cast<int32_t>(m)) *
                                  5.9604644775390625e-8f);
  const uint32_t normal = ((e + 112u) << 23) | (m << 13);
  const uint32_t special = 0x7F800000u | (m << 13) | (static_cast<uint32_t>(m != 0u) << 22);
  // Branch-free select (all-ones masks), so the CPU loops vectorise.
  const uint32_t is_sub = 0u - static_cast<uint32_t>(e == 0u);
  const uint32_t is_special = 0u - static_cast<uint32_t>(e == 0x1Fu);
  return sign | (sub & is_sub) | (special & is_special) | (normal & ~(is_sub | is_special));
}

}  // namespace areal_fast
