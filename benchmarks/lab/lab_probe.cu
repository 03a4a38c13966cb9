// The read probe and the empty kernel (csrc/cuda/probe.cu) as every lab
// library exports them: labkit.build links this file into each.
#include <cstdint>

#include "kvsplit/probe.h"

extern "C" int lab_read(const void* o, int64_t o_bytes, const void* stats, int64_t stats_bytes,
                        void* out, int64_t out_bytes, void* stream) {
  return static_cast<int>(
      kvsplit::launch_read_probe(o, o_bytes, stats, stats_bytes, out, out_bytes, stream).error);
}

// The probe as it was before it stored one output chunk a thread: a thread per
// four input chunks, storing its share of the output after its loads.
extern "C" int lab_read_quarter(const void* o, int64_t o_bytes, const void* stats,
                                int64_t stats_bytes, void* out, int64_t out_bytes, void* stream) {
  return static_cast<int>(kvsplit::launch_read_probe(o, o_bytes, stats, stats_bytes, out,
                                                     out_bytes, stream, false)
                              .error);
}

extern "C" int lab_noop(int grid, void* stream) {
  return static_cast<int>(kvsplit::launch_noop(grid, stream).error);
}
