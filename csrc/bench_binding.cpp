// pybind11 module kvsplit._bench: the benchmarks' reference kernels
// (csrc/cuda/probe.cu), built with KVSPLIT_BENCH_KERNELS and left out of
// wheels. Addresses and streams are ints; a launcher's Status becomes a
// Python exception as in kvsplit._ext.
#include <pybind11/pybind11.h>

#include <cstdint>

#include "binding_launch.h"
#include "kvsplit/probe.h"

namespace py = pybind11;

using kvsplit::binding::as_pointer;
using kvsplit::binding::raise_for;

PYBIND11_MODULE(_bench, m) {
  m.doc() = "kvsplit's benchmark reference kernels (not part of the merge path)";
  m.def(
      "launch_noop",
      [](int grid, uintptr_t stream) {
        raise_for(kvsplit::launch_noop(grid, as_pointer<void>(stream)));
      },
      "An empty kernel of `grid` CTAs on `stream`", py::arg("grid"), py::arg("stream"));
  m.def(
      "launch_read_probe",
      [](uintptr_t partial_o, int64_t o_bytes, uintptr_t stats, int64_t stats_bytes,
         uintptr_t out, int64_t out_bytes, uintptr_t stream) {
        raise_for(kvsplit::launch_read_probe(as_pointer<const void>(partial_o), o_bytes,
                                             as_pointer<const void>(stats), stats_bytes,
                                             as_pointer<void>(out), out_bytes,
                                             as_pointer<void>(stream)));
      },
      "Reads every partial and stats byte once and writes every output byte");
  m.def(
      "launch_producer",
      [](uintptr_t partial_o, int64_t o_elems, uintptr_t stats, int64_t num_stats, int seed,
         bool pdl, uintptr_t stream) {
        raise_for(kvsplit::launch_producer(as_pointer<void>(partial_o), o_elems,
                                           as_pointer<float>(stats), num_stats, seed, pdl,
                                           as_pointer<void>(stream)));
      },
      "Writes bf16 partials and maxsum stats like an attention kernel (pdl: programmatic "
      "dependent launch, compute capability 9.0 and later)");
}
