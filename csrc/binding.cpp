// pybind11 module kvsplit._ext: casts integer pointers, strides and the stream
// handle into MergeParams and calls the launchers. No torch, no logic; CUDA
// errors become Python exceptions here and only here.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>

#include "kvsplit/launch.h"

namespace py = pybind11;

namespace {

using kvsplit::DType;
using kvsplit::KernelChoice;
using kvsplit::MergeParams;
using kvsplit::StatsFormat;

template <typename T>
T* as_pointer(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

MergeParams make_params(uintptr_t partial_o, uintptr_t stats, uintptr_t split_counts,
                        uintptr_t sinks, uintptr_t out, uintptr_t out_stats, int64_t num_splits,
                        int64_t rows, int64_t heads, int64_t o_stride_split, int64_t o_stride_row,
                        int64_t stats_stride_split, int64_t stats_stride_row,
                        int64_t out_stride_row, float log2_scale, float export_scale) {
  return MergeParams{as_pointer<const void>(partial_o), as_pointer<const float>(stats),
                     as_pointer<const int32_t>(split_counts), as_pointer<const float>(sinks),
                     as_pointer<void>(out), as_pointer<float>(out_stats), num_splits, rows, heads,
                     o_stride_split, o_stride_row, stats_stride_split, stats_stride_row,
                     out_stride_row, log2_scale, export_scale};
}

#if defined(KVSPLIT_WITH_CUDA)
void check_cuda(int status) {
  if (status != 0) {
    throw std::runtime_error("kvsplit: CUDA launch failed: " + kvsplit::cuda_error_string(status));
  }
}
#endif

KernelChoice make_choice(int head_dim, int partial_dtype, int out_dtype, int stats_format,
                         int family, int slices, int kv_split, int depth) {
  return KernelChoice{head_dim,
                      static_cast<DType>(partial_dtype),
                      static_cast<DType>(out_dtype),
                      static_cast<StatsFormat>(stats_format),
                      static_cast<kvsplit::Family>(family),
                      slices,
                      kv_split,
                      depth};
}

}  // namespace

PYBIND11_MODULE(_ext, m) {
  m.doc() = "kvsplit kernels: pointer-level entry points (use kvsplit.merge_* instead)";
  m.attr("build_hash") = KVSPLIT_BUILD_HASH;
  m.attr("version") = KVSPLIT_VERSION;
#if defined(KVSPLIT_WITH_CUDA)
  m.attr("cuda_architectures") = KVSPLIT_CUDA_ARCHITECTURES;
#else
  m.attr("cuda_architectures") = "";
#endif

  m.def(
      "merge_cpu",
      [](uintptr_t partial_o, uintptr_t stats, uintptr_t split_counts, uintptr_t sinks,
         uintptr_t out, uintptr_t out_stats, int64_t num_splits, int64_t rows, int64_t heads,
         int64_t o_stride_split, int64_t o_stride_row, int64_t stats_stride_split,
         int64_t stats_stride_row, int64_t out_stride_row, float log2_scale, float export_scale,
         int head_dim, int partial_dtype, int out_dtype, int stats_format, int family, int slices,
         int kv_split, int depth) {
        kvsplit::merge_cpu(
            make_params(partial_o, stats, split_counts, sinks, out, out_stats, num_splits, rows,
                        heads, o_stride_split, o_stride_row, stats_stride_split,
                        stats_stride_row, out_stride_row, log2_scale, export_scale),
            make_choice(head_dim, partial_dtype, out_dtype, stats_format, family, slices, kv_split,
                        depth));
      },
      py::call_guard<py::gil_scoped_release>());

#if defined(KVSPLIT_WITH_CUDA)
  m.def("merge_cuda",
        [](uintptr_t partial_o, uintptr_t stats, uintptr_t split_counts, uintptr_t sinks,
           uintptr_t out, uintptr_t out_stats, int64_t num_splits, int64_t rows, int64_t heads,
           int64_t o_stride_split, int64_t o_stride_row, int64_t stats_stride_split,
           int64_t stats_stride_row, int64_t out_stride_row, float log2_scale,
           float export_scale, int head_dim, int partial_dtype, int out_dtype, int stats_format,
           int family, int slices, int kv_split, int depth, int sm_count, bool pdl,
           uintptr_t stream) {
          check_cuda(kvsplit::merge_cuda(
              make_params(partial_o, stats, split_counts, sinks, out, out_stats, num_splits, rows,
                          heads, o_stride_split, o_stride_row, stats_stride_split,
                          stats_stride_row, out_stride_row, log2_scale, export_scale),
              make_choice(head_dim, partial_dtype, out_dtype, stats_format, family, slices, kv_split,
                        depth), sm_count,
              pdl, as_pointer<void>(stream)));
        });
  m.def("launch_noop", [](int grid, uintptr_t stream) {
    check_cuda(kvsplit::launch_noop(grid, as_pointer<void>(stream)));
  });
  m.def("launch_read_probe",
        [](uintptr_t partial_o, int64_t o_bytes, uintptr_t stats, int64_t stats_bytes,
           uintptr_t out, int64_t out_bytes, uintptr_t stream) {
          check_cuda(kvsplit::launch_read_probe(as_pointer<const void>(partial_o), o_bytes,
                                                as_pointer<const void>(stats), stats_bytes,
                                                as_pointer<void>(out), out_bytes,
                                                as_pointer<void>(stream)));
        });
  m.def("launch_producer",
        [](uintptr_t partial_o, int64_t o_elems, uintptr_t stats, int64_t num_stats, int seed,
           bool pdl, uintptr_t stream) {
          check_cuda(kvsplit::launch_producer(as_pointer<void>(partial_o), o_elems,
                                              as_pointer<float>(stats), num_stats, seed, pdl,
                                              as_pointer<void>(stream)));
        });
#endif
}
