// Where a small Few launch's time goes: the product kernel (bf16 partials,
// base-2 LSE, bf16 out, one vector a thread) beside lab kernels that each add
// one of its parts to a bare two-state merge. benchmarks/lab/lab_fixed.py
// times them in graph replay at decode sizes. Lab code: nothing here ships.
//
//   bare     small parameters (pointers and sizes by value), <<<>>> launch,
//            the product's loads, math (MergeState) and bf16 store;
//   ex       bare through cudaLaunchKernelEx with the PDL attribute off;
//   pdl      bare with griddepcontrol.wait / launch_dependents in it;
//   bigp     bare reading the same fields from MergeParams + FewGeometry;
//   any      bigp with the product's epilogue: output-dtype switch, FP8
//            scaling, sinks and stats export (each off at run time);
//   general  the product's general kernel (few_kernel), which the lean one
//            (few_lean_kernel) spares these calls;
//   product  launch_few_typed, as the extension launches it.
#include <cuda_bf16.h>

#include "kvsplit/launch.h"
#include "kvsplit/merge_few.cuh"
#include "kvsplit/probe.h"

namespace kvsplit {
namespace {

constexpr int kVec = 8;  // bf16 elements of one 16-byte vector

struct SmallParams {
  const __nv_bfloat16* o;
  const float* s;
  __nv_bfloat16* out;
  int64_t rows;
  int64_t o_split;  // elements from one state to the next
  int64_t s_split;
  FastDivmod lanes;
  int32_t row_vectors;
  float empty_stat;
};

template <bool kPdl>
__device__ __forceinline__ void bare_body(const __nv_bfloat16* o_base, const float* s_base,
                                          __nv_bfloat16* out, int64_t rows, int64_t o_split,
                                          int64_t s_split, const FastDivmod& lanes_div,
                                          float empty_stat) {
  const uint32_t thread = blockIdx.x * blockDim.x + threadIdx.x;
  const uint32_t row = lanes_div.div(thread);
  const int lanes = static_cast<int>(lanes_div.divisor);
  const int lane = static_cast<int>(thread - row * lanes_div.divisor);
  if (kPdl) pdl_wait();
  if (row >= rows) return;
  const int64_t at = int64_t{row} * lanes * kVec + lane * kVec;
  MergeState<kVec> state;
  state.reset();
  bool holds[1] = {true};
  merge_few_round<2, 1, DType::kBFloat16, StatsFormat::kLse>(
      state, o_base + at, s_base + row, 2, o_split, s_split, lanes * kVec, holds, 1.f, empty_stat);
  if (kPdl) pdl_trigger();
  float result[kVec], log2_rel;
  state.finalize(neg_inf(), 1.f, result, log2_rel);
  store_out<kVec, DType::kBFloat16>(out, at, result);
}

template <bool kPdl>
__global__ void __launch_bounds__(256, 1) bare_kernel(const SmallParams p) {
  bare_body<kPdl>(p.o, p.s, p.out, p.rows, p.o_split, p.s_split, p.lanes, p.empty_stat);
}

__global__ void __launch_bounds__(256, 1) bigp_kernel(const MergeParams p, const FewGeometry geo) {
  bare_body<false>(static_cast<const __nv_bfloat16*>(p.partial_o), p.stats,
                   static_cast<__nv_bfloat16*>(p.out), p.rows, p.o_stride_split,
                   p.stats_stride_split, geo.lanes, p.empty_stat);
}

__global__ void __launch_bounds__(256, 1) any_kernel(const MergeParams p, const FewGeometry geo) {
  const uint32_t thread = blockIdx.x * blockDim.x + threadIdx.x;
  const uint32_t row = geo.lanes.div(thread);
  const int lanes = static_cast<int>(geo.lanes.divisor);
  const int lane = static_cast<int>(thread - row * geo.lanes.divisor);
  const float out_scale = load_out_scale(p);
  const bool active = row < p.rows;
  const int64_t o_at = int64_t{row} * p.o_row.head + lane * kVec;
  MergeState<kVec> state;
  state.reset();
  bool holds[1] = {true};
  if (active) {
    merge_few_round<2, 1, DType::kBFloat16, StatsFormat::kLse>(
        state, static_cast<const __nv_bfloat16*>(p.partial_o) + o_at, p.stats + row * p.stats_row.head,
        2, p.o_stride_split, p.stats_stride_split, lanes * kVec, holds, p.log2_scale, p.empty_stat);
  }
  const RowIndex at{0, 0, row};
  const float sink_log2 = p.sinks != nullptr && active ? __ldg(p.sinks + split_row(p, row).head) * kLog2E
                                                       : neg_inf();
  float out[kVec], log2_rel;
  const float total = state.finalize(sink_log2, p.log2_scale, out, log2_rel);
  const int col = lane * kVec;
  if (is_fp8(p.out_dtype)) scale_fp8(p, out, at, col, active, 0xffffffffu, out_scale);
  if (active) store_any(p.out_dtype, p.out, row * p.out_row.head + col, out);
  if (active && lane == 0 && p.out_stats != nullptr) {
    export_stats<StatsFormat::kLse>(p, state, at, total, sink_log2, log2_rel, nullptr);
  }
}

FewGeometry geometry(const MergeParams& p, int sm_count, FewLaunch& shape) {
  const int lanes = few_threads_per_row(p.head_dim, 2, 1);
  shape = make_few_launch(lanes, p.rows, sm_count);
  return FewGeometry{FastDivmod(static_cast<uint32_t>(lanes)), p.head_dim * 2 / kBytesPerThread,
                     shape.rows_per_pass, true, FastDivmod(1)};
}

}  // namespace
}  // namespace kvsplit

using namespace kvsplit;

// variant: 0 bare, 1 ex, 2 pdl, 3 bigp, 4 any, 5 general, 6 product. Split-major
// (N, rows, D) bf16 partials and (N, rows) base-2 LSE, N = 2.
extern "C" int lab_fixed(const MergeParams* params, int variant, int sm_count, void* raw_stream) {
  MergeParams p = *params;
  flatten_rows(p);
  const auto stream = static_cast<cudaStream_t>(raw_stream);
  FewLaunch shape;
  const FewGeometry geo = geometry(p, sm_count, shape);
  const SmallParams small{static_cast<const __nv_bfloat16*>(p.partial_o), p.stats,
                          static_cast<__nv_bfloat16*>(p.out), p.rows, p.o_stride_split,
                          p.stats_stride_split, geo.lanes, geo.row_vectors, p.empty_stat};
  const dim3 grid(static_cast<unsigned>(shape.ctas)), block(shape.cta_threads);
  switch (variant) {
    case 0: bare_kernel<false><<<grid, block, 0, stream>>>(small); break;
    case 1: {
      PdlLaunch launch(grid.x, block.x, 0, stream, false);
      cudaLaunchKernelEx(&launch.config, bare_kernel<false>, small);
      break;
    }
    case 2: bare_kernel<true><<<grid, block, 0, stream>>>(small); break;
    case 3: bigp_kernel<<<grid, block, 0, stream>>>(p, geo); break;
    case 4: any_kernel<<<grid, block, 0, stream>>>(p, geo); break;
    case 5: few_kernel<DType::kBFloat16, StatsFormat::kLse, 2, 1><<<grid, block, 0, stream>>>(p, geo); break;
    default: {
      KernelConfig config;
      config.family = Family::kFew;
      config.vectors = 1;
      const Status status = launch_few_typed<DType::kBFloat16, StatsFormat::kLse>(
          p, config, sm_count, false, stream);
      if (!status.ok()) return static_cast<int>(status.error);
    }
  }
  return static_cast<int>(cudaGetLastError());
}

extern "C" int lab_fixed_read(const void* o, int64_t o_bytes, const void* stats,
                              int64_t stats_bytes, void* out, int64_t out_bytes, void* stream) {
  return static_cast<int>(
      launch_read_probe(o, o_bytes, stats, stats_bytes, out, out_bytes, stream).error);
}

extern "C" int lab_fixed_noop(int grid, void* stream) {
  return static_cast<int>(launch_noop(grid, stream).error);
}
