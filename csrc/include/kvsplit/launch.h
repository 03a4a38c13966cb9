// Non-template entry points that the binding calls. They take the stream as
// a plain pointer and return CUDA errors as ints so that the binding compiles
// with the host C++ compiler alone, with no CUDA headers.
#pragma once

#include <cstdint>
#include <string>

#include "kvsplit/params.h"

namespace kvsplit {

// Merges on the CPU with the same K-group structure as the CUDA kernel.
// Throws std::invalid_argument for an unsupported configuration.
void merge_cpu(const MergeParams& params, const KernelChoice& choice);

#if defined(KVSPLIT_WITH_CUDA)
// Enqueues the merge on `stream` (a cudaStream_t); returns a cudaError_t value.
int merge_cuda(const MergeParams& params, const KernelChoice& choice, int sm_count, bool pdl,
               void* stream);
std::string cuda_error_string(int status);
// An empty kernel of `grid` CTAs: the launch cost that bounds every merge from below.
int launch_noop(int grid, void* stream);
// Reads every byte of the partials and stats once and writes every output
// byte: the time no merge can beat.
int launch_read_probe(const void* partial_o, int64_t o_bytes, const void* stats,
                      int64_t stats_bytes, void* out, int64_t out_bytes, void* stream);
// Writes bf16 partials (values in [-1, 1)) and maxsum stats, like the
// attention kernel before a merge, for chained (PDL) benchmarks.
int launch_producer(void* partial_o, int64_t o_elems, float* stats, int64_t num_stats, int seed,
                    bool pdl, void* stream);
#endif

}  // namespace kvsplit
