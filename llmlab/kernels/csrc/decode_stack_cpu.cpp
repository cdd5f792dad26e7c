// A decode step's decoder layers in one call: for every layer, what DecoderLayer._serve_cpu
// (llmlab/model/llama.py) calls from Python, the same operators on the same tensors in the same
// order, called here from C++. The operators are the other kernel modules' (the fused RMSNorm,
// rotary, cache write and SwiGLU, the panel products, the paged attention), reached through the
// entry points they export (entry_points.h), so the outputs are theirs, bit for bit.
//
// Why: a decode step of a small model is a few hundred operator calls, each a few microseconds of
// Python and PyTorch dispatch, and after each product has streamed its weight through the caches
// that Python runs with cold caches. For SmolLM2-135M (30 layers) on bench_vs_vllm.py's workload,
// one call per step instead took its decode steps from 65.2 to 61.7 ms (bf16) and from 118.5 to
// 111.6 ms (fp32) on average (docs/kernels.md, "Session 18"). CUDA graphs play this role for
// vLLM's decode steps on a GPU (a step's kernels replayed without the host's per-kernel work).
//
// llmlab.kernels.cpu_decode_stack is the Python side (which layers and steps it takes);
// tests/test_engine_fast_paths.py checks the engine's logprobs against the modules' path.
#include <torch/extension.h>
#include "cpu_math.h"
#include "entry_points.h"
#include <tuple>
#include <vector>

namespace {

using llmlab_entry::import_fn;
using Opt = c10::optional<torch::Tensor>;

// One layer: (layer_idx, input_layernorm weight, eps, fused q|k|v panels, bias, o_proj panels,
// bias, post_attention_layernorm weight, eps, fused gate/up panels (SwiGLU panels if swiglu),
// bias, swiglu, down_proj panels, bias, intermediate size, sliding window or -1).
using Layer = std::tuple<int64_t, torch::Tensor, double, torch::Tensor, Opt, torch::Tensor, Opt, torch::Tensor, double,
                         torch::Tensor, Opt, bool, torch::Tensor, Opt, int64_t, int64_t>;

struct Ops {
  llmlab_entry::RmsNorm rms_norm;
  llmlab_entry::SiluMul silu_mul;
  llmlab_entry::Rotary rotary;
  llmlab_entry::WriteKv write_kv;
  llmlab_entry::Linear linear;
  llmlab_entry::LinearSwiglu linear_swiglu;
  llmlab_entry::Attention attention;
};

Ops import_ops(const pybind11::tuple& fused, const pybind11::tuple& panels, const pybind11::tuple& attention) {
  using namespace llmlab_entry;
  TORCH_CHECK(fused.size() == 4 && panels.size() == 2 && attention.size() == 1,
              "decode stack: the entry points are (rms_norm, silu_mul, rotary_, write_kv), (linear, linear_swiglu), "
              "(paged_attention_cpu,)");
  return {import_fn<RmsNorm>(fused[0], kRmsNorm),     import_fn<SiluMul>(fused[1], kSiluMul),
          import_fn<Rotary>(fused[2], kRotary),       import_fn<WriteKv>(fused[3], kWriteKv),
          import_fn<Linear>(panels[0], kLinear),      import_fn<LinearSwiglu>(panels[1], kLinearSwiglu),
          import_fn<Attention>(attention[0], kAttention)};
}

}  // namespace

// x [N, hidden] (one new token per sequence, token-major), cos, sin [N, D] (x's dtype), kv_cache
// [layers, 2, num_blocks, block_size, Hkv, D], the step's block_tables [S, max_blocks],
// context_lens [S], query_lens [S] (all 1) and slots [N] (int64), the layers in order; heads H,
// kv heads Hkv, head_dim D, attention scale -> the hidden states after the last layer [N, hidden].
torch::Tensor decode_layers(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor kv_cache,
                            torch::Tensor block_tables, torch::Tensor context_lens, torch::Tensor query_lens,
                            torch::Tensor slots, const std::vector<Layer>& layers, int64_t H, int64_t Hkv, int64_t D,
                            double scale, const pybind11::tuple& fused, const pybind11::tuple& panels,
                            const pybind11::tuple& attention) {
  const Ops ops = import_ops(fused, panels, attention);
  TORCH_CHECK(x.dim() == 2 && kv_cache.dim() == 6 && kv_cache.size(1) == 2,
              "decode stack: x must be [N, hidden] and kv_cache [layers, 2, num_blocks, block_size, Hkv, D]");
  const int64_t N = x.size(0), hidden = x.size(1), qkv_out = (H + 2 * Hkv) * D;
  torch::Tensor xf = x;
  for (const Layer& L : layers) {
    const auto& [idx, norm1, eps1, qkv_w, qkv_b, o_w, o_b, norm2, eps2, gu_w, gu_b, swiglu, down_w, down_b, I,
                 window] = L;
    TORCH_CHECK(idx >= 0 && idx < kv_cache.size(0), "decode stack: layer ", idx, " has no cache");
    // attention: RMSNorm, the fused q|k|v product, RoPE on q|k in place, the cache write, the
    // paged attention of q, o_proj (Attention._serve and PagedAttentionContext.attention)
    const torch::Tensor qkv = ops.linear(ops.rms_norm(xf, norm1, eps1, c10::nullopt)[0], qkv_w, qkv_out, qkv_b);
    const torch::Tensor qk = qkv.as_strided({N, H + Hkv, D}, {qkv.stride(0), D, 1});
    ops.rotary(qk, cos, sin);
    const torch::Tensor k_cache = kv_cache[idx][0], v_cache = kv_cache[idx][1];
    const torch::Tensor v = qkv.narrow(1, (H + Hkv) * D, Hkv * D).view({N, Hkv, D});
    ops.write_kv(k_cache, v_cache, qk.narrow(1, H, Hkv), v, slots);
    const torch::Tensor o = ops.attention(qk.narrow(1, 0, H), k_cache, v_cache, block_tables, context_lens, query_lens,
                                          scale, window);
    // the residual add with RMSNorm, the MLP (SwiGLU), the residual add
    auto normed = ops.rms_norm(ops.linear(o.reshape({N, H * D}), o_w, hidden, o_b), norm2, eps2, xf);
    xf = normed[1];
    torch::Tensor act;
    if (swiglu) {
      act = ops.linear_swiglu(normed[0], gu_w, I);
    } else {
      const torch::Tensor gu = ops.linear(normed[0], gu_w, 2 * I, gu_b);
      act = ops.silu_mul(gu.narrow(1, 0, I), gu.narrow(1, I, I));
    }
    xf = xf + ops.linear(act, down_w, hidden, down_b);
  }
  return xf;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_layers", &decode_layers,
        "a decode step's decoder layers through the other modules' entry points (decode_stack_cpu.cpp)");
  m.def("isa", [] { return std::string(llmlab_cpu::compiled_isa()); },
        "the vector code this build uses (cpu_math.h)");
}
