// What one merge call needs, as raw pointers, sizes and strides, with the
// problem it solves (head dim, dtypes, stats format). Shared by the CUDA
// launchers, the CPU implementation and the binding; knows nothing of Python
// or tensors.
#pragma once

#include <cstdint>

#include "kvsplit/dsplit_geometry.h"

#include "kvsplit/config.h"

namespace kvsplit {

// Where row r of a call lives. Rows are (batch, token, head) with heads
// fastest: r = (batch * seqlen + token) * heads + head. A (num_splits, rows,
// D) call is one token per batch (seqlen 1) with heads = the sinks' count or 1;
// an engine's (tokens, heads) or (batch, seqlen, heads) layout is a view with
// its own strides, so no caller has to copy into a split-major buffer.
struct RowIndex {
  int64_t batch = 0;
  int64_t token = 0;
  int64_t head = 0;
};

// Strides of one tensor over (batch, token, head), in its own elements.
struct RowStrides {
  int64_t batch = 0;
  int64_t token = 0;
  int64_t head = 0;
  KVSPLIT_HOST_DEVICE constexpr int64_t at(const RowIndex& i) const {
    return i.batch * batch + i.token * token + i.head * head;
  }
};

// Fields in the order the kernels first read them. A kernel reads its
// parameters from the constant bank, and a launch's first reads of it miss:
// the fewer and closer the fields that its first loads wait for, the sooner
// they issue (fields spread over a larger block cost the Few kernel 0.3 us a
// launch: design.md). The plain kernels' loads wait for the fields up to
// empty_stat, their epilogue reads those up to seqlen, the general kernels'
// row options follow, and the rest is read only by the calls that use it.
struct MergeParams {
  const void* partial_o = nullptr;       // (num_splits, rows..., head_dim), unit stride on head_dim
  const float* stats = nullptr;          // maxsum: (num_splits, rows..., 2); lse: (num_splits, rows...)
  // FP8 outputs: out = fp8(clamp(value / scale)) with the scale *out_scale
  // (per tensor), or per group of quant_group head-dim elements (below).
  // Null: no scale (1).
  const float* out_scale = nullptr;
  int64_t o_stride_split = 0;            // in elements
  int64_t stats_stride_split = 0;        // in floats
  RowStrides o_row;
  RowStrides stats_row;
  int64_t num_splits = 0;
  int64_t rows = 0;
  int32_t head_dim = 0;
  // Multiplies a stat into the base-2 domain of merge_math.h:
  // maxsum: scale_log2; lse: 1 (base 2) or log2(e) (base e).
  float log2_scale = 1.f;
  // A raw stat (max or lse) equal to this reads as an empty split: +inf for
  // vLLM (FlashAttention 2 writes +inf for an empty sequence). NaN: none,
  // since NaN equals nothing.
  float empty_stat = __builtin_nanf("");
  // Multiplies a base-2 result back into the exported unit:
  // maxsum: ln 2 (the max is exported as scale_log2 * M / log2 e);
  // lse: 1 (base 2) or ln 2 (base e).
  float export_scale = 1.f;
  void* out = nullptr;                   // (rows..., head_dim), unit stride on head_dim
  float* out_stats = nullptr;            // maxsum: (rows..., 2); lse: (rows...); or null
  RowStrides out_row;                    // in elements
  RowStrides out_stats_row;              // in floats (a maxsum pair is two adjacent floats)
  const float* sinks = nullptr;          // (heads,) natural-log logits, or null
  DType partial_dtype = DType::kBFloat16;
  DType out_dtype = DType::kBFloat16;
  StatsFormat stats_format = StatsFormat::kMaxSum;
  // Set by the launchers (flatten_rows), never by callers: in every tensor row r
  // starts at r * stride, each RowStrides holds {0, 0, stride}, and rows are
  // addressed by their index alone (locate_row), with no (batch, token, head)
  // division on the way to the first load.
  bool flat_rows = false;
  // out_stats is split 0's stats (an in-place merge): every read of a row's
  // stats must be done before its export, so the kernels add a barrier and
  // a row must not span CTAs (DSplit slices 1).
  bool stats_in_place = false;
  bool indptr_int64 = false;
  // LSE stats held as (max, sum) pairs of normalised partials (TensorRT-LLM):
  // a state's LSE is max + ln(sum), read from the pair; a merged row exports
  // (LSE, 1), a pass-through row its pair as it is. Few family only.
  bool pair_stats = false;
  int64_t heads = 1;               // sink of a row is sinks[head]
  int64_t seqlen = 1;              // tokens per batch

  const int32_t* split_counts = nullptr; // (rows,) row-major, or null: every row has num_splits partials
  // (batch * seqlen + token) * row_mask_stride -> 0: the row is neither read
  // nor written (FlashInfer's merge_state_in_place mask); null: every row.
  const uint8_t* row_mask = nullptr;
  int64_t row_mask_stride = 1;
  // Variable-length states: the splits of the row at (batch * seqlen + token)
  // = t are indptr[t] .. indptr[t + 1] - 1 (read on the device), addressed
  // from split 0 with o_stride_split / stats_stride_split; null: 0 .. num_splits - 1.
  // int32, or int64 with indptr_int64.
  const void* indptr = nullptr;
  // Rows whose (batch * seqlen + token) is at least this take split
  // pass_through_split alone (vLLM's prefill_tokens_with_context): output and
  // stats as they are. The default: every row merges.
  int64_t pass_through_tokens = INT64_MAX;
  int32_t pass_through_split = 0;

  // Per-group FP8 scales: the kernel takes scale = max(amax, eps) / fp8 max
  // of each group of quant_group head-dim elements (QuantGroups; rounded up
  // to a power of two with ue8m0) and writes it to group_scales (float32, or
  // one ue8m0 byte), whose strides over (batch, token, head) and from one
  // group to the next (in scales) follow. Null: none.
  int32_t quant_group = 0;
  void* group_scales = nullptr;
  RowStrides group_scales_row;
  int64_t group_scales_stride = 1;
  DType group_scales_dtype = DType::kFloat32;
  bool scale_ue8m0 = false;
  // Per-request ops (TensorRT-LLM's chunked MLA merge): request r owns the
  // tokens (batch * seqlen + token) request_starts[r] .. request_starts[r + 1]
  // - 1 (int64, num_requests + 1 of them, read on the device), and
  // request_ops[r] (int64) says what its rows take: 0 nothing (left as they
  // are), 2 split 1 as it is (a pass-through row), anything else the merge.
  // Tokens outside every request are left as they are. Null: every row merges.
  const int64_t* request_starts = nullptr;
  const int64_t* request_ops = nullptr;
  int64_t num_requests = 0;
};

// Splits a row index into (batch, token, head); 32-bit division when it fits
// (a 64-bit one is a long software sequence on the GPU).
KVSPLIT_HOST_DEVICE inline RowIndex split_row(const MergeParams& p, int64_t row) {
  RowIndex i;
  if (p.rows <= 0xffffffffll) {
    const auto r = static_cast<uint32_t>(row);
    const auto heads = static_cast<uint32_t>(p.heads);
    const auto seqlen = static_cast<uint32_t>(p.seqlen);
    const uint32_t token_major = r / heads;
    i.head = r - token_major * heads;
    i.batch = token_major / seqlen;
    i.token = token_major - static_cast<uint32_t>(i.batch) * seqlen;
  } else {
    const int64_t token_major = row / p.heads;
    i.head = row - token_major * p.heads;
    i.batch = token_major / p.seqlen;
    i.token = token_major - i.batch * p.seqlen;
  }
  return i;
}

// The stride that puts row r at r * stride of a tensor whose rows have strides
// `s` over (batch, token, head), or -1 where no single stride does.
KVSPLIT_HOST_DEVICE constexpr int64_t flat_stride(const RowStrides& s, int64_t batches,
                                                  int64_t seqlen, int64_t heads) {
  const int64_t stride = heads > 1 ? s.head : seqlen > 1 ? s.token : s.batch;
  const bool even = (seqlen == 1 || s.token == heads * stride) &&
                    (batches <= 1 || s.batch == seqlen * heads * stride);
  return even ? stride : -1;
}

// Sets flat_rows, and rewrites the row strides to match, when one stride per
// tensor addresses every row (split-major buffers, and most engine layouts).
KVSPLIT_HOST_DEVICE inline void flatten_rows(MergeParams& p) {
  if (p.flat_rows || p.heads < 1 || p.seqlen < 1) return;
  const int64_t batches = p.rows / (p.seqlen * p.heads);
  const int64_t o = flat_stride(p.o_row, batches, p.seqlen, p.heads);
  const int64_t stats = flat_stride(p.stats_row, batches, p.seqlen, p.heads);
  const int64_t out = flat_stride(p.out_row, batches, p.seqlen, p.heads);
  const int64_t out_stats =
      p.out_stats == nullptr ? 0 : flat_stride(p.out_stats_row, batches, p.seqlen, p.heads);
  const int64_t scales = p.group_scales == nullptr
                             ? 0
                             : flat_stride(p.group_scales_row, batches, p.seqlen, p.heads);
  if (o < 0 || stats < 0 || out < 0 || out_stats < 0 || scales < 0) return;
  p.o_row = RowStrides{0, 0, o};
  p.stats_row = RowStrides{0, 0, stats};
  p.out_row = RowStrides{0, 0, out};
  p.out_stats_row = RowStrides{0, 0, out_stats};
  p.group_scales_row = RowStrides{0, 0, scales};
  p.flat_rows = true;
}

// Where row `row` lives: its (batch, token, head), or {0, 0, row} for flat rows.
KVSPLIT_HOST_DEVICE inline RowIndex locate_row(const MergeParams& p, int64_t row) {
  if (!p.flat_rows) return split_row(p, row);
  RowIndex i;
  i.head = row;
  return i;
}

// The row's head (its sink's index) and its (batch, token) position (its mask's).
KVSPLIT_HOST_DEVICE inline int64_t row_head(const MergeParams& p, const RowIndex& i) {
  return p.flat_rows ? split_row(p, i.head).head : i.head;
}
KVSPLIT_HOST_DEVICE inline int64_t row_token_major(const MergeParams& p, const RowIndex& i) {
  if (!p.flat_rows) return i.batch * p.seqlen + i.token;
  const RowIndex split = split_row(p, i.head);
  return split.batch * p.seqlen + split.token;
}

// Whether the row is merged at all (see row_mask).
KVSPLIT_HOST_DEVICE inline bool row_selected(const MergeParams& p, const RowIndex& i) {
  return p.row_mask == nullptr || p.row_mask[row_token_major(p, i) * p.row_mask_stride] != 0;
}

// The problem's own rules (the config's are check_config's).
KVSPLIT_HOST_DEVICE constexpr Status check_problem(const MergeParams& p) {
  if (!head_dim_supported(p.head_dim, elem_bytes(p.partial_dtype))) {
    return fail(Error::kHeadDim, p.head_dim);
  }
  if (!dtype_pair_supported(p.partial_dtype, p.out_dtype)) {
    return fail(Error::kDtypes, static_cast<int>(p.partial_dtype) * 8 + static_cast<int>(p.out_dtype));
  }
  if (p.group_scales != nullptr) {
    if (!is_fp8(p.out_dtype) || !QuantGroups::contains(p.quant_group) ||
        p.head_dim % p.quant_group != 0 ||
        (p.group_scales_dtype != DType::kFloat32 && p.group_scales_dtype != DType::kFloat8E8M0FNU)) {
      return fail(Error::kQuantGroup, p.quant_group);
    }
  }
  if (p.pass_through_tokens != INT64_MAX &&
      (p.pass_through_split < 0 || p.pass_through_split >= p.num_splits)) {
    return fail(Error::kSplitRange, p.pass_through_split);
  }
  if (p.indptr != nullptr && p.split_counts != nullptr) return fail(Error::kSplitRange, 0);
  // Per-request ops merge two splits or take split 1, alone among the split options.
  if (p.request_starts != nullptr &&
      (p.request_ops == nullptr || p.num_splits != 2 || p.indptr != nullptr ||
       p.split_counts != nullptr || p.pass_through_tokens != INT64_MAX)) {
    return fail(Error::kSplitRange, p.num_splits);
  }
  if (p.stats_format != StatsFormat::kMaxSum && p.stats_format != StatsFormat::kLse) {
    return fail(Error::kStatsFormat, static_cast<int>(p.stats_format));
  }
  return Status{};
}

// The rules a call adds to its config's, from the call's facts alone
// (`quant_group` 0: no per-group FP8 scales), so that the dispatcher can
// mend a config before any launch. An in-place stats export needs each row's
// reads done before its export: a DSplit row in one CTA (slices 1), a Few
// row's threads in one warp (L dividing 32). Per-group FP8 scales are
// reduced by shuffles over the lanes of one group: a DSplit slice must hold
// whole groups, and a Few step of a row (L threads) must too.
KVSPLIT_HOST_DEVICE constexpr Status check_call_rules(const KernelConfig& config, int head_dim,
                                                      int elem_bytes, bool stats_in_place,
                                                      int quant_group) {
  if (config.family == Family::kDSplit && config.slices != 1) {
    if (stats_in_place) return fail(Error::kSlices, config.slices);
    if (quant_group > 0 && dsplit_slice_vectors(head_dim, elem_bytes, config.slices) *
                                   kDsplitLaneBytes / elem_bytes % quant_group != 0) {
      return fail(Error::kSlices, config.slices);
    }
  }
  if (config.family == Family::kFew) {
    const int lanes = few_threads_per_row(head_dim, elem_bytes, config.vectors);
    const int group_lanes = quant_group * elem_bytes / kFewVectorBytes;
    if (stats_in_place && (lanes < 1 || lanes > 32 || 32 % lanes != 0)) {
      return fail(Error::kVectors, config.vectors);
    }
    if (quant_group > 0 && (group_lanes < 1 || lanes < 1 || lanes % group_lanes != 0)) {
      return fail(Error::kVectors, config.vectors);
    }
  }
  return Status{};
}

KVSPLIT_HOST_DEVICE constexpr Status check_call(const MergeParams& p, const KernelConfig& config) {
  // Per-request ops and pair stats are the general Few kernel's alone.
  if ((p.request_starts != nullptr || p.pair_stats) && config.family != Family::kFew) {
    return fail(Error::kFamily, static_cast<int>(config.family));
  }
  if (p.pair_stats && p.stats_format != StatsFormat::kLse) {
    return fail(Error::kStatsFormat, static_cast<int>(p.stats_format));
  }
  return check_call_rules(config, p.head_dim, elem_bytes(p.partial_dtype), p.stats_in_place,
                          p.group_scales != nullptr ? p.quant_group : 0);
}

// The splits of a row: `begin` and how many. Split counts clamp the count;
// indptr gives both; a pass-through row takes its one split as it is: its
// output unweighted (maxsum: divided by its sum) whatever its stat, no sink,
// and its stats exported as they are (an LSE raw, +inf included; a maxsum
// max in the exported unit).
struct SplitRange {
  int64_t begin;
  int count;
  bool pass = false;  // a pass-through row: split `begin` as it is
};
// `token`: the row's (batch * seqlen + token), row_token_major's.
KVSPLIT_HOST_DEVICE inline SplitRange row_splits_of_token(const MergeParams& p, int64_t token,
                                                          int64_t row) {
  SplitRange range{0, static_cast<int>(p.num_splits)};
  if (p.split_counts != nullptr) {
    const int32_t count = p.split_counts[row];
    range.count = count < 0 ? 0 : count < range.count ? count : range.count;
  }
  if (p.indptr != nullptr || p.pass_through_tokens != INT64_MAX) {
    if (token >= p.pass_through_tokens) return SplitRange{p.pass_through_split, 1, true};
    if (p.indptr != nullptr) {
      const int64_t begin = p.indptr_int64 ? static_cast<const int64_t*>(p.indptr)[token]
                                           : static_cast<const int32_t*>(p.indptr)[token];
      const int64_t end = p.indptr_int64 ? static_cast<const int64_t*>(p.indptr)[token + 1]
                                         : static_cast<const int32_t*>(p.indptr)[token + 1];
      // Clamped into the states (validation checks indptr, except in a CUDA-graph
      // capture, where reading it on the host is not possible).
      const int64_t first = begin < 0 ? 0 : begin < p.num_splits ? begin : p.num_splits;
      const int64_t past = end < first ? first : end < p.num_splits ? end : p.num_splits;
      range = SplitRange{first, static_cast<int>(past - first)};
    }
  }
  return range;
}
KVSPLIT_HOST_DEVICE inline SplitRange row_splits(const MergeParams& p, const RowIndex& at,
                                                 int64_t row) {
  return row_splits_of_token(
      p, p.indptr != nullptr || p.pass_through_tokens != INT64_MAX ? row_token_major(p, at) : 0,
      row);
}

// What a row of a call with per-request ops takes (request_starts): its
// request's op, found by bisection, or 0 for a token outside every request.
KVSPLIT_HOST_DEVICE inline int64_t request_op(const MergeParams& p, int64_t token) {
  const int64_t* starts = p.request_starts;
  if (p.num_requests < 1 || token < starts[0] || token >= starts[p.num_requests]) return 0;
  int64_t low = 0, high = p.num_requests;  // starts[low] <= token < starts[high]
  while (high - low > 1) {
    const int64_t mid = low + (high - low) / 2;
    if (starts[mid] <= token) {
      low = mid;
    } else {
      high = mid;
    }
  }
  return p.request_ops[low];
}

// A row's splits under its request's op (request_op), or false: the row is
// left as it is. Op 2 takes split 1 as it is.
KVSPLIT_HOST_DEVICE inline bool request_splits(const MergeParams& p, int64_t token,
                                               SplitRange& range) {
  const int64_t op = request_op(p, token);
  if (op == 0) return false;
  if (op == 2) range = SplitRange{1, 1, true};
  return true;
}

// Where and how a CUDA merge launches.
struct CudaTarget {
  int32_t device = 0;    // the tensors' device: the launch runs there, whatever is current
  int32_t sm_count = 1;  // bounds the KvSplit grid
  bool pdl = false;      // programmatic dependent launch
  void* stream = nullptr;  // a cudaStream_t of `device`
  int64_t l2_bytes = 0;  // the device's L2 cache (0: unknown), see few_lean_head_major
};

}  // namespace kvsplit
