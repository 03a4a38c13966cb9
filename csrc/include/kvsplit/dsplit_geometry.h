// The DSplit family's geometry: how a config maps onto lanes, groups and CTAs.
// Used by config.h's validity check, the CUDA launcher and the CPU
// implementation alike.
#pragma once

#include <cstdint>

#include "kvsplit/host_device.h"

namespace kvsplit {

constexpr int kDsplitMinLanes = 4;  // 16-byte vectors per slice: a group is 4..32 lanes
constexpr int kDsplitMaxLanes = 32;  // of one warp
constexpr int kDsplitMinThreads = 32;
constexpr int kDsplitMaxThreads = 512;
// Items of one warp (lanes * kv_split = 32) run this many to a CTA, one per
// warp, and twice as many in a call of kDsplitWideItems items or more (knobs
// for benchmarks/lab; the defaults are the product; 0 wide items: never).
// Measured on an H200 with the lean kernel: 8 to a CTA took 0.96-0.99x of
// the time of 4 at calls of 1024-4096 one-warp items and 1.00-1.08x at
// 64-512 (benchmarks/lab/lab_dsplit.py, docs/kernel-notes.md).
#ifndef KVSPLIT_DSPLIT_ITEMS_PER_CTA
#define KVSPLIT_DSPLIT_ITEMS_PER_CTA 4
#endif
#ifndef KVSPLIT_DSPLIT_WIDE_ITEMS
#define KVSPLIT_DSPLIT_WIDE_ITEMS 1024
#endif
constexpr int kDsplitItemsPerCta = KVSPLIT_DSPLIT_ITEMS_PER_CTA;
constexpr int64_t kDsplitWideItems = KVSPLIT_DSPLIT_WIDE_ITEMS;
// Bytes of a row each lane loads per partial (a benchmarks/lab knob: 16, 8 or 4).
#ifndef KVSPLIT_DSPLIT_LANE_BYTES
#define KVSPLIT_DSPLIT_LANE_BYTES 16
#endif
constexpr int kDsplitLaneBytes = KVSPLIT_DSPLIT_LANE_BYTES;
// The plain kernel's element offsets in 32 bits (a benchmarks/lab knob: 0 keeps 64).
#ifndef KVSPLIT_DSPLIT_INDEX32
#define KVSPLIT_DSPLIT_INDEX32 1
#endif
// The plain kernel's stats into the merge as loaded, scaled there (a benchmarks/lab
// knob: 0 scales and tests each stat against the empty-split sentinel, as the
// general kernel does).
#ifndef KVSPLIT_DSPLIT_RAW_STATS
#define KVSPLIT_DSPLIT_RAW_STATS 1
#endif

// log2 of a power of two, -1 for anything else.
KVSPLIT_HOST_DEVICE constexpr int exact_log2(int value) {
  if (value < 1) return -1;
  int log2 = 0;
  while ((1 << log2) < value) ++log2;
  return (1 << log2) == value ? log2 : -1;
}

// Threads per group (16-byte vectors per slice of head_dim / slices
// elements), or 0 when that slice is not a power of two of 4..32 vectors.
KVSPLIT_HOST_DEVICE constexpr int dsplit_lanes(int head_dim, int elem_bytes, int slices) {
  const int row_bytes = head_dim * elem_bytes;
  if (exact_log2(slices) < 0 || row_bytes % (kDsplitLaneBytes * slices) != 0) return 0;
  const int lanes = row_bytes / (kDsplitLaneBytes * slices);
  return exact_log2(lanes) >= 0 && lanes >= kDsplitMinLanes && lanes <= kDsplitMaxLanes ? lanes : 0;
}

// A valid DSplit config as the kernel walks it (all counts are powers of two).
struct DsplitGeometry {
  int lanes_log2;     // threads per group = 16-byte vectors per slice
  int kv_split_log2;  // groups per CTA
  int slices_log2;    // CTAs per row
  int slice_elems;    // head_dim / slices
  int64_t items;      // rows * slices: the work of lanes * kv_split threads each
  int items_per_cta_log2;  // 0, or log2 of the items of one warp a CTA runs

  KVSPLIT_HOST_DEVICE int lanes() const { return 1 << lanes_log2; }
  KVSPLIT_HOST_DEVICE int threads() const { return 1 << (lanes_log2 + kv_split_log2); }
};

KVSPLIT_HOST_DEVICE constexpr DsplitGeometry make_dsplit_geometry(int head_dim, int elem_bytes,
                                                                  int slices, int kv_split,
                                                                  int64_t rows) {
  const int lanes = dsplit_lanes(head_dim, elem_bytes, slices);
  const int64_t items = rows * slices;
  const bool wide = kDsplitWideItems > 0 && items >= kDsplitWideItems;
  return DsplitGeometry{exact_log2(lanes), exact_log2(kv_split), exact_log2(slices),
                        head_dim / slices, items,
                        lanes * kv_split == 32 ? exact_log2(kDsplitItemsPerCta) + (wide ? 1 : 0)
                                               : 0};
}

}  // namespace kvsplit
