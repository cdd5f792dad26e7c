// The C++ functions one kernel module hands another: each module exports its entry points as
// PyCapsules (CPython's way for one extension module to call another's C functions without
// linking them together: docs.python.org/3/extending/extending.html, "Providing a C API for an
// Extension Module"), and the decode stack (decode_stack_cpu.cpp) calls the fused operators, the
// panel products and the paged attention through them, each taken from the build of the same
// instruction-set level. The capsule's name is the function's name and signature: a module built
// from another version of this header is refused, not called with the wrong arguments.
#pragma once
#include <torch/extension.h>
#include <string>
#include <vector>

namespace llmlab_entry {

using RmsNorm = std::vector<torch::Tensor> (*)(torch::Tensor x, torch::Tensor weight, double eps,
                                               c10::optional<torch::Tensor> residual);
using SiluMul = torch::Tensor (*)(torch::Tensor gate, torch::Tensor up);
using Rotary = void (*)(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
using WriteKv = void (*)(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k, torch::Tensor v,
                         torch::Tensor slots);
using Linear = torch::Tensor (*)(torch::Tensor x, torch::Tensor panels, int64_t N, c10::optional<torch::Tensor> bias);
using LinearSwiglu = torch::Tensor (*)(torch::Tensor x, torch::Tensor panels, int64_t I);
using Attention = torch::Tensor (*)(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                    torch::Tensor block_tables, torch::Tensor context_lens,
                                    torch::Tensor query_lens, double scale, int64_t sliding_window);

// The capsule names (one per signature above; change the name with the signature).
constexpr const char* kRmsNorm = "llmlab.rms_norm.v1";
constexpr const char* kSiluMul = "llmlab.silu_mul.v1";
constexpr const char* kRotary = "llmlab.rotary_.v1";
constexpr const char* kWriteKv = "llmlab.write_kv.v1";
constexpr const char* kLinear = "llmlab.panel_linear.v1";
constexpr const char* kLinearSwiglu = "llmlab.panel_linear_swiglu.v1";
constexpr const char* kAttention = "llmlab.paged_attention_cpu.v1";

template <typename F>
pybind11::capsule export_fn(F f, const char* name) {
  return pybind11::capsule(reinterpret_cast<void*>(f), name);
}

template <typename F>
F import_fn(const pybind11::object& capsule, const char* name) {
  void* p = PyCapsule_GetPointer(capsule.ptr(), name);
  if (p == nullptr) {
    PyErr_Clear();
    TORCH_CHECK(false, "decode stack: expected the entry point ", name, " (a kernel module of another version?)");
  }
  return reinterpret_cast<F>(p);
}

}  // namespace llmlab_entry
