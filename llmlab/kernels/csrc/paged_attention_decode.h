// PagedAttention's decode path: part of paged_attention_cpu.cpp, included inside its anonymous
// namespace after paged_attention_common.h (vf, load16, reduce16, max16, exp_f, Item, max_rows,
// with_rows) and the bf16 passes (kDpBf16, dp, ld512), not compiled on its own.
//
// A decode item is a whole sequence with one new token (query_len 1): all its kv heads and all H
// query rows. Its blocks are walked once, in order, and each block is finished before the next:
// for every kv head, the block's scores (q.k of the G query heads sharing it, 16 keys reduced at
// once), an online-softmax update (Milakov & Gimelshein 2018, as FlashAttention rescales) and the
// weighted sum of the block's V rows, so K and V are read once each and the scores never leave a
// one-block buffer. The layout [num_blocks, block_size, Hkv, D] keeps one key's rows of all kv
// heads side by side: a block's K (and V) is one contiguous stretch of memory. While a kv head
// reads its rows of a block, it prefetches its rows of the next block of the walk (the sequence's
// next block, or the next item's first): a few lines between the arithmetic of each key, since a
// burst of a whole block's prefetches stalls the core once its fill buffers are all taken.
#pragma once

// A row of K, V or q as NC vectors of fp32 in a fixed lane order: the stored order for fp32 and
// fp16; for bf16, each 32 values split into the even and the odd ones (the 32-bit pairs shifted
// and masked: two cheap instructions, no cross-lane shuffle), a last 16 in order. The dot product
// and the weighted sum do not care about the order as long as q, K, V and the output share it.
template <typename T, int NC>
struct Lanes {
  template <int CG>                                   // vectors c0 .. c0 + CG - 1 of the row
  static void load_part(const T* p, int c0, vf (&x)[CG]) {
    for (int c = 0; c < CG; ++c) x[c] = load16(p + (c0 + c) * L);
  }
  static void load(const T* p, vf (&x)[NC]) { load_part<NC>(p, 0, x); }
  static int dim(int c, int i) { return c * L + i; }
};
#if !defined(LLMLAB_VF_PAIR)
typedef uint32_t vu_u __attribute__((vector_size(64), aligned(2)));
template <int NC>
struct Lanes<c10::BFloat16, NC> {
  static void load(const c10::BFloat16* p, vf (&x)[NC]) {
    for (int c = 0; c + 1 < NC; c += 2) {
      const vu w = *reinterpret_cast<const vu_u*>(p + c * L);
      x[c] = (vf)(w << 16);
      x[c + 1] = (vf)(w & 0xFFFF0000u);
    }
    if constexpr (NC % 2 == 1) x[NC - 1] = load16(p + (NC - 1) * L);
  }
  template <int CG>                                   // (whole rows only: CG == NC on AVX-512)
  static void load_part(const c10::BFloat16* p, int, vf (&x)[CG]) {
    static_assert(CG == NC);
    load(p, x);
  }
  static int dim(int c, int i) { return NC % 2 == 1 && c == NC - 1 ? c * L + i : (c / 2) * 2 * L + 2 * i + c % 2; }
};
#endif

// Prefetches the `bytes` at p (whole 64-byte lines) into L2 (prefetcht1): the demand loads a block
// later hit L2 at little cost, and the lines in flight are not limited to the L1's fill buffers
// (into L1 the decode attention measured 7-12 % slower at 40-64 sequences, fp32).
template <typename T>
inline void prefetch_row(const T* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(reinterpret_cast<const char*>(p) + o, 0, 2);
}

// One decode item's state: per query row (h * G + g) the running max m, the running sum of
// exp(s - m) l, and the weighted sum of V acc [NC vectors, Lanes order]; q in the form the score
// code wants (NC vectors: fp32 scaled in Lanes order, or the raw bf16 in the first NC / 2).
struct DecodeState {
  std::vector<float> m, sc;
  std::vector<vf> l, acc, q;
};

// Where the next block's rows of a kv head are, to prefetch while this block's are read: `rows`
// rows at k and v (0: none), `bytes` of each.
template <typename T>
struct Ahead {
  const T* k;
  const T* v;
  int rows;
  int64_t bytes;
};

// The scores of RT rows with the n (<= 16) keys at k (stride c_tok), scaled, into s[r][0 .. 16),
// -inf past n. dots(row, part, j) writes each row's 16-lane partial products with one K row into
// part[r][j]; reduce16 sums 16 keys' partials at once. Prefetches the next block's K row of each
// key it reads (`ahead`, rows from j0): a few lines at a time between the arithmetic, since a burst of
// prefetches stalls the core once its fill buffers are all taken.
template <typename T, int RT, typename Dots>
inline void chunk_scores(const T* k, int64_t c_tok, int n, float scale, Dots&& dots, float* s, int64_t ls,
                         const Ahead<T>& ahead, int j0) {
  vf part[RT][L];
  for (int j = 0; j < n; ++j) {
    if (j0 + j < ahead.rows) prefetch_row(ahead.k + (j0 + j) * c_tok, ahead.bytes);
    dots(k + j * c_tok, part, j);
  }
  for (int r = 0; r < RT; ++r) {
    for (int j = n; j < L; ++j) part[r][j] = vf{};
    store16(s + r * ls, reduce16(part[r]) * scale);
    for (int j = n; j < L; ++j) s[r * ls + j] = -std::numeric_limits<float>::infinity();
  }
}

// Online-softmax update of RT rows for one block's scores s[r][0 .. np) (-inf past the keys):
// where the block raises a row's max m, the row's sums so far (l, and acc: RT rows of NC vectors)
// are rescaled by exp(m_old - m_new); s becomes exp(s - m) (0 past the keys) and is added to the
// row's 16 lanes of sums l.
template <int NC, int RT>
inline void online_update(float* s, int64_t ls, int np, float* m, vf* l, vf* acc) {
  for (int r = 0; r < RT; ++r) {
    float* x = s + r * ls;
    vf mx = load16(x);
    for (int j = L; j < np; j += L) mx = vmax(mx, load16(x + j));
    const float mb = max16(mx);
    if (mb > m[r]) {
      const float corr = exp_f(m[r] - mb);      // (m = -inf at first: exp_f clamps; l, acc are 0)
      l[r] *= corr;
      for (int c = 0; c < NC; ++c) acc[r * NC + c] *= corr;
      m[r] = mb;
    }
    const float mn = m[r];
#pragma omp simd
    for (int j = 0; j < np; ++j) x[j] = x[j] == -std::numeric_limits<float>::infinity() ? 0.f : exp_f(x[j] - mn);
    vf lr = l[r];
    for (int j = 0; j < np; j += L) lr += load16(x + j);
    l[r] = lr;
  }
}

// RT query rows of one kv head over one block's n keys (K rows at k, V rows at v, stride c_tok):
// scores, online-softmax update, weighted sum of V into the rows' state.
template <typename T, int NC, int RT, typename Dots>
void decode_block(const T* k, const T* v, int64_t c_tok, int n, float scale, Dots&& dots, float* s,
                  int64_t ls, float* m, vf* l, vf* acc_state, const Ahead<T>& ahead) {
  for (int j0 = 0; j0 < n; j0 += L)
    chunk_scores<T, RT>(k + j0 * c_tok, c_tok, std::min(L, n - j0), scale, dots, s + j0, ls, ahead, j0);
  online_update<NC, RT>(s, ls, (n + L - 1) / L * L, m, l, acc_state);
  constexpr int CG = column_group<NC, RT>();   // (NC but on AVX2: see softmax_v)
  for (int c0 = 0; c0 < NC; c0 += CG) {
    vf acc[RT][CG];
    for (int r = 0; r < RT; ++r)
      for (int c = 0; c < CG; ++c) acc[r][c] = acc_state[r * NC + c0 + c];
    for (int j = 0; j < n; ++j) {
      if (c0 == 0 && j < ahead.rows) prefetch_row(ahead.v + j * c_tok, ahead.bytes);
      vf vx[CG];
      Lanes<T, NC>::template load_part<CG>(v + j * c_tok, c0, vx);
      for (int r = 0; r < RT; ++r) {
        const float p = s[r * ls + j];
        for (int c = 0; c < CG; ++c) acc[r][c] += p * vx[c];
      }
    }
    for (int r = 0; r < RT; ++r)
      for (int c = 0; c < CG; ++c) acc_state[r * NC + c0 + c] = acc[r][c];
  }
  for (int j = n; j < ahead.rows; ++j) {
    prefetch_row(ahead.k + j * c_tok, ahead.bytes);
    prefetch_row(ahead.v + j * c_tok, ahead.bytes);
  }
}

// Rows g0 .. g0 + RT - 1 (of all H) over one block: the dot products as the build and dtype allow
// (bf16 pairs with AVX512-BF16, else fp32 multiply-adds of the widened rows).
template <typename T, int NC, int RT>
void decode_rows(const T* k, const T* v, int64_t c_tok, int n, float scale, int64_t g0, DecodeState& st,
                 int64_t ls, const Ahead<T>& ahead) {
  float* s = st.sc.data();
  vf* acc = st.acc.data() + g0 * NC;
#if defined(__AVX512BF16__)
  if constexpr (kDpBf16 && std::is_same_v<T, c10::BFloat16> && NC % 2 == 0) {
    __m512i q[RT][NC / 2];
    for (int r = 0; r < RT; ++r)
      for (int c = 0; c < NC / 2; ++c) q[r][c] = (__m512i)st.q[(g0 + r) * NC + c];
    auto dots = [&](const T* row, vf (&part)[RT][L], int j) {
      __m512i kx[NC / 2];
      for (int c = 0; c < NC / 2; ++c) kx[c] = ld512(row + c * 2 * L);
      for (int r = 0; r < RT; ++r) {
        vf p = dp(vf{}, q[r][0], kx[0]);
        for (int c = 1; c < NC / 2; ++c) p = dp(p, q[r][c], kx[c]);
        part[r][j] = p;
      }
    };
    return decode_block<T, NC, RT>(k, v, c_tok, n, scale, dots, s, ls, &st.m[g0], &st.l[g0], acc, ahead);
  }
#endif
  vf q[RT][NC];
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < NC; ++c) q[r][c] = st.q[(g0 + r) * NC + c];
  auto dots = [&](const T* row, vf (&part)[RT][L], int j) {
    vf kx[NC];
    Lanes<T, NC>::load(row, kx);
    for (int r = 0; r < RT; ++r) {
      vf p = q[r][0] * kx[0];
      for (int c = 1; c < NC; ++c) p += q[r][c] * kx[c];
      part[r][j] = p;
    }
  };
  decode_block<T, NC, RT>(k, v, c_tok, n, 1.f, dots, s, ls, &st.m[g0], &st.l[g0], acc, ahead);
}

// Loads the item's H query rows into st.q (fp32 scaled in Lanes order, or raw bf16 pairs) and
// clears its state.
template <typename T, int NC>
void decode_init(const T* q, int64_t q_s1, int64_t H, float scale, int64_t ls, DecodeState& st) {
  st.m.assign(H, -std::numeric_limits<float>::infinity());
  st.l.assign(H, vf{});
  st.acc.assign(H * NC, vf{});
  st.q.resize(H * NC);
  st.sc.resize(max_rows<NC>() * ls);
  for (int64_t h = 0; h < H; ++h) {
    const T* row = q + h * q_s1;
#if defined(__AVX512BF16__)
    if constexpr (kDpBf16 && std::is_same_v<T, c10::BFloat16> && NC % 2 == 0) {
      for (int c = 0; c < NC / 2; ++c) st.q[h * NC + c] = (vf)ld512(row + c * 2 * L);
      continue;
    }
#endif
    vf x[NC];
    Lanes<T, NC>::load(row, x);
    for (int c = 0; c < NC; ++c) st.q[h * NC + c] = x[c] * scale;
  }
}

// One block of a decode item as the walk meets it: its first K and V rows in range (all kv
// heads) and how many.
template <typename T>
struct BlockRef {
  const T* k;
  const T* v;
  int64_t rows;
};

// A decode item: a sequence's new token (q rows at q, H = Hkv * G of them, stride q_s1) against
// its blocks walk[0 .. n) (block_size bs; rows of a key c_tok apart, kv heads c_head apart),
// written to out (stride o_s1). The walk goes on past this item to walk_end (the next items'
// blocks, which the last blocks of this one prefetch).
template <typename T, int NC>
void attend_decode(const BlockRef<T>* walk, int64_t n, const BlockRef<T>* walk_end, int64_t bs, int64_t c_tok,
                   int64_t c_head, int64_t Hkv, const T* q, int64_t q_s1, int64_t G, float scale, T* out,
                   int64_t o_s1, DecodeState& st) {
  constexpr int R = max_rows<NC>();
  const int64_t H = Hkv * G, ls = (bs + L - 1) / L * L, row_bytes = Hkv * c_head * sizeof(T);
  decode_init<T, NC>(q, q_s1, H, scale, ls, st);
  for (int64_t b = 0; b < n; ++b) {
    const BlockRef<T>* nb = walk + b + 1 < walk_end ? walk + b + 1 : nullptr;   // (2 ahead measured slower)
    for (int64_t h = 0; h < Hkv; ++h) {
      const int64_t slice = h * row_bytes / Hkv / 64 * 64, end = (h + 1) * row_bytes / Hkv / 64 * 64;
      for (int64_t g0 = 0; g0 < G; g0 += R) {
        Ahead<T> ahead{nullptr, nullptr, 0, end - slice};
        if (g0 == 0 && nb)
          ahead = {reinterpret_cast<const T*>(reinterpret_cast<const char*>(nb->k) + slice),
                   reinterpret_cast<const T*>(reinterpret_cast<const char*>(nb->v) + slice),
                   static_cast<int>(nb->rows), end - slice};
        with_rows<R>(static_cast<int>(std::min<int64_t>(R, G - g0)), [&](auto rows) {
          decode_rows<T, NC, decltype(rows)::value>(walk[b].k + h * c_head, walk[b].v + h * c_head, c_tok,
                                                  static_cast<int>(walk[b].rows), scale, h * G + g0, st, ls, ahead);
        });
      }
    }
  }
  for (int64_t r = 0; r < H; ++r) {
    const float inv = 1.f / sum16(st.l[r]);
    for (int c = 0; c < NC; ++c)
      for (int i = 0; i < L; ++i) out[r * o_s1 + Lanes<T, NC>::dim(c, i)] = static_cast<T>(st.acc[r * NC + c][i] * inv);
  }
}
