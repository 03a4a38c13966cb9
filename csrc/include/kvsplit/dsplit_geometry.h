// The DSplit family's geometry: how a config maps onto lanes, groups and CTAs.
// Used by config.h's validity check, the CUDA launcher and the CPU
// implementation alike.
#pragma once

#include <cstdint>

#include "kvsplit/host_device.h"
#include "kvsplit/knobs.h"

namespace kvsplit {

constexpr int kDsplitMinLanes = 4;  // 16-byte vectors per slice: a group is 4..32 lanes
constexpr int kDsplitMaxLanes = 32;  // of one warp
constexpr int kDsplitMinThreads = 32;
constexpr int kDsplitMaxThreads = 512;
// Items of one warp (lanes * kv_split = 32) run this many to a CTA, one per
// warp, and twice as many in a call of kDsplitWideItems items or more.
constexpr int kDsplitItemsPerCta = KVSPLIT_DSPLIT_ITEMS_PER_CTA;
constexpr int64_t kDsplitWideItems = KVSPLIT_DSPLIT_WIDE_ITEMS;
// Bytes of a row each lane loads per partial.
constexpr int kDsplitLaneBytes = KVSPLIT_DSPLIT_LANE_BYTES;

// 16-byte vectors of each slice of a row cut into `slices` (the last slice
// may be shorter), or 0 when `slices` is not a power of two or leaves a slice
// empty.
KVSPLIT_HOST_DEVICE constexpr int dsplit_slice_vectors(int head_dim, int elem_bytes, int slices) {
  const int vectors = head_dim * elem_bytes / kDsplitLaneBytes;
  if (exact_log2(slices) < 0 || vectors < 1 || (head_dim * elem_bytes) % kDsplitLaneBytes) return 0;
  const int per_slice = (vectors + slices - 1) / slices;
  return per_slice * (slices - 1) < vectors ? per_slice : 0;
}

// The smallest power of two >= value (value >= 1).
KVSPLIT_HOST_DEVICE constexpr int pow2_ceil(int value) {
  int p = 1;
  while (p < value) p <<= 1;
  return p;
}

// Threads per group: the slice's vectors rounded up to a power of two (so
// that groups tile a warp and combine by shuffles), or 0 when that is not
// 4..32 lanes or would idle half of them or more. Lanes past the slice's
// vectors hold an empty state and store nothing; a power-of-two row keeps
// every lane busy.
KVSPLIT_HOST_DEVICE constexpr int dsplit_lanes(int head_dim, int elem_bytes, int slices) {
  const int per_slice = dsplit_slice_vectors(head_dim, elem_bytes, slices);
  if (per_slice < 1) return 0;
  const int lanes = pow2_ceil(per_slice);
  return lanes >= kDsplitMinLanes && lanes <= kDsplitMaxLanes && 2 * per_slice > lanes ? lanes : 0;
}

// A valid DSplit config as the kernel walks it (all counts are powers of two).
struct DsplitGeometry {
  int lanes_log2;     // threads per group = 16-byte vectors per slice
  int kv_split_log2;  // groups per CTA
  int slices_log2;    // CTAs per row
  int slice_elems;    // elements of a slice (the last one may be shorter)
  int slice_vectors;  // lanes of a group that hold a vector of the slice
  int64_t items;      // rows * slices: the work of lanes * kv_split threads each
  int items_per_cta_log2;  // 0, or log2 of the items of one warp a CTA runs

  KVSPLIT_HOST_DEVICE int lanes() const { return 1 << lanes_log2; }
  KVSPLIT_HOST_DEVICE int threads() const { return 1 << (lanes_log2 + kv_split_log2); }
};

KVSPLIT_HOST_DEVICE constexpr DsplitGeometry make_dsplit_geometry(int head_dim, int elem_bytes,
                                                                  int slices, int kv_split,
                                                                  int64_t rows) {
  const int lanes = dsplit_lanes(head_dim, elem_bytes, slices);
  const int slice_vectors = dsplit_slice_vectors(head_dim, elem_bytes, slices);
  const int64_t items = rows * slices;
  const bool wide = kDsplitWideItems > 0 && items >= kDsplitWideItems;
  return DsplitGeometry{exact_log2(lanes), exact_log2(kv_split), exact_log2(slices),
                        slice_vectors * kDsplitLaneBytes / elem_bytes, slice_vectors, items,
                        lanes * kv_split == 32 ? exact_log2(kDsplitItemsPerCta) + (wide ? 1 : 0)
                                               : 0};
}

}  // namespace kvsplit
