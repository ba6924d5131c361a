// Micro-batch packing: first-fit decreasing and Karmarkar-Karp differencing.
// See include/areal_fast/packing.h for the contracts. The pure-Python twin in
// areal_fast/ops/packing.py follows the same steps and tie-breaking, so both
// return identical micro-batches.
#include "areal_fast/packing.h"

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>

namespace areal_fast {
namespace {

[[noreturn]] void fail(const std::string& message) { throw std::invalid_argument(message); }

void check_budget(int64_t max_tokens_per_mb) {
  if (max_tokens_per_mb <= 0) {
    fail("max_tokens_per_mb must be positive, got " + std::to_string(max_tokens_per_mb));
  }
}

void check_min_num_mbs(int64_t min_num_mbs) {
  if (min_num_mbs < 1) fail("min_num_mbs must be >= 1, got " + std::to_string(min_num_mbs));
}

void check_lengths(const int64_t* seqlens, int64_t n, int64_t max_tokens_per_mb) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t v = seqlens[i];
    if (v < 0) fail("seqlens[" + std::to_string(i) + "] = " + std::to_string(v) + " is negative");
    if (v > max_tokens_per_mb) {
      fail("seqlens[" + std::to_string(i) + "] = " + std::to_string(v) +
           " exceeds max_tokens_per_mb = " + std::to_string(max_tokens_per_mb));
    }
  }
}

int64_t checked_total(const int64_t* seqlens, int64_t n) {
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (__builtin_add_overflow(total, seqlens[i], &total)) fail("total of seqlens overflows int64");
  }
  return total;
}

// Indices sorted by length descending, ties by index ascending.
std::vector<int64_t> decreasing_order(const int64_t* seqlens, int64_t n) {
  std::vector<int64_t> order(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [seqlens](int64_t a, int64_t b) {
    return seqlens[a] > seqlens[b] || (seqlens[a] == seqlens[b] && a < b);
  });
  return order;
}

// Sorts indices inside each micro-batch, then micro-batches by first index.
void canonicalize(MicroBatches& mbs) {
  for (auto& mb : mbs) std::sort(mb.begin(), mb.end());
  std::sort(mbs.begin(), mbs.end(),
            [](const std::vector<int64_t>& a, const std::vector<int64_t>& b) {
              return a.front() < b.front();
            });
}

// ---------------------------------------------------------------------------
// Karmarkar-Karp with sparse partitions.
//
// A partial solution ("partition") is a set of at most k subsets; the missing
// ones are empty. A subset is keyed by (sum, sid), sid being a unique creation
// number, which gives a strict total order. Merging partitions P1 and P2 (sizes
// m and j) lays P1's subsets largest-first and P2's smallest-first side by side
// in k slots; when m + j > k the o = m + j - k smallest subsets of each overlap
// and are combined pairwise: the t-th smallest of P1 with the t-th largest of
// P2's o smallest. Combined subsets get fresh sids in that order of t. The
// partition's difference is max_sum - min_sum, min_sum counting as 0 while the
// partition has fewer than k subsets. Partitions are processed largest
// difference first, ties by partition id (creation order) ascending.
// ---------------------------------------------------------------------------

struct Subset {
  int64_t sum;
  int64_t sid;
};

// Comparator for std::push_heap / pop_heap giving a min-heap on (sum, sid).
struct MinFirst {
  bool operator()(const Subset& a, const Subset& b) const {
    return a.sum > b.sum || (a.sum == b.sum && a.sid > b.sid);
  }
};

struct Partition {
  std::vector<Subset> heap;  // min-heap by (sum, sid)
  int64_t max_sum = 0;
};

struct Pending {
  int64_t diff;
  int64_t pid;
};

// Heap order (std::make_heap etc.) puts on top: largest diff, then smallest pid.
struct PendingOrder {
  bool operator()(const Pending& a, const Pending& b) const {
    return a.diff < b.diff || (a.diff == b.diff && a.pid > b.pid);
  }
};

Subset pop_smallest(std::vector<Subset>& heap) {
  std::pop_heap(heap.begin(), heap.end(), MinFirst{});
  Subset s = heap.back();
  heap.pop_back();
  return s;
}

void push_subset(std::vector<Subset>& heap, Subset s) {
  heap.push_back(s);
  std::push_heap(heap.begin(), heap.end(), MinFirst{});
}

// One differencing run for k parts over items visited in `order` (length
// descending, ties by index). Returns the heaviest part's load and fills `out`
// with the parts when that load is at most `out_limit` (else leaves it as is).
int64_t run_karmarkar_karp(const int64_t* seqlens, const std::vector<int64_t>& order, int64_t k,
                           int64_t out_limit, MicroBatches* out) {
  const int64_t n = static_cast<int64_t>(order.size());
  const size_t max_ids = 2 * static_cast<size_t>(n);
  // Items of each subset as a singly linked list over item indices.
  std::vector<int64_t> head(max_ids), tail(max_ids), next_item(static_cast<size_t>(n), -1);
  std::vector<Partition> parts;
  parts.reserve(max_ids);
  // Singletons are created in `order`, so their (difference, pid) keys are
  // already sorted: they wait in a plain queue and only merged partitions go
  // through the heap. Popping the better of the two fronts is the same as one
  // priority queue over all partitions.
  std::vector<Pending> singles;
  singles.reserve(static_cast<size_t>(n));
  size_t next_single = 0;
  std::vector<Pending> merged_heap;
  merged_heap.reserve(static_cast<size_t>(n));
  const PendingOrder before;  // before(a, b): a is popped after b

  auto difference = [k](const Partition& p) {
    const int64_t low = static_cast<int64_t>(p.heap.size()) == k ? p.heap.front().sum : 0;
    return p.max_sum - low;
  };

  int64_t next_sid = 0;
  for (int64_t item : order) {
    const int64_t sid = next_sid++;
    head[sid] = tail[sid] = item;
    Partition p;
    p.heap.push_back({seqlens[item], sid});
    p.max_sum = seqlens[item];
    singles.push_back({difference(p), static_cast<int64_t>(parts.size())});
    parts.push_back(std::move(p));
  }
  auto remaining = [&]() { return singles.size() - next_single + merged_heap.size(); };
  auto pop_pending = [&]() {
    if (next_single < singles.size() &&
        (merged_heap.empty() || before(merged_heap.front(), singles[next_single]))) {
      return singles[next_single++].pid;
    }
    std::pop_heap(merged_heap.begin(), merged_heap.end(), before);
    const int64_t pid = merged_heap.back().pid;
    merged_heap.pop_back();
    return pid;
  };

  std::vector<Subset> low1, low2;
  while (remaining() > 1) {
    Partition& p1 = parts[pop_pending()];
    Partition& p2 = parts[pop_pending()];

    const int64_t m = static_cast<int64_t>(p1.heap.size());
    const int64_t j = static_cast<int64_t>(p2.heap.size());
    const int64_t overlap = std::max<int64_t>(0, m + j - k);
    low1.clear();
    low2.clear();
    for (int64_t t = 0; t < overlap; ++t) low1.push_back(pop_smallest(p1.heap));
    for (int64_t t = 0; t < overlap; ++t) low2.push_back(pop_smallest(p2.heap));

    // Popping the smallest subsets leaves the largest sum in place unless the
    // partition was emptied.
    int64_t max_sum = std::numeric_limits<int64_t>::min();
    if (!p1.heap.empty()) max_sum = p1.max_sum;
    if (!p2.heap.empty()) max_sum = std::max(max_sum, p2.max_sum);

    // Small-to-large: move the smaller remainder into the larger one.
    const bool keep_first = p1.heap.size() >= p2.heap.size();
    std::vector<Subset> merged = std::move(keep_first ? p1.heap : p2.heap);
    std::vector<Subset>& rest = keep_first ? p2.heap : p1.heap;
    for (const Subset& s : rest) push_subset(merged, s);
    std::vector<Subset>().swap(rest);

    for (int64_t t = 0; t < overlap; ++t) {
      const Subset& a = low1[t];
      const Subset& b = low2[overlap - 1 - t];
      const int64_t sid = next_sid++;
      next_item[tail[a.sid]] = head[b.sid];
      head[sid] = head[a.sid];
      tail[sid] = tail[b.sid];
      push_subset(merged, {a.sum + b.sum, sid});
      max_sum = std::max(max_sum, a.sum + b.sum);
    }

    Partition q;
    q.heap = std::move(merged);
    q.max_sum = max_sum;
    merged_heap.push_back({difference(q), static_cast<int64_t>(parts.size())});
    std::push_heap(merged_heap.begin(), merged_heap.end(), before);
    parts.push_back(std::move(q));
  }

  const Partition& final_part = parts[pop_pending()];
  if (final_part.max_sum <= out_limit) {
    out->clear();
    out->reserve(final_part.heap.size());
    for (const Subset& s : final_part.heap) {
      std::vector<int64_t> items;
      for (int64_t it = head[s.sid];; it = next_item[it]) {
        items.push_back(it);
        if (it == tail[s.sid]) break;
      }
      out->push_back(std::move(items));
    }
    canonicalize(*out);
  }
  return final_part.max_sum;
}

}  // namespace

MicroBatches karmarkar_karp(const int64_t* seqlens, int64_t n, int64_t k, int64_t* max_load) {
  if (n <= 0) {
    if (max_load) *max_load = 0;
    return {};
  }
  if (k < 1 || k > n) fail("karmarkar_karp: k must be in [1, n], got " + std::to_string(k));
  MicroBatches mbs;
  const int64_t load = run_karmarkar_karp(seqlens, decreasing_order(seqlens, n), k,
                                          std::numeric_limits<int64_t>::max(), &mbs);
  if (max_load) *max_load = load;
  return mbs;
}

MicroBatches partition_kk(const int64_t* seqlens, int64_t n, int64_t max_tokens_per_mb,
                          int64_t min_num_mbs) {
  check_budget(max_tokens_per_mb);
  check_min_num_mbs(min_num_mbs);
  check_lengths(seqlens, n, max_tokens_per_mb);
  if (n == 0) return {};
  const int64_t total = checked_total(seqlens, n);
  const int64_t needed = total / max_tokens_per_mb + (total % max_tokens_per_mb != 0 ? 1 : 0);
  const std::vector<int64_t> order = decreasing_order(seqlens, n);
  MicroBatches mbs;
  // k == n puts every item alone, which always fits.
  for (int64_t k = std::max<int64_t>(1, std::min(std::max(min_num_mbs, needed), n));; ++k) {
    const int64_t limit = k >= n ? std::numeric_limits<int64_t>::max() : max_tokens_per_mb;
    if (run_karmarkar_karp(seqlens, order, k, limit, &mbs) <= limit) return mbs;
  }
}

MicroBatches partition_ffd(const int64_t* seqlens, int64_t n, int64_t max_tokens_per_mb) {
  check_budget(max_tokens_per_mb);
  check_lengths(seqlens, n, max_tokens_per_mb);
  if (n == 0) return {};

  // Max segment tree over n bins' remaining room. Unopened bins have the full
  // budget and opened bins are always a prefix, so "leftmost leaf with enough
  // room" is exactly first fit, opening a new bin when none of the open fits.
  size_t leaves = 1;
  while (leaves < static_cast<size_t>(n)) leaves <<= 1;
  std::vector<int64_t> room(2 * leaves, -1);
  for (size_t i = 0; i < static_cast<size_t>(n); ++i) room[leaves + i] = max_tokens_per_mb;
  for (size_t v = leaves - 1; v >= 1; --v) room[v] = std::max(room[2 * v], room[2 * v + 1]);

  std::vector<int64_t> bin_of(static_cast<size_t>(n));
  int64_t num_bins = 0;
  for (int64_t item : decreasing_order(seqlens, n)) {
    const int64_t w = seqlens[item];
    size_t v = 1;
    while (v < leaves) v = room[2 * v] >= w ? 2 * v : 2 * v + 1;
    const int64_t bin = static_cast<int64_t>(v - leaves);
    room[v] -= w;
    for (v >>= 1; v >= 1; v >>= 1) room[v] = std::max(room[2 * v], room[2 * v + 1]);
    bin_of[item] = bin;
    num_bins = std::max(num_bins, bin + 1);
  }

  MicroBatches mbs(static_cast<size_t>(num_bins));
  for (int64_t i = 0; i < n; ++i) mbs[bin_of[i]].push_back(i);
  canonicalize(mbs);
  return mbs;
}

SequenceGroups group_sequences(const int64_t* seqlens, const int64_t* group_ids, int64_t n) {
  SequenceGroups groups;
  std::unordered_map<int64_t, int64_t> item_of;
  item_of.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    if (seqlens[i] < 0) {
      fail("seqlens[" + std::to_string(i) + "] = " + std::to_string(seqlens[i]) + " is negative");
    }
    auto [it, inserted] = item_of.try_emplace(group_ids[i], static_cast<int64_t>(groups.lengths.size()));
    if (inserted) {
      groups.lengths.push_back(0);
      groups.members.emplace_back();
    }
    int64_t& total = groups.lengths[it->second];
    if (__builtin_add_overflow(total, seqlens[i], &total)) fail("total of seqlens overflows int64");
    groups.members[it->second].push_back(i);
  }
  return groups;
}

MicroBatches partition_sequences(PackMethod method, const int64_t* seqlens,
                                 const int64_t* group_ids, int64_t n,
                                 int64_t max_tokens_per_mb, int64_t min_num_mbs) {
  check_budget(max_tokens_per_mb);
  if (method == PackMethod::kKarmarkarKarp) check_min_num_mbs(min_num_mbs);
  auto run = [&](const int64_t* lengths, int64_t count) {
    return method == PackMethod::kFirstFitDecreasing
               ? partition_ffd(lengths, count, max_tokens_per_mb)
               : partition_kk(lengths, count, max_tokens_per_mb, min_num_mbs);
  };
  if (group_ids == nullptr) return run(seqlens, n);

  const SequenceGroups groups = group_sequences(seqlens, group_ids, n);
  for (size_t g = 0; g < groups.lengths.size(); ++g) {
    if (groups.lengths[g] > max_tokens_per_mb) {
      const int64_t first = groups.members[g].front();
      fail("group " + std::to_string(group_ids[first]) + " (first at seqlens[" +
           std::to_string(first) + "]) has " + std::to_string(groups.lengths[g]) +
           " tokens, exceeding max_tokens_per_mb = " + std::to_string(max_tokens_per_mb));
    }
  }
  MicroBatches item_mbs = run(groups.lengths.data(), static_cast<int64_t>(groups.lengths.size()));
  MicroBatches mbs;
  mbs.reserve(item_mbs.size());
  for (const auto& items : item_mbs) {
    std::vector<int64_t> seqs;
    for (int64_t item : items) {
      const auto& members = groups.members[item];
      seqs.insert(seqs.end(), members.begin(), members.end());
    }
    mbs.push_back(std::move(seqs));
  }
  canonicalize(mbs);
  return mbs;
}

void cu_seqlens_from_lengths(const int64_t* lengths, int64_t n, int32_t* out) {
  int64_t total = 0;
  out[0] = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (lengths[i] < 0) {
      fail("lengths[" + std::to_string(i) + "] = " + std::to_string(lengths[i]) + " is negative");
    }
    total += lengths[i];
    if (total > std::numeric_limits<int32_t>::max()) {
      fail("total of lengths exceeds the int32 range of cu_seqlens at lengths[" +
           std::to_string(i) + "]");
    }
    out[i + 1] = static_cast<int32_t>(total);
  }
}

int64_t validate_cu_seqlens(const int32_t* cu_seqlens, int64_t num_seqs) {
  if (num_seqs < 0) fail("cu_seqlens must have at least one element");
  if (cu_seqlens[0] != 0) fail("cu_seqlens[0] must be 0, got " + std::to_string(cu_seqlens[0]));
  for (int64_t i = 1; i <= num_seqs; ++i) {
    if (cu_seqlens[i] < cu_seqlens[i - 1]) {
      fail("cu_seqlens must be non-decreasing, but cu_seqlens[" + std::to_string(i) +
           "] = " + std::to_string(cu_seqlens[i]) + " < cu_seqlens[" + std::to_string(i - 1) +
           "] = " + std::to_string(cu_seqlens[i - 1]));
    }
  }
  return cu_seqlens[num_seqs];
}

void position_ids_from_cu_seqlens(const int32_t* cu_seqlens, int64_t num_seqs, int64_t* out) {
  validate_cu_seqlens(cu_seqlens, num_seqs);
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t start = cu_seqlens[i];
    const int64_t len = cu_seqlens[i + 1] - start;
    for (int64_t t = 0; t < len; ++t) out[start + t] = t;
  }
}

}  // namespace areal_fast
