// The Few kernel (bf16 partials, base-2 LSE, bf16 out) as built by one lab
// variant (-D flags: few_geometry.h's knobs), beside the read probe.
// benchmarks/lab/lab_few.py loads it with ctypes.
#include "kvsplit/launch.h"
#include "kvsplit/merge_few.cuh"
#include "kvsplit/probe.h"

extern "C" int lab_few(const kvsplit::MergeParams* params, int vectors, int sm_count,
                       void* stream) {
  kvsplit::MergeParams p = *params;
  kvsplit::flatten_rows(p);  // as merge_cuda does
  kvsplit::KernelConfig config;
  config.family = kvsplit::Family::kFew;
  config.vectors = vectors;
  kvsplit::Status status = kvsplit::check_config(config, p.head_dim, 2);
  if (status.ok()) {
    status = kvsplit::launch_few_typed<kvsplit::DType::kBFloat16, kvsplit::StatsFormat::kLse>(
        p, config, sm_count, false, static_cast<cudaStream_t>(stream));
  }
  return status.ok() ? 0 : static_cast<int>(status.error);
}
