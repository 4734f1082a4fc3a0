// Shared helpers of the pyrl C++ core: element conversions, a vectorizable exp, input checks.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

// Hot loops are compiled for AVX-512, AVX2 and baseline x86-64, picked at load time (no -march=native).
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(PYRL_NO_MULTIVERSION)
#define PYRL_MULTIVERSION __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define PYRL_MULTIVERSION
#endif

namespace pyrl {

// Floating formats the logits kernels read and write natively (no fp32 copy of the input).
enum class FloatKind : int { F32 = 0, BF16 = 1, F16 = 2 };

inline std::size_t itemsize(FloatKind kind) { return kind == FloatKind::F32 ? 4 : 2; }

// bf16 is the top half of an IEEE float32.
inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);  // quiet NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(bits >> 16);
}

inline float f16_to_float(uint16_t h) {
  _Float16 v;
  std::memcpy(&v, &h, 2);
  return static_cast<float>(v);
}

inline uint16_t float_to_f16(float f) {
  _Float16 v = static_cast<_Float16>(f);
  uint16_t h;
  std::memcpy(&h, &v, 2);
  return h;
}

inline float load_as_float(const void* base, FloatKind kind, int64_t i) {
  switch (kind) {
    case FloatKind::F32: return static_cast<const float*>(base)[i];
    case FloatKind::BF16: return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    default: return f16_to_float(static_cast<const uint16_t*>(base)[i]);
  }
}

// exp(x) in straight-line code that GCC vectorizes (Cephes polynomial, ~1 ulp relative error).
// Exactly 0 below -87.3 (so masked -inf logits contribute nothing), NaN in gives NaN out.
inline float fast_exp(float x) {
  float xc = x < -87.3f ? -87.3f : x;
  xc = xc > 88.3f ? 88.3f : xc;
  xc = xc == xc ? xc : 0.0f;  // keep the integer conversion below defined for NaN
  // round(x / ln2) with the 1.5 * 2^23 trick: branch-free, unlike std::floor before SSE4.1.
  const float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = xc - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, 4);
  const float y = p * scale;
  return x != x ? x : (x < -87.3f ? 0.0f : y);
}

[[noreturn]] inline void fail(const std::string& msg) { throw std::invalid_argument(msg); }

inline void check(bool ok, const std::string& msg) {
  if (!ok) fail(msg);
}

}  // namespace pyrl
