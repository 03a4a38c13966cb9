// Lab: what a float32 or FP8 output's store costs a two-state merge, by the
// way a warp's lanes map onto the row (benchmarks/lab/lab_store.py). Each variant
// is the same hand merge of two bf16 states with base-2 LSE stats; they
// differ in the bytes a lane loads of each state and how it stores:
//   0 bf16   16-byte loads, one 16-byte bf16 store a lane
//   1 two    16-byte loads, float32 as two 16-byte stores a lane
//   2 pair   16-byte loads, float32 stored with the lane pair's halves traded
//            (how the product stored float32 before its lean kernel took
//            8-byte loads for it)
//   3 w8     8-byte loads, one 16-byte float32 store a lane
//   4 w8bf   8-byte loads, one 8-byte bf16 store a lane
//   5 fp8    16-byte loads, one 8-byte FP8 e4m3fn store a lane (the product's
//            lean kernel)
//   6 fp8w32 32 contiguous bytes of each state a lane (two 16-byte loads),
//            one 16-byte FP8 store a lane
//   7 fp8pair 16-byte loads; the even lane of a pair stores its own 8 FP8
//            bytes and its neighbour's in one 16-byte store
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kvsplit/device_common.cuh"
#include "kvsplit/few_geometry.h"
#include "kvsplit/merge_math.h"

namespace {

using kvsplit::FastDivmod;
using kvsplit::Packed;

constexpr int kThreads = 256;

template <int kLoadBytes, int kStore>
__global__ void __launch_bounds__(kThreads, 6)
    store_kernel(const __nv_bfloat16* o, const float* lse, void* out, const float* out_scale, int rows,
                 int head_dim, int64_t o_split, FastDivmod lanes) {
  constexpr int kVec = kLoadBytes / 2;
  // Loads of up to 16 bytes; 32 bytes a lane are two adjacent ones.
  constexpr int kChunk = kLoadBytes < 16 ? kLoadBytes : 16;
  constexpr int kChunks = kLoadBytes / kChunk;
  constexpr int kChunkVec = kChunk / 2;
  const uint32_t thread = blockIdx.x * blockDim.x + threadIdx.x;
  const uint32_t row = lanes.div(thread);
  const int lane = static_cast<int>(thread - row * lanes.divisor);
  const bool active = row < static_cast<uint32_t>(rows);
  const int64_t at = static_cast<int64_t>(active ? row : 0) * head_dim + lane * kVec;
  // Issued first, as the product does, so that its latency hides behind the partials'
  // (a volatile load: ptxas sank an __ldg of the 32-byte variant to its store).
  float scale = 1.f;
  if constexpr (kStore >= 5) asm volatile("ld.global.nc.f32 %0, [%1];" : "=f"(scale) : "l"(out_scale));
  Packed<kChunk> a[kChunks], b[kChunks];
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    a[c] = kvsplit::load_packed<kChunk>(o + at + c * kChunkVec);
    b[c] = kvsplit::load_packed<kChunk>(o + o_split + at + c * kChunkVec);
  }
  const float m0 = __ldg(lse + (active ? row : 0));
  const float m1 = __ldg(lse + rows + (active ? row : 0));
  const float top = fmaxf(m0, m1);
  const float w0 = kvsplit::fast_exp2(m0 - top), w1 = kvsplit::fast_exp2(m1 - top);
  const float inverse = __fdividef(1.f, w0 + w1);
  float v[kVec];
#pragma unroll
  for (int e = 0; e < kVec; ++e) {
    v[e] = (w0 * kvsplit::unpack<kvsplit::DType::kBFloat16>(a[e / kChunkVec], e % kChunkVec) +
            w1 * kvsplit::unpack<kvsplit::DType::kBFloat16>(b[e / kChunkVec], e % kChunkVec)) * inverse;
  }
  if constexpr (kStore >= 5) {
    // FP8 with a per-tensor scale, as the product converts it.
    const float inverse_scale = 1.f / scale;
#pragma unroll
    for (int e = 0; e < kVec; ++e) v[e] = kvsplit::fp8_prepare(v[e], inverse_scale);
  }
  if constexpr (kStore == 7) {
    uint32_t words[2];
    kvsplit::pack_out<kVec, kvsplit::DType::kFloat8E4M3FN>(v, words);
    const uint32_t next0 = __shfl_down_sync(0xffffffffu, words[0], 1);
    const uint32_t next1 = __shfl_down_sync(0xffffffffu, words[1], 1);
    if (!active || (lane & 1)) return;
    *reinterpret_cast<uint4*>(static_cast<uint8_t*>(out) + at) = make_uint4(words[0], words[1], next0, next1);
    return;
  }
  if constexpr (kStore == 2) {
    // Every lane of the warp trades; a lane past the rows stores nothing.
    float keep[4], got[4];
    const bool odd = lane & 1;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      keep[i] = odd ? v[4 + i] : v[i];
      got[i] = __shfl_xor_sync(0xffffffffu, odd ? v[i] : v[4 + i], 1);
    }
    if (!active) return;
    // Selected per element: a select of whole float4 values made ptxas split
    // one store into four 4-byte ones.
    float lo[4], hi[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      lo[i] = odd ? got[i] : keep[i];
      hi[i] = odd ? keep[i] : got[i];
    }
    float4* first = reinterpret_cast<float4*>(static_cast<float*>(out) + at - (odd ? 4 : 0));
    first[0] = make_float4(lo[0], lo[1], lo[2], lo[3]);
    first[2] = make_float4(hi[0], hi[1], hi[2], hi[3]);
    return;
  }
  if (!active) return;
  // bf16 (0, 4), float32 (1, 3) or FP8 (5, 6) in accesses of up to 16 bytes, as the product stores.
  constexpr auto kOut = kStore == 0 || kStore == 4 ? kvsplit::DType::kBFloat16
                        : kStore >= 5          ? kvsplit::DType::kFloat8E4M3FN
                                               : kvsplit::DType::kFloat32;
  kvsplit::store_out<kVec, kOut>(out, at, v);
}

template <int kLoadBytes, int kStore>
int launch(const void* o, const float* lse, void* out, const float* out_scale, int rows, int head_dim,
           cudaStream_t stream) {
  if (head_dim * 2 % kLoadBytes != 0 || (kStore == 7 && head_dim % 16 != 0)) return 1;
  const int lanes = head_dim * 2 / kLoadBytes;
  const int64_t threads = static_cast<int64_t>(rows) * lanes;
  const auto ctas = static_cast<unsigned>((threads + kThreads - 1) / kThreads);
  store_kernel<kLoadBytes, kStore><<<ctas, kThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(o), lse, out, out_scale, rows, head_dim,
      static_cast<int64_t>(rows) * head_dim, FastDivmod(static_cast<uint32_t>(lanes)));
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

// o: (2, rows, head_dim) bf16; lse: (2, rows) base 2; out: (rows, head_dim), float32 for
// variants 1-3, bf16 for 0 and 4, FP8 e4m3fn for 5-7 (out_scale: its per-tensor scale, one
// float on the device).
extern "C" int lab_store(int variant, const void* o, const float* lse, void* out, const float* out_scale,
                         int rows, int head_dim, void* raw_stream) {
  const auto stream = static_cast<cudaStream_t>(raw_stream);
  switch (variant) {
    case 0: return launch<16, 0>(o, lse, out, out_scale, rows, head_dim, stream);
    case 1: return launch<16, 1>(o, lse, out, out_scale, rows, head_dim, stream);
    case 2: return launch<16, 2>(o, lse, out, out_scale, rows, head_dim, stream);
    case 3: return launch<8, 3>(o, lse, out, out_scale, rows, head_dim, stream);
    case 4: return launch<8, 4>(o, lse, out, out_scale, rows, head_dim, stream);
    case 5: return launch<16, 5>(o, lse, out, out_scale, rows, head_dim, stream);
    case 6: return launch<32, 6>(o, lse, out, out_scale, rows, head_dim, stream);
    case 7: return launch<16, 7>(o, lse, out, out_scale, rows, head_dim, stream);
    default: return -1;
  }
}
