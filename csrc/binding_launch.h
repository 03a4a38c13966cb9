// What the binding's two translation units share (binding.cpp: the module and
// the address launchers; fast_call.cpp: the per-call path): the Launch object,
// the addresses of one call, and the one place where a launcher's Status
// becomes a Python exception.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>

#include "kvsplit/launch.h"

namespace kvsplit::binding {

namespace py = pybind11;

// Everything one merge call needs but its addresses, the stats scale and the
// stream: built once per call layout by kvsplit._kernel.
struct Launch {
  MergeParams params;
  KernelConfig config;
  CudaTarget target;
};

// Error code -> (name, what the message calls the value). The names are the
// constraint names that kvsplit.dispatch reports.
inline const std::map<Error, std::pair<const char*, const char*>>& error_names() {
  static const std::map<Error, std::pair<const char*, const char*>> names = {
      {Error::kHeadDim, {"head_dim", "head_dim"}},
      {Error::kDtypes, {"dtypes", "(partial_dtype, out_dtype) pair"}},
      {Error::kStatsFormat, {"stats_format", "stats_format"}},
      {Error::kFamily, {"family", "family"}},
      {Error::kKvSplit, {"kv_split", "kv_split"}},
      {Error::kGroupHoldsRow,
       {"group_holds_row", "kv_split (a group of 512/kv_split threads must hold a whole row)"}},
      {Error::kSlices,
       {"slice_width", "slices (a slice of head_dim must be 3..32 vectors of 16 bytes, on 4..32 lanes)"}},
      {Error::kCtaThreads, {"cta_threads", "kv_split (lanes * kv_split must be 32..512 threads)"}},
      {Error::kDepth, {"depth", "depth"}},
      {Error::kDevice, {"device", "device"}},
      {Error::kCuda, {"cuda", "cuda"}},
      {Error::kQuantGroup, {"quant_group", "quant_group (64 or 128, dividing head_dim, FP8 out)"}},
      {Error::kSplitRange, {"split_range", "split range (pass-through split or indptr)"}},
      {Error::kVectors,
       {"vectors", "vectors (1, 2 or 4 of a row per thread, no step of a row empty; in "
                   "place: a row's threads in one warp; per-group scales: whole groups per "
                   "step)"}},
  };
  return names;
}

#if !defined(KVSPLIT_WITH_CUDA)
// Why a CUDA merge cannot run on this build, and what to do about it.
inline constexpr const char* kNoCudaKernels =
    "this kvsplit build has no CUDA kernels (" KVSPLIT_NO_CUDA_REASON "): install kvsplit's "
    "binary wheel, or install the CUDA toolkit (nvcc) and rebuild kvsplit from source";
#endif

// Throws the Python exception (through pybind11) of a failed Status; `device`
// names the GPU of a CUDA error (-1: the current one).
inline void raise_for(const Status& status, int device = -1) {
  if (status.ok()) return;
#if defined(KVSPLIT_WITH_CUDA)
  if (status.error == Error::kCuda) {
    throw std::runtime_error("kvsplit: CUDA error: " +
                             cuda_error_string(status.detail, device));
  }
#else
  if (status.error == Error::kDevice) throw std::runtime_error(kNoCudaKernels);
#endif
  throw py::value_error(std::string("kvsplit: unsupported ") + error_names().at(status.error).second +
                        " = " + std::to_string(status.detail));
}

// Runs `fn` and turns a C++ exception into the matching Python one: None, or
// nullptr with the Python error set.
template <typename Fn>
PyObject* guarded(Fn&& fn) {
  try {
    fn();
  } catch (const py::builtin_exception& e) {
    e.set_error();
    return nullptr;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  Py_RETURN_NONE;
}

template <typename T>
T* as_pointer(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

inline MergeParams with_addresses(const MergeParams& base, uintptr_t partial_o, uintptr_t stats,
                                  uintptr_t split_counts, uintptr_t sinks, uintptr_t out,
                                  uintptr_t out_stats, float log2_scale) {
  MergeParams p = base;
  p.partial_o = as_pointer<const void>(partial_o);
  p.stats = as_pointer<const float>(stats);
  p.split_counts = as_pointer<const int32_t>(split_counts);
  p.sinks = as_pointer<const float>(sinks);
  p.out = as_pointer<void>(out);
  p.out_stats = as_pointer<float>(out_stats);
  p.log2_scale = log2_scale;
  return p;
}

// CPU merges of at least this many partial elements release the GIL; smaller
// ones finish before a release and re-acquire would.
inline constexpr int64_t kReleaseGilElements = int64_t{1} << 16;

inline Status merge_cpu_released(const MergeParams& p, const KernelConfig& config) {
  if (p.rows * p.num_splits * p.head_dim >= kReleaseGilElements) {
    py::gil_scoped_release release;
    return merge_cpu(p, config);
  }
  return merge_cpu(p, config);
}

// One launch of `launch` at these addresses: on the CPU, or with `cuda` on `stream`.
// It copies what it needs first: a CPU merge releases the GIL, and the Launch
// may be released meanwhile (fast_call.cpp's table is cleared from any thread).
inline Status launch_at(const Launch& launch, uintptr_t partial_o, uintptr_t stats,
                        uintptr_t split_counts, uintptr_t sinks, uintptr_t out,
                        uintptr_t out_stats, float log2_scale, bool cuda, void* stream) {
  const MergeParams p = with_addresses(launch.params, partial_o, stats, split_counts, sinks, out,
                                       out_stats, log2_scale);
  const KernelConfig config = launch.config;
  if (!cuda) return merge_cpu_released(p, config);
  CudaTarget target = launch.target;
  target.stream = stream;
  return merge_cuda(p, config, target);
}

// The per-call path (fast_call.cpp): adds fast_merge, fast_add, fast_clear,
// fast_info and fast_init to the module.
void def_fast_call(py::module_& m);

}  // namespace kvsplit::binding
