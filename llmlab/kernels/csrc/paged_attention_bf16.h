// PagedAttention's bf16 passes on CPUs with AVX512-BF16: part of paged_attention_cpu.cpp,
// included inside its anonymous namespace after paged_attention_common.h (vf, load16, reduce16,
// max_of, exp_sum, for_each_key, scores_in_place, Item), not compiled on its own.
#pragma once
#if defined(__AVX512BF16__)
// --- bf16 with AVX512-BF16 (head dims a multiple of 32) -------------------------------------------
// vdpbf16ps multiplies 32 bf16 pairs and adds each pair's sum to one of 16 fp32 lanes: q.k
// straight from the stored bf16 (no widening, half the instructions of fp32 multiply-adds).
// Prompt items also weight V this way: V copied once into pairs of keys (t, t+1) per dim, and
// the softmax weights rounded to bf16 pairs (as flash attention kernels do; the sums stay fp32).
constexpr bool kDpBf16 = true;
inline vf dp(vf acc, __m512i a, __m512i b) {
  return (vf)_mm512_dpbf16_ps((__m512)acc, (__m512bh)a, (__m512bh)b);
}
inline __m512i ld512(const void* p) { return _mm512_loadu_si512(p); }
inline uint32_t u32_at(const void* p) {
  uint32_t x;
  std::memcpy(&x, p, 4);
  return x;
}

// Pass 1 from K rows read in place, for bf16: sc[r][t] = scale * q_r . k_t (scores_in_place).
template <int NC, int RT>
void scores_direct_bf16(const Item<c10::BFloat16>& it, const c10::BFloat16* const* qr, float scale,
                        int64_t lo, int64_t hi, float* const* sc) {
  constexpr int NP = NC / 2;                                   // 32-value vectors per row
  __m512i q[RT][NP];
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < NP; ++c) q[r][c] = ld512(qr[r] + c * 2 * L);
  scores_in_place<RT>(it, lo, hi, scale, NC * L * sizeof(c10::BFloat16), sc,
                      [&](const c10::BFloat16* row, vf (&part)[RT][L], int n) {
    __m512i kx[NP];
    for (int c = 0; c < NP; ++c) kx[c] = ld512(row + c * 2 * L);
    for (int r = 0; r < RT; ++r) {
      vf p = dp(vf{}, q[r][0], kx[0]);
      for (int c = 1; c < NP; ++c) p = dp(p, q[r][c], kx[c]);
      part[r][n] = p;
    }
  });
}

// Pass 1 from kt [D/2, ld]: the item's K as bf16 pairs (dims 2p, 2p+1) per key, keys in lanes;
// tiles of 64 keys (kt is padded past the end).
template <int NC, int RT>
void scores_tiled_bf16(const uint32_t* kt, int64_t ld, const c10::BFloat16* const* qr, float scale,
                       int64_t lo, int64_t hi, float* const* sc) {
  constexpr int TK = 4;
  for (int64_t t0 = lo; t0 <= hi; t0 += TK * L) {
    vf acc[RT][TK] = {};
    for (int p = 0; p < NC * L / 2; ++p) {
      const uint32_t* kr = kt + p * ld + t0;
      __m512i kx[TK];
      for (int i = 0; i < TK; ++i) kx[i] = ld512(kr + i * L);
      for (int r = 0; r < RT; ++r) {
        const __m512i qp = _mm512_set1_epi32(u32_at(qr[r] + 2 * p));
        for (int i = 0; i < TK; ++i) acc[r][i] = dp(acc[r][i], qp, kx[i]);
      }
    }
    const int64_t n = std::min<int64_t>(TK * L, hi + 1 - t0);
    for (int r = 0; r < RT; ++r)
      for (int i = 0; i < TK; ++i) acc[r][i] *= scale;
    for (int r = 0; r < RT; ++r) std::memcpy(sc[r] + t0, acc[r], n * sizeof(float));
  }
}

// Pass 2 from vt [ld/2, D]: V as bf16 pairs of keys (t, t+1) per dim. The weights exp(s - max)
// are rounded to bf16 (into pb, RT rows of ld) and summed in fp32 for the normaliser.
template <int NC, int RT>
void softmax_v_bf16(const uint32_t* vt, int64_t lo, int64_t hi, float* const* sc, uint16_t* pb,
                    int64_t ld, c10::BFloat16* const* out) {
  constexpr int D = NC * L;
  const int64_t a = lo & ~int64_t{1}, b = hi | 1;             // whole pairs [a, b]
  float inv[RT];
  for (int r = 0; r < RT; ++r) {
    float* s = sc[r];
    inv[r] = 1.f / exp_sum(s, lo, hi, max_of(s + lo, hi + 1 - lo));
    if (a < lo) s[a] = 0.f;
    if (b > hi) s[b] = 0.f;
    uint16_t* pr = pb + r * ld;
    for (int64_t t = a; t <= b; t += L)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + t),
                          (__m256i)_mm512_cvtneps_pbh((__m512)load16(s + t)));
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
  kt.assign(D / 2 * ld, 0u);
  vt.assign(ld / 2 * D, 0u);
  uint32_t* k = kt.data();
  for_each_key(it.k, it.c_blk, it.c_tok, it.table, it.bs, 0, ctx - 1, [&](int64_t t, const c10::BFloat16* row) {
    for (int p = 0; p < D / 2; ++p) k[p * ld + t] = u32_at(row + 2 * p);
  });
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
#else
constexpr bool kDpBf16 = false;
#endif
