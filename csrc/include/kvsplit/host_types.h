// bfloat16 / float16 <-> float32 on the host, bit-exact with the CUDA
// intrinsics for finite values (round to nearest even) and keeping NaN a NaN.
#pragma once

#include <cstdint>
#include <cstring>

namespace kvsplit::host {

inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

inline float bfloat16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

inline uint16_t float_to_bfloat16(float f) {
  const uint32_t bits = float_to_bits(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

inline float float16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1fu) return bits_to_float(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {
    // Subnormal (or zero): value = mantissa * 2^-24, exact in float32.
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -magnitude : magnitude;
  }
  return bits_to_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

inline uint16_t float_to_float16(float f) {
  const uint32_t bits = float_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return sign | 0x7e00u;           // NaN
  if (magnitude >= 0x477ff000u) return sign | 0x7c00u;          // rounds to inf
  if (magnitude < 0x38800000u) {                                // subnormal or zero
    // Scale so that the half subnormal step 2^-24 is one unit, then round to
    // nearest even through float arithmetic.
    const float scaled = bits_to_float(magnitude) * 16777216.f;
    float rounded = static_cast<float>(static_cast<int32_t>(scaled));
    const float fraction = scaled - rounded;
    if (fraction > 0.5f || (fraction == 0.5f && (static_cast<int32_t>(rounded) & 1))) rounded += 1.f;
    return sign | static_cast<uint16_t>(static_cast<int32_t>(rounded));
  }
  const uint32_t rebased = magnitude - (112u << 23);
  const uint32_t rounding = 0xfffu + ((rebased >> 13) & 1u);
  return sign | static_cast<uint16_t>((rebased + rounding) >> 13);
}

}  // namespace kvsplit::host
