// PagedAttention's CPU building blocks: part of paged_attention_cpu.cpp, included inside its
// anonymous namespace before the bf16 passes (paged_attention_bf16.h) and the decode items
// (paged_attention_decode.h), which use them; not compiled on its own. The 16-lane vector type and
// its loads, the lane reductions, the walk over a sequence's blocks (for_each_key, with the next
// block prefetched), a work item's view of the cache (Item), the two passes of a prompt item
// (scores read in place or from K transposed; softmax with the weighted sum of V), and how many
// query rows one tile takes (max_rows).
#pragma once

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

// Most rows one tile takes: RT * NC accumulators must fit the registers (32 vectors on AVX-512).
template <int NC>
constexpr int max_rows() { return std::max(1, std::min(4, 16 / NC)); }
