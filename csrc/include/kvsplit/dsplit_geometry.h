// The DSplit family's geometry rules, shared by the CUDA launcher and the CPU
// implementation so that both accept exactly the same configs.
#pragma once

#include "kvsplit/dispatch.h"

namespace kvsplit {

constexpr int kDsplitMaxThreads = 512;

// log2 of a power of two, -1 for anything else.
inline int exact_log2(int value) {
  if (value < 1) return -1;
  int log2 = 0;
  while ((1 << log2) < value) ++log2;
  return (1 << log2) == value ? log2 : -1;
}

// Threads per group (16-byte vectors per slice) of a DSplit config; throws
// std::invalid_argument naming the bad value. A group lies within one warp
// (1..32 lanes), a CTA has 32..512 threads, all powers of two, and a round
// loads 4 or 8 partials.
inline int dsplit_lanes(int head_dim, int elem_bytes, int slices, int kv_split, int depth) {
  if (depth != 4 && depth != 8) throw_unsupported("depth", depth);
  const int vec = 16 / elem_bytes;
  if (exact_log2(slices) < 0 || head_dim % (slices * vec) != 0 ||
      head_dim / (slices * vec) > 32) {
    throw_unsupported("slices (head_dim / slices must be 1..32 vectors of 16 bytes)", slices);
  }
  const int lanes = head_dim / (slices * vec);
  if (exact_log2(lanes) < 0) throw_unsupported("slices (lanes must be a power of two)", slices);
  const int threads = lanes * kv_split;
  if (exact_log2(kv_split) < 0 || threads < 32 || threads > kDsplitMaxThreads) {
    throw_unsupported("kv_split (lanes * kv_split must be 32..512 threads)", kv_split);
  }
  return lanes;
}

}  // namespace kvsplit
