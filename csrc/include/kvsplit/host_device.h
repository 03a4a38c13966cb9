// Qualifiers for code that both the CUDA kernels and the host compile, and
// the integer helper both families' geometry uses.
#pragma once

#if defined(__CUDACC__)
#define KVSPLIT_HOST_DEVICE __host__ __device__
#define KVSPLIT_HD __host__ __device__ __forceinline__
#else
#define KVSPLIT_HOST_DEVICE
#define KVSPLIT_HD inline
#endif

namespace kvsplit {

// log2 of a power of two, -1 for anything else.
KVSPLIT_HOST_DEVICE constexpr int exact_log2(int value) {
  if (value < 1) return -1;
  int log2 = 0;
  while ((1 << log2) < value) ++log2;
  return (1 << log2) == value ? log2 : -1;
}

}  // namespace kvsplit
