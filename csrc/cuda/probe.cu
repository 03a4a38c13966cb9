// Reference kernels for the benchmark's floor: an empty kernel (the cost of a
// launch in graph replay). Not used by the merge path.
#include <cuda_runtime.h>

#include "kvsplit/launch.h"

namespace kvsplit {

__global__ void noop_kernel() {}

int launch_noop(int grid, void* stream) {
  noop_kernel<<<grid, 32, 0, static_cast<cudaStream_t>(stream)>>>();
  return static_cast<int>(cudaGetLastError());
}

}  // namespace kvsplit
