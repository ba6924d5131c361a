// Python bindings of areal_fast._C: argument checks, conversion and dispatch
// only. The algorithms live in packing.cpp and cuda/*.cu, which know nothing
// of Python. std::invalid_argument from them surfaces as ValueError.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "areal_fast/buckets.h"
#include "areal_fast/logprob_rows.h"
#include "areal_fast/packing.h"
#include "areal_fast/segment_sum.h"
#ifdef AREAL_FAST_WITH_CUDA
#include "areal_fast/bucket_pack_cuda.h"
#endif

#ifndef AREAL_FAST_VERSION
#define AREAL_FAST_VERSION "0+unknown"
#endif
#ifndef AREAL_FAST_COMPILER
#define AREAL_FAST_COMPILER "unknown"
#endif
#ifndef AREAL_FAST_BUILD_TYPE
#define AREAL_FAST_BUILD_TYPE "unknown"
#endif

namespace py = pybind11;

namespace {

// No forcecast: only lossless conversions (e.g. int32 -> int64) are accepted,
// a float array is rejected with TypeError by pybind11's overload resolution.
using Int64Array = py::array_t<int64_t, py::array::c_style>;
using Int32Array = py::array_t<int32_t, py::array::c_style>;

template <typename Array>
void require_1d(const Array& a, const char* name) {
  if (a.ndim() != 1) {
    throw py::value_error(std::string(name) + " must be 1-D, got " + std::to_string(a.ndim()) +
                          " dimensions");
  }
}

areal_fast::MicroBatches partition(areal_fast::PackMethod method, const Int64Array& seqlens,
                                   int64_t max_tokens_per_mb, int64_t min_num_mbs,
                                   const std::optional<Int64Array>& group_ids) {
  require_1d(seqlens, "seqlens");
  const int64_t n = static_cast<int64_t>(seqlens.size());
  const int64_t* groups = nullptr;
  if (group_ids.has_value()) {
    require_1d(*group_ids, "group_ids");
    if (static_cast<int64_t>(group_ids->size()) != n) {
      throw py::value_error("group_ids has " + std::to_string(group_ids->size()) +
                            " entries but seqlens has " + std::to_string(n));
    }
    groups = group_ids->data();
  }
  const int64_t* lengths = seqlens.data();
  py::gil_scoped_release release;
  return areal_fast::partition_sequences(method, lengths, groups, n, max_tokens_per_mb,
                                         min_num_mbs);
}

Int32Array cu_seqlens_from_lengths(const Int64Array& lengths) {
  require_1d(lengths, "lengths");
  const int64_t n = static_cast<int64_t>(lengths.size());
  Int32Array out(n + 1);
  const int64_t* src = lengths.data();
  int32_t* dst = out.mutable_data();
  {
    py::gil_scoped_release release;
    areal_fast::cu_seqlens_from_lengths(src, n, dst);
  }
  return out;
}

py::array_t<int64_t> position_ids_from_cu_seqlens(const Int32Array& cu_seqlens) {
  require_1d(cu_seqlens, "cu_seqlens");
  if (cu_seqlens.size() == 0) throw py::value_error("cu_seqlens must have at least one element");
  const int64_t num_seqs = static_cast<int64_t>(cu_seqlens.size()) - 1;
  const int32_t* cu = cu_seqlens.data();
  const int64_t total = areal_fast::validate_cu_seqlens(cu, num_seqs);
  py::array_t<int64_t> out(total);
  int64_t* dst = out.mutable_data();
  {
    py::gil_scoped_release release;
    areal_fast::position_ids_from_cu_seqlens(cu, num_seqs, dst);
  }
  return out;
}

template <typename T>
T* pointer(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

void logprob_rows_forward(uintptr_t z, int64_t rows, int64_t vocab, int64_t row_stride,
                          uintptr_t labels, float inv_temp, int64_t ignore_index,
                          uintptr_t logprobs, uintptr_t entropy, uintptr_t lse,
                          int num_threads) {
  if (rows < 0 || vocab < 1 || row_stride < vocab || num_threads < 1) {
    throw py::value_error("logprob_rows_forward: bad sizes");
  }
  py::gil_scoped_release release;
  areal_fast::logprob_rows_forward(pointer<const float>(z), rows, vocab, row_stride,
                                   pointer<const int64_t>(labels), inv_temp, ignore_index,
                                   pointer<float>(logprobs), pointer<float>(entropy),
                                   pointer<float>(lse), num_threads);
}

void logprob_rows_backward(uintptr_t z, int64_t rows, int64_t vocab, int64_t row_stride,
                           uintptr_t labels, uintptr_t lse, uintptr_t entropy,
                           uintptr_t grad_logprobs, uintptr_t grad_entropy, float inv_temp,
                           int64_t ignore_index, int num_threads) {
  if (rows < 0 || vocab < 1 || row_stride < vocab || num_threads < 1) {
    throw py::value_error("logprob_rows_backward: bad sizes");
  }
  py::gil_scoped_release release;
  areal_fast::logprob_rows_backward(pointer<float>(z), rows, vocab, row_stride,
                                    pointer<const int64_t>(labels), pointer<const float>(lse),
                                    pointer<const float>(entropy),
                                    pointer<const float>(grad_logprobs),
                                    pointer<const float>(grad_entropy), inv_temp, ignore_index,
                                    num_threads);
}

void logprob_tile_forward(uintptr_t z, int64_t rows, int64_t tile, int64_t row_stride,
                          int64_t v0, uintptr_t labels, float inv_temp, int64_t ignore_index,
                          uintptr_t m, uintptr_t s, uintptr_t t, uintptr_t picked,
                          int num_threads) {
  if (rows < 0 || tile < 1 || row_stride < tile || v0 < 0 || num_threads < 1) {
    throw py::value_error("logprob_tile_forward: bad sizes");
  }
  py::gil_scoped_release release;
  areal_fast::logprob_tile_forward(pointer<const float>(z), rows, tile, row_stride, v0,
                                   pointer<const int64_t>(labels), inv_temp, ignore_index,
                                   pointer<float>(m), pointer<float>(s), pointer<float>(t),
                                   pointer<float>(picked), num_threads);
}

void logprob_tile_backward(uintptr_t z, int64_t rows, int64_t tile, int64_t row_stride,
                           int64_t v0, uintptr_t labels, uintptr_t lse, uintptr_t entropy,
                           uintptr_t grad_logprobs, uintptr_t grad_entropy, float inv_temp,
                           int64_t ignore_index, uintptr_t others, uintptr_t d_label,
                           int num_threads) {
  if (rows < 0 || tile < 1 || row_stride < tile || v0 < 0 || num_threads < 1) {
    throw py::value_error("logprob_tile_backward: bad sizes");
  }
  py::gil_scoped_release release;
  areal_fast::logprob_tile_backward(
      pointer<float>(z), rows, tile, row_stride, v0, pointer<const int64_t>(labels),
      pointer<const float>(lse), pointer<const float>(entropy),
      pointer<const float>(grad_logprobs), pointer<const float>(grad_entropy), inv_temp,
      ignore_index, pointer<float>(others), pointer<float>(d_label), num_threads);
}

#ifdef AREAL_FAST_WITH_CUDA
void segment_sum_cuda(uintptr_t values_ptr, int dtype_code, uintptr_t cu_seqlens_ptr,
                      int64_t num_segments, uintptr_t out_ptr, uintptr_t stream) {
  int code = 0;
  {
    py::gil_scoped_release release;
    code = areal_fast::launch_segment_sum(
        reinterpret_cast<const void*>(values_ptr), dtype_code,
        reinterpret_cast<const int32_t*>(cu_seqlens_ptr), num_segments,
        reinterpret_cast<float*>(out_ptr), reinterpret_cast<cudaStream_t>(stream));
  }
  if (code != 0) {
    throw std::runtime_error("segment_sum CUDA launch failed: " +
                             std::string(areal_fast::cuda_error_string(code)) + " (error " +
                             std::to_string(code) + ")");
  }
}
#endif

// --- weight-sync buckets -------------------------------------------------------

py::tuple plan_buckets(const Int64Array& numels, const Int64Array& itemsizes,
                       int64_t bucket_bytes, int64_t solo_bytes) {
  require_1d(numels, "numels");
  require_1d(itemsizes, "itemsizes");
  const int64_t n = static_cast<int64_t>(numels.size());
  if (static_cast<int64_t>(itemsizes.size()) != n) {
    throw py::value_error("itemsizes has " + std::to_string(itemsizes.size()) +
                          " entries but numels has " + std::to_string(n));
  }
  const int64_t* numel_data = numels.data();
  const int64_t* itemsize_data = itemsizes.data();
  areal_fast::BucketLayout layout;
  {
    py::gil_scoped_release release;
    layout = areal_fast::plan_buckets(numel_data, itemsize_data, n, bucket_bytes, solo_bytes);
  }
  const auto num_chunks = static_cast<py::ssize_t>(layout.chunks.size());
  py::array_t<int64_t> chunks({num_chunks, static_cast<py::ssize_t>(5)});
  int64_t* out = chunks.mutable_data();
  for (const auto& c : layout.chunks) {
    *out++ = c.tensor;
    *out++ = c.bucket;
    *out++ = c.offset;
    *out++ = c.start;
    *out++ = c.numel;
  }
  py::array_t<int64_t> sizes(static_cast<py::ssize_t>(layout.bucket_sizes.size()));
  std::copy(layout.bucket_sizes.begin(), layout.bucket_sizes.end(), sizes.mutable_data());
  return py::make_tuple(chunks, sizes);
}

// Rows (src, dst, count, src_dtype, dst_dtype) of an int64 [C, 5] array.
std::vector<areal_fast::BucketCopy> bucket_copies(const Int64Array& rows) {
  if (rows.ndim() != 2 || rows.shape(1) != 5) {
    throw py::value_error("copies must have shape [C, 5] (src, dst, count, src_dtype, "
                          "dst_dtype)");
  }
  const int64_t n = static_cast<int64_t>(rows.shape(0));
  std::vector<areal_fast::BucketCopy> copies(static_cast<size_t>(n));
  const int64_t* r = rows.data();
  for (int64_t i = 0; i < n; ++i, r += 5) {
    if (r[3] < INT32_MIN || r[3] > INT32_MAX || r[4] < INT32_MIN || r[4] > INT32_MAX) {
      throw py::value_error("copies[" + std::to_string(i) + "]: dtype code out of range");
    }
    copies[i] = {reinterpret_cast<const void*>(static_cast<uintptr_t>(r[0])),
                 reinterpret_cast<void*>(static_cast<uintptr_t>(r[1])), r[2],
                 static_cast<int32_t>(r[3]), static_cast<int32_t>(r[4])};
  }
  areal_fast::validate_bucket_copies(copies.data(), n);
  return copies;
}

void bucket_copy(const Int64Array& rows, int num_threads) {
  if (num_threads < 1) {
    throw py::value_error("num_threads must be >= 1, got " + std::to_string(num_threads));
  }
  const auto copies = bucket_copies(rows);
  py::gil_scoped_release release;
  areal_fast::bucket_copy_cpu(copies.data(), static_cast<int64_t>(copies.size()), num_threads);
}

#ifdef AREAL_FAST_WITH_CUDA
void bucket_copy_cuda(const Int64Array& rows, uintptr_t stream) {
  const auto copies = bucket_copies(rows);
  int code = 0;
  {
    py::gil_scoped_release release;
    code = areal_fast::launch_bucket_copy(copies.data(), static_cast<int64_t>(copies.size()),
                                          reinterpret_cast<cudaStream_t>(stream));
  }
  if (code != 0) {
    throw std::runtime_error("bucket_copy CUDA launch failed: " +
                             std::string(areal_fast::cuda_error_string(code)) + " (error " +
                             std::to_string(code) + ")");
  }
}
#endif

py::dict build_info() {
  py::dict info;
  info["version"] = AREAL_FAST_VERSION;
  info["compiler"] = AREAL_FAST_COMPILER;
  info["build_type"] = AREAL_FAST_BUILD_TYPE;
  info["cplusplus"] = static_cast<long>(__cplusplus);
#ifdef AREAL_FAST_WITH_CUDA
  info["cuda"] = true;
  info["cuda_runtime_version"] = areal_fast::cuda_runtime_version();
  info["cuda_compiler"] = AREAL_FAST_CUDA_COMPILER;
  info["cuda_architectures"] = AREAL_FAST_CUDA_ARCHITECTURES;
#else
  info["cuda"] = false;
  info["cuda_runtime_version"] = py::none();
  info["cuda_compiler"] = py::none();
  info["cuda_architectures"] = py::none();
#endif
  return info;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "Native helpers of areal_fast: micro-batch packing (C++) and CUDA kernels.";
  m.attr("__version__") = AREAL_FAST_VERSION;
#ifdef AREAL_FAST_WITH_CUDA
  m.attr("has_cuda") = true;
#else
  m.attr("has_cuda") = false;
#endif
  py::dict dtype_codes;
  dtype_codes["float32"] = static_cast<int>(areal_fast::kSegmentSumFloat32);
  dtype_codes["float16"] = static_cast<int>(areal_fast::kSegmentSumFloat16);
  dtype_codes["bfloat16"] = static_cast<int>(areal_fast::kSegmentSumBFloat16);
  m.attr("SEGMENT_SUM_DTYPE_CODES") = dtype_codes;

  m.def(
      "partition_ffd",
      [](const Int64Array& seqlens, int64_t max_tokens_per_mb,
         const std::optional<Int64Array>& group_ids) {
        return partition(areal_fast::PackMethod::kFirstFitDecreasing, seqlens, max_tokens_per_mb,
                         1, group_ids);
      },
      py::arg("seqlens"), py::arg("max_tokens_per_mb"), py::arg("group_ids") = py::none(),
      "First-fit-decreasing packing of int64 seqlens [N] under max_tokens_per_mb; sequences "
      "sharing a group id stay together. Returns a list of index lists.");
  m.def(
      "partition_kk",
      [](const Int64Array& seqlens, int64_t max_tokens_per_mb, int64_t min_num_mbs,
         const std::optional<Int64Array>& group_ids) {
        return partition(areal_fast::PackMethod::kKarmarkarKarp, seqlens, max_tokens_per_mb,
                         min_num_mbs, group_ids);
      },
      py::arg("seqlens"), py::arg("max_tokens_per_mb"), py::arg("min_num_mbs") = 1,
      py::arg("group_ids") = py::none(),
      "Karmarkar-Karp balanced packing of int64 seqlens [N] into the fewest parts (at least "
      "min_num_mbs) that fit max_tokens_per_mb. Returns a list of index lists.");
  m.def(
      "karmarkar_karp",
      [](const Int64Array& seqlens, int64_t k) {
        require_1d(seqlens, "seqlens");
        const int64_t n = static_cast<int64_t>(seqlens.size());
        if (k < 1 || k > n) {
          throw py::value_error("k must be in [1, len(seqlens)] = [1, " + std::to_string(n) +
                                "], got " + std::to_string(k));
        }
        for (int64_t i = 0; i < n; ++i) {
          if (seqlens.data()[i] < 0) throw py::value_error("seqlens must be non-negative");
        }
        const int64_t* lengths = seqlens.data();
        py::gil_scoped_release release;
        return areal_fast::karmarkar_karp(lengths, n, k, nullptr);
      },
      py::arg("seqlens"), py::arg("k"),
      "One Karmarkar-Karp run into exactly k parts, without a budget.");
  m.def("cu_seqlens_from_lengths", &cu_seqlens_from_lengths, py::arg("lengths"),
        "int64 lengths [B] -> int32 cu_seqlens [B + 1] starting at 0.");
  m.def("position_ids_from_cu_seqlens", &position_ids_from_cu_seqlens, py::arg("cu_seqlens"),
        "int32 cu_seqlens [B + 1] -> int64 position ids [T], restarting at 0 per sequence.");
  m.def("logprob_rows_forward", &logprob_rows_forward, py::arg("z_ptr"), py::arg("rows"),
        py::arg("vocab"), py::arg("row_stride"), py::arg("labels_ptr"), py::arg("inv_temp"),
        py::arg("ignore_index"), py::arg("logprobs_ptr"), py::arg("entropy_ptr"),
        py::arg("lse_ptr"), py::arg("num_threads"),
        "CPU row epilogue, forward: float32 logits [rows, vocab] (row stride in floats) and "
        "int64 labels -> float32 logprobs, entropy (entropy_ptr 0 skips it) and logsumexp. "
        "Raw host addresses; the caller checks shapes, dtypes and label ranges.");
  m.def("logprob_rows_backward", &logprob_rows_backward, py::arg("z_ptr"), py::arg("rows"),
        py::arg("vocab"), py::arg("row_stride"), py::arg("labels_ptr"), py::arg("lse_ptr"),
        py::arg("entropy_ptr"), py::arg("grad_logprobs_ptr"), py::arg("grad_entropy_ptr"),
        py::arg("inv_temp"), py::arg("ignore_index"), py::arg("num_threads"),
        "CPU row epilogue, backward: overwrites the float32 logits [rows, vocab] with the "
        "gradient of grad_logprobs*logprobs + grad_entropy*entropy w.r.t. them (0 pointers "
        "for entropy/grad_entropy mean no entropy term).");
  m.def("logprob_tile_forward", &logprob_tile_forward, py::arg("z_ptr"), py::arg("rows"),
        py::arg("tile"), py::arg("row_stride"), py::arg("v0"), py::arg("labels_ptr"),
        py::arg("inv_temp"), py::arg("ignore_index"), py::arg("m_ptr"), py::arg("s_ptr"),
        py::arg("t_ptr"), py::arg("picked_ptr"), py::arg("num_threads"),
        "Vocabulary tile [rows, tile] (columns v0..v0+tile) of float32 logits: update the "
        "online max m, exp-sum s, entropy sum t (t_ptr 0 skips it) and the label logit.");
  m.def("logprob_tile_backward", &logprob_tile_backward, py::arg("z_ptr"), py::arg("rows"),
        py::arg("tile"), py::arg("row_stride"), py::arg("v0"), py::arg("labels_ptr"),
        py::arg("lse_ptr"), py::arg("entropy_ptr"), py::arg("grad_logprobs_ptr"),
        py::arg("grad_entropy_ptr"), py::arg("inv_temp"), py::arg("ignore_index"),
        py::arg("others_ptr"), py::arg("d_label_ptr"), py::arg("num_threads"),
        "Overwrite a vocabulary tile of logits with its gradient, the label column zeroed; "
        "accumulate sum_{v != y} p_v into others and write x_y - lse into d_label.");
#ifdef AREAL_FAST_WITH_CUDA
  m.def("segment_sum_cuda", &segment_sum_cuda, py::arg("values_ptr"), py::arg("dtype_code"),
        py::arg("cu_seqlens_ptr"), py::arg("num_segments"), py::arg("out_ptr"),
        py::arg("stream"),
        "Launch the segmented-sum kernel on raw device pointers and a cudaStream_t; the "
        "caller checks shapes, dtypes and devices.");
#endif
  py::dict bucket_dtype_codes;
  bucket_dtype_codes["bytes"] = static_cast<int>(areal_fast::kBucketBytes);
  bucket_dtype_codes["float32"] = static_cast<int>(areal_fast::kBucketFloat32);
  bucket_dtype_codes["float16"] = static_cast<int>(areal_fast::kBucketFloat16);
  bucket_dtype_codes["bfloat16"] = static_cast<int>(areal_fast::kBucketBFloat16);
  m.attr("BUCKET_DTYPE_CODES") = bucket_dtype_codes;
  m.attr("BUCKET_ALIGNMENT") = areal_fast::kBucketAlignment;
  m.def("plan_buckets", &plan_buckets, py::arg("numels"), py::arg("itemsizes"),
        py::arg("bucket_bytes"), py::arg("solo_bytes") = 0,
        "Weight-sync bucket layout of tensors with int64 numels [N] and itemsizes [N] "
        "(bytes) in buckets of bucket_bytes (a positive multiple of 256). Returns (chunks "
        "int64 [C, 5] rows (tensor, bucket, offset, start, numel), bucket_sizes int64 [B]).");
  m.def("bucket_copy", &bucket_copy, py::arg("copies"), py::arg("num_threads"),
        "CPU copies of an int64 [C, 5] array of rows (src_ptr, dst_ptr, count, src_dtype, "
        "dst_dtype) with BUCKET_DTYPE_CODES (count in elements, bytes for 'bytes'), casting "
        "between the float codes; split over num_threads threads, GIL released. Raw host "
        "addresses; the caller checks sizes and devices.");
#ifdef AREAL_FAST_WITH_CUDA
  m.def("bucket_copy_cuda", &bucket_copy_cuda, py::arg("copies"), py::arg("stream"),
        "The copies of bucket_copy on raw device pointers of the current device, in one "
        "kernel launch (per 800 copies) on the cudaStream_t `stream`; does not synchronise.");
#endif
  m.def("build_info", &build_info, "How this extension was built (version, compiler, CUDA).");
}
