// The CPU implementation: the same algorithm as the CUDA kernels, one row at a
// time, one 16-byte vector of it at a time as a kernel thread holds it. K
// groups each merge every K-th partial and are combined in the order of the
// chosen family's kernel (see merge_group and combine_groups), so that every
// family's order of combination is tested on machines without a GPU. A
// DSplit slice is a column range of the same element-wise merge; a Few
// thread's vectors are merged as one group (the weights depend only on the
// stats, so each vector's sums are those of a one-vector thread).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <thread>
#include <vector>

#include "kvsplit/dispatch.h"
#include "kvsplit/dsplit_geometry.h"
#include "kvsplit/host_types.h"
#include "kvsplit/launch.h"
#include "kvsplit/merge_math.h"
#include "kvsplit/out_convert.h"

namespace kvsplit {
namespace {

constexpr int kLoadUnroll = kKvSplitLoadDepth;

template <DType kDType>
float load_elem(const void* base, int64_t offset) {
  if constexpr (kDType == DType::kFloat32) {
    return static_cast<const float*>(base)[offset];
  } else if constexpr (kDType == DType::kBFloat16) {
    return host::bfloat16_to_float(static_cast<const uint16_t*>(base)[offset]);
  } else {
    return host::float16_to_float(static_cast<const uint16_t*>(base)[offset]);
  }
}

// Stores `count` floats as the call's output dtype at element `offset` of `base`.
void store_row(DType out, void* base, int64_t offset, const float* values, int count) {
  for (int d = 0; d < count; ++d) {
    const float value = values[d];
    switch (out) {
      case DType::kBFloat16:
        static_cast<uint16_t*>(base)[offset + d] = host::float_to_bfloat16(value);
        break;
      case DType::kFloat16:
        static_cast<uint16_t*>(base)[offset + d] = host::float_to_float16(value);
        break;
      case DType::kFloat32: static_cast<float*>(base)[offset + d] = value; break;
      default:
        static_cast<uint8_t*>(base)[offset + d] =
            float_to_e4m3(value, out == DType::kFloat8E4M3FNUZ);
        break;
    }
  }
}

// FP8 outputs: each value divided by its scale (the per-tensor one, or its
// group's, which is computed here from the group's amax and written out, as
// the kernels do); the conversion saturates it to the format's range.
void scale_fp8_row(const MergeParams& p, const RowIndex& at, float* row) {
  if (p.group_scales == nullptr) {
    const float inverse = p.out_scale != nullptr ? 1.f / *p.out_scale : 1.f;
    for (int d = 0; d < p.head_dim; ++d) row[d] = fp8_prepare(row[d], inverse);
    return;
  }
  const bool ue8m0 = p.scale_ue8m0 || p.group_scales_dtype == DType::kFloat8E8M0FNU;
  for (int g = 0; g < p.head_dim / p.quant_group; ++g) {
    float* values = row + g * p.quant_group;
    float amax = 0.f;
    for (int d = 0; d < p.quant_group; ++d) amax = max_keep_nan(amax, std::fabs(values[d]));
    const float scale = group_scale(amax, p.out_dtype, ue8m0);
    const int64_t at_scale = p.group_scales_row.at(at) + g * p.group_scales_stride;
    if (p.group_scales_dtype == DType::kFloat32) {
      static_cast<float*>(p.group_scales)[at_scale] = scale;
    } else {
      static_cast<uint8_t*>(p.group_scales)[at_scale] = ue8m0_byte(scale);
    }
    const float inverse = 1.f / scale;
    for (int d = 0; d < p.quant_group; ++d) values[d] = fp8_prepare(values[d], inverse);
  }
}

// Folds kDepth partials of one row's 16-byte vector at `col`, starting at
// split `first` and kv_split apart; slots at or past `live` are padding
// (re-read `last`, weight 0).
template <int kDepth, DType kPartial, int kVec>
void merge_batch_at(MergeState<kVec>& state, const MergeParams& p, StatsFormat format,
                    const RowIndex& row, int col, int64_t first, int kv_split, int live,
                    int64_t last) {
  float m_in[kDepth], l_in[kDepth], o_in[kDepth][kVec];
  for (int u = 0; u < kDepth; ++u) {
    const int64_t split = u < live ? first + u * kv_split : last;
    const float* stat = p.stats + split * p.stats_stride_split + p.stats_row.at(row);
    l_in[u] = format == StatsFormat::kMaxSum ? stat[1] : 1.f;
    m_in[u] = u < live && stat[0] != p.empty_stat ? stat[0] : neg_inf();
    // (max, sum) pairs of normalised partials (MergeParams::pair_stats): LSE = max + ln(sum).
    if (format == StatsFormat::kLse && p.pair_stats && u < live) m_in[u] += std::log(stat[1]);
    const int64_t base = split * p.o_stride_split + p.o_row.at(row) + col;
    for (int d = 0; d < kVec; ++d) o_in[u][d] = load_elem<kPartial>(p.partial_o, base + d);
  }
  state.merge_batch(m_in, l_in, [&](int j, int d) { return o_in[j][d]; }, p.log2_scale);
}

// One group's walk over partials begin + group, begin + group + K, ... of
// one vector: the KvSplit kernel's padded batches of 4, the Few kernel's
// padded rounds of few_depth (K = 1), or the DSplit kernel's exact trip
// count (the remainder of count / depth first, then rounds of depth).
template <DType kPartial, int kVec>
void merge_group(MergeState<kVec>& state, const MergeParams& p, const KernelConfig& config,
                 const RowIndex& row, int col, int group, const SplitRange& splits) {
  const int k = config.kv_split;
  const int count = (splits.count - group + k - 1) / k;
  const int64_t start = splits.begin + group;
  const int64_t last = start + int64_t{count - 1} * k;
  const StatsFormat format = p.stats_format;
  if (config.family == Family::kKvSplit) {
    for (int j0 = 0; j0 < count; j0 += kLoadUnroll) {
      merge_batch_at<kLoadUnroll, kPartial>(state, p, format, row, col, start + int64_t{j0} * k,
                                            k, count - j0, last);
    }
    return;
  }
  Status status;  // config checked by merge_cpu: the depth is a legal one
  if (config.family == Family::kFew) {
    // Rounds of few_depth states, each folded in batches of kFewMathBatch.
    KVSPLIT_DISPATCH_FEW_DEPTH(few_depth(p.num_splits, config.vectors), kDepth, status, {
      constexpr int kBatch = kDepth < kFewMathBatch ? kDepth : kFewMathBatch;
      for (int j0 = 0; j0 < count; j0 += kDepth) {
        for (int b = 0; b < kDepth; b += kBatch) {
          merge_batch_at<kBatch, kPartial>(state, p, format, row, col, start + j0 + b, 1,
                                           count - j0 - b, last);
        }
      }
    })
    return;
  }
  const int depth = config.depth;
  const int first = count - (count - 1) / depth * depth;
  KVSPLIT_DISPATCH_FIRST_ROUND(first, kDsplitMaxDepth, kFirst, {
    merge_batch_at<kFirst, kPartial>(state, p, format, row, col, start, k, kFirst, last);
  })
  KVSPLIT_DISPATCH_DSPLIT_DEPTH(depth, kDepth, status, {
    for (int done = first; done < count; done += kDepth) {
      merge_batch_at<kDepth, kPartial>(state, p, format, row, col, start + int64_t{done} * k, k,
                                       kDepth, last);
    }
  })
}

// Butterfly (xor) over `width` consecutive states starting at `base`, as warp
// shuffles do it: afterwards every one of them holds the same total.
template <int kVec>
void butterfly(std::vector<MergeState<kVec>>& states, int base, int width, float scale) {
  for (int offset = 1; offset < width; offset <<= 1) {
    const std::vector<MergeState<kVec>> before(states.begin() + base,
                                               states.begin() + base + width);
    for (int i = 0; i < width; ++i) {
      const auto& other = before[i ^ offset];
      states[base + i].combine(other.m, other.l, other.acc, 1, scale);
    }
  }
}

// Folds the groups into groups[0] in the kernel's order. KvSplit: group 0
// adds 1..K-1 in turn (a Few row is one group). DSplit: a butterfly among
// the groups of each warp; with several warps, position q of warp 0 folds
// the totals of warps q, q + G, ... (G groups per warp) into an empty state,
// and a butterfly joins the positions.
template <int kVec>
void combine_groups(std::vector<MergeState<kVec>>& groups, const KernelConfig& config,
                    int lanes, float scale) {
  const int k = config.kv_split;
  if (config.family != Family::kDSplit) {
    for (int g = 1; g < k; ++g) groups[0].combine(groups[g].m, groups[g].l, groups[g].acc, 1, scale);
    return;
  }
  const int per_warp = std::min(k, 32 / lanes);
  const int warps = k / per_warp;
  for (int w = 0; w < warps; ++w) butterfly(groups, w * per_warp, per_warp, scale);
  if (warps == 1) return;
  std::vector<MergeState<kVec>> positions(per_warp);
  for (int q = 0; q < per_warp; ++q) {
    positions[q].reset();
    for (int w = q; w < warps; w += per_warp) {
      const auto& total = groups[w * per_warp];
      positions[q].combine(total.m, total.l, total.acc, 1, scale);
    }
  }
  butterfly(positions, 0, per_warp, scale);
  groups[0] = positions[0];
}

// Rows [row_begin, row_end): each 16-byte vector of a row is merged as a
// kernel thread merges it (the weights depend only on the stats, so every
// vector's m and l agree), then the row is stored and its stats exported.
template <DType kPartial>
void merge_rows(const MergeParams& p, const KernelConfig& config, int lanes, int64_t row_begin,
                int64_t row_end) {
  constexpr int kVec = kBytesPerThread / elem_bytes(kPartial);
  using State = MergeState<kVec>;
  const StatsFormat format = p.stats_format;
  std::vector<State> groups(config.kv_split);
  std::vector<float> row_out(p.head_dim);

  for (int64_t row = row_begin; row < row_end; ++row) {
    const RowIndex at = locate_row(p, row);
    if (!row_selected(p, at)) continue;
    SplitRange splits = row_splits(p, at, row);
    if (p.request_starts != nullptr && !request_splits(p, row_token_major(p, at), splits)) continue;
    // A pass-through row: its split as it is, no sink, its raw stats exported.
    const float* pass_stats =
        splits.pass ? p.stats + splits.begin * p.stats_stride_split + p.stats_row.at(at) : nullptr;
    const float sink_log2 = p.sinks != nullptr && !splits.pass
                                ? p.sinks[row_head(p, at)] * kLog2E
                                : neg_inf();
    float total = 0.f, log2_rel = 0.f;
    for (int col = 0; col < p.head_dim; col += kVec) {
      for (int group = 0; group < config.kv_split; ++group) {
        groups[group].reset();
        if (splits.pass) {
          if (group > 0) continue;
          groups[0].set_single(format == StatsFormat::kMaxSum ? pass_stats[1] : 1.f);
          const int64_t base = splits.begin * p.o_stride_split + p.o_row.at(at) + col;
          for (int d = 0; d < kVec; ++d) groups[0].acc[d] = load_elem<kPartial>(p.partial_o, base + d);
        } else if (group < splits.count) {
          merge_group<kPartial>(groups[group], p, config, at, col, group, splits);
        }
      }
      combine_groups(groups, config, lanes, p.log2_scale);
      float out[kVec];
      total = groups[0].finalize(sink_log2, p.log2_scale, out, log2_rel);
      std::copy(out, out + kVec, row_out.begin() + col);
    }
    if (is_fp8(p.out_dtype)) scale_fp8_row(p, at, row_out.data());
    store_row(p.out_dtype, p.out, p.out_row.at(at), row_out.data(), p.head_dim);
    if (p.out_stats != nullptr) {
      float* stats = p.out_stats + p.out_stats_row.at(at);
      if (pass_stats != nullptr) {
        stats[0] = format == StatsFormat::kMaxSum ? pass_stats[0] * (p.log2_scale * p.export_scale)
                                                  : pass_stats[0];
        if (format == StatsFormat::kMaxSum) stats[1] = pass_stats[1];
      } else if (format == StatsFormat::kMaxSum) {
        stats[0] = groups[0].m * (p.log2_scale * p.export_scale);
        stats[1] = total;
      } else {
        stats[0] = groups[0].exported_log2_total(sink_log2, p.log2_scale, log2_rel,
                                                 p.export_scale);
      }
      if (format == StatsFormat::kLse && p.pair_stats) {  // the pair's sum: 1, or as it is
        stats[1] = pass_stats != nullptr ? pass_stats[1] : 1.f;
      }
    }
  }
}

}  // namespace

Status merge_cpu(const MergeParams& call, const KernelConfig& config) {
  MergeParams params = call;
  flatten_rows(params);  // as the CUDA launcher does, so both take the same path
  Status status = check_problem(params);
  if (status.ok()) status = check_config(config, params.head_dim, elem_bytes(params.partial_dtype));
  if (status.ok()) status = check_call(params, config);
  if (!status.ok() || params.rows == 0) return status;
  const int lanes = config.family == Family::kDSplit
                        ? dsplit_lanes(params.head_dim, elem_bytes(params.partial_dtype),
                                       config.slices)
                        : 0;
  // Rows are independent; large calls are spread over the host's cores.
  const int64_t work = params.rows * std::max<int64_t>(params.num_splits, 1) * params.head_dim;
  // hardware_concurrency() reads /sys on every call (microseconds): asked once, and
  // only by calls large enough to spread.
  static const int64_t hardware = std::max(1u, std::thread::hardware_concurrency());
  const int64_t workers =
      work >> 22 ? std::clamp<int64_t>(work >> 22, 1, std::min(hardware, params.rows)) : 1;
  KVSPLIT_DISPATCH_PARTIAL_DTYPE(params.partial_dtype, kPartial, status, {
      auto run = [&](int64_t begin, int64_t end) {
        merge_rows<kPartial>(params, config, lanes, begin, end);
      };
      if (workers <= 1) {
        run(0, params.rows);
      } else {
        std::vector<std::thread> threads;
        const int64_t chunk = (params.rows + workers - 1) / workers;
        for (int64_t begin = 0; begin < params.rows; begin += chunk) {
          threads.emplace_back(run, begin, std::min(params.rows, begin + chunk));
        }
        for (auto& thread : threads) thread.join();
      }
  })
  return status;
}

#if !defined(KVSPLIT_WITH_CUDA)
Status merge_cuda(const MergeParams&, const KernelConfig&, const CudaTarget&) {
  return fail(Error::kDevice, 0);
}
#endif

}  // namespace kvsplit
