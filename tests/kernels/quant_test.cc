// The CPU quantization kernels (kernels/cpu/quant.h) against their definitions in
// docs/COMPRESSION.md section 3: runs are decoded here from the documented byte layout with the
// rotation built as an explicit matrix in float64, error bounds are derived from the methods, and
// the attention pieces are checked against float64 loops over the dequantized K and V.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "cpu/quant.h"
#include "karakv/kernels/half.h"

namespace karakv::kernels::test {
namespace {

using cpu::QuantFormat;

constexpr QuantFormat kAllFormats[] = {QuantFormat::kKivi2, QuantFormat::kKivi4, QuantFormat::kTq2, QuantFormat::kTq3,
                                       QuantFormat::kTq4};

bool is_kivi(QuantFormat f) { return f == QuantFormat::kKivi2 || f == QuantFormat::kKivi4; }
int bits_of(QuantFormat f) {
  switch (f) {
    case QuantFormat::kKivi2: case QuantFormat::kTq2: return 2;
    case QuantFormat::kTq3: return 3;
    default: return 4;
  }
}
std::string name_of(QuantFormat f) { return cpu::quant_format_name(f); }

// Lloyd-Max centroids of N(0, 1) from COMPRESSION.md, positive halves; the codebook is symmetric.
std::vector<double> centroids(int bits) {
  std::vector<double> half;
  if (bits == 2) half = {0.4528, 1.5104};
  if (bits == 3) half = {0.2451, 0.7560, 1.3439, 2.1519};
  if (bits == 4) half = {0.1284, 0.3880, 0.6568, 0.9423, 1.2562, 1.6180, 2.0690, 2.7326};
  std::vector<double> all;
  for (auto it = half.rbegin(); it != half.rend(); ++it) all.push_back(-*it);
  for (double c : half) all.push_back(c);
  return all;  // ascending: code k is entry k
}

// Lloyd-Max mean squared error of N(0, 1) per coordinate.
double lloyd_max_distortion(int bits) { return bits == 2 ? 0.1175 : bits == 3 ? 0.03454 : 0.009497; }

// ---- inputs -----------------------------------------------------------------------------------

enum class Input { kGaussian, kHeavyTailed };
std::string name_of(Input in) { return in == Input::kGaussian ? "Gaussian" : "HeavyTailed"; }

// Gaussian N(0, 1); or Student-t with 3 degrees of freedom whose channels 3 and d/2+5 are scaled
// by 100 (the outlier channels KIVI quantizes keys per channel for).
std::vector<float> make_input(Input in, int n, int d, std::mt19937& rng) {
  std::normal_distribution<double> normal(0.0, 1.0);
  std::chi_squared_distribution<double> chi2(3.0);
  std::vector<float> x(size_t(n) * d);
  for (int t = 0; t < n; ++t)
    for (int c = 0; c < d; ++c) {
      double v = normal(rng);
      if (in == Input::kHeavyTailed) {
        v /= std::sqrt(chi2(rng) / 3.0);
        if (c == 3 || c == d / 2 + 5) v *= 100.0;
      }
      x[size_t(t) * d + c] = float(v);
    }
  return x;
}

// ---- the documented layout, decoded independently ----------------------------------------------

float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return half_to_float(h);
}

// Code i of an LSB-first stream of `bits`-bit codes, bit by bit.
int code_at(const uint8_t* stream, int i, int bits) {
  int code = 0;
  for (int k = 0; k < bits; ++k) {
    const int bit = i * bits + k;
    code |= ((stream[bit / 8] >> (bit % 8)) & 1) << k;
  }
  return code;
}

struct KiviElement {
  double scale, zero;
  int code;
};

// KIVI key element (t, c): group record t / 32 = [scale d][zero d][codes d][32 * b / 8].
KiviElement kivi_key_element(const uint8_t* run, int d, int bits, int t, int c) {
  const uint8_t* rec = run + size_t(t / 32) * (4 * d + 4 * bits * d);
  return {half_at(rec + 2 * c), half_at(rec + 2 * (d + c)), code_at(rec + 4 * d + c * 4 * bits, t % 32, bits)};
}

// KIVI value element (t, c): token record t = [scale d/32][zero d/32][codes d * b / 8].
KiviElement kivi_value_element(const uint8_t* run, int d, int bits, int t, int c) {
  const int groups = d / 32;
  const uint8_t* rec = run + size_t(t) * (4 * groups + d * bits / 8);
  return {half_at(rec + 2 * (c / 32)), half_at(rec + 2 * (groups + c / 32)), code_at(rec + 4 * groups, c, bits)};
}

// Sign i of the rotation for `seed`, spelled as in quant.h.
double rotation_sign(uint64_t seed, int i) {
  uint64_t z = seed + uint64_t(i + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return (z >> 63) ? -1.0 : 1.0;
}

// R = H D / sqrt(d) as a dense [d][d] float64 matrix, H[i][j] = (-1)^popcount(i & j).
std::vector<double> rotation_matrix(int d, uint64_t seed) {
  std::vector<double> r(size_t(d) * d);
  for (int i = 0; i < d; ++i)
    for (int j = 0; j < d; ++j)
      r[size_t(i) * d + j] = (std::popcount(unsigned(i & j)) % 2 ? -1.0 : 1.0) * rotation_sign(seed, j) / std::sqrt(d);
  return r;
}

// x' of every token of a run decoded from the layout: KIVI code * scale + zero, TurboQuant
// norm * R^T c with c the centroids / sqrt(d).
std::vector<double> naive_dequantize(QuantFormat f, bool keys, const std::vector<uint8_t>& run, int n, int d,
                                     uint64_t seed) {
  const int bits = bits_of(f);
  std::vector<double> x(size_t(n) * d);
  if (is_kivi(f)) {
    for (int t = 0; t < n; ++t)
      for (int c = 0; c < d; ++c) {
        const KiviElement e = keys ? kivi_key_element(run.data(), d, bits, t, c) : kivi_value_element(run.data(), d, bits, t, c);
        x[size_t(t) * d + c] = e.code * e.scale + e.zero;
      }
    return x;
  }
  const std::vector<double> r = rotation_matrix(d, seed);
  const std::vector<double> table = centroids(bits);
  const size_t record = 2 + size_t(d) * bits / 8;
  for (int t = 0; t < n; ++t) {
    const uint8_t* rec = run.data() + t * record;
    const double norm = half_at(rec);
    for (int i = 0; i < d; ++i) {
      double sum = 0;
      for (int j = 0; j < d; ++j) sum += r[size_t(j) * d + i] * table[code_at(rec + 2, j, bits)] / std::sqrt(d);
      x[size_t(t) * d + i] = norm * sum;
    }
  }
  return x;
}

// ---- running the kernels ----------------------------------------------------------------------

std::vector<uint8_t> quantize(QuantFormat f, bool keys, const std::vector<float>& x, int n, int d, uint64_t seed) {
  std::vector<uint8_t> run(keys ? cpu::key_run_bytes(f, n, d) : cpu::value_run_bytes(f, n, d));
  EXPECT_GT(run.size(), 0u);
  const KernelStatus st = keys ? cpu::quantize_keys(f, x.data(), n, d, seed, run.data())
                               : cpu::quantize_values(f, x.data(), n, d, seed, run.data());
  EXPECT_TRUE(st.is_ok()) << st.message;
  return run;
}

std::vector<float> dequantize(QuantFormat f, bool keys, const std::vector<uint8_t>& run, int n, int d, uint64_t seed) {
  std::vector<float> x(size_t(n) * d, NAN);
  const KernelStatus st = keys ? cpu::dequantize_keys(f, run.data(), n, d, seed, x.data())
                               : cpu::dequantize_values(f, run.data(), n, d, seed, x.data());
  EXPECT_TRUE(st.is_ok()) << st.message;
  return x;
}

// ---- sizes ------------------------------------------------------------------------------------

TEST(QuantLayoutTest, RunBytesFollowTheDocumentedRecords) {
  // d = 64. KIVI keys: 32-token groups of 4d + 4bd bytes; KIVI values: tokens of d/8 + db/8 bytes;
  // TurboQuant: tokens of 2 + db/8 bytes.
  struct Case {
    QuantFormat f;
    size_t keys32, values32;
  };
  const Case cases[] = {{QuantFormat::kKivi2, 768, 768},
                        {QuantFormat::kKivi4, 1280, 1280},
                        {QuantFormat::kTq2, 576, 576},
                        {QuantFormat::kTq3, 832, 832},
                        {QuantFormat::kTq4, 1088, 1088}};
  for (const Case& c : cases) {
    SCOPED_TRACE(name_of(c.f));
    EXPECT_EQ(cpu::key_run_bytes(c.f, 32, 64), c.keys32);
    EXPECT_EQ(cpu::value_run_bytes(c.f, 32, 64), c.values32);
    EXPECT_EQ(cpu::key_run_bytes(c.f, 64, 64), 2 * c.keys32);
    EXPECT_EQ(cpu::value_run_bytes(c.f, 64, 64), 2 * c.values32);
    EXPECT_EQ(cpu::key_run_bytes(c.f, 0, 64), 0u);
    EXPECT_EQ(cpu::token_multiple(c.f), is_kivi(c.f) ? 32 : 1);
  }
  EXPECT_EQ(cpu::key_run_bytes(QuantFormat::kKivi2, 33, 64), 0u);  // not a whole key group
  EXPECT_EQ(cpu::value_run_bytes(QuantFormat::kKivi2, 33, 64), 33u * 24);
  EXPECT_EQ(cpu::key_run_bytes(QuantFormat::kKivi4, 32, 48), 0u);
  EXPECT_EQ(cpu::key_run_bytes(QuantFormat::kTq3, 1, 96), 0u);
  EXPECT_EQ(cpu::value_run_bytes(QuantFormat::kTq3, 1, 8), 5u);
  EXPECT_EQ(cpu::value_run_bytes(QuantFormat::kTq2, -1, 64), 0u);
  EXPECT_EQ(cpu::token_multiple(QuantFormat(9)), 0);
}

// Records are self-contained: the run of 64 tokens is the runs of [0, 32) and [32, 64) end to end.
TEST(QuantLayoutTest, RunsConcatenate) {
  std::mt19937 rng(7);
  const int d = 64;
  const std::vector<float> x = make_input(Input::kGaussian, 64, d, rng);
  const std::vector<float> first(x.begin(), x.begin() + 32 * d), second(x.begin() + 32 * d, x.end());
  for (QuantFormat f : kAllFormats)
    for (bool keys : {true, false}) {
      SCOPED_TRACE(name_of(f) + (keys ? " keys" : " values"));
      std::vector<uint8_t> joined = quantize(f, keys, first, 32, d, 11);
      const std::vector<uint8_t> tail = quantize(f, keys, second, 32, d, 11);
      joined.insert(joined.end(), tail.begin(), tail.end());
      EXPECT_EQ(quantize(f, keys, x, 64, d, 11), joined);
    }
}

// dequantize_* equals x' decoded here from the documented layout (TurboQuant through the explicit
// rotation matrix): checks the layout, the code order, the centroid table and the rotation.
TEST(QuantLayoutTest, DequantizeMatchesLayoutDecodedInFloat64) {
  std::mt19937 rng(3);
  {
    const int d = 64, n = 64;  // two KIVI key groups and two value groups per token
    const std::vector<float> x = make_input(Input::kHeavyTailed, n, d, rng);
    for (QuantFormat f : kAllFormats)
      for (bool keys : {true, false}) {
        SCOPED_TRACE(name_of(f) + (keys ? " keys" : " values"));
        const std::vector<uint8_t> run = quantize(f, keys, x, n, d, 1234);
        const std::vector<float> got = dequantize(f, keys, run, n, d, 1234);
        const std::vector<double> want = naive_dequantize(f, keys, run, n, d, 1234);
        for (size_t i = 0; i < want.size(); ++i)
          ASSERT_NEAR(got[i], want[i], 1e-5 * (1.0 + std::fabs(want[i]))) << "element " << i;
      }
  }
}

// ---- KIVI round trip --------------------------------------------------------------------------

class QuantKiviRoundTripTest : public ::testing::TestWithParam<std::tuple<QuantFormat, Input, int>> {};

// Per element, against its group's min m, max M and stored s, z (quant.h derives this):
//   |x - x'| <= s/2 + |m - z| + L*|s - (M - m)/L| + 2^-20 * (|x| + |z| + L*s)
// the last term a generous allowance for the fp32 rounding of (x - z)/s and code*s + z (a few
// 2^-24 relative). Also checks that s and z are the fp16 roundings the layout promises:
// |m - z| <= 2^-11 |m| + 2^-25 and |s - (M-m)/L| <= (2^-11 + 2^-20) (M-m)/L + 2^-25 (the 2^-20
// covers the fp32 subtraction and division before the fp16 rounding).
TEST_P(QuantKiviRoundTripTest, ErrorWithinHalfScalePlusFp16Slack) {
  const auto [f, input, d] = GetParam();
  const int bits = bits_of(f);
  const double levels = (1 << bits) - 1;
  const int n = 96;
  std::mt19937 rng(100 + d);
  const std::vector<float> x = make_input(input, n, d, rng);
  for (bool keys : {true, false}) {
    SCOPED_TRACE(keys ? "keys" : "values");
    const std::vector<uint8_t> run = quantize(f, keys, x, n, d, 0);
    const std::vector<float> back = dequantize(f, keys, run, n, d, 0);
    double worst_ratio = 0;  // max |x - x'| / (s/2) over elements with s > 0
    for (int t = 0; t < n; ++t)
      for (int c = 0; c < d; ++c) {
        // The group of (t, c): 32 tokens of channel c for keys, 32 channels of token t for values.
        double lo = INFINITY, hi = -INFINITY;
        for (int k = 0; k < 32; ++k) {
          const float v = keys ? x[size_t(t / 32 * 32 + k) * d + c] : x[size_t(t) * d + c / 32 * 32 + k];
          lo = std::min<double>(lo, v);
          hi = std::max<double>(hi, v);
        }
        const KiviElement e = keys ? kivi_key_element(run.data(), d, bits, t, c) : kivi_value_element(run.data(), d, bits, t, c);
        const double exact_scale = (hi - lo) / levels;
        ASSERT_LE(std::fabs(lo - e.zero), std::ldexp(std::fabs(lo), -11) + std::ldexp(1.0, -25));
        ASSERT_LE(std::fabs(e.scale - exact_scale), std::ldexp(exact_scale, -11) + std::ldexp(exact_scale, -20) + std::ldexp(1.0, -25));
        const double xv = x[size_t(t) * d + c];
        const double err = std::fabs(xv - double(back[size_t(t) * d + c]));
        const double bound = e.scale / 2 + std::fabs(lo - e.zero) + levels * std::fabs(e.scale - exact_scale) +
                             std::ldexp(std::fabs(xv) + std::fabs(e.zero) + levels * e.scale, -20);
        ASSERT_LE(err, bound) << "t " << t << " c " << c << " x " << xv << " scale " << e.scale << " zero " << e.zero;
        if (e.scale > 0) worst_ratio = std::max(worst_ratio, err / (e.scale / 2));
      }
    // The bound is tight: some element sits near a midpoint, and none exceeds s/2 by more than the
    // fp16 slack allows for these inputs.
    EXPECT_GT(worst_ratio, 0.9);
  }
}

INSTANTIATE_TEST_SUITE_P(
    QuantKiviFormats, QuantKiviRoundTripTest,
    ::testing::Combine(::testing::Values(QuantFormat::kKivi2, QuantFormat::kKivi4),
                       ::testing::Values(Input::kGaussian, Input::kHeavyTailed), ::testing::Values(32, 64, 128)),
    [](const auto& info) {
      return name_of(std::get<0>(info.param)) + "_" + name_of(std::get<1>(info.param)) + "_d" +
             std::to_string(std::get<2>(info.param));
    });

// A constant group has scale 0: every code is 0 and x' is the fp16 rounding of the constant.
TEST(QuantKiviTest, ConstantGroupHasZeroScaleAndCodes) {
  const int d = 32, n = 32;
  std::vector<float> x(size_t(n) * d, 0.1f);
  for (QuantFormat f : {QuantFormat::kKivi2, QuantFormat::kKivi4})
    for (bool keys : {true, false}) {
      const std::vector<uint8_t> run = quantize(f, keys, x, n, d, 0);
      const std::vector<float> back = dequantize(f, keys, run, n, d, 0);
      for (int t = 0; t < n; ++t)
        for (int c = 0; c < d; ++c) {
          const KiviElement e =
              keys ? kivi_key_element(run.data(), d, bits_of(f), t, c) : kivi_value_element(run.data(), d, bits_of(f), t, c);
          ASSERT_EQ(e.scale, 0.0);
          ASSERT_EQ(e.code, 0);
          ASSERT_EQ(back[size_t(t) * d + c], half_to_float(float_to_half(0.1f)));
        }
    }
}

// Min and max of a group are reproduced up to the fp16 slack, the codes span [0, L].
TEST(QuantKiviTest, ExtremesMapToEndCodes) {
  const int d = 32, n = 32;
  std::vector<float> x(size_t(n) * d);
  for (int t = 0; t < n; ++t)
    for (int c = 0; c < d; ++c) x[size_t(t) * d + c] = float(t - 8) * 0.25f + float(c);  // per channel: c-2 .. c+5.75
  for (QuantFormat f : {QuantFormat::kKivi2, QuantFormat::kKivi4}) {
    const std::vector<uint8_t> run = quantize(f, true, x, n, d, 0);
    for (int c = 0; c < d; ++c) {
      EXPECT_EQ(kivi_key_element(run.data(), d, bits_of(f), 0, c).code, 0);
      EXPECT_EQ(kivi_key_element(run.data(), d, bits_of(f), 31, c).code, (1 << bits_of(f)) - 1);
    }
  }
}

// ---- TurboQuant round trip ---------------------------------------------------------------------

// Relative MSE sum ||x - x'||^2 / sum ||x||^2 over many vectors.
double relative_mse(QuantFormat f, bool keys, const std::vector<float>& x, int n, int d, uint64_t seed) {
  const std::vector<float> back = dequantize(f, keys, quantize(f, keys, x, n, d, seed), n, d, seed);
  double err = 0, energy = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    err += (double(x[i]) - back[i]) * (double(x[i]) - back[i]);
    energy += double(x[i]) * x[i];
  }
  return err / energy;
}

// The rotated unit vector's coordinates are close to N(0, 1/d), so the relative error of x' is the
// Lloyd-Max distortion of N(0, 1) per unit variance (the fp16 norm adds ~2^-22): within 25%.
// Student-t inputs (no outlier channels) rotate to near-Gaussian coordinates as well. (Each
// vector's exact error, for any input, is checked by the next test.)
TEST(QuantTurboTest, RelativeMseMatchesLloydMaxDistortion) {
  const int n = 2000;
  for (int d : {64, 128})
    for (Input input : {Input::kGaussian, Input::kHeavyTailed}) {
      std::mt19937 rng(d);
      std::vector<float> x = make_input(input, n, d, rng);
      if (input == Input::kHeavyTailed) {  // Student-t without the outlier channels (next test)
        x = make_input(Input::kGaussian, n, d, rng);
        std::chi_squared_distribution<double> chi2(3.0);
        for (float& v : x) v = float(v / std::sqrt(chi2(rng) / 3.0));
      }
      double previous = INFINITY;
      for (QuantFormat f : {QuantFormat::kTq2, QuantFormat::kTq3, QuantFormat::kTq4})
        for (bool keys : {true, false}) {
          SCOPED_TRACE(name_of(f) + " d " + std::to_string(d) + " " + name_of(input));
          const double mse = relative_mse(f, keys, x, n, d, 99);
          const double want = lloyd_max_distortion(bits_of(f));
          EXPECT_NEAR(mse, want, 0.25 * want);
          if (keys) {
            EXPECT_LT(mse, previous);
            previous = mse;
          }
        }
    }
}

// Whatever the input, the method fixes each vector's error exactly: with v = sqrt(d) R x / ||x||
// and c_i the centroid nearest to v_i (over sqrt(d)), ||x - x'||^2 / ||x||^2 = ||u - c||^2 =: D_x
// up to the fp16 norm. That norm is ||x|| (1 + e) with |e| <= 2^-11, so the ratio is
// D_x - 2e <u - c, c> + e^2 ||c||^2, within 2^-10 sqrt(D_x) ||c|| + 2^-22 ||c||^2 of D_x (+1e-5 for
// fp32 arithmetic). Checked per vector on Gaussian inputs and on the heavy-tailed ones, whose two
// x100 channels make rotated vectors far from Gaussian (coordinates cluster near (+-a +- b)/sqrt(d));
// more bits must still help on average.
TEST(QuantTurboTest, ErrorIsTheNearestCentroidDistortionOfEachRotatedVector) {
  const int n = 300;
  const uint64_t seed = 42;
  for (int d : {64, 128})
    for (Input input : {Input::kGaussian, Input::kHeavyTailed}) {
      std::mt19937 rng(5 + d);
      const std::vector<float> x = make_input(input, n, d, rng);
      const std::vector<double> r = rotation_matrix(d, seed);
      double previous = INFINITY;
      for (QuantFormat f : {QuantFormat::kTq2, QuantFormat::kTq3, QuantFormat::kTq4}) {
        SCOPED_TRACE(name_of(f) + " d " + std::to_string(d) + " " + name_of(input));
        const std::vector<double> table = centroids(bits_of(f));
        const std::vector<float> back = dequantize(f, true, quantize(f, true, x, n, d, seed), n, d, seed);
        double sum_ratio = 0;
        for (int t = 0; t < n; ++t) {
          const float* xt = x.data() + size_t(t) * d;
          double norm = 0;
          for (int c = 0; c < d; ++c) norm += double(xt[c]) * xt[c];
          norm = std::sqrt(norm);
          double distortion = 0, c_norm2 = 0, err = 0;
          for (int i = 0; i < d; ++i) {
            double v = 0;
            for (int j = 0; j < d; ++j) v += r[size_t(i) * d + j] * xt[j];
            v *= std::sqrt(d) / norm;
            double nearest = table[0];
            for (double c : table)
              if (std::fabs(v - c) < std::fabs(v - nearest)) nearest = c;
            distortion += (v - nearest) * (v - nearest) / d;
            c_norm2 += nearest * nearest / d;
            err += (double(xt[i]) - back[size_t(t) * d + i]) * (double(xt[i]) - back[size_t(t) * d + i]);
          }
          const double ratio = err / (norm * norm);
          const double tol = std::ldexp(std::sqrt(distortion * c_norm2), -10) + std::ldexp(c_norm2, -22) + 1e-5;
          ASSERT_NEAR(ratio, distortion, tol) << "token " << t;
          sum_ratio += ratio;
        }
        EXPECT_LT(sum_ratio / n, previous);
        previous = sum_ratio / n;
      }
    }
}

TEST(QuantTurboTest, ZeroVectorStoresZeroNormAndDequantizesToZero) {
  const int d = 64;
  std::mt19937 rng(1);
  std::vector<float> x = make_input(Input::kGaussian, 3, d, rng);
  std::fill(x.begin() + d, x.begin() + 2 * d, 0.0f);  // token 1 is zero
  for (QuantFormat f : {QuantFormat::kTq2, QuantFormat::kTq3, QuantFormat::kTq4}) {
    const std::vector<uint8_t> run = quantize(f, true, x, 3, d, 5);
    const size_t record = 2 + size_t(d) * bits_of(f) / 8;
    EXPECT_EQ(half_at(run.data() + record), 0.0f);
    const std::vector<float> back = dequantize(f, true, run, 3, d, 5);
    for (int c = 0; c < d; ++c) ASSERT_EQ(back[d + c], 0.0f);
    std::vector<float> q(d, 1.0f), scores(3);
    ASSERT_TRUE(cpu::quantized_key_scores(f, run.data(), 3, d, 5, q.data(), 1.0f, scores.data()).is_ok());
    EXPECT_EQ(scores[1], 0.0f);
  }
}

TEST(QuantTurboTest, BitExactGivenTheSeedAndSeedsDiffer) {
  const int n = 16, d = 128;
  std::mt19937 rng(2);
  const std::vector<float> x = make_input(Input::kGaussian, n, d, rng);
  for (QuantFormat f : {QuantFormat::kTq2, QuantFormat::kTq3, QuantFormat::kTq4}) {
    EXPECT_EQ(quantize(f, true, x, n, d, 77), quantize(f, true, x, n, d, 77));
    EXPECT_EQ(quantize(f, false, x, n, d, 77), quantize(f, true, x, n, d, 77));  // K and V share the format
    EXPECT_NE(quantize(f, true, x, n, d, 77), quantize(f, true, x, n, d, 78));
  }
  // Different seeds: different sign vectors, hence different rotations of the same vector.
  std::vector<float> a(d), b(d);
  const std::vector<float> v = make_input(Input::kGaussian, 1, d, rng);
  ASSERT_TRUE(cpu::hadamard_rotate(v.data(), d, 1, a.data()).is_ok());
  ASSERT_TRUE(cpu::hadamard_rotate(v.data(), d, 2, b.data()).is_ok());
  EXPECT_NE(a, b);
  int differing_signs = 0;
  for (int i = 0; i < d; ++i) differing_signs += rotation_sign(1, i) != rotation_sign(2, i);
  EXPECT_GT(differing_signs, d / 4);
}

// hadamard_rotate is R x with R built here as a matrix; R is orthogonal (rotated basis vectors are
// orthonormal, norms are preserved) and hadamard_unrotate inverts it, also in place.
TEST(QuantTurboTest, RotationIsTheDocumentedOrthogonalMatrix) {
  std::mt19937 rng(4);
  for (int d : {1, 2, 8, 64, 128, 256}) {
    SCOPED_TRACE("d " + std::to_string(d));
    const uint64_t seed = 0xC0FFEEull + d;
    const std::vector<double> r = rotation_matrix(d, seed);
    const std::vector<float> x = make_input(Input::kGaussian, 1, d, rng);
    std::vector<float> y(d), back(d);
    ASSERT_TRUE(cpu::hadamard_rotate(x.data(), d, seed, y.data()).is_ok());
    double norm_x = 0, norm_y = 0;
    for (int i = 0; i < d; ++i) {
      double want = 0;
      for (int j = 0; j < d; ++j) want += r[size_t(i) * d + j] * x[j];
      ASSERT_NEAR(y[i], want, 1e-5 * (1 + std::fabs(want)));
      norm_x += double(x[i]) * x[i];
      norm_y += double(y[i]) * y[i];
    }
    EXPECT_NEAR(norm_y, norm_x, 1e-5 * norm_x);
    ASSERT_TRUE(cpu::hadamard_unrotate(y.data(), d, seed, back.data()).is_ok());
    for (int i = 0; i < d; ++i) ASSERT_NEAR(back[i], x[i], 1e-5 * (1 + std::fabs(x[i])));
    std::vector<float> in_place = x;
    ASSERT_TRUE(cpu::hadamard_rotate(in_place.data(), d, seed, in_place.data()).is_ok());
    EXPECT_EQ(in_place, y);
    ASSERT_TRUE(cpu::hadamard_unrotate(in_place.data(), d, seed, in_place.data()).is_ok());
    EXPECT_EQ(in_place, back);
    // Columns R e_j are orthonormal.
    std::vector<std::vector<float>> cols(d, std::vector<float>(d));
    for (int j = 0; j < d; ++j) {
      std::vector<float> e(d, 0.0f);
      e[j] = 1.0f;
      ASSERT_TRUE(cpu::hadamard_rotate(e.data(), d, seed, cols[j].data()).is_ok());
    }
    for (int i = 0; i < d; ++i)
      for (int j = 0; j < d; ++j) {
        double dot = 0;
        for (int k = 0; k < d; ++k) dot += double(cols[i][k]) * cols[j][k];
        ASSERT_NEAR(dot, i == j ? 1.0 : 0.0, 1e-6);
      }
  }
}

// The CUDA backend repeats the reference's fp32 operations to be bit exact with it, so the CPU's
// rotation must be exactly the documented butterflies (x[j] = a + b, x[j + h] = a - b for h = 1, 2,
// 4, ...) in fp32, whatever instructions it runs them with, then the 1/sqrt(d) scaling.
TEST(QuantTurboTest, RotationIsBitExactlyTheScalarButterflies) {
  std::mt19937 rng(11);
  for (int d : {8, 16, 64, 128, 512}) {
    SCOPED_TRACE("d " + std::to_string(d));
    const uint64_t seed = 0xBEEFull + d;
    const std::vector<float> x = make_input(Input::kGaussian, 1, d, rng);
    std::vector<float> want(d), got(d);
    for (int c = 0; c < d; ++c) want[c] = x[c] * float(rotation_sign(seed, c));
    for (int h = 1; h < d; h <<= 1)
      for (int i = 0; i < d; i += 2 * h)
        for (int j = i; j < i + h; ++j) {
          const float a = want[j], b = want[j + h];
          want[j] = a + b;
          want[j + h] = a - b;
        }
    const float inv_sqrt_d = 1.0f / std::sqrt(float(d));
    for (int c = 0; c < d; ++c) want[c] *= inv_sqrt_d;
    ASSERT_TRUE(cpu::hadamard_rotate(x.data(), d, seed, got.data()).is_ok());
    for (int c = 0; c < d; ++c) ASSERT_EQ(got[c], want[c]) << "coordinate " << c;
  }
}

// ---- attention pieces --------------------------------------------------------------------------

// A refusal with its code and the words that say why.
void expect_invalid(const KernelStatus& st, const std::string& mentions) {
  EXPECT_EQ(st.code, KernelStatus::Code::kInvalidArgument) << st.message;
  EXPECT_NE(st.message.find(mentions), std::string::npos) << st.message;
}

class QuantAttentionTest : public ::testing::TestWithParam<std::tuple<QuantFormat, int>> {};

// scores[t] = scale * q . k'_t with k' from dequantize_keys, in float64. Tolerance 1e-5 relative
// to the magnitude of the terms the kernel sums (fp32 sums of d terms err ~d * 2^-24 of it):
// KIVI sum_c |q_c| (|z_c| + L s_c) (q*s times codes plus q*z), TurboQuant ||q|| ||k'_t|| (the
// rotated q against norm * centroid / sqrt(d), bounded by Cauchy-Schwarz).
TEST_P(QuantAttentionTest, KeyScoresEqualScaledDotWithDequantizedKeys) {
  const auto [f, d] = GetParam();
  const int n = 96;
  const float scale = 0.125f;
  const uint64_t seed = 2024;
  std::mt19937 rng(d * 3 + int(f));
  for (Input input : {Input::kGaussian, Input::kHeavyTailed}) {
    SCOPED_TRACE(name_of(input));
    const std::vector<float> x = make_input(input, n, d, rng);
    const std::vector<float> q = make_input(Input::kGaussian, 1, d, rng);
    const std::vector<uint8_t> run = quantize(f, true, x, n, d, seed);
    const std::vector<float> k = dequantize(f, true, run, n, d, seed);
    std::vector<float> scores(n, NAN);
    ASSERT_TRUE(cpu::quantized_key_scores(f, run.data(), n, d, seed, q.data(), scale, scores.data()).is_ok());
    double q_norm = 0;
    for (float v : q) q_norm += double(v) * v;
    q_norm = std::sqrt(q_norm);
    for (int t = 0; t < n; ++t) {
      double want = 0, magnitude = 0, k_norm = 0;
      for (int c = 0; c < d; ++c) {
        want += double(q[c]) * k[size_t(t) * d + c];
        k_norm += double(k[size_t(t) * d + c]) * k[size_t(t) * d + c];
        if (is_kivi(f)) {
          const KiviElement e = kivi_key_element(run.data(), d, bits_of(f), t, c);
          magnitude += std::fabs(q[c]) * (std::fabs(e.zero) + ((1 << bits_of(f)) - 1) * e.scale);
        }
      }
      if (!is_kivi(f)) magnitude = q_norm * std::sqrt(k_norm);
      want *= scale;
      ASSERT_NEAR(scores[t], want, 1e-5 * scale * magnitude + 1e-30) << "token " << t;
    }
  }
}

// out = out0 + sum_t p_t v'_t with v' from dequantize_values, in float64; out0 is kept. Tolerance
// 1e-5 relative to |out0_c| + sum_t |p_t| * (KIVI: |z| + L s of the element; TurboQuant ||v'_t||,
// which bounds each coordinate of the rotated accumulator and of its de-rotation).
TEST_P(QuantAttentionTest, ValueAccumulateEqualsWeightedSumOfDequantizedValues) {
  const auto [f, d] = GetParam();
  const int n = 96;
  const uint64_t seed = 31337;
  std::mt19937 rng(d * 5 + int(f));
  for (Input input : {Input::kGaussian, Input::kHeavyTailed}) {
    SCOPED_TRACE(name_of(input));
    const std::vector<float> x = make_input(input, n, d, rng);
    std::vector<float> p(n);
    std::uniform_real_distribution<float> prob(0.0f, 1.0f);
    for (float& v : p) v = prob(rng);
    p[5] = 0.0f;
    const std::vector<uint8_t> run = quantize(f, false, x, n, d, seed);
    const std::vector<float> v = dequantize(f, false, run, n, d, seed);
    const std::vector<float> out0 = make_input(Input::kGaussian, 1, d, rng);
    std::vector<float> out = out0;
    ASSERT_TRUE(cpu::quantized_value_accumulate(f, run.data(), n, d, seed, p.data(), out.data()).is_ok());
    for (int c = 0; c < d; ++c) {
      double want = out0[c], magnitude = std::fabs(out0[c]);
      for (int t = 0; t < n; ++t) {
        want += double(p[t]) * v[size_t(t) * d + c];
        if (is_kivi(f)) {
          const KiviElement e = kivi_value_element(run.data(), d, bits_of(f), t, c);
          magnitude += p[t] * (std::fabs(e.zero) + ((1 << bits_of(f)) - 1) * e.scale);
        } else {
          double norm = 0;
          for (int j = 0; j < d; ++j) norm += double(v[size_t(t) * d + j]) * v[size_t(t) * d + j];
          magnitude += p[t] * std::sqrt(norm);
        }
      }
      ASSERT_NEAR(out[c], want, 1e-5 * magnitude) << "channel " << c;
    }
  }
}

// The multi-head scorers (the query heads of one KV head, codes decoded once for all) give each
// head exactly, bit for bit, what the one-head call with that head's row gives (which the two
// tests above check against float64), rows `stride` apart with the gaps untouched, zero weights
// included.
TEST_P(QuantAttentionTest, HeadsGiveEachHeadWhatItsOwnCallGives) {
  const auto [f, d] = GetParam();
  const int n = 96;
  const uint64_t seed = 99;
  std::mt19937 rng(d * 7 + int(f));
  const std::vector<float> x = make_input(Input::kGaussian, n, d, rng);
  const std::vector<uint8_t> keys = quantize(f, true, x, n, d, seed), values = quantize(f, false, x, n, d, seed);
  for (int heads : {1, 2, 3, 8}) {
    SCOPED_TRACE("heads " + std::to_string(heads));
    const size_t stride = n + 5;
    const std::vector<float> q = make_input(Input::kGaussian, heads, d, rng);
    std::vector<float> scores(heads * stride, -7.0f);
    ASSERT_TRUE(cpu::quantized_key_scores_heads(f, keys.data(), n, d, seed, q.data(), heads, 0.25f, scores.data(),
                                                stride).is_ok());
    std::vector<float> p(heads * stride, -9.0f), out(size_t(heads) * d, 0.5f);
    for (int m = 0; m < heads; ++m)
      for (int t = 0; t < n; ++t) p[m * stride + t] = (t + m) % 4 == 0 ? 0.0f : std::abs(scores[m * stride + t]);
    ASSERT_TRUE(cpu::quantized_value_accumulate_heads(f, values.data(), n, d, seed, p.data(), heads, stride,
                                                      out.data()).is_ok());
    for (int m = 0; m < heads; ++m) {
      std::vector<float> one(n), one_out(d, 0.5f);
      ASSERT_TRUE(cpu::quantized_key_scores(f, keys.data(), n, d, seed, q.data() + size_t(m) * d, 0.25f, one.data())
                      .is_ok());
      for (int t = 0; t < n; ++t) ASSERT_EQ(scores[m * stride + t], one[t]) << "head " << m << " token " << t;
      for (size_t t = n; t < stride; ++t) ASSERT_EQ(scores[m * stride + t], -7.0f) << "gap written";
      ASSERT_TRUE(cpu::quantized_value_accumulate(f, values.data(), n, d, seed, p.data() + m * stride, one_out.data())
                      .is_ok());
      for (int c = 0; c < d; ++c) ASSERT_EQ(out[size_t(m) * d + c], one_out[c]) << "head " << m << " channel " << c;
    }
  }
  std::vector<float> q(2 * d), scores(2 * n);
  expect_invalid(cpu::quantized_key_scores_heads(f, keys.data(), n, d, seed, q.data(), 0, 1.0f, scores.data(), n),
                 "heads 0 must be >= 1");
  expect_invalid(cpu::quantized_value_accumulate_heads(f, values.data(), n, d, seed, scores.data(), 2, n - 1,
                                                       q.data()),
                 "stride 95 must be >= n 96");
}

INSTANTIATE_TEST_SUITE_P(QuantAllFormats, QuantAttentionTest,
                         ::testing::Combine(::testing::ValuesIn(kAllFormats), ::testing::Values(64, 128)),
                         [](const auto& info) {
                           return name_of(std::get<0>(info.param)) + "_d" + std::to_string(std::get<1>(info.param));
                         });

// ---- invalid arguments -------------------------------------------------------------------------

TEST(QuantInvalidArgumentTest, HeadDimTokenCountAndPointers) {
  const int n = 32, d = 64;
  std::vector<float> x(size_t(n) * 256, 1.0f), q(256, 1.0f), scores(n), p(n, 1.0f), out(256);
  std::vector<uint8_t> run(1 << 16, 0);
  for (QuantFormat f : {QuantFormat::kKivi2, QuantFormat::kKivi4})
    for (int bad_d : {0, 16, 48, 100, 8192}) {
      SCOPED_TRACE(name_of(f) + " d " + std::to_string(bad_d));
      expect_invalid(cpu::quantize_keys(f, x.data(), n, bad_d, 0, run.data()), "head_dim " + std::to_string(bad_d));
      expect_invalid(cpu::quantize_values(f, x.data(), n, bad_d, 0, run.data()), "multiple of 32");
      expect_invalid(cpu::dequantize_values(f, run.data(), n, bad_d, 0, x.data()), "head_dim");
      expect_invalid(cpu::quantized_key_scores(f, run.data(), n, bad_d, 0, q.data(), 1, scores.data()), "head_dim");
    }
  for (QuantFormat f : {QuantFormat::kTq2, QuantFormat::kTq3, QuantFormat::kTq4})
    for (int bad_d : {0, 4, 48, 96, 8192}) {
      SCOPED_TRACE(name_of(f) + " d " + std::to_string(bad_d));
      expect_invalid(cpu::quantize_keys(f, x.data(), n, bad_d, 0, run.data()), "power of two");
      expect_invalid(cpu::quantize_values(f, x.data(), n, bad_d, 0, run.data()), "head_dim " + std::to_string(bad_d));
      expect_invalid(cpu::dequantize_keys(f, run.data(), n, bad_d, 0, x.data()), "head_dim");
      expect_invalid(cpu::quantized_value_accumulate(f, run.data(), n, bad_d, 0, p.data(), out.data()), "head_dim");
    }
  for (QuantFormat f : {QuantFormat::kKivi2, QuantFormat::kKivi4}) {
    expect_invalid(cpu::quantize_keys(f, x.data(), 33, d, 0, run.data()), "n 33");
    expect_invalid(cpu::dequantize_keys(f, run.data(), 31, d, 0, x.data()), "n 31");
    expect_invalid(cpu::quantized_key_scores(f, run.data(), 40, d, 0, q.data(), 1, scores.data()), "multiple of 32");
    EXPECT_TRUE(cpu::quantize_values(f, x.data(), 3, d, 0, run.data()).is_ok());  // values are per token
  }
  for (QuantFormat f : kAllFormats) {
    SCOPED_TRACE(name_of(f));
    expect_invalid(cpu::quantize_keys(f, x.data(), -1, d, 0, run.data()), "n -1");
    expect_invalid(cpu::quantize_keys(f, nullptr, n, d, 0, run.data()), "x is null");
    expect_invalid(cpu::quantize_values(f, x.data(), n, d, 0, nullptr), "run is null");
    expect_invalid(cpu::dequantize_keys(f, nullptr, n, d, 0, x.data()), "run is null");
    expect_invalid(cpu::dequantize_values(f, run.data(), n, d, 0, nullptr), "x is null");
    expect_invalid(cpu::quantized_key_scores(f, run.data(), n, d, 0, nullptr, 1, scores.data()), "q is null");
    expect_invalid(cpu::quantized_key_scores(f, run.data(), n, d, 0, q.data(), 1, nullptr), "scores is null");
    expect_invalid(cpu::quantized_key_scores(f, run.data(), n, d, 0, q.data(), NAN, scores.data()), "scale");
    expect_invalid(cpu::quantized_value_accumulate(f, run.data(), n, d, 0, nullptr, out.data()), "p is null");
    expect_invalid(cpu::quantized_value_accumulate(f, run.data(), n, d, 0, p.data(), nullptr), "out is null");
    // n = 0 touches nothing and needs no pointers.
    EXPECT_TRUE(cpu::quantize_keys(f, nullptr, 0, d, 0, nullptr).is_ok());
  }
  expect_invalid(cpu::quantize_keys(QuantFormat(9), x.data(), n, d, 0, run.data()), "format 9");
  expect_invalid(cpu::hadamard_rotate(x.data(), 96, 0, out.data()), "d 96");
  expect_invalid(cpu::hadamard_rotate(nullptr, 64, 0, out.data()), "x is null");
  expect_invalid(cpu::hadamard_unrotate(x.data(), 64, 0, nullptr), "x is null");
}

// Values fp16 cannot hold (KIVI's zero point, TurboQuant's norm) and non-finite inputs are
// rejected before anything is written.
TEST(QuantInvalidArgumentTest, InputsOutsideFp16RangeWriteNothing) {
  const int n = 32, d = 64;
  for (QuantFormat f : kAllFormats)
    for (float bad : {NAN, INFINITY, 70000.0f}) {
      SCOPED_TRACE(name_of(f) + " " + std::to_string(bad));
      std::vector<float> x(size_t(n) * d, 1.0f);
      x[size_t(17) * d + 9] = bad;
      std::vector<uint8_t> run(cpu::key_run_bytes(f, n, d), 0xAB);
      const KernelStatus st = cpu::quantize_keys(f, x.data(), n, d, 0, run.data());
      expect_invalid(st, is_kivi(f) ? "x[17][9]" : "||x[17]||");
      EXPECT_TRUE(std::all_of(run.begin(), run.end(), [](uint8_t b) { return b == 0xAB; }));
    }
  // A norm over 65504 from in-range elements: 64 elements of 9000 have norm 72000.
  std::vector<float> x(size_t(n) * d, 9000.0f);
  std::vector<uint8_t> tq_run(cpu::value_run_bytes(QuantFormat::kTq4, n, d));
  expect_invalid(cpu::quantize_values(QuantFormat::kTq4, x.data(), n, d, 0, tq_run.data()), "||x[0]||");
  std::vector<uint8_t> kivi_run(cpu::value_run_bytes(QuantFormat::kKivi4, n, d));
  EXPECT_TRUE(cpu::quantize_values(QuantFormat::kKivi4, x.data(), n, d, 0, kivi_run.data()).is_ok());
}

// ---- CaM (version 2, the convex normalised merge) ---------------------------------------------

// Worked by hand. Five slots, kept {1, 3}, d = 2, a = (2, 1, 4, 3, 0.5),
//   V0 = (2, 0), V1 = (4, 8), V2 = (1, -2), V3 = (0, 4), V4 = (16, 16).
// M = 2:
//   e = 0: T = {1, 3}, mean = (1 + 3)/2 = 2, p = min(1, 2/2) = 1, c = p a_e / |T| = 1 * 2 / 2 = 1.
//   e = 2: T = {3} (one follows), mean = 3, p = min(1, 4/3) = 1, c = 4.
//   e = 4: none follow, T = the last 2 kept = {1, 3}, mean = 2, p = 0.5/2 = 0.25, c = 0.25 * 0.5 / 2
//          = 1/16.
//   V'1 = (1*(4, 8) + 1*(2, 0) + (1/16)*(16, 16)) / (1 + 1 + 1/16) = (7, 9) / (33/16)
//       = (112/33, 144/33)
//   V'3 = (3*(0, 4) + 1*(2, 0) + 4*(1, -2) + (1/16)*(16, 16)) / (3 + 1 + 4 + 1/16) = (7, 5) / (129/16)
//       = (112/129, 80/129)
// M = 8 (more than the 2 kept): every T is the same as with M = 2, so the same result.
// M = 1:
//   e = 0: T = {1}, mean = 1, p = min(1, 2/1) = 1, c = 2.   e = 2: T = {3}, p = 1, c = 4.
//   e = 4: T = {3} (the last 1 kept), mean = 3, p = 0.5/3 = 1/6, c = (1/6) * 0.5 = 1/12.
//   V'1 = (1*(4, 8) + 2*(2, 0)) / (1 + 2) = (8/3, 8/3)
//   V'3 = (3*(0, 4) + 4*(1, -2) + (1/12)*(16, 16)) / (3 + 4 + 1/12) = (16/3, 16/3) / (85/12)
//       = (64/85, 64/85)
TEST(CamMergeTest, HandCheckedCase) {
  const float scores[5] = {2, 1, 4, 3, 0.5f};
  const int32_t kept[2] = {1, 3};
  const float values[10] = {2, 0, 4, 8, 1, -2, 0, 4, 16, 16};
  auto merged = [&](int M) {
    std::vector<float> out(4, -1.0f);
    EXPECT_TRUE(cpu::cam_merge(scores, 5, kept, 2, M, values, 2, out.data()).is_ok());
    return out;
  };
  for (int M : {2, 8}) {
    const std::vector<float> out = merged(M);
    EXPECT_FLOAT_EQ(out[0], float(112.0 / 33)) << "M " << M;
    EXPECT_FLOAT_EQ(out[1], float(144.0 / 33)) << "M " << M;
    EXPECT_FLOAT_EQ(out[2], float(112.0 / 129)) << "M " << M;
    EXPECT_FLOAT_EQ(out[3], float(80.0 / 129)) << "M " << M;
  }
  const std::vector<float> out = merged(1);
  EXPECT_FLOAT_EQ(out[0], float(8.0 / 3));
  EXPECT_FLOAT_EQ(out[1], float(8.0 / 3));
  EXPECT_FLOAT_EQ(out[2], float(64.0 / 85));
  EXPECT_FLOAT_EQ(out[3], float(64.0 / 85));
}

// The zero-mass rule: when the targets' scores are all 0, p_e = 1 for an evicted token with a_e > 0,
// so a kept token of score 0 becomes exactly the (weighted mean of the) value(s) it absorbs; an
// evicted token of score 0 (or negative, NaN, infinite: read as 0) lends nothing.
TEST(CamMergeTest, ZeroTargetMassTakesTheEvictedValue) {
  const int32_t kept[1] = {0};
  const float values[6] = {1, 1, 3, -1, 5, 5};  // V0, V1, V2
  std::vector<float> out(2);
  // a = (0, 2, 0): T(1) = T(2) = {0}, mean 0; c_1 = 1 * 2 / 1 = 2, c_2 = 0.
  // V'0 = (0 * V0 + 2 * V1 + 0 * V2) / (0 + 2) = V1.
  const float some[3] = {0, 2, 0};
  ASSERT_TRUE(cpu::cam_merge(some, 3, kept, 1, 4, values, 2, out.data()).is_ok());
  EXPECT_EQ(out, (std::vector<float>{3, -1}));
  // a = (0, 2, 6): c_1 = 2, c_2 = 6: V'0 = (2 V1 + 6 V2) / 8 = (36, 28) / 8 = (4.5, 3.5).
  const float both[3] = {0, 2, 6};
  ASSERT_TRUE(cpu::cam_merge(both, 3, kept, 1, 4, values, 2, out.data()).is_ok());
  EXPECT_EQ(out, (std::vector<float>{4.5f, 3.5f}));
  // Every score 0 or read as 0: the denominator is 0 and V0 stays as it is.
  for (float bad : {0.0f, -3.0f, NAN, INFINITY, -INFINITY}) {
    const float none[3] = {0, bad, 0};
    ASSERT_TRUE(cpu::cam_merge(none, 3, kept, 1, 4, values, 2, out.data()).is_ok());
    EXPECT_EQ(out, (std::vector<float>{1, 1})) << "a_e " << bad;
  }
  // A negative or non-finite kept score is 0 too: V'0 = V1 as in the first case.
  for (float bad : {-3.0f, NAN, INFINITY}) {
    const float s[3] = {bad, 2, 0};
    ASSERT_TRUE(cpu::cam_merge(s, 3, kept, 1, 4, values, 2, out.data()).is_ok());
    EXPECT_EQ(out, (std::vector<float>{3, -1})) << "a_k " << bad;
  }
}

// T(e) as kept indices, from the contract text, for the property tests below.
std::vector<int> cam_targets(const std::vector<int32_t>& kept, int e, int M) {
  std::vector<int> t;
  for (int i = 0; i < int(kept.size()) && int(t.size()) < M; ++i)
    if (kept[i] > e) t.push_back(i);
  if (t.empty())
    for (int i = std::max(0, int(kept.size()) - M); i < int(kept.size()); ++i) t.push_back(i);
  return t;
}

// A convex combination: every channel of V'_k lies between the smallest and the largest value of
// that channel among V_k and the V_e it absorbs (so no norm grows either); equal inputs are a
// fixed point, bit for bit; a kept token that absorbs nothing is copied bit for bit.
TEST(CamMergeTest, ConvexCombinationProperties) {
  const int n = 96, d = 64;
  for (uint32_t seed = 1; seed <= 40; ++seed) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> exponent(-6, 6);
    const int num_kept = 1 + int(rng() % n), M = 1 + int(rng() % 40);
    std::vector<int32_t> slots(n);
    std::iota(slots.begin(), slots.end(), 0);
    std::shuffle(slots.begin(), slots.end(), rng);
    std::vector<int32_t> kept(slots.begin(), slots.begin() + num_kept);
    std::sort(kept.begin(), kept.end());
    std::vector<float> scores(n);
    for (float& a : scores) a = rng() % 4 == 0 ? 0.0f : std::pow(10.0f, exponent(rng));
    std::vector<float> values = make_input(Input::kHeavyTailed, n, d, rng);
    std::vector<float> out(size_t(num_kept) * d);
    ASSERT_TRUE(cpu::cam_merge(scores.data(), n, kept.data(), num_kept, M, values.data(), d, out.data()).is_ok());
    std::vector<float> lo(size_t(num_kept) * d), hi(size_t(num_kept) * d);
    std::vector<bool> absorbs(num_kept, false);
    for (int i = 0; i < num_kept; ++i)
      for (int c = 0; c < d; ++c) lo[size_t(i) * d + c] = hi[size_t(i) * d + c] = values[size_t(kept[i]) * d + c];
    for (int e = 0; e < n; ++e) {
      if (std::binary_search(kept.begin(), kept.end(), e)) continue;
      for (int i : cam_targets(kept, e, M)) {
        absorbs[i] = absorbs[i] || scores[e] > 0;
        for (int c = 0; c < d; ++c) {
          lo[size_t(i) * d + c] = std::min(lo[size_t(i) * d + c], values[size_t(e) * d + c]);
          hi[size_t(i) * d + c] = std::max(hi[size_t(i) * d + c], values[size_t(e) * d + c]);
        }
      }
    }
    for (int i = 0; i < num_kept; ++i)
      for (int c = 0; c < d; ++c) {
        const size_t j = size_t(i) * d + c;
        if (!absorbs[i]) {
          ASSERT_EQ(out[j], values[size_t(kept[i]) * d + c]) << "seed " << seed << " kept " << i;
        }
        ASSERT_GE(out[j], lo[j]) << "seed " << seed << " kept " << i << " channel " << c;
        ASSERT_LE(out[j], hi[j]) << "seed " << seed << " kept " << i << " channel " << c;
      }
    // Every slot holding the same vector: the merge returns it unchanged.
    for (int t = 1; t < n; ++t) std::copy_n(values.begin(), d, values.begin() + size_t(t) * d);
    ASSERT_TRUE(cpu::cam_merge(scores.data(), n, kept.data(), num_kept, M, values.data(), d, out.data()).is_ok());
    for (int i = 0; i < num_kept; ++i)
      for (int c = 0; c < d; ++c) ASSERT_EQ(out[size_t(i) * d + c], values[c]) << "seed " << seed;
  }
}

TEST(CamMergeTest, InvalidArguments) {
  const float scores[4] = {1, 1, 1, 1}, v[16] = {};
  const int32_t kept[2] = {0, 2}, unsorted[2] = {2, 0}, outside[2] = {1, 4};
  float out[8];
  expect_invalid(cpu::cam_merge(scores, 4, kept, 2, 0, v, 4, out), "merge_tokens 0");
  expect_invalid(cpu::cam_merge(scores, -1, kept, 0, 2, v, 4, out), "n -1");
  expect_invalid(cpu::cam_merge(scores, 4, kept, 5, 2, v, 4, out), "num_kept 5");
  expect_invalid(cpu::cam_merge(scores, 4, kept, 2, 2, v, 0, out), "d 0");
  expect_invalid(cpu::cam_merge(scores, 4, unsorted, 2, 2, v, 4, out), "kept[1]");
  expect_invalid(cpu::cam_merge(scores, 4, outside, 2, 2, v, 4, out), "kept[1] = 4");
  expect_invalid(cpu::cam_merge(nullptr, 4, kept, 2, 2, v, 4, out), "scores is null");
  expect_invalid(cpu::cam_merge(scores, 4, nullptr, 2, 2, v, 4, out), "kept is null");
  expect_invalid(cpu::cam_merge(scores, 4, kept, 2, 2, nullptr, 4, out), "values is null");
  expect_invalid(cpu::cam_merge(scores, 4, kept, 2, 2, v, 4, nullptr), "kept_out is null");
  // Nothing kept: nothing to do, and nothing is dereferenced.
  EXPECT_TRUE(cpu::cam_merge(nullptr, 4, nullptr, 0, cpu::kCamMergeTokens, nullptr, 4, nullptr).is_ok());
}

}  // namespace
}  // namespace karakv::kernels::test
