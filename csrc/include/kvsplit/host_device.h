// Qualifiers for code that both the CUDA kernels and the host compile.
#pragma once

#if defined(__CUDACC__)
#define KVSPLIT_HOST_DEVICE __host__ __device__
#define KVSPLIT_HD __host__ __device__ __forceinline__
#else
#define KVSPLIT_HOST_DEVICE
#define KVSPLIT_HD inline
#endif
