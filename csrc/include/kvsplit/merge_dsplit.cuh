// The DSplit merge kernel: a row's head dim split across `slices` CTAs.
//
// The KvSplit kernel gives a whole row to every group, so at decode shapes
// (tens of rows) it keeps few SMs busy and each group walks many partials in
// dependent rounds. Here one item, a slice of one row, is D / slices
// elements, read by a group of `lanes` threads (16 bytes each, 4..32 lanes,
// so a group never spans warps). An item holds `kv_split` such groups, each
// merging partials g, g + K, g + 2K, ... with loops of the exact trip count:
// a group of `count` partials loads them in rounds of up to kDepth (4, 8 or 16),
// the remainder first, so it waits on ceil(count / kDepth) round trips and
// never loads a padded slot. Groups are combined with warp shuffles first;
// across warps, every warp parks its total in shared memory and warp 0 folds
// them with all 32 lanes, then shuffles again. Every item reads its row's
// stats itself. An item of one warp needs no shared memory and no barrier,
// so a CTA runs 4 of them side by side, one per warp, or 8 in calls of 1024
// such items or more (dsplit_geometry.h).
//
// Geometry is a runtime argument (all powers of two), so one kernel per
// (dtypes, stats format, depth) serves every (slices, kv_split): the tuner's
// search costs few instantiations.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <type_traits>

#include "kvsplit/device_common.cuh"
#include "kvsplit/dispatch.h"
#include "kvsplit/dsplit_geometry.h"
#include "kvsplit/merge_math.h"
#include "kvsplit/params.h"

namespace kvsplit {

// Registers. Bounded by 512 threads alone, ptxas keeps every DSplit kernel
// to 64 registers a thread, and the deep kernels then issue a round's loads a
// few at a time between the math of the earlier ones. With a minimum of one
// CTA per SM (up to 128 registers) they issue a whole round back to back.
// Plain kernels from KVSPLIT_DSPLIT_ROOMY_DEPTH deep get that minimum; the
// 4-deep one keeps none, so that large calls still fit in one wave.
// The general (not plain) kernel gets it at every depth: its row lookups
// (masks, split counts, indptr, pass-through rows) spill at 64 registers.
template <int kDepth, bool kPlain>
inline constexpr int kDsplitMinCtas = kDepth >= KVSPLIT_DSPLIT_ROOMY_DEPTH || !kPlain ? 1 : 0;

// Loads kDepth partials (all loads issued before the first use) and folds them in.
// kRawStats: no stat is the empty-split sentinel (dsplit_plain checks), so the
// stats go into the merge as loaded.
template <int kDepth, DType kPartial, StatsFormat kFormat, bool kRawStats, int kVec,
          typename Index>
__device__ __forceinline__ void merge_exact_batch(MergeState<kVec>& state,
                                                  const typename CudaType<kPartial>::type* o,
                                                  const float* s, Index o_step, Index s_step,
                                                  float log2_scale, float empty_stat) {
  Packed<kDsplitLaneBytes> packed[kDepth];
  float m_in[kDepth], l_in[kDepth];
#pragma unroll
  for (int u = 0; u < kDepth; ++u) {
    packed[u] = load_packed<kDsplitLaneBytes>(o + u * o_step);
    const float m_raw = __ldg(s + u * s_step);
    if constexpr (kRawStats) {
      m_in[u] = m_raw;
    } else {
      m_in[u] = m_raw != empty_stat ? m_raw : neg_inf();
    }
    l_in[u] = kFormat == StatsFormat::kMaxSum ? __ldg(s + u * s_step + 1) : 1.f;
  }
  state.merge_batch(m_in, l_in, [&](int j, int v) { return unpack<kPartial>(packed[j], v); },
                    log2_scale);
}

template <int kVec>
__device__ __forceinline__ void combine_shuffled(MergeState<kVec>& state, int offset,
                                                 float log2_scale) {
  float acc_other[kVec];
  const float m_other = __shfl_xor_sync(0xffffffffu, state.m, offset);
  const float l_other = __shfl_xor_sync(0xffffffffu, state.l, offset);
#pragma unroll
  for (int v = 0; v < kVec; ++v) acc_other[v] = __shfl_xor_sync(0xffffffffu, state.acc[v], offset);
  state.combine(m_other, l_other, acc_other, 1, log2_scale);
}

// The first round of a group: its `first` (1..kDepth) partials, one template
// case each so that every load is issued before the first use.
template <int kDepth, DType kPartial, StatsFormat kFormat, bool kRawStats, int kVec,
          typename Index>
__device__ __forceinline__ void merge_first_round(MergeState<kVec>& state, int first,
                                                  const typename CudaType<kPartial>::type* o,
                                                  const float* s, Index o_step, Index s_step,
                                                  float log2_scale, float empty_stat) {
  KVSPLIT_DISPATCH_FIRST_ROUND(first, kDepth, kCount, {
    merge_exact_batch<kCount, kPartial, kFormat, kRawStats>(state, o, s, o_step, s_step,
                                                            log2_scale, empty_stat);
  })
}

template <int kVec>
__device__ __forceinline__ void park(float* parked, int stride, int slot,
                                     const MergeState<kVec>& state) {
  parked[slot] = state.m;
  parked[stride + slot] = state.l;
#pragma unroll
  for (int v = 0; v < kVec; ++v) parked[(2 + v) * stride + slot] = state.acc[v];
}

// kPlain: flat rows, no row mask, no split counts, no empty-split sentinel, a
// positive scale and element offsets of 32 bits (dsplit_plain checks), so
// nothing stands between the row index and the first load, a load's address is
// one multiply-add and a stat goes into the merge as loaded.
// kLean (plain calls only): no sinks and an output of dtype kOut, so the
// epilogue is store_lean's alone (launch_dsplit_typed decides).
template <DType kPartial, StatsFormat kFormat, int kDepth, bool kPlain, bool kLean,
          DType kOut = kPartial>
__global__ void __launch_bounds__(kDsplitMaxThreads, kDsplitMinCtas<kDepth, kPlain>)
    dsplit_kernel(const DsplitGeometry geo, const MergeParams p) {
  constexpr int kVec = kDsplitLaneBytes / elem_bytes<kPartial>();
  using Partial = typename CudaType<kPartial>::type;
  using Index = std::conditional_t<kPlain && KVSPLIT_DSPLIT_INDEX32, int32_t, int64_t>;
  constexpr bool kRaw = kPlain && KVSPLIT_DSPLIT_RAW_STATS;
  // Each warp of a multi-warp item parks its total (m, l, acc) here for warp 0:
  // [2 + kVec][warps][lanes] floats, sized at launch.
  extern __shared__ float parked[];

  const int lanes = geo.lanes();
  const int kv_split = 1 << geo.kv_split_log2;
  const int item_threads = geo.threads();
  const int thread = threadIdx.x & (item_threads - 1);  // within the item
  const int group = thread >> geo.lanes_log2;
  const int lane = thread & (lanes - 1);
  const int warp = thread >> 5;
  const int warps = item_threads >> 5;  // per item; 1 when a CTA runs several items
  const int parked_stride = warps * lanes;
  const int per_cta = 1 << geo.items_per_cta_log2;

  pdl_wait();
  static_assert(kPlain || !kLean, "a lean kernel is a plain one");
  const float out_scale = kLean && !is_fp8(kOut) ? 1.f : load_out_scale(p);
  const auto items = static_cast<Index>(geo.items);
  for (Index item = Index(blockIdx.x) * per_cta + Index(threadIdx.x >> (geo.lanes_log2 +
                                                                         geo.kv_split_log2));
       item < items; item += Index(gridDim.x) * per_cta) {
    const Index row = item >> geo.slices_log2;
    RowIndex at;
    if constexpr (kPlain) {
      at.head = row;
    } else {
      at = locate_row(p, row);
      // The whole item skips this row: every barrier of a multi-warp item stays uniform.
      if (!row_selected(p, at)) continue;
    }
    const int col = static_cast<int>(item & ((1 << geo.slices_log2) - 1)) * geo.slice_elems +
                    lane * kVec;
    // Lanes past the slice's vectors (a row that is not a power of two of
    // them) merge nothing and store nothing.
    const bool holds = lane < geo.slice_vectors && col < p.head_dim;
    SplitRange splits{0, static_cast<int>(p.num_splits)};
    if constexpr (!kPlain) splits = row_splits(p, at, row);
    const int num_splits = splits.count;
    MergeState<kVec> state;
    state.reset();
    const float* pass_stats = nullptr;
    if (!kPlain && splits.pass) {
      if (holds && group == 0) {
        pass_stats = load_pass_through<kVec, kPartial, kFormat>(p, state, at, splits.begin, col);
      }
    } else if (holds && group < num_splits) {
      const int count = ((num_splits - group - 1) >> geo.kv_split_log2) + 1;
      const int first = count - (count - 1) / kDepth * kDepth;  // 1..kDepth
      // Flat rows: row r of a tensor starts at r * its row stride.
      const Index o_row = kPlain ? row * Index(p.o_row.head) : Index(p.o_row.at(at));
      const Index s_row = kPlain ? row * Index(p.stats_row.head) : Index(p.stats_row.at(at));
      const Index first_split = Index(splits.begin) + group;
      const Partial* o = static_cast<const Partial*>(p.partial_o) +
                         (first_split * Index(p.o_stride_split) + o_row + col);
      const float* s = p.stats + (first_split * Index(p.stats_stride_split) + s_row);
      const Index o_step = kv_split * Index(p.o_stride_split);
      const Index s_step = kv_split * Index(p.stats_stride_split);
      merge_first_round<kDepth, kPartial, kFormat, kRaw>(state, first, o, s, o_step, s_step,
                                                         p.log2_scale, p.empty_stat);
      o += first * o_step;
      s += first * s_step;
      for (int done = first; done < count; done += kDepth) {
        merge_exact_batch<kDepth, kPartial, kFormat, kRaw>(state, o, s, o_step, s_step,
                                                           p.log2_scale, p.empty_stat);
        o += kDepth * o_step;
        s += kDepth * s_step;
      }
    }
    // Every load of this item is done: the next kernel may start its prologue.
    pdl_trigger();

    // Groups of one warp: butterfly over the lane bits above the group's own.
    for (int offset = lanes; offset < 32; offset <<= 1) combine_shuffled(state, offset, p.log2_scale);
    if (warps > 1) {
      // Warp w's total goes to slots [w * lanes, (w + 1) * lanes). Lane j of
      // warp 0 then folds the totals of warps j / lanes, j / lanes + 32 / lanes,
      // ... for column j % lanes, and a second butterfly joins the lanes.
      if ((threadIdx.x & 31) < lanes) park(parked, parked_stride, warp * lanes + lane, state);
      __syncthreads();
      if (warp == 0) {
        state.reset();
        for (int slot = threadIdx.x; slot < parked_stride; slot += 32) {
          state.combine(parked[slot], parked[parked_stride + slot],
                        &parked[2 * parked_stride + slot], parked_stride, p.log2_scale);
        }
        for (int offset = lanes; offset < 32; offset <<= 1) combine_shuffled(state, offset, p.log2_scale);
      }
    }

    // An item of one warp has no barrier to order the reads of an in-place
    // row's stats before the export: its warp syncs.
    if (p.stats_in_place) {
      if (warps > 1) __syncthreads();
      else __syncwarp();
    }
    if constexpr (kLean) {
      if (thread < lanes) store_lean<kVec, kOut, kFormat>(p, state, at, col, holds, out_scale);
    } else if (thread < lanes) {
      finalize_and_store<kVec, kFormat>(p, state, at, col, holds,
                                        lanes == 32 ? 0xffffffffu : (1u << lanes) - 1u,
                                        out_scale, pass_stats);
    }
    if (warps > 1 && item + gridDim.x < geo.items) __syncthreads();
  }
}

// Whether a call takes the plain kernel: flat rows, no mask, no split counts,
// no empty-split sentinel (NaN: no stat equals it), a positive scale, and
// every element offset it forms (rows, splits and a round's step past the
// last split) below 2^30.
inline bool dsplit_plain(const MergeParams& p, const DsplitGeometry& geo) {
  if (!p.flat_rows || p.row_mask != nullptr || p.split_counts != nullptr || p.indptr != nullptr ||
      p.pass_through_tokens != INT64_MAX) {
    return false;
  }
  if (KVSPLIT_DSPLIT_RAW_STATS && !(std::isnan(p.empty_stat) && p.log2_scale > 0.f)) return false;
  constexpr int64_t kLimit = int64_t{1} << 30;
  const int64_t splits =
      p.num_splits + int64_t{kDsplitMaxDepth} * (int64_t{1} << geo.kv_split_log2);
  const auto span = [&](int64_t split_stride, int64_t row_stride, int64_t width) {
    return splits * std::llabs(split_stride) + p.rows * std::llabs(row_stride) + width;
  };
  return geo.items < kLimit && span(p.o_stride_split, p.o_row.head, p.head_dim) < kLimit &&
         span(p.stats_stride_split, p.stats_row.head, 2) < kLimit;
}

// Launches a checked DSplit config (check_config) on rows > 0.
template <DType kPartial, StatsFormat kFormat>
Status launch_dsplit_typed(const MergeParams& p, const KernelConfig& config, bool pdl,
                           cudaStream_t stream) {
  constexpr int kVec = kDsplitLaneBytes / elem_bytes<kPartial>();
  const DsplitGeometry geo = make_dsplit_geometry(p.head_dim, elem_bytes<kPartial>(),
                                                  config.slices, config.kv_split, p.rows);
  const int lanes = geo.lanes();
  const int warps = geo.threads() / 32;
  const int per_cta = 1 << geo.items_per_cta_log2;
  const int64_t ctas = (geo.items + per_cta - 1) / per_cta;
  constexpr int64_t kGridCap = int64_t{1} << 30;
  PdlLaunch launch(static_cast<unsigned>(ctas < kGridCap ? ctas : kGridCap),
                   static_cast<unsigned>(geo.threads() * per_cta),
                   warps > 1 ? (2 + kVec) * warps * lanes * sizeof(float) : 0, stream, pdl);
  Status status;
  cudaError_t error = cudaSuccess;
  const bool plain = dsplit_plain(p, geo);
  // A plain call whose rows end in store_lean takes the lean kernel of its output dtype.
  const bool lean = plain && lean_epilogue(p) && has_lean_instance(p.out_dtype);
  KVSPLIT_DISPATCH_DSPLIT_DEPTH(config.depth, kDepth, status, {
    const auto kernel =
        lean    ? lean_instance(p.out_dtype, [&](auto out) {
                    return dsplit_kernel<kPartial, kFormat, kDepth, true, true, decltype(out)::value>;
                  })
        : plain ? dsplit_kernel<kPartial, kFormat, kDepth, true, false>
                : dsplit_kernel<kPartial, kFormat, kDepth, false, false>;
    error = cudaLaunchKernelEx(&launch.config, kernel, geo, p);
  })
  return error != cudaSuccess ? fail(Error::kCuda, error) : status;
}

}  // namespace kvsplit
