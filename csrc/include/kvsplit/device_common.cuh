// Device helpers shared by the kernel families: dtype mapping, 16-byte
// packed loads and stores, a row's output epilogue, and programmatic
// dependent launch.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "kvsplit/merge_math.h"
#include "kvsplit/out_convert.h"
#include "kvsplit/params.h"

namespace kvsplit {

template <DType kDType> struct CudaType;
template <> struct CudaType<DType::kBFloat16> { using type = __nv_bfloat16; };
template <> struct CudaType<DType::kFloat16> { using type = __half; };
template <> struct CudaType<DType::kFloat32> { using type = float; };

template <DType kDType>
constexpr int elem_bytes() {
  static_assert(sizeof(typename CudaType<kDType>::type) == elem_bytes(kDType), "dtype sizes");
  return elem_bytes(kDType);
}

// kBytes (16, 8 or 4) loaded as one vector, kept as 32-bit words.
template <int kBytes>
struct Packed {
  uint32_t w[kBytes / 4];
};

template <int kBytes>
__device__ __forceinline__ Packed<kBytes> load_packed(const void* at) {
  Packed<kBytes> packed;
  if constexpr (kBytes == 16) {
    const uint4 v = __ldg(static_cast<const uint4*>(at));
    packed.w[0] = v.x, packed.w[1] = v.y, packed.w[2] = v.z, packed.w[3] = v.w;
  } else if constexpr (kBytes == 8) {
    const uint2 v = __ldg(static_cast<const uint2*>(at));
    packed.w[0] = v.x, packed.w[1] = v.y;
  } else {
    static_assert(kBytes == 4, "lanes load 16, 8 or 4 bytes");
    packed.w[0] = __ldg(static_cast<const unsigned int*>(at));
  }
  return packed;
}

// Element v of a Packed, as float. `v` is a compile-time constant after
// unrolling, so the word index never sends `packed` to local memory.
template <DType kDType, int kBytes>
__device__ __forceinline__ float unpack(const Packed<kBytes>& packed, int v) {
  const uint32_t* words = packed.w;
  if constexpr (kDType == DType::kFloat32) {
    return __uint_as_float(words[v]);
  } else if constexpr (kDType == DType::kBFloat16) {
    const uint32_t word = words[v / 2];
    return __uint_as_float(v % 2 ? word & 0xffff0000u : word << 16);
  } else {
    const uint32_t word = words[v / 2];
    return __half2float(__ushort_as_half(static_cast<unsigned short>(v % 2 ? word >> 16 : word)));
  }
}

// Whether the device converts to e4m3 in hardware (sm_89 and later).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define KVSPLIT_HARDWARE_E4M3 1
#else
#define KVSPLIT_HARDWARE_E4M3 0
#endif

// Packs kVec floats as `out` elements into 32-bit words (kVec * bytes of out / 4).
template <int kVec, DType kOut>
__device__ __forceinline__ void pack_out(const float (&src)[kVec], uint32_t* words) {
  if constexpr (kOut == DType::kFloat32) {
#pragma unroll
    for (int i = 0; i < kVec; ++i) words[i] = __float_as_uint(src[i]);
  } else if constexpr (kOut == DType::kBFloat16 || kOut == DType::kFloat16) {
#pragma unroll
    for (int i = 0; i < kVec / 2; ++i) {
      if constexpr (kOut == DType::kBFloat16) {
        const __nv_bfloat162 pair = __floats2bfloat162_rn(src[2 * i], src[2 * i + 1]);
        words[i] = *reinterpret_cast<const uint32_t*>(&pair);
      } else {
        const __half2 pair = __floats2half2_rn(src[2 * i], src[2 * i + 1]);
        words[i] = *reinterpret_cast<const uint32_t*>(&pair);
      }
    }
  } else if constexpr (kOut == DType::kFloat8E4M3FN && KVSPLIT_HARDWARE_E4M3) {
    // Ada and later convert two floats per instruction (round to nearest even,
    // finite values saturated: the software path's results, bit for bit).
#pragma unroll
    for (int i = 0; i < kVec / 4; ++i) {
      const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(src[4 * i], src[4 * i + 1]),
                                                   __NV_SATFINITE, __NV_E4M3);
      const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(src[4 * i + 2], src[4 * i + 3]),
                                                   __NV_SATFINITE, __NV_E4M3);
      words[i] = lo | hi << 16;
    }
  } else {
    constexpr bool kFnuz = kOut == DType::kFloat8E4M3FNUZ;
#pragma unroll
    for (int i = 0; i < kVec / 4; ++i) {
      words[i] = uint32_t{float_to_e4m3(src[4 * i], kFnuz)} |
                 uint32_t{float_to_e4m3(src[4 * i + 1], kFnuz)} << 8 |
                 uint32_t{float_to_e4m3(src[4 * i + 2], kFnuz)} << 16 |
                 uint32_t{float_to_e4m3(src[4 * i + 3], kFnuz)} << 24;
    }
  }
}

// Stores kVec floats at element `offset` of `base` as kOut, in accesses of
// up to 16 bytes (the row's output offset is a multiple of the store's size,
// up to 16 bytes: layout validation checks it).
template <int kVec, DType kOut>
__device__ __forceinline__ void store_out(void* base, int64_t offset, const float (&src)[kVec]) {
  constexpr int kBytes = kVec * elem_bytes(kOut);
  static_assert(kBytes % 4 == 0, "stores are whole 32-bit words");
  uint32_t words[kBytes / 4];
  pack_out<kVec, kOut>(src, words);
  char* dst = static_cast<char*>(base) + offset * elem_bytes(kOut);
  if constexpr (kBytes >= 16) {
#pragma unroll
    for (int i = 0; i < kBytes / 16; ++i) {
      reinterpret_cast<uint4*>(dst)[i] =
          make_uint4(words[4 * i], words[4 * i + 1], words[4 * i + 2], words[4 * i + 3]);
    }
  } else if constexpr (kBytes == 8) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(words[0], words[1]);
  } else {
    *reinterpret_cast<uint32_t*>(dst) = words[0];
  }
}

// The output dtype is a runtime value of the call: uniform branches per store.
// Written as compares, not a switch: a switch compiles to an indirect branch
// through a table in constant memory, whose first read in each SM misses the
// constant cache at the end of the merge (0.04-0.09 us a launch: lab_outputs,
// lab_fixed's any and general).
template <int kVec>
__device__ __forceinline__ void store_any(DType out, void* base, int64_t offset,
                                          const float (&src)[kVec]) {
  if (out == DType::kBFloat16) {
    store_out<kVec, DType::kBFloat16>(base, offset, src);
  } else if (out == DType::kFloat16) {
    store_out<kVec, DType::kFloat16>(base, offset, src);
  } else if (out == DType::kFloat32) {
    store_out<kVec, DType::kFloat32>(base, offset, src);
  } else if (out == DType::kFloat8E4M3FN) {
    store_out<kVec, DType::kFloat8E4M3FN>(base, offset, src);
  } else {
    store_out<kVec, DType::kFloat8E4M3FNUZ>(base, offset, src);
  }
}

// A pass-through row's split, as the state that finalize turns into it.
template <int kVec, DType kPartial, StatsFormat kFormat>
__device__ __forceinline__ const float* load_pass_through(const MergeParams& p,
                                                          MergeState<kVec>& state,
                                                          const RowIndex& at, int64_t split,
                                                          int col) {
  const float* stats = p.stats + split * p.stats_stride_split + p.stats_row.at(at);
  state.set_single(kFormat == StatsFormat::kMaxSum ? __ldg(stats + 1) : 1.f);
  const auto packed = load_packed<kBytesPerThread>(
      static_cast<const typename CudaType<kPartial>::type*>(p.partial_o) +
      split * p.o_stride_split + p.o_row.at(at) + col);
#pragma unroll
  for (int v = 0; v < kVec; ++v) state.acc[v] = unpack<kPartial>(packed, v);
  return stats;
}

// Scales FP8 outputs in place: by the per-tensor scale, or by the scale of
// the vector's group of p.quant_group elements, whose lanes (a power of two
// of them, aligned in the warp, all in `mask`) reduce its amax by shuffles;
// the group's first lane writes its scale when `active`.
// A per-tensor FP8 scale (1 without one), loaded by each kernel before its
// merge so that the load's latency hides behind it; nothing uses it before
// the epilogue (inverting it at once made every thread wait for the load
// before issuing its partials' loads).
__device__ __forceinline__ float load_out_scale(const MergeParams& p) {
  return p.out_scale != nullptr ? __ldg(p.out_scale) : 1.f;
}

template <int kVec>
__device__ __forceinline__ void scale_fp8(const MergeParams& p, float (&out)[kVec],
                                          const RowIndex& at, int col, bool active,
                                          unsigned mask, float out_scale) {
  float inverse = 1.f / out_scale;
  if (p.group_scales != nullptr) {
    float amax = 0.f;
#pragma unroll
    for (int v = 0; v < kVec; ++v) amax = max_keep_nan(amax, fabsf(out[v]));
    const int group_lanes = p.quant_group / kVec;
    for (int offset = 1; offset < group_lanes; offset <<= 1) {
      amax = max_keep_nan(amax, __shfl_xor_sync(mask, amax, offset));
    }
    const bool ue8m0 = p.scale_ue8m0 || p.group_scales_dtype == DType::kFloat8E8M0FNU;
    const float scale = group_scale(amax, p.out_dtype, ue8m0);
    if (active && col % p.quant_group == 0) {
      const int64_t at_scale = p.group_scales_row.at(at) + (col / p.quant_group) * p.group_scales_stride;
      if (p.group_scales_dtype == DType::kFloat32) {
        static_cast<float*>(p.group_scales)[at_scale] = scale;
      } else {
        static_cast<uint8_t*>(p.group_scales)[at_scale] = ue8m0_byte(scale);
      }
    }
    inverse = 1.f / scale;
  }
#pragma unroll
  for (int v = 0; v < kVec; ++v) out[v] = fp8_prepare(out[v], inverse);
}

// A row's sink logit in base 2, or -inf: no sinks, a row not stored, or a
// pass-through row (which takes no sink).
__device__ __forceinline__ float row_sink_log2(const MergeParams& p, const RowIndex& at,
                                               bool active, bool pass) {
  return p.sinks != nullptr && active && !pass ? __ldg(p.sinks + row_head(p, at)) * kLog2E
                                               : neg_inf();
}

// Writes a merged row's stats to `stats` in the call's format, from `total`
// and `log2_rel` of state.finalize; a pass-through row's raw stats
// (`pass_stats`) as they are.
template <StatsFormat kFormat, int kVec>
__device__ __forceinline__ void write_stats(float* stats, const MergeState<kVec>& state,
                                            float total, float sink_log2, float log2_rel,
                                            float log2_scale, float export_scale,
                                            const float* pass_stats) {
  if (pass_stats != nullptr) {
    if constexpr (kFormat == StatsFormat::kMaxSum) {
      stats[0] = pass_stats[0] * (log2_scale * export_scale);  // the merge's unit
      stats[1] = pass_stats[1];
    } else {
      stats[0] = pass_stats[0];
    }
  } else if constexpr (kFormat == StatsFormat::kMaxSum) {
    stats[0] = state.m * (log2_scale * export_scale);
    stats[1] = total;
  } else {
    stats[0] = state.exported_log2_total(sink_log2, log2_scale, log2_rel, export_scale);
  }
}

// write_stats at the row's place in the call's out_stats.
template <StatsFormat kFormat, int kVec>
__device__ __forceinline__ void export_stats(const MergeParams& p, const MergeState<kVec>& state,
                                             const RowIndex& at, float total, float sink_log2,
                                             float log2_rel, const float* pass_stats) {
  write_stats<kFormat>(p.out_stats + p.out_stats_row.at(at), state, total, sink_log2, log2_rel,
                       p.log2_scale, p.export_scale, pass_stats);
}

// The last step for one row, by the threads holding its merged state: adds
// the sink, normalises, stores 16 bytes of partials' worth of output per
// thread and, from the thread at column 0, exports the row's stats in the
// call's format. Every thread of `mask` calls it (per-group FP8 scales
// reduce across lanes); only `active` ones store.
//
// `out_scale`: load_out_scale's. `pass_stats`: a pass-through row's raw
// stats, exported as they are (no sink).
template <int kVec, StatsFormat kFormat>
__device__ __forceinline__ void finalize_and_store(const MergeParams& p,
                                                   const MergeState<kVec>& state,
                                                   const RowIndex& at, int col, bool active,
                                                   unsigned mask, float out_scale,
                                                   const float* pass_stats = nullptr) {
  const float sink_log2 = row_sink_log2(p, at, active, pass_stats != nullptr);
  float out[kVec], log2_rel;
  const float total = state.finalize(sink_log2, p.log2_scale, out, log2_rel);
  if (is_fp8(p.out_dtype)) scale_fp8(p, out, at, col, active, mask, out_scale);
  if (!active) return;
  store_any(p.out_dtype, p.out, p.out_row.at(at) + col, out);
  if (p.out_stats != nullptr && col == 0) {
    export_stats<kFormat>(p, state, at, total, sink_log2, log2_rel, pass_stats);
  }
}

// The epilogue of a call without sinks, pass-through rows or group scales
// whose output dtype is kOut (any but e4m3fnuz; FP8 with one scale): the
// same values as finalize_and_store, without its branches for sinks, group
// scales and other output dtypes (an LSE row's denominator lies in [1, N],
// so finalize_lse needs no range check). `out_scale`: load_out_scale's,
// loaded before the merge and inverted here, after it, so that no partial's
// load waits for it.
template <int kVec, DType kOut, StatsFormat kFormat>
__device__ __forceinline__ void store_lean(const MergeParams& p, const MergeState<kVec>& state,
                                           const RowIndex& at, int col, bool active,
                                           float out_scale) {
  float out[kVec], log2_rel;
  const float total = kFormat == StatsFormat::kLse
                          ? state.finalize_lse(out, log2_rel)
                          : state.finalize(neg_inf(), p.log2_scale, out, log2_rel);
  if (!active) return;
  if constexpr (is_fp8(kOut)) {
    // 1 / out_scale, rounded as `/` rounds it, but as a volatile instruction:
    // a plain division is loop-invariant, and the compiler hoisted it ahead
    // of the first partial's load, which then waited for the scale's load.
    float inverse_scale;
    asm volatile("rcp.rn.f32 %0, %1;" : "=f"(inverse_scale) : "f"(out_scale));
#pragma unroll
    for (int v = 0; v < kVec; ++v) out[v] = fp8_prepare(out[v], inverse_scale);
  }
  store_out<kVec, kOut>(p.out, p.out_row.at(at) + col, out);
  if (p.out_stats != nullptr && col == 0) {
    export_stats<kFormat>(p, state, at, total, neg_inf(), log2_rel, nullptr);
  }
}

// Whether a call's rows can end in store_lean (the output dtype aside).
inline bool lean_epilogue(const MergeParams& p) {
  return p.sinks == nullptr && p.group_scales == nullptr && p.pass_through_tokens == INT64_MAX;
}

// The output dtypes with lean kernel instances: every one check_problem admits
// but e4m3fnuz (converted in software: instances of their own were an eighth
// of the extension's machine code).
inline bool has_lean_instance(DType out) {
  return static_cast<int>(out) <= static_cast<int>(DType::kFloat8E4M3FN);
}

// A lean kernel's instance for the call's output dtype (has_lean_instance):
// `instance(out)`, `out` a std::integral_constant<DType, ...>, names the
// instance of each.
template <typename Instance>
auto lean_instance(DType out, Instance instance) {
  using D = DType;
  static_assert(static_cast<int>(D::kBFloat16) == 0 && static_cast<int>(D::kFloat16) == 1 &&
                    static_cast<int>(D::kFloat32) == 2 && static_cast<int>(D::kFloat8E4M3FN) == 3,
                "the instances below are in DType order");
  const decltype(instance(std::integral_constant<D, D::kBFloat16>{})) instances[] = {
      instance(std::integral_constant<D, D::kBFloat16>{}),
      instance(std::integral_constant<D, D::kFloat16>{}),
      instance(std::integral_constant<D, D::kFloat32>{}),
      instance(std::integral_constant<D, D::kFloat8E4M3FN>{})};
  return instances[static_cast<int>(out)];
}

// Programmatic dependent launch: wait for the producer's writes before the
// first load; let the next kernel start its prologue once our loads are done.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

// A launch configuration carrying the programmatic-dependent-launch attribute
// (on or off). Not copyable: config.attrs points into the object itself.
struct PdlLaunch {
  cudaLaunchConfig_t config = {};
  cudaLaunchAttribute attribute[1] = {};

  PdlLaunch(unsigned grid, unsigned threads, size_t dynamic_smem_bytes, cudaStream_t stream,
            bool pdl) {
    config.gridDim = dim3(grid);
    config.blockDim = dim3(threads);
    config.dynamicSmemBytes = dynamic_smem_bytes;
    config.stream = stream;
    attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[0].val.programmaticStreamSerializationAllowed = pdl ? 1 : 0;
    config.attrs = attribute;
    config.numAttrs = 1;
  }
  PdlLaunch(const PdlLaunch&) = delete;
  PdlLaunch& operator=(const PdlLaunch&) = delete;
};

}  // namespace kvsplit
