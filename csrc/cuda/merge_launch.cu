// Maps the runtime stats format, partial dtype and family to the typed launchers,
// which are instantiated one (partial dtype, stats format) per file (see
// CMakeLists.txt) so that they compile in parallel, and launches on the
// tensors' device.
#include <cuda_runtime.h>

#include "kvsplit/dispatch.h"
#include "kvsplit/launch.h"

namespace kvsplit {

template <DType kPartial, StatsFormat kFormat>
Status launch_kvsplit_typed(const MergeParams& p, const KernelConfig& config, int sm_count,
                            bool pdl, cudaStream_t stream);
template <DType kPartial, StatsFormat kFormat>
Status launch_dsplit_typed(const MergeParams& p, const KernelConfig& config, bool pdl,
                           cudaStream_t stream);

namespace {

// Makes `device` current for one launch and restores the caller's device.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    error_ = cudaGetDevice(&previous_);
    if (error_ == cudaSuccess && previous_ != device) error_ = cudaSetDevice(device);
    else previous_ = -1;  // nothing to restore
  }
  ~DeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  cudaError_t error() const { return error_; }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
  cudaError_t error_ = cudaSuccess;
};

}  // namespace

Status merge_cuda(const MergeParams& call, const KernelConfig& config, const CudaTarget& target) {
  MergeParams p = call;
  flatten_rows(p);
  Status status = check_problem(p);
  if (status.ok()) status = check_config(config, p.head_dim, elem_bytes(p.partial_dtype));
  if (status.ok()) status = check_call(p, config);
  if (!status.ok() || p.rows == 0) return status;
  DeviceGuard guard(target.device);
  if (guard.error() != cudaSuccess) return fail(Error::kCuda, guard.error());
  const auto stream = static_cast<cudaStream_t>(target.stream);
  KVSPLIT_DISPATCH_STATS_FORMAT(p.stats_format, kFormat, status, {
    KVSPLIT_DISPATCH_PARTIAL_DTYPE(p.partial_dtype, kPartial, status, {
      KVSPLIT_DISPATCH_FAMILY(config.family, kFamily, status, {
        if constexpr (kFamily == Family::kKvSplit) {
          status = launch_kvsplit_typed<kPartial, kFormat>(p, config, target.sm_count, target.pdl,
                                                           stream);
        } else {
          status = launch_dsplit_typed<kPartial, kFormat>(p, config, target.pdl, stream);
        }
      })
    })
  })
  return status;
}

std::string cuda_error_string(int64_t error) {
  const auto value = static_cast<cudaError_t>(error);
  return std::string(cudaGetErrorName(value)) + ": " + cudaGetErrorString(value);
}

}  // namespace kvsplit
