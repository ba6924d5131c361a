// CPU row epilogues of the chunked log-prob computation (see logprob_rows.h).
//
// Each row is processed while it sits in the core's L2 cache: one pass for the
// row maximum, one pass for the exp-sums (forward) or for the gradient
// (backward). The inner loops use GCC vector extensions of 16 floats and a
// Cody-Waite range-reduced polynomial exp (Cephes' expf coefficients, about
// 1 ulp on the reduced range), compiled for AVX-512, AVX2 and baseline x86-64
// and chosen at load time (target_clones).
#include "areal_fast/logprob_rows.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

namespace areal_fast {
namespace {

constexpr int kLanes = 16;
typedef float VecF __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t VecI __attribute__((vector_size(kLanes * sizeof(int32_t))));

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define AREAL_FAST_CLONES \
  __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define AREAL_FAST_CLONES
#endif
#define AREAL_FAST_INLINE static inline __attribute__((always_inline))

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

AREAL_FAST_INLINE VecF load(const float* p) {
  VecF v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

AREAL_FAST_INLINE void store(float* p, VecF v) { std::memcpy(p, &v, sizeof(v)); }

AREAL_FAST_INLINE VecF splat(float x) { return VecF{} + x; }

AREAL_FAST_INLINE float hsum(VecF v) {
  float total = 0.f;
  for (int i = 0; i < kLanes; ++i) total += v[i];
  return total;
}

// exp(x) lane-wise for x <= ~0 (the only range used here); 0 below -87.3 and
// for -inf, NaN stays NaN.
AREAL_FAST_INLINE VecF vexp(VecF x) {
  const VecF lowest = splat(-87.33654f);
  const VecI underflow = x < lowest;
  x = underflow ? lowest : x;
  const VecF magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const VecF shifted = x * 1.44269504088896341f + magic;
  const VecF n = shifted - magic;
  VecF r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  VecF poly = splat(1.9875691500e-4f);
  poly = poly * r + 1.3981999507e-3f;
  poly = poly * r + 8.3334519073e-3f;
  poly = poly * r + 4.1665795894e-2f;
  poly = poly * r + 1.6666665459e-1f;
  poly = poly * r + 5.0000001201e-1f;
  poly = poly * r * r + r + 1.0f;
  const VecI exponent = (__builtin_convertvector(n, VecI) + 127) << 23;
  VecF scale;
  std::memcpy(&scale, &exponent, sizeof(scale));
  return underflow ? splat(0.f) : poly * scale;
}

// Scalar twin of vexp for the row tails (std::exp: the same function to ~1 ulp).
AREAL_FAST_INLINE float sexp(float x) { return x < -87.33654f ? 0.f : std::exp(x); }

AREAL_FAST_CLONES
float row_max(const float* z, int64_t vocab, float inv_temp) {
  VecF best = splat(kNegInf);
  int64_t v = 0;
  for (; v + kLanes <= vocab; v += kLanes) {
    const VecF x = load(z + v) * inv_temp;
    best = x > best ? x : best;
  }
  float m = kNegInf;
  for (int i = 0; i < kLanes; ++i) m = best[i] > m ? best[i] : m;
  for (; v < vocab; ++v) m = std::max(m, z[v] * inv_temp);
  return m;
}

// Sums of one row (or tile) against a given maximum m: `small` = sum of exp(x - m)
// over the entries below m, `at_max` = how many entries equal m (each adds
// exp(0) = 1), t = sum exp(x - m) * (x - m) (0 where exp is 0). Keeping the
// entries at the maximum out of `small` lets the caller form log(sum) as
// log1p(small + at_max - 1), accurate when one entry dominates.
struct ExpSums {
  float small = 0.f;
  float at_max = 0.f;
  float t = 0.f;
};

AREAL_FAST_CLONES
ExpSums row_exp_sums(const float* z, int64_t vocab, float inv_temp, float m, bool want_t) {
  VecF small_acc = splat(0.f), max_acc = splat(0.f), t_acc = splat(0.f);
  int64_t v = 0;
  for (; v + kLanes <= vocab; v += kLanes) {
    const VecF d = load(z + v) * inv_temp - m;
    const VecF e = vexp(d);
    const VecI below = d < 0.f;
    small_acc += below ? e : splat(0.f);
    max_acc += below ? splat(0.f) : splat(1.f);
    if (want_t) t_acc += (e > 0.f) ? e * d : splat(0.f);
  }
  ExpSums sums;
  sums.small = hsum(small_acc);
  sums.at_max = hsum(max_acc);
  sums.t = hsum(t_acc);
  for (; v < vocab; ++v) {
    const float d = z[v] * inv_temp - m;
    const float e = sexp(d);
    if (d < 0.f) {
      sums.small += e;
    } else {
      sums.at_max += 1.f;
    }
    if (want_t && e > 0.f) sums.t += e * d;
  }
  return sums;
}

// Overwrites z with the gradient except at the label; returns sum_{v != y} p_v.
AREAL_FAST_CLONES
float row_backward(float* z, int64_t vocab, int64_t label, float inv_temp, float lse, float g,
                   float h, float ent) {
  VecF s_acc = splat(0.f);
  VecI index = VecI{};
  for (int i = 0; i < kLanes; ++i) index[i] = i;
  const VecI label_vec = VecI{} + static_cast<int32_t>(label);
  int64_t v = 0;
  for (; v + kLanes <= vocab; v += kLanes) {
    const VecF d = load(z + v) * inv_temp - lse;
    const VecF p = vexp(d);
    const VecI at_label = (index + static_cast<int32_t>(v)) == label_vec;
    s_acc += at_label ? splat(0.f) : p;
    const VecF grad = p * (-g - h * (d + ent)) * inv_temp;
    store(z + v, (p > 0.f) ? grad : splat(0.f));
  }
  float others = hsum(s_acc);
  for (; v < vocab; ++v) {
    const float d = z[v] * inv_temp - lse;
    const float p = sexp(d);
    if (v != label) others += p;
    z[v] = p > 0.f ? p * (-g - h * (d + ent)) * inv_temp : 0.f;
  }
  return others;
}

template <typename Fn>
void parallel_rows(int64_t rows, int num_threads, Fn&& fn) {
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(num_threads, rows));
  if (workers == 1) {
    fn(0, rows);
    return;
  }
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(workers - 1));
  const int64_t per = (rows + workers - 1) / workers;
  for (int64_t w = 1; w < workers; ++w) {
    const int64_t begin = std::min(rows, w * per), end = std::min(rows, (w + 1) * per);
    threads.emplace_back([&fn, begin, end] { fn(begin, end); });
  }
  fn(0, std::min(rows, per));
  for (auto& thread : threads) thread.join();
}

}  // namespace

void logprob_rows_forward(const float* z, int64_t rows, int64_t vocab, int64_t row_stride,
                          const int64_t* labels, float inv_temp, int64_t ignore_index,
                          float* logprobs, float* entropy, float* lse, int num_threads) {
  parallel_rows(rows, num_threads, [=](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const float* row = z + c * row_stride;
      const bool ignored = labels[c] == ignore_index;
      const float m = row_max(row, vocab, inv_temp);
      const ExpSums sums =
          row_exp_sums(row, vocab, inv_temp, m, entropy != nullptr && !ignored);
      const float rest = sums.small + (sums.at_max - 1.f);  // sum exp(x - m) - 1
      const float log_s = std::log1p(rest);
      lse[c] = m + log_s;
      logprobs[c] = ignored ? 0.f : (row[labels[c]] * inv_temp - m) - log_s;
      if (entropy != nullptr) entropy[c] = ignored ? 0.f : log_s - sums.t / (1.f + rest);
    }
  });
}

void logprob_rows_backward(float* z, int64_t rows, int64_t vocab, int64_t row_stride,
                           const int64_t* labels, const float* lse, const float* entropy,
                           const float* grad_logprobs, const float* grad_entropy,
                           float inv_temp, int64_t ignore_index, int num_threads) {
  parallel_rows(rows, num_threads, [=](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      float* row = z + c * row_stride;
      const int64_t label = labels[c];
      if (label == ignore_index) {
        std::fill(row, row + vocab, 0.f);
        continue;
      }
      const float g = grad_logprobs[c];
      const float h = grad_entropy != nullptr ? grad_entropy[c] : 0.f;
      const float ent = (grad_entropy != nullptr && entropy != nullptr) ? entropy[c] : 0.f;
      const float d_label = row[label] * inv_temp - lse[c];
      const float others = row_backward(row, vocab, label, inv_temp, lse[c], g, h, ent);
      // confident rows: x_y - lse = log1p(-others) is accurate where the fp32
      // difference of two nearly equal numbers is not
      const bool confident = others < 0.5f;
      const float d_y = confident ? std::log1p(-others) : d_label;
      const float p_label = confident ? 1.f - others : sexp(d_label);
      const float entropy_term = p_label > 0.f ? p_label * (d_y + ent) : 0.f;
      row[label] = (g * others - h * entropy_term) * inv_temp;
    }
  });
}

void logprob_tile_forward(const float* z, int64_t rows, int64_t tile, int64_t row_stride,
                          int64_t v0, const int64_t* labels, float inv_temp,
                          int64_t ignore_index, float* m, float* s, float* t, float* picked,
                          int num_threads) {
  parallel_rows(rows, num_threads, [=](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t label = labels[c];
      if (label == ignore_index) continue;
      const float* row = z + c * row_stride;
      if (label >= v0 && label < v0 + tile) picked[c] = row[label - v0] * inv_temp;
      const float m_old = m[c];
      const float m_new = std::max(m_old, row_max(row, tile, inv_temp));
      if (m_new == kNegInf) continue;  // every logit so far is -inf
      const ExpSums sums = row_exp_sums(row, tile, inv_temp, m_new, t != nullptr);
      // state: s[c] = sum exp(x - m) - 1 over the tiles so far (the entry at the
      // running maximum kept out, so log1p(s) stays accurate for dominant entries)
      if (m_new > m_old) {  // this tile holds the new maximum (at_max >= 1)
        float carried = 0.f, t_carried = 0.f;
        if (m_old != kNegInf) {
          const float shift = m_old - m_new;  // < 0
          const float alpha = std::exp(shift);
          carried = alpha * (1.f + s[c]);
          if (t != nullptr) t_carried = alpha * (t[c] + (1.f + s[c]) * shift);
        }
        s[c] = carried + sums.small + (sums.at_max - 1.f);
        if (t != nullptr) t[c] = t_carried + sums.t;
      } else {  // same maximum: entries equal to it add 1 each
        s[c] += sums.small + sums.at_max;
        if (t != nullptr) t[c] += sums.t;
      }
      m[c] = m_new;
    }
  });
}

void logprob_tile_backward(float* z, int64_t rows, int64_t tile, int64_t row_stride,
                           int64_t v0, const int64_t* labels, const float* lse,
                           const float* entropy, const float* grad_logprobs,
                           const float* grad_entropy, float inv_temp, int64_t ignore_index,
                           float* others, float* d_label, int num_threads) {
  parallel_rows(rows, num_threads, [=](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      float* row = z + c * row_stride;
      const int64_t label = labels[c];
      if (label == ignore_index) {
        std::fill(row, row + tile, 0.f);
        continue;
      }
      const bool in_tile = label >= v0 && label < v0 + tile;
      // outside the tile the relative label index never matches a column
      const int64_t local = in_tile ? label - v0 : -1;
      if (in_tile) d_label[c] = row[local] * inv_temp - lse[c];
      const float g = grad_logprobs[c];
      const float h = grad_entropy != nullptr ? grad_entropy[c] : 0.f;
      const float ent = (grad_entropy != nullptr && entropy != nullptr) ? entropy[c] : 0.f;
      others[c] += row_backward(row, tile, local, inv_temp, lse[c], g, h, ent);
      if (in_tile) row[local] = 0.f;
    }
  });
}

}  // namespace areal_fast
