// A bf16 linear layer for decode-sized batches (1-48 rows) on Intel AMX tiles: y = x W^T.
//
// In a decode step the product reads the whole weight for a few dozen rows, so its speed is
// how fast the weight streams from memory. The weight is packed once into the tiles' own layout
// (B operands of TDPBF16PS: per 16 output columns and 32 inputs, 16 rows of 16 column pairs, one
// contiguous 1 KB tile), the rows of x are packed per step into A tiles (16 rows x 32 inputs),
// and each weight tile is loaded once for all row blocks, with a software prefetch running
// ahead of it. Accumulation is fp32 in the C tiles (the K sum in blocks of 32, in order); the
// result is rounded once to bf16 (round to nearest even), as oneDNN's bf16 product rounds it.
//
// Intel, "Intel Architecture Instruction Set Extensions Programming Reference", ch. 3 (AMX);
// llmlab.kernels.amx_linear is the Python side (which CPUs, which shapes), tests/test_amx_linear.py
// checks it against F.linear.
#include <torch/extension.h>
#include "cpu_math.h"
#include <ATen/Parallel.h>
#include <cstdint>
#include <cstring>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define LLMLAB_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t kRows = 48;        // row blocks of 16: three A tiles, 3 x 2 C tiles
constexpr int64_t kPrefetch = 2048;  // bytes of the weight stream fetched ahead of the tile loads

#ifdef LLMLAB_AMX
struct TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// The kernel asks Linux for the tile state once per process (ARCH_REQ_XCOMP_PERM, XTILEDATA).
bool tiles_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

// C tiles 0..MB*2-1 (row block m, column block n at 2m+n) += A (tile 6) x B (tile 7), over KB
// blocks of 32 inputs; then stored to cb [MB*2][16][16] fp32.
template <int MB>
void tile_pair(const uint16_t* xp, int64_t KB, const uint16_t* w, float* cb) {
  _tile_zero(0); _tile_zero(1);
  if (MB > 1) { _tile_zero(2); _tile_zero(3); }
  if (MB > 2) { _tile_zero(4); _tile_zero(5); }
  for (int64_t kb = 0; kb < KB; ++kb) {
    for (int n = 0; n < 2; ++n) {
      const char* b = reinterpret_cast<const char*>(w + (n * KB + kb) * 512);
      for (int line = 0; line < 1024; line += 64) _mm_prefetch(b + kPrefetch + line, _MM_HINT_T0);
      _tile_loadd(7, b, 64);
      _tile_loadd(6, xp + kb * 512, 64);
      if (n == 0) _tile_dpbf16ps(0, 6, 7); else _tile_dpbf16ps(1, 6, 7);
      if (MB > 1) {
        _tile_loadd(6, xp + (KB + kb) * 512, 64);
        if (n == 0) _tile_dpbf16ps(2, 6, 7); else _tile_dpbf16ps(3, 6, 7);
      }
      if (MB > 2) {
        _tile_loadd(6, xp + (2 * KB + kb) * 512, 64);
        if (n == 0) _tile_dpbf16ps(4, 6, 7); else _tile_dpbf16ps(5, 6, 7);
      }
    }
  }
  _tile_stored(0, cb, 64); _tile_stored(1, cb + 256, 64);
  if (MB > 1) { _tile_stored(2, cb + 512, 64); _tile_stored(3, cb + 768, 64); }
  if (MB > 2) { _tile_stored(4, cb + 1024, 64); _tile_stored(5, cb + 1280, 64); }
}
#endif

void check_weight(const torch::Tensor& w) {
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && w.scalar_type() == at::kBFloat16,
              "amx_linear: the weight must be a bf16 CPU tensor [out, in]");
  TORCH_CHECK(w.size(0) % 32 == 0 && w.size(1) % 32 == 0 && w.size(0) > 0 && w.size(1) > 0,
              "amx_linear: out and in features must be multiples of 32, got [", w.size(0), ", ", w.size(1), "]");
}

}  // namespace

// weight [N, K] bf16 -> its tiles [N/16, K/32, 16, 16, 2]: tile (nb, kb) row p holds
// W[nb*16 + c, kb*32 + 2p + j] at column c, pair j (the VNNI layout of TDPBF16PS's B operand).
torch::Tensor pack(torch::Tensor w) {
  check_weight(w);
  const int64_t N = w.size(0), K = w.size(1);
  return w.view({N / 16, 16, K / 32, 16, 2}).permute({0, 2, 3, 1, 4}).contiguous();
}

// x [M, K] bf16 (1 <= M <= 48), packed [N/16, K/32, 16, 16, 2] -> y [M, N] bf16.
torch::Tensor linear(torch::Tensor x, torch::Tensor packed) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kBFloat16,
              "amx_linear: x must be a bf16 CPU tensor [rows, in]");
  TORCH_CHECK(packed.dim() == 5 && packed.size(3) == 16 && packed.size(4) == 2 && packed.is_contiguous() &&
                  packed.scalar_type() == at::kBFloat16,
              "amx_linear: the weight must come from pack()");
  const int64_t M = x.size(0), K = x.size(1), KB = packed.size(1), NB = packed.size(0), N = NB * 16;
  TORCH_CHECK(K == KB * 32, "amx_linear: x has ", K, " features, the weight ", KB * 32);
  TORCH_CHECK(M >= 1 && M <= kRows, "amx_linear: takes 1 to ", kRows, " rows, got ", M);
#ifdef LLMLAB_AMX
  TORCH_CHECK(tiles_permitted(), "amx_linear: Linux refused this process the AMX tile state");
  const int64_t MB = (M + 15) / 16;
  // x's rows as A tiles [MB, KB, 16, 32], zero rows below M
  auto xp = torch::zeros({MB * 16, K}, x.options());
  xp.narrow(0, 0, M).copy_(x);
  xp = xp.view({MB, 16, KB, 32}).permute({0, 2, 1, 3}).contiguous();
  auto y = torch::empty({M, N}, x.options());
  const auto* X = reinterpret_cast<const uint16_t*>(xp.data_ptr());
  const auto* W = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  auto* Y = reinterpret_cast<uint16_t*>(y.data_ptr());
  at::parallel_for(0, NB / 2, 4, [&](int64_t begin, int64_t end) {
    TileConfig cfg;
    std::memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
    _tile_loadconfig(&cfg);
    alignas(64) float cb[6 * 256];
    for (int64_t pair = begin; pair < end; ++pair) {
      const uint16_t* w = W + pair * 2 * KB * 512;
      if (MB == 1) tile_pair<1>(X, KB, w, cb);
      else if (MB == 2) tile_pair<2>(X, KB, w, cb);
      else tile_pair<3>(X, KB, w, cb);
      for (int n = 0; n < 2; ++n)
        for (int64_t m = 0; m < M; ++m) {
          const __m256bh v = _mm512_cvtneps_pbh(_mm512_load_ps(cb + ((m / 16) * 2 + n) * 256 + (m % 16) * 16));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(Y + m * N + (pair * 2 + n) * 16), (__m256i)v);
        }
    }
    _tile_release();
  });
  return y;
#else
  TORCH_CHECK(false, "amx_linear: this build has no AMX (built for ", llmlab_cpu::compiled_isa(), ")");
  return torch::Tensor();
#endif
}

bool has_amx() {
#ifdef LLMLAB_AMX
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "a bf16 weight [out, in] in AMX tiles (amx_linear_cpu.cpp)");
  m.def("linear", &linear, "x [rows <= 48, in] times a packed weight, bf16 (amx_linear_cpu.cpp)");
  m.def("has_amx", &has_amx, "whether this build has the AMX kernel (amx_linear_cpu.cpp)");
  m.def("isa", [] { return std::string(llmlab_cpu::compiled_isa()); },
        "the vector code this build uses (cpu_math.h)");
}
