// Scalar conversions between float and the 16-bit storage types (IEEE fp16, bfloat16), round to
// nearest even. Used by kernels, the SDK, tests and examples so every side rounds identically.
#pragma once

#include <cstdint>
#include <cstddef>
#include <cstring>

#include "karakv/kernels/types.h"

// The scalar conversions compile for the device too (nvcc), in integer arithmetic: the CUDA
// quantize kernels take their fp16 record fields from float_to_half, so no fp16 register is ever
// stored a byte at a time. CUDA 13.0's ptxas compiles a byte store of the low half of an fp16
// register (the cvt.rn.f16.f32 result) as a conversion of the half's value to an 8-bit integer
// (F2I.U8.F16.TRUNC): 0x4512 (5.07) stored its low byte as 0x05.
#if defined(__CUDACC__)
#define KARAKV_SCALAR_FN __host__ __device__ inline
#else
#define KARAKV_SCALAR_FN inline
#endif

namespace karakv::kernels {

KARAKV_SCALAR_FN float bits_to_float(uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(b);
#else
  float f;
  std::memcpy(&f, &b, 4);
  return f;
#endif
}
KARAKV_SCALAR_FN uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
#endif
}

KARAKV_SCALAR_FN float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    if (mant == 0) return bits_to_float(sign);
    // Subnormal: value = mant * 2^-24.
    float f = float(mant) * (1.0f / 16777216.0f);
    return sign ? -f : f;
  }
  if (exp == 31) return bits_to_float(sign | 0x7f800000u | (mant << 13));
  return bits_to_float(sign | ((exp + 112) << 23) | (mant << 13));
}

KARAKV_SCALAR_FN uint16_t float_to_half(float f) {
  const uint32_t x = float_to_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) return uint16_t(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0));
  if (abs >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to infinity
  if (abs < 0x38800000u) {
    // Subnormal or zero in fp16: round abs * 2^24 to the nearest integer, ties to even.
    const float v = bits_to_float(abs) * 16777216.0f;
    uint32_t m = uint32_t(v);
    const float rem = v - float(m);
    if (rem > 0.5f || (rem == 0.5f && (m & 1u))) ++m;
    return uint16_t(sign | m);
  }
  uint32_t m = abs + 0xc8000fffu + ((abs >> 13) & 1u);  // rebias exponent and round to even
  return uint16_t(sign | (m >> 13));
}

KARAKV_SCALAR_FN float bf16_to_float(uint16_t h) { return bits_to_float(uint32_t(h) << 16); }

KARAKV_SCALAR_FN uint16_t float_to_bf16(float f) {
  uint32_t x = float_to_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t((x >> 16) | 0x40u);  // quiet NaN
  x += 0x7fffu + ((x >> 16) & 1u);
  return uint16_t(x >> 16);
}

// Element i of a tensor in storage dtype `d`, widened to float, and the reverse.
inline float load_element(const void* base, size_t i, DType d) {
  switch (d) {
    case DType::kFloat16: return half_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::kBFloat16: return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    default: return static_cast<const float*>(base)[i];
  }
}

inline void store_element(void* base, size_t i, float v, DType d) {
  switch (d) {
    case DType::kFloat16: static_cast<uint16_t*>(base)[i] = float_to_half(v); break;
    case DType::kBFloat16: static_cast<uint16_t*>(base)[i] = float_to_bf16(v); break;
    default: static_cast<float*>(base)[i] = v; break;
  }
}

}  // namespace karakv::kernels

#undef KARAKV_SCALAR_FN
