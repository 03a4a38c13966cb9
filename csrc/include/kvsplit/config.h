// The kernel layer's vocabulary, owned here and exported to Python by the
// binding: the enums, the legal parameter values of each kernel family, the
// kernel config, launch statuses, and the one validity check that the CUDA
// launchers and the CPU implementation both call. Python derives every code
// and allowed value from what the binding exports of this file.
#pragma once

#include <cstdint>

#include "kvsplit/dsplit_geometry.h"
#include "kvsplit/few_geometry.h"
#include "kvsplit/host_device.h"

namespace kvsplit {

enum class DType : int32_t {
  kBFloat16 = 0,
  kFloat16 = 1,
  kFloat32 = 2,
  kFloat8E4M3FN = 3,    // outputs only: OCP e4m3, max 448, NaN 0x7f/0xff
  kFloat8E4M3FNUZ = 4,  // outputs only: e4m3 with bias 8, max 240, no -0, NaN 0x80
  kFloat8E8M0FNU = 5,   // per-group scales only: a biased power-of-two exponent (ue8m0)
};

enum class StatsFormat : int32_t {
  kMaxSum = 0,  // float2 (raw max m_i, sum l_i) per split and row; O_i unnormalised
  kLse = 1,     // one log-sum-exp per split and row; O_i normalised
};

enum class Family : int32_t {
  kKvSplit = 0,  // merge_kvsplit.cuh: whole rows per group, kv_split groups per CTA
  kDSplit = 1,   // merge_dsplit.cuh: a row's head dim split across `slices` CTAs
  kFew = 2,      // merge_few.cuh: every state of `vectors` vectors of a row in one thread
};

// A compile-time list of legal values: the dispatch macros instantiate one
// case per value, and the binding exports the same list.
template <int... kValues>
struct IntList {
  static constexpr int size = sizeof...(kValues);
  static constexpr int values[sizeof...(kValues)] = {kValues...};
  static constexpr KVSPLIT_HOST_DEVICE bool contains(int value) {
    return ((value == kValues) || ...);
  }
};

// A row of partials is any whole number of 16-byte vectors, up to this many
// elements (head_dim is a runtime value: no kernel is compiled per head dim).
constexpr int kMaxHeadDim = 1024;
// KvSplit: groups per CTA. 512 threads per CTA, each owning 16 bytes of a row.
using KvSplitKvSplits = IntList<1, 2, 4, 8, 16>;
constexpr int kKvSplitThreadsPerCta = 512;
constexpr int kKvSplitCtasPerSm = 2;   // the grid cap, in CTAs per SM
constexpr int kKvSplitLoadDepth = 4;   // partials per load round
// DSplit: CTAs per row, groups per CTA, partials per load round.
using DsplitSlices = IntList<1, 2, 4, 8, 16>;
using DsplitKvSplits = IntList<1, 2, 4, 8, 16, 32, 64, 128>;
using DsplitDepths = IntList<4, 8, 16>;
constexpr int kDsplitMaxDepth = 16;  // the largest of DsplitDepths: a first round's bound
// Few: 16-byte vectors of a row per thread (the family's one parameter), and
// the states a round loads, few_depth of the call (few_geometry.h): one
// kernel per pair that few_loads_fit.
using FewVectors = IntList<1, 2, 4>;
using FewDepths = IntList<2, 4, 8, 16>;
static_assert(FewDepths::values[0] == kFewMinDepth &&
                  FewDepths::values[FewDepths::size - 1] == kFewMaxDepth &&
                  FewDepths::size == 4,
              "few_depth returns the powers of two of FewDepths");
constexpr int kBytesPerThread = 16;
static_assert(kFewVectorBytes == kBytesPerThread, "a Few thread loads 16 bytes a vector");

KVSPLIT_HOST_DEVICE constexpr bool is_partial_dtype(DType dtype) {
  return dtype == DType::kBFloat16 || dtype == DType::kFloat16 || dtype == DType::kFloat32;
}
KVSPLIT_HOST_DEVICE constexpr bool is_fp8(DType dtype) {
  return dtype == DType::kFloat8E4M3FN || dtype == DType::kFloat8E4M3FNUZ;
}

// (partial dtype, output dtype) pairs: 16- and 32-bit partials, each into any
// output dtype. The kernels are compiled per partial dtype; the output dtype
// is a runtime switch of the store, done once per 16 bytes of partials.
KVSPLIT_HOST_DEVICE constexpr bool dtype_pair_supported(DType partial, DType out) {
  return is_partial_dtype(partial) && (is_partial_dtype(out) || is_fp8(out));
}

KVSPLIT_HOST_DEVICE constexpr int elem_bytes(DType dtype) {
  return dtype == DType::kFloat32 ? 4 : is_fp8(dtype) || dtype == DType::kFloat8E8M0FNU ? 1 : 2;
}

// Whether rows of `head_dim` elements of `elem_bytes` bytes are whole 16-byte
// vectors, at least one and at most kMaxHeadDim elements.
KVSPLIT_HOST_DEVICE constexpr bool head_dim_supported(int head_dim, int elem_bytes) {
  return head_dim >= 1 && head_dim <= kMaxHeadDim && elem_bytes > 0 &&
         (head_dim * elem_bytes) % kBytesPerThread == 0;
}

// FP8 outputs with a scale per group of head-dim elements: the legal group sizes.
using QuantGroups = IntList<64, 128>;

// What the kernel runs: a family and its parameters. KvSplit uses kv_split
// alone (slices 1, depth kKvSplitLoadDepth, vectors 1); Few uses vectors
// alone (slices 1, kv_split 1, depth kKvSplitLoadDepth: its rounds' depth
// is few_depth of the call).
struct KernelConfig {
  Family family = Family::kKvSplit;
  int32_t slices = 1;    // DSplit: CTAs per row
  int32_t kv_split = 1;  // groups per CTA, each merging every kv_split-th partial
  int32_t depth = kKvSplitLoadDepth;  // DSplit: partials loaded per round, 4, 8 or 16
  int32_t vectors = 1;   // Few: 16-byte vectors of a row per thread
};

// Why a launch did not happen. `detail` carries the offending value, or the
// cudaError_t of a failed CUDA call.
enum class Error : int32_t {
  kNone = 0,
  kHeadDim,        // head_dim not a whole number of 16-byte vectors of the partials, or too large
  kDtypes,         // (partial, out) dtype pair not compiled
  kStatsFormat,    // unknown stats format
  kFamily,         // unknown family
  kKvSplit,        // kv_split not a legal value of the family
  kGroupHoldsRow,  // KvSplit: a group of 512 / kv_split threads cannot hold a row
  kSlices,         // DSplit: head_dim / slices is not 4..32 vectors of 16 bytes
  kCtaThreads,     // DSplit: lanes * kv_split is not 32..512 threads
  kDepth,          // depth not a legal value of the family
  kDevice,         // a CUDA launch asked for on a build without CUDA kernels
  kCuda,           // a CUDA call failed
  kQuantGroup,     // per-group FP8 scales: group not in QuantGroups or not dividing head_dim
  kSplitRange,     // pass-through split out of range, or indptr with split_counts
  kVectors,        // Few: vectors not legal (or a step of every row empty); or a call's
                   // rule (in place, per-group scales) broken
};

struct Status {
  Error error = Error::kNone;
  int64_t detail = 0;
  KVSPLIT_HOST_DEVICE constexpr bool ok() const { return error == Error::kNone; }
};

KVSPLIT_HOST_DEVICE constexpr Status fail(Error error, int64_t detail) { return Status{error, detail}; }

// Rows one KvSplit CTA covers per band of rows (0: a group cannot hold a row).
KVSPLIT_HOST_DEVICE constexpr int kvsplit_rows_per_band(int head_dim, int elem_bytes, int kv_split) {
  return (kKvSplitThreadsPerCta / kv_split) * kBytesPerThread / (head_dim * elem_bytes);
}

// Whether the kernel layer can run `config` on rows of `head_dim` partials of
// `elem_bytes` bytes each: the rules of the family, nothing about the shape
// of a call (only the element size of the partial dtype matters).
KVSPLIT_HOST_DEVICE constexpr Status check_config(const KernelConfig& config, int head_dim,
                                                  int elem_bytes) {
  if (!head_dim_supported(head_dim, elem_bytes)) return fail(Error::kHeadDim, head_dim);
  if (config.family != Family::kFew && config.vectors != 1) {
    return fail(Error::kVectors, config.vectors);
  }
  if (config.family == Family::kKvSplit) {
    if (!KvSplitKvSplits::contains(config.kv_split)) return fail(Error::kKvSplit, config.kv_split);
    if (config.slices != 1) return fail(Error::kSlices, config.slices);
    if (config.depth != kKvSplitLoadDepth) return fail(Error::kDepth, config.depth);
    if (kvsplit_rows_per_band(head_dim, elem_bytes, config.kv_split) < 1) {
      return fail(Error::kGroupHoldsRow, config.kv_split);
    }
    return Status{};
  }
  if (config.family == Family::kDSplit) {
    if (!DsplitKvSplits::contains(config.kv_split)) return fail(Error::kKvSplit, config.kv_split);
    if (!DsplitDepths::contains(config.depth)) return fail(Error::kDepth, config.depth);
    const int lanes = DsplitSlices::contains(config.slices)
                          ? dsplit_lanes(head_dim, elem_bytes, config.slices)
                          : 0;
    if (lanes == 0) return fail(Error::kSlices, config.slices);
    const int threads = lanes * config.kv_split;
    if (threads < kDsplitMinThreads || threads > kDsplitMaxThreads) {
      return fail(Error::kCtaThreads, config.kv_split);
    }
    return Status{};
  }
  if (config.family == Family::kFew) {
    if (config.slices != 1) return fail(Error::kSlices, config.slices);
    if (config.kv_split != 1) return fail(Error::kKvSplit, config.kv_split);
    if (config.depth != KernelConfig{}.depth) return fail(Error::kDepth, config.depth);
    if (!FewVectors::contains(config.vectors) ||
        few_threads_per_row(head_dim, elem_bytes, config.vectors) < 1) {
      return fail(Error::kVectors, config.vectors);
    }
    return Status{};
  }
  return fail(Error::kFamily, static_cast<int>(config.family));
}

}  // namespace kvsplit
