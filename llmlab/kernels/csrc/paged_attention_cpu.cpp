// PagedAttention for CPU tensors: one pass over each sequence's blocks, in place (no gather).
//
// The same maths as llmlab.inference.paged_attention.paged_attention_reference: the step's new
// tokens q [N, H, D] (query_lens[s] per sequence, concatenated) attend causally to the
// context_lens[s] cached tokens of their sequence, found through block_tables [S, max_blocks] in
// k_cache / v_cache [num_blocks, block_size, Hkv, D]. A query at position p sees keys t <= p
// (and t > p - sliding_window when sliding_window > 0). Grouped-query attention: query head h
// reads kv head h / (H / Hkv). Scores, softmax and the weighted sum are computed in fp32 whatever
// the storage dtype (fp32, bf16, fp16), as vLLM's CPU kernel does; out has q's dtype.
//
// Decode items (a sequence with query_len 1, when there are at least as many of them as threads)
// are whole sequences: paged_attention_decode.h walks the sequence's blocks once, and for each
// block and kv head computes the scores of the G query heads, updates an online softmax and adds
// the block's V rows, while prefetching the next block of the walk (the layout keeps a block's K,
// all kv heads, in one contiguous 12 KB stretch for SmolLM2's shapes in bf16). Measured on this
// repository's machine (one thread, SmolLM2-135M's shapes, 40 sequences of 100-250 tokens, blocks
// at random in a 1 GiB cache read cold as in the engine, benchmarks/bench_cpu_paged_attention.py):
// bf16 0.90 -> 0.74 ms a layer, fp32 1.20 -> 1.18 ms (memory-bound at ~9.4 GB/s).
//
// Other work items: one (sequence, kv head). Its G = H / Hkv query heads are "rows" that read the
// same K and V: up to RT rows of one query position go together, so each K or V row read (and
// converted to fp32) serves all of them. Two passes per row tile (Kwon et al., SOSP 2023, §4.1;
// the in-place walk over the block table is their kernel's, the loop order is ours):
//   1. scores q.k and their max. Short items (few rows) read K rows in place and reduce 16 keys'
//      partial dot products at once (a shuffle tree instead of one horizontal sum per key);
//      prompt items (many rows) first copy the sequence's K, transposed, into an fp32 buffer
//      [D, context] once, and then 64 keys' scores are 64 lanes of plain multiply-adds.
//   2. exp(s - max), its sum, and the weighted sum of V rows read in place.
// bf16 on a build with AVX512-BF16 (and head dims a multiple of 32) multiplies bf16 pairs
// directly (vdpbf16ps, fp32 sums): prompt items then copy K and V once into pairs, and round
// their softmax weights to bf16 for the weighted sum of V, as flash attention kernels do (decode
// items keep fp32 weights). The next block's rows are prefetched before a block is read (blocks
// lie anywhere in the cache, where the hardware prefetcher, which follows strides within a page,
// cannot see them coming).
// Vectors are GCC/Clang vector extensions of 16 floats: the compiler maps them to AVX-512, AVX2
// or SSE, whatever the build targets.
#include <torch/extension.h>
#include "cpu_math.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using llmlab_cpu::exp_f;

constexpr int L = 16;                                            // lanes of one vector
typedef float vf __attribute__((vector_size(64)));               // 16 x fp32
typedef float vf_u __attribute__((vector_size(64), aligned(4)));     // (unaligned access)
typedef uint16_t vh_u __attribute__((vector_size(32), aligned(2)));  // 16 x 16-bit storage
typedef uint32_t vu __attribute__((vector_size(64)));

// 16 stored values -> fp32. bf16 is the top half of an fp32: widen and shift.
inline vf load16(const float* p) { return *reinterpret_cast<const vf_u*>(p); }
#if defined(__AVX512F__)
inline vf load16(const c10::BFloat16* p) {        // (one widening load; the generic code splits it)
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return (vf)_mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline vf load16(const c10::Half* p) {
  return (vf)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#else
inline vf load16(const c10::BFloat16* p) {
  return (vf)(__builtin_convertvector(*reinterpret_cast<const vh_u*>(p), vu) << 16);
}
inline vf load16(const c10::Half* p) {
  vf x;
  for (int i = 0; i < L; ++i) x[i] = static_cast<float>(p[i]);
  return x;
}
#endif
inline float sum16(vf x) {
  float s = 0.f;
  for (int i = 0; i < L; ++i) s += x[i];
  return s;
}

// max(x[0 .. n)), n >= 1, in whole vectors of 16 lanes (x must have room up to the next
// multiple of 16; the lanes past n are masked). A scalar loop would not vectorise (fp max is not
// associative for the compiler), and a scalar tail would cost as much as the vectors.
inline float max_of(const float* x, int64_t n) {
  vf m = vf{} + x[0];
  for (int64_t i = 0; i < n; i += L) {
    vf y = load16(x + i);
    for (int j = 0; j < L; ++j) y[j] = i + j < n ? y[j] : x[0];
    m = m > y ? m : y;
  }
  float r = m[0];
  for (int j = 1; j < L; ++j) r = std::max(r, m[j]);
  return r;
}

// s[t] = exp(s[t] - mx) for t in [lo, hi], and 0 past hi up to the next multiple of 16 keys
// (whole vectors, no scalar tail; s must have room); returns the sum over [lo, hi].
inline float exp_sum(float* s, int64_t lo, int64_t hi, float mx) {
  const int64_t end = lo + (hi - lo + L) / L * L;
  float l = 0.f;
#pragma omp simd reduction(+ : l)
  for (int64_t t = lo; t < end; ++t) {
    const float p = t <= hi ? exp_f(s[t] - mx) : 0.f;
    s[t] = p;
    l += p;
  }
  return l;
}

// p[i]'s lane sum in lane i, for 16 vectors: four levels of "add the two halves", each pairing
// two inputs into one output (15 adds in all, instead of 16 separate horizontal sums).
inline vf reduce16(vf p[L]) {
  vf a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(p[2 * i], p[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// Calls f(t, row) for the keys t in [lo, hi] of one sequence, block by block: row is key t's
// vector of one kv head in the cache (block table[t / bs], slot t % bs). Before a block's rows,
// the next block's rows are prefetched: blocks lie anywhere in the cache, so the hardware's
// prefetcher, which follows a stride within a page, cannot see them coming.
template <typename T, typename F>
inline void for_each_key(const T* cache, int64_t c_blk, int64_t c_tok, const int64_t* table,
                         int64_t bs, int64_t lo, int64_t hi, F&& f, int64_t row_bytes = 0) {
  for (int64_t b = lo / bs, t = lo; t <= hi; ++b) {
    const T* row = cache + table[b] * c_blk + (t - b * bs) * c_tok;
    const int64_t stop = std::min(hi + 1, (b + 1) * bs);
    if (row_bytes && stop <= hi) {
      const char* nxt = reinterpret_cast<const char*>(cache + table[b + 1] * c_blk);
      const int64_t n = std::min(bs, hi + 1 - stop);
      for (int64_t j = 0; j < n; ++j)
        for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(nxt + j * c_tok * sizeof(T) + o);
    }
    for (; t < stop; ++t, row += c_tok) f(t, row);
  }
}

// One work item's view of the cache and its sequence.
template <typename T>
struct Item {
  const T* k;            // kv head's first element in the K cache (block 0, slot 0)
  const T* v;
  int64_t c_blk, c_tok;  // cache strides: block, slot
  const int64_t* table;
  int64_t bs;
};

// Pass 1, in place: sc[r][t] = scale * (lane sum of row r's partial products with key t) for t
// in [lo, hi]. dots(row, part, n) writes each row r's 16-lane partial products with one K row
// into part[r][n]; 16 keys' partials are then reduced at once (reduce16).
template <int RT, typename T, typename Dots>
void scores_in_place(const Item<T>& it, int64_t lo, int64_t hi, float scale, int64_t row_bytes,
                     float* const* sc, Dots&& dots) {
  vf part[RT][L];
  int n = 0;
  int64_t first = lo;
  auto flush = [&]() {
    for (int r = 0; r < RT; ++r) {
      for (int i = n; i < L; ++i) part[r][i] = vf{};
      const vf s = reduce16(part[r]) * scale;
      std::memcpy(sc[r] + first, &s, n * sizeof(float));
    }
  };
  for_each_key(it.k, it.c_blk, it.c_tok, it.table, it.bs, lo, hi, [&](int64_t t, const T* row) {
    dots(row, part, n);
    if (++n == L) {
      flush();
      n = 0;
      first = t + 1;
    }
  }, row_bytes);
  if (n) flush();
}

// Pass 1 from K rows read in place, q already scaled (fp32 multiply-adds of the widened rows).
template <typename T, int NC, int RT>
void scores_direct(const Item<T>& it, const vf (&q)[RT][NC], int64_t lo, int64_t hi, float* const* sc) {
  scores_in_place<RT>(it, lo, hi, 1.f, NC * L * sizeof(T), sc, [&](const T* row, vf (&part)[RT][L], int n) {
    vf kx[NC];
    for (int c = 0; c < NC; ++c) kx[c] = load16(row + c * L);
    for (int r = 0; r < RT; ++r) {
      vf p = q[r][0] * kx[0];
      for (int c = 1; c < NC; ++c) p += q[r][c] * kx[c];
      part[r][n] = p;
    }
  });
}

// Scores of keys [t0, t0 + TK * 16) from kt [D, ld], the item's K transposed to fp32: keys
// in lanes, TK vectors of them per row.
template <int NC, int RT, int TK>
inline void score_tile(const float* kt, int64_t ld, const vf (&q)[RT][NC], int64_t t0, vf (&acc)[RT][TK]) {
  for (int r = 0; r < RT; ++r)
    for (int i = 0; i < TK; ++i) acc[r][i] = vf{};
  for (int d = 0; d < NC * L; ++d) {
    const float* kr = kt + d * ld + t0;
    vf kx[TK];
    for (int i = 0; i < TK; ++i) kx[i] = load16(kr + i * L);
    for (int r = 0; r < RT; ++r) {
      const float qd = q[r][d / L][d % L];
      for (int i = 0; i < TK; ++i) acc[r][i] += qd * kx[i];
    }
  }
}

// Pass 1 from kt: tiles of 64 keys, the last one past hi too (kt is padded past the end; a
// narrower tail tile would leave the multiply-adds waiting on each other).
template <int NC, int RT>
void scores_tiled(const float* kt, int64_t ld, const vf (&q)[RT][NC], int64_t lo, int64_t hi,
                  float* const* sc) {
  for (int64_t t0 = lo; t0 <= hi; t0 += 4 * L) {
    vf acc[RT][4];
    score_tile<NC, RT, 4>(kt, ld, q, t0, acc);
    const int64_t n = std::min<int64_t>(4 * L, hi + 1 - t0);
    for (int r = 0; r < RT; ++r) std::memcpy(sc[r] + t0, acc[r], n * sizeof(float));
  }
}

// Pass 2 for RT rows: softmax of sc[r][lo..hi] and the weighted sum of V (rows read in place),
// written to out[r].
template <typename T, int NC, int RT>
void softmax_v(const Item<T>& it, int64_t lo, int64_t hi, float* const* sc, T* const* out) {
  float inv[RT];
  for (int r = 0; r < RT; ++r) {
    float* s = sc[r];
    inv[r] = 1.f / exp_sum(s, lo, hi, max_of(s + lo, hi + 1 - lo));
  }
  vf acc[RT][NC] = {};
  for_each_key(it.v, it.c_blk, it.c_tok, it.table, it.bs, lo, hi, [&](int64_t t, const T* row) {
    vf vx[NC];
    for (int c = 0; c < NC; ++c) vx[c] = load16(row + c * L);
    for (int r = 0; r < RT; ++r) {
      const float p = sc[r][t];
      for (int c = 0; c < NC; ++c) acc[r][c] += p * vx[c];
    }
  }, NC * L * sizeof(T));
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < NC; ++c)
      for (int i = 0; i < L; ++i) out[r][c * L + i] = static_cast<T>(acc[r][c][i] * inv[r]);
}

#include "paged_attention_bf16.h"   // (the bf16 dot-product passes; kDpBf16)

struct Buffers {
  std::vector<float> kt, sc;         // K transposed (fp32), scores
  std::vector<uint32_t> kt2, vt2;    // K and V as bf16 pairs (the AVX512-BF16 prompt path)
  std::vector<uint16_t> pb;          // softmax weights in bf16
};

// Whether items of this dtype and head dim take the bf16 dot-product path.
template <typename T, int NC>
constexpr bool dp_bf16() { return kDpBf16 && std::is_same_v<T, c10::BFloat16> && NC % 2 == 0; }

// Rows g0 .. g0+RT-1 of query n (position pos): the G heads of one kv head, RT at a time.
// tiled: the item's K (and, bf16 path, V) were copied into buf first.
template <typename T, int NC, int RT>
void attend_rows(const Item<T>& it, const T* const* qr, float scale, int64_t lo, int64_t pos,
                 bool tiled, int64_t ld, Buffers& buf, float* const* sc, T* const* out) {
#if defined(__AVX512BF16__)
  if constexpr (dp_bf16<T, NC>()) {
    if (tiled) {
      scores_tiled_bf16<NC, RT>(buf.kt2.data(), ld, qr, scale, lo, pos, sc);
      softmax_v_bf16<NC, RT>(buf.vt2.data(), lo, pos, sc, buf.pb.data(), ld, out);
    } else {
      scores_direct_bf16<NC, RT>(it, qr, scale, lo, pos, sc);
      softmax_v<T, NC, RT>(it, lo, pos, sc, out);
    }
    return;
  }
#endif
  vf q[RT][NC];
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < NC; ++c) q[r][c] = load16(qr[r] + c * L) * scale;
  if (tiled) scores_tiled<NC, RT>(buf.kt.data(), ld, q, lo, pos, sc);
  else scores_direct<T, NC, RT>(it, q, lo, pos, sc);
  softmax_v<T, NC, RT>(it, lo, pos, sc, out);
}

// Most rows one tile takes: RT * NC accumulators must fit the registers (32 vectors on AVX-512).
template <int NC>
constexpr int max_rows() { return std::max(1, std::min(4, 16 / NC)); }

#include "paged_attention_decode.h"   // (the decode items: attend_decode)

template <typename T, int NC, int RT = max_rows<NC>()>
void dispatch_rows(int rt, const Item<T>& it, const T* const* qr, float scale, int64_t lo, int64_t pos,
                   bool tiled, int64_t ld, Buffers& buf, float* const* sc, T* const* out) {
  if constexpr (RT > 1) {
    if (rt < RT) return dispatch_rows<T, NC, RT - 1>(rt, it, qr, scale, lo, pos, tiled, ld, buf, sc, out);
  }
  attend_rows<T, NC, RT>(it, qr, scale, lo, pos, tiled, ld, buf, sc, out);
}

// Work item (sequence s, kv head hkv): its qlen queries x G heads.
template <typename T, int NC>
void attend_item(const Item<T>& it, const T* q, int64_t q_s0, int64_t q_s1, int64_t ctx, int64_t qlen,
                 int64_t q0, int64_t hkv, int64_t G, float scale, int64_t window, T* out,
                 int64_t o_s0, int64_t o_s1, Buffers& buf) {
  constexpr int D = NC * L, R = max_rows<NC>();
  const int64_t ld = (ctx + L - 1) / L * L + 4 * L;          // (room for a tile's overrun)
  const bool tiled = qlen * G >= 16;                          // copying K pays for itself
  buf.sc.resize(R * ld);
  float* sc[R];
  for (int r = 0; r < R; ++r) sc[r] = buf.sc.data() + r * ld;
  if (tiled) {
#if defined(__AVX512BF16__)
    if constexpr (dp_bf16<T, NC>()) {
      pack_bf16<NC>(it, ctx, ld, buf.kt2, buf.vt2);
      buf.pb.resize(R * ld + L);
    } else
#endif
    {
      buf.kt.assign(D * ld, 0.f);
      float* k = buf.kt.data();
      for_each_key(it.k, it.c_blk, it.c_tok, it.table, it.bs, 0, ctx - 1, [&](int64_t t, const T* row) {
        for (int c = 0; c < NC; ++c) {
          const vf x = load16(row + c * L);
          for (int i = 0; i < L; ++i) k[(c * L + i) * ld + t] = x[i];
        }
      });
    }
  }
  for (int64_t j = 0; j < qlen; ++j) {
    const int64_t n = q0 + j, pos = ctx - qlen + j;
    const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
    for (int64_t g0 = 0; g0 < G; g0 += R) {
      const int rt = static_cast<int>(std::min<int64_t>(R, G - g0));
      const T* qr[R];
      T* orow[R];
      for (int r = 0; r < rt; ++r) {
        qr[r] = q + n * q_s0 + (hkv * G + g0 + r) * q_s1;
        orow[r] = out + n * o_s0 + (hkv * G + g0 + r) * o_s1;
      }
      dispatch_rows<T, NC>(rt, it, qr, scale, lo, pos, tiled, ld, buf, sc, orow);
    }
  }
}

template <typename T>
using ItemFn = void (*)(const Item<T>&, const T*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                        int64_t, float, int64_t, T*, int64_t, int64_t, Buffers&);

// The compiled head dims: D / 16 in {1, ..., 8, 16} (head_dim 16 .. 128, and 256).
template <typename T>
ItemFn<T> item_fn(int64_t D) {
  switch (D) {
    case 16: return attend_item<T, 1>;
    case 32: return attend_item<T, 2>;
    case 48: return attend_item<T, 3>;
    case 64: return attend_item<T, 4>;
    case 80: return attend_item<T, 5>;
    case 96: return attend_item<T, 6>;
    case 112: return attend_item<T, 7>;
    case 128: return attend_item<T, 8>;
    case 256: return attend_item<T, 16>;
    default: return nullptr;
  }
}

template <typename T>
using DecodeFn = void (*)(const BlockRef<T>*, int64_t, const BlockRef<T>*, int64_t, int64_t, int64_t, int64_t,
                          const T*, int64_t, int64_t, float, T*, int64_t, DecodeState&);

template <typename T>
DecodeFn<T> decode_fn(int64_t D) {
  switch (D) {
    case 16: return attend_decode<T, 1>;
    case 32: return attend_decode<T, 2>;
    case 48: return attend_decode<T, 3>;
    case 64: return attend_decode<T, 4>;
    case 80: return attend_decode<T, 5>;
    case 96: return attend_decode<T, 6>;
    case 112: return attend_decode<T, 7>;
    case 128: return attend_decode<T, 8>;
    case 256: return attend_decode<T, 16>;
    default: return nullptr;
  }
}

// Appends a decode sequence's blocks in range (the window's, or all up to its new token) to walk.
template <typename T>
void add_blocks(const Item<T>& it, int64_t ctx, int64_t window, std::vector<BlockRef<T>>& walk) {
  const int64_t pos = ctx - 1, lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
  for (int64_t b = lo / it.bs; b * it.bs <= pos; ++b) {
    const int64_t t0 = std::max(lo, b * it.bs), off = it.table[b] * it.c_blk + (t0 - b * it.bs) * it.c_tok;
    walk.push_back({it.k + off, it.v + off, std::min(pos, (b + 1) * it.bs - 1) - t0 + 1});
  }
}

// The work items: (sequence, kv head), or (sequence, -1) for a whole decode sequence (query_len 1),
// which is what decodes are as long as there are at least as many of them as threads.
std::vector<std::pair<int64_t, int64_t>> work_items(const int64_t* ql, int64_t S, int64_t Hkv) {
  int64_t decodes = 0;
  for (int64_t s = 0; s < S; ++s) decodes += ql[s] == 1;
  const bool whole = decodes >= at::get_num_threads();
  std::vector<std::pair<int64_t, int64_t>> items;
  for (int64_t s = 0; s < S; ++s) {
    if (whole && ql[s] == 1) items.emplace_back(s, -1);
    else
      for (int64_t h = 0; h < Hkv; ++h) items.emplace_back(s, h);
  }
  return items;
}

}  // namespace

bool supports_head_dim(int64_t D) { return item_fn<float>(D) != nullptr; }

torch::Tensor paged_attention_cpu(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                  torch::Tensor block_tables, torch::Tensor context_lens,
                                  torch::Tensor query_lens, double scale, int64_t sliding_window) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "paged_attention_cpu takes CPU tensors");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "q must be [N, H, D] and k_cache, v_cache [num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "q, k_cache and v_cache must have one dtype");
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D, "head_dim of q (", D, ") and of the cache (", k_cache.size(3), ") differ");
  TORCH_CHECK(supports_head_dim(D), "head_dim=", D, " is not compiled (16, 32, ..., 128 or 256)");
  TORCH_CHECK(H % Hkv == 0, "num_heads=", H, " must be a multiple of num_kv_heads=", Hkv);
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.strides() == k_cache.strides(),
              "the head dimension must be contiguous and both caches laid out alike");
  auto bt = block_tables.to(torch::kInt64).contiguous();
  auto cl = context_lens.to(torch::kInt64).contiguous();
  auto ql = query_lens.to(torch::kInt64).contiguous();
  const int64_t S = bt.size(0);
  TORCH_CHECK(cl.numel() == S && ql.numel() == S, "one context_len and query_len per block table row");
  const int64_t* cl_p = cl.data_ptr<int64_t>();
  const int64_t* ql_p = ql.data_ptr<int64_t>();
  std::vector<int64_t> q0(S + 1, 0);
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(ql_p[s] >= 1 && ql_p[s] <= cl_p[s], "sequence ", s, ": need 1 <= query_len <= context_len");
    TORCH_CHECK((cl_p[s] + bs - 1) / bs <= bt.size(1), "sequence ", s, ": context_len exceeds its block table");
    q0[s + 1] = q0[s] + ql_p[s];
  }
  TORCH_CHECK(q0[S] == N, "query_lens sum to ", q0[S], " but q has ", N, " tokens");
  auto out = torch::empty({N, H, D}, q.options());
  const int64_t G = H / Hkv;
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16 ||
              q.scalar_type() == at::kHalf, "paged_attention_cpu takes fp32, bf16 or fp16 tensors");
  const auto run = [&](auto zero) {
    using scalar_t = decltype(zero);
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = k_cache.data_ptr<scalar_t>();
    const scalar_t* vp = v_cache.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t* tp = bt.data_ptr<int64_t>();
    const auto fn = item_fn<scalar_t>(D);
    const auto dec = decode_fn<scalar_t>(D);
    const auto items = work_items(ql_p, S, Hkv);
    const auto item = [&](int64_t s, int64_t hkv) {
      return Item<scalar_t>{kp + std::max<int64_t>(hkv, 0) * k_cache.stride(2), vp + std::max<int64_t>(hkv, 0) * k_cache.stride(2),
                            k_cache.stride(0), k_cache.stride(1), tp + s * bt.size(1), bs};
    };
    at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
      Buffers buf;
      DecodeState st;
      std::vector<BlockRef<scalar_t>> walk;           // the decode items' blocks, in order
      std::vector<int64_t> first(end - begin + 1, 0);
      for (int64_t i = begin; i < end; ++i) {
        if (items[i].second < 0) add_blocks(item(items[i].first, -1), cl_p[items[i].first], sliding_window, walk);
        first[i + 1 - begin] = static_cast<int64_t>(walk.size());
      }
      for (int64_t i = begin; i < end; ++i) {
        const auto [s, hkv] = items[i];
        if (hkv >= 0) {
          fn(item(s, hkv), qp, q.stride(0), q.stride(1), cl_p[s], ql_p[s], q0[s], hkv, G, static_cast<float>(scale),
             sliding_window, op, out.stride(0), out.stride(1), buf);
          continue;
        }
        const BlockRef<scalar_t>* w = walk.data() + first[i - begin];
        dec(w, first[i + 1 - begin] - first[i - begin], walk.data() + walk.size(), bs, k_cache.stride(1),
            k_cache.stride(2), Hkv, qp + q0[s] * q.stride(0), q.stride(1), G, static_cast<float>(scale),
            op + q0[s] * out.stride(0), out.stride(1), st);
      }
    });
  };
  if (q.scalar_type() == at::kFloat) run(float{});
  else if (q.scalar_type() == at::kBFloat16) run(c10::BFloat16{});
  else run(c10::Half{});
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention_cpu", &paged_attention_cpu,
        "PagedAttention over block tables on CPU tensors (see paged_attention_cpu.cpp)");
  m.def("supports_head_dim", &supports_head_dim, "whether a head_dim is compiled");
  m.def("isa", [] { return std::string(llmlab_cpu::compiled_isa()); },
        "the vector code this build uses (cpu_math.h)");
}
