// The read probe and the empty kernel (csrc/cuda/probe.cu) as every lab
// library exports them: labkit.build links this file into each.
#include <cstdint>

#include "kvsplit/probe.h"

extern "C" int lab_read(const void* o, int64_t o_bytes, const void* stats, int64_t stats_bytes,
                        void* out, int64_t out_bytes, void* stream) {
  return static_cast<int>(
      kvsplit::launch_read_probe(o, o_bytes, stats, stats_bytes, out, out_bytes, stream).error);
}

extern "C" int lab_noop(int grid, void* stream) {
  return static_cast<int>(kvsplit::launch_noop(grid, stream).error);
}
