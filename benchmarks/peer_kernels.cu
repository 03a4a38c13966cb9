// Peer merges of attention states that kvsplit's Few family is measured against
// (N = 2 to 16), written here from the math and from the designs the engines'
// public headers describe, not copied: compiled by benchmarks/peers_cuda.py with
// nvcc into a shared library of its own (never the product's extension), called
// through ctypes with raw pointers. bf16 or fp16 states and outputs, float32 LSE.
//
// * two_state_vllm: vLLM's CUDA merge_attn_states design: one thread per 16
//   bytes of a (token, head) row, a grid of 128-thread CTAs over every such
//   vector; each thread reads both LSEs of its row (natural log; +inf is an
//   empty state, as FlashAttention 2 writes it), takes the max, two exps, and
//   writes its 16 bytes; the row's first thread writes the merged LSE.
// * states_flashinfer: FlashInfer's MergeState / MergeStates design: one CTA per
//   token, a block of (bdx, bdy) threads, bdx = the row's 16-byte vectors over
//   ceil(vectors / 32) chunks a thread (one warp-wide vector per (token,
//   head)), bdy heads; LSE in base 2. Two states: both states' vectors and
//   LSEs loaded up front, then the merge; N states: the online update over the
//   states in order. FlashInfer's kernel fails to launch past 1024 threads
//   (more than 64 heads at D = 128); here the heads go over gridDim.y so that
//   every shape of the benchmark runs.
//
// Strides are in elements; a row is (token, head). Returns a cudaError_t.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

// A (tokens, heads, head_dim) call: strides in elements (floats for LSEs).
struct RowLayout {
  int64_t tokens, heads;
  int32_t head_dim;
  int64_t o_token, o_head;      // the states'
  int64_t lse_token, lse_head;  // their LSEs'
  int64_t out_token, out_head;  // the output's (the merged LSE is token-major, contiguous)
};

namespace {

template <bool kBf16>
__device__ __forceinline__ void to_float(const uint4& v, float (&f)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (kBf16) {
      const __nv_bfloat162 pair = *reinterpret_cast<const __nv_bfloat162*>(&w[i]);
      const float2 x = __bfloat1622float2(pair);
      f[2 * i] = x.x, f[2 * i + 1] = x.y;
    } else {
      const __half2 pair = *reinterpret_cast<const __half2*>(&w[i]);
      const float2 x = __half22float2(pair);
      f[2 * i] = x.x, f[2 * i + 1] = x.y;
    }
  }
}

template <bool kBf16>
__device__ __forceinline__ uint4 from_float(const float (&f)[8]) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (kBf16) {
      const __nv_bfloat162 pair = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
      w[i] = *reinterpret_cast<const uint32_t*>(&pair);
    } else {
      const __half2 pair = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
      w[i] = *reinterpret_cast<const uint32_t*>(&pair);
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// -- vLLM's design ---------------------------------------------------------------------------

template <bool kBf16>
__global__ void __launch_bounds__(128)
    two_state_vllm_kernel(const uint16_t* o_a, const float* lse_a, const uint16_t* o_b,
                          const float* lse_b, uint16_t* out, float* out_lse, RowLayout at) {
  const int vectors = at.head_dim / 8;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (item >= at.tokens * at.heads * vectors) return;
  const int vec = static_cast<int>(item % vectors);
  const int64_t row = item / vectors;
  const int64_t head = row % at.heads;
  const int64_t token = row / at.heads;
  float p = lse_a[token * at.lse_token + head * at.lse_head];
  float s = lse_b[token * at.lse_token + head * at.lse_head];
  p = isinf(p) ? -INFINITY : p;  // +inf: an empty state
  s = isinf(s) ? -INFINITY : s;
  const int64_t o_at = token * at.o_token + head * at.o_head + vec * 8;
  const uint4 a = *reinterpret_cast<const uint4*>(o_a + o_at);
  const uint4 b = *reinterpret_cast<const uint4*>(o_b + o_at);
  const float top = fmaxf(p, s);
  const float anchor = top == -INFINITY ? 0.f : top;
  const float pw = __expf(p - anchor), sw = __expf(s - anchor);
  const float total = pw + sw;
  const float pa = total > 0.f ? pw / total : 0.f, sb = total > 0.f ? sw / total : 0.f;
  float fa[8], fb[8], r[8];
  to_float<kBf16>(a, fa);
  to_float<kBf16>(b, fb);
#pragma unroll
  for (int i = 0; i < 8; ++i) r[i] = fa[i] * pa + fb[i] * sb;
  *reinterpret_cast<uint4*>(out + token * at.out_token + head * at.out_head + vec * 8) =
      from_float<kBf16>(r);
  if (out_lse != nullptr && vec == 0) {
    out_lse[token * at.heads + head] = total > 0.f ? __logf(total) + anchor : -INFINITY;
  }
}

// -- FlashInfer's design ---------------------------------------------------------------------

// kChunks 16-byte vectors a thread (bdx = ceil(vectors / kChunks) <= 32 threads a row).
template <bool kBf16, int kChunks>
__global__ void two_state_flashinfer_kernel(const uint16_t* o_a, const float* lse_a,
                                            const uint16_t* o_b, const float* lse_b,
                                            uint16_t* out, float* out_lse, RowLayout at) {
  const int64_t token = blockIdx.x;
  const int64_t head = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y;
  if (head >= at.heads) return;
  const int vectors = at.head_dim / 8;
  const int64_t o_row = token * at.o_token + head * at.o_head;
  uint4 a[kChunks], b[kChunks];
  const float s_a = lse_a[token * at.lse_token + head * at.lse_head];
  const float s_b = lse_b[token * at.lse_token + head * at.lse_head];
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int vec = threadIdx.x * kChunks + c;
    if (vec < vectors) {
      a[c] = *reinterpret_cast<const uint4*>(o_a + o_row + vec * 8);
      b[c] = *reinterpret_cast<const uint4*>(o_b + o_row + vec * 8);
    }
  }
  const float top = fmaxf(s_a, s_b);
  const float anchor = top == -INFINITY ? 0.f : top;
  const float wa = exp2f(s_a - anchor), wb = exp2f(s_b - anchor);
  const float total = wa + wb;
  const float fa_w = total > 0.f ? wa / total : 0.f, fb_w = total > 0.f ? wb / total : 0.f;
  const int64_t out_row = token * at.out_token + head * at.out_head;
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int vec = threadIdx.x * kChunks + c;
    if (vec >= vectors) continue;
    float fa[8], fb[8], r[8];
    to_float<kBf16>(a[c], fa);
    to_float<kBf16>(b[c], fb);
#pragma unroll
    for (int i = 0; i < 8; ++i) r[i] = fa[i] * fa_w + fb[i] * fb_w;
    *reinterpret_cast<uint4*>(out + out_row + vec * 8) = from_float<kBf16>(r);
  }
  if (out_lse != nullptr && threadIdx.x == 0) {
    out_lse[token * at.heads + head] = total > 0.f ? log2f(total) + anchor : -INFINITY;
  }
}

template <bool kBf16, int kChunks>
__global__ void states_flashinfer_kernel(const uint16_t* o, const float* lse, int num_states,
                                         int64_t o_state, int64_t lse_state, uint16_t* out,
                                         float* out_lse, RowLayout at) {
  const int64_t token = blockIdx.x;
  const int64_t head = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y;
  if (head >= at.heads) return;
  const int vectors = at.head_dim / 8;
  const int64_t o_row = token * at.o_token + head * at.o_head;
  const int64_t lse_row = token * at.lse_token + head * at.lse_head;
  float m = -INFINITY, d = 0.f, acc[kChunks][8] = {};
  for (int i = 0; i < num_states; ++i) {
    const float s = lse[i * lse_state + lse_row];
    uint4 v[kChunks];
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int vec = threadIdx.x * kChunks + c;
      v[c] = vec < vectors ? *reinterpret_cast<const uint4*>(o + i * o_state + o_row + vec * 8)
                           : make_uint4(0, 0, 0, 0);
    }
    const float m_new = fmaxf(m, s);
    const float anchor = m_new == -INFINITY ? 0.f : m_new;
    const float scale = exp2f(m - anchor), w = exp2f(s - anchor);
    d = d * scale + w;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      float f[8];
      to_float<kBf16>(v[c], f);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[c][e] = acc[c][e] * scale + f[e] * w;
    }
    m = m_new;
  }
  const float inv = d > 0.f ? 1.f / d : 0.f;
  const int64_t out_row = token * at.out_token + head * at.out_head;
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int vec = threadIdx.x * kChunks + c;
    if (vec >= vectors) continue;
    float r[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) r[e] = acc[c][e] * inv;
    *reinterpret_cast<uint4*>(out + out_row + vec * 8) = from_float<kBf16>(r);
  }
  if (out_lse != nullptr && threadIdx.x == 0) {
    out_lse[token * at.heads + head] = d > 0.f ? log2f(d) + m : -INFINITY;
  }
}

template <typename Launch>
cudaError_t with_chunks(int chunks, Launch&& launch) {
  switch (chunks) {
    case 1: return launch(std::integral_constant<int, 1>{});
    case 2: return launch(std::integral_constant<int, 2>{});
    case 3: return launch(std::integral_constant<int, 3>{});
    case 4: return launch(std::integral_constant<int, 4>{});
    default: return cudaErrorInvalidValue;
  }
}

// (bdx, bdy) and the grid of FlashInfer's design for `at`.
void flashinfer_grid(const RowLayout& at, int chunks, dim3& grid, dim3& block) {
  const int vectors = at.head_dim / 8;
  const int bdx = (vectors + chunks - 1) / chunks;
  const int bdy = static_cast<int>(at.heads < 1024 / bdx ? at.heads : 1024 / bdx);
  block = dim3(bdx, bdy);
  grid = dim3(static_cast<unsigned>(at.tokens), static_cast<unsigned>((at.heads + bdy - 1) / bdy));
}

}  // namespace

extern "C" {

// The states' 16-byte vectors per row: head_dim / 8 (bf16, fp16); chunks a
// FlashInfer thread holds: ceil(vectors / 32).
int peer_chunks(int head_dim) { return (head_dim / 8 + 31) / 32; }

int peer_two_state_vllm(const void* o_a, const float* lse_a, const void* o_b, const float* lse_b,
                        void* out, float* out_lse, RowLayout at, int bf16, void* stream) {
  if (at.head_dim % 8) return cudaErrorInvalidValue;
  if (at.tokens * at.heads == 0) return 0;
  const int64_t items = at.tokens * at.heads * (at.head_dim / 8);
  const unsigned grid = static_cast<unsigned>((items + 127) / 128);
  const auto s = static_cast<cudaStream_t>(stream);
  const auto* a = static_cast<const uint16_t*>(o_a);
  const auto* b = static_cast<const uint16_t*>(o_b);
  auto* o = static_cast<uint16_t*>(out);
  if (bf16) {
    two_state_vllm_kernel<true><<<grid, 128, 0, s>>>(a, lse_a, b, lse_b, o, out_lse, at);
  } else {
    two_state_vllm_kernel<false><<<grid, 128, 0, s>>>(a, lse_a, b, lse_b, o, out_lse, at);
  }
  return cudaGetLastError();
}

int peer_two_state_flashinfer(const void* o_a, const float* lse_a, const void* o_b,
                              const float* lse_b, void* out, float* out_lse, RowLayout at,
                              int bf16, void* stream) {
  if (at.head_dim % 8 || at.head_dim / 8 > 128) return cudaErrorInvalidValue;
  if (at.tokens * at.heads == 0) return 0;
  const int chunks = peer_chunks(at.head_dim);
  dim3 grid, block;
  flashinfer_grid(at, chunks, grid, block);
  const auto s = static_cast<cudaStream_t>(stream);
  const auto* a = static_cast<const uint16_t*>(o_a);
  const auto* b = static_cast<const uint16_t*>(o_b);
  auto* o = static_cast<uint16_t*>(out);
  const cudaError_t error = with_chunks(chunks, [&](auto k) {
    constexpr int kChunks = decltype(k)::value;
    if (bf16) {
      two_state_flashinfer_kernel<true, kChunks><<<grid, block, 0, s>>>(a, lse_a, b, lse_b, o,
                                                                        out_lse, at);
    } else {
      two_state_flashinfer_kernel<false, kChunks><<<grid, block, 0, s>>>(a, lse_a, b, lse_b, o,
                                                                         out_lse, at);
    }
    return cudaGetLastError();
  });
  return error;
}

int peer_states_flashinfer(const void* o, const float* lse, int num_states, int64_t o_state,
                           int64_t lse_state, void* out, float* out_lse, RowLayout at, int bf16,
                           void* stream) {
  if (at.head_dim % 8 || at.head_dim / 8 > 128) return cudaErrorInvalidValue;
  if (at.tokens * at.heads == 0) return 0;
  const int chunks = peer_chunks(at.head_dim);
  dim3 grid, block;
  flashinfer_grid(at, chunks, grid, block);
  const auto s = static_cast<cudaStream_t>(stream);
  const auto* v = static_cast<const uint16_t*>(o);
  auto* w = static_cast<uint16_t*>(out);
  return with_chunks(chunks, [&](auto k) {
    constexpr int kChunks = decltype(k)::value;
    if (bf16) {
      states_flashinfer_kernel<true, kChunks><<<grid, block, 0, s>>>(v, lse, num_states, o_state,
                                                                     lse_state, w, out_lse, at);
    } else {
      states_flashinfer_kernel<false, kChunks><<<grid, block, 0, s>>>(v, lse, num_states, o_state,
                                                                      lse_state, w, out_lse, at);
    }
    return cudaGetLastError();
  });
}

}  // extern "C"
