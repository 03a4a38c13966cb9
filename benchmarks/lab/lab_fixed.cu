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
//   product  launch_few_typed, as the extension launches it;
//   hand16 / hand8 / hand4
//            a two-state merge written out by hand (no MergeState, no
//            FastDivmod: rows of a power-of-two lane count), loads of 16, 8
//            or 4 bytes a thread, CTAs as make_few_launch sizes them;
//   row16 / row8
//            the same with one CTA per row (Triton's serial merge's grid:
//            a program per row, its threads the row's lanes);
//   hdiv / h64 / hstate / hfirst
//            hand16 with one part of bare each, to split bare - hand16:
//            the row and lane by FastDivmod, not a shift (hdiv); bare's
//            64-bit offsets (h64); the product's round and MergeState
//            (merge_few_round, merge_batch, finalize: hstate); and hstate
//            without the fresh state's rescale by the empty state's weight
//            (hfirst: the first round written as m = max, acc = sum w x);
//   lean8 / lean6 / lean4
//            the product's lean kernel under launch bounds that ask for 8,
//            6 or 4 CTAs of 256 threads an SM (at most 32, 40 or 64
//            registers; the product asks for 1 and takes 55), launched
//            with <<<>>> on the product's grid.
//   lconst / lnoloop / lfin / lnochk / lexit / lbare
//            the product's lean merge (bf16, base-2 LSE, two states, one
//            vector, bf16 out) with one of its parts made as bare has it,
//            to split product - bare where it grows with the rows: the
//            round's live count a constant (its loads unpredicated:
//            lconst), no loop over further rounds (lnoloop), the general
//            finalize (lfin), no in-place sync, export or vector check
//            (lnochk), threads past the rows leaving before any load
//            (lexit); lbare: all five.
//   l8 / l8row / l16row / lean
//            the product's general lean instance (as launched before the
//            pair instance: `lean`) but for the bytes of a state's row each
//            thread loads (8: twice the threads) and the grid: l8 on
//            make_few_launch's CTAs, l8row and l16row one CTA a row (Triton's
//            grid), for the one-token calls where the serial Triton merge
//            leads;
//   p8 / p8row / p16row
//            the same with the pair instance (what `product` launches);
//   pshift / pflat / pmath / pnoexp / phand
//            the pair instance on the product's parameter block with one
//            part made as hand16 has it (pair_parts_kernel says which; phand:
//            all four), to split product - hand16 at one token;
//   pnopdl   phand without the griddepcontrol (PDL) instructions;
//   hbigp    hand16 behind the pair instance's parameter block, unread (its
//            own parameters past it in the constant bank);
//   htail    hand16 with that block after its own parameters (as many bytes
//            a launch, its own where hand16 has them);
//   hmid     hand16 behind 48 unread bytes (its parameters at the offsets of
//            the second half of what the pair instance's prologue reads);
//   pair     the pair instance on rows addressed by (token, head) strides, as
//            the product launched two packed states before its packed
//            instance (kPacked);
//   packed / pkrow / pk8 / pk8row
//            the packed pair instance (what `product` launches here) on
//            make_few_launch's CTAs or one CTA a row, loading 16 or 8 bytes
//            of a state's row a thread;
//   pkc64 / pkc128 / pkc256 / pk8c128 / pk8c256
//            the packed pair instance on CTAs of 64, 128 or 256 threads
//            (16-byte loads) or 128 or 256 (8-byte loads), as few CTAs as
//            the rows need;
//   pk1l / pk1l0
//            the packed pair's body on a 64-byte parameter block that holds
//            only what it reads: one line of the constant bank (pk1l, behind
//            48 unread bytes) or across two (pk1l0, at the first parameter);
//   hspread / hlate
//            hand16 with its parameters over three constant lines, as the
//            pair instance reads them (hspread), or with only its output
//            pointer, read after the loads, in a line of its own (hlate).
#include <cuda_bf16.h>

#include <type_traits>

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

template <int kMinCtas>
__global__ void __launch_bounds__(256, kMinCtas) lean_bounded_kernel(const FewLeanParams p) {
  few_lean_merge<DType::kBFloat16, StatsFormat::kLse, 2, 1, DType::kBFloat16>(p);
}

// The packed pair's parameter block (as the product launches it), any other
// call's FewLeanParams.
template <bool kPacked>
using LeanParams = std::conditional_t<kPacked, FewPackedParams, FewLeanParams>;

template <int kBytes, bool kPair, bool kPacked = false>
__global__ void __launch_bounds__(256, 1) lean_bytes_kernel(const LeanParams<kPacked> p) {
  few_lean_merge<DType::kBFloat16, StatsFormat::kLse, 2, 1, DType::kBFloat16, kPair, kPacked,
                 kBytes>(p);
}

// log2 of a power of two, or -1 for any other count (the shift-based variants'
// lanes a row).
// A two-state call of `p` as the product's lean kernel takes it at `bytes` a
// thread a state: its parameters `f` (and in `packed`, where given, the
// packed instance's), make_few_launch's `shape` and the heads a token; false
// where the call does not take the pair instance (or `packed`, the packed
// one) or its row needs more than 256 threads.
bool pair_call(const MergeParams& p, int bytes, int sm_count, FewLeanParams& f, FewLaunch& shape,
               uint32_t& heads, FewPackedParams* packed = nullptr) {
  const int lanes = few_threads_per_row(static_cast<int>(p.head_dim), 2, 1, bytes);
  if (lanes < 1 || lanes > 256) return false;
  shape = make_few_launch(lanes, p.rows, sm_count);
  const FewGeometry geo{FastDivmod(static_cast<uint32_t>(lanes)),
                        static_cast<int32_t>(p.head_dim) * 2 / bytes, p.rows, true};
  MergeParams lean;
  heads = 1;
  if (!few_lean_call(p, p.rows * lanes, 2, lean, heads) || !few_pair_call(lean)) return false;
  f = few_lean_params(lean, heads, geo);
  if (packed == nullptr) return true;
  if (!few_packed_call(lean, heads, lanes, f)) return false;
  *packed = few_packed_params(f);
  return true;
}

// The product's lean kernel (`pair`: its pair instance) with kBytes a thread
// a state, on make_few_launch's CTAs or one CTA a row; -1 where the call does
// not take it.
int launch_lean_bytes(const MergeParams& p, int bytes, bool row_grid, bool pair, int sm_count,
                      cudaStream_t stream, bool packed = false, int cta_threads = 0) {
  FewLeanParams f;
  FewPackedParams pk;
  FewLaunch shape;
  uint32_t heads;
  if (!pair_call(p, bytes, sm_count, f, shape, heads, packed ? &pk : nullptr)) return -1;
  unsigned cta = row_grid ? f.lanes.divisor : shape.cta_threads;
  auto ctas = static_cast<unsigned>(row_grid ? p.rows : shape.ctas);
  if (cta_threads > 0) {  // CTAs of this size, as many as the rows' threads need
    cta = static_cast<unsigned>(cta_threads);
    ctas = static_cast<unsigned>((p.rows * f.lanes.divisor + cta - 1) / cta);
  }
  if (packed) {
    (bytes == 16 ? lean_bytes_kernel<16, true, true>
                 : lean_bytes_kernel<8, true, true>)<<<ctas, cta, 0, stream>>>(pk);
    return 0;
  }
  void (*const kernels[])(FewLeanParams) = {lean_bytes_kernel<8, false>, lean_bytes_kernel<16, false>,
                                            lean_bytes_kernel<8, true>, lean_bytes_kernel<16, true>};
  kernels[(bytes == 16 ? 1 : 0) + (pair ? 2 : 0)]<<<ctas, cta, 0, stream>>>(f);
  return 0;
}

// The pair instance (bf16, base-2 LSE, bf16 out) on the product's parameter
// block, each bit of kParts a part made as hand16 has it, to split the pair
// instance - hand16 at one token: 1 the row and lane by a shift (`lanes_log2`;
// lanes a power of two), 2 no token / head division (flat rows: token = row),
// 4 hand16's arithmetic (no empty-stat test, plain max, (w0 x + w1 y) / l
// without MergeState's empty-row selects; without it, merge_few_round's round
// of two live states: the pair instance's operations and the fresh state's
// zero rescale), 8 no stats export, 16 no griddepcontrol (PDL) instructions.
template <int kParts>
__global__ void __launch_bounds__(256, 1) pair_parts_kernel(const FewLeanParams p,
                                                            int lanes_log2) {
  constexpr bool kShift = kParts & 1, kFlat = kParts & 2, kHandMath = kParts & 4;
  constexpr bool kNoExport = kParts & 8, kNoPdl = kParts & 16;
  const uint32_t thread = blockIdx.x * blockDim.x + threadIdx.x;
  const uint32_t row = kShift ? thread >> lanes_log2 : p.lanes.div(thread);
  const int lane = kShift ? static_cast<int>(thread & ((1u << lanes_log2) - 1))
                          : static_cast<int>(thread - row * p.lanes.divisor);
  const auto token = kFlat ? static_cast<int32_t>(row) : static_cast<int32_t>(p.heads.div(row));
  const auto head = kFlat ? 0 : static_cast<int32_t>(row - token * p.heads.divisor);
  if (row >= static_cast<uint32_t>(p.rows)) return;
  if (!kNoPdl) pdl_wait();
  const auto* o = static_cast<const __nv_bfloat16*>(p.partial_o) +
                  (token * p.o_token + head * p.o_head + lane * kVec);
  const float* s = p.stats + (token * p.s_token + head * p.s_head);
  MergeState<kVec> state;
  float out[kVec], log2_rel = 0.f, total = 0.f;
  if constexpr (kHandMath) {
    const auto x = load_packed<kBytesPerThread>(o), y = load_packed<kBytesPerThread>(o + p.o_split);
    const float raw0 = __ldg(s), raw1 = __ldg(s + p.s_split);
    if (!kNoPdl) pdl_trigger();
    const float m = fmaxf(raw0, raw1);
    const float anchor = m == -INFINITY ? 0.f : m;
    const float w0 = fast_exp2(raw0 - anchor), w1 = fast_exp2(raw1 - anchor);
    total = w0 + w1;
    const float inv = total > 0.f ? __fdividef(1.f, total) : 0.f;
#pragma unroll
    for (int v = 0; v < kVec; ++v) {
      out[v] = (w0 * unpack<DType::kBFloat16>(x, v) + w1 * unpack<DType::kBFloat16>(y, v)) * inv;
    }
    state.m = m;
    state.l = total;
    log2_rel = fast_log2(total);
  } else {
    // The pair instance's operations and the fresh state's zero rescale
    // (merge_batch from reset()), with no load predicated.
    const bool holds[1] = {true};
    state.reset();
    merge_few_round<2, 1, DType::kBFloat16, StatsFormat::kLse>(
        state, o, s, 2, p.o_split, p.s_split, 0, holds, p.log2_scale, p.empty_stat);
    if (!kNoPdl) pdl_trigger();
    total = state.finalize_lse(out, log2_rel);
  }
  store_out<kVec, DType::kBFloat16>(p.out, token * p.out_token + head * p.out_head + lane * kVec,
                                    out);
  if (!kNoExport && lane == 0 && p.out_stats != nullptr) {
    write_stats<StatsFormat::kLse>(p.out_stats + (token * p.out_stats_token +
                                                  head * p.out_stats_head),
                                   state, total, neg_inf(), log2_rel, p.log2_scale,
                                   p.export_scale, nullptr);
  }
}

// pair_parts_kernel<kParts> on make_few_launch's CTAs; -1 where the call does
// not take the pair instance or (a shift) its lanes are not a power of two.
template <int kParts>
int launch_pair_parts(const MergeParams& p, int sm_count, cudaStream_t stream) {
  FewLeanParams f;
  FewLaunch shape;
  uint32_t heads;
  if (!pair_call(p, kBytesPerThread, sm_count, f, shape, heads) || ((kParts & 2) && heads != 1)) {
    return -1;
  }
  const int lanes_log2 = exact_log2(static_cast<int>(f.lanes.divisor));
  if ((kParts & 1) && lanes_log2 < 0) return -1;
  pair_parts_kernel<kParts><<<static_cast<unsigned>(shape.ctas), shape.cta_threads, 0, stream>>>(
      f, lanes_log2);
  return 0;
}

// The product's lean merge for these calls (flat rows, bf16, base-2 LSE, two
// states, one vector, bf16 out), each bit of kParts a part made as bare has
// it: 1 a constant live count, 2 no further rounds, 4 the general finalize,
// 8 no in-place sync, export or vector check, 16 an early exit.
template <int kParts>
__global__ void __launch_bounds__(256, 1) lean_parts_kernel(const MergeParams p,
                                                            const FewGeometry geo,
                                                            const FastDivmod heads) {
  constexpr bool kConstLive = kParts & 1, kNoLoop = kParts & 2, kGeneralFinalize = kParts & 4;
  constexpr bool kNoChecks = kParts & 8, kEarlyExit = kParts & 16;
  const uint32_t thread = blockIdx.x * blockDim.x + threadIdx.x;
  const uint32_t row = geo.lanes.div(thread);
  const int lanes = static_cast<int>(geo.lanes.divisor);
  const int lane = static_cast<int>(thread - row * geo.lanes.divisor);
  const auto token = static_cast<int32_t>(heads.div(row));
  const auto head = static_cast<int32_t>(row - token * heads.divisor);
  const bool active = row < p.rows;
  if (kEarlyExit && !active) return;
  bool holds[1] = {kNoChecks || lane < geo.row_vectors};
  pdl_wait();
  const __nv_bfloat16* o = static_cast<const __nv_bfloat16*>(p.partial_o) +
                           (token * static_cast<int32_t>(p.o_row.token) +
                            head * static_cast<int32_t>(p.o_row.head) + lane * kVec);
  const float* s = p.stats + (token * static_cast<int32_t>(p.stats_row.token) +
                              head * static_cast<int32_t>(p.stats_row.head));
  MergeState<kVec> state;
  state.reset();
  const int count = kConstLive ? 2 : active ? static_cast<int>(p.num_splits) : 0;
  merge_few_round<2, 1, DType::kBFloat16, StatsFormat::kLse>(
      state, o, s, count, p.o_stride_split, p.stats_stride_split, lanes * kVec, holds,
      p.log2_scale, p.empty_stat);
  if (!kNoLoop) {
    for (int done = 2; done < count; done += 2) {
      o += 2 * p.o_stride_split;
      s += 2 * p.stats_stride_split;
      merge_few_round<2, 1, DType::kBFloat16, StatsFormat::kLse>(
          state, o, s, count - done, p.o_stride_split, p.stats_stride_split, lanes * kVec, holds,
          p.log2_scale, p.empty_stat);
    }
  }
  pdl_trigger();
  float out[kVec], log2_rel;
  const float total = kGeneralFinalize ? state.finalize(neg_inf(), p.log2_scale, out, log2_rel)
                                       : state.finalize_lse(out, log2_rel);
  if (!kNoChecks && p.stats_in_place) __syncwarp();
  if (!kEarlyExit && !active) return;
  if (!holds[0]) return;
  const int32_t out_row =
      token * static_cast<int32_t>(p.out_row.token) + head * static_cast<int32_t>(p.out_row.head);
  store_out<kVec, DType::kBFloat16>(p.out, out_row + lane * kVec, out);
  if (!kNoChecks && lane == 0 && p.out_stats != nullptr) {
    export_stats<StatsFormat::kLse>(p, state, RowIndex{0, token, head}, total, neg_inf(),
                                    log2_rel, nullptr);
  }
}

// A two-state merge written out: each thread loads both LSEs and its piece
// of both partials, then weights, one store. kBytes a thread a state.
template <int kBytes>
__device__ __forceinline__ void hand_merge(const __nv_bfloat16* o, const float* s,
                                           __nv_bfloat16* out, int rows, int lanes_log2,
                                           int64_t o_split, int64_t s_split) {
  constexpr int kElems = kBytes / 2;
  using Vec = typename std::conditional<kBytes == 16, uint4,
              typename std::conditional<kBytes == 8, uint2, uint32_t>::type>::type;
  const int thread = blockIdx.x * blockDim.x + threadIdx.x;
  const int row = thread >> lanes_log2;
  if (row >= rows) return;
  const int64_t at = int64_t{thread} * kElems;  // rows are lanes * kElems elements, packed
  const float s0 = __ldg(s + row), s1 = __ldg(s + s_split + row);
  Vec raw0 = __ldg(reinterpret_cast<const Vec*>(o + at));
  Vec raw1 = __ldg(reinterpret_cast<const Vec*>(o + o_split + at));
  const float m = fmaxf(s0, s1);
  const float anchor = m == -INFINITY ? 0.f : m;
  const float w0 = fast_exp2(s0 - anchor), w1 = fast_exp2(s1 - anchor);
  const float total = w0 + w1;
  const float inv = total > 0.f ? __fdividef(1.f, total) : 0.f;
  const __nv_bfloat162* a = reinterpret_cast<const __nv_bfloat162*>(&raw0);
  const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&raw1);
  Vec result;
  __nv_bfloat162* r = reinterpret_cast<__nv_bfloat162*>(&result);
#pragma unroll
  for (int i = 0; i < kElems / 2; ++i) {
    const float2 x = __bfloat1622float2(a[i]), y = __bfloat1622float2(b[i]);
    r[i] = __floats2bfloat162_rn((w0 * x.x + w1 * y.x) * inv, (w0 * x.y + w1 * y.y) * inv);
  }
  *reinterpret_cast<Vec*>(out + at) = result;
}

template <int kBytes>
__global__ void __launch_bounds__(1024) hand_kernel(const __nv_bfloat16* o, const float* s,
                                                    __nv_bfloat16* out, int rows, int lanes_log2,
                                                    int64_t o_split, int64_t s_split) {
  hand_merge<kBytes>(o, s, out, rows, lanes_log2, o_split, s_split);
}

// hand16 behind the pair instance's parameter block (unread): its own
// parameters at the offsets past it, the launch copying as many bytes.
__global__ void __launch_bounds__(1024) hand_big_kernel(const FewLeanParams unread,
                                                        const __nv_bfloat16* o, const float* s,
                                                        __nv_bfloat16* out, int rows,
                                                        int lanes_log2, int64_t o_split,
                                                        int64_t s_split) {
  hand_merge<16>(o, s, out, rows, lanes_log2, o_split, s_split);
}

// Unread bytes ahead of hand16's parameters (hmid: 48, so that they sit where
// the pair instance's prologue reads the second half of its 80 bytes).
struct Pad48 {
  int64_t unread[6];
};

__global__ void __launch_bounds__(1024) hand_mid_kernel(const Pad48 pad, const __nv_bfloat16* o,
                                                        const float* s, __nv_bfloat16* out,
                                                        int rows, int lanes_log2, int64_t o_split,
                                                        int64_t s_split) {
  hand_merge<16>(o, s, out, rows, lanes_log2, o_split, s_split);
}

// hand16 with the same parameter block after its own (unread): the launch
// copies as many bytes, its own parameters where hand16 has them.
__global__ void __launch_bounds__(1024) hand_tail_kernel(const __nv_bfloat16* o, const float* s,
                                                         __nv_bfloat16* out, int rows,
                                                         int lanes_log2, int64_t o_split,
                                                         int64_t s_split,
                                                         const FewLeanParams unread) {
  hand_merge<16>(o, s, out, rows, lanes_log2, o_split, s_split);
}

// hand16 with one part of bare (kStep 0 hdiv, 1 h64, 2 hstate, 3 hfirst).
template <int kStep>
__global__ void __launch_bounds__(1024) step_kernel(const SmallParams p, int lanes_log2) {
  const uint32_t thread = blockIdx.x * blockDim.x + threadIdx.x;
  uint32_t row = thread >> lanes_log2;
  uint32_t lane = thread & ((1u << lanes_log2) - 1);
  if (kStep == 0) {
    row = p.lanes.div(thread);
    lane = thread - row * p.lanes.divisor;
  }
  if (row >= static_cast<uint32_t>(p.rows)) return;
  int64_t at = int64_t{thread} * kVec;
  if (kStep == 1) at = int64_t{row} * static_cast<int>(p.lanes.divisor) * kVec + lane * kVec;
  const __nv_bfloat16* o = p.o + at;
  const float* s = p.s + row;
  float result[kVec];
  if (kStep >= 2) {
    MergeState<kVec> state;
    state.reset();
    if (kStep == 2) {
      bool holds[1] = {true};
      merge_few_round<2, 1, DType::kBFloat16, StatsFormat::kLse>(
          state, o, s, 2, p.o_split, p.s_split, 0, holds, 1.f, p.empty_stat);
    } else {
      const auto a = load_packed<kBytesPerThread>(o), b = load_packed<kBytesPerThread>(o + p.o_split);
      const float raw0 = __ldg(s), raw1 = __ldg(s + p.s_split);
      const float m0 = raw0 != p.empty_stat ? raw0 : neg_inf();
      const float m1 = raw1 != p.empty_stat ? raw1 : neg_inf();
      state.m = max_keep_nan(m0, m1);
      const float offset = weight_offset(state.m);
      const float w0 = MergeState<kVec>::weight(m0, offset, 1.f);
      const float w1 = MergeState<kVec>::weight(m1, offset, 1.f);
      state.l = w0 + w1;
#pragma unroll
      for (int v = 0; v < kVec; ++v) {
        state.acc[v] = w0 * unpack<DType::kBFloat16>(a, v);
        state.acc[v] += w1 * unpack<DType::kBFloat16>(b, v);
      }
    }
    float log2_rel;
    state.finalize(neg_inf(), 1.f, result, log2_rel);
  } else {
    const auto a = load_packed<kBytesPerThread>(o), b = load_packed<kBytesPerThread>(o + p.o_split);
    const float s0 = __ldg(s), s1 = __ldg(s + p.s_split);
    const float m = fmaxf(s0, s1);
    const float anchor = m == -INFINITY ? 0.f : m;
    const float w0 = fast_exp2(s0 - anchor), w1 = fast_exp2(s1 - anchor);
    const float total = w0 + w1;
    const float inv = total > 0.f ? __fdividef(1.f, total) : 0.f;
#pragma unroll
    for (int v = 0; v < kVec; ++v) {
      result[v] = (w0 * unpack<DType::kBFloat16>(a, v) + w1 * unpack<DType::kBFloat16>(b, v)) * inv;
    }
  }
  store_out<kVec, DType::kBFloat16>(p.out, at, result);
}

int launch_hand(const MergeParams& p, int bytes, bool row_grid, int sm_count, cudaStream_t stream,
                int big = 0) {
  const int lanes = static_cast<int>(p.head_dim) * 2 / bytes;
  const int lanes_log2 = exact_log2(lanes);
  if (lanes_log2 < 0) return -1;
  const int rows = static_cast<int>(p.rows);
  int cta = lanes, ctas = rows;
  if (!row_grid) {
    const FewLaunch shape = make_few_launch(lanes, p.rows, sm_count);
    cta = shape.cta_threads;
    ctas = static_cast<int>(shape.ctas);
  }
  const auto* o = static_cast<const __nv_bfloat16*>(p.partial_o);
  auto* out = static_cast<__nv_bfloat16*>(p.out);
  if (big == 1) {
    hand_big_kernel<<<ctas, cta, 0, stream>>>(FewLeanParams{}, o, p.stats, out, rows, lanes_log2,
                                              p.o_stride_split, p.stats_stride_split);
    return 0;
  }
  if (big == 3) {
    hand_mid_kernel<<<ctas, cta, 0, stream>>>(Pad48{}, o, p.stats, out, rows, lanes_log2,
                                              p.o_stride_split, p.stats_stride_split);
    return 0;
  }
  if (big == 2) {
    hand_tail_kernel<<<ctas, cta, 0, stream>>>(o, p.stats, out, rows, lanes_log2, p.o_stride_split,
                                               p.stats_stride_split, FewLeanParams{});
    return 0;
  }
  switch (bytes) {
    case 16: hand_kernel<16><<<ctas, cta, 0, stream>>>(o, p.stats, out, rows, lanes_log2, p.o_stride_split, p.stats_stride_split); break;
    case 8: hand_kernel<8><<<ctas, cta, 0, stream>>>(o, p.stats, out, rows, lanes_log2, p.o_stride_split, p.stats_stride_split); break;
    default: hand_kernel<4><<<ctas, cta, 0, stream>>>(o, p.stats, out, rows, lanes_log2, p.o_stride_split, p.stats_stride_split); break;
  }
  return 0;
}

// The packed pair's parameters in one 64-byte line of the constant bank
// (pk1l: placed at 0x240 behind Pad48; pk1l0: at 0x210, across two lines),
// the fields its code reads (state offsets as 32 bits, no FP8 scale, the
// export scale 1: enough for the lab's split-major calls), under
// FewPackedParams' names.
struct PairLine {
  const __nv_bfloat16* partial_o;
  const float* stats;
  __nv_bfloat16* out;
  float* out_stats;
  int32_t o_split, s_split;
  int32_t rows, lanes_log2;
  int32_t s_token, out_stats_token;
  float log2_scale, empty_stat;
  static constexpr float export_scale = 1.f;
  static constexpr const float* out_scale = nullptr;
};
static_assert(sizeof(PairLine) == 64, "one constant line");

// The packed pair instance's body (bf16, base-2 LSE, bf16 out) on PairLine.
__device__ __forceinline__ void pair_line_merge(const PairLine& p) {
  few_lean_merge<DType::kBFloat16, StatsFormat::kLse, 2, 1, DType::kBFloat16, true, true>(p);
}

__global__ void __launch_bounds__(256, 1) pair_line_kernel(const Pad48 pad, const PairLine p) {
  pair_line_merge(p);
}

__global__ void __launch_bounds__(256, 1) pair_line0_kernel(const PairLine p) {
  pair_line_merge(p);
}

// Unread bytes that move hand16's later parameters into further lines.
struct Pad40 {
  int64_t unread[5];
};

// hspread: hand16 with its parameters over three constant lines (o, rows and
// lanes in the first, s and the state offsets in the second, out in the
// third), as the pair instance reads three. hlate: only out in a line of its
// own, read after the loads.
__global__ void __launch_bounds__(1024) hand_spread_kernel(const __nv_bfloat16* o, int rows,
                                                           int lanes_log2, const Pad40 pad_a,
                                                           const float* s, int64_t o_split,
                                                           int64_t s_split, const Pad40 pad_b,
                                                           __nv_bfloat16* out) {
  hand_merge<16>(o, s, out, rows, lanes_log2, o_split, s_split);
}

__global__ void __launch_bounds__(1024) hand_late_kernel(const __nv_bfloat16* o, const float* s,
                                                         int rows, int lanes_log2,
                                                         int64_t o_split, int64_t s_split,
                                                         const Pad40 pad_a, const Pad40 pad_b,
                                                         __nv_bfloat16* out) {
  hand_merge<16>(o, s, out, rows, lanes_log2, o_split, s_split);
}

// pk1l / pk1l0 / hspread / hlate on make_few_launch's CTAs; -1 where the call
// is not a packed pair (pk1l*) or its lanes are not a power of two.
int launch_line(const MergeParams& p, int which, int sm_count, cudaStream_t stream) {
  FewLeanParams f;
  FewPackedParams pk;
  FewLaunch shape;
  uint32_t heads;
  if (!pair_call(p, kBytesPerThread, sm_count, f, shape, heads, &pk)) return -1;
  const auto ctas = static_cast<unsigned>(shape.ctas);
  const unsigned cta = shape.cta_threads;
  const auto* o = static_cast<const __nv_bfloat16*>(f.partial_o);
  auto* out = static_cast<__nv_bfloat16*>(f.out);
  if (which >= 2) {
    if (which == 2) {
      hand_spread_kernel<<<ctas, cta, 0, stream>>>(o, f.rows, pk.lanes_log2, Pad40{}, f.stats,
                                                   f.o_split, f.s_split, Pad40{}, out);
    } else {
      hand_late_kernel<<<ctas, cta, 0, stream>>>(o, f.stats, f.rows, pk.lanes_log2, f.o_split,
                                                 f.s_split, Pad40{}, Pad40{}, out);
    }
    return 0;
  }
  if (f.o_split != static_cast<int32_t>(f.o_split) || f.s_split != static_cast<int32_t>(f.s_split)) {
    return -1;
  }
  const PairLine line{o, f.stats, out, f.out_stats,
                      static_cast<int32_t>(f.o_split), static_cast<int32_t>(f.s_split),
                      f.rows, pk.lanes_log2, pk.s_token, pk.out_stats_token,
                      f.log2_scale, f.empty_stat};
  if (which == 0) {
    pair_line_kernel<<<ctas, cta, 0, stream>>>(Pad48{}, line);
  } else {
    pair_line0_kernel<<<ctas, cta, 0, stream>>>(line);
  }
  return 0;
}

FewGeometry geometry(const MergeParams& p, int sm_count, FewLaunch& shape) {
  const int lanes = few_threads_per_row(p.head_dim, 2, 1);
  shape = make_few_launch(lanes, p.rows, sm_count);
  return FewGeometry{FastDivmod(static_cast<uint32_t>(lanes)), p.head_dim * 2 / kBytesPerThread,
                     shape.rows_per_pass, true};
}

}  // namespace
}  // namespace kvsplit

using namespace kvsplit;

// variant: 0 bare, 1 ex, 2 pdl, 3 bigp, 4 any, 5 general, 6 product, 7 hand16, 8 hand8,
// 9 hand4, 10 row16, 11 row8, 12 hdiv, 13 h64, 14 hstate, 15 hfirst, 16 lean8, 17 lean6,
// 18 lean4, 19 lconst, 20 lnoloop, 21 lfin, 22 lnochk, 23 lexit, 24 lbare, 25 l8,
// 26 l8row, 27 l16row, 28 lean, 29 p8, 30 p8row, 31 p16row, 32 pshift, 33 pflat, 34 pmath,
// 35 pnoexp, 36 phand, 37 pnopdl, 38 hbigp, 39 htail, 40 hmid, 41 pair, 42 packed, 43 pkrow,
// 44 pk8, 45 pk8row, 46-50 pkc64 ... pk8c256, 51 pk1l, 52 pk1l0, 53 hspread, 54 hlate. Split-major
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
    case 5: few_kernel<DType::kBFloat16, StatsFormat::kLse, 2, 1><<<grid, block, 0, stream>>>(geo, p); break;
    case 7: case 8: case 9: case 10: case 11: {
      const int bytes[] = {16, 8, 4, 16, 8};
      if (launch_hand(p, bytes[variant - 7], variant >= 10, sm_count, stream) != 0) return -1;
      break;
    }
    case 12: case 13: case 14: case 15: {
      const int lanes_log2 = exact_log2(static_cast<int>(geo.lanes.divisor));
      if (lanes_log2 < 0) return -1;
      void (*const kernels[])(SmallParams, int) = {step_kernel<0>, step_kernel<1>, step_kernel<2>,
                                                    step_kernel<3>};
      kernels[variant - 12]<<<grid, block, 0, stream>>>(small, lanes_log2);
      break;
    }
    case 16: case 17: case 18: case 19: case 20: case 21: case 22: case 23: case 24: {
      MergeParams lean;
      uint32_t heads = 1;
      if (!few_lean_call(p, p.rows * static_cast<int64_t>(geo.lanes.divisor), 2, lean, heads)) {
        return -1;
      }
      if (variant <= 18) {
        void (*const bounded[])(FewLeanParams) = {lean_bounded_kernel<8>, lean_bounded_kernel<6>,
                                                  lean_bounded_kernel<4>};
        bounded[variant - 16]<<<grid, block, 0, stream>>>(few_lean_params(lean, heads, geo));
        break;
      }
      void (*const kernels[])(MergeParams, FewGeometry, FastDivmod) = {
          lean_parts_kernel<1>, lean_parts_kernel<2>,  lean_parts_kernel<4>,
          lean_parts_kernel<8>, lean_parts_kernel<16>, lean_parts_kernel<31>};
      kernels[variant - 19]<<<grid, block, 0, stream>>>(lean, geo, FastDivmod(heads));
      break;
    }
    case 25: case 26: case 27: case 28: case 29: case 30: case 31: {
      // l8, l8row, l16row, lean (16 bytes, make_few_launch: the product before the pair
      // instance), p8, p8row, p16row
      const int bytes[] = {8, 8, 16, 16, 8, 8, 16};
      const bool rows[] = {false, true, true, false, false, true, true};
      if (launch_lean_bytes(p, bytes[variant - 25], rows[variant - 25], variant >= 29, sm_count,
                            stream) != 0) {
        return -1;
      }
      break;
    }
    case 32: case 33: case 34: case 35: case 36: case 37: {
      int (*const launches[])(const MergeParams&, int, cudaStream_t) = {
          launch_pair_parts<1>, launch_pair_parts<2>, launch_pair_parts<4>, launch_pair_parts<8>,
          launch_pair_parts<15>, launch_pair_parts<31>};
      if (launches[variant - 32](p, sm_count, stream) != 0) return -1;
      break;
    }
    case 38: case 39: case 40:
      if (launch_hand(p, 16, false, sm_count, stream, variant - 37) != 0) return -1;
      break;
    case 41: case 42: case 43: case 44: case 45: {
      const int bytes[] = {16, 16, 16, 8, 8};
      const bool rows[] = {false, false, true, false, true};
      if (launch_lean_bytes(p, bytes[variant - 41], rows[variant - 41], true, sm_count, stream,
                            variant > 41) != 0) {
        return -1;
      }
      break;
    }
    case 46: case 47: case 48: case 49: case 50: {
      const int bytes[] = {16, 16, 16, 8, 8};
      const int ctas[] = {64, 128, 256, 128, 256};
      if (launch_lean_bytes(p, bytes[variant - 46], false, true, sm_count, stream, true,
                            ctas[variant - 46]) != 0) {
        return -1;
      }
      break;
    }
    case 51: case 52: case 53: case 54:
      if (launch_line(p, variant - 51, sm_count, stream) != 0) return -1;
      break;
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
