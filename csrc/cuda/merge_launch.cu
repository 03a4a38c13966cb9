// Maps the runtime stats format, partial dtype and family to the typed launchers,
// which are instantiated one (partial dtype, stats format) per file (see
// CMakeLists.txt) so that they compile in parallel, and launches on the
// tensors' device; checks that a device can run this build.
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
template <DType kPartial, StatsFormat kFormat>
Status launch_few_typed(const MergeParams& p, const KernelConfig& config, int sm_count, bool pdl,
                        cudaStream_t stream, int64_t l2_bytes);

namespace {

// Compiled with the merge kernels' architectures: check_device loads it.
__global__ void image_probe_kernel() {}

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
        } else if constexpr (kFamily == Family::kDSplit) {
          status = launch_dsplit_typed<kPartial, kFormat>(p, config, target.pdl, stream);
        } else {
          status = launch_few_typed<kPartial, kFormat>(p, config, target.sm_count, target.pdl,
                                                       stream, target.l2_bytes);
        }
      })
    })
  })
  return status;
}

Status check_device(int device) {
  DeviceGuard guard(device);
  if (guard.error() != cudaSuccess) return fail(Error::kCuda, guard.error());
  // Loading one kernel of this build asks the driver what a merge launch
  // would: whether the device has machine code or PTX it can compile.
  cudaFuncAttributes attributes;
  cudaError_t error = cudaFuncGetAttributes(&attributes, image_probe_kernel);
  if (error == cudaSuccess) return Status{};
  cudaGetLastError();  // not sticky: leave no error behind for a later launch to report
  // For a kernel of this build, an invalid function can only mean no code for the device.
  if (error == cudaErrorInvalidDeviceFunction) error = cudaErrorNoKernelImageForDevice;
  return fail(Error::kCuda, error);
}

}  // namespace kvsplit
