// The KvSplit merge kernel and its typed host launcher.
//
// 512 threads per CTA, each owning 16 bytes of one output row. The threads
// form kKvSplit groups; every group covers the same rows ("a slice") and runs
// the online-softmax merge over partials g, g + K, g + 2K, ...; group 0 then
// folds the other groups' states in through shared memory and stores. A
// larger K means fewer rows per CTA, hence K times more CTAs and K times
// shorter serial chains per thread.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kvsplit/device_common.cuh"
#include "kvsplit/dispatch.h"
#include "kvsplit/merge_math.h"
#include "kvsplit/params.h"

namespace kvsplit {

constexpr int kThreadsPerCta = 512;
constexpr int kCtasPerSm = 2;

// Knobs for benchmarks/lab, which compiles variants side by side; the
// defaults are the product. Measured there on an H200 and dropped: a
// one-batch register prefetch (no faster at small shapes; spilled under the
// 64-register cap), one 8-byte load per (max, sum) pair (3-13 % slower at
// K = 1 than two 4-byte loads), clamping padded slots by pointer select
// (more registers, spills at K = 1), issuing the stats loads before the
// partials' (no change), and load hints for the partials (L2::256B prefetch
// with L1::no_allocate: 5-30 % slower at large row counts; evict-first
// streaming loads: no change).
#ifndef KVSPLIT_LOAD_UNROLL
#define KVSPLIT_LOAD_UNROLL 4
#endif
#ifndef KVSPLIT_MIN_CTAS
#define KVSPLIT_MIN_CTAS kCtasPerSm
#endif
constexpr int kLoadUnroll = KVSPLIT_LOAD_UNROLL;

// Whether one group of 512 / K threads, 16 bytes each, holds a whole row.
template <int kHeadDim, DType kPartial, int kKvSplit>
constexpr bool group_holds_row() {
  return (kThreadsPerCta / kKvSplit) * kBytesPerThread >= kHeadDim * elem_bytes<kPartial>();
}

template <int kHeadDim, DType kPartial, DType kOut, StatsFormat kFormat, int kKvSplit>
__global__ void __launch_bounds__(kThreadsPerCta, KVSPLIT_MIN_CTAS)
    merge_kernel(const MergeParams p, int64_t num_slices) {
  constexpr int kVec = kBytesPerThread / elem_bytes<kPartial>();
  constexpr int kGroupThreads = kThreadsPerCta / kKvSplit;
  constexpr int kThreadsPerRow = kHeadDim / kVec;
  constexpr int kRowsPerSlice = kGroupThreads / kThreadsPerRow;
  static_assert(kRowsPerSlice >= 1, "a group must hold a whole row");
  // Groups 1..K-1 park (m, l) and acc[kVec] here for group 0; acc is stored
  // vector-element-major so that a warp's stores hit consecutive banks.
  using Partial = typename CudaType<kPartial>::type;
  constexpr int kParked = kKvSplit > 1 ? (kKvSplit - 1) * kGroupThreads : 1;
  __shared__ float parked_ml[2][kParked];
  __shared__ float parked_acc[kKvSplit > 1 ? kVec : 1][kParked];

  const int group = threadIdx.x / kGroupThreads;
  const int lane = threadIdx.x % kGroupThreads;
  const int row_in_slice = lane / kThreadsPerRow;
  const int col = (lane % kThreadsPerRow) * kVec;

  pdl_wait();
  for (int64_t slice = blockIdx.x; slice < num_slices; slice += gridDim.x) {
    const int64_t row = slice * kRowsPerSlice + row_in_slice;
    const bool active = row < p.rows;
    MergeState<kVec> state;
    state.reset();
    int num_splits = 0;
    if (active) {
      num_splits = static_cast<int>(p.num_splits);
      if (p.split_counts != nullptr) {
        num_splits = min(max(__ldg(p.split_counts + row), 0), num_splits);
      }
    }
    if (group < num_splits) {
      // Walk partials group, group + K, ... with cursors, kLoadUnroll at a
      // time, keeping them packed (16-bit) in registers until the multiply.
      const int count = (num_splits - group + kKvSplit - 1) / kKvSplit;
      const Partial* o_cursor = static_cast<const Partial*>(p.partial_o) +
                                group * p.o_stride_split + row * p.o_stride_row + col;
      const float* s_cursor = p.stats + group * p.stats_stride_split + row * p.stats_stride_row;
      const int64_t o_step = kKvSplit * p.o_stride_split;
      const int64_t s_step = kKvSplit * p.stats_stride_split;

      // A slot past the end re-reads the group's last partial and gets weight
      // 0, so the loads stay unconditional and in bounds. All loads of a batch
      // are issued before the first use.
      auto merge_round = [&](auto tail, int j0) {
        constexpr bool kTail = decltype(tail)::value;
        uint4 packed[kLoadUnroll];
        float m_in[kLoadUnroll], l_in[kLoadUnroll];
        // Slot u of this round: u itself, or the group's last partial once
        // past the end (tail rounds only).
        auto slot = [&](int u) { return !kTail || j0 + u < count ? u : count - 1 - j0; };
        {
          const Partial* o_ptr = o_cursor;
#pragma unroll
          for (int u = 0; u < kLoadUnroll; ++u) {
            if constexpr (kTail) o_ptr = o_cursor + slot(u) * o_step;
            packed[u] = __ldg(reinterpret_cast<const uint4*>(o_ptr));
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
            m_in[u] = !kTail || j0 + u < count ? m_raw * p.log2_scale : neg_inf();
            if constexpr (!kTail) s_ptr += s_step;
          }
        }
        state.merge_batch(m_in, l_in, [&](int j, int v) { return unpack<kPartial>(packed[j], v); });
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
          state.combine(parked_ml[0][slot], parked_ml[1][slot], &parked_acc[0][slot], kParked);
        }
      }
    }

    if (group == 0 && active) finalize_and_store<kVec, kOut, kFormat>(p, state, row, col);
    // parked_* is reused by the next slice; most small calls have none.
    if (kKvSplit > 1 && slice + gridDim.x < num_slices) __syncthreads();
  }
}

template <int kHeadDim, DType kPartial, DType kOut, StatsFormat kFormat, int kKvSplit>
cudaError_t launch_merge_config(const MergeParams& p, int sm_count, bool pdl, cudaStream_t stream) {
  if constexpr (!group_holds_row<kHeadDim, kPartial, kKvSplit>()) {
    throw_unsupported("kv_split (a group of 512/kv_split threads must hold a whole row)", kKvSplit);
  } else {
    constexpr int kVec = kBytesPerThread / elem_bytes<kPartial>();
    constexpr int kRowsPerSlice = (kThreadsPerCta / kKvSplit) / (kHeadDim / kVec);
    if (p.rows == 0) return cudaSuccess;
    const int64_t num_slices = (p.rows + kRowsPerSlice - 1) / kRowsPerSlice;
    const int64_t grid_cap = static_cast<int64_t>(kCtasPerSm) * (sm_count > 0 ? sm_count : 1);
    PdlLaunch launch(static_cast<unsigned>(num_slices < grid_cap ? num_slices : grid_cap),
                     kThreadsPerCta, 0, stream, pdl);
    return cudaLaunchKernelEx(&launch.config,
                              merge_kernel<kHeadDim, kPartial, kOut, kFormat, kKvSplit>, p,
                              num_slices);
  }
}

template <DType kPartial, DType kOut, StatsFormat kFormat>
cudaError_t launch_merge_typed(const MergeParams& p, int head_dim, int kv_split, int sm_count,
                               bool pdl, cudaStream_t stream) {
  cudaError_t status = cudaErrorInvalidValue;
  KVSPLIT_DISPATCH_HEAD_DIM(head_dim, kHeadDim, {
    KVSPLIT_DISPATCH_KV_SPLIT(kv_split, kKvSplit, {
      status = launch_merge_config<kHeadDim, kPartial, kOut, kFormat, kKvSplit>(p, sm_count, pdl,
                                                                               stream);
    })
  })
  return status;
}

}  // namespace kvsplit
