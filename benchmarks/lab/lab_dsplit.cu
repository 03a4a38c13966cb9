// The DSplit kernel (bf16 partials, base-2 LSE, bf16 out) as built by one lab
// variant (-D flags), and an empty kernel of any grid and block, for the
// launch cost of a geometry. benchmarks/lab/lab_dsplit.py loads it with
// ctypes, beside csrc/cuda/probe.cu.
#include "kvsplit/launch.h"
#include "kvsplit/merge_dsplit.cuh"
#include "kvsplit/probe.h"

namespace {
__global__ void lab_empty_kernel() {}
}  // namespace

extern "C" int lab_dsplit(const kvsplit::MergeParams* params, int slices, int kv_split,
                          int depth, void* stream) {
  kvsplit::MergeParams p = *params;
  kvsplit::flatten_rows(p);  // as merge_cuda does
  kvsplit::KernelConfig config;
  config.family = kvsplit::Family::kDSplit;
  config.slices = slices;
  config.kv_split = kv_split;
  config.depth = depth;
  const kvsplit::Status status =
      kvsplit::launch_dsplit_typed<kvsplit::DType::kBFloat16,
                                   kvsplit::StatsFormat::kLse>(p, config, false,
                                                               static_cast<cudaStream_t>(stream));
  return status.ok() ? 0 : static_cast<int>(status.error);
}

extern "C" int lab_empty(int grid, int threads, void* stream) {
  lab_empty_kernel<<<grid, threads, 0, static_cast<cudaStream_t>(stream)>>>();
  return static_cast<int>(cudaGetLastError());
}
