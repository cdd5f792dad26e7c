// PagedAttention's bf16 passes on CPUs with AVX512-BF16: part of paged_attention_cpu.cpp,
// included inside its anonymous namespace after paged_attention_common.h (vf, load16, reduce16,
// for_each_key, scores_in_place, Item), not compiled on its own.
#pragma once
#if defined(__AVX512BF16__)
// --- bf16 with AVX512-BF16 (head dims a multiple of 32) -------------------------------------------
// vdpbf16ps multiplies 32 bf16 pairs and adds each pair's sum to one of 16 fp32 lanes: q.k
// straight from the stored bf16 (no widening, half the instructions of fp32 multiply-adds).
// Prompt items also weight V this way (paged_attention_prompt.h).
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

#else
constexpr bool kDpBf16 = false;
#endif
