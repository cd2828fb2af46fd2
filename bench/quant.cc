// karakv-bench quant: quantized storage formats (kivi2/4, tq2/3/4, kara+kivi4) against fp16.
// (1) actual compression ratio through a real daemon at several context lengths, beside the
// format's nominal ratio; (2) decode attention output error against full precision on the same
// inputs; (3) decode attention time against fp16 decode_attention. (2) and (3) call the CPU
// backend in this process.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench_common.h"
#include "common/synthetic.h"
#include "harness.h"
#include "karakv/client.h"
#include "karakv/kernels/backend.h"
#include "karakv/kernels/half.h"

ABSL_FLAG(std::string, quant_lengths, "1024,4096,16384", "quant: context lengths (tokens) of the compression-ratio sequences");
ABSL_FLAG(int32_t, quant_kara_max, 4096, "quant: kara and kara+kivi4 decode (Step) up to this length; longer lengths are skipped");
ABSL_FLAG(int32_t, quant_sequences, 8, "quant: sequences for the in-process attention error and time");
ABSL_FLAG(int32_t, quant_tokens, 4096, "quant: tokens per sequence for the attention error and time");
ABSL_FLAG(int32_t, quant_reps, 2, "quant: timed passes over all layers (best is reported)");
ABSL_FLAG(bool, quant_outlier, true, "quant: also measure the error with one key channel 10x larger");
ABSL_DECLARE_FLAG(std::string, out_dir);  // karakv_bench.cc

namespace karakv::bench {
namespace {

struct QuantCase {
  std::string name;    // fp16, kivi2, ..., kara+kivi4
  std::string policy;  // the CreateSequence policy string
  std::optional<kn::QuantFormat> format;
  bool decode = false;  // reached by Step (Kara) rather than by Append
};

std::vector<QuantCase> quant_cases() {
  return {{"fp16", "none", std::nullopt},
          {"kivi2", "none+kivi2", kn::QuantFormat::kKivi2},
          {"kivi4", "none+kivi4", kn::QuantFormat::kKivi4},
          {"tq2", "none+tq2", kn::QuantFormat::kTq2},
          {"tq3", "none+tq3", kn::QuantFormat::kTq3},
          {"tq4", "none+tq4", kn::QuantFormat::kTq4},
          {"kara+kivi4", "kara+kivi4", kn::QuantFormat::kKivi4, true},
          {"kara", "kara", std::nullopt, true}};  // context: Kara's eviction alone
}

struct QuantRatio {
  std::string name;
  int context = 0;  // logical tokens
  karakv::SequenceInfo info;
  double actual() const { return info.kv_bytes ? double(info.fp16_bytes) / double(info.kv_bytes) : 0; }
};

absl::StatusOr<karakv::SequenceInfo> sequence_info(karakv::Client& c, uint64_t id) {
  auto list = c.ListSequences();
  if (!list.ok()) return list.status();
  for (const karakv::SequenceInfo& info : *list) {
    if (info.id == id) return info;
  }
  return absl::NotFoundError(absl::StrCat("sequence ", id, " not in ListSequences"));
}

// Part 1: through karakvd. Append formats: one sequence per (format, length), the prompt appended
// 1024 tokens per call (the same synthetic chunk each time: the ratio does not depend on the
// values). Kara: one sequence per case, a 128-token prompt, then batched Steps up to the longest
// length, sampled on the way.
absl::StatusOr<std::vector<QuantRatio>> quant_ratios(const TempDir& dir, const kn::Geometry& g) {
  const std::vector<int> lengths = parse_lengths(absl::GetFlag(FLAGS_quant_lengths));
  const int kara_max = absl::GetFlag(FLAGS_quant_kara_max);
  const int longest = *std::max_element(lengths.begin(), lengths.end());
  constexpr int kChunk = 1024, kPrompt = 128;
  const std::vector<QuantCase> cases = quant_cases();
  int decoders = 0;
  for (const QuantCase& c : cases) decoders += c.decode;
  const size_t pool = decode_pool_bytes(g, 1, longest) + decode_pool_bytes(g, decoders, kara_max);
  auto daemon = start_karakvd(dir, "karakvd-quant", smollm_flags(pool));
  if (!daemon.ok()) return daemon.status();
  auto client = attach(*daemon, 2 * append_tensor_bytes(g, kChunk) + (8 << 20), "karakv-bench-quant");
  if (!client.ok()) return client.status();
  karakv::Client& c = **client;
  std::vector<QuantRatio> out;
  {
    auto k = c.alloc(c.append_bytes(kChunk)), v = c.alloc(c.append_bytes(kChunk));
    if (!k.ok()) return k.status();
    if (!v.ok()) return v.status();
    karakv::synthetic::fill_prompt(k->data(), g, 1, Tensor::kKey, 0, 0, kChunk);
    karakv::synthetic::fill_prompt(v->data(), g, 1, Tensor::kValue, 0, 0, kChunk);
    for (const QuantCase& qc : cases) {
      if (qc.decode) continue;
      for (int len : lengths) {
        const auto t = Clock::now();
        karakv::SequenceOptions o;
        o.policy = qc.policy;
        auto id = c.CreateSequence(o);
        if (!id.ok()) return id.status();
        for (int done = 0; done < len; done += kChunk) {
          const int n = std::min(kChunk, len - done);
          karakv::Buffer hk = *k, hv = *v;
          if (n < kChunk) {  // [L][T][Hk][D]: a shorter chunk is its own tensor
            hk = karakv::Client::alloc_heap(c.append_bytes(n));
            hv = karakv::Client::alloc_heap(c.append_bytes(n));
            karakv::synthetic::fill_prompt(hk.data(), g, 1, Tensor::kKey, 0, 0, n);
            karakv::synthetic::fill_prompt(hv.data(), g, 1, Tensor::kValue, 0, 0, n);
          }
          if (auto r = c.Append(*id, n, hk, hv); !r.ok()) return r.status();
        }
        auto info = sequence_info(c, *id);
        if (!info.ok()) return info.status();
        out.push_back({qc.name, len, *info});
        progress(absl::StrFormat("quant %s %d tokens: %u blocks (%u quantized tokens), actual %.2fx, nominal %.2fx (%.1f s)",
                                 qc.name, len, info->blocks, info->quantized_tokens, out.back().actual(),
                                 info->nominal_ratio, seconds_since(t)));
        if (auto r = c.Release(*id); !r.ok()) return r.status();
      }
    }
  }
  // Kara cases: decoded together in one Step batch.
  std::vector<std::string> policies;
  std::vector<const QuantCase*> decoded;
  for (const QuantCase& qc : cases) {
    if (qc.decode) policies.push_back(qc.policy), decoded.push_back(&qc);
  }
  std::vector<int> samples;
  for (int len : lengths) {
    if (len > kPrompt && len <= kara_max) samples.push_back(len);
  }
  if (!policies.empty() && !samples.empty()) {
    c.reset_staging();
    DecodeSet set;
    set.label = "quant";
    set.c = &c;
    if (absl::Status s = prefill(set, g, policies, kPrompt); !s.ok()) return s;
    StepTensors tensors(g, int(policies.size()));
    const int last = *std::max_element(samples.begin(), samples.end());
    const auto start = Clock::now();
    auto last_report = start;
    for (int len = kPrompt + 1; len <= last; ++len) {
      tensors.fill(len - 1);
      if (absl::Status s = set.step(tensors); !s.ok()) return s;
      if (std::find(samples.begin(), samples.end(), len) != samples.end()) {
        for (size_t i = 0; i < decoded.size(); ++i) {
          auto info = sequence_info(c, set.ids[i]);
          if (!info.ok()) return info.status();
          out.push_back({decoded[i]->name, len, *info});
          progress(absl::StrFormat("quant %s %d tokens (prompt %d + %d steps): %u resident, %u blocks (%u quantized "
                                   "tokens), actual %.2fx, nominal %.2fx",
                                   decoded[i]->name, len, kPrompt, len - kPrompt, info->length, info->blocks,
                                   info->quantized_tokens, out.back().actual(), info->nominal_ratio));
        }
      }
      if (seconds_since(last_report) >= 5) {
        last_report = Clock::now();
        progress(absl::StrFormat("quant decode %d/%d tokens (%.0f s)", len, last, seconds_since(start)));
      }
    }
    set = DecodeSet{};
  }
  client->reset();
  stop_or_warn(*daemon);
  return out;
}

// Gaussian fp16 values from a table of N(0, 1) samples, copied from rotating offsets (fast to
// fill a large pool; values iid enough for error and timing).
const std::vector<uint16_t>& gaussian_table() {
  static const std::vector<uint16_t> t = [] {
    std::vector<uint16_t> v(size_t(1) << 22);
    std::mt19937_64 rng(20261129);
    std::normal_distribution<float> n(0.0f, 1.0f);
    for (uint16_t& x : v) x = kn::float_to_half(n(rng));
    return v;
  }();
  return t;
}

struct QuantKernelResult {
  double rel_err = 0, rel_err_outlier = -1, fp16_s = 0, quant_s = 0;
  int tokens_per_block = 0, quantized_tokens = 0;
};

// Parts 2 and 3: `seqs` sequences of `tokens` Gaussian tokens in a pool of this geometry. For
// each format the first tokens - residual tokens (rounded down to whole quantized blocks) are
// quantized into blocks of their own with quantize_tokens, the rest stays in the fp16 blocks, and
// decode_attention_quantized runs against decode_attention over the fp16 copy of all tokens.
absl::StatusOr<std::map<std::string, QuantKernelResult>> quant_kernels(const kn::Geometry& g) {
  const int seqs = std::max(1, absl::GetFlag(FLAGS_quant_sequences));
  const int tokens = std::max(g.block_size, absl::GetFlag(FLAGS_quant_tokens) / g.block_size * g.block_size);
  const int reps = std::max(1, absl::GetFlag(FLAGS_quant_reps));
  constexpr int kResidual = 128;
  auto backend = kn::make_cpu_backend(0);
  const int fp_blocks = tokens / g.block_size;
  // Quantized blocks hold at least block_size tokens each, so fp_blocks per sequence suffice.
  const size_t num_blocks = size_t(seqs) * fp_blocks * 2;
  void* pool = nullptr;
  progress(absl::StrFormat("quant kernels: %d seqs x %d tokens, pool %.2f GB", seqs, tokens,
                           double(num_blocks) * g.block_bytes() / 1e9));
  if (auto s = backend->allocate(num_blocks * g.block_bytes(), &pool); !s.is_ok()) {
    return absl::ResourceExhaustedError(s.message);
  }
  std::unique_ptr<void, std::function<void(void*)>> pool_owner(pool, [&](void* p) { backend->free(p); });
  const std::vector<uint16_t>& table = gaussian_table();
  const size_t block_elems = g.block_elems();
  auto* base = static_cast<uint16_t*>(pool);
  for (size_t b = 0; b < size_t(seqs) * fp_blocks; ++b) {
    const size_t shift = (b * 7919 * 64) % (table.size() - block_elems);
    std::memcpy(base + b * block_elems, table.data() + shift, block_elems * sizeof(uint16_t));
  }
  // Full-precision view: sequence s owns blocks [s * fp_blocks, (s + 1) * fp_blocks).
  std::vector<int32_t> fp_table(size_t(seqs) * fp_blocks), fp_offsets(seqs + 1), fp_lengths(seqs, tokens);
  std::iota(fp_table.begin(), fp_table.end(), 0);
  for (int s = 0; s <= seqs; ++s) fp_offsets[s] = s * fp_blocks;
  kn::PagedKV full;
  full.pool = pool;
  full.geometry = g;
  full.block_table = fp_table.data();
  full.table_offset = fp_offsets.data();
  full.seq_len = fp_lengths.data();
  full.num_seqs = seqs;

  const size_t q_elems = size_t(seqs) * g.q_token_elems();
  std::vector<float> q(q_elems * g.num_layers), ref(q.size()), got(q.size());
  {
    std::mt19937_64 rng(7);
    std::normal_distribution<float> n(0.0f, 1.0f);
    for (float& x : q) x = n(rng);
  }
  const float scale = float(1.0 / std::sqrt(double(g.head_dim)));
  // One pass over every layer; returns seconds.
  auto pass = [&](auto&& call, std::vector<float>& out) -> absl::StatusOr<double> {
    const auto start = Clock::now();
    for (int l = 0; l < g.num_layers; ++l) {
      kn::KernelStatus st = call(l, q.data() + l * q_elems, out.data() + l * q_elems);
      if (!st.is_ok()) return absl::InternalError(st.message);
    }
    return seconds_since(start);
  };
  auto fp16_call = [&](int l, const float* ql, float* ol) { return backend->decode_attention(full, l, ql, ol, scale); };
  auto rel_error = [&]() {
    double sum = 0;
    size_t n = 0;
    for (size_t r = 0; r < q.size() / g.head_dim; ++r) {
      double num = 0, den = 0;
      for (int c = 0; c < g.head_dim; ++c) {
        const double d = double(got[r * g.head_dim + c]) - ref[r * g.head_dim + c];
        num += d * d;
        den += double(ref[r * g.head_dim + c]) * ref[r * g.head_dim + c];
      }
      if (den > 0) sum += std::sqrt(num / den), ++n;
    }
    return n ? sum / n : 0.0;
  };
  double fp16_best = 1e30;
  for (int r = 0; r <= reps; ++r) {
    auto el = pass(fp16_call, ref);
    if (!el.ok()) return el.status();
    if (r > 0) fp16_best = std::min(fp16_best, *el);
  }
  progress(absl::StrFormat("quant kernels: fp16 decode_attention, all %d layers: %.3f s (best of %d)", g.num_layers,
                           fp16_best, reps));

  // Builds the quantized copy of every sequence for `format`; fills `qkv`'s tables and the
  // fp16-tail view `tail`.
  struct Quantized {
    std::vector<int32_t> qtable, qoffsets, ttable, toffsets, tlengths;
    kn::QuantizedKV qkv;
    kn::PagedKV tail;
  };
  auto quantize = [&](kn::QuantFormat f, Quantized& z) -> absl::Status {
    const int tpb = backend->quantized_tokens_per_block(g, f);
    if (tpb <= 0) return absl::FailedPreconditionError("format cannot hold this geometry");
    const int nq = std::max(0, tokens - kResidual) / tpb * tpb;
    z.qkv.format = f;
    z.qkv.tokens_per_block = tpb;
    z.qkv.seed = 0x6b617261ull;
    z.qoffsets.assign(1, 0);
    z.toffsets.assign(1, 0);
    z.qtable.clear(), z.ttable.clear(), z.tlengths.clear();
    int32_t next = seqs * fp_blocks;  // quantized blocks after the fp16 ones
    for (int s = 0; s < seqs; ++s) {
      for (int i = 0; i < nq / tpb; ++i) z.qtable.push_back(next++);
      z.qoffsets.push_back(int32_t(z.qtable.size()));
      for (int b = nq / g.block_size; b < fp_blocks; ++b) z.ttable.push_back(s * fp_blocks + b);
      z.toffsets.push_back(int32_t(z.ttable.size()));
      z.tlengths.push_back(tokens - nq);
    }
    z.qkv.block_table = z.qtable.data();
    z.qkv.table_offset = z.qoffsets.data();
    for (int s = 0; s < seqs; ++s) {
      for (int i = 0; i < nq / tpb; ++i) {
        kn::KernelStatus st = backend->quantize_tokens(full, s, i * tpb, z.qkv, z.qtable[z.qoffsets[s] + i]);
        if (!st.is_ok()) return absl::InternalError(absl::StrCat("quantize_tokens: ", st.message));
      }
    }
    z.tail = full;
    z.tail.block_table = z.ttable.data();
    z.tail.table_offset = z.toffsets.data();
    z.tail.seq_len = z.tlengths.data();
    return absl::OkStatus();
  };

  std::map<std::string, QuantKernelResult> results;
  results["fp16"] = {0, 0, fp16_best, fp16_best, 0, 0};
  for (const QuantCase& qc : quant_cases()) {
    if (!qc.format || qc.decode) continue;
    Quantized z;
    const auto t = Clock::now();
    if (absl::Status s = quantize(*qc.format, z); !s.ok()) return s;
    const double quantize_s = seconds_since(t);
    auto call = [&](int l, const float* ql, float* ol) {
      return backend->decode_attention_quantized(z.tail, z.qkv, l, ql, ol, scale, nullptr, nullptr, nullptr);
    };
    QuantKernelResult r;
    r.tokens_per_block = z.qkv.tokens_per_block;
    r.quantized_tokens = z.qkv.quantized(0);
    r.fp16_s = fp16_best;
    r.quant_s = 1e30;
    for (int rep = 0; rep < reps; ++rep) {
      auto el = pass(call, got);
      if (!el.ok()) return el.status();
      r.quant_s = std::min(r.quant_s, *el);
    }
    r.rel_err = rel_error();
    results[qc.name] = r;
    progress(absl::StrFormat("quant kernels: %s (%d tokens/block, %d of %d tokens quantized, quantize %.2f s): "
                             "attention %.3f s = %.1fx fp16, mean relative L2 error %.4f",
                             qc.name, r.tokens_per_block, r.quantized_tokens, tokens, quantize_s, r.quant_s,
                             r.quant_s / fp16_best, r.rel_err));
  }

  // Heavy-tailed keys: one channel of every (layer, KV head) 10x larger, the rest unchanged.
  // Error only (one pass each), on the same queries.
  if (absl::GetFlag(FLAGS_quant_outlier)) {
    constexpr int kChannel = 7;
    for (size_t b = 0; b < size_t(seqs) * fp_blocks; ++b) {
      for (int l = 0; l < g.num_layers; ++l) {
        for (int h = 0; h < g.num_kv_heads; ++h) {
          uint16_t* run = base + full.run_offset(int32_t(b), l, 0, h);
          for (int t = 0; t < g.block_size; ++t) {
            uint16_t& x = run[size_t(t) * g.head_dim + kChannel];
            x = kn::float_to_half(10.0f * kn::half_to_float(x));
          }
        }
      }
    }
    if (auto el = pass(fp16_call, ref); !el.ok()) return el.status();
    for (const QuantCase& qc : quant_cases()) {
      if (!qc.format || qc.decode) continue;
      Quantized z;
      if (absl::Status s = quantize(*qc.format, z); !s.ok()) return s;
      auto call = [&](int l, const float* ql, float* ol) {
        return backend->decode_attention_quantized(z.tail, z.qkv, l, ql, ol, scale, nullptr, nullptr, nullptr);
      };
      if (auto el = pass(call, got); !el.ok()) return el.status();
      results[qc.name].rel_err_outlier = rel_error();
      progress(absl::StrFormat("quant kernels: %s with an outlier key channel: mean relative L2 error %.4f", qc.name,
                               results[qc.name].rel_err_outlier));
    }
    results["fp16"].rel_err_outlier = 0;
  }
  return results;
}

}  // namespace

absl::StatusOr<std::vector<Row>> run_quant(const TempDir& dir) {
  const kn::Geometry g = smollm_geometry();
  auto ratios = quant_ratios(dir, g);
  if (!ratios.ok()) return ratios.status();
  auto kernels = quant_kernels(g);
  if (!kernels.ok()) return kernels.status();
  const std::vector<int> lengths = parse_lengths(absl::GetFlag(FLAGS_quant_lengths));
  auto find = [&](const std::string& name, int len) -> const QuantRatio* {
    for (const QuantRatio& r : *ratios)
      if (r.name == name && r.context == len) return &r;
    return nullptr;
  };
  auto kernel_of = [&](const QuantCase& qc) -> const QuantKernelResult* {
    // kara+kivi4 stores kivi4 blocks: the kernel numbers are kivi4's
    const std::string key = qc.name == "kara+kivi4" ? "kivi4" : qc.name;
    auto it = kernels->find(key);
    return it == kernels->end() ? nullptr : &it->second;
  };
  auto len_label = [](int len) { return len % 1024 == 0 ? absl::StrCat(len / 1024, "k") : absl::StrCat(len); };

  // Long CSV of every ratio sample (plotted) and the per-format table.
  std::string ratio_csv = "format,policy,context,nominal_ratio,actual_ratio,kv_bytes,fp16_bytes,resident_tokens,"
                          "quantized_tokens,blocks\n";
  for (const QuantRatio& r : *ratios) {
    std::string policy;
    for (const QuantCase& qc : quant_cases())
      if (qc.name == r.name) policy = qc.policy;
    absl::StrAppend(&ratio_csv, r.name, ",", policy, ",", r.context, ",", absl::StrFormat("%.4f", r.info.nominal_ratio),
                    ",", absl::StrFormat("%.4f", r.actual()), ",", r.info.kv_bytes, ",", r.info.fp16_bytes, ",",
                    r.info.length, ",", r.info.quantized_tokens, ",", r.info.blocks, "\n");
  }
  std::vector<std::vector<std::string>> cells;
  std::vector<std::string> head = {"format", "nominal"};
  for (int len : lengths) head.push_back("actual " + len_label(len));
  for (const char* h : {"tok/qblock", "rel err", "rel err outl.", "attn time/fp16"}) head.push_back(h);
  cells.push_back(head);
  std::string formats_csv = "format,policy,nominal_ratio";
  for (int len : lengths) absl::StrAppend(&formats_csv, ",actual_ratio_", len);
  absl::StrAppend(&formats_csv, ",tokens_per_qblock,rel_err,rel_err_outlier,attn_time_s,fp16_attn_time_s,attn_time_ratio\n");
  std::vector<Row> rows;
  for (const QuantCase& qc : quant_cases()) {
    double nominal = 0;
    for (const QuantRatio& r : *ratios)
      if (r.name == qc.name) nominal = r.info.nominal_ratio;
    std::vector<std::string> line = {qc.name, absl::StrFormat("%.2fx", nominal)};
    std::string csv_line = absl::StrCat(qc.name, ",", qc.policy, ",", absl::StrFormat("%.4f", nominal));
    const QuantRatio* longest = nullptr;
    for (int len : lengths) {
      const QuantRatio* r = find(qc.name, len);
      line.push_back(r ? absl::StrFormat("%.2fx", r->actual()) : "-");
      absl::StrAppend(&csv_line, ",", r ? absl::StrFormat("%.4f", r->actual()) : "");
      if (r) longest = r;
    }
    const QuantKernelResult* k = kernel_of(qc);
    const bool quantized = qc.format.has_value();
    if (k && (quantized || qc.name == "fp16")) {
      line.push_back(quantized ? absl::StrCat(k->tokens_per_block) : "16");
      line.push_back(absl::StrFormat("%.4f", k->rel_err));
      line.push_back(k->rel_err_outlier < 0 ? "-" : absl::StrFormat("%.4f", k->rel_err_outlier));
      line.push_back(absl::StrFormat("%.2fx", k->quant_s / k->fp16_s));
      absl::StrAppend(&csv_line, ",", quantized ? k->tokens_per_block : 16, ",", absl::StrFormat("%.6g", k->rel_err), ",",
                      k->rel_err_outlier < 0 ? "" : absl::StrFormat("%.6g", k->rel_err_outlier), ",",
                      absl::StrFormat("%.6g", k->quant_s), ",", absl::StrFormat("%.6g", k->fp16_s), ",",
                      absl::StrFormat("%.4f", k->quant_s / k->fp16_s), "\n");
    } else {
      for (int i = 0; i < 4; ++i) line.push_back("-");
      absl::StrAppend(&csv_line, ",,,,,,\n");
    }
    cells.push_back(line);
    formats_csv += csv_line;
    if (longest && qc.name != "fp16") {
      rows.push_back({"quant", absl::StrFormat("actual compression ratio, %s, %s tokens", qc.name,
                                               len_label(longest->context)),
                      longest->actual(), "nominal ratio", nominal, "x", true, std::nullopt});
    }
    if (k && quantized && qc.name != "kara+kivi4") {
      rows.push_back({"quant", absl::StrFormat("decode attention time, %s (CPU quantized path)", qc.name),
                      k->quant_s, "fp16 decode_attention", k->fp16_s, "s", false, std::nullopt});
    }
  }
  if (const std::string out = absl::GetFlag(FLAGS_out_dir); !out.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(out, ec);
    for (const auto& [name, text] : {std::pair<std::string, const std::string*>{"quant_ratio.csv", &ratio_csv},
                                     {"quant_formats.csv", &formats_csv}}) {
      std::ofstream f(out + "/" + name);
      f << *text;
      if (!f) return absl::InternalError(absl::StrCat("cannot write ", out, "/", name));
    }
  }
  std::string table = absl::StrFormat(
      "quant: SmolLM2-135M geometry fp16, residual 128. actual = fp16 bytes of the logical tokens / bytes of "
      "the blocks held (ListSequences); Append formats: one sequence per length, prompt appended 1024 tokens per "
      "call; kara, kara+kivi4: 128-token prompt then Step (batch of both) up to %d tokens. rel err: mean relative L2 "
      "error of decode attention outputs vs fp16 over %d seqs x %d Gaussian tokens x %d layers x %d q heads "
      "(outl.: key channel 7 x10); attn time: decode_attention_quantized / decode_attention, best of %d "
      "(kara+kivi4: kivi4's kernels):\n",
      absl::GetFlag(FLAGS_quant_kara_max), absl::GetFlag(FLAGS_quant_sequences), absl::GetFlag(FLAGS_quant_tokens),
      g.num_layers, g.num_q_heads, absl::GetFlag(FLAGS_quant_reps));
  std::vector<size_t> width(cells[0].size(), 0);
  for (const auto& line : cells)
    for (size_t i = 0; i < line.size(); ++i) width[i] = std::max(width[i], line[i].size());
  for (const auto& line : cells) {
    std::string out;
    for (size_t i = 0; i < line.size(); ++i) {
      out += i == 0 ? line[i] + std::string(width[i] - line[i].size(), ' ')
                    : std::string(width[i] - line[i].size() + 2, ' ') + line[i];
    }
    absl::StrAppend(&table, out, "\n");
  }
  extra_reports().push_back(table);
  return rows;
}

std::string quant_how() {
  return absl::StrFormat("quant SmolLM2-135M geometry fp16, residual 128; ratios through karakvd "
                         "at %s tokens (kara cases by Step up to %d); error and time in process, "
                         "CPU backend, %d seqs x %d tokens",
                         absl::GetFlag(FLAGS_quant_lengths), absl::GetFlag(FLAGS_quant_kara_max),
                         absl::GetFlag(FLAGS_quant_sequences), absl::GetFlag(FLAGS_quant_tokens));
}

}  // namespace karakv::bench
