// The Few family's geometry: how a config maps a call onto threads and CTAs.
// Used by config.h's validity check, the CUDA launcher and the binding alike.
//
// A thread owns `vectors` 16-byte vectors of one row: lanes lane, lane + L,
// lane + 2L, ... of the row's V vectors, L = ceil(V / vectors) threads a row
// (so that a warp's loads of one step are consecutive in every row). Rows
// follow one another across threads, warps and CTAs with no padding: a call
// of R rows is R * L threads, whatever the head dim.
#pragma once

#include <cstdint>

#include "kvsplit/host_device.h"
#include "kvsplit/knobs.h"

namespace kvsplit {

constexpr int kFewVectorBytes = 16;  // a thread's load of one state's vector
// depth * vectors: the 16-byte loads a thread holds in registers per round,
// at most this many with several vectors a thread; one vector a thread takes
// any depth (16 states in one round trip, for decode). Seven (depth, vectors) pairs per
// (partial dtype, stats format) instead of nine: the build's time.
constexpr int kFewMaxLoads = 8;

// Whether a thread of `vectors` vectors may load `depth` states a round.
KVSPLIT_HOST_DEVICE constexpr bool few_loads_fit(int depth, int vectors) {
  return vectors == 1 || depth * vectors <= kFewMaxLoads;
}

// The most states one merge_batch of a Few round folds: a round of more
// loads them all first, then folds them in batches of this many, in order (a
// batch's max, the state rescaled once, its states), so that ptxas need not
// hold every loaded state until the round's last arrives. Folded at once, a
// round of sixteen took 160 registers a thread (sm_90a), one CTA of 256 an SM,
// and an 18 MB merge ran 1.55x the read probe (benchmarks/lab/lab_split.py);
// in batches of eight it takes 106.
constexpr int kFewMathBatch = 8;

// States loaded per round by a thread of `vectors` vectors in a call of
// `num_splits` states: the smallest power of two from kFewMinDepth that
// takes them all in one round, or the largest up to kFewMaxDepth that fits
// (few_loads_fit), in which case a row takes several rounds. A function of
// the call, not a tuned parameter, so that one config serves a key's whole
// bucket of split counts (2 and 4 share one) at one round trip wherever the
// loads fit.
constexpr int kFewMinDepth = 2;
constexpr int kFewMaxDepth = 16;
KVSPLIT_HOST_DEVICE constexpr int few_depth(int64_t num_splits, int vectors) {
  int depth = kFewMinDepth;
  while (depth < kFewMaxDepth && depth < num_splits && few_loads_fit(2 * depth, vectors)) {
    depth *= 2;
  }
  return depth;
}
// Threads per CTA: a multiple of 32 from the minimum (128) to the maximum
// that spreads a call most evenly over the SMs (make_few_launch), so that no
// SM runs twice the others' rows; large calls run CTAs of the maximum. At one
// token fewer, larger CTAs win over more SMs: CTAs of 128 took 0.01-0.09 us
// less than CTAs of 32 (H100, benchmarks/bench_few.py).
constexpr int kFewMinCtaThreads = KVSPLIT_FEW_MIN_CTA_THREADS;
static_assert(KVSPLIT_FEW_MIN_CTA_THREADS % 32 == 0, "Few CTAs are whole warps");
constexpr int kFewMaxCtaThreads = KVSPLIT_FEW_MAX_CTA_THREADS;
// The launch bounds' minimum of CTAs per SM (KVSPLIT_FEW_MIN_CTAS, 1) lets a
// kernel take the registers to issue a whole round's loads back to back.
// The most threads one pass of the grid runs; a larger call loops over passes
// (thread indices stay below 2^31 for FastDivmod).
constexpr int64_t kFewMaxGridThreads = int64_t{1} << 30;

// Threads per row, L = ceil(V / vectors), or 0 when `vectors` leaves a step
// of every row's threads empty ((vectors - 1) * L >= V: more vectors per
// thread than the row fills), or the row is not whole 16-byte vectors. The
// lean kernel's threads take vectors of 8 bytes of 16-bit partials in some
// calls (`vector_bytes`: merge_few.cuh's few_lean_vector_bytes).
KVSPLIT_HOST_DEVICE constexpr int few_threads_per_row(int head_dim, int elem_bytes, int vectors,
                                                      int vector_bytes = kFewVectorBytes) {
  if (vectors < 1 || elem_bytes < 1 || head_dim < 1 || (head_dim * elem_bytes) % kFewVectorBytes) {
    return 0;
  }
  const int row_vectors = head_dim * elem_bytes / vector_bytes;
  const int lanes = (row_vectors + vectors - 1) / vectors;
  return (vectors - 1) * lanes < row_vectors ? lanes : 0;
}

// n / d and n % d for 0 <= n < 2^31 by one multiply-high and a shift, with
// the divisor's magic numbers made once on the host: a 32-bit division by a
// runtime value is a sequence of about 20 instructions on the GPU, which
// every thread would pay before its first load. Multiplier 2^p / d rounded
// up, p = 31 + ceil(log2 d) (the round-up's error stays below one quotient
// step for every n < 2^31).
struct FastDivmod {
  uint32_t divisor = 1;
  uint32_t multiplier = 0;
  uint32_t shift = 0;

  constexpr FastDivmod() = default;
  KVSPLIT_HOST_DEVICE constexpr explicit FastDivmod(uint32_t d) : divisor(d < 1 ? 1 : d) {
    if (divisor > 1) {
      uint32_t log2 = 0;
      while ((uint32_t{1} << log2) < divisor) ++log2;
      const uint32_t p = 31 + log2;
      multiplier = static_cast<uint32_t>(((uint64_t{1} << p) + divisor - 1) / divisor);
      shift = p - 32;
    }
  }
  KVSPLIT_HOST_DEVICE constexpr uint32_t div(uint32_t n) const {
    return divisor == 1 ? n : static_cast<uint32_t>((uint64_t{n} * multiplier) >> 32) >> shift;
  }
};

// Every divisor a row can have (up to 256 vectors) against exact division at
// the ends of the range and around multiples of the divisor.
KVSPLIT_HOST_DEVICE constexpr bool fast_divmod_exact(uint32_t max_divisor) {
  for (uint32_t d = 1; d <= max_divisor; ++d) {
    const FastDivmod fast(d);
    const uint32_t top = 0x7fffffffu;
    const uint32_t probes[] = {0u, 1u, d - 1, d, d + 1, 2 * d - 1, 1000003u, top / 2, top - d,
                               top - d + 1, top - 1, top, (top / d) * d, (top / d) * d - 1};
    for (const uint32_t n : probes) {
      if (fast.div(n) != n / d) return false;
    }
  }
  return true;
}
static_assert(fast_divmod_exact(1024), "FastDivmod must divide exactly below 2^31");

// Where a call runs: threads per CTA, CTAs, and the rows one pass of the
// grid covers (the call's rows when one pass covers them all).
struct FewLaunch {
  int32_t cta_threads;
  int64_t ctas;
  int64_t rows_per_pass;
};

// The launch of `rows` rows of `lanes` threads each on `sm_count` SMs. A
// call of up to kFewBalancedSmThreads threads an SM: the CTA size whose
// busiest SM gets the fewest threads (ceil(CTAs / SMs) CTAs), the largest of
// equals. A power of two can leave a third of the SMs idle (an SM's share of
// 150 threads in CTAs of 256), or give some SMs twice the others' rows (144
// CTAs of 256 on 132 SMs), and a merge that fits the SMs at once lasts as
// long as its busiest SM. A larger call takes CTAs of the maximum, so that
// as many threads stay resident as registers allow.
constexpr int64_t kFewBalancedSmThreads = 4 * kFewMaxCtaThreads;

KVSPLIT_HOST_DEVICE constexpr FewLaunch make_few_launch(int lanes, int64_t rows, int sm_count) {
  const int64_t threads = rows * lanes;
  const int64_t sms = sm_count > 0 ? sm_count : 1;
  if (threads <= kFewMaxGridThreads && (threads + sms - 1) / sms <= kFewBalancedSmThreads) {
    int32_t best = kFewMinCtaThreads;
    int64_t best_load = INT64_MAX;
    for (int32_t cta = kFewMinCtaThreads; cta <= kFewMaxCtaThreads; cta += 32) {
      const int64_t ctas = (threads + cta - 1) / cta;
      const int64_t load = (ctas + sms - 1) / sms * cta;
      if (load <= best_load) {
        best = cta;
        best_load = load;
      }
    }
    return FewLaunch{best, (threads + best - 1) / best, rows};
  }
  const int64_t per_sm = (threads + sms - 1) / sms;
  int32_t cta = kFewMinCtaThreads;
  while (cta < per_sm && cta < kFewMaxCtaThreads) cta *= 2;
  if (threads <= kFewMaxGridThreads) return FewLaunch{cta, (threads + cta - 1) / cta, rows};
  // Passes of m * cta rows on m * lanes CTAs: the grid's threads are exactly
  // whole rows, so a thread keeps its lane from one pass to the next.
  const int64_t m = kFewMaxGridThreads / (int64_t{lanes} * cta);
  return FewLaunch{cta, m * lanes, m * cta};
}

// What the kernels need of the geometry: threads per row (as a divisor), the
// row's vectors, the rows of one pass, and whether the call is plain: flat
// rows, every row merging all num_splits states (no row mask, split counts,
// indptr or pass-through rows), so that a row's offsets are one multiply.
struct FewGeometry {
  FastDivmod lanes;
  int32_t row_vectors;
  int64_t rows_per_pass;
  bool plain;
};

}  // namespace kvsplit
