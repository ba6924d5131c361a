// Row epilogues of the chunked log-prob computation, on the CPU.
//
// A chunk of C tokens has raw LM-head logits z [C, V] float32 (row stride
// `row_stride` floats, unit column stride). With x = z * inv_temp (the
// tempered logits), lse = logsumexp(x) and p = exp(x - lse):
//
//   forward:  lse[c] = lse; logprobs[c] = x[y] - lse;
//             entropy[c] = lse - sum_v p_v x_v   (entries with p_v = 0, such
//             as x_v = -inf, contribute 0). Rows whose label equals
//             ignore_index get logprob 0 and entropy 0 (lse is still written).
//   backward: z is overwritten with d/dz of  g*logprob + h*entropy:
//             dz_v = inv_temp * (g*(1[v=y] - p_v) - h*p_v*(x_v - lse + H)),
//             where g = grad_logprobs[c], h = grad_entropy[c], H = entropy[c].
//             The label entry uses sum_{v!=y} p_v instead of 1 - p_y, which
//             keeps its relative accuracy for confident rows (p_y -> 1).
//             Ignored rows become all zeros.
//
// entropy / grad_entropy may be null (entropy skipped / h = 0). Rows are split
// over `num_threads` threads; no allocation, nothing else is touched. The
// caller validates shapes and label ranges.
#pragma once

#include <cstdint>

namespace areal_fast {

void logprob_rows_forward(const float* z, int64_t rows, int64_t vocab, int64_t row_stride,
                          const int64_t* labels, float inv_temp, int64_t ignore_index,
                          float* logprobs, float* entropy, float* lse, int num_threads);

void logprob_rows_backward(float* z, int64_t rows, int64_t vocab, int64_t row_stride,
                           const int64_t* labels, const float* lse, const float* entropy,
                           const float* grad_logprobs, const float* grad_entropy,
                           float inv_temp, int64_t ignore_index, int num_threads);

}  // namespace areal_fast

// Vocabulary-tiled variants: the logits of C tokens arrive as tiles
// z [C, vt] holding vocabulary columns [v0, v0 + vt), so a chunk of many tokens
// never needs a [C, V] block (the matmul then streams the LM head once per
// chunk instead of once per few rows).
//
// Forward, per tile, updates the online state of each row: m (running max of
// the tempered logits, start -inf), s = sum exp(x - m) - 1 (the entry at the
// maximum kept out, so that log1p(s) is accurate when it dominates; start 0),
// t = sum exp(x - m)(x - m) (start 0; skipped when null) and picked = x[y] when
// y is in the tile. After the last tile: lse = m + log1p(s),
// logprob = picked - lse, entropy = log1p(s) - t / (1 + s).
namespace areal_fast {

void logprob_tile_forward(const float* z, int64_t rows, int64_t tile, int64_t row_stride,
                          int64_t v0, const int64_t* labels, float inv_temp,
                          int64_t ignore_index, float* m, float* s, float* t, float* picked,
                          int num_threads);

// Backward, per tile: overwrites the tile with dz for every column except the
// label's (set to 0; the caller adds the label entry once all tiles are done),
// adds sum_{v != y} p_v of the tile to others[c] and, when y is in the tile,
// writes d_label[c] = x_y - lse. Ignored rows become zeros.
void logprob_tile_backward(float* z, int64_t rows, int64_t tile, int64_t row_stride,
                           int64_t v0, const int64_t* labels, const float* lse,
                           const float* entropy, const float* grad_logprobs,
                           const float* grad_entropy, float inv_temp, int64_t ignore_index,
                           float* others, float* d_label, int num_threads);

}  // namespace areal_fast
