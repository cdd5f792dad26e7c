// PagedAttention's prompt items on CPU: part of paged_attention_cpu.cpp, included inside its
// anonymous namespace after paged_attention_common.h, paged_attention_bf16.h and the Buffers it
// fills (vf, load16, for_each_key, Item, weights, softmax_v; dp, ld512, u32_at), not compiled on
// its own.
//
// A prompt item (one sequence and kv head with qlen * G >= 16 query rows) copies its K once,
// transposed to fp32 [D, ld] (bf16 with AVX512-BF16: K and V into bf16 pairs), then takes its
// rows, the pairs (query position, head) in position order, RT at a time: a tile spans
// consecutive positions (SmolLM2, G = 3 and D = 64: two positions' three heads), so each vector
// of K or V loaded serves RT rows. A tile's two passes:
//   1. the scores of keys [lo of its first row, hi of its last] for all its rows, keys in lanes,
//      64 at a time (fewer where RT is large), the last step only the 16-key vectors left;
//   2. each row's softmax over its own keys [lo, hi], zero weights for the tile's other keys
//      (those only a later position sees, or before an earlier one's window), and the weighted
//      sum of V for all its rows at once (the zeros add nothing: each row's result is the one it
//      had on its own).
#pragma once

// Rows one prompt tile takes: RT * NC accumulator vectors, 24 (on AVX-512, 24 of its 32
// registers: its weighted sum of V in one pass; AVX2 builds take the same rows and sum V a few of
// a row's vectors at a time, softmax_v's column groups: forced AVX2 on Zen 4, the benchmark's
// prompts took 14.4 ms a layer with 24, 24.2 with 6, 17.6-18.1 with 36-48).
template <int NC>
constexpr int tile_rows() { return std::max(1, std::min(12, 24 / NC)); }

// A prompt tile's rows (the first RT of R): row r reads q[r], writes out[r] and sees keys
// [lo[r], hi[r]]; in position order, so lo[0] and hi[RT - 1] bound the tile's keys.
template <typename T, int R>
struct Tile {
  const T* q[R];
  T* out[R];
  int64_t lo[R], hi[R];
};

// f(t0, TK) for keys [a, b], TK vectors of 16 keys from t0: as many as RT rows' accumulators leave
// room for (up to 4), the last step only those left (kt and sc are padded past the context).
template <int RT, typename F>
inline void key_steps(int64_t a, int64_t b, F&& f) {
  constexpr int TK = std::max(1, std::min(4, kAccRegs / RT));
  int64_t t0 = a;
  for (; t0 + (TK - 1) * L <= b; t0 += TK * L) f(t0, std::integral_constant<int, TK>{});
  const int64_t left = (b + L - t0) / L;   // (vectors, 0 .. TK - 1)
  if constexpr (TK > 1) {
    if (left == 1) f(t0, std::integral_constant<int, 1>{});
  }
  if constexpr (TK > 2) {
    if (left == 2) f(t0, std::integral_constant<int, 2>{});
  }
  if constexpr (TK > 3) {
    if (left == 3) f(t0, std::integral_constant<int, 3>{});
  }
}

// Pass 1 from kt [D, ld], the item's K transposed to fp32: sc[r][t] for keys t in [a, b] (and on
// to the last step's end), q [RT][D] already scaled.
template <int NC, int RT>
void scores_tiled(const float* kt, int64_t ld, const float (*q)[NC * L], int64_t a, int64_t b,
                  float* const* sc) {
  key_steps<RT>(a, b, [&](int64_t t0, auto tk) {
    constexpr int TK = decltype(tk)::value;
    vf acc[RT][TK] = {};
    for (int d = 0; d < NC * L; ++d) {
      vf kx[TK];
      for (int i = 0; i < TK; ++i) kx[i] = load16(kt + d * ld + t0 + i * L);
      for (int r = 0; r < RT; ++r)
        for (int i = 0; i < TK; ++i) acc[r][i] += q[r][d] * kx[i];
    }
    for (int r = 0; r < RT; ++r)
      for (int i = 0; i < TK; ++i) store16(sc[r] + t0 + i * L, acc[r][i]);
  });
}

// Swaps the off-diagonal W x W blocks in each 2W x 2W block of x, 16 rows of 16 lanes (W = 8, 4, 2
// and 1 in turn transpose it: 64 two-vector shuffles for 256 values).
#if defined(LLMLAB_VF_PAIR)
inline void transpose16(vf (&x)[L]) {   // (AVX2: through memory, once per 16 keys of an item's K)
  alignas(32) float t[L][L];
  for (int i = 0; i < L; ++i) store16(t[i], x[i]);
  for (int i = 0; i < L; ++i) {
    alignas(32) float col[L];
    for (int j = 0; j < L; ++j) col[j] = t[j][i];
    x[i] = load16(col);
  }
}
#else
template <int W, size_t... I>
inline void swap_blocks(vf (&x)[L], std::index_sequence<I...>) {
  for (int i = 0; i < L; ++i)
    if (!(i & W)) {
      const vf a = x[i], b = x[i + W];
      x[i] = __builtin_shufflevector(a, b, ((I & W) ? L + I - W : I)...);
      x[i + W] = __builtin_shufflevector(a, b, ((I & W) ? L + I : I + W)...);
    }
}
inline void transpose16(vf (&x)[L]) {
  constexpr auto lanes = std::make_index_sequence<L>{};
  swap_blocks<8>(x, lanes);
  swap_blocks<4>(x, lanes);
  swap_blocks<2>(x, lanes);
  swap_blocks<1>(x, lanes);
}
#endif

// The item's keys [0, ctx) 16 at a time, transposed into kt [NV * 16, ld] (keys in lanes, zero past
// the context): row(key, c) gives vector c (of NV) of a key's row in the cache.
template <int NV, typename T, typename Row>
void transpose_keys(const Item<T>& it, int64_t ctx, int64_t ld, float* kt, Row&& row) {
  const T* rows[L];
  int n = 0;
  auto flush = [&](int64_t t0) {
    for (int c = 0; c < NV; ++c) {
      vf x[L];
      for (int i = 0; i < L; ++i) x[i] = i < n ? row(rows[i], c) : vf{};
      transpose16(x);
      for (int i = 0; i < L; ++i) store16(kt + (c * L + i) * ld + t0, x[i]);
    }
  };
  for_each_key(it.k, it.c_blk, it.c_tok, it.table, it.bs, 0, ctx - 1, [&](int64_t t, const T* r) {
    rows[n++] = r;
    if (n == L) {
      flush(t + 1 - L);
      n = 0;
    }
  });
  if (n) flush(ctx - n);
  const int64_t end = (ctx + L - 1) / L * L;
  for (int64_t d = 0; d < NV * L; ++d) std::fill(kt + d * ld + end, kt + (d + 1) * ld, 0.f);
}

// The item's K, transposed to fp32 [D, ld].
template <typename T, int NC>
void transpose_k(const Item<T>& it, int64_t ctx, int64_t ld, std::vector<float>& kt) {
  kt.resize(NC * L * ld);
  transpose_keys<NC>(it, ctx, ld, kt.data(), [](const T* row, int c) { return load16(row + c * L); });
}

#if defined(__AVX512BF16__)
// --- bf16 with AVX512-BF16: V is weighted by vdpbf16ps too, from pairs of keys (t, t+1) per dim,
// the softmax weights rounded to bf16 pairs (as flash attention kernels do; the sums stay fp32).

// Pass 1 from kt [D/2, ld]: the item's K as bf16 pairs (dims 2p, 2p+1) per key, keys in lanes.
template <int NC, int RT>
void scores_tiled_bf16(const uint32_t* kt, int64_t ld, const c10::BFloat16* const* qr, float scale,
                       int64_t a, int64_t b, float* const* sc) {
  key_steps<RT>(a, b, [&](int64_t t0, auto tk) {
    constexpr int TK = decltype(tk)::value;
    vf acc[RT][TK] = {};
    for (int p = 0; p < NC * L / 2; ++p) {
      __m512i kx[TK];
      for (int i = 0; i < TK; ++i) kx[i] = ld512(kt + p * ld + t0 + i * L);
      for (int r = 0; r < RT; ++r) {
        const __m512i qp = _mm512_set1_epi32(u32_at(qr[r] + 2 * p));
        for (int i = 0; i < TK; ++i) acc[r][i] = dp(acc[r][i], qp, kx[i]);
      }
    }
    for (int r = 0; r < RT; ++r)
      for (int i = 0; i < TK; ++i) store16(sc[r] + t0 + i * L, acc[r][i] * scale);
  });
}

// Pass 2 from vt [ld/2, D]: V as bf16 pairs of keys (t, t+1) per dim. Row r's weights (zero
// outside its keys [lo[r], hi[r]]) are rounded to bf16 into pb's row r (RT rows of ld) and summed
// in fp32 for the normaliser.
template <int NC, int RT>
void softmax_v_bf16(const uint32_t* vt, const int64_t* lo, const int64_t* hi, float* const* sc, uint16_t* pb,
                    int64_t ld, c10::BFloat16* const* out) {
  constexpr int D = NC * L;
  const int64_t a = lo[0] & ~int64_t{1}, b = hi[RT - 1] | 1;  // whole pairs [a, b]
  float inv[RT];
  for (int r = 0; r < RT; ++r) {
    float* s = sc[r];
    inv[r] = weights(s, a, b, lo[r], hi[r]);
    uint16_t* pr = pb + r * ld;
    for (int64_t t = a; t <= b; t += L)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + t), (__m256i)_mm512_cvtneps_pbh((__m512)load16(s + t)));
  }
  vf acc[RT][NC] = {};
  for (int64_t t = a; t <= b; t += 2) {
    const uint32_t* vr = vt + (t / 2) * D;
    __m512i vx[NC];
    for (int c = 0; c < NC; ++c) vx[c] = ld512(vr + c * L);
    for (int r = 0; r < RT; ++r) {
      const __m512i pp = _mm512_set1_epi32(u32_at(pb + r * ld + t));
      for (int c = 0; c < NC; ++c) acc[r][c] = dp(acc[r][c], pp, vx[c]);
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < NC; ++c)
      for (int i = 0; i < L; ++i) out[r][c * L + i] = static_cast<c10::BFloat16>(acc[r][c][i] * inv[r]);
}

// The item's K and V, bf16 pairs, for the tiled passes (zero past the context).
template <int NC>
void pack_bf16(const Item<c10::BFloat16>& it, int64_t ctx, int64_t ld, std::vector<uint32_t>& kt,
               std::vector<uint32_t>& vt) {
  constexpr int D = NC * L;
  kt.resize(D / 2 * ld);
  vt.assign(ld / 2 * D, 0u);
  transpose_keys<NC / 2>(it, ctx, ld, reinterpret_cast<float*>(kt.data()),   // (as bits: only moved)
                         [](const c10::BFloat16* row, int c) { return (vf)ld512(row + 2 * L * c); });
  // V: rows t, t+1 interleaved 16 dims at a time (row t alone, against zeros, for an odd tail)
  const c10::BFloat16* prev = nullptr;
  const __m512i lo16 = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                        39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi16 = _mm512_add_epi16(lo16, _mm512_set1_epi16(16));
  auto interleave = [&](int64_t pair, const c10::BFloat16* a, const c10::BFloat16* b) {
    uint32_t* dst = vt.data() + pair * D;
    for (int c = 0; c < D / 32; ++c) {
      const __m512i x = ld512(a + 32 * c), y = b ? ld512(b + 32 * c) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + 32 * c, _mm512_permutex2var_epi16(x, lo16, y));
      _mm512_storeu_si512(dst + 32 * c + 16, _mm512_permutex2var_epi16(x, hi16, y));
    }
  };
  for_each_key(it.v, it.c_blk, it.c_tok, it.table, it.bs, 0, ctx - 1, [&](int64_t t, const c10::BFloat16* row) {
    if (t & 1) interleave(t / 2, prev, row);
    prev = row;
  });
  if (ctx & 1) interleave(ctx / 2, prev, nullptr);
}
#endif

// One tile of RT rows: its two passes.
template <typename T, int NC, int RT, int R>
void prompt_tile(const Item<T>& it, const Tile<T, R>& tl, float scale, int64_t ld, Buffers& buf, float* const* sc) {
#if defined(__AVX512BF16__)
  if constexpr (dp_bf16<T, NC>()) {
    scores_tiled_bf16<NC, RT>(buf.kt2.data(), ld, tl.q, scale, tl.lo[0], tl.hi[RT - 1], sc);
    softmax_v_bf16<NC, RT>(buf.vt2.data(), tl.lo, tl.hi, sc, buf.pb.data(), ld, tl.out);
    return;
  }
#endif
  alignas(64) float q[RT][NC * L];
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < NC; ++c) store16(q[r] + c * L, load16(tl.q[r] + c * L) * scale);
  scores_tiled<NC, RT>(buf.kt.data(), ld, q, tl.lo[0], tl.hi[RT - 1], sc);
  softmax_v<T, NC, RT>(it, tl.lo, tl.hi, sc, tl.out);
}

// A prompt item (sequence s, kv head hkv): its qlen queries x G heads, in tiles of tile_rows<NC>()
// rows, with sc rows of ld floats (ld: the context rounded up to 16 keys, and 64 more).
template <typename T, int NC>
void attend_prompt(const Item<T>& it, const T* q, int64_t q_s0, int64_t q_s1, int64_t ctx, int64_t qlen,
                   int64_t q0, int64_t hkv, int64_t G, float scale, int64_t window, T* out, int64_t o_s0,
                   int64_t o_s1, int64_t ld, Buffers& buf, float* const* sc) {
  constexpr int R = tile_rows<NC>();
#if defined(__AVX512BF16__)
  if constexpr (dp_bf16<T, NC>()) {
    pack_bf16<NC>(it, ctx, ld, buf.kt2, buf.vt2);
    buf.pb.resize(R * ld + L);
  } else
#endif
    transpose_k<T, NC>(it, ctx, ld, buf.kt);
  for (int64_t r0 = 0; r0 < qlen * G; r0 += R) {
    const int rt = static_cast<int>(std::min<int64_t>(R, qlen * G - r0));
    Tile<T, R> tl;
    for (int r = 0; r < rt; ++r) {
      const int64_t j = (r0 + r) / G, h = hkv * G + (r0 + r) % G, pos = ctx - qlen + j;
      tl.q[r] = q + (q0 + j) * q_s0 + h * q_s1;
      tl.out[r] = out + (q0 + j) * o_s0 + h * o_s1;
      tl.lo[r] = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
      tl.hi[r] = pos;
    }
    with_rows<R>(rt, [&](auto rows) { prompt_tile<T, NC, decltype(rows)::value>(it, tl, scale, ld, buf, sc); });
  }
}
