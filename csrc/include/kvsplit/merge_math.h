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

namespace kvsplit {

constexpr float kLog2E = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

#ifndef KVSPLIT_LEAN_MATH
#define KVSPLIT_LEAN_MATH 1
#endif
// combine() without a test for an empty state (a benchmarks/lab knob: 0 skips it).
#ifndef KVSPLIT_LEAN_COMBINE
#define KVSPLIT_LEAN_COMBINE 1
#endif

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

  // Folds kDepth loaded partials into the state: partial j's m is
  // m_in[j] * scale (scale > 0; the kernels that read stats raw pass the
  // call's scale here instead of scaling each stat). The running max moves
  // once per batch and the old state is rescaled before anything is added,
  // so a padded slot (m = -inf) can never move the max without rescaling.
  // With a positive scale the largest m_in gives the largest m, so the max
  // is taken raw and scaled once, and a weight is 2^(m_in * scale - offset),
  // one FFMA before the exponent. `o_at(j, v)` yields element v of partial j,
  // so that callers can keep the partials packed (16-bit) in registers until
  // this very multiply.
  template <int kDepth, typename OAt>
  KVSPLIT_HD void merge_batch(const float (&m_in)[kDepth], const float (&l_in)[kDepth],
                              OAt&& o_at, float scale = 1.f) {
    float in_max = m_in[0];
#pragma unroll
    for (int j = 1; j < kDepth; ++j) in_max = max_keep_nan(in_max, m_in[j]);
    const float m_new = max_keep_nan(m, in_max * scale);
    const float alpha = rescale_weight(m, m_new);
    l *= alpha;
#pragma unroll
    for (int v = 0; v < kVec; ++v) acc[v] *= alpha;
#if KVSPLIT_LEAN_MATH
    const float offset = weight_offset(m_new);
#endif
#pragma unroll
    for (int j = 0; j < kDepth; ++j) {
#if KVSPLIT_LEAN_MATH
      const float w = fast_exp2(scaled_minus(m_in[j], scale, offset));
#else
      const float w = rescale_weight(m_in[j] * scale, m_new);
#endif
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

  // Adds another group's state. An empty state (m = -inf) weighs 0 with the
  // same exponent offset as merge_batch, and its l and accumulators are 0
  // (its partials were weighed 0), so it adds nothing, with no test for it.
  KVSPLIT_HD void combine(float m_other, float l_other, const float* acc_other,
                          int acc_stride) {
    const float m_new = max_keep_nan(m, m_other);
#if KVSPLIT_LEAN_COMBINE
    const float offset = weight_offset(m_new);
    const float a = fast_exp2(m - offset);
    const float b = fast_exp2(m_other - offset);
#else
    if (m_other == neg_inf()) return;
    const float a = rescale_weight(m, m_new);
    const float b = rescale_weight(m_other, m_new);
#endif
    l = l * a + l_other * b;
#pragma unroll
    for (int v = 0; v < kVec; ++v) acc[v] = acc[v] * a + acc_other[v * acc_stride] * b;
    m = m_new;
  }

  // Normalises the state into `out`. Returns the row's denominator relative
  // to 2^m, sink included (the maxsum layout's L: it may overflow to inf
  // when a sink dwarfs every split), and sets `log2_total` to log2 of the
  // absolute denominator, which stays finite because it is taken relative to
  // max(m, sink). `sink_log2` is the sink logit in base 2 (-inf: none).
  // An empty row writes zeros, returns 0 and sets -inf; its sink is ignored
  // because a sink has zero output and nothing else would be normalised by it.
  KVSPLIT_HD float finalize(float sink_log2, float (&out)[kVec], float& log2_total) const {
    if (m == neg_inf()) {
#pragma unroll
      for (int v = 0; v < kVec; ++v) out[v] = 0.f;
      log2_total = neg_inf();
      return 0.f;
    }
    const float top = max_keep_nan(m, sink_log2);
    const float own = fast_exp2(m - top);  // 1 unless the sink dominates
    const float total_top = l * own + rescale_weight(sink_log2, top);
    const float scale = fast_divide(own, total_top);
#pragma unroll
    for (int v = 0; v < kVec; ++v) out[v] = acc[v] * scale;
    log2_total = top + fast_log2(total_top);
    return l + rescale_weight(sink_log2, m);
  }
};

}  // namespace kvsplit
