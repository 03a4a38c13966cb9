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
// A CUDA error's name and description and, for the errors of an install that
// does not fit the machine (driver too old, no code for the GPU), their cause
// and remedy (runtime.cu). `device`: the GPU the error came from (-1: the
// current one).
std::string cuda_error_string(int64_t error, int device = -1);
// The statically linked CUDA runtime's version (1000 * major + 10 * minor)
// and the driver's (0: no driver found).
int cuda_runtime_version();
int cuda_driver_version();
// The oldest Linux driver branch that the runtime's major version runs on.
int cuda_min_driver();
// Whether this build's kernels run on `device`: the runtime starts (the
// driver is recent enough) and the device has machine code or PTX it can take
// (merge_launch.cu).
Status check_device(int device);
#endif

}  // namespace kvsplit
