// An fp32 or bf16 linear layer for decode-sized batches: y = x W^T (+ bias), AVX-512
// (bf16: AVX512-BF16's vdpbf16ps); fp32 also in AVX2 builds (the same panels, half a panel at a
// time, the same sums).
//
// A decode step multiplies a few dozen rows by every weight, and the weights do not stay in cache
// from one step to the next, so each product streams its weight from memory while it computes.
// oneDNN's prepacked product leaves that stream to the hardware prefetcher and waits on it; here
// the weight is packed once in panels of 32 output columns ([N/32][K][32], zero-padded), each
// panel is multiplied by all rows (row blocks of up to 12 rows x 32 columns in 24 vector
// accumulators; fp32 from 24 rows on: of up to 8), and while one panel is multiplied the next
// one is prefetched (into L2; fp32 chunks of 16+ rows into L1 too), spread evenly over the row
// blocks, so the memory streams the next panel while the FMA units work on this one. Rows
// beyond kChunk are taken in chunks of rows (each chunk streams the weight again).
//
// Accumulation is fp32 with fused multiply-adds, over k in order (0, 1, ..., K-1; bf16: in pairs
// of inputs, the result rounded once to bf16), so results differ from oneDNN's (another
// summation order) by rounding only. Any N and K; bias optional.
//
// Goto and van de Geijn, "Anatomy of High-Performance Matrix Multiplication" (ACM TOMS 2008),
// sec. 4-6 (panels, register blocks, streaming the larger operand); llmlab.kernels.panel_linear
// is the Python side, tests/test_panel_linear.py checks it against F.linear.
#include <torch/extension.h>
#include "cpu_math.h"
#include "entry_points.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__)
#define LLMLAB_PANEL 1
#define LLMLAB_PANEL_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define LLMLAB_PANEL 1  // fp32 only, each panel as two halves of 16 columns (AVX2: 16 registers)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kCols = 32;     // output columns per panel: two 16-float vectors
constexpr int kRowsMax = 12;      // rows per register block: 12 x 2 accumulators of 32
#ifdef LLMLAB_PANEL_AVX512
constexpr int kRowsFp32 = kRowsMax;
// fp32 products of at least kManyRows rows take register blocks of at most kRowsFp32Many rows:
// on AMD Zen 4 blocks of 5-8 rows ran at 112-115 GFLOP/s against 108-110 for blocks of 10-12
// (hot), and a 64-row decode step's products took 4 % less time cold; below 24 rows, where the
// product waits on the weight's stream, fewer passes over each panel did as well or better
// (docs/kernels.md, "Session 17").
constexpr int kRowsFp32Many = 8;
#else
constexpr int kRowsFp32 = 6;      // AVX2: 6 rows x 2 accumulators of 8 floats, a 16-column half at a time
constexpr int kRowsFp32Many = kRowsFp32;
#endif
constexpr int64_t kManyRows = 24;
constexpr int kRowsBf16 = 8;      // bf16: at most 8 (on Zen 4, 5-13 % faster than 12; docs/kernels.md)
constexpr int64_t kChunk = 96;    // rows per pass over the weight (their x stays in L2)
// fp32 products of at least this many rows prefetch the next panel into L1 as well (T0): there
// each panel's product is long enough to hide it, and it cut a 64-row step's products by 6-8 %
// on AMD Zen 4 (docs/kernels.md); fewer rows keep the L2 hint (T0 was 7-17 % slower at 1-8).
constexpr int64_t kRowsL1Prefetch = 16;

#ifdef LLMLAB_PANEL_AVX512
// One register block: y[R, cols] = x[R, K] . panel[K, 32] (+ bias); while it runs, the cache
// lines [pf, pf_end) are prefetched (Hint: into L2, or L1 too), spread evenly over its K/2 steps.
// m0, m1: which of the 16 + 16 columns exist (bit c: column c).
template <int R, int Hint = _MM_HINT_T1>
void block(const float* __restrict x, int64_t K, const float* __restrict panel, float* __restrict y,
           int64_t ldy, const float* __restrict bias, uint16_t m0, uint16_t m1, const char* pf,
           const char* pf_end) {
  __m512 a0[R], a1[R];
  for (int r = 0; r < R; ++r) { a0[r] = _mm512_setzero_ps(); a1[r] = _mm512_setzero_ps(); }
  const int64_t steps = std::max<int64_t>(1, K / 2), lines = (pf_end - pf) / 64;
  int64_t due = 0;  // lines owed, in units of 1/steps
  int64_t k = 0;
  for (; k + 1 < K; k += 2) {
    for (due += lines; due >= steps; due -= steps) { _mm_prefetch(pf, static_cast<_mm_hint>(Hint)); pf += 64; }
    const float* w = panel + k * kCols;
    const __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16);
    const __m512 w2 = _mm512_loadu_ps(w + 32), w3 = _mm512_loadu_ps(w + 48);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512 b = _mm512_set1_ps(x[r * K + k]);
      a0[r] = _mm512_fmadd_ps(b, w0, a0[r]);
      a1[r] = _mm512_fmadd_ps(b, w1, a1[r]);
      const __m512 c = _mm512_set1_ps(x[r * K + k + 1]);
      a0[r] = _mm512_fmadd_ps(c, w2, a0[r]);
      a1[r] = _mm512_fmadd_ps(c, w3, a1[r]);
    }
  }
  if (k < K) {  // odd K: the last input
    const __m512 w0 = _mm512_loadu_ps(panel + k * kCols), w1 = _mm512_loadu_ps(panel + k * kCols + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 b = _mm512_set1_ps(x[r * K + k]);
      a0[r] = _mm512_fmadd_ps(b, w0, a0[r]);
      a1[r] = _mm512_fmadd_ps(b, w1, a1[r]);
    }
  }
  if (bias) {
    const __m512 b0 = _mm512_maskz_loadu_ps(m0, bias), b1 = _mm512_maskz_loadu_ps(m1, bias + 16);
    for (int r = 0; r < R; ++r) { a0[r] = _mm512_add_ps(a0[r], b0); a1[r] = _mm512_add_ps(a1[r], b1); }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_ps(y + r * ldy, m0, a0[r]);
    _mm512_mask_storeu_ps(y + r * ldy + 16, m1, a1[r]);
  }
}

#elif defined(LLMLAB_PANEL)
// AVX2: the same register block, its 32 columns taken as two halves of 16 (2R accumulators of 8
// floats, the two weight vectors and a broadcast fit the 16 registers at R <= 6): each half
// reads its own 64 bytes of every 128-byte panel row, over k in the same order, so the sums (and
// the outputs) equal the AVX-512 block's bit for bit. Prefetch spread over both halves' K steps.
inline __m256i lanes8(unsigned m) {  // bit i of m -> lane i all ones
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(m)), bit), bit);
}

inline void store8(float* y, unsigned m, __m256 v) {
  if (m == 0xFF) _mm256_storeu_ps(y, v);
  else if (m) _mm256_maskstore_ps(y, lanes8(m), v);
}

template <int R, int Hint = _MM_HINT_T1>
void block(const float* __restrict x, int64_t K, const float* __restrict panel, float* __restrict y,
           int64_t ldy, const float* __restrict bias, uint16_t m0, uint16_t m1, const char* pf,
           const char* pf_end) {
  const int64_t steps = std::max<int64_t>(1, 2 * K), lines = (pf_end - pf) / 64;
  int64_t due = 0;  // lines owed, in units of 1/steps
  for (int h = 0; h < 2; ++h) {
    const unsigned m = h ? m1 : m0;
    if (m == 0) break;  // (the last panel: no column in this half)
    const float* w = panel + 16 * h;
    __m256 a0[R], a1[R];
    for (int r = 0; r < R; ++r) { a0[r] = _mm256_setzero_ps(); a1[r] = _mm256_setzero_ps(); }
    for (int64_t k = 0; k < K; ++k, w += kCols) {
      for (due += lines; due >= steps; due -= steps) { _mm_prefetch(pf, static_cast<_mm_hint>(Hint)); pf += 64; }
      const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r) {
        const __m256 b = _mm256_broadcast_ss(x + r * K + k);
        a0[r] = _mm256_fmadd_ps(b, w0, a0[r]);
        a1[r] = _mm256_fmadd_ps(b, w1, a1[r]);
      }
    }
    if (bias) {
      const __m256 b0 = _mm256_maskload_ps(bias + 16 * h, lanes8(m & 0xFF));
      const __m256 b1 = _mm256_maskload_ps(bias + 16 * h + 8, lanes8(m >> 8));
      for (int r = 0; r < R; ++r) { a0[r] = _mm256_add_ps(a0[r], b0); a1[r] = _mm256_add_ps(a1[r], b1); }
    }
    for (int r = 0; r < R; ++r) {
      store8(y + r * ldy + 16 * h, m & 0xFF, a0[r]);
      store8(y + r * ldy + 16 * h + 8, m >> 8, a1[r]);
    }
  }
}
#endif

#ifdef LLMLAB_PANEL
using Block = void (*)(const float*, int64_t, const float*, float*, int64_t, const float*, uint16_t,
                       uint16_t, const char*, const char*);
constexpr int T0 = _MM_HINT_T0;
#ifdef LLMLAB_PANEL_AVX512
constexpr Block kBlocks[kRowsMax + 1] = {nullptr,   block<1>, block<2>, block<3>,  block<4>,  block<5>, block<6>,
                                         block<7>,  block<8>, block<9>, block<10>, block<11>, block<12>};
constexpr Block kBlocksL1[kRowsMax + 1] = {
    nullptr,          block<1, T0>, block<2, T0>, block<3, T0>,  block<4, T0>,  block<5, T0>, block<6, T0>,
    block<7, T0>,     block<8, T0>, block<9, T0>, block<10, T0>, block<11, T0>, block<12, T0>};
#else
constexpr Block kBlocks[kRowsFp32 + 1] = {nullptr, block<1>, block<2>, block<3>, block<4>, block<5>, block<6>};
constexpr Block kBlocksL1[kRowsFp32 + 1] = {nullptr,      block<1, T0>, block<2, T0>, block<3, T0>,
                                            block<4, T0>, block<5, T0>, block<6, T0>};
#endif
#endif

#if defined(LLMLAB_PANEL_AVX512) && defined(__AVX512BF16__)
#define LLMLAB_PANEL_BF16 1
// bf16: a panel holds the inputs in pairs ([K/2][32][2], then for odd K the last input's 32
// weights alone), so one vdpbf16ps multiplies a row's input pair (broadcast as one 32-bit word)
// by 16 columns' weight pairs and adds both products to 16 fp32 accumulators; the sums are fp32
// and the result is rounded once to bf16.
inline __m512 dot2(__m512 acc, __m512i x, __m512i w) {
  return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w);
}

inline __m512 to_fp32(__m256i h) {  // 16 bf16 -> 16 fp32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline __m512i widen(const uint16_t* h) {  // 16 bf16 -> 16 pairs (bf16, 0)
  return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
}

inline __m512 round_bf16(__m512 v) { return to_fp32((__m256i)_mm512_cvtneps_pbh(v)); }  // v as bf16 holds it

// SwiGLU's epilogue (panel = 16 gate columns, then the same 16 up columns): silu(gate) * up, each
// step rounded to bf16 as the unfused path rounds it (the product's outputs, then silu, then the
// product: fused_ops_cpu.cpp's silu_mul), 16 outputs.
inline __m512 swiglu16(__m512 gate, __m512 up) {
  alignas(64) float g[16], s[16];
  _mm512_store_ps(g, round_bf16(gate));
#pragma omp simd
  for (int i = 0; i < 16; ++i) {
    const float x = g[i];                           // sigmoid from exp(-|x|) <= 1
    const float e = llmlab_cpu::exp_f(x < 0.f ? x : -x);
    s[i] = x * ((x < 0.f ? e : 1.f) / (1.f + e));
  }
  return _mm512_mul_ps(round_bf16(_mm512_load_ps(s)), round_bf16(up));
}

template <int R, bool SWIGLU = false>
void block_bf16(const uint16_t* __restrict x, int64_t K, const uint16_t* __restrict panel,
                uint16_t* __restrict y, int64_t ldy, const uint16_t* __restrict bias, __mmask16 m0,
                __mmask16 m1, const char* pf, const char* pf_end) {
  __m512 a0[R], a1[R];
  for (int r = 0; r < R; ++r) { a0[r] = _mm512_setzero_ps(); a1[r] = _mm512_setzero_ps(); }
  const int64_t K2 = K / 2, steps = std::max<int64_t>(1, K2), lines = (pf_end - pf) / 64;
  int64_t due = 0;  // lines owed, in units of 1/steps
  for (int64_t j = 0; j < K2; ++j) {
    for (due += lines; due >= steps; due -= steps) { _mm_prefetch(pf, _MM_HINT_T1); pf += 64; }
    const __m512i w0 = _mm512_loadu_si512(panel + j * 2 * kCols);
    const __m512i w1 = _mm512_loadu_si512(panel + j * 2 * kCols + kCols);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512i b = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x + r * K + 2 * j));
      a0[r] = dot2(a0[r], b, w0);
      a1[r] = dot2(a1[r], b, w1);
    }
  }
  if (K % 2) {  // odd K: the last input and its weights, each paired with a zero
    const __m512i w0 = widen(panel + (K - 1) * kCols), w1 = widen(panel + (K - 1) * kCols + 16);
    for (int r = 0; r < R; ++r) {
      const __m512i b = _mm512_set1_epi32(static_cast<int32_t>(x[r * K + K - 1]));
      a0[r] = dot2(a0[r], b, w0);
      a1[r] = dot2(a1[r], b, w1);
    }
  }
  if (bias) {  // bf16 -> fp32: the 16 bits on top of a zero mantissa tail
    const __m512 b0 = to_fp32(_mm256_maskz_loadu_epi16(m0, bias));
    const __m512 b1 = to_fp32(_mm256_maskz_loadu_epi16(m1, bias + 16));
    for (int r = 0; r < R; ++r) { a0[r] = _mm512_add_ps(a0[r], b0); a1[r] = _mm512_add_ps(a1[r], b1); }
  }
  if constexpr (SWIGLU) {
    for (int r = 0; r < R; ++r)
      _mm256_mask_storeu_epi16(y + r * ldy, m0, (__m256i)_mm512_cvtneps_pbh(swiglu16(a0[r], a1[r])));
    return;
  }
  for (int r = 0; r < R; ++r) {  // round to nearest even, as oneDNN's bf16 product
    _mm256_mask_storeu_epi16(y + r * ldy, m0, (__m256i)_mm512_cvtneps_pbh(a0[r]));
    _mm256_mask_storeu_epi16(y + r * ldy + 16, m1, (__m256i)_mm512_cvtneps_pbh(a1[r]));
  }
}

using BlockBf16 = void (*)(const uint16_t*, int64_t, const uint16_t*, uint16_t*, int64_t, const uint16_t*,
                           __mmask16, __mmask16, const char*, const char*);
constexpr BlockBf16 kBlocksBf16[kRowsMax + 1] = {
    nullptr,       block_bf16<1>, block_bf16<2>, block_bf16<3>,  block_bf16<4>,  block_bf16<5>, block_bf16<6>,
    block_bf16<7>, block_bf16<8>, block_bf16<9>, block_bf16<10>, block_bf16<11>, block_bf16<12>};
constexpr BlockBf16 kBlocksSwiglu[kRowsMax + 1] = {
    nullptr,
    block_bf16<1, true>,
    block_bf16<2, true>,
    block_bf16<3, true>,
    block_bf16<4, true>,
    block_bf16<5, true>,
    block_bf16<6, true>,
    block_bf16<7, true>,
    block_bf16<8, true>,
    nullptr,
    nullptr,
    nullptr,
    nullptr};
#endif

#ifdef LLMLAB_PANEL
// Rows [0, M) of one chunk in register blocks of at most rows_max, panels [p0, p1) of the weight
// (``panel`` elements each); the next panel of the range is prefetched while each one is
// multiplied. T: float or bf16 bits.
template <typename T, typename Block>
void chunk(const Block* blocks, int rows_max, const T* x, int64_t M, int64_t K, const T* W, int64_t panel,
           int64_t N, const T* bias, T* y, int64_t p0, int64_t p1, int64_t out_cols = kCols) {
  const int64_t panel_bytes = panel * static_cast<int64_t>(sizeof(T)), nb = (M + rows_max - 1) / rows_max;
  const int64_t lines_per_block = (panel_bytes / 64 + nb - 1) / nb;
  for (int64_t p = p0; p < p1; ++p) {
    const T* w = W + p * panel;
    const char* next = reinterpret_cast<const char*>(w + panel);
    const char* next_end = p + 1 < p1 ? next + panel_bytes : next;
    const int64_t cols = std::min(out_cols, N - p * out_cols);  // (out_cols 16: SwiGLU's outputs)
    const uint16_t m0 = cols >= 16 ? 0xFFFF : static_cast<uint16_t>((1u << cols) - 1);
    const uint16_t m1 = cols >= 32 ? 0xFFFF : (cols <= 16 ? 0 : static_cast<uint16_t>((1u << (cols - 16)) - 1));
    int64_t m = 0;
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t rows = (M - m + (nb - b) - 1) / (nb - b);  // blocks of even size
      const char* s = std::min(next_end, next + b * lines_per_block * 64);
      const char* e = std::min(next_end, s + lines_per_block * 64);
      blocks[rows](x + m * K, K, w, y + m * N + p * out_cols, N, bias ? bias + p * kCols : nullptr, m0, m1, s, e);
      m += rows;
    }
  }
}

// y [M, N] = the product of x [M, K] and the panels [P, K, 32] (blocks: the register blocks'
// kernels, rows_max rows at most; out_cols outputs a panel), panels split among the threads and
// rows taken kChunk at a time.
template <typename T, typename Block>
void run(const Block* blocks, int rows_max, const T* X, int64_t M, int64_t K, const T* W, int64_t P, int64_t N,
         const T* B, T* Y, int64_t out_cols = kCols) {
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t m = 0; m < M; m += kChunk)
      chunk(blocks, rows_max, X + m * K, std::min(kChunk, M - m), K, W, K * kCols, N, B, Y + m * N, p0, p1,
            out_cols);
  });
}

#endif

const char* name(at::ScalarType t) { return t == at::kFloat ? "fp32" : t == at::kBFloat16 ? "bf16" : "other"; }

}  // namespace

// weight [N, K] -> panels [ceil(N/32), K, 32], zero beyond N. fp32: panel p row k holds
// W[p*32 + c, k] at c. bf16: rows 2j and 2j+1 hold the pairs (W[p*32 + c, 2j], W[p*32 + c, 2j+1])
// at 2c and 2c+1; for odd K, row K-1 holds W[p*32 + c, K-1] at c.
torch::Tensor pack(torch::Tensor w) {
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && w.numel() > 0 &&
                  (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "panel_linear: the weight must be a non-empty fp32 or bf16 CPU tensor [out, in], got ",
              w.scalar_type(), " ", w.sizes(), " on ", w.device());
  const int64_t N = w.size(0), K = w.size(1), P = (N + kCols - 1) / kCols;
  auto padded = torch::zeros({P * kCols, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  auto by_col = padded.view({P, kCols, K});
  if (w.scalar_type() == at::kFloat) return by_col.transpose(1, 2).contiguous();
  const int64_t Ke = K - K % 2;
  auto pairs = by_col.narrow(2, 0, Ke).reshape({P, kCols, Ke / 2, 2}).permute({0, 2, 1, 3}).reshape({P, Ke, kCols});
  if (K % 2 == 0) return pairs.contiguous();
  return torch::cat({pairs, by_col.narrow(2, Ke, 1).transpose(1, 2)}, 1).contiguous();
}

// x [M, K] (the weight's dtype), panels [P, K, 32] from pack(), N (<= P*32) outputs, bias [N] or
// None -> y [M, N] in x's dtype.
torch::Tensor linear(torch::Tensor x, torch::Tensor panels, int64_t N, c10::optional<torch::Tensor> bias) {
  const auto dt = panels.scalar_type();
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kCols && panels.is_contiguous() &&
                  (dt == at::kFloat || dt == at::kBFloat16),
              "panel_linear: the weight must come from pack()");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == dt,
              "panel_linear: x must be a CPU tensor [rows, in] in the weight's dtype (", name(dt), "), got ",
              x.scalar_type(), " ", x.sizes(), " on ", x.device());
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  TORCH_CHECK(K == panels.size(1), "panel_linear: x has ", K, " features, the weight ", panels.size(1));
  TORCH_CHECK(N > (P - 1) * kCols && N <= P * kCols, "panel_linear: ", N, " outputs do not match ", P, " panels");
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == dt && b.dim() == 1 && b.numel() == N, "panel_linear: bias must be ", name(dt), " [",
                N, "], got ", b.scalar_type(), " ", b.sizes());
  }
  auto xc = x.contiguous();
  auto y = torch::empty({M, N}, x.options());
  if (dt == at::kFloat) {
#ifdef LLMLAB_PANEL
    if (M == 0) return y;
    const float* X = xc.data_ptr<float>();
    const float* W = panels.data_ptr<float>();
    const float* B = b.defined() ? b.data_ptr<float>() : nullptr;
    float* Y = y.data_ptr<float>();
    run(M >= kRowsL1Prefetch ? kBlocksL1 : kBlocks, M >= kManyRows ? kRowsFp32Many : kRowsFp32, X, M, K, W, P, N, B,
        Y);
    return y;
#else
    TORCH_CHECK(false, "panel_linear: this build has no AVX2 or AVX-512 (built for ", llmlab_cpu::compiled_isa(), ")");
#endif
  }
#ifdef LLMLAB_PANEL_BF16
  if (M == 0) return y;
  auto bits = [](const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); };
  const uint16_t* X = bits(xc);
  const uint16_t* W = bits(panels);
  const uint16_t* B = b.defined() ? bits(b) : nullptr;
  uint16_t* Y = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  run(kBlocksBf16, kRowsBf16, X, M, K, W, P, N, B, Y);
  return y;
#else
  TORCH_CHECK(false, "panel_linear: this build has no AVX512-BF16 (built for ", llmlab_cpu::compiled_isa(), ")");
  return torch::Tensor();
#endif
}

// SwiGLU after a gate/up product: x [M, K] bf16, panels [ceil(I/16), K, 32] from pack() of the
// gate/up weight interleaved in groups of 16 rows (16 gate rows, the same 16 up rows, ...) ->
// silu(x gate^T) * (x up^T) [M, I] bf16, rounded as the unfused product and silu_mul round it.
torch::Tensor linear_swiglu(torch::Tensor x, torch::Tensor panels, int64_t I) {
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kCols && panels.is_contiguous() &&
                  panels.scalar_type() == at::kBFloat16,
              "panel_linear: the SwiGLU weight must come from pack() of the interleaved bf16 gate/up weight");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kBFloat16,
              "panel_linear: x must be a bf16 CPU tensor [rows, in], got ", x.scalar_type(), " ", x.sizes());
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  TORCH_CHECK(K == panels.size(1), "panel_linear: x has ", K, " features, the weight ", panels.size(1));
  TORCH_CHECK(I > (P - 1) * 16 && I <= P * 16, "panel_linear: ", I, " SwiGLU outputs do not match ", P, " panels");
  auto xc = x.contiguous();
  auto y = torch::empty({M, I}, x.options());
#ifdef LLMLAB_PANEL_BF16
  if (M == 0) return y;
  const uint16_t* X = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const uint16_t* W = reinterpret_cast<const uint16_t*>(panels.data_ptr<at::BFloat16>());
  uint16_t* Y = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  run(kBlocksSwiglu, kRowsBf16, X, M, K, W, P, I, static_cast<const uint16_t*>(nullptr), Y, 16);
  return y;
#else
  TORCH_CHECK(false, "panel_linear: this build has no AVX512-BF16 (built for ", llmlab_cpu::compiled_isa(), ")");
  return torch::Tensor();
#endif
}

bool has_fp32() {
#ifdef LLMLAB_PANEL
  return true;
#else
  return false;
#endif
}

bool has_bf16() {
#ifdef LLMLAB_PANEL_BF16
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("entry_points", [] {
    using namespace llmlab_entry;
    return pybind11::make_tuple(export_fn<Linear>(&linear, kLinear),
                                export_fn<LinearSwiglu>(&linear_swiglu, kLinearSwiglu));
  }, "(linear, linear_swiglu) as capsules for the decode stack (entry_points.h)");
  m.def("pack", &pack, "an fp32 or bf16 weight [out, in] in panels of 32 outputs (panel_linear_cpu.cpp)");
  m.def("linear", &linear, "x [rows, in] times a packed weight of its dtype, + bias (panel_linear_cpu.cpp)");
  m.def("has_fp32", &has_fp32, "whether this build has the fp32 kernel: AVX2 or AVX-512 (panel_linear_cpu.cpp)");
  m.def("linear_swiglu", &linear_swiglu,
        "silu(x gate^T) * (x up^T) from the interleaved bf16 gate/up panels (panel_linear_cpu.cpp)");
  m.def("has_bf16", &has_bf16, "whether this build has the bf16 AVX512-BF16 kernel (panel_linear_cpu.cpp)");
  m.def("isa", [] { return std::string(llmlab_cpu::compiled_isa()); },
        "the vector code this build uses (cpu_math.h)");
}
