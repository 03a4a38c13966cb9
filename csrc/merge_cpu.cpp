// The CPU implementation: the same algorithm as the CUDA kernels, one row at a
// time. K groups each merge every K-th partial and are combined in the order
// of the chosen family's kernel (see merge_group and combine_groups), so that
// both families' group merges are tested on machines without a GPU. A
// DSplit slice is a column range of the same element-wise merge, so the whole
// row is computed at once.
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

template <DType kDType>
void store_elem(void* base, int64_t offset, float value) {
  if constexpr (kDType == DType::kBFloat16) {
    static_cast<uint16_t*>(base)[offset] = host::float_to_bfloat16(value);
  } else {
    static_assert(kDType == DType::kFloat16, "outputs are 16-bit");
    static_cast<uint16_t*>(base)[offset] = host::float_to_float16(value);
  }
}

// Folds kDepth partials of one row, starting at `first` and kv_split apart;
// slots at or past `live` are padding (re-read `last`, weight 0).
template <int kDepth, int kHeadDim, DType kPartial>
void merge_batch_at(MergeState<kHeadDim>& state, const MergeParams& p, StatsFormat format,
                    const RowIndex& row, int first, int kv_split, int live, int last) {
  float m_in[kDepth], l_in[kDepth], o_in[kDepth][kHeadDim];
  for (int u = 0; u < kDepth; ++u) {
    const int64_t split = u < live ? first + u * kv_split : last;
    const float* stat = p.stats + split * p.stats_stride_split + p.stats_row.at(row);
    l_in[u] = format == StatsFormat::kMaxSum ? stat[1] : 1.f;
    m_in[u] = u < live && stat[0] != p.empty_stat ? stat[0] * p.log2_scale : neg_inf();
    const int64_t base = split * p.o_stride_split + p.o_row.at(row);
    for (int d = 0; d < kHeadDim; ++d) o_in[u][d] = load_elem<kPartial>(p.partial_o, base + d);
  }
  state.merge_batch(m_in, l_in, [&](int j, int d) { return o_in[j][d]; });
}

// One group's walk over partials group, group + K, ...: the KvSplit kernel's
// padded batches of 4, or the DSplit kernel's exact trip count (the remainder
// of count / depth first, then rounds of depth).
template <int kHeadDim, DType kPartial>
void merge_group(MergeState<kHeadDim>& state, const MergeParams& p, const KernelConfig& config,
                 const RowIndex& row, int group, int num_splits) {
  const int k = config.kv_split;
  const int count = (num_splits - group + k - 1) / k;
  const int last = group + (count - 1) * k;
  const StatsFormat format = p.stats_format;
  if (config.family == Family::kKvSplit) {
    for (int j0 = 0; j0 < count; j0 += kLoadUnroll) {
      merge_batch_at<kLoadUnroll, kHeadDim, kPartial>(state, p, format, row, group + j0 * k, k,
                                                      count - j0, last);
    }
    return;
  }
  const int depth = config.depth;
  const int first = count - (count - 1) / depth * depth;
  KVSPLIT_DISPATCH_FIRST_ROUND(first, kDsplitMaxDepth, kFirst, {
    merge_batch_at<kFirst, kHeadDim, kPartial>(state, p, format, row, group, k, kFirst, last);
  })
  Status status;  // config checked by merge_cpu: the depth is a legal one
  KVSPLIT_DISPATCH_DSPLIT_DEPTH(depth, kDepth, status, {
    for (int done = first; done < count; done += kDepth) {
      merge_batch_at<kDepth, kHeadDim, kPartial>(state, p, format, row, group + done * k, k,
                                                 kDepth, last);
    }
  })
}

// Butterfly (xor) over `width` consecutive states starting at `base`, as warp
// shuffles do it: afterwards every one of them holds the same total.
template <int kHeadDim>
void butterfly(std::vector<MergeState<kHeadDim>>& states, int base, int width) {
  for (int offset = 1; offset < width; offset <<= 1) {
    const std::vector<MergeState<kHeadDim>> before(states.begin() + base,
                                                   states.begin() + base + width);
    for (int i = 0; i < width; ++i) {
      const auto& other = before[i ^ offset];
      states[base + i].combine(other.m, other.l, other.acc, 1);
    }
  }
}

// Folds the groups into groups[0] in the kernel's order. KvSplit: group 0
// adds 1..K-1 in turn. DSplit: a butterfly among the groups of each warp;
// with several warps, position q of warp 0 folds the totals of warps q,
// q + G, ... (G groups per warp) into an empty state, and a butterfly joins
// the positions.
template <int kHeadDim>
void combine_groups(std::vector<MergeState<kHeadDim>>& groups, const KernelConfig& config,
                    int lanes) {
  const int k = config.kv_split;
  if (config.family == Family::kKvSplit) {
    for (int g = 1; g < k; ++g) groups[0].combine(groups[g].m, groups[g].l, groups[g].acc, 1);
    return;
  }
  const int per_warp = std::min(k, 32 / lanes);
  const int warps = k / per_warp;
  for (int w = 0; w < warps; ++w) butterfly(groups, w * per_warp, per_warp);
  if (warps == 1) return;
  std::vector<MergeState<kHeadDim>> positions(per_warp);
  for (int q = 0; q < per_warp; ++q) {
    positions[q].reset();
    for (int w = q; w < warps; w += per_warp) {
      const auto& total = groups[w * per_warp];
      positions[q].combine(total.m, total.l, total.acc, 1);
    }
  }
  butterfly(positions, 0, per_warp);
  groups[0] = positions[0];
}

template <int kHeadDim, DType kPartial, DType kOut>
void merge_rows(const MergeParams& p, const KernelConfig& config, int lanes, int64_t row_begin,
                int64_t row_end) {
  using State = MergeState<kHeadDim>;
  const StatsFormat format = p.stats_format;
  std::vector<State> groups(config.kv_split);

  for (int64_t row = row_begin; row < row_end; ++row) {
    const RowIndex at = locate_row(p, row);
    if (!row_selected(p, at)) continue;
    int num_splits = static_cast<int>(p.num_splits);
    if (p.split_counts != nullptr) num_splits = std::clamp(p.split_counts[row], 0, num_splits);
    for (int group = 0; group < config.kv_split; ++group) {
      groups[group].reset();
      if (group < num_splits) {
        merge_group<kHeadDim, kPartial>(groups[group], p, config, at, group, num_splits);
      }
    }
    combine_groups(groups, config, lanes);
    State& state = groups[0];
    const float sink_log2 = p.sinks != nullptr ? p.sinks[row_head(p, at)] * kLog2E : neg_inf();
    float out[kHeadDim], log2_total;
    const float total = state.finalize(sink_log2, out, log2_total);
    const int64_t out_base = p.out_row.at(at);
    for (int d = 0; d < kHeadDim; ++d) store_elem<kOut>(p.out, out_base + d, out[d]);
    if (p.out_stats != nullptr) {
      float* stats = p.out_stats + p.out_stats_row.at(at);
      if (format == StatsFormat::kMaxSum) {
        stats[0] = state.m * p.export_scale;
        stats[1] = total;
      } else {
        stats[0] = log2_total * p.export_scale;
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
  const int64_t hardware = std::max(1u, std::thread::hardware_concurrency());
  const int64_t workers = std::clamp<int64_t>(work >> 22, 1, std::min(hardware, params.rows));
  KVSPLIT_DISPATCH_HEAD_DIM(params.head_dim, kHeadDim, status, {
    KVSPLIT_DISPATCH_DTYPES(params.partial_dtype, params.out_dtype, kPartial, kOut, status, {
      auto run = [&](int64_t begin, int64_t end) {
        merge_rows<kHeadDim, kPartial, kOut>(params, config, lanes, begin, end);
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
  })
  return status;
}

#if !defined(KVSPLIT_WITH_CUDA)
Status merge_cuda(const MergeParams&, const KernelConfig&, const CudaTarget&) {
  return fail(Error::kDevice, 0);
}
#endif

}  // namespace kvsplit
