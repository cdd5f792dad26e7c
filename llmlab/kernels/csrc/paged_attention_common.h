// PagedAttention's CPU building blocks: part of paged_attention_cpu.cpp, included inside its
// anonymous namespace before the bf16 passes (paged_attention_bf16.h) and the decode items
// (paged_attention_decode.h), which use them; not compiled on its own. The 16-lane vector type and
// its loads, the lane reductions, the walk over a sequence's blocks (for_each_key, with the next
// block prefetched), a work item's view of the cache (Item), the scores read in place (short
// items), a row's softmax weights and the weighted sum of V (softmax_v, also the prompt items'),
// how many query rows a short item's tile takes (max_rows), and the call of a tile's kernel
// instantiated for its row count (with_rows).
#pragma once

using llmlab_cpu::exp_f;

constexpr int L = 16;                                            // lanes of one vector
typedef uint16_t vh_u __attribute__((vector_size(32), aligned(2)));  // 16 x 16-bit storage
#if defined(__AVX__) && !defined(__AVX512F__)
// AVX2 (and AVX) builds: a 16-float vector is two 8-float halves. GCC keeps a 64-byte vector
// extension type out of registers where the target has none that wide: every value went through
// the stack (prompt attention 20-35x slower than AVX-512, decode 4-6x, session 15); a pair of
// 32-byte halves stays in registers. The operators are those the kernels use.
#define LLMLAB_VF_PAIR 1
typedef float v8 __attribute__((vector_size(32)));
typedef float v8_u __attribute__((vector_size(32), aligned(4), may_alias));
typedef uint16_t v8h_u __attribute__((vector_size(16), aligned(2)));
typedef uint32_t v8u __attribute__((vector_size(32)));
struct vf {
  v8 a, b;                                                       // lanes 0-7, 8-15
  float operator[](int i) const { return i < 8 ? a[i] : b[i - 8]; }
  vf& operator+=(vf y) { a += y.a; b += y.b; return *this; }
  vf& operator*=(float s) { a *= s; b *= s; return *this; }
};
inline vf operator+(vf x, vf y) { return {x.a + y.a, x.b + y.b}; }
inline vf operator-(vf x, vf y) { return {x.a - y.a, x.b - y.b}; }
inline vf operator*(vf x, vf y) { return {x.a * y.a, x.b * y.b}; }
inline vf operator*(vf x, float s) { return {x.a * s, x.b * s}; }
inline vf operator*(float s, vf x) { return {s * x.a, s * x.b}; }
inline vf vmax(vf x, vf y) { return {x.a > y.a ? x.a : y.a, x.b > y.b ? x.b : y.b}; }
inline vf load16(const float* p) { return {*reinterpret_cast<const v8_u*>(p), *reinterpret_cast<const v8_u*>(p + 8)}; }
inline void store16(float* p, vf x) {
  *reinterpret_cast<v8_u*>(p) = x.a;
  *reinterpret_cast<v8_u*>(p + 8) = x.b;
}
inline v8 widen_bf16(const c10::BFloat16* p) {                  // 8 bf16 -> fp32: widen and shift
  return (v8)(__builtin_convertvector(*reinterpret_cast<const v8h_u*>(p), v8u) << 16);
}
inline vf load16(const c10::BFloat16* p) { return {widen_bf16(p), widen_bf16(p + 8)}; }
inline vf load16(const c10::Half* p) {
  float x[L];
  for (int i = 0; i < L; ++i) x[i] = static_cast<float>(p[i]);
  return load16(x);
}
// Memory-to-memory loops (the softmax weights) step by the widest vector the build keeps in a
// register: LN lanes of vn.
typedef v8 vn;
constexpr int LN = 8;
inline vn loadn(const float* p) { return *reinterpret_cast<const v8_u*>(p); }
inline void storen(float* p, vn x) { *reinterpret_cast<v8_u*>(p) = x; }
#else
typedef float vf __attribute__((vector_size(64)));               // 16 x fp32
typedef float vf_u __attribute__((vector_size(64), aligned(4), may_alias));  // (unaligned access)
typedef uint32_t vu __attribute__((vector_size(64)));
inline vf vmax(vf x, vf y) { return x > y ? x : y; }

// 16 stored values -> fp32. bf16 is the top half of an fp32: widen and shift.
inline vf load16(const float* p) { return *reinterpret_cast<const vf_u*>(p); }
inline void store16(float* p, vf x) { *reinterpret_cast<vf_u*>(p) = x; }
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
typedef vf vn;
constexpr int LN = L;
inline vn loadn(const float* p) { return load16(p); }
inline void storen(float* p, vn x) { store16(p, x); }
#endif
inline float sum16(vf x) {
  float s = 0.f;
  for (int i = 0; i < L; ++i) s += x[i];
  return s;
}

// The largest of x's lanes (four halvings, in vector registers).
#if defined(LLMLAB_VF_PAIR)
inline float max16(vf x) {
  v8 m = x.a > x.b ? x.a : x.b, y = __builtin_shufflevector(m, m, 4, 5, 6, 7, 0, 1, 2, 3);
  m = m > y ? m : y;
  y = __builtin_shufflevector(m, m, 2, 3, 0, 1, 6, 7, 4, 5);
  m = m > y ? m : y;
  y = __builtin_shufflevector(m, m, 1, 0, 3, 2, 5, 4, 7, 6);
  m = m > y ? m : y;
  return m[0];
}
#else
inline float max16(vf x) {
  vf y = __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  x = x > y ? x : y;
  y = __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  x = x > y ? x : y;
  y = __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  x = x > y ? x : y;
  y = __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  x = x > y ? x : y;
  return x[0];
}
#endif
// exp_f of a vector's lanes (one vector of each of its steps).
inline vn expn(vn x) {
  float y[LN];
#pragma omp simd
  for (int i = 0; i < LN; ++i) y[i] = exp_f(x[i]);
  return loadn(y);
}

// p[i]'s lane sum in lane i, for 16 vectors: four levels of "add the two halves", each pairing
// two inputs into one output (15 adds in all, instead of 16 separate horizontal sums).
#if defined(LLMLAB_VF_PAIR)
// (two halves: each vector's halves added, then the same levels on 8 lanes for each 8 vectors)
inline v8 reduce8(const v8* q) {
  v8 a[4], b[2];
  for (int i = 0; i < 4; ++i)
    a[i] = __builtin_shufflevector(q[2 * i], q[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(q[2 * i], q[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(b[0], b[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(b[0], b[1], 1, 3, 5, 7, 9, 11, 13, 15);
}
inline vf reduce16(vf p[L]) {
  v8 q[L];
  for (int i = 0; i < L; ++i) q[i] = p[i].a + p[i].b;
  return {reduce8(q), reduce8(q + 8)};
}
#else
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
#endif

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

// Row r of a tile of rows whose keys are [a, b]: its softmax weights over its own keys [lo, hi],
// s[t] = exp(s[t] - max) there and 0 on the rest of [a, b] (a later position's keys, or keys
// before an earlier one's window); returns 1 / their sum. Whole vectors from a (s must have room
// up to b's next multiple of 16 past a): a scalar tail would cost as much as the vectors.
inline float weights(float* s, int64_t a, int64_t b, int64_t lo, int64_t hi) {
  typedef int32_t vi __attribute__((vector_size(LN * 4)));
  vi lane;
  for (int i = 0; i < LN; ++i) lane[i] = i;
  const auto in = [&](int64_t t) { return (lane >= static_cast<int32_t>(lo - t)) & (lane <= static_cast<int32_t>(hi - t)); };
  const vn ninf = vn{} - std::numeric_limits<float>::infinity();
  vn m = ninf;
  for (int64_t t = a; t <= b; t += LN) {
    const vn x = loadn(s + t);
    m = in(t) && x > m ? x : m;
  }
  float mx = m[0];
  for (int i = 1; i < LN; ++i) mx = std::max(mx, m[i]);
  vn l = {};
  for (int64_t t = a; t <= b; t += LN) {
    const vn p = in(t) ? expn(loadn(s + t) - mx) : vn{};
    storen(s + t, p);
    l += p;
  }
  float sum = 0.f;
  for (int i = 0; i < LN; ++i) sum += l[i];
  return 1.f / sum;
}

// Accumulator vectors a pass keeps in registers: 24 of AVX-512's 32; 6 pairs of halves (12 of
// AVX2's 16 registers).
#if defined(LLMLAB_VF_PAIR)
constexpr int kAccRegs = 6;
#else
constexpr int kAccRegs = 24;
#endif

// The most vectors of a row, a divisor of NC, that RT rows' accumulators can hold at once.
template <int NC, int RT>
constexpr int column_group() {
  for (int cg = NC; cg > 1; --cg)
    if (NC % cg == 0 && RT * cg <= kAccRegs) return cg;
  return 1;
}

// Pass 2 for RT rows, row r seeing keys [lo[r], hi[r]] (rows in position order: the keys of all
// are [lo[0], hi[RT - 1]]): each row's softmax, and the weighted sum of V (rows read in place) for
// all rows at once, written to out[r]. A row's zero weights for the others' keys add nothing.
// Where RT rows' sums do not fit the registers (AVX2), the sum is taken a group of a row's
// vectors at a time, V's rows read once a group (from cache after the first).
template <typename T, int NC, int RT>
void softmax_v(const Item<T>& it, const int64_t* lo, const int64_t* hi, float* const* sc, T* const* out) {
  const int64_t a = lo[0], b = hi[RT - 1];
  float inv[RT];
  for (int r = 0; r < RT; ++r) inv[r] = weights(sc[r], a, b, lo[r], hi[r]);
  constexpr int CG = column_group<NC, RT>();
  for (int c0 = 0; c0 < NC; c0 += CG) {
    vf acc[RT][CG] = {};
    for_each_key(it.v, it.c_blk, it.c_tok, it.table, it.bs, a, b, [&](int64_t t, const T* row) {
      vf vx[CG];
      for (int c = 0; c < CG; ++c) vx[c] = load16(row + (c0 + c) * L);
      for (int r = 0; r < RT; ++r) {
        const float p = sc[r][t];
        for (int c = 0; c < CG; ++c) acc[r][c] += p * vx[c];
      }
    }, NC * L * sizeof(T));
    for (int r = 0; r < RT; ++r)
      for (int c = 0; c < CG; ++c)
        for (int i = 0; i < L; ++i) out[r][(c0 + c) * L + i] = static_cast<T>(acc[r][c][i] * inv[r]);
  }
}

// f(std::integral_constant<int, rt>{}) for a tile's row count rt in [1, RT]: each count its own
// instantiation, so a tile's accumulators are fixed-size arrays the compiler keeps in registers.
template <int RT, typename F>
inline void with_rows(int rt, F&& f) {
  if constexpr (RT > 1) {
    if (rt < RT) return with_rows<RT - 1>(rt, f);
  }
  f(std::integral_constant<int, RT>{});
}

// Most rows a short item's tile (and a decode item's) takes: RT * NC accumulators must fit the
// registers (32 vectors on AVX-512).
template <int NC>
constexpr int max_rows() { return std::max(1, std::min(4, 16 / NC)); }
