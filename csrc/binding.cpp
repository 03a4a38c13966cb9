// pybind11 module kvsplit._ext: exports the kernel layer's vocabulary
// (config.h), a parameter object per call layout (Launch), the launchers and
// (fast_call.cpp) the per-call path of a layout seen before.
// No torch and no merge logic; a launcher's Status becomes a Python exception
// here and only here.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <tuple>

#include "binding_launch.h"

namespace py = pybind11;

namespace {

using kvsplit::binding::as_pointer;
using kvsplit::binding::error_names;
using kvsplit::binding::guarded;
using kvsplit::binding::launch_at;
using kvsplit::binding::Launch;
using kvsplit::binding::merge_cpu_released;
using kvsplit::binding::raise_for;
using kvsplit::binding::with_addresses;
using kvsplit::CudaTarget;
using kvsplit::DType;
using kvsplit::Error;
using kvsplit::Family;
using kvsplit::KernelConfig;
using kvsplit::MergeParams;
using kvsplit::Status;
using kvsplit::StatsFormat;

template <typename List>
py::tuple values_of() {
  py::tuple values(List::size);
  for (int i = 0; i < List::size; ++i) values[i] = List::values[i];
  return values;
}

// A RowStrides field as a (batch, token, head) tuple.
void def_row_strides(py::class_<MergeParams>& cls, const char* name,
                     kvsplit::RowStrides MergeParams::*field) {
  cls.def_property(
      name,
      [field](const MergeParams& p) {
        const auto& r = p.*field;
        return py::make_tuple(r.batch, r.token, r.head);
      },
      [field](MergeParams& p, const std::tuple<int64_t, int64_t, int64_t>& value) {
        p.*field = {std::get<0>(value), std::get<1>(value), std::get<2>(value)};
      });
}

template <typename Enum>
void def_enum_field(py::class_<MergeParams>& cls, const char* name, Enum MergeParams::*field) {
  cls.def_property(
      name, [field](const MergeParams& p) { return static_cast<int>(p.*field); },
      [field](MergeParams& p, int value) { p.*field = static_cast<Enum>(value); });
}

// -- the fast launchers -----------------------------------------------------------------
// Arguments: a Launch, six addresses (ints), log2_scale (a float) and, for CUDA, a
// stream (an int). Errors come back as the exceptions raise_for throws elsewhere.

bool parse_launch(PyObject* const* args, Py_ssize_t nargs, Py_ssize_t expected, const char* name,
                  const Launch** launch, uintptr_t (&addresses)[7], float* log2_scale) {
  if (nargs != expected) {
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", name, expected, nargs);
    return false;
  }
  try {
    *launch = &py::handle(args[0]).cast<const Launch&>();
  } catch (const py::cast_error&) {
    PyErr_Format(PyExc_TypeError, "%s: the first argument must be a Launch", name);
    return false;
  }
  for (Py_ssize_t i = 1; i < expected; ++i) {
    if (i == 7) continue;
    const unsigned long long value = PyLong_AsUnsignedLongLong(args[i]);
    if (value == static_cast<unsigned long long>(-1) && PyErr_Occurred()) return false;
    addresses[i < 7 ? i - 1 : 6] = static_cast<uintptr_t>(value);
  }
  const double scale = PyFloat_AsDouble(args[7]);
  if (scale == -1.0 && PyErr_Occurred()) return false;
  *log2_scale = static_cast<float>(scale);
  return true;
}

PyObject* merge_cpu_fast(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  const Launch* launch = nullptr;
  uintptr_t a[7] = {};
  float log2_scale = 1.f;
  if (!parse_launch(args, nargs, 8, "merge_cpu", &launch, a, &log2_scale)) return nullptr;
  return guarded([&] {
    raise_for(launch_at(*launch, a[0], a[1], a[2], a[3], a[4], a[5], log2_scale, false, nullptr));
  });
}

PyObject* merge_cuda_fast(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  const Launch* launch = nullptr;
  uintptr_t a[7] = {};
  float log2_scale = 1.f;
  if (!parse_launch(args, nargs, 9, "merge_cuda", &launch, a, &log2_scale)) return nullptr;
  return guarded([&] {
    raise_for(launch_at(*launch, a[0], a[1], a[2], a[3], a[4], a[5], log2_scale, true,
                        as_pointer<void>(a[6])));
  });
}

}  // namespace

PYBIND11_MODULE(_ext, m) {
  m.doc() = "kvsplit kernels: the kernel layer's vocabulary and pointer-level launchers "
            "(use kvsplit.merge_* instead)";
  m.attr("cpu_build_hash") = KVSPLIT_CPU_BUILD_HASH;
  m.attr("version") = KVSPLIT_VERSION;
#if defined(KVSPLIT_WITH_CUDA)
  m.attr("cuda_build_hash") = KVSPLIT_CUDA_BUILD_HASH;
  m.attr("cuda_architectures") = KVSPLIT_CUDA_ARCHITECTURES;
#else
  m.attr("cuda_build_hash") = "";
  m.attr("cuda_architectures") = "";
#endif

  // -- vocabulary (config.h) ------------------------------------------------------------
  m.attr("MAX_HEAD_DIM") = kvsplit::kMaxHeadDim;
  m.attr("QUANT_GROUPS") = values_of<kvsplit::QuantGroups>();
  // Every dtype the kernel layer names, by torch's name: partials and outputs,
  // and the ue8m0 scale dtype.
  const std::pair<const char*, DType> dtypes[] = {
      {"bfloat16", DType::kBFloat16},          {"float16", DType::kFloat16},
      {"float32", DType::kFloat32},            {"float8_e4m3fn", DType::kFloat8E4M3FN},
      {"float8_e4m3fnuz", DType::kFloat8E4M3FNUZ}, {"float8_e8m0fnu", DType::kFloat8E8M0FNU}};
  py::dict dtype_codes, dtype_bytes;
  for (const auto& [name, dtype] : dtypes) {
    dtype_codes[name] = static_cast<int>(dtype);
    dtype_bytes[name] = kvsplit::elem_bytes(dtype);
  }
  m.attr("DTYPES") = dtype_codes;
  m.attr("DTYPE_BYTES") = dtype_bytes;
  m.attr("STATS_FORMATS") = py::dict(py::arg("maxsum") = static_cast<int>(StatsFormat::kMaxSum),
                                     py::arg("lse") = static_cast<int>(StatsFormat::kLse));
  m.attr("FAMILIES") = py::dict(py::arg("kvsplit") = static_cast<int>(Family::kKvSplit),
                                py::arg("dsplit") = static_cast<int>(Family::kDSplit),
                                py::arg("few") = static_cast<int>(Family::kFew));
  // Each family's parameters and their legal values; a family's other fields
  // take the defaults of KernelConfig (KvSplit: slices 1, depth
  // kKvSplitLoadDepth, vectors 1; Few: slices 1, kv_split 1, that depth).
  m.attr("FAMILY_PARAMS") = py::dict(
      py::arg("kvsplit") = py::dict(py::arg("kv_split") = values_of<kvsplit::KvSplitKvSplits>()),
      py::arg("dsplit") = py::dict(py::arg("depth") = values_of<kvsplit::DsplitDepths>(),
                                   py::arg("kv_split") = values_of<kvsplit::DsplitKvSplits>(),
                                   py::arg("slices") = values_of<kvsplit::DsplitSlices>()),
      py::arg("few") = py::dict(py::arg("vectors") = values_of<kvsplit::FewVectors>()));
  m.attr("CONFIG_DEFAULTS") = py::dict(py::arg("slices") = KernelConfig{}.slices,
                                       py::arg("kv_split") = KernelConfig{}.kv_split,
                                       py::arg("depth") = KernelConfig{}.depth,
                                       py::arg("vectors") = KernelConfig{}.vectors);
  py::list pairs;
  for (const auto& [in_name, in] : dtypes) {
    for (const auto& [out_name, out] : dtypes) {
      if (kvsplit::dtype_pair_supported(in, out)) {
        pairs.append(py::make_tuple(static_cast<int>(in), static_cast<int>(out)));
      }
    }
  }
  m.attr("DTYPE_PAIRS") = pairs;
  m.attr("LIMITS") = py::dict(
      py::arg("bytes_per_thread") = kvsplit::kBytesPerThread,
      py::arg("kvsplit_threads_per_cta") = kvsplit::kKvSplitThreadsPerCta,
      py::arg("kvsplit_ctas_per_sm") = kvsplit::kKvSplitCtasPerSm,
      py::arg("kvsplit_load_depth") = kvsplit::kKvSplitLoadDepth,
      py::arg("dsplit_min_lanes") = kvsplit::kDsplitMinLanes,
      py::arg("dsplit_max_lanes") = kvsplit::kDsplitMaxLanes,
      py::arg("dsplit_min_threads") = kvsplit::kDsplitMinThreads,
      py::arg("dsplit_max_threads") = kvsplit::kDsplitMaxThreads,
      py::arg("few_max_loads") = kvsplit::kFewMaxLoads,
      py::arg("few_min_cta_threads") = kvsplit::kFewMinCtaThreads,
      py::arg("few_max_cta_threads") = kvsplit::kFewMaxCtaThreads);
  py::dict errors;
  for (const auto& [error, names] : error_names()) errors[py::int_(static_cast<int>(error))] = names.first;
  m.attr("ERRORS") = errors;

  m.def(
      "check_config",
      [](int family, int slices, int kv_split, int depth, int vectors, int head_dim,
         int elem_bytes) {
        const Status status = kvsplit::check_config(
            KernelConfig{static_cast<Family>(family), slices, kv_split, depth, vectors}, head_dim,
            elem_bytes);
        return static_cast<int>(status.error);
      },
      "0 if the kernel layer can run the config on rows of head_dim partials of elem_bytes "
      "bytes, else the error code (a key of ERRORS)",
      py::arg("family"), py::arg("slices"), py::arg("kv_split"), py::arg("depth"),
      py::arg("vectors"), py::arg("head_dim"), py::arg("elem_bytes"));
  m.def(
      "check_call_rules",
      [](int family, int slices, int kv_split, int depth, int vectors, int head_dim,
         int elem_bytes, bool stats_in_place, int quant_group) {
        const Status status = kvsplit::check_call_rules(
            KernelConfig{static_cast<Family>(family), slices, kv_split, depth, vectors}, head_dim,
            elem_bytes, stats_in_place, quant_group);
        return static_cast<int>(status.error);
      },
      "0 if a call with an in-place stats export and/or per-group FP8 scales of quant_group "
      "elements (0: none) may run the config, else the error code (a key of ERRORS)",
      py::arg("family"), py::arg("slices"), py::arg("kv_split"), py::arg("depth"),
      py::arg("vectors"), py::arg("head_dim"), py::arg("elem_bytes"), py::arg("stats_in_place"),
      py::arg("quant_group"));
  m.def("head_dim_supported", &kvsplit::head_dim_supported,
        "Whether rows of head_dim elements of elem_bytes bytes are whole 16-byte vectors, "
        "1..MAX_HEAD_DIM elements",
        py::arg("head_dim"), py::arg("elem_bytes"));
  m.def("kvsplit_rows_per_band", &kvsplit::kvsplit_rows_per_band,
        "Rows one KvSplit CTA covers per band (0: a group cannot hold a row)", py::arg("head_dim"),
        py::arg("elem_bytes"), py::arg("kv_split"));
  m.def("dsplit_slice_vectors", &kvsplit::dsplit_slice_vectors,
        "16-byte vectors of each DSplit slice of a row, or 0 when slices is not legal",
        py::arg("head_dim"), py::arg("elem_bytes"), py::arg("slices"));
  m.def("dsplit_lanes", &kvsplit::dsplit_lanes,
        "Threads per DSplit group, or 0 when head_dim / slices is not a legal slice",
        py::arg("head_dim"), py::arg("elem_bytes"), py::arg("slices"));
  m.def("few_threads_per_row",
        [](int head_dim, int elem_bytes, int vectors) {
          return kvsplit::few_threads_per_row(head_dim, elem_bytes, vectors);
        },
        "Threads per row of a Few config of `vectors` vectors a thread, or 0 when not legal",
        py::arg("head_dim"), py::arg("elem_bytes"), py::arg("vectors"));
  m.def("few_depth", &kvsplit::few_depth,
        "States a Few thread of `vectors` vectors loads per round in a call of num_splits",
        py::arg("num_splits"), py::arg("vectors"));
  m.def(
      "few_launch",
      [](int lanes, int64_t rows, int sm_count) {
        const kvsplit::FewLaunch launch = kvsplit::make_few_launch(lanes, rows, sm_count);
        return py::make_tuple(launch.cta_threads, launch.ctas, launch.rows_per_pass);
      },
      "(threads per CTA, CTAs, rows per pass of the grid) of a Few launch of rows of `lanes` "
      "threads on sm_count SMs",
      py::arg("lanes"), py::arg("rows"), py::arg("sm_count"));

  // -- the parameter object -------------------------------------------------------------
  py::class_<MergeParams> params(m, "MergeParams");
  params.def(py::init<>())
      .def_readwrite("head_dim", &MergeParams::head_dim)
      .def_readwrite("num_splits", &MergeParams::num_splits)
      .def_readwrite("rows", &MergeParams::rows)
      .def_readwrite("heads", &MergeParams::heads)
      .def_readwrite("seqlen", &MergeParams::seqlen)
      .def_readwrite("o_stride_split", &MergeParams::o_stride_split)
      .def_readwrite("stats_stride_split", &MergeParams::stats_stride_split)
      .def_readwrite("row_mask_stride", &MergeParams::row_mask_stride)
      .def_readwrite("export_scale", &MergeParams::export_scale)
      .def_readwrite("empty_stat", &MergeParams::empty_stat)
      .def_readwrite("stats_in_place", &MergeParams::stats_in_place)
      .def_readwrite("pass_through_tokens", &MergeParams::pass_through_tokens)
      .def_readwrite("pass_through_split", &MergeParams::pass_through_split)
      .def_readwrite("quant_group", &MergeParams::quant_group)
      .def_readwrite("group_scales_stride", &MergeParams::group_scales_stride)
      .def_readwrite("scale_ue8m0", &MergeParams::scale_ue8m0)
      .def_readwrite("indptr_int64", &MergeParams::indptr_int64)
      .def_readwrite("num_requests", &MergeParams::num_requests)
      .def_readwrite("pair_stats", &MergeParams::pair_stats);
  def_row_strides(params, "group_scales_row", &MergeParams::group_scales_row);
  def_enum_field(params, "group_scales_dtype", &MergeParams::group_scales_dtype);
  def_row_strides(params, "o_row", &MergeParams::o_row);
  def_row_strides(params, "stats_row", &MergeParams::stats_row);
  def_row_strides(params, "out_row", &MergeParams::out_row);
  def_row_strides(params, "out_stats_row", &MergeParams::out_stats_row);
  def_enum_field(params, "partial_dtype", &MergeParams::partial_dtype);
  def_enum_field(params, "out_dtype", &MergeParams::out_dtype);
  def_enum_field(params, "stats_format", &MergeParams::stats_format);

  py::class_<KernelConfig>(m, "KernelConfig")
      .def(py::init([](int family, int slices, int kv_split, int depth, int vectors) {
             return KernelConfig{static_cast<Family>(family), slices, kv_split, depth, vectors};
           }),
           py::arg("family"), py::arg("slices"), py::arg("kv_split"), py::arg("depth"),
           py::arg("vectors") = 1)
      .def_property_readonly("family", [](const KernelConfig& c) { return static_cast<int>(c.family); })
      .def_readonly("slices", &KernelConfig::slices)
      .def_readonly("kv_split", &KernelConfig::kv_split)
      .def_readonly("depth", &KernelConfig::depth)
      .def_readonly("vectors", &KernelConfig::vectors);

  py::class_<CudaTarget>(m, "CudaTarget")
      .def(py::init<>())
      .def_readwrite("device", &CudaTarget::device)
      .def_readwrite("sm_count", &CudaTarget::sm_count)
      .def_readwrite("pdl", &CudaTarget::pdl)
      .def_readwrite("l2_bytes", &CudaTarget::l2_bytes);

  py::class_<Launch>(m, "Launch")
      .def(py::init([](const MergeParams& p, const KernelConfig& c, const CudaTarget& t) {
             return Launch{p, c, t};
           }),
           py::arg("params"), py::arg("config"), py::arg("target") = CudaTarget{})
      .def_readonly("params", &Launch::params)
      .def_readonly("config", &Launch::config)
      .def_readonly("target", &Launch::target);

  // -- launchers ------------------------------------------------------------------------
  kvsplit::binding::def_fast_call(m);
  // Raw METH_FASTCALL functions: these two are the per-call path of every eager
  // merge, and pybind11's overload dispatch costs more than the rest of a launch.
  static PyMethodDef launchers[] = {
      {"merge_cpu", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&merge_cpu_fast)),
       METH_FASTCALL,
       "merge_cpu(launch, partial_o, stats, split_counts, sinks, out, out_stats, log2_scale)\n"
       "Merges on the CPU (addresses are host addresses as ints, 0: absent)"},
      {"merge_cuda", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&merge_cuda_fast)),
       METH_FASTCALL,
       "merge_cuda(launch, partial_o, stats, split_counts, sinks, out, out_stats, log2_scale, "
       "stream)\nEnqueues the merge on `stream` (a cudaStream_t of launch.target.device)"},
  };
  for (PyMethodDef& def : launchers) {
    m.add_object(def.ml_name,
                 py::reinterpret_steal<py::object>(PyCFunction_NewEx(&def, nullptr, m.ptr())));
  }
  // -- the CUDA runtime and this machine ------------------------------------------------
#if defined(KVSPLIT_WITH_CUDA)
  m.attr("no_cuda_kernels") = "";
  m.attr("cuda_runtime_version") = kvsplit::cuda_runtime_version();
  m.attr("cuda_min_driver") = kvsplit::cuda_min_driver();
  m.def("cuda_driver_version", &kvsplit::cuda_driver_version,
        "The driver's CUDA version (1000 * major + 10 * minor; 0: no driver found)");
  m.def(
      "check_device", [](int device) { raise_for(kvsplit::check_device(device), device); },
      "Raises RuntimeError (cause and remedy) unless this build's kernels run on `device`",
      py::arg("device"));
  m.def(
      "cuda_error_message", [](int error) { return kvsplit::cuda_error_string(error); },
      "The text a CUDA error code raises with", py::arg("error"));
#else
  m.attr("no_cuda_kernels") = kvsplit::binding::kNoCudaKernels;
  m.attr("cuda_runtime_version") = 0;
  m.attr("cuda_min_driver") = 0;
#endif
}
