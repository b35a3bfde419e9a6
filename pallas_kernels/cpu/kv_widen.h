// Widening a KV pool's stored values to float32: the pool holds float32, or a narrower float stored as
// integers of its width (pallas_kernels.kv_storage); Widen<kind>::get reads one value.
#pragma once

#include <cstdint>
#include <cstring>

namespace jaxpaged {

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    int e = -1;
    uint32_t m = man;
    do { ++e; m <<= 1; } while ((m & 0x400u) == 0);
    bits = sign | ((112 - e) << 23) | ((m & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

float f8_to_f32(uint8_t v, int exp_bits, int man_bits, int bias, bool has_inf) {
  const int sign = v >> 7, exp = (v >> man_bits) & ((1 << exp_bits) - 1), man = v & ((1 << man_bits) - 1);
  const int max_exp = (1 << exp_bits) - 1;
  float mag;
  if (has_inf && exp == max_exp) {
    mag = man ? NAN : INFINITY;
  } else if (!has_inf && exp == max_exp && man == (1 << man_bits) - 1) {
    mag = NAN;  // e4m3fn: S.1111.111 is the only NaN
  } else if (exp == 0) {
    mag = std::ldexp(static_cast<float>(man), 1 - bias - man_bits);
  } else {
    mag = std::ldexp(static_cast<float>(man + (1 << man_bits)), exp - bias - man_bits);
  }
  return sign ? -mag : mag;
}

struct F8Tables {
  float e4m3[256], e5m2[256];
  F8Tables() {
    for (int i = 0; i < 256; ++i) {
      e4m3[i] = f8_to_f32(static_cast<uint8_t>(i), 4, 3, 7, false);
      e5m2[i] = f8_to_f32(static_cast<uint8_t>(i), 5, 2, 15, true);
    }
  }
};
const F8Tables kF8;

enum class Kv { kF32, kBF16, kF16, kE4M3, kE5M2 };

template <Kv kind>
struct Widen;
template <>
struct Widen<Kv::kF32> {
  using T = float;
  static float get(float x) { return x; }
};
template <>
struct Widen<Kv::kBF16> {
  using T = uint16_t;
  static float get(uint16_t x) {
    uint32_t bits = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
};
template <>
struct Widen<Kv::kF16> {
  using T = uint16_t;
  static float get(uint16_t x) { return f16_to_f32(x); }
};
template <>
struct Widen<Kv::kE4M3> {
  using T = uint8_t;
  static float get(uint8_t x) { return kF8.e4m3[x]; }
};
template <>
struct Widen<Kv::kE5M2> {
  using T = uint8_t;
  static float get(uint8_t x) { return kF8.e5m2[x]; }
};

}  // namespace jaxpaged
