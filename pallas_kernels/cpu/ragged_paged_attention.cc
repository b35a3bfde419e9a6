// Ragged paged attention for CPUs, as an XLA FFI custom call: the meaning of
// pallas_kernels.paged_attention (each token over keys 0..positions[t] of its sequence, read through
// block_tables[token_seq[t]]), with the loops XLA:CPU cannot fuse written out.
//
// Work is cut into items, one per query tile (all its heads): a tile is up to kTileTokens consecutive tokens of
// one sequence, so a decode row is a tile of one token and a prompt chunk reads each key once per tile; items
// run on XLA's intra-op thread pool, costliest first. An item walks its keys kKeyChunk at a time: the chunk's K
// and V (widened to float32 into a small buffer when the pool is narrower), scores for every (token, grouped
// query head) of the tile, an online softmax, and the weighted V accumulated in float32. Up to kFewRows query
// vectors per KV head (decodes) take per-key dot products and a softmax along each row's keys; more (prompt
// tiles) keep the queries transposed, so scores come out as vectors over rows and the softmax runs across rows
// with no horizontal reductions. Vectors are one register wide (16 floats on AVX-512, else 8).
// Pools: float32, or a narrower float stored as integers of its width (pallas_kernels.kv_storage):
// bf16 <- uint16, f16 <- int16, f8e4m3fn <- uint8, f8e5m2 <- int8 (and the float types themselves).
//
// Shapes: q f32[T, H, D]; kv_pool [L, 2, N, bs, KH, D]; layer s32[]; block_tables s32[S, B];
// token_seq s32[T] (-1: padding, output 0); positions s32[T]. Output f32[T, H, D]. Attributes: sm_scale,
// sliding_window (0: none), softcap (0: none; scores squashed to softcap * tanh(score / softcap), Gemma 2).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "float_vectors.h"
#include "kv_widen.h"
#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jaxpaged::parallel_for;

namespace {

using namespace jaxpaged;  // float_vectors.h, kv_widen.h

constexpr int kTileTokens = 16;  // tokens of one sequence per work item
constexpr int kKeyChunk = 16;    // keys per step of the online softmax
constexpr float kMasked = -1e30f;

// ---- one work item: a tile of tokens of one sequence, all heads ----------------------------------------

struct Problem {
  const float* q;          // [T, H, D]
  const void* pool;        // [L, 2, N, bs, KH, D]
  const int32_t* tables;   // [S, B]
  const int32_t* positions;
  float* out;              // [T, H, D]
  int64_t num_blocks, block_size, kv_heads, head_dim, heads, table_width, layer;
  float sm_scale;
  int64_t sliding_window;  // 0: none
  float softcap;           // 0: none; else scores become softcap * tanh(score / softcap) (Gemma 2)
};

struct Tile {
  int32_t first, count, seq;
  int64_t cost;  // ~ its tokens x the keys it reads
};

constexpr int kChunkVecs = kKeyChunk / kLanes;  // vectors of one row's scores for a chunk
static_assert(kKeyChunk % kLanes == 0, "a chunk's scores are whole vectors");
constexpr int kFewRows = 16;  // up to this many query vectors per KV head, scores come from per-key dot products

// Scores s[r][j] = q[r] . k[j] for `rows` query vectors and kKeyChunk keys (k given per key, float32).
// kNV > 0 (head_dim = kLanes kNV, in vectors), at most kFewRows rows (decodes: the grouped heads of one token):
// per-key products summed by `reduce_lanes`. More rows take `scores_by_rows`.
template <int kNV>
inline void scores(const float* q, int64_t rows, const float* const* k, int64_t d_dim, float* s) {
  if constexpr (kNV > 0) {
    constexpr int kD = kLanes * kNV;
    for (int64_t r = 0; r < rows; ++r) {
      vf qr[kNV], t[kLanes];
      for (int v = 0; v < kNV; ++v) qr[v] = load(q + r * kD + kLanes * v);
      for (int c = 0; c < kChunkVecs; ++c) {
        for (int j = 0; j < kLanes; ++j) {
          const float* kj = k[c * kLanes + j];
          vf a = qr[0] * load(kj);
          for (int v = 1; v < kNV; ++v) a += qr[v] * load(kj + kLanes * v);
          t[j] = a;
        }
        store(s + r * kKeyChunk + c * kLanes, reduce_lanes(t));
      }
    }
  } else {
    for (int64_t r = 0; r < rows; ++r)
      for (int j = 0; j < kKeyChunk; ++j) {
        float t = 0.f;
        for (int64_t d = 0; d < d_dim; ++d) t += q[r * d_dim + d] * k[j][d];
        s[r * kKeyChunk + j] = t;
      }
  }
}

// A loaded vector stays in a register: without this GCC folds its load into every FMA that uses it and the
// loops are bound by loads (x86; prompt tiles' attention 2x faster on AVX-512; elsewhere a no-op).
inline void keep_in_register(vf& v) {
#if defined(__AVX__) && (defined(__GNUC__) || defined(__clang__))
  asm("" : "+v"(v));
#else
  (void)v;
#endif
}

// acc[r] = acc[r] * scale[r] + sum_j w[r * wr + j * wj] v[j] over n keys for `rows` rows; with head_dim =
// kLanes kNV, kRows rows at a time with their accumulators in registers (and, AVX-512, the keys' values).
template <int kNV>
inline void accumulate(float* acc, int64_t rows, int64_t d_dim, const float* scale, const float* w, int64_t wr,
                       int64_t wj, const float* const* v, int n) {
  if constexpr (kNV > 0) {
    constexpr int kD = kLanes * kNV;
    constexpr int kRows = kLanes == 16 ? (kNV <= 4 ? 4 : kNV <= 8 ? 2 : 1) : kNV <= 6 ? 2 : 1;
    int64_t r = 0;
    for (; r + kRows <= rows; r += kRows) {
      vf a[kRows][kNV];
      for (int b = 0; b < kRows; ++b)
        for (int i = 0; i < kNV; ++i) a[b][i] = load(acc + (r + b) * kD + kLanes * i) * scale[r + b];
      for (int j = 0; j < n; ++j) {
        vf vj[kNV];
        for (int i = 0; i < kNV; ++i) {
          vj[i] = load(v[j] + kLanes * i);
          if constexpr (kLanes == 16) keep_in_register(vj[i]);  // (AVX2 has too few registers)
        }
        for (int b = 0; b < kRows; ++b) {
          const float wb = w[(r + b) * wr + j * wj];
          for (int i = 0; i < kNV; ++i) a[b][i] += wb * vj[i];
        }
      }
      for (int b = 0; b < kRows; ++b)
        for (int i = 0; i < kNV; ++i) store(acc + (r + b) * kD + kLanes * i, a[b][i]);
    }
    for (; r < rows; ++r) {
      vf a[kNV];
      for (int i = 0; i < kNV; ++i) a[i] = load(acc + r * kD + kLanes * i) * scale[r];
      for (int j = 0; j < n; ++j) {
        const float wb = w[r * wr + j * wj];
        for (int i = 0; i < kNV; ++i) a[i] += wb * load(v[j] + kLanes * i);
      }
      for (int i = 0; i < kNV; ++i) store(acc + r * kD + kLanes * i, a[i]);
    }
  } else {
    for (int64_t r = 0; r < rows; ++r) {
      float* ar = acc + r * d_dim;
      for (int64_t d = 0; d < d_dim; ++d) ar[d] *= scale[r];
      for (int j = 0; j < n; ++j)
        for (int64_t d = 0; d < d_dim; ++d) ar[d] += w[r * wr + j * wj] * v[j][d];
    }
  }
}

// ---- prompt tiles: the query rows in vectors ------------------------------------------------------------
// A tile with more than kFewRows query vectors per KV head keeps them transposed, qt[d][row] with the rows
// padded to a multiple of kLanes (rp), so each key's scores over kLanes rows are one vector: s[j][row]. K needs
// no transpose and the online softmax runs across rows, without horizontal reductions.

#if defined(__AVX512F__)
constexpr int kRowVecs = 4, kKeyGroup = 4;  // 16 accumulators of the 32 vector registers
#else
constexpr int kRowVecs = 2, kKeyGroup = 4;  // 8 of AVX2's 16 (NEON: 16 of 32)
#endif

// s[g][row] = q[row] . k[g] for kKeyGroup keys and the rows of vectors v0 .. v0 + kRV (qt: [kD][rp]; s: rp
// per key).
template <int kNV, int kRV>
inline void score_block(const float* qt, int64_t rp, int64_t v0, const float* const* k, float* s) {
  constexpr int kD = kLanes * kNV;
  vf a[kKeyGroup][kRV];
  for (int g = 0; g < kKeyGroup; ++g)
    for (int b = 0; b < kRV; ++b) a[g][b] = vf{};
  for (int d = 0; d < kD; ++d) {
    vf qv[kRV];
    for (int b = 0; b < kRV; ++b) {
      qv[b] = load(qt + d * rp + kLanes * (v0 + b));
      keep_in_register(qv[b]);
    }
    for (int g = 0; g < kKeyGroup; ++g) {
      const float kd = k[g][d];
      for (int b = 0; b < kRV; ++b) a[g][b] += kd * qv[b];
    }
  }
  for (int g = 0; g < kKeyGroup; ++g)
    for (int b = 0; b < kRV; ++b) store(s + g * rp + kLanes * (v0 + b), a[g][b]);
}

// s[j][row] = q[row] . k[j] for the chunk's kKeyChunk keys and all rp rows.
template <int kNV>
inline void scores_by_rows(const float* qt, int64_t rp, const float* const* k, float* s) {
  const int64_t nv = rp / kLanes;
  for (int j = 0; j < kKeyChunk; j += kKeyGroup) {
    const float* const* kg = k + j;
    float* sg = s + j * rp;
    int64_t v0 = 0;
    for (; v0 + kRowVecs <= nv; v0 += kRowVecs) score_block<kNV, kRowVecs>(qt, rp, v0, kg, sg);
    switch (nv - v0) {  // (kRowVecs <= 4)
      case 3: score_block<kNV, 3>(qt, rp, v0, kg, sg); break;
      case 2: score_block<kNV, 2>(qt, rp, v0, kg, sg); break;
      case 1: score_block<kNV, 1>(qt, rp, v0, kg, sg); break;
      default: break;
    }
  }
}

// The online softmax of one chunk, kLanes rows at a time: keys key0 + j visible to a row (lo <= key <= pos) keep
// their scores, the rest weigh 0; s becomes the weights, scale each row's factor for its accumulator, and m, l
// its running max and sum. A row that sees none of the chunk's keys keeps its state (scale 1, weights 0).
inline void softmax_by_rows(float* s, int64_t rp, int32_t key0, const int32_t* pos, const int32_t* lo, float* m,
                            float* l, float* scale) {
  for (int64_t v = 0; v < rp; v += kLanes) {
    const vi pv = *reinterpret_cast<const vi*>(pos + v), lv = *reinterpret_cast<const vi*>(lo + v);
    vf mx = splat(kMasked);
    for (int j = 0; j < kKeyChunk; ++j) {
      const vi key = vi{} + (key0 + j);
      const vf sj = (key <= pv) & (key >= lv) ? load(s + j * rp + v) : splat(kMasked);
      mx = mx > sj ? mx : sj;
    }
    const vf m_old = load(m + v), m_new = m_old > mx ? m_old : mx;
    const vf sc = vexp_nonpositive(m_old - m_new);
    vf sum = {};
    for (int j = 0; j < kKeyChunk; ++j) {
      const vi key = vi{} + (key0 + j);
      const vf e = (key <= pv) & (key >= lv) ? vexp_nonpositive(load(s + j * rp + v) - m_new) : vf{};
      store(s + j * rp + v, e);
      sum += e;
    }
    store(l + v, load(l + v) * sc + sum);
    store(m + v, m_new);
    store(scale + v, sc);
  }
}

template <Kv kind, int kNV>
void run_item(const Problem& p, const Tile& tile) {
  using Stored = typename Widen<kind>::T;
  constexpr bool kWide = kind == Kv::kF32;
  const int64_t dd = kNV > 0 ? kLanes * kNV : p.head_dim;
  const int64_t kvh = p.kv_heads, group = p.heads / kvh;
  const int64_t rows = tile.count * group;  // query vectors per KV head: (token, grouped head)
  const bool by_rows = kNV > 0 && rows > kFewRows;  // a prompt tile: queries transposed (`scores_by_rows`)
  const int64_t rp = by_rows ? (rows + kLanes - 1) / kLanes * kLanes : rows;  // rows stored (padded by rows)
  const Stored* pool = static_cast<const Stored*>(p.pool);
  const int64_t slot_stride = kvh * dd;  // one key's K or V, all heads
  const int64_t block_stride = p.block_size * slot_stride;
  const int64_t half = p.num_blocks * block_stride;  // K or V of one layer
  const Stored* k_base = pool + (2 * p.layer) * half;
  const Stored* v_base = k_base + half;
  const int32_t* table = p.tables + static_cast<int64_t>(tile.seq) * p.table_width;

  // Per KV head: its query rows (scaled; [row][d], or [d][row] by rows), softmax state and accumulator. Row r of
  // head h is token r / group, query head h * group + r % group. Padding rows (by rows) see no key.
  std::vector<float> qs(kvh * rp * dd, 0.f), acc(kvh * rows * dd, 0.f), m(kvh * rp, kMasked), l(kvh * rp, 0.f);
  std::vector<int32_t> pos(rp, -1), lo(rp, 0);
  for (int64_t h = 0; h < kvh; ++h)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t t = tile.first + r / group, qh = h * group + r % group;
      const float* src = p.q + (t * p.heads + qh) * dd;
      float* dst = &qs[h * rp * dd];
      if (by_rows) {
        for (int64_t d = 0; d < dd; ++d) dst[d * rp + r] = src[d] * p.sm_scale;
      } else {
        for (int64_t d = 0; d < dd; ++d) dst[r * dd + d] = src[d] * p.sm_scale;
      }
    }
  for (int64_t r = 0; r < rows; ++r) {
    pos[r] = p.positions[tile.first + r / group];
    lo[r] = p.sliding_window > 0 ? static_cast<int32_t>(std::max<int64_t>(0, pos[r] - p.sliding_window + 1)) : 0;
  }
  int32_t first_pos = pos[0], last = pos[0];  // the tile's tokens may come in any order
  for (int64_t r = 0; r < rows; ++r) {
    first_pos = std::min(first_pos, pos[r]);
    last = std::max(last, pos[r]);
  }
  int64_t start = 0;
  if (p.sliding_window > 0) start = std::max<int64_t>(0, first_pos - p.sliding_window + 1);
  start -= start % kKeyChunk;

  std::vector<float> kbuf(kWide ? 0 : kKeyChunk * dd), vbuf(kWide ? 0 : kKeyChunk * dd);
  std::vector<float> s(rp * kKeyChunk), scale(rp);
  alignas(64) static thread_local float zeros[512];  // a key slot past the visible ones (its scores are masked)
  std::vector<float> zero_row(dd > 512 ? dd : 0, 0.f);
  const float* zero = dd > 512 ? zero_row.data() : zeros;
  const Stored* slot_k[kKeyChunk];
  const Stored* slot_v[kKeyChunk];
  const float* kp[kKeyChunk];
  const float* vp[kKeyChunk];
  vi iota;
  for (int j = 0; j < kLanes; ++j) iota[j] = j;

  auto slot_offset = [&](int64_t key) {
    const int64_t b = key / p.block_size;
    int64_t phys = b < p.table_width ? table[b] : 0;
    if (phys < 0 || phys >= p.num_blocks) phys = 0;
    return phys * block_stride + (key % p.block_size) * slot_stride;
  };
  for (int64_t k0 = start; k0 <= last; k0 += kKeyChunk) {
    const int n = static_cast<int>(std::min<int64_t>(kKeyChunk, last + 1 - k0));
    for (int j = 0; j < n; ++j) {
      const int64_t off = slot_offset(k0 + j);
      slot_k[j] = k_base + off;
      slot_v[j] = v_base + off;
    }
    for (int64_t h = 0; h < kvh; ++h) {
      for (int j = 0; j < kKeyChunk; ++j) {
        if (j >= n) {
          kp[j] = vp[j] = zero;
        } else if constexpr (kWide) {
          kp[j] = reinterpret_cast<const float*>(slot_k[j]) + h * dd;
          vp[j] = reinterpret_cast<const float*>(slot_v[j]) + h * dd;
        } else {
          const Stored* ks = slot_k[j] + h * dd;
          const Stored* vs = slot_v[j] + h * dd;
          float* kw = &kbuf[j * dd];
          float* vw = &vbuf[j * dd];
          for (int64_t d = 0; d < dd; ++d) kw[d] = Widen<kind>::get(ks[d]);
          for (int64_t d = 0; d < dd; ++d) vw[d] = Widen<kind>::get(vs[d]);
          kp[j] = kw;
          vp[j] = vw;
        }
      }
      float* mh = &m[h * rp];
      float* lh = &l[h * rp];
      if (by_rows) {
        scores_by_rows<kNV>(&qs[h * rp * dd], rp, kp, s.data());
        if (p.softcap > 0.f) soft_cap(s.data(), rp * kKeyChunk, p.softcap);
        softmax_by_rows(s.data(), rp, static_cast<int32_t>(k0), pos.data(), lo.data(), mh, lh, scale.data());
        accumulate<kNV>(&acc[h * rows * dd], rows, dd, scale.data(), s.data(), 1, rp, vp, n);
        continue;
      }
      scores<kNV>(&qs[h * rp * dd], rows, kp, dd, s.data());
      if (p.softcap > 0.f) soft_cap(s.data(), rows * kKeyChunk, p.softcap);
      // Online softmax over the chunk, a row's keys a vector at a time: masked keys get weight 0; a row that
      // sees none of them keeps its state (scale 1, weights 0).
      for (int64_t r = 0; r < rows; ++r) {
        float* sr = &s[r * kKeyChunk];
        vi visible[kChunkVecs];
        vf sv[kChunkVecs];
        float chunk_max = kMasked;
        for (int c = 0; c < kChunkVecs; ++c) {
          const vi keys = iota + static_cast<int32_t>(k0 + c * kLanes);
          visible[c] = (keys <= pos[r]) & (keys >= lo[r]);
          sv[c] = visible[c] ? load(sr + c * kLanes) : splat(kMasked);
          chunk_max = std::max(chunk_max, hmax(sv[c]));
        }
        if (chunk_max <= kMasked) {
          scale[r] = 1.f;
          for (int c = 0; c < kChunkVecs; ++c) store(sr + c * kLanes, vf{});
          continue;
        }
        const float m_new = std::max(mh[r], chunk_max);
        scale[r] = exp_nonpositive(mh[r] - m_new);
        float sum = 0.f;
        for (int c = 0; c < kChunkVecs; ++c) {
          const vf e = visible[c] ? vexp_nonpositive(sv[c] - m_new) : vf{};
          store(sr + c * kLanes, e);
          sum += hsum(e);
        }
        lh[r] = lh[r] * scale[r] + sum;
        mh[r] = m_new;
      }
      accumulate<kNV>(&acc[h * rows * dd], rows, dd, scale.data(), s.data(), kKeyChunk, 1, vp, n);
    }
  }
  for (int64_t h = 0; h < kvh; ++h)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t t = tile.first + r / group, qh = h * group + r % group;
      float* dst = p.out + (t * p.heads + qh) * dd;
      const float lr = l[h * rp + r];
      const float inv = lr > 0.f ? 1.f / lr : 0.f;
      const float* ar = &acc[(h * rows + r) * dd];
      for (int64_t d = 0; d < dd; ++d) dst[d] = ar[d] * inv;
    }
}

template <Kv kind>
void run_item_dispatch(const Problem& p, const Tile& tile) {
  switch (p.head_dim) {
    case 64: return run_item<kind, 64 / kLanes>(p, tile);
    case 80: return run_item<kind, 80 / kLanes>(p, tile);  // (kLanes 8 or 16 divides each)
    case 96: return run_item<kind, 96 / kLanes>(p, tile);
    case 128: return run_item<kind, 128 / kLanes>(p, tile);
    case 256: return run_item<kind, 256 / kLanes>(p, tile);
    default: return run_item<kind, 0>(p, tile);
  }
}

using ItemFn = void (*)(const Problem&, const Tile&);

ffi::Error RaggedPagedAttention(ffi::ThreadPool thread_pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer kv_pool,
                                ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> block_tables,
                                ffi::Buffer<ffi::S32> token_seq, ffi::Buffer<ffi::S32> positions,
                                ffi::ResultBuffer<ffi::F32> out, float sm_scale, int64_t sliding_window,
                                float softcap) {
  const auto qd = q.dimensions(), pd = kv_pool.dimensions(), td = block_tables.dimensions();
  if (qd.size() != 3 || pd.size() != 6 || td.size() != 2) {
    return ffi::Error::InvalidArgument("ragged_paged_attention: q must be 3-D, kv_pool 6-D, block_tables 2-D");
  }
  Problem p;
  p.q = q.typed_data();
  p.pool = kv_pool.untyped_data();
  p.tables = block_tables.typed_data();
  p.positions = positions.typed_data();
  p.out = out->typed_data();
  const int64_t num_tokens = qd[0];
  p.heads = qd[1];
  p.head_dim = qd[2];
  p.num_blocks = pd[2];
  p.block_size = pd[3];
  p.kv_heads = pd[4];
  p.table_width = td[1];
  p.sm_scale = sm_scale;
  p.sliding_window = sliding_window;
  p.softcap = softcap;
  p.layer = layer.typed_data()[0];
  if (pd[5] != p.head_dim || p.heads % p.kv_heads != 0 || p.layer < 0 || p.layer >= pd[0]) {
    return ffi::Error::InvalidArgument("ragged_paged_attention: inconsistent shapes or layer out of range");
  }
  ItemFn fn;
  switch (kv_pool.element_type()) {
    case ffi::DataType::F32: fn = run_item_dispatch<Kv::kF32>; break;
    case ffi::DataType::U16: case ffi::DataType::BF16: fn = run_item_dispatch<Kv::kBF16>; break;
    case ffi::DataType::S16: case ffi::DataType::F16: fn = run_item_dispatch<Kv::kF16>; break;
    case ffi::DataType::U8: case ffi::DataType::F8E4M3FN: fn = run_item_dispatch<Kv::kE4M3>; break;
    case ffi::DataType::S8: case ffi::DataType::F8E5M2: fn = run_item_dispatch<Kv::kE5M2>; break;
    default: return ffi::Error::InvalidArgument("ragged_paged_attention: unsupported kv_pool dtype");
  }
  std::memset(p.out, 0, sizeof(float) * num_tokens * p.heads * p.head_dim);

  // Tiles: runs of consecutive tokens of one sequence, at most kTileTokens each.
  const int32_t* seq = token_seq.typed_data();
  const int64_t num_seqs = td[0];
  std::vector<Tile> tiles;
  for (int64_t t = 0; t < num_tokens;) {
    if (seq[t] < 0 || seq[t] >= num_seqs) { ++t; continue; }
    int64_t e = t + 1;
    while (e < num_tokens && e - t < kTileTokens && seq[e] == seq[t]) ++e;
    int64_t last = 0;
    for (int64_t i = t; i < e; ++i) last = std::max<int64_t>(last, p.positions[i]);
    const int64_t keys = p.sliding_window > 0 ? std::min<int64_t>(last + 1, p.sliding_window + e - t) : last + 1;
    tiles.push_back({static_cast<int32_t>(t), static_cast<int32_t>(e - t), seq[t], (e - t + 4) * keys});
    t = e;
  }
  // The costliest first (a prompt's last tiles read the most keys): threads that take items in this order end
  // together, instead of one running the last long tile alone.
  std::stable_sort(tiles.begin(), tiles.end(), [](const Tile& a, const Tile& b) { return a.cost > b.cost; });
  parallel_for(thread_pool, static_cast<int64_t>(tiles.size()), [&p, &tiles, fn](int64_t i) { fn(p, tiles[i]); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedRaggedPagedAttention, RaggedPagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q
                                  .Arg<ffi::AnyBuffer>()          // kv_pool
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()   // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()   // token_seq
                                  .Arg<ffi::Buffer<ffi::S32>>()   // positions
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("softcap"));
