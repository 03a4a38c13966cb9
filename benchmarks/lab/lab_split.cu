// Few states at L2-resident sizes (3-18 MB, N = 4-16): the product's Few
// kernel beside two-state-style merges written out by hand whose states are
// spread over S adjacent lanes. benchmarks/lab/lab_split.py times them in
// graph replay. Lab code: nothing here ships.
//
//   product v1 / v2   launch_few_typed, one or two 16-byte vectors a thread;
//   split S (1, 2, 4) a hand-written merge of N states, bf16, base-2 LSE,
//                     rows of a power-of-two vector count: S adjacent lanes
//                     share one 16-byte vector of a row, each loads N / S of
//                     its states (partials and LSEs) before any arithmetic,
//                     the lanes agree on the max by shuffles, weigh their
//                     own states, sum the weights and the vector by
//                     shuffles, and the first lane stores. S = 1 is one
//                     thread a vector, the product's layout without its
//                     running state; S > 1 gives the GPU S times the threads
//                     for the same bytes (the read probe runs two to four
//                     times the product's threads) and each thread N / S
//                     states of arithmetic after its loads.
//   half S            split S with each lane storing 16 / S bytes of the
//                     summed vector instead of the first lane all 16;
//   phase             split 1 with its states merged in two halves, each
//                     weighed against its own max (phase_kernel).
//   m-base / m-ldg / m-math / m-addr / m-all
//                     split 1 taking MergeParams (m-base), then with one part
//                     of the product's lean kernel each, to say what product
//                     v1 - split1 is made of: its loads (load_packed and
//                     __ldg, each predicated by a ternary: m-ldg), its math
//                     (MergeState's round with the empty-stat test, the log2
//                     scale and the fresh state's rescale, finalize_lse,
//                     store_out: m-math), its addressing (row and lane by
//                     FastDivmod, token and head by another, 32-bit offsets
//                     from each tensor's strides, the lane check, PDL
//                     instructions, cudaLaunchKernelEx: m-addr); m-all has
//                     all three (the product's lean merge without its
//                     epilogue's export and in-place checks).
//   m-pad / m-far     split 1 with an unused 800-byte block beside its
//                     arguments, after them (m-pad: the same constant-bank
//                     offsets, a parameter block the size of MergeParams)
//                     or before them (m-far: its fields at MergeParams-like
//                     offsets): whether m-base - split1 is the block's size
//                     or where its fields lie.
#include <cuda_bf16.h>

#include "kvsplit/launch.h"
#include "kvsplit/merge_few.cuh"
#include "kvsplit/probe.h"

namespace kvsplit {
namespace {

// Loads as volatile asm, so that ptxas keeps every load of a thread ahead of
// the arithmetic: with __ldg it moved each partial's load next to its use
// (42 registers for sixteen states, one load in flight at a time).
__device__ __forceinline__ uint4 load_v4(const void* at, bool on) {
  uint4 v;
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n mov.b32 %0, 0;\n mov.b32 %1, 0;\n"
      " mov.b32 %2, 0;\n mov.b32 %3, 0;\n @p ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n}"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(at), "r"(static_cast<int>(on)));
  return v;
}

__device__ __forceinline__ float load_f32(const float* at, bool on) {
  float v;
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n mov.b32 %0, 0xff800000;\n"
      " @p ld.global.nc.f32 %0, [%1];\n}"
      : "=f"(v)
      : "l"(at), "r"(static_cast<int>(on)));
  return v;
}

// Every load of a thread's kCount states, issued before any arithmetic.
template <int kCount>
__device__ __forceinline__ void load_states(const __nv_bfloat16* o, const float* s, int64_t o_split,
                                            int64_t s_split, bool active, uint4 (&raw)[kCount],
                                            float (&m_in)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i, o += o_split, s += s_split) {
    raw[i] = load_v4(o, active);
    m_in[i] = load_f32(s, active);
  }
}

// acc += w x for the eight bf16 values of a 16-byte vector.
__device__ __forceinline__ void accumulate(const uint4& raw, float w, float (&acc)[8]) {
  const __nv_bfloat162* x = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float2 v = __bfloat1622float2(x[e]);
    acc[2 * e] = fmaf(w, v.x, acc[2 * e]);
    acc[2 * e + 1] = fmaf(w, v.y, acc[2 * e + 1]);
  }
}

template <int kN, int kS, bool kSpreadStore>
__device__ __forceinline__ void split_body(const __nv_bfloat16* o, const float* s,
                                           __nv_bfloat16* out, uint32_t rows, int vectors_log2,
                                           int64_t o_split, int64_t s_split) {
  constexpr int kPer = kN / kS;
  const uint32_t thread = blockIdx.x * blockDim.x + threadIdx.x;
  const uint32_t sub = thread & (kS - 1);
  const uint32_t vector = thread / kS;
  const uint32_t row = vector >> vectors_log2;
  const bool active = row < rows;
  const int64_t at = int64_t{vector} * 8;
  uint4 raw[kPer];
  float m_in[kPer];
  load_states(o + int64_t{sub} * kPer * o_split + at, s + int64_t{sub} * kPer * s_split + row,
              o_split, s_split, active, raw, m_in);
  float m = m_in[0];
#pragma unroll
  for (int i = 1; i < kPer; ++i) m = fmaxf(m, m_in[i]);
#pragma unroll
  for (int k = 1; k < kS; k <<= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, k));
  const float anchor = m == neg_inf() ? 0.f : m;
  float acc[8] = {}, l = 0.f;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const float w = fast_exp2(m_in[i] - anchor);
    l += w;
    accumulate(raw[i], w, acc);
  }
#pragma unroll
  for (int k = 1; k < kS; k <<= 1) {
    l += __shfl_xor_sync(0xffffffffu, l, k);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] += __shfl_xor_sync(0xffffffffu, acc[e], k);
  }
  if (!active) return;
  const float inv = l > 0.f ? __fdividef(1.f, l) : 0.f;
  uint4 result;
  __nv_bfloat162* r = reinterpret_cast<__nv_bfloat162*>(&result);
#pragma unroll
  for (int e = 0; e < 4; ++e) r[e] = __floats2bfloat162_rn(acc[2 * e] * inv, acc[2 * e + 1] * inv);
  if constexpr (kSpreadStore && kS > 1) {
    constexpr int kWords = 4 / kS;  // 32-bit words a lane stores
    uint32_t* dst = reinterpret_cast<uint32_t*>(out + at) + sub * kWords;
    const uint32_t* src = reinterpret_cast<const uint32_t*>(&result) + sub * kWords;
    if constexpr (kWords == 2) {
      *reinterpret_cast<uint2*>(dst) = make_uint2(src[0], src[1]);
    } else {
      *dst = src[0];
    }
  } else {
    if (sub == 0) *reinterpret_cast<uint4*>(out + at) = result;
  }
}

template <int kN, int kS, bool kSpreadStore>
__global__ void __launch_bounds__(256) split_kernel(const __nv_bfloat16* o, const float* s,
                                                    __nv_bfloat16* out, uint32_t rows,
                                                    int vectors_log2, int64_t o_split,
                                                    int64_t s_split) {
  split_body<kN, kS, kSpreadStore>(o, s, out, rows, vectors_log2, o_split, s_split);
}

// One thread a vector, its states merged in two halves, each weighed
// against its own max as soon as its loads are in (every load is still issued
// first), then the halves combined: whether arithmetic on the first half
// overlaps the arrival of the second.
template <int kN>
__global__ void __launch_bounds__(256) phase_kernel(const __nv_bfloat16* o, const float* s,
                                                    __nv_bfloat16* out, uint32_t rows,
                                                    int vectors_log2, int64_t o_split,
                                                    int64_t s_split) {
  constexpr int kHalf = kN / 2;
  const uint32_t vector = blockIdx.x * blockDim.x + threadIdx.x;
  const uint32_t row = vector >> vectors_log2;
  const bool active = row < rows;
  const int64_t at = int64_t{vector} * 8;
  uint4 raw[kN];
  float m_in[kN];
  load_states(o + at, s + row, o_split, s_split, active, raw, m_in);
  float m[2], l[2] = {0.f, 0.f}, acc[2][8] = {};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    m[h] = m_in[h * kHalf];
#pragma unroll
    for (int i = 1; i < kHalf; ++i) m[h] = fmaxf(m[h], m_in[h * kHalf + i]);
    const float anchor = m[h] == neg_inf() ? 0.f : m[h];
#pragma unroll
    for (int i = 0; i < kHalf; ++i) {
      const float w = fast_exp2(m_in[h * kHalf + i] - anchor);
      l[h] += w;
      accumulate(raw[h * kHalf + i], w, acc[h]);
    }
  }
  if (!active) return;
  const float top = fmaxf(m[0], m[1]);
  const float anchor = top == neg_inf() ? 0.f : top;
  const float w0 = m[0] == neg_inf() ? 0.f : fast_exp2(m[0] - anchor);
  const float w1 = m[1] == neg_inf() ? 0.f : fast_exp2(m[1] - anchor);
  const float total = w0 * l[0] + w1 * l[1];
  const float inv = total > 0.f ? __fdividef(1.f, total) : 0.f;
  uint4 result;
  __nv_bfloat162* r = reinterpret_cast<__nv_bfloat162*>(&result);
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    r[e] = __floats2bfloat162_rn((w0 * acc[0][2 * e] + w1 * acc[1][2 * e]) * inv,
                                 (w0 * acc[0][2 * e + 1] + w1 * acc[1][2 * e + 1]) * inv);
  }
  *reinterpret_cast<uint4*>(out + at) = result;
}

struct SplitArgs {
  const __nv_bfloat16* o;
  const float* s;
  __nv_bfloat16* out;
  uint32_t rows;
  int vectors_log2;
  int64_t o_split;
  int64_t s_split;
};

struct Pad {
  int64_t unused[100];
};

template <int kN>
__device__ __forceinline__ void split1_body(const SplitArgs& a) {
  split_body<kN, 1, false>(a.o, a.s, a.out, a.rows, a.vectors_log2, a.o_split, a.s_split);
}

template <int kN>
__global__ void __launch_bounds__(256) pad_after_kernel(const SplitArgs a, const Pad) {
  split1_body<kN>(a);
}

template <int kN>
__global__ void __launch_bounds__(256) pad_before_kernel(const Pad, const SplitArgs a) {
  split1_body<kN>(a);
}

// log2 of a power of two, or -1 (the hand-written kernels find a row by a shift).
int log2_exact(int n) {
  if (n < 1 || (n & (n - 1))) return -1;
  int log2 = 0;
  while ((1 << log2) < n) ++log2;
  return log2;
}

// split1 as a MergeParams kernel, with the product lean kernel's loads (kLdg),
// math (kMath) and addressing (kAddr) each switched in on its own.
template <int kN, bool kLdg, bool kMath, bool kAddr>
__global__ void __launch_bounds__(256) morph_kernel(const MergeParams p, const FewGeometry geo,
                                                    const FastDivmod heads, int vectors_log2) {
  const uint32_t thread = blockIdx.x * blockDim.x + threadIdx.x;
  const auto* o = static_cast<const __nv_bfloat16*>(p.partial_o);
  const float* s = p.stats;
  int64_t o_at, s_at, out_at;
  bool active, holds = true;
  if constexpr (kAddr) {
    const uint32_t row = geo.lanes.div(thread);
    const int lane = static_cast<int>(thread - row * geo.lanes.divisor);
    const auto token = static_cast<int32_t>(heads.div(row));
    const auto head = static_cast<int32_t>(row - token * heads.divisor);
    active = row < p.rows;
    holds = lane < geo.row_vectors;
    o_at = token * static_cast<int32_t>(p.o_row.token) +
           head * static_cast<int32_t>(p.o_row.head) + lane * 8;
    s_at = token * static_cast<int32_t>(p.stats_row.token) +
           head * static_cast<int32_t>(p.stats_row.head);
    out_at = token * static_cast<int32_t>(p.out_row.token) +
             head * static_cast<int32_t>(p.out_row.head) + lane * 8;
    pdl_wait();
  } else {
    const uint32_t row = thread >> vectors_log2;
    active = row < p.rows;
    o_at = out_at = int64_t{thread} * 8;
    s_at = row;
  }
  const bool on = active && holds;
  uint4 raw[kN];
  float m_in[kN];
  if constexpr (kLdg) {
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      const Packed<16> packed = on ? load_packed<16>(o + o_at + i * p.o_stride_split) : Packed<16>{};
      raw[i] = *reinterpret_cast<const uint4*>(&packed);
      m_in[i] = active ? __ldg(s + s_at + i * p.stats_stride_split) : neg_inf();
    }
  } else {
    load_states(o + o_at, s + s_at, p.o_stride_split, p.stats_stride_split, on, raw, m_in);
  }
  if constexpr (kAddr) pdl_trigger();
  float result[8];
  if constexpr (kMath) {
    float l_in[kN];
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      l_in[i] = 1.f;
      if (m_in[i] == p.empty_stat) m_in[i] = neg_inf();
    }
    MergeState<8> state;
    state.reset();
    state.merge_batch(
        m_in, l_in,
        [&](int j, int e) {
          return unpack<DType::kBFloat16>(*reinterpret_cast<const Packed<16>*>(&raw[j]), e);
        },
        p.log2_scale);
    float log2_rel;
    state.finalize_lse(result, log2_rel);
  } else {
    float m = m_in[0];
#pragma unroll
    for (int i = 1; i < kN; ++i) m = fmaxf(m, m_in[i]);
    const float anchor = m == neg_inf() ? 0.f : m;
    float acc[8] = {}, l = 0.f;
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      const float w = fast_exp2(m_in[i] - anchor);
      l += w;
      accumulate(raw[i], w, acc);
    }
    const float inv = l > 0.f ? __fdividef(1.f, l) : 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) result[e] = acc[e] * inv;
  }
  if (!on) return;
  store_out<8, DType::kBFloat16>(p.out, out_at, result);
}

// variant 0 m-base, 1 m-ldg, 2 m-math, 3 m-addr, 4 m-all, 5 m-pad, 6 m-far.
template <int kN>
int launch_morph(int variant, const MergeParams& p, int sm_count, cudaStream_t stream) {
  const int vectors = static_cast<int>(p.head_dim / 8);
  const int vectors_log2 = log2_exact(vectors);
  if (vectors_log2 < 0) return -1;
  const FewLaunch shape = make_few_launch(vectors, p.rows, sm_count);
  if (variant >= 5) {
    const SplitArgs a{static_cast<const __nv_bfloat16*>(p.partial_o), p.stats,
                      static_cast<__nv_bfloat16*>(p.out), static_cast<uint32_t>(p.rows),
                      vectors_log2, p.o_stride_split, p.stats_stride_split};
    const dim3 grid(static_cast<unsigned>(shape.ctas)), block(shape.cta_threads);
    if (variant == 5) {
      pad_after_kernel<kN><<<grid, block, 0, stream>>>(a, Pad{});
    } else {
      pad_before_kernel<kN><<<grid, block, 0, stream>>>(Pad{}, a);
    }
    return 0;
  }
  MergeParams lean;
  uint32_t heads = 1;
  if (!few_lean_call(p, p.rows * vectors, kN, lean, heads)) return -2;
  const FewGeometry geo{FastDivmod(static_cast<uint32_t>(vectors)), vectors, shape.rows_per_pass,
                        true};
  PdlLaunch launch(static_cast<unsigned>(shape.ctas), static_cast<unsigned>(shape.cta_threads), 0,
                   stream, false);
  void (*const kernels[])(MergeParams, FewGeometry, FastDivmod, int) = {
      morph_kernel<kN, false, false, false>, morph_kernel<kN, true, false, false>,
      morph_kernel<kN, false, true, false>, morph_kernel<kN, false, false, true>,
      morph_kernel<kN, true, true, true>};
  if (variant == 3 || variant == 4) {
    return static_cast<int>(
        cudaLaunchKernelEx(&launch.config, kernels[variant], lean, geo, FastDivmod(heads),
                           vectors_log2));
  }
  kernels[variant]<<<dim3(static_cast<unsigned>(shape.ctas)), dim3(shape.cta_threads), 0,
                     stream>>>(lean, geo, FastDivmod(heads), vectors_log2);
  return 0;
}

template <int kN>
int launch_split(int s_lanes, bool spread, const MergeParams& p, int sm_count,
                 cudaStream_t stream) {
  const int vectors = static_cast<int>(p.head_dim / 8);
  const int vectors_log2 = log2_exact(vectors);
  if (vectors_log2 < 0) return -1;
  const FewLaunch shape = make_few_launch(vectors * (s_lanes ? s_lanes : 1), p.rows, sm_count);
  const dim3 grid(static_cast<unsigned>(shape.ctas)), block(shape.cta_threads);
  const auto* o = static_cast<const __nv_bfloat16*>(p.partial_o);
  auto* out = static_cast<__nv_bfloat16*>(p.out);
  const auto rows = static_cast<uint32_t>(p.rows);
#define KVSPLIT_LAB_SPLIT(S)                                                                    \
  (spread ? split_kernel<kN, S, true> : split_kernel<kN, S, false>)<<<grid, block, 0, stream>>>( \
      o, p.stats, out, rows, vectors_log2, p.o_stride_split, p.stats_stride_split)
  switch (s_lanes) {
    case 1: KVSPLIT_LAB_SPLIT(1); break;
    case 2: KVSPLIT_LAB_SPLIT(2); break;
    case 4: if constexpr (kN >= 4) KVSPLIT_LAB_SPLIT(4); break;
    case 0:
      phase_kernel<kN><<<grid, block, 0, stream>>>(o, p.stats, out, rows, vectors_log2,
                                                   p.o_stride_split, p.stats_stride_split);
      break;
    default: return -1;
  }
#undef KVSPLIT_LAB_SPLIT
  return 0;
}

}  // namespace
}  // namespace kvsplit

using namespace kvsplit;

// variant: 0 product v1, 1 product v2, 2 + k: split S = 1, 2, 4 (k = 0, 1, 2), 5 + k: half
// S = 2, 4 (k = 0, 1), 7: phase, 8 + k: m-base, m-ldg, m-math, m-addr, m-all, m-pad, m-far
// (k = 0 ... 6).
extern "C" int lab_split(const MergeParams* params, int variant, int sm_count, void* raw_stream) {
  MergeParams p = *params;
  flatten_rows(p);
  const auto stream = static_cast<cudaStream_t>(raw_stream);
  if (variant <= 1) {
    KernelConfig config;
    config.family = Family::kFew;
    config.vectors = variant + 1;
    const Status status = launch_few_typed<DType::kBFloat16, StatsFormat::kLse>(
        p, config, sm_count, false, stream);
    if (!status.ok()) return static_cast<int>(status.error);
    return static_cast<int>(cudaGetLastError());
  }
  if (variant >= 8) {
    int result = -1;
    switch (p.num_splits) {
      case 4: result = launch_morph<4>(variant - 8, p, sm_count, stream); break;
      case 8: result = launch_morph<8>(variant - 8, p, sm_count, stream); break;
      case 16: result = launch_morph<16>(variant - 8, p, sm_count, stream); break;
      default: return -1;
    }
    if (result != 0) return result;
    return static_cast<int>(cudaGetLastError());
  }
  const int s_lanes = variant == 7 ? 0 : variant <= 4 ? 1 << (variant - 2) : 2 << (variant - 5);
  const bool spread = variant >= 5;
  int result = -1;
  switch (p.num_splits) {
    case 4: result = launch_split<4>(s_lanes, spread, p, sm_count, stream); break;
    case 8: result = launch_split<8>(s_lanes, spread, p, sm_count, stream); break;
    case 16: result = launch_split<16>(s_lanes, spread, p, sm_count, stream); break;
    default: return -1;
  }
  if (result != 0) return result;
  return static_cast<int>(cudaGetLastError());
}
