// Lab: what a float32 output's store costs a two-state merge, by the way a
// warp's lanes map onto the row (benchmarks/lab/lab_store.py). Each variant
// is the same hand merge of two bf16 states with base-2 LSE stats; they
// differ in the bytes a lane loads of each state and how it stores:
//   0 bf16   16-byte loads, one 16-byte bf16 store a lane
//   1 two    16-byte loads, float32 as two 16-byte stores a lane
//   2 pair   16-byte loads, float32 stored with the lane pair's halves traded
//            (how the product stored float32 before its lean kernel took
//            8-byte loads for it)
//   3 w8     8-byte loads, one 16-byte float32 store a lane
//   4 w8bf   8-byte loads, one 8-byte bf16 store a lane
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
__global__ void __launch_bounds__(kThreads)
    store_kernel(const __nv_bfloat16* o, const float* lse, void* out, int rows, int head_dim,
                 int64_t o_split, FastDivmod lanes) {
  constexpr int kVec = kLoadBytes / 2;
  const uint32_t thread = blockIdx.x * blockDim.x + threadIdx.x;
  const uint32_t row = lanes.div(thread);
  const int lane = static_cast<int>(thread - row * lanes.divisor);
  const bool active = row < static_cast<uint32_t>(rows);
  const int64_t at = static_cast<int64_t>(active ? row : 0) * head_dim + lane * kVec;
  const Packed<kLoadBytes> a = kvsplit::load_packed<kLoadBytes>(o + at);
  const Packed<kLoadBytes> b = kvsplit::load_packed<kLoadBytes>(o + o_split + at);
  const float m0 = __ldg(lse + (active ? row : 0));
  const float m1 = __ldg(lse + rows + (active ? row : 0));
  const float top = fmaxf(m0, m1);
  const float w0 = kvsplit::fast_exp2(m0 - top), w1 = kvsplit::fast_exp2(m1 - top);
  const float inverse = __fdividef(1.f, w0 + w1);
  float v[kVec];
#pragma unroll
  for (int e = 0; e < kVec; ++e) {
    v[e] = (w0 * kvsplit::unpack<kvsplit::DType::kBFloat16>(a, e) +
            w1 * kvsplit::unpack<kvsplit::DType::kBFloat16>(b, e)) * inverse;
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
  // bf16 (0, 4) or float32 (1, 3) in accesses of up to 16 bytes, as the product stores.
  constexpr auto kOut = kStore == 0 || kStore == 4 ? kvsplit::DType::kBFloat16 : kvsplit::DType::kFloat32;
  kvsplit::store_out<kVec, kOut>(out, at, v);
}

template <int kLoadBytes, int kStore>
int launch(const void* o, const float* lse, void* out, int rows, int head_dim, cudaStream_t stream) {
  const int lanes = head_dim * 2 / kLoadBytes;
  const int64_t threads = static_cast<int64_t>(rows) * lanes;
  const auto ctas = static_cast<unsigned>((threads + kThreads - 1) / kThreads);
  store_kernel<kLoadBytes, kStore><<<ctas, kThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(o), lse, out, rows, head_dim,
      static_cast<int64_t>(rows) * head_dim, FastDivmod(static_cast<uint32_t>(lanes)));
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

// o: (2, rows, head_dim) bf16; lse: (2, rows) base 2; out: (rows, head_dim), float32 for
// variants 1-3, bf16 for 0 and 4.
extern "C" int lab_store(int variant, const void* o, const float* lse, void* out, int rows,
                         int head_dim, void* raw_stream) {
  const auto stream = static_cast<cudaStream_t>(raw_stream);
  switch (variant) {
    case 0: return launch<16, 0>(o, lse, out, rows, head_dim, stream);
    case 1: return launch<16, 1>(o, lse, out, rows, head_dim, stream);
    case 2: return launch<16, 2>(o, lse, out, rows, head_dim, stream);
    case 3: return launch<8, 3>(o, lse, out, rows, head_dim, stream);
    case 4: return launch<8, 4>(o, lse, out, rows, head_dim, stream);
    default: return -1;
  }
}
