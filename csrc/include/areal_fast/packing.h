// Micro-batch packing for packed (padding-free) sequence batches.
//
// Pure C++17 on raw pointers and std::vector: nothing here knows about Python,
// pybind11 or torch. Errors in the caller's input are reported by throwing
// std::invalid_argument with a one-line message; the messages use the names of
// the public Python API (`seqlens`, `group_ids`, `max_tokens_per_mb`) so the
// native and the pure-Python implementation raise the same text.
#pragma once

#include <cstdint>
#include <vector>

namespace areal_fast {

// For each micro-batch, the indices of the items it holds. Indices are sorted
// ascending inside a micro-batch; micro-batches are ordered by their first
// (smallest) index.
using MicroBatches = std::vector<std::vector<int64_t>>;

enum class PackMethod { kFirstFitDecreasing, kKarmarkarKarp };

// First-fit-decreasing bin packing (Johnson 1973): items are visited by length
// descending, ties by index ascending, and each goes into the first (oldest)
// micro-batch that still has room for it, else into a new one.
// Throws std::invalid_argument for a negative length, an item longer than the
// budget or a non-positive budget. n == 0 gives zero micro-batches.
MicroBatches partition_ffd(const int64_t* seqlens, int64_t n, int64_t max_tokens_per_mb);

// Karmarkar-Karp largest differencing method for balanced k-way partitioning
// (Karmarkar & Karp 1982, "The differencing method of set partitioning").
// k starts at max(min_num_mbs, ceil(sum / max_tokens_per_mb)), capped at n, and
// grows one by one until the heaviest part fits the budget (k == n always fits).
// Every micro-batch is non-empty. Throws like partition_ffd, and for
// min_num_mbs < 1.
MicroBatches partition_kk(const int64_t* seqlens, int64_t n, int64_t max_tokens_per_mb,
                          int64_t min_num_mbs);

// One Karmarkar-Karp run for a fixed number of parts k (1 <= k <= n, lengths
// already validated). Exposed for tests and benchmarks. `max_load`, when not
// null, receives the heaviest part's total length.
MicroBatches karmarkar_karp(const int64_t* seqlens, int64_t n, int64_t k, int64_t* max_load);

// Sequences that share a group id, merged into one packing item.
struct SequenceGroups {
  std::vector<int64_t> lengths;               // total length of each item
  std::vector<std::vector<int64_t>> members;  // sequence indices of each item, ascending
};

// Items are numbered in order of the first appearance of their group id.
// Throws std::invalid_argument for a negative length.
SequenceGroups group_sequences(const int64_t* seqlens, const int64_t* group_ids, int64_t n);

// Partitions n sequences; when group_ids is non-null, sequences sharing a group
// id always land in the same micro-batch (a group longer than the budget is an
// error naming the group). min_num_mbs is used by kKarmarkarKarp only.
MicroBatches partition_sequences(PackMethod method, const int64_t* seqlens,
                                 const int64_t* group_ids, int64_t n,
                                 int64_t max_tokens_per_mb, int64_t min_num_mbs);

// out[0] = 0, out[i + 1] = out[i] + lengths[i]; out has n + 1 entries. Throws for
// a negative length or a total beyond the int32 range.
void cu_seqlens_from_lengths(const int64_t* lengths, int64_t n, int32_t* out);

// Checks cu_seqlens[0] == 0 and that it never decreases (num_seqs + 1 entries);
// returns the total token count cu_seqlens[num_seqs].
int64_t validate_cu_seqlens(const int32_t* cu_seqlens, int64_t num_seqs);

// Fills out[cu_seqlens[i] + t] = t for t in [0, cu_seqlens[i + 1] - cu_seqlens[i]).
// out must hold cu_seqlens[num_seqs] entries. Validates cu_seqlens first.
void position_ids_from_cu_seqlens(const int32_t* cu_seqlens, int64_t num_seqs, int64_t* out);

}  // namespace areal_fast
