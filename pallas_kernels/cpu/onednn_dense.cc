// Dense layers with bfloat16 or int8 weights on CPUs, as XLA FFI custom calls into oneDNN's matmul primitive:
// y = x @ w with x and w in bf16, accumulated and stored in float32 (`JaxpagedOneDnnDense`); or with x and w in
// int8, accumulated and stored in int32 (`JaxpagedOneDnnDenseS8`: AVX512-VNNI / AMX-INT8 brgemm; the caller
// quantizes x per row and applies both scales to y, `pallas_kernels/cpu_onednn.py`).
//
// The weights are reordered once, at load, into the blocked layout oneDNN's bf16 matmul reads (AVX512-BF16 /
// AMX brgemm panels): `JaxpagedOneDnnPack`. XLA:CPU's bf16 dot and oneDNN's plain GEMM repack or stride
// through a row-major weight on every call; on 30 layers of SmolLM2 at 8-64 rows (decode) the prepacked form is
// 1.2-1.6x faster (docs/benchmarks/cpu.md), which is what vLLM's CPU backend runs.
//
// The packed layout is a function of (K, N, type) only (`WeightDesc`, chosen for a fixed row count). A bf16 one
// takes exactly K * N elements for the shapes the Python side accepts (checked there through
// `JaxpagedOneDnnPackedSize`), so it travels as a bf16[1, K, N] array of opaque contents; an int8 one carries
// oneDNN's compensation for signed x after the weights, so it travels as an int8[bytes] array. A primitive per
// (K, N, rows rounded up to 8, type) is created on first use and kept.
//
// Only the first `rows` rows of x are multiplied (a step's tokens before its padding, rounded up to 8); the rest
// of y is zeros, as in packed_dense.cc.
//
// Shapes: x bf16[M, K]; w bf16[1, K, N] (packed); rows s32[] (clamped to [0, M]). Output f32[M, N].
// int8: x s8[M, K]; w s8[bytes] (packed); rows s32[]. Output s32[M, N].

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

using Type = memory::data_type;

// The output type of a matmul whose inputs are `t`: float32 for bf16, int32 for int8.
Type OutputType(Type t) { return t == Type::s8 ? Type::s32 : Type::f32; }

// The packed weight layout for [K, N] of type `t`: what oneDNN's matmul picks for `any` at kRowsHint rows.
memory::desc WeightDesc(int64_t k, int64_t n, Type t) {
  static std::map<std::tuple<int64_t, int64_t, Type>, memory::desc> cache;
  std::lock_guard<std::mutex> lock(cache_mutex);
  auto it = cache.find({k, n, t});
  if (it != cache.end()) return it->second;
  memory::desc src({kRowsHint, k}, t, memory::format_tag::ab);
  memory::desc any({k, n}, t, memory::format_tag::any);
  memory::desc dst({kRowsHint, n}, OutputType(t), memory::format_tag::ab);
  dnnl::matmul::primitive_desc pd(cpu_engine(), src, any, dst);
  // Only the brgemm kernels (AVX512-BF16 / VNNI, AMX) are what was measured faster than XLA's dot; elsewhere
  // (AVX-512 without them picks a plain-layout GEMM) an empty descriptor: the Python side then keeps XLA's dot.
  memory::desc chosen = std::string(pd.impl_info_str()).rfind("brg", 0) == 0 ? pd.weights_desc() : memory::desc();
  cache.emplace(std::make_tuple(k, n, t), chosen);
  return chosen;
}

// A primitive and the scratchpad bytes it needs. Its scratchpad is the caller's (scratchpad_mode::user): one
// primitive run on two threads at once with a scratchpad of its own gave wrong outputs (~1.6% of them in a
// two-thread test), and XLA may call the custom call from several of its threads.
struct Matmul {
  dnnl::matmul primitive;
  size_t scratchpad_bytes;
};

const Matmul& Primitive(int64_t m, int64_t k, int64_t n, Type t) {
  static std::map<std::tuple<int64_t, int64_t, int64_t, Type>, Matmul> cache;
  const memory::desc weights = WeightDesc(k, n, t);
  std::lock_guard<std::mutex> lock(cache_mutex);
  auto it = cache.find({m, k, n, t});
  if (it != cache.end()) return it->second;
  memory::desc src({m, k}, t, memory::format_tag::ab);
  memory::desc dst({m, n}, OutputType(t), memory::format_tag::ab);
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  dnnl::matmul::primitive_desc pd(cpu_engine(), src, weights, dst, attr);
  Matmul entry{dnnl::matmul(pd), pd.scratchpad_desc().get_size()};
  return cache.emplace(std::make_tuple(m, k, n, t), entry).first->second;
}

// y[:rows] = x[:rows] @ w for x [M, K] and y [M, N] of element type `t` and OutputType(t), w packed by
// `JaxpagedOneDnnPack`; y's other rows zeros.
ffi::Error Run(const void* x, const void* w, int64_t m_all, int64_t k, int64_t n, int64_t rows, Type t, void* y) {
  const int64_t m = std::clamp<int64_t>(rows, 0, m_all);
  const int64_t run = std::min<int64_t>(m_all, (m + kRowStep - 1) / kRowStep * kRowStep);
  char* ys = static_cast<char*>(y);
  try {
    if (run > 0) {
      const Matmul& mm = Primitive(run, k, n, t);
      thread_local std::vector<char> scratchpad;
      if (scratchpad.size() < mm.scratchpad_bytes) scratchpad.resize(mm.scratchpad_bytes);
      memory src({{run, k}, t, memory::format_tag::ab}, cpu_engine(), const_cast<void*>(x));
      memory weights(WeightDesc(k, n, t), cpu_engine(), const_cast<void*>(w));
      memory dst({{run, n}, OutputType(t), memory::format_tag::ab}, cpu_engine(), ys);
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
  if (m < m_all) std::memset(ys + m * n * 4, 0, (m_all - m) * n * 4);  // (f32 and s32: 4 bytes each)
  return ffi::Error::Success();
}

ffi::Error OneDnnDense(ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w, ffi::Buffer<ffi::S32> rows,
                       ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || wd[0] != 1 || wd[1] != xd[1] || yd[0] != xd[0] ||
      yd[1] != wd[2] || rows.element_count() != 1) {
    return ffi::Error::InvalidArgument("onednn_dense: x [M, K], w [1, K, N], rows [], y [M, N]");
  }
  return Run(x.untyped_data(), w.untyped_data(), xd[0], xd[1], wd[2], rows.typed_data()[0], Type::bf16,
             y->untyped_data());
}

ffi::Error OneDnnDenseS8(ffi::Buffer<ffi::S8> x, ffi::Buffer<ffi::S8> w, ffi::Buffer<ffi::S32> rows,
                         ffi::ResultBuffer<ffi::S32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 1 || yd.size() != 2 || yd[0] != xd[0] || rows.element_count() != 1) {
    return ffi::Error::InvalidArgument("onednn_dense_s8: x [M, K], w [bytes], rows [], y [M, N]");
  }
  const memory::desc desc = WeightDesc(xd[1], yd[1], Type::s8);
  if (desc.get_ndims() == 0 || static_cast<int64_t>(desc.get_size()) != wd[0]) {
    return ffi::Error::InvalidArgument("onednn_dense_s8: w is not a packed [K, N] int8 weight");
  }
  return Run(x.untyped_data(), w.untyped_data(), xd[0], xd[1], yd[1], rows.typed_data()[0], Type::s8,
             y->untyped_data());
}

Type TypeOf(int s8) { return s8 ? Type::s8 : Type::bf16; }

}  // namespace

// Bytes of the packed [K, N] weight (bf16, or int8 where `s8`), or -1 where no brgemm kernel takes it (the
// Python side uses the bf16 call only where it is K * N * 2).
extern "C" int64_t JaxpagedOneDnnPackedSize(int64_t k, int64_t n, int s8) {
  try {
    const memory::desc desc = WeightDesc(k, n, TypeOf(s8));
    return desc.get_ndims() == 0 ? -1 : static_cast<int64_t>(desc.get_size());
  } catch (...) {
    return -1;
  }
}

// Reorders a row-major [K, N] weight at `src` (bf16, or int8 where `s8`) into the packed layout at `dst`; 1 on
// success.
extern "C" int JaxpagedOneDnnPack(int64_t k, int64_t n, int s8, const void* src, void* dst) {
  try {
    memory from({{k, n}, TypeOf(s8), memory::format_tag::ab}, cpu_engine(), const_cast<void*>(src));
    memory to(WeightDesc(k, n, TypeOf(s8)), cpu_engine(), dst);
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedOneDnnDenseS8, OneDnnDenseS8,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S8>>()     // x
                                  .Arg<ffi::Buffer<ffi::S8>>()     // w (packed, with compensation)
                                  .Arg<ffi::Buffer<ffi::S32>>()    // rows
                                  .Ret<ffi::Buffer<ffi::S32>>());  // y
