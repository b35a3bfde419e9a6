// Float vectors for the CPU kernels: one register wide (GCC/Clang vector extensions, one source for AVX-512,
// AVX2 or NEON), with the exp, lane folds and tanh cap the attention kernel's softmax needs without libm.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace jaxpaged {

// e^r for |r| <= ln2/2 by its degree-6 Taylor polynomial (relative error < 2e-7); T: float or a float vector.
template <typename T>
inline T exp_reduced(T r) {
  T p = T{} + 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  return p * r + 1.f;
}

// exp(x) for x <= 0 without a libm call: x = n ln2 + r, |r| <= ln2/2, e^r by `exp_reduced`; below -87 it
// returns 0.
inline float exp_nonpositive(float x) {
  const float xc = x < -87.f ? -87.f : x;
  const float n = std::nearbyint(xc * 1.44269504f);
  const float r = xc - n * 0.693145752f - n * 1.42860677e-6f;  // ln2 in two parts
  const float p = exp_reduced(r);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return x < -87.f ? 0.f : p * scale;
}

// One vector register of floats (GCC/Clang vector extensions: one source for AVX-512, AVX2 or NEON). Generic
// vectors wider than the machine's registers compile to stack spills (many times slower:
// docs/benchmarks/design-choices.md), so the width follows the target.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;  // AVX2: one register; NEON: two
#endif
typedef float vf __attribute__((vector_size(4 * kLanes), aligned(4)));
typedef int32_t vi __attribute__((vector_size(4 * kLanes), aligned(4)));
typedef float vf8 __attribute__((vector_size(32), aligned(4)));
typedef float vf4 __attribute__((vector_size(16), aligned(4)));

inline vf load(const float* p) { return *reinterpret_cast<const vf*>(p); }
inline void store(float* p, vf v) { *reinterpret_cast<vf*>(p) = v; }
inline vf splat(float x) { return vf{} + x; }

// The vector's lanes folded to 8 (the lower half plus or max the upper half, AVX-512), then to 4.
template <typename Op>
inline vf4 fold4(vf v, Op op) {
#if defined(__AVX512F__)
  const vf8 a = op(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7),
                   __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
#else
  const vf8 a = v;
#endif
  return op(__builtin_shufflevector(a, a, 0, 1, 2, 3), __builtin_shufflevector(a, a, 4, 5, 6, 7));
}

inline float hsum(vf v) {
  const vf4 b = fold4(v, [](auto x, auto y) { return x + y; });
  return (b[0] + b[2]) + (b[1] + b[3]);
}

inline float hmax(vf v) {
  const vf4 b = fold4(v, [](auto x, auto y) { return x > y ? x : y; });
  return std::max(std::max(b[0], b[1]), std::max(b[2], b[3]));
}

// exp_nonpositive on a vector (the same polynomial; x * log2(e) rounded by truncating x * log2(e) - 1/2).
inline vf vexp_nonpositive(vf x) {
  const vf xc = x < -87.f ? splat(-87.f) : x;
  const vi n = __builtin_convertvector(xc * 1.44269504f - 0.5f, vi);
  const vf nf = __builtin_convertvector(n, vf);
  const vf r = xc - nf * 0.693145752f - nf * 1.42860677e-6f;
  const vf p = exp_reduced(r);
  const vf scale = reinterpret_cast<vf>((n + 127) << 23);
  return x < -87.f ? vf{} : p * scale;
}

// Lane j = the sum of t[j]'s lanes, for kLanes vectors t: rounds of pairwise shuffles and adds (AVX-512: 45
// operations for 16 sums).
inline vf reduce_lanes(const vf* t) {
#if defined(__AVX512F__)
  vf x[8], z[4], w[2];
  for (int i = 0; i < 8; ++i)
    x[i] = __builtin_shufflevector(t[2 * i], t[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(t[2 * i], t[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30,
                                   31);
  for (int i = 0; i < 4; ++i)
    z[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(x[2 * i], x[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    w[i] = __builtin_shufflevector(z[2 * i], z[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(z[2 * i], z[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(w[0], w[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(w[0], w[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
  vf x[4], z[2];
  for (int i = 0; i < 4; ++i)
    x[i] = __builtin_shufflevector(t[2 * i], t[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(t[2 * i], t[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)
    z[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(x[2 * i], x[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(z[0], z[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(z[0], z[1], 1, 3, 5, 7, 9, 11, 13, 15);
#endif
}

// s[i] = cap * tanh(s[i] / cap) for n floats (n a multiple of kLanes): tanh(y) = (1 - e) / (1 + e), e = exp(-2|y|),
// the sign put back; below |y| = 1/16 its odd Taylor polynomial to y^5 instead (relative error < 1e-8), where
// 1 - e would lose digits.
inline void soft_cap(float* s, int64_t n, float cap) {
  const float inv = 1.f / cap;
  for (int64_t i = 0; i < n; i += kLanes) {
    const vf y = load(s + i) * inv;
    const vf a = y < 0.f ? -y : y;
    const vf e = vexp_nonpositive(-2.f * a);
    const vf big = (1.f - e) / (1.f + e);
    const vf y2 = a * a;
    const vf small = a * (1.f + y2 * (-1.f / 3 + y2 * (2.f / 15)));
    const vf t = a < 0.0625f ? small : big;
    store(s + i, (y < 0.f ? -t : t) * cap);
  }
}

}  // namespace jaxpaged
