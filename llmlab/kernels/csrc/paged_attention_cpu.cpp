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
// Decode items (a sequence with query_len 1, when there are at least as many of them as threads)
// are whole sequences: paged_attention_decode.h walks the sequence's blocks once, and for each
// block and kv head computes the scores of the G query heads, updates an online softmax and adds
// the block's V rows, while prefetching the next block of the walk (the layout keeps a block's K,
// all kv heads, in one contiguous 12 KB stretch for SmolLM2's shapes in bf16). Measured on this
// repository's machine (one thread, SmolLM2-135M's shapes, 40 sequences of 100-250 tokens, blocks
// at random in a 1 GiB cache read cold as in the engine, benchmarks/bench_cpu_paged_attention.py):
// bf16 0.90 -> 0.74 ms a layer, fp32 1.20 -> 1.18 ms (memory-bound at ~9.4 GB/s).
//
// Other work items: one (sequence, kv head). Its G = H / Hkv query heads are "rows" that read the
// same K and V, so rows go together in tiles: each K or V row read (and converted to fp32) serves
// all of a tile's rows. Two passes per row tile (Kwon et al., SOSP 2023, §4.1; the in-place walk
// over the block table is their kernel's, the loop order is ours):
//   1. scores q.k. Short items (fewer than 16 rows: up to RT rows of one query position) read K
//      rows in place and reduce 16 keys' partial dot products at once (a shuffle tree instead of
//      one horizontal sum per key). Prompt items (paged_attention_prompt.h) first copy the
//      sequence's K, transposed 16 keys at a time, into an fp32 buffer [D, context] once; their
//      tiles take rows of consecutive query positions (SmolLM2: two positions' three heads), and
//      up to 64 keys' scores are lanes of plain multiply-adds, the last step cut to the 16-key
//      vectors left before the tile's causal edge.
//   2. each row's max, exp(s - max) and its sum (whole vectors, masked to the row's own keys), and
//      the weighted sum of V rows read in place, for all the tile's rows at once.
// bf16 on a build with AVX512-BF16 (and head dims a multiple of 32) multiplies bf16 pairs
// directly (vdpbf16ps, fp32 sums): prompt items then copy K and V once into pairs, and round
// their softmax weights to bf16 for the weighted sum of V, as flash attention kernels do (decode
// items keep fp32 weights). The next block's rows are prefetched before a block is read (blocks
// lie anywhere in the cache, where the hardware prefetcher, which follows strides within a page,
// cannot see them coming). Prompt items, measured on this repository's machine (AMD EPYC Zen 4,
// one thread, SmolLM2-135M's shapes, 26 prompts of 36-250 tokens, `benchmarks/
// bench_cpu_paged_attention.py --prefill --seqs 26 --ctx 36,250`, hot): fp32 21.0 -> 12.9 ms a
// layer, bf16 15.6 -> 8.0 ms (before: rows of one position at a time, 64-key score steps, a
// scalar softmax tail, K copied one value at a time).
// Vectors are GCC/Clang vector extensions of 16 floats: one AVX-512 register; in AVX2 builds a pair
// of 8-float halves (paged_attention_common.h), which GCC keeps in registers where it kept the
// 16-float type on the stack; SSE builds (generic) keep the 16-float type.
#include <torch/extension.h>
#include "cpu_math.h"
#include "entry_points.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

#include "paged_attention_common.h"   // (vectors, block walk, the two passes; L, vf, Item, max_rows)

#include "paged_attention_bf16.h"   // (the bf16 dot-product passes; kDpBf16)

struct Buffers {
  std::vector<float> kt, sc;         // K transposed (fp32), scores
  std::vector<uint32_t> kt2, vt2;    // K and V as bf16 pairs (the AVX512-BF16 prompt path)
  std::vector<uint16_t> pb;          // softmax weights in bf16
};

// Whether items of this dtype and head dim take the bf16 dot-product path.
template <typename T, int NC>
constexpr bool dp_bf16() { return kDpBf16 && std::is_same_v<T, c10::BFloat16> && NC % 2 == 0; }

// Rows g0 .. g0+RT-1 of query n (position pos): the G heads of one kv head, RT at a time, K and V
// read in place (a short item's rows).
template <typename T, int NC, int RT>
void attend_rows(const Item<T>& it, const T* const* qr, float scale, int64_t lo, int64_t pos, float* const* sc,
                 T* const* out) {
  int64_t los[RT], his[RT];
  std::fill(los, los + RT, lo);
  std::fill(his, his + RT, pos);
#if defined(__AVX512BF16__)
  if constexpr (dp_bf16<T, NC>()) {
    scores_direct_bf16<NC, RT>(it, qr, scale, lo, pos, sc);
    softmax_v<T, NC, RT>(it, los, his, sc, out);
    return;
  }
#endif
  vf q[RT][NC];
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < NC; ++c) q[r][c] = load16(qr[r] + c * L) * scale;
  scores_direct<T, NC, RT>(it, q, lo, pos, sc);
  softmax_v<T, NC, RT>(it, los, his, sc, out);
}

#include "paged_attention_prompt.h"   // (the prompt items: attend_prompt)

#include "paged_attention_decode.h"   // (the decode items: attend_decode)

// Work item (sequence s, kv head hkv): its qlen queries x G heads. Prompt items (qlen * G >= 16
// rows: copying K pays for itself) go to attend_prompt.
template <typename T, int NC>
void attend_item(const Item<T>& it, const T* q, int64_t q_s0, int64_t q_s1, int64_t ctx, int64_t qlen,
                 int64_t q0, int64_t hkv, int64_t G, float scale, int64_t window, T* out,
                 int64_t o_s0, int64_t o_s1, Buffers& buf) {
  constexpr int R = max_rows<NC>(), RS = std::max(R, tile_rows<NC>());
  const int64_t ld = (ctx + L - 1) / L * L + 4 * L;          // (room for a tile's overrun)
  buf.sc.resize(RS * ld);
  float* sc[RS];
  for (int r = 0; r < RS; ++r) sc[r] = buf.sc.data() + r * ld;
  if (qlen * G >= 16)
    return attend_prompt<T, NC>(it, q, q_s0, q_s1, ctx, qlen, q0, hkv, G, scale, window, out, o_s0, o_s1, ld,
                                buf, sc);
  for (int64_t j = 0; j < qlen; ++j) {
    const int64_t n = q0 + j, pos = ctx - qlen + j;
    const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
    for (int64_t g0 = 0; g0 < G; g0 += R) {
      const int rt = static_cast<int>(std::min<int64_t>(R, G - g0));
      const T* qr[R];
      T* orow[R];
      for (int r = 0; r < rt; ++r) {
        qr[r] = q + n * q_s0 + (hkv * G + g0 + r) * q_s1;
        orow[r] = out + n * o_s0 + (hkv * G + g0 + r) * o_s1;
      }
      with_rows<R>(rt, [&](auto rows) { attend_rows<T, NC, decltype(rows)::value>(it, qr, scale, lo, pos, sc, orow); });
    }
  }
}

template <typename T>
using ItemFn = void (*)(const Item<T>&, const T*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                        int64_t, float, int64_t, T*, int64_t, int64_t, Buffers&);

// The compiled head dims: D / 16 in {1, ..., 8, 16} (head_dim 16 .. 128, and 256). f(nc) gives the
// kernel instantiated for NC = nc (a std::integral_constant); nullptr for another head dim.
template <typename Fn, typename F>
Fn by_head_dim(int64_t D, F&& f) {
  switch (D) {
    case 16: return f(std::integral_constant<int, 1>{});
    case 32: return f(std::integral_constant<int, 2>{});
    case 48: return f(std::integral_constant<int, 3>{});
    case 64: return f(std::integral_constant<int, 4>{});
    case 80: return f(std::integral_constant<int, 5>{});
    case 96: return f(std::integral_constant<int, 6>{});
    case 112: return f(std::integral_constant<int, 7>{});
    case 128: return f(std::integral_constant<int, 8>{});
    case 256: return f(std::integral_constant<int, 16>{});
    default: return nullptr;
  }
}

template <typename T>
ItemFn<T> item_fn(int64_t D) {
  return by_head_dim<ItemFn<T>>(D, [](auto nc) -> ItemFn<T> { return attend_item<T, decltype(nc)::value>; });
}

template <typename T>
using DecodeFn = void (*)(const BlockRef<T>*, int64_t, const BlockRef<T>*, int64_t, int64_t, int64_t, int64_t,
                          const T*, int64_t, int64_t, float, T*, int64_t, DecodeState&);

template <typename T>
DecodeFn<T> decode_fn(int64_t D) {
  return by_head_dim<DecodeFn<T>>(D, [](auto nc) -> DecodeFn<T> { return attend_decode<T, decltype(nc)::value>; });
}

// Appends a decode sequence's blocks in range (the window's, or all up to its new token) to walk.
template <typename T>
void add_blocks(const Item<T>& it, int64_t ctx, int64_t window, std::vector<BlockRef<T>>& walk) {
  const int64_t pos = ctx - 1, lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
  for (int64_t b = lo / it.bs; b * it.bs <= pos; ++b) {
    const int64_t t0 = std::max(lo, b * it.bs), off = it.table[b] * it.c_blk + (t0 - b * it.bs) * it.c_tok;
    walk.push_back({it.k + off, it.v + off, std::min(pos, (b + 1) * it.bs - 1) - t0 + 1});
  }
}

// The work items: (sequence, kv head), or (sequence, -1) for a whole decode sequence (query_len 1),
// which is what decodes are as long as there are at least as many of them as threads.
std::vector<std::pair<int64_t, int64_t>> work_items(const int64_t* ql, int64_t S, int64_t Hkv) {
  int64_t decodes = 0;
  for (int64_t s = 0; s < S; ++s) decodes += ql[s] == 1;
  const bool whole = decodes >= at::get_num_threads();
  std::vector<std::pair<int64_t, int64_t>> items;
  for (int64_t s = 0; s < S; ++s) {
    if (whole && ql[s] == 1) items.emplace_back(s, -1);
    else
      for (int64_t h = 0; h < Hkv; ++h) items.emplace_back(s, h);
  }
  return items;
}

}  // namespace

bool supports_head_dim(int64_t D) { return item_fn<float>(D) != nullptr; }

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
  TORCH_CHECK(supports_head_dim(D), "head_dim=", D, " is not compiled (16, 32, ..., 128 or 256)");
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
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16 ||
              q.scalar_type() == at::kHalf, "paged_attention_cpu takes fp32, bf16 or fp16 tensors");
  const auto run = [&](auto zero) {
    using scalar_t = decltype(zero);
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = k_cache.data_ptr<scalar_t>();
    const scalar_t* vp = v_cache.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t* tp = bt.data_ptr<int64_t>();
    const auto fn = item_fn<scalar_t>(D);
    const auto dec = decode_fn<scalar_t>(D);
    const auto items = work_items(ql_p, S, Hkv);
    const auto item = [&](int64_t s, int64_t hkv) {
      return Item<scalar_t>{kp + std::max<int64_t>(hkv, 0) * k_cache.stride(2), vp + std::max<int64_t>(hkv, 0) * k_cache.stride(2),
                            k_cache.stride(0), k_cache.stride(1), tp + s * bt.size(1), bs};
    };
    at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
      Buffers buf;
      DecodeState st;
      std::vector<BlockRef<scalar_t>> walk;           // the decode items' blocks, in order
      std::vector<int64_t> first(end - begin + 1, 0);
      for (int64_t i = begin; i < end; ++i) {
        if (items[i].second < 0) add_blocks(item(items[i].first, -1), cl_p[items[i].first], sliding_window, walk);
        first[i + 1 - begin] = static_cast<int64_t>(walk.size());
      }
      for (int64_t i = begin; i < end; ++i) {
        const auto [s, hkv] = items[i];
        if (hkv >= 0) {
          fn(item(s, hkv), qp, q.stride(0), q.stride(1), cl_p[s], ql_p[s], q0[s], hkv, G, static_cast<float>(scale),
             sliding_window, op, out.stride(0), out.stride(1), buf);
          continue;
        }
        const BlockRef<scalar_t>* w = walk.data() + first[i - begin];
        dec(w, first[i + 1 - begin] - first[i - begin], walk.data() + walk.size(), bs, k_cache.stride(1),
            k_cache.stride(2), Hkv, qp + q0[s] * q.stride(0), q.stride(1), G, static_cast<float>(scale),
            op + q0[s] * out.stride(0), out.stride(1), st);
      }
    });
  };
  if (q.scalar_type() == at::kFloat) run(float{});
  else if (q.scalar_type() == at::kBFloat16) run(c10::BFloat16{});
  else run(c10::Half{});
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("entry_points", [] {
    return pybind11::make_tuple(llmlab_entry::export_fn<llmlab_entry::Attention>(
        &paged_attention_cpu, llmlab_entry::kAttention));
  }, "(paged_attention_cpu,) as a capsule for the decode stack (entry_points.h)");
  m.def("paged_attention_cpu", &paged_attention_cpu,
        "PagedAttention over block tables on CPU tensors (see paged_attention_cpu.cpp)");
  m.def("supports_head_dim", &supports_head_dim, "whether a head_dim is compiled");
  m.def("isa", [] { return std::string(llmlab_cpu::compiled_isa()); },
        "the vector code this build uses (cpu_math.h)");
}
