// The scalar fp16/bf16 conversions in half.h against independent implementations: GCC's _Float16
// (libgcc soft-float, round to nearest even) for fp16, and integer/double arithmetic for bf16.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "karakv/kernels/half.h"

namespace karakv::kernels {
namespace {

// clang before 15 has no _Float16 on x86-64; the fp16 tests need it as their reference and run in
// every GCC build (the main tree and the ASan one), the bf16 tests everywhere.
#if defined(__clang__) && __clang_major__ < 15
#define KARAKV_HAVE_FLOAT16 0
#else
#define KARAKV_HAVE_FLOAT16 1
#endif

#if KARAKV_HAVE_FLOAT16
// volatile keeps GCC from folding the conversions at compile time: the runtime routine is the
// reference.
uint16_t gcc_float_to_half(float f) {
  volatile float in = f;
  _Float16 h = static_cast<_Float16>(in);
  uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}

float gcc_half_to_float(uint16_t b) {
  _Float16 h;
  std::memcpy(&h, &b, 2);
  volatile _Float16 in = h;
  return static_cast<float>(in);
}

bool is_nan_half(uint16_t h) { return (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0; }

TEST(HalfTest, HalfToFloatExhaustive) {
  for (uint32_t h = 0; h <= 0xffffu; ++h) {
    const float got = half_to_float(uint16_t(h));
    const float want = gcc_half_to_float(uint16_t(h));
    if (is_nan_half(uint16_t(h))) {
      ASSERT_TRUE(std::isnan(got)) << std::hex << h;
      ASSERT_EQ(std::signbit(got), std::signbit(want)) << std::hex << h;
    } else {
      ASSERT_EQ(float_to_bits(got), float_to_bits(want)) << std::hex << h;
    }
  }
}

void expect_float_to_half(uint32_t bits) {
  const float f = bits_to_float(bits);
  const uint16_t got = float_to_half(f);
  const uint16_t want = gcc_float_to_half(f);
  if (std::isnan(f)) {
    ASSERT_TRUE(is_nan_half(got)) << std::hex << bits << " -> " << got;
    ASSERT_EQ(got & 0x8000u, want & 0x8000u) << std::hex << bits;
  } else {
    ASSERT_EQ(got, want) << "float bits 0x" << std::hex << bits << " (" << f << ")";
  }
}

TEST(HalfTest, FloatToHalfEveryExponentAndRoundingBoundary) {
  // For every float exponent and sign: mantissas around every fp16 rounding boundary (the 13
  // dropped bits at 0, just below/at/above half, and all ones), which covers ties to even, carries
  // into the exponent, the normal/subnormal edge, overflow to infinity, and NaN/inf.
  const uint32_t low_patterns[] = {0x0000, 0x0001, 0x0fff, 0x1000, 0x1001, 0x1fff, 0x17ff, 0x0800};
  for (uint32_t sign = 0; sign < 2; ++sign) {
    for (uint32_t exp = 0; exp < 256; ++exp) {
      for (uint32_t hi = 0; hi < 1024; ++hi) {
        for (uint32_t low : low_patterns) {
          expect_float_to_half((sign << 31) | (exp << 23) | (hi << 13) | low);
          if (HasFatalFailure()) return;
        }
      }
    }
  }
}

TEST(HalfTest, FloatToHalfRandomAndFp16RangeSweep) {
  std::mt19937 rng(1234);
  for (int i = 0; i < 2'000'000; ++i) {
    expect_float_to_half(rng());
    if (HasFatalFailure()) return;
  }
  // Every float bit pattern of magnitude in the fp16 subnormal/normal range, with a stride.
  for (uint32_t bits = 0x33000000u; bits < 0x47800000u; bits += 97) {
    expect_float_to_half(bits);
    expect_float_to_half(bits | 0x80000000u);
    if (HasFatalFailure()) return;
  }
}
#else
TEST(HalfTest, Fp16AgainstFloat16) { GTEST_SKIP() << "no _Float16 in this compiler to check fp16 against"; }
#endif

// bf16 reference: round the float (exactly representable in double) to 8 significant bits by
// integer arithmetic on the bit pattern, ties to even; NaN stays NaN.
uint16_t reference_float_to_bf16(float f) {
  if (std::isnan(f)) return 0x7fc0u | (std::signbit(f) ? 0x8000u : 0);
  const uint32_t x = float_to_bits(f);
  const uint32_t upper = x >> 16;
  const uint32_t lower = x & 0xffffu;
  uint32_t r = upper;
  if (lower > 0x8000u || (lower == 0x8000u && (upper & 1u))) ++r;  // carries into exp/inf
  return uint16_t(r);
}

TEST(HalfTest, Bf16ToFloatExhaustiveAgainstDouble) {
  for (uint32_t h = 0; h <= 0xffffu; ++h) {
    const float got = bf16_to_float(uint16_t(h));
    const uint32_t exp = (h >> 7) & 0xffu;
    const uint32_t mant = h & 0x7fu;
    const double sign = (h & 0x8000u) ? -1.0 : 1.0;
    if (exp == 0xff) {
      if (mant == 0) {
        ASSERT_EQ(got, sign * INFINITY) << std::hex << h;
      } else {
        ASSERT_TRUE(std::isnan(got)) << std::hex << h;
      }
      continue;
    }
    const double want = exp == 0 ? sign * std::ldexp(double(mant), -133)
                                 : sign * std::ldexp(double(128 + mant), int(exp) - 134);
    ASSERT_EQ(double(got), want) << std::hex << h;
  }
}

TEST(HalfTest, FloatToBf16) {
  std::mt19937 rng(99);
  auto check = [](uint32_t bits) {
    const float f = bits_to_float(bits);
    const uint16_t got = float_to_bf16(f);
    const uint16_t want = reference_float_to_bf16(f);
    if (std::isnan(f)) {
      ASSERT_TRUE(std::isnan(bf16_to_float(got))) << std::hex << bits;
    } else {
      ASSERT_EQ(got, want) << std::hex << bits;
      // Independent check of round-to-nearest in double: no bf16 neighbour is closer.
      if (std::isfinite(bf16_to_float(got))) {
        const double err = std::fabs(double(bf16_to_float(got)) - double(f));
        const double up = std::fabs(double(bf16_to_float(uint16_t(got + 1))) - double(f));
        const double down = std::fabs(double(bf16_to_float(uint16_t(got - 1))) - double(f));
        if ((got & 0x7fffu) != 0x7f7fu && (got & 0x7fffu) != 0) {
          ASSERT_LE(err, up) << std::hex << bits;
          ASSERT_LE(err, down) << std::hex << bits;
        }
      }
    }
  };
  const uint32_t low_patterns[] = {0x0000, 0x0001, 0x7fff, 0x8000, 0x8001, 0xffff};
  for (uint32_t sign = 0; sign < 2; ++sign)
    for (uint32_t exp = 0; exp < 256; ++exp)
      for (uint32_t hi = 0; hi < 128; ++hi)
        for (uint32_t low : low_patterns) {
          check((sign << 31) | (exp << 23) | (hi << 16) | low);
          if (HasFatalFailure()) return;
        }
  for (int i = 0; i < 1'000'000; ++i) {
    check(rng());
    if (HasFatalFailure()) return;
  }
}

}  // namespace
}  // namespace karakv::kernels
