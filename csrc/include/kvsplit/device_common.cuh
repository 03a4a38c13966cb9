// Device helpers shared by both kernel families: dtype mapping, 16-byte
// packed loads and stores, a row's output epilogue, and programmatic
// dependent launch.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kvsplit/merge_math.h"
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

template <int kVec, DType kDType>
__device__ __forceinline__ void store_vec(void* base, int64_t offset, const float (&src)[kVec]) {
  static_assert(kVec % 2 == 0, "stores go in pairs");
  using T = typename CudaType<kDType>::type;
  uint32_t words[kVec / 2];
#pragma unroll
  for (int i = 0; i < kVec / 2; ++i) {
    if constexpr (kDType == DType::kBFloat16) {
      const __nv_bfloat162 pair = __floats2bfloat162_rn(src[2 * i], src[2 * i + 1]);
      words[i] = *reinterpret_cast<const uint32_t*>(&pair);
    } else {
      static_assert(kDType == DType::kFloat16, "outputs are 16-bit");
      const __half2 pair = __floats2half2_rn(src[2 * i], src[2 * i + 1]);
      words[i] = *reinterpret_cast<const uint32_t*>(&pair);
    }
  }
  T* dst = static_cast<T*>(base) + offset;
  if constexpr (kVec == 8) {
    *reinterpret_cast<uint4*>(dst) = make_uint4(words[0], words[1], words[2], words[3]);
  } else if constexpr (kVec == 4) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(words[0], words[1]);
  } else {
    *reinterpret_cast<uint32_t*>(dst) = words[0];
  }
}

// The last step for one row, by the threads holding its merged state: adds
// the sink, normalises, stores 16 bytes of output per thread and, from the
// thread at column 0, exports the row's stats in the call's format.
template <int kVec, DType kOut, StatsFormat kFormat>
__device__ __forceinline__ void finalize_and_store(const MergeParams& p,
                                                   const MergeState<kVec>& state,
                                                   const RowIndex& at, int col) {
  const float sink_log2 = p.sinks != nullptr ? __ldg(p.sinks + row_head(p, at)) * kLog2E : neg_inf();
  float out[kVec], log2_total;
  const float total = state.finalize(sink_log2, out, log2_total);
  store_vec<kVec, kOut>(p.out, p.out_row.at(at) + col, out);
  if (p.out_stats != nullptr && col == 0) {
    float* stats = p.out_stats + p.out_stats_row.at(at);
    if constexpr (kFormat == StatsFormat::kMaxSum) {
      stats[0] = state.m * p.export_scale;
      stats[1] = total;
    } else {
      stats[0] = log2_total * p.export_scale;
    }
  }
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
