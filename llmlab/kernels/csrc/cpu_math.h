// Shared by the C++ CPU kernels of llmlab/kernels/csrc (included, not compiled on its own).
#pragma once
#include <cstdint>

namespace llmlab_cpu {

// exp(x), as Cephes' expf: 2^n * p(r), |r| <= ln2/2, a degree-6 polynomial (relative error
// ~2e-7), x clamped to [-87, 88]; branch-free, so loops over it vectorise.
inline float exp_f(float x) {
  x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
  const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  union { int32_t i; float f; } two_n;                 // (a union, not memcpy: it vectorises)
  two_n.i = (static_cast<int32_t>(n) + 127) << 23;
  return p * two_n.f;
}

// The vector code this translation unit is compiled with (llmlab.kernels.cpu_isa's level names).
inline const char* compiled_isa() {
#if defined(__AVX512BF16__)
  return "avx512_bf16";
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "generic";
#endif
}

}  // namespace llmlab_cpu
