// The benchmarks' reference kernels (csrc/cuda/probe.cu), built into the
// kvsplit._bench module (KVSPLIT_BENCH_KERNELS), never into the merge path.
#pragma once

#include <cstdint>

#include "kvsplit/config.h"

namespace kvsplit {

// An empty kernel of `grid` CTAs: the launch cost that bounds every merge from below.
Status launch_noop(int grid, void* stream);
// Reads every byte of the partials and stats once and writes every output
// byte: the time no merge should beat. Its threads each read up to four
// 16-byte chunks and, with `store_per_thread`, number at least the output's
// chunks; without it (the lab's former probe), a quarter of the input's.
Status launch_read_probe(const void* partial_o, int64_t o_bytes, const void* stats,
                         int64_t stats_bytes, void* out, int64_t out_bytes, void* stream,
                         bool store_per_thread = true);
// Writes bf16 partials (values in [-1, 1)) and maxsum stats, like the
// attention kernel before a merge, for chained (PDL) benchmarks.
Status launch_producer(void* partial_o, int64_t o_elems, float* stats, int64_t num_stats,
                       int seed, bool pdl, void* stream);

}  // namespace kvsplit
