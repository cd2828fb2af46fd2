// The CPU backend's decode attention over quantized paged sequences (Backend::
// decode_attention_quantized) against a float64 loop over the K and V its codes dequantize to:
// outputs, the probabilities it adds into score_acc from acc_begin on (slots counted over the
// quantized tokens first), and each query head's log-sum-exp (Kara's norm = full). Every storage
// dtype (the unquantized tail is widened from it; the reference reads the rounded values) and
// groups of 2 and 5 query heads (5 takes two of the kernels' register chunks of heads).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "cpu/quant.h"
#include "karakv/kernels/backend.h"
#include "kernel_test_util.h"

namespace karakv::kernels::test {
namespace {

Geometry quant_geometry(DType dtype, int group) {
  Geometry g;
  g.num_layers = 2;
  g.num_kv_heads = 2;
  g.num_q_heads = 2 * group;
  g.head_dim = 64;
  g.block_size = 16;
  g.dtype = dtype;
  return g;
}

// (format, storage dtype, query heads per KV head)
class QuantPagedTest : public ::testing::TestWithParam<std::tuple<QuantFormat, DType, int>> {};

// Sequences of (quantized blocks, unquantized tokens): two quantized blocks and a tail that ends
// mid-block, one block and a short tail, and no quantized token at all.
struct SeqShape {
  int qblocks;
  int fp;
};
constexpr SeqShape kShapes[] = {{2, 37}, {1, 5}, {0, 20}};

TEST_P(QuantPagedTest, DecodeObservesWhatAFloat64LoopOverTheDequantizedCacheGives) {
  const auto [f, dtype, group_size] = GetParam();
  const Geometry g = quant_geometry(dtype, group_size);
  auto backend = make_cpu_backend(1);
  const int tpb = backend->quantized_tokens_per_block(g, f);
  ASSERT_GT(tpb, 0);
  const int num_seqs = int(std::size(kShapes)), hq = g.num_q_heads, hk = g.num_kv_heads, d = g.head_dim;
  const int group = hq / hk;
  const size_t esize = dtype_size(g.dtype);

  // Each sequence's source tokens (quantized part + tail) in fp blocks of its own; its quantized
  // blocks after all of them.
  std::vector<int32_t> src_table, src_offset{0}, src_len, qtable, qoffset{0}, tail_table, tail_offset{0}, tail_len;
  int32_t next = 0;
  for (const SeqShape& sh : kShapes) {
    const int len = sh.qblocks * tpb + sh.fp, nq = sh.qblocks * tpb;
    const int blocks = (len + g.block_size - 1) / g.block_size;
    for (int b = 0; b < blocks; ++b) {
      src_table.push_back(next + b);
      if (b >= nq / g.block_size) tail_table.push_back(next + b);
    }
    next += blocks;
    src_offset.push_back(int32_t(src_table.size()));
    tail_offset.push_back(int32_t(tail_table.size()));
    src_len.push_back(len);
    tail_len.push_back(sh.fp);
  }
  for (int s = 0; s < num_seqs; ++s) {
    for (int b = 0; b < kShapes[s].qblocks; ++b) qtable.push_back(next++);
    qoffset.push_back(int32_t(qtable.size()));
  }
  std::vector<uint8_t> pool(size_t(next) * g.block_elems() * esize, 0);
  PagedKV src;
  src.pool = pool.data();
  src.geometry = g;
  src.block_table = src_table.data();
  src.table_offset = src_offset.data();
  src.seq_len = src_len.data();
  src.num_seqs = num_seqs;

  std::mt19937 rng(11 + int(f));
  // keys[s][layer][t][h][c] and values: what the kernel attends over, in float64.
  std::vector<std::vector<double>> keys(num_seqs), values(num_seqs);
  QuantizedKV qkv;
  qkv.format = f;
  qkv.tokens_per_block = tpb;
  qkv.seed = 0x6b617261ull;
  qkv.block_table = qtable.data();
  qkv.table_offset = qoffset.data();
  for (int s = 0; s < num_seqs; ++s) {
    const int len = src_len[s];
    const size_t elems = size_t(g.num_layers) * len * hk * d;
    const std::vector<uint8_t> k = encode(g.dtype, random_values(elems, -2.0f, 2.0f, rng));
    const std::vector<uint8_t> v = encode(g.dtype, random_values(elems, -2.0f, 2.0f, rng));
    ASSERT_TRUE(backend->write_kv(src, s, 0, len, 0, g.num_layers, k.data(), v.data()).is_ok());
    keys[s].resize(elems);
    values[s].resize(elems);
    for (size_t i = 0; i < elems; ++i) {
      keys[s][i] = decode_at(g.dtype, k.data(), i);
      values[s][i] = decode_at(g.dtype, v.data(), i);
    }
    // The quantized part: what the kernel's codes dequantize to in fp32 (dequantize_block would
    // round them to the storage dtype), run by run from the pool.
    for (int b = 0; b < kShapes[s].qblocks; ++b) {
      const int32_t block = qtable[qoffset[s] + b];
      const KernelStatus st = backend->quantize_tokens(src, s, b * tpb, qkv, block);
      ASSERT_TRUE(st.is_ok()) << st.message;
      std::vector<float> x(size_t(tpb) * d);
      for (int l = 0; l < g.num_layers; ++l) {
        for (int h = 0; h < hk; ++h) {
          for (int kvi = 0; kvi < 2; ++kvi) {
            const uint8_t* run = pool.data() + src.run_offset(block, l, kvi, h) * esize;
            const uint64_t seed = head_seed(qkv.seed, l, h);
            ASSERT_TRUE((kvi == 0 ? cpu::dequantize_keys(f, run, tpb, d, seed, x.data())
                                  : cpu::dequantize_values(f, run, tpb, d, seed, x.data()))
                            .is_ok());
            std::vector<double>& dst = kvi == 0 ? keys[s] : values[s];
            for (int t = 0; t < tpb; ++t)
              std::copy_n(x.begin() + size_t(t) * d, d, dst.begin() + ((size_t(l) * len + b * tpb + t) * hk + h) * d);
          }
        }
      }
    }
  }
  PagedKV tail = src;
  tail.block_table = tail_table.data();
  tail.table_offset = tail_offset.data();
  tail.seq_len = tail_len.data();

  const float scale = 0.125f;
  const int layer = 1;
  const std::vector<float> q = random_values(size_t(num_seqs) * hq * d, -2.0f, 2.0f, rng);
  std::vector<float> out(q.size(), NAN);
  // Accumulators start random: slots before acc_begin must keep their values. Sequence 0 starts in
  // its tail, sequence 1 inside its quantized block, sequence 2 at its end (nothing added).
  const std::vector<int32_t> acc_begin = {2 * tpb + 3, 5, src_len[2]};
  std::vector<std::vector<float>> acc(size_t(num_seqs) * hk);
  std::vector<float*> accp;
  for (size_t i = 0; i < acc.size(); ++i) {
    acc[i] = random_values(size_t(src_len[i / hk]), 0.0f, 1.0f, rng);
    accp.push_back(acc[i].data());
  }
  const std::vector<std::vector<float>> acc_before = acc;
  // Sequence 1 records no log-sum-exp; its buffer must stay as it was.
  std::vector<std::vector<float>> lse(num_seqs, std::vector<float>(hq, -7.0f));
  std::vector<float*> lsep = {lse[0].data(), nullptr, lse[2].data()};

  const KernelStatus st = backend->decode_attention_quantized(tail, qkv, layer, q.data(), out.data(), scale,
                                                              accp.data(), acc_begin.data(), lsep.data());
  ASSERT_TRUE(st.is_ok()) << st.message;

  for (int s = 0; s < num_seqs; ++s) {
    const int len = src_len[s];
    std::vector<std::vector<double>> added(hk, std::vector<double>(len, 0.0));
    for (int j = 0; j < hq; ++j) {
      const int h = j / group;
      const float* qj = q.data() + (size_t(s) * hq + j) * d;
      std::vector<double> logit(len);
      double mx = -INFINITY;
      for (int t = 0; t < len; ++t) {
        const double* kt = keys[s].data() + ((size_t(layer) * len + t) * hk + h) * d;
        double dot = 0;
        for (int c = 0; c < d; ++c) dot += double(qj[c]) * kt[c];
        logit[t] = dot * scale;
        mx = std::max(mx, logit[t]);
      }
      double sum = 0;
      for (int t = 0; t < len; ++t) sum += std::exp(logit[t] - mx);
      const double want_lse = mx + std::log(sum);
      for (int c = 0; c < d; ++c) {
        double o = 0;
        for (int t = 0; t < len; ++t)
          o += std::exp(logit[t] - want_lse) * values[s][((size_t(layer) * len + t) * hk + h) * d + c];
        EXPECT_NEAR(out[(size_t(s) * hq + j) * d + c], o, 1e-4) << "seq " << s << " head " << j << " channel " << c;
      }
      for (int t = 0; t < len; ++t) added[h][t] += std::exp(logit[t] - want_lse);
      if (s == 1) {
        EXPECT_EQ(lse[s][j], -7.0f) << "a null lse pointer was written";
      } else {
        EXPECT_NEAR(lse[s][j], want_lse, 1e-4 * std::max(1.0, std::abs(want_lse))) << "seq " << s << " head " << j;
      }
    }
    for (int h = 0; h < hk; ++h) {
      const std::vector<float>& got = acc[size_t(s) * hk + h];
      const std::vector<float>& before = acc_before[size_t(s) * hk + h];
      for (int t = 0; t < len; ++t) {
        if (t < acc_begin[s]) {
          EXPECT_EQ(got[t], before[t]) << "seq " << s << " KV head " << h << " slot " << t << " is before acc_begin";
        } else {
          EXPECT_NEAR(got[t], before[t] + added[h][t], 1e-5) << "seq " << s << " KV head " << h << " slot " << t;
        }
      }
    }
  }

  // acc_begin is checked against the sequence's quantized + unquantized slots.
  std::vector<int32_t> bad = acc_begin;
  bad[0] = src_len[0] + 1;
  const KernelStatus refused = backend->decode_attention_quantized(tail, qkv, layer, q.data(), out.data(), scale,
                                                                   accp.data(), bad.data(), lsep.data());
  EXPECT_EQ(refused.code, KernelStatus::Code::kInvalidArgument);
  EXPECT_NE(refused.message.find("acc_begin[0] " + std::to_string(src_len[0] + 1) + " outside [0, quantized + seq_len " +
                                 std::to_string(src_len[0]) + "]"),
            std::string::npos)
      << refused.message;
}

std::string case_name(const ::testing::TestParamInfo<std::tuple<QuantFormat, DType, int>>& info) {
  static const char* const kNames[] = {"kivi2", "kivi4", "tq2", "tq3", "tq4"};
  const auto [f, dtype, group] = info.param;
  return std::string(kNames[int(f)]) + "_" + name_of(dtype) + "_g" + std::to_string(group);
}

INSTANTIATE_TEST_SUITE_P(AllFormats, QuantPagedTest,
                         ::testing::Combine(::testing::Values(QuantFormat::kKivi2, QuantFormat::kKivi4,
                                                              QuantFormat::kTq2, QuantFormat::kTq3, QuantFormat::kTq4),
                                            ::testing::Values(DType::kFloat32, DType::kFloat16, DType::kBFloat16),
                                            ::testing::Values(2, 5)),
                         case_name);

}  // namespace
}  // namespace karakv::kernels::test
