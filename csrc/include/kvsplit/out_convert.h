// Output conversions shared by the CUDA kernels and the CPU implementation:
// float to FP8 e4m3 (both encodings), bit-exact on host and device, and the
// scales of FP8 outputs.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kvsplit/config.h"
#include "kvsplit/host_device.h"

namespace kvsplit {

constexpr float kE4M3FnMax = 448.f;
constexpr float kE4M3FnuzMax = 240.f;
// The floor of a per-group amax, so that an all-zero group has a finite scale.
constexpr float kGroupScaleEps = 1e-10f;

KVSPLIT_HD uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits;
#endif
}

KVSPLIT_HD float bits_float(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
#endif
}

KVSPLIT_HD float fp8_max(DType dtype) {
  return dtype == DType::kFloat8E4M3FNUZ ? kE4M3FnuzMax : kE4M3FnMax;
}

// float -> e4m3 bits, round to nearest even, values past the largest finite
// one (infinities included) saturated to it, as Ada's and later GPUs'
// satfinite conversion does. fn: bias 7, NaN 0x7f; fnuz: bias 8, NaN 0x80
// and no negative zero.
KVSPLIT_HD uint8_t float_to_e4m3(float x, bool fnuz) {
  const uint32_t bits = float_bits(x);
  const uint32_t sign = (bits >> 24) & 0x80u;
  uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return fnuz ? 0x80u : static_cast<uint8_t>(sign | 0x7fu);
  const int bias = fnuz ? 8 : 7;
  const float limit = fnuz ? kE4M3FnuzMax : kE4M3FnMax;
  if (bits_float(magnitude) > limit) magnitude = float_bits(limit);
  const int exponent = static_cast<int>(magnitude >> 23) - 127;  // of the float
  uint32_t code;
  if (exponent < 1 - bias) {
    // Subnormal in e4m3: a multiple of 2^(-2 - bias); the scaling is exact.
    const float scaled = bits_float(magnitude) * (fnuz ? 1024.f : 512.f);
    // Round to nearest even by hand (no dependence on the rounding mode).
    const auto whole = static_cast<uint32_t>(scaled);
    const float fraction = scaled - static_cast<float>(whole);
    code = whole + ((fraction > 0.5f || (fraction == 0.5f && (whole & 1u))) ? 1u : 0u);
  } else {
    const uint32_t mantissa = magnitude & 0x7fffffu;
    uint32_t kept = mantissa >> 20;
    const uint32_t rest = mantissa & 0xfffffu;
    kept += (rest > 0x80000u || (rest == 0x80000u && (kept & 1u))) ? 1u : 0u;
    code = (static_cast<uint32_t>(exponent + bias) << 3) + kept;  // a carry bumps the exponent
  }
  if (fnuz && code == 0) return 0;  // no negative zero
  return static_cast<uint8_t>(sign | code);
}

// A per-group scale from the group's largest magnitude: amax / fp8 max
// (at least eps / fp8 max), rounded up to a power of two for ue8m0.
KVSPLIT_HD float group_scale(float amax, DType out, bool ue8m0) {
  if (amax != amax) return amax;  // a NaN in the group: its scale is NaN too
  float scale = (amax > kGroupScaleEps ? amax : kGroupScaleEps) / fp8_max(out);
  if (ue8m0) {
    const uint32_t bits = float_bits(scale);
    if ((bits & 0x7fffffu) != 0 && (bits & 0x7f800000u) != 0x7f800000u) {
      scale = bits_float((bits & 0xff800000u) + 0x800000u);
    }
  }
  return scale;
}

// The ue8m0 byte of a power-of-two scale: its biased exponent.
KVSPLIT_HD uint8_t ue8m0_byte(float scale) { return static_cast<uint8_t>(float_bits(scale) >> 23); }

// The value that goes into an FP8 store: x / scale, as x times the scale's
// inverse. The conversion saturates it to the format's range (NaN stays
// NaN), so no clamp comes before it.
KVSPLIT_HD float fp8_prepare(float x, float inverse_scale) { return x * inverse_scale; }

}  // namespace kvsplit
