// Non-template entry points that the binding calls. Both check the problem
// and the config (params.h, config.h) before touching memory and return a
// Status; they compile with the host C++ compiler alone (no CUDA headers
// here: the stream travels inside CudaTarget as a plain pointer).
#pragma once

#include <cstdint>
#include <string>

#include "kvsplit/params.h"

namespace kvsplit {

// Merges on the CPU with the same group structure as the chosen family's kernel.
Status merge_cpu(const MergeParams& params, const KernelConfig& config);

// Enqueues the merge on target.stream, on target.device (made current for the
// launch and restored after). Without CUDA kernels in the build: Error::kDevice.
Status merge_cuda(const MergeParams& params, const KernelConfig& config, const CudaTarget& target);

#if defined(KVSPLIT_WITH_CUDA)
std::string cuda_error_string(int64_t error);
// An empty kernel of `grid` CTAs: the launch cost that bounds every merge from below.
Status launch_noop(int grid, void* stream);
// Reads every byte of the partials and stats once and writes every output
// byte: the time no merge can beat.
Status launch_read_probe(const void* partial_o, int64_t o_bytes, const void* stats,
                         int64_t stats_bytes, void* out, int64_t out_bytes, void* stream);
// Writes bf16 partials (values in [-1, 1)) and maxsum stats, like the
// attention kernel before a merge, for chained (PDL) benchmarks.
Status launch_producer(void* partial_o, int64_t o_elems, float* stats, int64_t num_stats,
                       int seed, bool pdl, void* stream);
#endif

}  // namespace kvsplit
