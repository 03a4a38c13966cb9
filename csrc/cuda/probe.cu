// Reference kernels for the benchmarks, not used by the merge path:
// - an empty kernel: the cost of a launch in graph replay;
// - a read probe: reads every input byte once and writes every output byte,
//   with all loads independent and spread over the whole GPU, and at least
//   as many threads as output chunks, so that each stores at most one (as a
//   merge of two states does). No merge of the same bytes should be faster,
//   so best / probe is how far a merge is from the hardware at that shape;
// - a producer that writes partials like an attention kernel, to chain with
//   the merge (programmatic dependent launch on and off).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kvsplit/device_common.cuh"
#include "kvsplit/probe.h"

namespace kvsplit {
namespace {

constexpr int kProbeThreads = 256;
constexpr int kProbeChunksPerThread = 4;
constexpr uint32_t kUnlikely = 0x9e3779b9u;

__global__ void noop_kernel() {}

__device__ __forceinline__ uint32_t fold(const uint4& v) { return v.x ^ v.y ^ v.z ^ v.w; }

// Chunk c < o_chunks is partial_o's, then stats' up to in_chunks. Each
// thread issues all of its loads (predicated, no branch) before using any,
// then stores output chunks tid, tid + threads, ... (one where threads >=
// out_chunks); the XOR of what it read decides a store that never happens in
// practice but that the compiler cannot drop. Index: int where every chunk
// index fits, so that the address arithmetic is 32-bit.
template <typename Index>
__global__ void __launch_bounds__(kProbeThreads)
    read_probe_kernel(const uint4* o, Index o_chunks, const uint4* stats, Index in_chunks,
                      uint4* out, Index out_chunks, Index threads) {
  const Index tid = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x;
  uint4 loaded[kProbeChunksPerThread];
#pragma unroll
  for (int u = 0; u < kProbeChunksPerThread; ++u) {
    const Index c = tid + u * threads;
    const uint4* from = c < o_chunks ? o + c : stats + (c - o_chunks);
    loaded[u] = make_uint4(0, 0, 0, 0);
    if (c < in_chunks) loaded[u] = __ldg(from);
  }
  uint32_t folded = 0;
#pragma unroll
  for (int u = 0; u < kProbeChunksPerThread; ++u) folded ^= fold(loaded[u]);
#pragma unroll 1  // no trip count to divide out: most threads store once, if at all
  for (Index c = tid; c < out_chunks; c += threads) out[c] = loaded[0];
  if (folded == kUnlikely && out_chunks > 0) out[0].x = folded;
}

__device__ __forceinline__ uint32_t mix(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// A uniform value in [lo, hi) from (index, seed).
__device__ __forceinline__ float uniform(uint32_t index, uint32_t seed, float lo, float hi) {
  return lo + (hi - lo) * (mix(index * 2654435761u + seed) >> 8) * (1.f / 16777216.f);
}

__global__ void __launch_bounds__(kProbeThreads)
    producer_kernel(uint4* o, int64_t o_vecs, float2* stats, int64_t num_stats, uint32_t seed) {
  pdl_wait();  // the previous merge may still be reading these buffers
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < o_vecs;
       i += stride) {
    uint32_t words[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const uint32_t index = static_cast<uint32_t>(i * 8 + 2 * w);
      const __nv_bfloat162 pair = __floats2bfloat162_rn(uniform(index, seed, -1.f, 1.f),
                                                        uniform(index + 1, seed, -1.f, 1.f));
      words[w] = *reinterpret_cast<const uint32_t*>(&pair);
    }
    o[i] = make_uint4(words[0], words[1], words[2], words[3]);
    if (i < num_stats) {
      const uint32_t index = static_cast<uint32_t>(i);
      stats[i] = make_float2(uniform(index, seed ^ 0x5bd1e995u, -2.f, 2.f),
                             uniform(index, seed ^ 0x1b873593u, 1.f, 65.f));
    }
  }
  pdl_trigger();
}

int64_t blocks_for(int64_t threads) { return (threads + kProbeThreads - 1) / kProbeThreads; }

Status cuda_status(cudaError_t error) {
  return error == cudaSuccess ? Status{} : fail(Error::kCuda, error);
}

}  // namespace

Status launch_noop(int grid, void* stream) {
  noop_kernel<<<grid, 32, 0, static_cast<cudaStream_t>(stream)>>>();
  return cuda_status(cudaGetLastError());
}

Status launch_read_probe(const void* partial_o, int64_t o_bytes, const void* stats,
                      int64_t stats_bytes, void* out, int64_t out_bytes, void* stream,
                      bool store_per_thread) {
  // Whole 16-byte chunks only: a stats tail under 16 bytes is left unread.
  const int64_t o_chunks = o_bytes / 16;
  const int64_t stats_chunks = stats_bytes / 16;
  const int64_t out_chunks = out_bytes / 16;
  int64_t threads = (o_chunks + stats_chunks + kProbeChunksPerThread - 1) / kProbeChunksPerThread;
  // With a thread per input quad alone, an output over a quarter of the inputs
  // (two states writing 16-bit values: half) is stored in a loop after all of
  // a thread's loads, by half a merge's threads: a hand-written two-state
  // merge ran at 0.81-0.92x such a probe (benchmarks/lab/lab_store.py).
  if (store_per_thread && out_chunks > threads) threads = out_chunks;
  if (threads < 1) return Status{};
  const auto grid = static_cast<unsigned>(blocks_for(threads));
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
  const auto* o = static_cast<const uint4*>(partial_o);
  const auto* s = static_cast<const uint4*>(stats);
  auto* to = static_cast<uint4*>(out);
  const int64_t in_chunks = o_chunks + stats_chunks;
  // The largest index a thread forms: its last load's or its last store's.
  if (kProbeChunksPerThread * threads + out_chunks <= INT32_MAX) {
    read_probe_kernel<int><<<grid, kProbeThreads, 0, cuda_stream>>>(
        o, static_cast<int>(o_chunks), s, static_cast<int>(in_chunks), to,
        static_cast<int>(out_chunks), static_cast<int>(threads));
  } else {
    read_probe_kernel<int64_t><<<grid, kProbeThreads, 0, cuda_stream>>>(
        o, o_chunks, s, in_chunks, to, out_chunks, threads);
  }
  return cuda_status(cudaGetLastError());
}

Status launch_producer(void* partial_o, int64_t o_elems, float* stats, int64_t num_stats, int seed,
                    bool pdl, void* stream) {
  const int64_t o_vecs = o_elems / 8;
  const int64_t threads = o_vecs > num_stats ? o_vecs : num_stats;
  int64_t blocks = blocks_for(threads);
  if (blocks > 8192) blocks = 8192;
  if (blocks < 1) return Status{};
  PdlLaunch launch(static_cast<unsigned>(blocks), kProbeThreads, 0,
                   static_cast<cudaStream_t>(stream), pdl);
  return cuda_status(cudaLaunchKernelEx(
      &launch.config, producer_kernel, static_cast<uint4*>(partial_o), o_vecs,
      reinterpret_cast<float2*>(stats), num_stats, static_cast<uint32_t>(seed)));
}

}  // namespace kvsplit
