// Dense layers with bfloat16 weights on CPUs, as an XLA FFI custom call into oneDNN's matmul primitive:
// y = x @ w with x and w in bf16, accumulated and stored in float32.
//
// The weights are reordered once, at load, into the blocked layout oneDNN's bf16 matmul reads (AVX512-BF16 /
// AMX brgemm panels): `JaxpagedOneDnnPack`. XLA:CPU's bf16 dot and oneDNN's plain GEMM repack or stride
// through a row-major weight on every call; on 30 layers of SmolLM2 at 8-64 rows (decode) the prepacked form is
// 1.2-1.6x faster (docs/benchmarks/cpu.md), which is what vLLM's CPU backend runs.
//
// The packed layout is a function of (K, N) only (`WeightDesc`, chosen for a fixed row count), and it takes
// exactly K * N bf16 elements for the shapes the Python side accepts (checked there through
// `JaxpagedOneDnnPackedSize`), so it travels as a bf16[1, K, N] array of opaque contents. A primitive per
// (K, N, rows rounded up to 8) is created on first use and kept.
//
// Only the first `rows` rows of x are multiplied (a step's tokens before its padding, rounded up to 8); the rest
// of y is zeros, as in packed_dense.cc.
//
// Shapes: x bf16[M, K]; w bf16[1, K, N] (packed); rows s32[] (clamped to [0, M]). Output f32[M, N].

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "oneapi/dnnl/dnnl.hpp"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using dnnl::memory;

namespace {

constexpr int64_t kRowsHint = 32;  // the row count the weight layout is chosen for (decode-sized)
constexpr int64_t kRowStep = 8;    // rows are rounded up to a multiple of this: few primitives, little waste

dnnl::engine& cpu_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

std::mutex cache_mutex;

// The packed weight layout for [K, N]: what oneDNN's matmul picks for `any` at kRowsHint rows.
memory::desc WeightDesc(int64_t k, int64_t n) {
  static std::map<std::pair<int64_t, int64_t>, memory::desc> cache;
  std::lock_guard<std::mutex> lock(cache_mutex);
  auto it = cache.find({k, n});
  if (it != cache.end()) return it->second;
  memory::desc src({kRowsHint, k}, memory::data_type::bf16, memory::format_tag::ab);
  memory::desc any({k, n}, memory::data_type::bf16, memory::format_tag::any);
  memory::desc dst({kRowsHint, n}, memory::data_type::f32, memory::format_tag::ab);
  dnnl::matmul::primitive_desc pd(cpu_engine(), src, any, dst);
  // Only the brgemm kernels (AVX512-BF16, AMX) are what was measured faster than XLA's dot; elsewhere (AVX-512
  // without BF16 picks a plain-layout GEMM) an empty descriptor: the Python side then keeps XLA's dot.
  memory::desc chosen = std::string(pd.impl_info_str()).rfind("brg", 0) == 0 ? pd.weights_desc() : memory::desc();
  cache.emplace(std::make_pair(k, n), chosen);
  return chosen;
}

// A primitive and the scratchpad bytes it needs. Its scratchpad is the caller's (scratchpad_mode::user): one
// primitive run on two threads at once with a scratchpad of its own gave wrong outputs (~1.6% of them in a
// two-thread test), and XLA may call the custom call from several of its threads.
struct Matmul {
  dnnl::matmul primitive;
  size_t scratchpad_bytes;
};

const Matmul& Primitive(int64_t m, int64_t k, int64_t n) {
  static std::map<std::tuple<int64_t, int64_t, int64_t>, Matmul> cache;
  const memory::desc weights = WeightDesc(k, n);
  std::lock_guard<std::mutex> lock(cache_mutex);
  auto it = cache.find({m, k, n});
  if (it != cache.end()) return it->second;
  memory::desc src({m, k}, memory::data_type::bf16, memory::format_tag::ab);
  memory::desc dst({m, n}, memory::data_type::f32, memory::format_tag::ab);
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  dnnl::matmul::primitive_desc pd(cpu_engine(), src, weights, dst, attr);
  Matmul entry{dnnl::matmul(pd), pd.scratchpad_desc().get_size()};
  return cache.emplace(std::make_tuple(m, k, n), entry).first->second;
}

ffi::Error OneDnnDense(ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w, ffi::Buffer<ffi::S32> rows,
                       ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || wd[0] != 1 || wd[1] != xd[1] || yd[0] != xd[0] ||
      yd[1] != wd[2] || rows.element_count() != 1) {
    return ffi::Error::InvalidArgument("onednn_dense: x [M, K], w [1, K, N], rows [], y [M, N]");
  }
  const int64_t k = xd[1], n = wd[2];
  const int64_t m = std::clamp<int64_t>(rows.typed_data()[0], 0, xd[0]);
  const int64_t run = std::min<int64_t>(xd[0], (m + kRowStep - 1) / kRowStep * kRowStep);
  float* ys = y->typed_data();
  try {
    if (run > 0) {
      const Matmul& mm = Primitive(run, k, n);
      thread_local std::vector<char> scratchpad;
      if (scratchpad.size() < mm.scratchpad_bytes) scratchpad.resize(mm.scratchpad_bytes);
      memory src({{run, k}, memory::data_type::bf16, memory::format_tag::ab}, cpu_engine(), x.untyped_data());
      memory weights(WeightDesc(k, n), cpu_engine(), w.untyped_data());
      memory dst({{run, n}, memory::data_type::f32, memory::format_tag::ab}, cpu_engine(), ys);
      memory pad({{static_cast<int64_t>(mm.scratchpad_bytes)}, memory::data_type::u8, memory::format_tag::a},
                 cpu_engine(), scratchpad.data());
      dnnl::stream stream(cpu_engine());
      mm.primitive.execute(stream, {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, weights}, {DNNL_ARG_DST, dst},
                                    {DNNL_ARG_SCRATCHPAD, pad}});
      stream.wait();
    }
  } catch (const dnnl::error& e) {
    return ffi::Error::Internal(std::string("onednn_dense: ") + e.what());
  } catch (...) {
    return ffi::Error::Internal("onednn_dense: failed (out of memory?)");
  }
  if (m < xd[0]) std::memset(ys + m * n, 0, (xd[0] - m) * n * sizeof(float));
  return ffi::Error::Success();
}

}  // namespace

// Bytes of the packed [K, N] bf16 weight (the Python side uses the call only where it is K * N * 2), or -1
// where no brgemm kernel takes it.
extern "C" int64_t JaxpagedOneDnnPackedSize(int64_t k, int64_t n) {
  try {
    const memory::desc desc = WeightDesc(k, n);
    return desc.get_ndims() == 0 ? -1 : static_cast<int64_t>(desc.get_size());
  } catch (...) {
    return -1;
  }
}

// Reorders a row-major bf16 [K, N] weight at `src` into the packed layout at `dst`; 1 on success.
extern "C" int JaxpagedOneDnnPack(int64_t k, int64_t n, const void* src, void* dst) {
  try {
    memory from({{k, n}, memory::data_type::bf16, memory::format_tag::ab}, cpu_engine(), const_cast<void*>(src));
    memory to(WeightDesc(k, n), cpu_engine(), dst);
    dnnl::stream stream(cpu_engine());
    dnnl::reorder(from, to).execute(stream, from, to);
    stream.wait();
    return 1;
  } catch (...) {
    return 0;
  }
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedOneDnnDense, OneDnnDense,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()   // x
                                  .Arg<ffi::Buffer<ffi::BF16>>()   // w (packed)
                                  .Arg<ffi::Buffer<ffi::S32>>()    // rows
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y
