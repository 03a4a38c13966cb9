// The KvSplit kernel family: the merge kernel and its typed host launcher.
//
// 512 threads per CTA, each owning 16 bytes of one output row. The threads
// form kKvSplit groups; every group covers the same rows ("a band" of rows)
// and runs the online-softmax merge over partials g, g + K, g + 2K, ...;
// group 0 then folds the other groups' states in through shared memory and
// stores. A larger K means fewer rows per CTA, hence K times more CTAs and K
// times shorter serial chains per thread.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kvsplit/device_common.cuh"
#include "kvsplit/dispatch.h"
#include "kvsplit/knobs.h"
#include "kvsplit/merge_math.h"
#include "kvsplit/params.h"

namespace kvsplit {

constexpr int kThreadsPerCta = kKvSplitThreadsPerCta;
constexpr int kCtasPerSm = kKvSplitCtasPerSm;

constexpr int kLoadUnroll = KVSPLIT_LOAD_UNROLL;

// One band of rows per CTA iteration: each group of 512 / K threads holds
// rows_per_band whole rows of threads_per_row threads (16 bytes each); the
// threads past them idle. The head dim is a runtime value, so one kernel per
// K serves every head dim. kLean: the call's output is in the partials' dtype
// and its rows end in store_lean (lean_epilogue), not finalize_and_store's
// branches for sinks, pass-through rows, FP8 scales and other output dtypes.
template <DType kPartial, StatsFormat kFormat, int kKvSplit, bool kLean>
__global__ void __launch_bounds__(kThreadsPerCta, KVSPLIT_MIN_CTAS)
    merge_kernel(int64_t num_bands, int threads_per_row, int rows_per_band, const MergeParams p) {
  constexpr int kVec = kBytesPerThread / elem_bytes<kPartial>();
  constexpr int kGroupThreads = kThreadsPerCta / kKvSplit;
  // Groups 1..K-1 park (m, l) and acc[kVec] here for group 0; acc is stored
  // vector-element-major so that a warp's stores hit consecutive banks.
  using Partial = typename CudaType<kPartial>::type;
  constexpr int kParked = kKvSplit > 1 ? (kKvSplit - 1) * kGroupThreads : 1;
  __shared__ float parked_ml[2][kParked];
  __shared__ float parked_acc[kKvSplit > 1 ? kVec : 1][kParked];

  const int group = threadIdx.x / kGroupThreads;
  const int lane = threadIdx.x % kGroupThreads;
  const int row_in_band = lane / threads_per_row;
  const int col = (lane - row_in_band * threads_per_row) * kVec;

  pdl_wait();
  const float out_scale = kLean ? 1.f : load_out_scale(p);
  for (int64_t band = blockIdx.x; band < num_bands; band += gridDim.x) {
    const int64_t row = band * rows_per_band + row_in_band;
    const RowIndex at = locate_row(p, row);
    const bool active = row_in_band < rows_per_band && row < p.rows && row_selected(p, at);
    MergeState<kVec> state;
    state.reset();
    SplitRange splits{0, 0};
    if (active) splits = row_splits(p, at, row);
    const int num_splits = splits.count;
    const float* pass_stats = nullptr;
    if (!kLean && splits.pass) {
      if (group == 0) pass_stats = load_pass_through<kVec, kPartial, kFormat>(p, state, at, splits.begin, col);
    } else if (group < num_splits) {
      // Walk partials group, group + K, ... with cursors, kLoadUnroll at a
      // time, keeping them packed (16-bit) in registers until the multiply.
      const int count = (num_splits - group + kKvSplit - 1) / kKvSplit;
      const Partial* o_cursor = static_cast<const Partial*>(p.partial_o) +
                                (splits.begin + group) * p.o_stride_split + p.o_row.at(at) + col;
      const float* s_cursor =
          p.stats + (splits.begin + group) * p.stats_stride_split + p.stats_row.at(at);
      const int64_t o_step = kKvSplit * p.o_stride_split;
      const int64_t s_step = kKvSplit * p.stats_stride_split;

      // A slot past the end re-reads the group's last partial and gets weight
      // 0, so the loads stay unconditional and in bounds. All loads of a batch
      // are issued before the first use.
      auto merge_round = [&](auto tail, int j0) {
        constexpr bool kTail = decltype(tail)::value;
        Packed<kBytesPerThread> packed[kLoadUnroll];
        float m_in[kLoadUnroll], l_in[kLoadUnroll];
        // Slot u of this round: u itself, or the group's last partial once
        // past the end (tail rounds only).
        auto slot = [&](int u) { return !kTail || j0 + u < count ? u : count - 1 - j0; };
        {
          const Partial* o_ptr = o_cursor;
#pragma unroll
          for (int u = 0; u < kLoadUnroll; ++u) {
            if constexpr (kTail) o_ptr = o_cursor + slot(u) * o_step;
            packed[u] = load_packed<kBytesPerThread>(o_ptr);
            if constexpr (!kTail) o_ptr += o_step;
          }
        }
        {
          const float* s_ptr = s_cursor;
#pragma unroll
          for (int u = 0; u < kLoadUnroll; ++u) {
            if constexpr (kTail) s_ptr = s_cursor + slot(u) * s_step;
            // Stats may have any strides, so a (max, sum) pair is two loads.
            const float m_raw = __ldg(s_ptr);
            l_in[u] = kFormat == StatsFormat::kMaxSum ? __ldg(s_ptr + 1) : 1.f;
            m_in[u] = (!kTail || j0 + u < count) && m_raw != p.empty_stat ? m_raw : neg_inf();
            if constexpr (!kTail) s_ptr += s_step;
          }
        }
        state.merge_batch(m_in, l_in, [&](int j, int v) { return unpack<kPartial>(packed[j], v); },
                          p.log2_scale);
        o_cursor += kLoadUnroll * o_step;
        s_cursor += kLoadUnroll * s_step;
      };
      // Full rounds walk plain pointers; only the last round, if partial,
      // pays for the slot clamping (K = 1 ran 1-18 % faster for it).
      int j0 = 0;
      for (; j0 + kLoadUnroll <= count; j0 += kLoadUnroll) merge_round(std::false_type{}, j0);
      if (j0 < count) merge_round(std::true_type{}, j0);
    }
    pdl_trigger();

    if constexpr (kKvSplit > 1) {
      if (group > 0) {
        const int slot = (group - 1) * kGroupThreads + lane;
        parked_ml[0][slot] = state.m;
        parked_ml[1][slot] = state.l;
#pragma unroll
        for (int v = 0; v < kVec; ++v) parked_acc[v][slot] = state.acc[v];
      }
      __syncthreads();
      if (group == 0) {
#pragma unroll
        for (int g = 1; g < kKvSplit; ++g) {
          const int slot = (g - 1) * kGroupThreads + lane;
          state.combine(parked_ml[0][slot], parked_ml[1][slot], &parked_acc[0][slot], kParked,
                        p.log2_scale);
        }
      }
    }

    // With K > 1 the barrier above already orders every read before the export.
    if (kKvSplit == 1 && p.stats_in_place) __syncthreads();
    if (group == 0) {
      if constexpr (kLean) {
        store_lean<kVec, kPartial, kFormat>(p, state, at, col, active, out_scale);
      } else {
        finalize_and_store<kVec, kFormat>(p, state, at, col, active, 0xffffffffu, out_scale,
                                          pass_stats);
      }
    }
    // parked_* is reused by the next band; most small calls have none.
    if (kKvSplit > 1 && band + gridDim.x < num_bands) __syncthreads();
  }
}

template <DType kPartial, StatsFormat kFormat, int kKvSplit>
cudaError_t launch_kvsplit_config(const MergeParams& p, int sm_count, bool pdl, cudaStream_t stream) {
  const int threads_per_row = p.head_dim * elem_bytes(kPartial) / kBytesPerThread;
  const int rows_per_band = kvsplit_rows_per_band(p.head_dim, elem_bytes(kPartial), kKvSplit);
  const int64_t num_bands = (p.rows + rows_per_band - 1) / rows_per_band;
  const int64_t grid_cap = static_cast<int64_t>(kCtasPerSm) * (sm_count > 0 ? sm_count : 1);
  PdlLaunch launch(static_cast<unsigned>(num_bands < grid_cap ? num_bands : grid_cap),
                   kThreadsPerCta, 0, stream, pdl);
  const bool lean = lean_epilogue(p) && p.out_dtype == kPartial;
  return cudaLaunchKernelEx(&launch.config,
                            lean ? merge_kernel<kPartial, kFormat, kKvSplit, true>
                                 : merge_kernel<kPartial, kFormat, kKvSplit, false>,
                            num_bands, threads_per_row, rows_per_band, p);
}

// Launches a checked KvSplit config (check_config) on rows > 0.
template <DType kPartial, StatsFormat kFormat>
Status launch_kvsplit_typed(const MergeParams& p, const KernelConfig& config, int sm_count,
                            bool pdl, cudaStream_t stream) {
  Status status;
  cudaError_t error = cudaSuccess;
  KVSPLIT_DISPATCH_KVSPLIT_KV_SPLIT(config.kv_split, kKvSplit, status, {
    if (kvsplit_rows_per_band(p.head_dim, elem_bytes(kPartial), kKvSplit) >= 1) {
      error = launch_kvsplit_config<kPartial, kFormat, kKvSplit>(p, sm_count, pdl, stream);
    } else {
      status = fail(Error::kGroupHoldsRow, kKvSplit);
    }
  })
  return error != cudaSuccess ? fail(Error::kCuda, error) : status;
}

}  // namespace kvsplit
