// The online-softmax merge step, shared by the CUDA kernels and the CPU
// implementation. Plain floats only: loading and converting the partials is
// each implementation's business.
//
// Everything works in one domain: a partial is a state (m, l, acc) standing
// for the softmax numerator acc * 2^m and denominator l * 2^m, where m is the
// partial's maximum logit already multiplied into base 2 (maxsum stats: m =
// scale_log2 * raw max; lse stats: m = lse in base 2, l = 1). Both stats
// formats therefore share every line below.
#pragma once

#include <cmath>

#include "kvsplit/host_device.h"
#include "kvsplit/knobs.h"

namespace kvsplit {

constexpr float kLog2E = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kFloatMinNormal = 1.17549435e-38f;
constexpr float kFastDivideLimit = 8.50705917e37f;  // 2^126


KVSPLIT_HD float neg_inf() { return -INFINITY; }

KVSPLIT_HD float fast_exp2(float x) {
#if defined(__CUDA_ARCH__)
  // One MUFU.EX2. exp2f adds a denormal-range fix-up around it, which cost
  // the K = 1 loop 8-20 % of its time on an H200; a weight below 2^-126
  // next to the running max's weight of 1 is zero for any merge.
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return std::exp2(x);
#endif
}

// a / b and log2(x) for a row's last step. On the GPU: MUFU.RCP and MUFU.LG2
// (relative error about 2^-22), not the IEEE division and log2f sequences.
KVSPLIT_HD float fast_divide(float a, float b) {
#if defined(__CUDA_ARCH__) && KVSPLIT_LEAN_MATH
  return __fdividef(a, b);
#else
  return a / b;
#endif
}
// 1 / x by MUFU.RCP alone: fast_divide(1, x) scales a divisor below float32's
// normal range first, which finalize_lse's denominators in [1, N] never are
// (the same value there; 0 and NaN give inf and NaN either way).
KVSPLIT_HD float fast_reciprocal(float x) {
#if defined(__CUDA_ARCH__) && KVSPLIT_LEAN_MATH
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return 1.f / x;
#endif
}
KVSPLIT_HD float fast_log2(float x) {
#if defined(__CUDA_ARCH__) && KVSPLIT_LEAN_MATH
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#elif defined(__CUDA_ARCH__)
  return log2f(x);
#else
  return std::log2(x);
#endif
}

// x * scale - offset: one FFMA on the GPU. The CPU keeps the two roundings
// (exact for the scale of 1 that it always passes).
KVSPLIT_HD float scaled_minus(float x, float scale, float offset) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(x, scale, -offset);
#else
  return x * scale - offset;
#endif
}

// max that lets a NaN through, so that a NaN stat poisons its row instead of
// being silently dropped (fmaxf would drop it). On the GPU one FMNMX.NAN; the
// compare-and-select form took four instructions a partial.
KVSPLIT_HD float max_keep_nan(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 && KVSPLIT_LEAN_MATH
  float y;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b));
  return y;
#else
  return (b > a || b != b) ? b : a;
#endif
}

// Weight of a state with maximum `m` once the running maximum is `m_new`.
// An empty state (m = -inf) weighs exactly 0, even when m_new is -inf too,
// which is what keeps empty rows free of NaN.
KVSPLIT_HD float rescale_weight(float m, float m_new) {
  return m == neg_inf() ? 0.f : fast_exp2(m - m_new);
}

// The running max as the exponent's offset: 0 while every state is empty, so
// that 2^(m - offset) is 2^-inf = 0 for an empty m without a test per partial
// (-inf - -inf would be NaN).
KVSPLIT_HD float weight_offset(float m_new) { return m_new == neg_inf() ? 0.f : m_new; }

// A row's running state in the stats' own units: m is the largest raw stat
// (a maxsum max or an LSE) seen so far, and the call's `scale` (passed to
// each step, a value of the call rather than of the state) takes a
// difference of raw stats into base 2 (maxsum: scale_log2; LSE: 1 or log2 e). A weight is
// 2^((m_i - m) * scale): the difference is taken before the scale, so no
// finite stat or scale overflows on the way (a stat times a large scale
// would, and inf - inf is NaN), and the weight of the largest stat is 1.
template <int kVec>
struct MergeState {
  float m;
  float l;
  float acc[kVec];

  KVSPLIT_HD void reset() {
    m = neg_inf();
    l = 0.f;
#pragma unroll
    for (int v = 0; v < kVec; ++v) acc[v] = 0.f;
  }

  // 2^((x - offset) * scale): one FADD and one FMUL before the exponent.
  static KVSPLIT_HD float weight(float x, float offset, float scale) {
    return fast_exp2((x - offset) * scale);
  }

  // Folds kDepth loaded partials into the state (raw stats m_in, -inf for an
  // empty or padded slot). The running max moves once per batch and the old
  // state is rescaled before anything is added, so a padded slot can never
  // move the max without rescaling. `o_at(j, v)` yields element v of partial
  // j, so that callers can keep the partials packed (16-bit) in registers
  // until this very multiply.
  template <int kDepth, typename OAt>
  KVSPLIT_HD void merge_batch(const float (&m_in)[kDepth], const float (&l_in)[kDepth],
                              OAt&& o_at, float scale) {
    float in_max = m_in[0];
#pragma unroll
    for (int j = 1; j < kDepth; ++j) in_max = max_keep_nan(in_max, m_in[j]);
    const float m_new = max_keep_nan(m, in_max);
    const float offset = weight_offset(m_new);
    const float alpha = weight(m, offset, scale);  // 0 for an empty state
    l *= alpha;
#pragma unroll
    for (int v = 0; v < kVec; ++v) acc[v] *= alpha;
#pragma unroll
    for (int j = 0; j < kDepth; ++j) {
      const float w = weight(m_in[j], offset, scale);
      l += w * l_in[j];
#pragma unroll
      for (int v = 0; v < kVec; ++v) acc[v] += w * o_at(j, v);
    }
    m = m_new;
  }

  // A pass-through state: one split taken as it is, whatever its stat. An
  // LSE split has l = 1; a maxsum split is divided by its sum l (0: empty).
  KVSPLIT_HD void set_single(float l_in) {
    m = l_in == 0.f ? neg_inf() : 0.f;
    l = l_in;
  }

  // Adds another group's state (same scale). An empty state (m = -inf)
  // weighs 0 with the same exponent offset as merge_batch, and its l and
  // accumulators are 0 (its partials were weighed 0), so it adds nothing,
  // with no test for it.
  KVSPLIT_HD void combine(float m_other, float l_other, const float* acc_other,
                          int acc_stride, float scale) {
    const float m_new = max_keep_nan(m, m_other);
#if KVSPLIT_LEAN_COMBINE
    const float offset = weight_offset(m_new);
    const float a = weight(m, offset, scale);
    const float b = weight(m_other, offset, scale);
#else
    if (m_other == neg_inf()) return;
    const float offset = weight_offset(m_new);
    const float a = m == neg_inf() ? 0.f : weight(m, offset, scale);
    const float b = weight(m_other, offset, scale);
#endif
    l = l * a + l_other * b;
#pragma unroll
    for (int v = 0; v < kVec; ++v) acc[v] = acc[v] * a + acc_other[v * acc_stride] * b;
    m = m_new;
  }

  // Normalises the state into `out`. Returns the row's denominator relative
  // to 2^(m * scale), sink included (the maxsum layout's L: it may overflow
  // to inf when a sink dwarfs every split), and sets `log2_rel` to log2 of
  // the denominator relative to 2^top, top = max(m * scale, sink_log2)
  // (finite; the caller adds top in whatever unit it exports). `sink_log2`
  // is the sink logit in base 2 (-inf: none). An empty row writes zeros,
  // returns 0 and sets -inf; its sink is ignored because a sink has zero
  // output and nothing else would be normalised by it. A denominator below
  // float32's normal range or past 2^126 (tiny or huge maxsum sums) takes the
  // exact division and log2 (the fast ones give 0 or -inf there).
  KVSPLIT_HD float finalize(float sink_log2, float scale, float (&out)[kVec],
                            float& log2_rel) const {
    if (m == neg_inf()) {
#pragma unroll
      for (int v = 0; v < kVec; ++v) out[v] = 0.f;
      log2_rel = neg_inf();
      return 0.f;
    }
    const float ms = m * scale;  // may overflow to inf; then no sink can dominate
    const bool sink_on_top = sink_log2 > ms;
    const float own = sink_on_top ? fast_exp2(ms - sink_log2) : 1.f;
    const float sink_weight = sink_on_top ? 1.f : rescale_weight(sink_log2, ms);
    const float total_top = l * own + sink_weight;
    // The fast divide returns 0 for a divisor past 2^126 and the fast log2
    // flushes subnormals: both ends take the exact operations.
    if (total_top >= kFloatMinNormal && total_top < kFastDivideLimit) {
      const float factor = fast_divide(own, total_top);
#pragma unroll
      for (int v = 0; v < kVec; ++v) out[v] = acc[v] * factor;
      log2_rel = fast_log2(total_top);
    } else {
#pragma unroll
      for (int v = 0; v < kVec; ++v) out[v] = acc[v] / total_top * own;
      log2_rel = log2f(total_top);
    }
    return l + (sink_on_top ? fast_exp2(sink_log2 - ms) : sink_weight);
  }

  // finalize for LSE stats and no sink: every state weighs at most 1 and the
  // largest exactly 1, so the denominator l lies in [1, N] (0 for an empty
  // row, NaN after a NaN stat) and the fast reciprocal and log2 need no range
  // check. The same values as finalize(-inf, ...), an empty row's zeros
  // included whatever its partials hold, with selects for its branches.
  KVSPLIT_HD float finalize_lse(float (&out)[kVec], float& log2_rel) const {
    const bool empty = m == neg_inf();
    const float factor = fast_reciprocal(l);
#pragma unroll
    for (int v = 0; v < kVec; ++v) out[v] = empty ? 0.f : acc[v] * factor;
    log2_rel = empty ? neg_inf() : fast_log2(l);
    return l;
  }

  // The row's log2 total, absolute, in the stats' units times `export_scale`
  // (an LSE export): (m * scale + log2_rel) * export_scale, formed as
  // m * (scale * export_scale) + log2_rel * export_scale so that a large
  // raw stat does not overflow on the way (scale * export_scale is 1 for an
  // LSE). With a dominating sink the top is the sink's.
  KVSPLIT_HD float exported_log2_total(float sink_log2, float scale, float log2_rel,
                                       float export_scale) const {
    if (m == neg_inf()) return neg_inf();
    const float ms = m * scale;
    if (sink_log2 > ms) return (sink_log2 + log2_rel) * export_scale;
    return m * (scale * export_scale) + log2_rel * export_scale;
  }
};

}  // namespace kvsplit
