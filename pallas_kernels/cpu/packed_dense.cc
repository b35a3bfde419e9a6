// Dense layers for CPUs with weights packed once at load, as an XLA FFI custom call: y = x @ w in float32.
//
// XLA:CPU's dot (YNNPACK) repacks its weight operand on every call and runs small row counts (the 8-64 rows of
// decode and short-prompt steps) well below its large-matrix rate. Here the weights arrive already packed in
// column panels of kPanel (two vector registers wide): wp[p][k][j] = w[k][p * kPanel + j], so a panel's rows
// are read contiguously. Each work item is one panel and a run of rows: kRows rows at a time accumulate
// kRows x kPanel outputs in registers over K, each step broadcasting x[r][k] against the panel's two vectors
// of row k. Items run on XLA's intra-op thread pool, panel by panel: a panel's row runs are consecutive items,
// so each weight is read from memory once while the activations (smaller, for up to a few hundred rows) stay
// in cache; row runs outermost re-read every weight once per run (7-11% slower at 128-512 rows).
//
// Only the first `rows` rows of x are multiplied (a step's tokens before its padding to the token bucket); the
// rest of y is zeros, so a step's dense layers cost its tokens, not its bucket.
//
// Shapes: x f32[M, K]; wp f32[N / kPanel, K, kPanel]; rows s32[] (clamped to [0, M]). Output f32[M, N].

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jaxpaged::parallel_for;

namespace {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kRows = 8;  // 16 accumulators + 2 weight vectors + a broadcast (row counts are mostly multiples of 8)
#else
constexpr int kLanes = 8;
constexpr int kRows = 6;  // 12 accumulators + 2 weight vectors + a broadcast: 15 of 16 registers
#endif
constexpr int kPanel = 2 * kLanes;
// K per pass over the outputs: blocking K to fit L1 (256) measured 5-15% slower at 32-128 rows than keeping each
// row block's accumulators for the whole of K (a panel of K 576-1536 streams from L2).
constexpr int64_t kBlockK = 4096;
constexpr int64_t kItemRows = 96;  // rows per work item (a multiple of kRows on both widths)
// Panel rows prefetched ahead of the one in use (1 KiB on AVX-512): with the hardware prefetcher alone the loads
// wait on L2 and memory. Measured on an Intel Xeon (2 cores, 30 layers of SmolLM2, A/B in one process): -18% time
// at 8 rows, -12% at 32, -7% at 128, -3% at 512. (A prefetch past the panel's end is a hint, never a fault.)
constexpr int64_t kPrefetchRows = 8;

typedef float Vec __attribute__((vector_size(kLanes * 4), aligned(4), may_alias));

// Loads and stores through the vector type (one vmovups). Not memcpy: under a tuning that prefers 256-bit
// vectors (GCC 12's rocketlake, which -march=native picked on an Intel Xeon) it copied each 64-byte vector as
// two 32-byte halves through the stack, and the reload stalled on store forwarding: 30 vs 154 GFLOP/s on one
// core there.
inline Vec load(const float* p) { return *reinterpret_cast<const Vec*>(p); }
inline void store(float* p, Vec v) { *reinterpret_cast<Vec*>(p) = v; }

// rows x kPanel outputs at y (row stride ldy) += / = x[0:rows, 0:kc] @ panel[0:kc, 0:kPanel].
template <int rows>
inline void micro(const float* x, int64_t ldx, const float* panel, int64_t kc, float* y, int64_t ldy,
                  bool accumulate) {
  Vec acc[rows][2];
  for (int r = 0; r < rows; ++r) {
    if (accumulate) {
      acc[r][0] = load(y + r * ldy);
      acc[r][1] = load(y + r * ldy + kLanes);
    } else {
      acc[r][0] = Vec{};
      acc[r][1] = Vec{};
    }
  }
  for (int64_t k = 0; k < kc; ++k) {
    const Vec b0 = load(panel + k * kPanel), b1 = load(panel + k * kPanel + kLanes);
    for (int j = 0; j < kPanel; j += 64 / sizeof(float)) __builtin_prefetch(panel + (k + kPrefetchRows) * kPanel + j);
    for (int r = 0; r < rows; ++r) {
      const float a = x[r * ldx + k];
      acc[r][0] += a * b0;
      acc[r][1] += a * b1;
    }
  }
  for (int r = 0; r < rows; ++r) {
    store(y + r * ldy, acc[r][0]);
    store(y + r * ldy + kLanes, acc[r][1]);
  }
}

template <int rows>
void micro_dispatch(int n, const float* x, int64_t ldx, const float* panel, int64_t kc, float* y, int64_t ldy,
                    bool accumulate) {
  if constexpr (rows > 0) {
    if (n == rows) return micro<rows>(x, ldx, panel, kc, y, ldy, accumulate);
    return micro_dispatch<rows - 1>(n, x, ldx, panel, kc, y, ldy, accumulate);
  }
}

// Rows [m0, m1) of panel p.
void run_item(const float* x, const float* wp, float* y, int64_t k, int64_t n, int64_t p, int64_t m0,
              int64_t m1) {
  const float* panel = wp + p * k * kPanel;
  for (int64_t k0 = 0; k0 < k; k0 += kBlockK) {
    const int64_t kc = std::min(kBlockK, k - k0);
    for (int64_t m = m0; m < m1; m += kRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kRows, m1 - m));
      micro_dispatch<kRows>(rows, x + m * k + k0, k, panel + k0 * kPanel, kc, y + m * n + p * kPanel, n, k0 > 0);
    }
  }
}

ffi::Error PackedDense(ffi::ThreadPool thread_pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> wp,
                       ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = wp.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || wd[2] != kPanel || wd[1] != xd[1] ||
      yd[0] != xd[0] || yd[1] != wd[0] * kPanel || rows.element_count() != 1) {
    return ffi::Error::InvalidArgument("packed_dense: x [M, K], wp [N / panel, K, panel], rows [], y [M, N]");
  }
  const int64_t k = xd[1], panels = wd[0], n = yd[1];
  const int64_t m = std::clamp<int64_t>(rows.typed_data()[0], 0, xd[0]);
  const float* xs = x.typed_data();
  const float* ws = wp.typed_data();
  float* ys = y->typed_data();
  if (m < xd[0]) std::memset(ys + m * n, 0, (xd[0] - m) * n * sizeof(float));
  if (m == 0) return ffi::Error::Success();
  const int64_t row_items = (m + kItemRows - 1) / kItemRows;
  parallel_for(thread_pool, panels * row_items, [=](int64_t i) {
    const int64_t p = i / row_items, r = i % row_items;
    run_item(xs, ws, ys, k, n, p, r * kItemRows, std::min(m, (r + 1) * kItemRows));
  });
  return ffi::Error::Success();
}

}  // namespace

extern "C" int JaxpagedPackedDensePanel() { return kPanel; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedPackedDense, PackedDense,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x
                                  .Arg<ffi::Buffer<ffi::F32>>()   // wp
                                  .Arg<ffi::Buffer<ffi::S32>>()   // rows
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y
