// Maps the runtime stats format and dtypes to the typed launchers, which are
// instantiated one per file (see CMakeLists.txt) so that they compile in
// parallel.
#include <cuda_runtime.h>

#include "kvsplit/dispatch.h"
#include "kvsplit/launch.h"

namespace kvsplit {

template <DType kPartial, DType kOut, StatsFormat kFormat>
cudaError_t launch_merge_typed(const MergeParams& p, int head_dim, int kv_split, int sm_count,
                               bool pdl, cudaStream_t stream);
template <DType kPartial, DType kOut, StatsFormat kFormat>
cudaError_t launch_dsplit_typed(const MergeParams& p, int head_dim, int slices, int kv_split,
                                int depth, bool pdl, cudaStream_t stream);

int merge_cuda(const MergeParams& params, const KernelChoice& choice, int sm_count, bool pdl,
               void* stream) {
  cudaError_t status = cudaErrorInvalidValue;
  KVSPLIT_DISPATCH_STATS_FORMAT(choice.stats_format, kFormat, {
    KVSPLIT_DISPATCH_DTYPES(choice.partial_dtype, choice.out_dtype, kPartial, kOut, {
      const auto cuda_stream = static_cast<cudaStream_t>(stream);
      if (choice.family == Family::kDSplit) {
        status = launch_dsplit_typed<kPartial, kOut, kFormat>(
            params, choice.head_dim, choice.slices, choice.kv_split, choice.depth, pdl,
            cuda_stream);
      } else if (choice.family == Family::kKvSplit) {
        status = launch_merge_typed<kPartial, kOut, kFormat>(
            params, choice.head_dim, choice.kv_split, sm_count, pdl, cuda_stream);
      } else {
        throw_unsupported("family", static_cast<int>(choice.family));
      }
    })
  })
  return static_cast<int>(status);
}

std::string cuda_error_string(int status) {
  const auto error = static_cast<cudaError_t>(status);
  return std::string(cudaGetErrorName(error)) + ": " + cudaGetErrorString(error);
}

}  // namespace kvsplit
