// Fused elementwise operators for CPU tensors: RMSNorm (optionally after the residual add),
// SiLU-and-multiply, rotary embedding in place, and W8A8's per-token int8 quantisation (and, beside
// them, the greedy argmax of a step's logits and its bf16-screened form). Each is
// one pass over its rows instead of the several PyTorch operators (each a full read and write of
// the tensor) of the reference: llmlab.model.layers.RMSNorm, MLP, llmlab.model.llama.Attention._serve
// and llmlab.kernels.int8_linear.quantize_per_token.
//
// The arithmetic is the reference's, rounding included: fp32 inside, and the result rounded to
// the storage dtype wherever the reference's operator would round it (so bf16 results equal the
// reference's bit for bit, up to the order of the RMSNorm's sum and the exp's last bit).
#include <torch/extension.h>
#include "cpu_math.h"
#include "entry_points.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using llmlab_cpu::exp_f;

inline float to_f(float x) { return x; }
inline float to_f(c10::BFloat16 x) {
  union { uint32_t i; float f; } u;                 // (unions, not memcpy: the loops vectorise)
  u.i = static_cast<uint32_t>(x.x) << 16;
  return u.f;
}
inline float to_f(c10::Half x) { return static_cast<float>(x); }

// fp32 -> storage, round to nearest even (bf16: NaN stays NaN).
inline float from_f(float x, float*) { return x; }
inline c10::BFloat16 from_f(float x, c10::BFloat16*) {
  union { float f; uint32_t i; } u{x};
  const uint32_t r = u.i + 0x7FFFu + ((u.i >> 16) & 1u);
  c10::BFloat16 b;
  b.x = static_cast<uint16_t>(x != x ? 0x7FC0u : r >> 16);
  return b;
}
inline c10::Half from_f(float x, c10::Half*) { return static_cast<c10::Half>(x); }

template <typename T> inline T store(float x) { return from_f(x, static_cast<T*>(nullptr)); }
template <typename T> inline float rnd(float x) { return to_f(store<T>(x)); }   // x as T would hold it

template <typename F>
void dispatch(const torch::Tensor& t, const char* name, F&& f) {
  if (t.scalar_type() == at::kFloat) f(float{});
  else if (t.scalar_type() == at::kBFloat16) f(c10::BFloat16{});
  else if (t.scalar_type() == at::kHalf) f(c10::Half{});
  else TORCH_CHECK(false, name, " takes fp32, bf16 or fp16 tensors, got ", t.scalar_type());
}

// f(i) for each row i of [0, rows), the rows split over the intra-op threads, grain at a time.
template <typename F>
void each_row(int64_t rows, int64_t grain, F&& f) {
  at::parallel_for(0, rows, grain, [&](int64_t b, int64_t end) {
    for (int64_t i = b; i < end; ++i) f(i);
  });
}

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), name, " takes CPU tensors");
  TORCH_CHECK(x.dim() >= 1 && x.stride(-1) == 1, name, ": the last dimension must be contiguous");
}

}  // namespace

// out = weight * (x * rsqrt(mean(x^2) + eps)), per row of x [..., h] (the reference RMSNorm:
// fp32 inside, normalised x rounded to x's dtype, then the product with the weight rounded).
// With residual [..., h]: x := x + residual first (rounded), and that sum is returned too.
std::vector<torch::Tensor> rms_norm(torch::Tensor x, torch::Tensor weight, double eps,
                                    c10::optional<torch::Tensor> residual) {
  check_rows(x, "rms_norm");
  const int64_t h = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == h && weight.is_contiguous(),
              "rms_norm: weight must be [", h, "], contiguous");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm: weight and x must have one dtype");
  auto xc = x.contiguous().view({-1, h});
  torch::Tensor rc, sum;
  if (residual) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "rms_norm: residual must have x's shape and dtype");
    rc = residual->contiguous().view({-1, h});
    sum = torch::empty_like(xc);
  }
  auto out = torch::empty_like(xc);
  const int64_t rows = xc.size(0);
  const float e = static_cast<float>(eps);
  dispatch(x, "rms_norm", [&](auto zero) {
    using T = decltype(zero);
    const T* xp = xc.data_ptr<T>();
    const T* wp = weight.data_ptr<T>();
    const T* rp = residual ? rc.data_ptr<T>() : nullptr;
    T* sp = residual ? sum.data_ptr<T>() : nullptr;
    T* op = out.data_ptr<T>();
    each_row(rows, 16, [&](int64_t i) {
      const T* xr = xp + i * h;
      if (rp) {                                  // x + residual, rounded, is the new residual
        T* sr = sp + i * h;
        const T* rr = rp + i * h;
#pragma omp simd
        for (int64_t j = 0; j < h; ++j) sr[j] = store<T>(to_f(xr[j]) + to_f(rr[j]));
        xr = sr;
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t j = 0; j < h; ++j) ss += to_f(xr[j]) * to_f(xr[j]);
      const float r = 1.f / std::sqrt(ss / static_cast<float>(h) + e);
      T* orow = op + i * h;
#pragma omp simd
      for (int64_t j = 0; j < h; ++j) orow[j] = store<T>(to_f(wp[j]) * rnd<T>(to_f(xr[j]) * r));
    });
  });
  std::vector<torch::Tensor> res{out.view(x.sizes())};
  if (residual) res.push_back(sum.view(x.sizes()));
  return res;
}

// silu(gate) * up for gate, up [rows, I] (rows may be strided: the two halves of the fused
// gate/up projection's output) -> [rows, I]: silu rounded to the dtype, then the product rounded
// (the reference's two operators).
torch::Tensor silu_mul(torch::Tensor gate, torch::Tensor up) {
  TORCH_CHECK(gate.device().is_cpu() && gate.dim() == 2 && gate.stride(1) == 1 && up.stride(1) == 1,
              "silu_mul: gate and up must be CPU tensors [rows, I] with I contiguous");
  TORCH_CHECK(up.sizes() == gate.sizes() && up.scalar_type() == gate.scalar_type(),
              "silu_mul: gate and up must have one shape and dtype");
  const int64_t rows = gate.size(0), I = gate.size(1), gs = gate.stride(0), us = up.stride(0);
  auto out = torch::empty({rows, I}, gate.options());
  dispatch(gate, "silu_mul", [&](auto zero) {
    using T = decltype(zero);
    const T* gp = gate.data_ptr<T>();
    const T* up_ = up.data_ptr<T>();
    T* op = out.data_ptr<T>();
    each_row(rows, 4, [&](int64_t i) {
      const T* gr = gp + i * gs;
      const T* ur = up_ + i * us;
      T* orow = op + i * I;
#pragma omp simd
      for (int64_t j = 0; j < I; ++j) {
        const float x = to_f(gr[j]);               // sigmoid from exp(-|x|) <= 1: no huge
        const float e = exp_f(x < 0.f ? x : -x);   // quotients (their subnormal results cost
        const float sig = (x < 0.f ? e : 1.f) / (1.f + e);   // a microcode assist each)
        orow[j] = store<T>(rnd<T>(x * sig) * to_f(ur[j]));
      }
    });
  });
  return out;
}

// Rotary embedding in place (rotate_half form, Su et al. 2021): x [N, heads, D] (strided rows,
// the head dimension contiguous), cos, sin [N, D]: x := x * cos + rotate_half(x) * sin, each
// product and the sum rounded to the dtype as the reference's three operators round them.
void rotary_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1,
              "rotary_: x must be a CPU tensor [N, heads, D] with D contiguous");
  const int64_t N = x.size(0), heads = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(D % 2 == 0, "rotary_: head_dim=", D, " must be even");
  auto c = cos.contiguous().view({-1, D}), s = sin.contiguous().view({-1, D});
  TORCH_CHECK(c.size(0) == N && s.size(0) == N, "rotary_: cos and sin must be [", N, ", ", D, "]");
  TORCH_CHECK(c.scalar_type() == x.scalar_type() && s.scalar_type() == x.scalar_type(),
              "rotary_: cos, sin and x must have one dtype");
  dispatch(x, "rotary_", [&](auto zero) {
    using T = decltype(zero);
    T* xp = x.data_ptr<T>();
    const T* cp = c.data_ptr<T>();
    const T* sp = s.data_ptr<T>();
    const int64_t s0 = x.stride(0), s1 = x.stride(1);
    each_row(N, 16, [&](int64_t n) {
      const T* cr = cp + n * D;
      const T* sr = sp + n * D;
      for (int64_t hd = 0; hd < heads; ++hd) {
        T* r = xp + n * s0 + hd * s1;
#pragma omp simd
        for (int64_t j = 0; j < half; ++j) {
          const float x1 = to_f(r[j]), x2 = to_f(r[j + half]);
          const float lo = rnd<T>(x1 * to_f(cr[j])) + rnd<T>(-x2 * to_f(sr[j]));
          const float hi = rnd<T>(x2 * to_f(cr[j + half])) + rnd<T>(x1 * to_f(sr[j + half]));
          r[j] = store<T>(lo);
          r[j + half] = store<T>(hi);
        }
      }
    });
  });
}

// Per-token int8 quantisation (W8A8's activations; the reference is
// llmlab.kernels.int8_linear.quantize_per_token): x [rows, h] -> qx int8 [rows, h] and
// sx fp32 [rows, 1] with sx = max(max|x[r, :]|, 1e-12) / 127 and qx = round-half-even(x / sx)
// clipped to [-127, 127]: the reference's operators (a division, not a reciprocal product), so
// the results equal it bit for bit; one read of x instead of eight passes.
std::vector<torch::Tensor> quantize_per_token(torch::Tensor x) {
  check_rows(x, "quantize_per_token");
  const int64_t h = x.size(-1);
  auto xc = x.contiguous().view({-1, h});
  const int64_t rows = xc.size(0);
  auto q = torch::empty({rows, h}, x.options().dtype(at::kChar));
  auto s = torch::empty({rows, 1}, x.options().dtype(at::kFloat));
  dispatch(x, "quantize_per_token", [&](auto zero) {
    using T = decltype(zero);
    const T* xp = xc.data_ptr<T>();
    int8_t* qp = q.data_ptr<int8_t>();
    float* sp = s.data_ptr<float>();
    each_row(rows, 16, [&](int64_t i) {
      const T* xr = xp + i * h;
      float m = 0.f;
#pragma omp simd reduction(max : m)
      for (int64_t j = 0; j < h; ++j) m = std::max(m, std::fabs(to_f(xr[j])));
      const float sc = std::max(m, 1e-12f) / 127.f;
      sp[i] = sc;
      int8_t* qr = qp + i * h;
#pragma omp simd
      for (int64_t j = 0; j < h; ++j) {
        const float v = std::nearbyint(to_f(xr[j]) / sc);
        qr[j] = static_cast<int8_t>(std::min(std::max(v, -127.f), 127.f));
      }
    });
  });
  return {q, s};
}

// The step's greedy tokens (llmlab.inference.batched_greedy): for each row of x [rows, V] the
// index of its first maximum (torch.argmax's choice) and whether the row is finite. One pass
// finds the maximum and the finite check (an inf or nan has all its exponent bits set); a
// second, over the row still in cache, stops at the first element equal to it. A row that is
// not finite gets index 0 (its caller leaves it to the per-row path, which reports it).
std::vector<torch::Tensor> argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0,
              "argmax_rows: x must be a CPU tensor [rows, V] with V > 0 contiguous");
  const int64_t rows = x.size(0), V = x.size(1), rs = x.stride(0);
  auto idx = torch::zeros({rows}, x.options().dtype(at::kLong));
  auto finite = torch::empty({rows}, x.options().dtype(at::kBool));
  dispatch(x, "argmax_rows", [&](auto zero) {
    using T = decltype(zero);
    const T* xp = x.data_ptr<T>();
    int64_t* ip = idx.data_ptr<int64_t>();
    bool* fp = finite.data_ptr<bool>();
    each_row(rows, 1, [&](int64_t i) {
      const T* r = xp + i * rs;
      float m = to_f(r[0]);
      uint32_t bad = 0;
#pragma omp simd reduction(max : m) reduction(| : bad)
      for (int64_t j = 0; j < V; ++j) {
        union { float f; uint32_t bits; } u{to_f(r[j])};
        m = u.f > m ? u.f : m;
        bad |= (u.bits & 0x7F800000u) == 0x7F800000u;  // all exponent bits: inf or nan
      }
      fp[i] = bad == 0;
      if (!fp[i]) return;
      int64_t at = 0;
      while (to_f(r[at]) != m) ++at;
      ip[i] = at;
    });
  });
  return {idx, finite};
}

// The greedy token of fp32 logits h . w_v without all of them (llmlab.inference.greedy_screen):
// h [rows, K] fp32, approx [rows, V] bf16 the logits of bf16 copies of h and w, w [V, K] fp32,
// wnorm [V] (>= |w_v|). approx_v is within bound_v = c |h| wnorm_v + u |approx_v| + tiny of any
// fp32 dot product h . w_v (the caller's c and u; tiny covers flushed denormals), so only the v
// with approx_v + bound_v >= max_t(approx_t - bound_t) can hold the maximum: each of those is
// recomputed as an fp32 dot product and the first maximum is the token. ok[r] is false (token 0)
// where h, an approx or a recomputed logit is not finite, or |h| max(wnorm) could overflow a sum:
// the caller then computes that row in full.
std::vector<torch::Tensor> screened_argmax(torch::Tensor h, torch::Tensor approx, torch::Tensor w,
                                           torch::Tensor wnorm, double c, double u) {
  TORCH_CHECK(h.device().is_cpu() && h.dim() == 2 && h.is_contiguous() && h.scalar_type() == at::kFloat,
              "screened_argmax: h must be a contiguous fp32 CPU tensor [rows, K]");
  const int64_t rows = h.size(0), K = h.size(1), V = w.size(0);
  TORCH_CHECK(w.dim() == 2 && w.size(1) == K && w.is_contiguous() && w.scalar_type() == at::kFloat,
              "screened_argmax: w must be a contiguous fp32 tensor [V, ", K, "]");
  TORCH_CHECK(approx.dim() == 2 && approx.size(0) == rows && approx.size(1) == V && approx.stride(1) == 1 &&
                  approx.scalar_type() == at::kBFloat16,
              "screened_argmax: approx must be bf16 [", rows, ", ", V, "] with rows contiguous");
  TORCH_CHECK(wnorm.dim() == 1 && wnorm.size(0) == V && wnorm.is_contiguous() && wnorm.scalar_type() == at::kFloat,
              "screened_argmax: wnorm must be a contiguous fp32 tensor [", V, "]");
  auto idx = torch::zeros({rows}, h.options().dtype(at::kLong));
  auto ok = torch::zeros({rows}, h.options().dtype(at::kBool));
  const float* hp = h.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* np_ = wnorm.data_ptr<float>();
  const c10::BFloat16* ap = approx.data_ptr<c10::BFloat16>();
  const int64_t as = approx.stride(0);
  float wmax = 0.f;
  for (int64_t v = 0; v < V; ++v) wmax = std::max(wmax, np_[v]);
  const float uf = static_cast<float>(u);
  auto dot = [K](const float* a, const float* b) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t k = 0; k < K; ++k) s += a[k] * b[k];
    return s;
  };
  auto row = [&](int64_t i, float* hi) {            // hi [V]: approx + bound
    const float* hr = hp + i * K;
    double ss = 0;
    for (int64_t k = 0; k < K; ++k) ss += static_cast<double>(hr[k]) * hr[k];
    const double hn = std::sqrt(ss);
    if (!std::isfinite(hn) || hn * wmax > 1e37) return;
    const float ch = static_cast<float>(c * hn);
    const float tiny = static_cast<float>(std::ldexp(hn + wmax + static_cast<double>(K), -120));
    const c10::BFloat16* ar = ap + i * as;
    float lo = -std::numeric_limits<float>::infinity();
    uint32_t bad = 0;
#pragma omp simd reduction(max : lo) reduction(| : bad)
    for (int64_t v = 0; v < V; ++v) {
      union { float f; uint32_t bits; } a{to_f(ar[v])};
      bad |= (a.bits & 0x7F800000u) == 0x7F800000u;  // inf or nan
      const float b = ch * np_[v] + uf * std::fabs(a.f) + tiny;
      hi[v] = a.f + b;
      lo = std::max(lo, a.f - b);
    }
    if (bad) return;
    float best = -std::numeric_limits<float>::infinity();
    int64_t at = -1;
    for (int64_t v0 = 0; v0 < V; v0 += 64) {
      const int64_t n = std::min<int64_t>(64, V - v0);
      int any = 0;
#pragma omp simd reduction(| : any)
      for (int64_t j = 0; j < n; ++j) any |= hi[v0 + j] >= lo;
      if (!any) continue;
      for (int64_t v = v0; v < v0 + n; ++v) {
        if (!(hi[v] >= lo)) continue;
        const float d = dot(hr, wp + v * K);
        if (!std::isfinite(d)) return;
        if (d > best) best = d, at = v;
      }
    }
    if (at < 0) return;
    idx.data_ptr<int64_t>()[i] = at;
    ok.data_ptr<bool>()[i] = true;
  };
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> hi(V);                      // one buffer a thread, not one a row
    for (int64_t i = r0; i < r1; ++i) row(i, hi.data());
  });
  return {idx, ok};
}

// The paged KV cache write (llmlab.inference.paged_attention.write_kv, two index_copy_ calls
// there): k, v [N, Hkv, D] (rows may be strided, each row's Hkv x D contiguous) stored at flat
// slots [N] (int64) of k_cache, v_cache [num_blocks, block_size, Hkv, D] (contiguous, k's
// dtype). One call and a copy per row, for both caches.
void write_kv(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k, torch::Tensor v,
              torch::Tensor slots) {
  TORCH_CHECK(k_cache.device().is_cpu() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.dim() == 4,
              "write_kv: the caches must be contiguous CPU tensors [num_blocks, block_size, Hkv, D] of one shape");
  const int64_t Hkv = k_cache.size(2), D = k_cache.size(3), N = k.size(0);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (const auto& t : {k, v}) {
    TORCH_CHECK(t.device().is_cpu() && t.dim() == 3 && t.size(0) == N && t.size(1) == Hkv && t.size(2) == D &&
                    t.stride(2) == 1 && t.stride(1) == D,
                "write_kv: k and v must be CPU tensors [", N, ", ", Hkv, ", ", D, "] with each row contiguous");
    TORCH_CHECK(t.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
                "write_kv: k, v and the caches must have one dtype");
  }
  TORCH_CHECK(slots.device().is_cpu() && slots.scalar_type() == at::kLong && slots.dim() == 1 &&
                  slots.size(0) == N && slots.is_contiguous(),
              "write_kv: slots must be a contiguous int64 CPU tensor [", N, "]");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < N; ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < num_slots, "write_kv: slot ", sp[i], " outside the cache's [0, ", num_slots, ")");
  const int64_t es = k.element_size(), row = Hkv * D * es;
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  const int64_t ks = k.stride(0) * es, vs = v.stride(0) * es;
  for (int64_t i = 0; i < N; ++i) {
    std::memcpy(kc + sp[i] * row, kp + i * ks, row);
    std::memcpy(vc + sp[i] * row, vp + i * vs, row);
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("entry_points", [] {
    using namespace llmlab_entry;
    return pybind11::make_tuple(export_fn<RmsNorm>(&rms_norm, kRmsNorm), export_fn<SiluMul>(&silu_mul, kSiluMul),
                                export_fn<Rotary>(&rotary_, kRotary), export_fn<WriteKv>(&write_kv, kWriteKv));
  }, "(rms_norm, silu_mul, rotary_, write_kv) as capsules for the decode stack (entry_points.h)");
  m.def("rms_norm", &rms_norm, "RMSNorm, optionally after the residual add (fused_ops_cpu.cpp)",
        py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("residual") = py::none());
  m.def("silu_mul", &silu_mul, "silu(gate) * up, [rows, I] each (fused_ops_cpu.cpp)");
  m.def("rotary_", &rotary_, "rotary embedding in place (fused_ops_cpu.cpp)");
  m.def("quantize_per_token", &quantize_per_token,
        "int8 per row from its absolute maximum -> (qx, sx) (fused_ops_cpu.cpp)");
  m.def("argmax_rows", &argmax_rows,
        "first maximum and finite check of each row of x [rows, V] (fused_ops_cpu.cpp)");
  m.def("screened_argmax", &screened_argmax,
        "greedy tokens of fp32 h . w from bf16 approximate logits, candidates checked in fp32 (fused_ops_cpu.cpp)");
  m.def("write_kv", &write_kv, "the paged KV cache write of k, v at slots (fused_ops_cpu.cpp)");
  m.def("isa", [] { return std::string(llmlab_cpu::compiled_isa()); },
        "the vector code this build uses (cpu_math.h)");
}
