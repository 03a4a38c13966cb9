// One bf16/maxsum build of the KvSplit kernel with the experiment knobs of
// merge_kvsplit.cuh set by -D flags; benchmarks/lab/lab.py loads it with ctypes.
#include "kvsplit/merge_kvsplit.cuh"

extern "C" int lab_launch(const kvsplit::MergeParams* params, int head_dim, int kv_split,
                          int sm_count, void* stream) {
  kvsplit::MergeParams p = *params;
  p.head_dim = head_dim;
  kvsplit::KernelConfig config;
  config.kv_split = kv_split;
  const kvsplit::Status status =
      kvsplit::launch_kvsplit_typed<kvsplit::DType::kBFloat16,
                                    kvsplit::StatsFormat::kMaxSum>(
          p, config, sm_count, false, static_cast<cudaStream_t>(stream));
  return status.ok() ? 0 : static_cast<int>(status.error);
}
