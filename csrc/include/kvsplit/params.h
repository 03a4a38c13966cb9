// What one merge call needs, as raw pointers, sizes and strides, with the
// problem it solves (head dim, dtypes, stats format). Shared by the CUDA
// launchers, the CPU implementation and the binding; knows nothing of Python
// or tensors.
#pragma once

#include <cstdint>

#include "kvsplit/config.h"

namespace kvsplit {

struct MergeParams {
  const void* partial_o = nullptr;       // (num_splits, rows, head_dim), unit stride on head_dim
  const float* stats = nullptr;          // maxsum: (num_splits, rows, 2); lse: (num_splits, rows)
  const int32_t* split_counts = nullptr; // (rows,) or null: every row has num_splits partials
  const float* sinks = nullptr;          // (heads,) natural-log logits, or null
  void* out = nullptr;                   // (rows, head_dim), unit stride on head_dim
  float* out_stats = nullptr;            // maxsum: (rows, 2); lse: (rows,); or null

  int32_t head_dim = 0;
  DType partial_dtype = DType::kBFloat16;
  DType out_dtype = DType::kBFloat16;
  StatsFormat stats_format = StatsFormat::kMaxSum;

  int64_t num_splits = 0;
  int64_t rows = 0;
  int64_t heads = 1;               // sink of row r is sinks[r % heads]
  int64_t o_stride_split = 0;      // in elements
  int64_t o_stride_row = 0;
  int64_t stats_stride_split = 0;  // in floats
  int64_t stats_stride_row = 0;
  int64_t out_stride_row = 0;      // in elements

  // Multiplies a stat into the base-2 domain of merge_math.h:
  // maxsum: scale_log2; lse: 1 (base 2) or log2(e) (base e).
  float log2_scale = 1.f;
  // Multiplies a base-2 result back into the exported unit:
  // maxsum: ln 2 (the max is exported as scale_log2 * M / log2 e);
  // lse: 1 (base 2) or ln 2 (base e).
  float export_scale = 1.f;
};

// The problem's own rules (the config's are check_config's).
KVSPLIT_HOST_DEVICE constexpr Status check_problem(const MergeParams& p) {
  if (!HeadDims::contains(p.head_dim)) return fail(Error::kHeadDim, p.head_dim);
  if (!dtype_pair_compiled(p.partial_dtype, p.out_dtype)) {
    return fail(Error::kDtypes, static_cast<int>(p.partial_dtype) * 4 + static_cast<int>(p.out_dtype));
  }
  if (p.stats_format != StatsFormat::kMaxSum && p.stats_format != StatsFormat::kLse) {
    return fail(Error::kStatsFormat, static_cast<int>(p.stats_format));
  }
  return Status{};
}

// Where and how a CUDA merge launches.
struct CudaTarget {
  int32_t device = 0;    // the tensors' device: the launch runs there, whatever is current
  int32_t sm_count = 1;  // bounds the KvSplit grid
  bool pdl = false;      // programmatic dependent launch
  void* stream = nullptr;  // a cudaStream_t of `device`
};

}  // namespace kvsplit
