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
// Work item: one (sequence, kv head). Its G = H / Hkv query heads read the same K and V rows one
// after the other, so a decode step brings each cached row from memory once per layer. Two passes
// per query head: scores into a buffer and their max, then exp, sum and the weighted sum of V (Kwon et al., SOSP 2023, §4.1;
// the in-place walk over the block table is their kernel's, the loop order is ours).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

// Storage -> fp32. bf16 is the top half of an fp32 (a shift, which vectorises); fp16 via c10.
inline float to_f(float x) { return x; }
inline float to_f(c10::BFloat16 x) {
  union { uint32_t i; float f; } u;                 // (a union, not memcpy: it vectorises)
  u.i = static_cast<uint32_t>(x.x) << 16;
  return u.f;
}
inline float to_f(c10::Half x) { return static_cast<float>(x); }

// exp(x) for x <= 0 (scores minus their max), as Cephes' expf: 2^n * p(r), |r| <= ln2/2, a
// degree-6 polynomial (relative error ~2e-7); branch-free, so the loop over keys vectorises.
inline float exp_nonpos(float x) {
  x = x < -87.f ? -87.f : x;
  const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  union { int32_t i; float f; } two_n;
  two_n.i = (static_cast<int32_t>(n) + 127) << 23;
  return p * two_n.f;
}

// Calls f(t, row) for the keys t in [lo, hi] of one sequence, block by block: row is key t's
// vector of kv head `head` in the cache (block table[t / bs], slot t % bs).
template <typename T, typename F>
inline void for_each_key(const T* cache, int64_t c_blk, int64_t c_tok, const int64_t* table,
                         int64_t bs, int64_t lo, int64_t hi, F&& f) {
  for (int64_t b = lo / bs, t = lo; t <= hi; ++b) {
    const T* row = cache + table[b] * c_blk + (t - b * bs) * c_tok;
    for (const int64_t stop = std::min(hi + 1, (b + 1) * bs); t < stop; ++t, row += c_tok) f(t, row);
  }
}

// DC: the head dim when known at compile time (64, 128: the loops over it unroll and the
// accumulators stay in registers), else 0 (D_ at run time).
template <typename T, int64_t DC>
void attend_one(const T* q, int64_t q_s0, int64_t q_s1, const T* kc, const T* vc,
                int64_t c_blk, int64_t c_tok, int64_t c_head, const int64_t* table, int64_t bs,
                int64_t ctx, int64_t qlen, int64_t q0, int64_t hkv, int64_t G, int64_t D_,
                float scale, int64_t window, T* out, int64_t o_s0, int64_t o_s1,
                std::vector<float>& scores, std::vector<float>& qf, std::vector<float>& acc) {
  const int64_t D = DC ? DC : D_;
  scores.resize(ctx);
  qf.resize(D);
  acc.resize(D);
  const T* kh = kc + hkv * c_head;
  const T* vh = vc + hkv * c_head;
  for (int64_t j = 0; j < qlen; ++j) {
    const int64_t n = q0 + j, pos = ctx - qlen + j;
    const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
    for (int64_t g = 0; g < G; ++g) {                // one query head at a time: its K/V rows
      const T* qr = q + n * q_s0 + (hkv * G + g) * q_s1;   // are shared with the group's others
      float* qv = qf.data();                               // through the cache (L1/L2)
      for (int64_t d = 0; d < D; ++d) qv[d] = to_f(qr[d]) * scale;
      float* sc = scores.data();
      float mx = -std::numeric_limits<float>::infinity();
      for_each_key(kh, c_blk, c_tok, table, bs, lo, pos, [&](int64_t t, const T* kr) {
        float s = 0.f;                                     // pass 1: scores q.k, their max
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < D; ++d) s += qv[d] * to_f(kr[d]);
        sc[t] = s;
        mx = std::max(mx, s);
      });
      float l = 0.f;                                       // exp(s - max) and its sum
#pragma omp simd reduction(+ : l)
      for (int64_t t = lo; t <= pos; ++t) {
        const float p = exp_nonpos(sc[t] - mx);
        sc[t] = p;
        l += p;
      }
      float a[DC ? DC : 1];                                // pass 2: the weighted sum of V
      float* av = DC ? a : acc.data();
      for (int64_t d = 0; d < D; ++d) av[d] = 0.f;
      for_each_key(vh, c_blk, c_tok, table, bs, lo, pos, [&](int64_t t, const T* vr) {
        const float p = sc[t];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) av[d] += p * to_f(vr[d]);
      });
      T* o = out + n * o_s0 + (hkv * G + g) * o_s1;
      const float inv = 1.f / l;
      for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(av[d] * inv);
    }
  }
}

}  // namespace

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
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention_cpu", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = k_cache.data_ptr<scalar_t>();
    const scalar_t* vp = v_cache.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t* tp = bt.data_ptr<int64_t>();
    at::parallel_for(0, S * Hkv, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores, qf, acc;
      for (int64_t i = begin; i < end; ++i) {
        const int64_t s = i / Hkv, hkv = i % Hkv;
        auto f = D == 64 ? attend_one<scalar_t, 64> : D == 128 ? attend_one<scalar_t, 128>
                                                             : attend_one<scalar_t, 0>;
        f(qp, q.stride(0), q.stride(1), kp, vp, k_cache.stride(0), k_cache.stride(1),
                             k_cache.stride(2), tp + s * bt.size(1), bs, cl_p[s], ql_p[s], q0[s], hkv, G, D,
                             static_cast<float>(scale), sliding_window, op, out.stride(0), out.stride(1),
                             scores, qf, acc);
      }
    });
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention_cpu", &paged_attention_cpu,
        "PagedAttention over block tables on CPU tensors (see paged_attention_cpu.cpp)");
}
