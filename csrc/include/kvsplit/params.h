// What one merge call needs, as raw pointers, sizes and strides. Shared by the
// CUDA launcher, the CPU implementation and the binding; knows nothing of
// Python or tensors.
#pragma once

#include <cstdint>

namespace kvsplit {

enum class DType : int { kBFloat16 = 0, kFloat16 = 1, kFloat32 = 2 };

enum class StatsFormat : int {
  kMaxSum = 0,  // float2 (raw max m_i, sum l_i) per split and row; O_i unnormalised
  kLse = 1,     // one log-sum-exp per split and row; O_i normalised
};

struct MergeParams {
  const void* partial_o;       // (num_splits, rows, head_dim), unit stride on head_dim
  const float* stats;          // maxsum: (num_splits, rows, 2); lse: (num_splits, rows)
  const int32_t* split_counts; // (rows,) or null: every row has num_splits partials
  const float* sinks;          // (heads,) natural-log logits, or null
  void* out;                   // (rows, head_dim), unit stride on head_dim
  float* out_stats;            // maxsum: (rows, 2); lse: (rows,); or null

  int64_t num_splits;
  int64_t rows;
  int64_t heads;               // sink of row r is sinks[r % heads]
  int64_t o_stride_split;      // in elements
  int64_t o_stride_row;
  int64_t stats_stride_split;  // in floats
  int64_t stats_stride_row;
  int64_t out_stride_row;      // in elements

  // Multiplies a stat into the base-2 domain of merge_math.h:
  // maxsum: scale_log2; lse: 1 (base 2) or log2(e) (base e).
  float log2_scale;
  // Multiplies a base-2 result back into the exported unit:
  // maxsum: ln 2 (the max is exported as scale_log2 * M / log2 e);
  // lse: 1 (base 2) or ln 2 (base e).
  float export_scale;
};

enum class Family : int {
  kKvSplit = 0,  // merge.cuh: whole rows per group, kv_split groups per CTA
  kDSplit = 1,   // merge_dsplit.cuh: a row's head dim split across `slices` CTAs
};

struct KernelChoice {
  int head_dim;
  DType partial_dtype;
  DType out_dtype;
  StatsFormat stats_format;
  Family family;
  int slices;    // DSplit: CTAs per row (KvSplit: 1)
  int kv_split;  // groups per CTA, each merging every kv_split-th partial
  int depth;     // DSplit: partials loaded per round trip, 4 or 8 (KvSplit: 4)
};

}  // namespace kvsplit
