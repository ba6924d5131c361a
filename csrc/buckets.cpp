// Weight-sync buckets on the CPU: the layout planner and the multi-threaded
// pack/unpack copies (see include/areal_fast/buckets.h for the contracts).
//
// The planner's pure-Python twin is areal_fast/sync/buckets.py::_plan_python;
// both follow the same steps, so a receiver that re-plans from the metadata
// alone gets the sender's layout whichever of the two it runs.
//
// The copies split the destination bytes of all chunks of a bucket into equal
// ranges, one per thread, so a single large tensor is shared by every thread.
// The conversion loops are plain scalar code on bit patterns that GCC
// vectorises; they are compiled for AVX-512, AVX2 and baseline x86-64 and
// chosen at load time (target_clones), like logprob_rows.cpp.
#include "areal_fast/buckets.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace areal_fast {
namespace {

[[noreturn]] void fail(const std::string& message) { throw std::invalid_argument(message); }

int64_t align_up(int64_t value) {
  return (value + kBucketAlignment - 1) / kBucketAlignment * kBucketAlignment;
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define AREAL_FAST_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define AREAL_FAST_CLONES
#endif

// Element loads/stores through memcpy: the buffers hold torch's float / half /
// bfloat16 objects, read here as their bit patterns.
template <typename T>
inline T load_bits(const unsigned char* p, int64_t i) {
  T v;
  std::memcpy(&v, p + i * static_cast<int64_t>(sizeof(T)), sizeof(T));
  return v;
}

template <typename T>
inline void store_bits(unsigned char* p, int64_t i, T v) {
  std::memcpy(p + i * static_cast<int64_t>(sizeof(T)), &v, sizeof(T));
}

AREAL_FAST_CLONES
void cast_f32_to_bf16(const unsigned char* __restrict src, unsigned char* __restrict dst,
                      int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    store_bits<uint16_t>(dst, i, f32_bits_to_bf16(load_bits<uint32_t>(src, i)));
  }
}

AREAL_FAST_CLONES
void cast_f32_to_f16_portable(const unsigned char* __restrict src, unsigned char* __restrict dst,
                              int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    store_bits<uint16_t>(dst, i, f32_bits_to_f16(load_bits<uint32_t>(src, i)));
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
// The F16C instruction VCVTPS2PH (round to nearest even, MXCSR.FTZ ignored)
// gives the bits of f32_bits_to_f16, NaNs included, about 3x faster than the
// portable loop; the tail goes through the portable function.
__attribute__((target("avx2,f16c"))) void cast_f32_to_f16_f16c(
    const unsigned char* __restrict src, unsigned char* __restrict dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(reinterpret_cast<const float*>(src + 4 * i));
    const __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * i), h);
  }
  cast_f32_to_f16_portable(src + 4 * i, dst + 2 * i, n - i);
}

bool have_f16c() {
  static const bool have = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return have;
}
#endif

void cast_f32_to_f16(const unsigned char* src, unsigned char* dst, int64_t n) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (have_f16c()) {
    cast_f32_to_f16_f16c(src, dst, n);
    return;
  }
#endif
  cast_f32_to_f16_portable(src, dst, n);
}

AREAL_FAST_CLONES
void cast_bf16_to_f32(const unsigned char* __restrict src, unsigned char* __restrict dst,
                      int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    store_bits<uint32_t>(dst, i, bf16_bits_to_f32(load_bits<uint16_t>(src, i)));
  }
}

AREAL_FAST_CLONES
void cast_f16_to_f32(const unsigned char* __restrict src, unsigned char* __restrict dst,
                     int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    store_bits<uint32_t>(dst, i, f16_bits_to_f32(load_bits<uint16_t>(src, i)));
  }
}

// bfloat16 <-> float16 go through float32: exact widening, then one rounding.
AREAL_FAST_CLONES
void cast_bf16_to_f16(const unsigned char* __restrict src, unsigned char* __restrict dst,
                      int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    store_bits<uint16_t>(dst, i, f32_bits_to_f16(bf16_bits_to_f32(load_bits<uint16_t>(src, i))));
  }
}

AREAL_FAST_CLONES
void cast_f16_to_bf16(const unsigned char* __restrict src, unsigned char* __restrict dst,
                      int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    store_bits<uint16_t>(dst, i, f32_bits_to_bf16(f16_bits_to_f32(load_bits<uint16_t>(src, i))));
  }
}

// Elements [begin, end) of one copy.
void copy_range(const BucketCopy& c, int64_t begin, int64_t end) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  const int64_t src_size = bucket_dtype_size(c.src_dtype);
  const int64_t dst_size = bucket_dtype_size(c.dst_dtype);
  const auto* src = static_cast<const unsigned char*>(c.src) + begin * src_size;
  auto* dst = static_cast<unsigned char*>(c.dst) + begin * dst_size;
  if (c.src_dtype == c.dst_dtype) {
    std::memcpy(dst, src, static_cast<size_t>(n * src_size));
    return;
  }
  switch (c.src_dtype * 4 + c.dst_dtype) {
    case kBucketFloat32 * 4 + kBucketBFloat16: cast_f32_to_bf16(src, dst, n); break;
    case kBucketFloat32 * 4 + kBucketFloat16: cast_f32_to_f16(src, dst, n); break;
    case kBucketBFloat16 * 4 + kBucketFloat32: cast_bf16_to_f32(src, dst, n); break;
    case kBucketFloat16 * 4 + kBucketFloat32: cast_f16_to_f32(src, dst, n); break;
    case kBucketBFloat16 * 4 + kBucketFloat16: cast_bf16_to_f16(src, dst, n); break;
    case kBucketFloat16 * 4 + kBucketBFloat16: cast_f16_to_bf16(src, dst, n); break;
    default: break;  // excluded by validate_bucket_copies
  }
}

// Below this many destination bytes per thread, starting a thread costs more
// than it saves.
constexpr int64_t kMinBytesPerThread = int64_t{1} << 20;

// Thread ranges are cut at element indices that are multiples of a grain
// (whole vectors for the casts, pages for byte copies) except at a copy's end.
int64_t grain_of(const BucketCopy& c) { return c.src_dtype == kBucketBytes ? 4096 : 64; }

}  // namespace

BucketLayout plan_buckets(const int64_t* numels, const int64_t* itemsizes, int64_t n,
                          int64_t bucket_bytes, int64_t solo_bytes) {
  if (bucket_bytes <= 0 || bucket_bytes % kBucketAlignment != 0) {
    fail("bucket_bytes must be a positive multiple of " + std::to_string(kBucketAlignment) +
         ", got " + std::to_string(bucket_bytes));
  }
  if (n < 0) fail("number of tensors must be non-negative, got " + std::to_string(n));
  if (solo_bytes < 0) fail("solo_bytes must be non-negative, got " + std::to_string(solo_bytes));
  bool last_solo = false;
  BucketLayout layout;
  layout.chunks.reserve(static_cast<size_t>(n));
  auto& sizes = layout.bucket_sizes;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t numel = numels[i], itemsize = itemsizes[i];
    if (numel < 0) {
      fail("specs[" + std::to_string(i) + "]: numel must be non-negative, got " +
           std::to_string(numel));
    }
    if (itemsize <= 0 || kBucketAlignment % itemsize != 0) {
      fail("specs[" + std::to_string(i) + "]: itemsize " + std::to_string(itemsize) +
           " does not divide " + std::to_string(kBucketAlignment));
    }
    int64_t nbytes = 0;
    if (__builtin_mul_overflow(numel, itemsize, &nbytes)) {
      fail("specs[" + std::to_string(i) + "]: byte size overflows int64");
    }
    if (sizes.empty()) sizes.push_back(0);
    if (nbytes > 0 && solo_bytes > 0) {  // a solo tensor, or the one after it: fresh bucket
      const bool solo = nbytes >= solo_bytes;
      if ((solo || last_solo) && sizes.back() > 0) sizes.push_back(0);
      last_solo = solo;
    }
    int64_t bucket = static_cast<int64_t>(sizes.size()) - 1;
    const int64_t offset = align_up(sizes.back());
    if (nbytes == 0) {
      layout.chunks.push_back({i, bucket, offset, 0, 0});
      sizes.back() = offset;
      continue;
    }
    if (nbytes <= bucket_bytes - offset) {
      layout.chunks.push_back({i, bucket, offset, 0, numel});
      sizes.back() = offset + nbytes;
      continue;
    }
    if (nbytes <= bucket_bytes) {
      sizes.push_back(nbytes);
      layout.chunks.push_back({i, bucket + 1, 0, 0, numel});
      continue;
    }
    // Larger than a bucket: whole-bucket pieces, starting in an empty bucket.
    if (sizes.back() > 0) {
      sizes.push_back(0);
      ++bucket;
    }
    const int64_t per_bucket = bucket_bytes / itemsize;
    for (int64_t start = 0; start < numel;) {
      const int64_t take = std::min(per_bucket, numel - start);
      layout.chunks.push_back({i, bucket, 0, start, take});
      sizes.back() = take * itemsize;
      start += take;
      if (start < numel) {
        sizes.push_back(0);
        ++bucket;
      }
    }
  }
  return layout;
}

void validate_bucket_copies(const BucketCopy* copies, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const BucketCopy& c = copies[i];
    const std::string where = "copies[" + std::to_string(i) + "]: ";
    if (c.count < 0) fail(where + "count must be non-negative, got " + std::to_string(c.count));
    if (bucket_dtype_size(c.src_dtype) == 0 || bucket_dtype_size(c.dst_dtype) == 0) {
      fail(where + "unknown dtype code " + std::to_string(c.src_dtype) + " -> " +
           std::to_string(c.dst_dtype));
    }
    if ((c.src_dtype == kBucketBytes) != (c.dst_dtype == kBucketBytes)) {
      fail(where + "raw bytes can only be copied to raw bytes");
    }
    if (c.count > 0 && (c.src == nullptr || c.dst == nullptr)) fail(where + "null pointer");
  }
}

void bucket_copy_cpu(const BucketCopy* copies, int64_t n, int num_threads) {
  validate_bucket_copies(copies, n);
  // prefix[i] = destination bytes of copies[0 .. i).
  std::vector<int64_t> prefix(static_cast<size_t>(n) + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t bytes = copies[i].count * bucket_dtype_size(copies[i].dst_dtype);
    if (__builtin_add_overflow(prefix[i], bytes, &prefix[i + 1])) {
      fail("total bytes of the copies overflow int64");
    }
  }
  const int64_t total = prefix[n];
  if (total == 0) return;

  // Element of copy i at which a thread range that starts at global
  // destination byte b starts (monotone in b; 0 at b = 0, count at b = total).
  auto boundary = [&](int64_t i, int64_t b) -> int64_t {
    const BucketCopy& c = copies[i];
    if (b >= prefix[i + 1]) return c.count;
    if (b <= prefix[i]) return 0;
    const int64_t grain = grain_of(c);
    return (b - prefix[i]) / bucket_dtype_size(c.dst_dtype) / grain * grain;
  };
  auto run = [&](int64_t lo, int64_t hi) {
    // First copy whose destination range ends after lo.
    int64_t i = std::upper_bound(prefix.begin(), prefix.end(), lo) - prefix.begin() - 1;
    for (i = std::max<int64_t>(i, 0); i < n && prefix[i] < hi; ++i) {
      copy_range(copies[i], boundary(i, lo), boundary(i, hi));
    }
  };

  const int64_t workers =
      std::max<int64_t>(1, std::min<int64_t>(num_threads, total / kMinBytesPerThread));
  if (workers == 1) {
    run(0, total);
    return;
  }
  auto cut = [&](int64_t w) {  // w * total / workers without overflow
    return total / workers * w + total % workers * w / workers;
  };
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(workers - 1));
  int64_t started = 1;
  try {
    for (; started < workers; ++started) {
      threads.emplace_back(run, cut(started), cut(started + 1));
    }
  } catch (const std::system_error&) {
    // Out of threads: the calling thread does the ranges that got none.
  }
  run(cut(0), cut(1));
  if (started < workers) run(cut(started), cut(workers));
  for (auto& thread : threads) thread.join();
}

}  // namespace areal_fast
