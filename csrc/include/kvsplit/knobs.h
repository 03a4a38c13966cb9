// Compile-time values that benchmarks/lab varies: it builds kernel variants
// side by side with -D flags of these names. The values below are the
// product's, and the kernel headers read these names from this file alone.
// What each variant measured, and why these values stand: docs/history.md.
#pragma once

// KvSplit family (merge_kvsplit.cuh): slots loaded per round, and the launch
// bounds' minimum of CTAs per SM (kKvSplitCtasPerSm: the 64-register cap).
#ifndef KVSPLIT_LOAD_UNROLL
#define KVSPLIT_LOAD_UNROLL 4
#endif
#ifndef KVSPLIT_MIN_CTAS
#define KVSPLIT_MIN_CTAS kKvSplitCtasPerSm
#endif

// Merge math (merge_math.h): MUFU-only exp2 and division on the GPU, and
// combine() without a test for an empty state.
#ifndef KVSPLIT_LEAN_MATH
#define KVSPLIT_LEAN_MATH 1
#endif
#ifndef KVSPLIT_LEAN_COMBINE
#define KVSPLIT_LEAN_COMBINE 1
#endif

// DSplit family (dsplit_geometry.h, merge_dsplit.cuh): one-warp items to a
// CTA, and twice as many from this many items a call (0: never); bytes a lane
// loads per partial; 32-bit element offsets and stats merged as loaded in the
// plain kernel; round depth from which a plain kernel gets one CTA an SM's
// registers (the general kernel always does).
#ifndef KVSPLIT_DSPLIT_ITEMS_PER_CTA
#define KVSPLIT_DSPLIT_ITEMS_PER_CTA 4
#endif
#ifndef KVSPLIT_DSPLIT_WIDE_ITEMS
#define KVSPLIT_DSPLIT_WIDE_ITEMS 1024
#endif
#ifndef KVSPLIT_DSPLIT_LANE_BYTES
#define KVSPLIT_DSPLIT_LANE_BYTES 16
#endif
#ifndef KVSPLIT_DSPLIT_INDEX32
#define KVSPLIT_DSPLIT_INDEX32 1
#endif
#ifndef KVSPLIT_DSPLIT_RAW_STATS
#define KVSPLIT_DSPLIT_RAW_STATS 1
#endif
#ifndef KVSPLIT_DSPLIT_ROOMY_DEPTH
#define KVSPLIT_DSPLIT_ROOMY_DEPTH 8
#endif

// Few family (few_geometry.h, merge_few.cuh): the smallest and largest CTA
// in threads, and the launch bounds' minimum of CTAs per SM.
#ifndef KVSPLIT_FEW_MIN_CTA_THREADS
#define KVSPLIT_FEW_MIN_CTA_THREADS 128
#endif
#ifndef KVSPLIT_FEW_MAX_CTA_THREADS
#define KVSPLIT_FEW_MAX_CTA_THREADS 256
#endif
#ifndef KVSPLIT_FEW_MIN_CTAS
#define KVSPLIT_FEW_MIN_CTAS 1
#endif
