// One bf16/maxsum build of the merge kernel with the experiment knobs of
// merge.cuh set by -D flags; benchmarks/lab/lab.py loads it with ctypes.
#include "kvsplit/merge.cuh"

extern "C" int lab_launch(const kvsplit::MergeParams* params, int head_dim, int kv_split,
                          int sm_count, void* stream) {
  try {
    return static_cast<int>(
        kvsplit::launch_merge_typed<kvsplit::DType::kBFloat16, kvsplit::DType::kBFloat16,
                                    kvsplit::StatsFormat::kMaxSum>(
            *params, head_dim, kv_split, sm_count, false, static_cast<cudaStream_t>(stream)));
  } catch (...) {
    return -1;
  }
}
