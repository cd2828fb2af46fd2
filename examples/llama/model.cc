#include "llama/model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "karakv/kernels/half.h"

namespace karakv::llama {
namespace {

constexpr size_t kHeaderBytes = 256;

// Little-endian reads with bounds checks; every failure says what was being read.
class Reader {
 public:
  explicit Reader(std::span<const uint8_t> b) : b_(b) {}
  size_t pos() const { return pos_; }
  size_t left() const { return b_.size() - pos_; }
  bool read(void* dst, size_t n) {
    if (n > left()) return false;
    std::memcpy(dst, b_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  void seek(size_t p) { pos_ = p; }

 private:
  std::span<const uint8_t> b_;
  size_t pos_ = 0;
};

absl::Status bad(const std::string& what) { return absl::InvalidArgumentError(absl::StrCat("model file: ", what)); }

void rmsnorm(float* out, const float* x, const float* w, int n, float eps) {
  double ss = 0;
  for (int i = 0; i < n; ++i) ss += double(x[i]) * x[i];
  const float inv = 1.0f / std::sqrt(float(ss / n) + eps);
  for (int i = 0; i < n; ++i) out[i] = w[i] * (x[i] * inv);
}

// out[b][rows] = W[rows][cols] x[b][cols] for b < B. Each row of W is read once for the whole
// batch (decoding B sequences, or a prompt's T tokens, costs about one pass over the weights rather
// than B), and every dot product sums in the same order whatever B is: eight partial sums per row,
// which lets the compiler use vector registers, combined pairwise. Rows split over OpenMP threads
// when the work pays for waking them.
// Eight floats in one vector register (GCC/Clang vector extension); `V8u` loads from any float
// address. Lane j of an accumulator holds the partial sum of columns c + j, c + 8 + j, ..., exactly
// as an eight-element array would, so vectorising does not change the summation order.
typedef float V8 __attribute__((vector_size(32)));
typedef float V8u __attribute__((vector_size(32), aligned(4)));

inline float dot_finish(V8 acc, const float* row, const float* xb, int c, int cols) {
  float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; c < cols; ++c) sum += row[c] * xb[c];
  return sum;
}

void matmul(float* out, const float* w, const float* x, int rows, int cols, int B) {
  const int main_cols = cols / 8 * 8;
#pragma omp parallel for schedule(static) if (size_t(rows) * cols * B >= (size_t(1) << 18))
  for (int r = 0; r < rows; ++r) {
    const float* row = w + size_t(r) * cols;
    int b = 0;
    // Four batch entries at a time share each load of the row.
    for (; b + 4 <= B; b += 4) {
      const float* x0 = x + size_t(b) * cols;
      const float* x1 = x0 + cols;
      const float* x2 = x1 + cols;
      const float* x3 = x2 + cols;
      V8 a0 = {}, a1 = {}, a2 = {}, a3 = {};
      for (int c = 0; c < main_cols; c += 8) {
        const V8 wv = *reinterpret_cast<const V8u*>(row + c);
        a0 += wv * *reinterpret_cast<const V8u*>(x0 + c);
        a1 += wv * *reinterpret_cast<const V8u*>(x1 + c);
        a2 += wv * *reinterpret_cast<const V8u*>(x2 + c);
        a3 += wv * *reinterpret_cast<const V8u*>(x3 + c);
      }
      out[size_t(b) * rows + r] = dot_finish(a0, row, x0, main_cols, cols);
      out[size_t(b + 1) * rows + r] = dot_finish(a1, row, x1, main_cols, cols);
      out[size_t(b + 2) * rows + r] = dot_finish(a2, row, x2, main_cols, cols);
      out[size_t(b + 3) * rows + r] = dot_finish(a3, row, x3, main_cols, cols);
    }
    for (; b < B; ++b) {
      const float* xb = x + size_t(b) * cols;
      V8 acc = {};
      for (int c = 0; c < main_cols; c += 8)
        acc += *reinterpret_cast<const V8u*>(row + c) * *reinterpret_cast<const V8u*>(xb + c);
      out[size_t(b) * rows + r] = dot_finish(acc, row, xb, main_cols, cols);
    }
  }
}

// llama2.c's rotary embedding: adjacent pairs (2i, 2i+1) of each head rotate by pos * theta^(-2i/D).
// GGUF files store Llama's Q/K rows permuted into this same adjacent-pair layout (llama.cpp's
// converter undoes Hugging Face's rotate-half order), so converted SmolLM2 weights use it as well.
void rope(float* v, int heads, int head_dim, int pos, float theta) {
  for (int h = 0; h < heads; ++h) {
    float* x = v + size_t(h) * head_dim;
    for (int i = 0; i < head_dim; i += 2) {
      const float freq = 1.0f / std::pow(theta, float(i) / float(head_dim));
      const float a = float(pos) * freq;
      const float c = std::cos(a), s = std::sin(a);
      const float x0 = x[i], x1 = x[i + 1];
      x[i] = x0 * c - x1 * s;
      x[i + 1] = x0 * s + x1 * c;
    }
  }
}

// The per-token computations around attention, shared by prefill and decode, for B tokens at once
// (B sequences' next tokens, or one prompt's tokens).
struct Layer {
  const Config& c;
  const Weights& w;
  int l;

  // x [B][dim] -> q [B][Hq*D], k, v [B][Hk*D], RoPE applied at pos[b].
  void qkv(const float* x, const int* pos, int B, float* q, float* k, float* v) const {
    const int d = c.dim, kvd = c.kv_dim();
    std::vector<float> xb(size_t(B) * d);
    for (int b = 0; b < B; ++b)
      rmsnorm(&xb[size_t(b) * d], x + size_t(b) * d, w.attn_norm.data() + size_t(l) * d, d, c.norm_eps);
    matmul(q, w.wq.data() + size_t(l) * d * d, xb.data(), d, d, B);
    matmul(k, w.wk.data() + size_t(l) * kvd * d, xb.data(), kvd, d, B);
    matmul(v, w.wv.data() + size_t(l) * kvd * d, xb.data(), kvd, d, B);
    for (int b = 0; b < B; ++b) {
      rope(q + size_t(b) * d, c.n_heads, c.head_dim(), pos[b], c.rope_theta);
      rope(k + size_t(b) * kvd, c.n_kv_heads, c.head_dim(), pos[b], c.rope_theta);
    }
  }

  // x += Wo att; x += FFN(x), for x, att [B][dim].
  void finish(float* x, const float* att, int B) const {
    const int d = c.dim, f = c.ffn_dim;
    std::vector<float> tmp(size_t(B) * d), xb(size_t(B) * d), gate(size_t(B) * f), up(size_t(B) * f);
    matmul(tmp.data(), w.wo.data() + size_t(l) * d * d, att, d, d, B);
    for (size_t i = 0; i < tmp.size(); ++i) x[i] += tmp[i];
    for (int b = 0; b < B; ++b)
      rmsnorm(&xb[size_t(b) * d], x + size_t(b) * d, w.ffn_norm.data() + size_t(l) * d, d, c.norm_eps);
    matmul(gate.data(), w.w_gate.data() + size_t(l) * f * d, xb.data(), f, d, B);
    matmul(up.data(), w.w_up.data() + size_t(l) * f * d, xb.data(), f, d, B);
    for (size_t i = 0; i < gate.size(); ++i) gate[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
    matmul(tmp.data(), w.w_down.data() + size_t(l) * d * f, gate.data(), d, f, B);
    for (size_t i = 0; i < tmp.size(); ++i) x[i] += tmp[i];
  }
};

// logits [B][vocab] from the last hidden states x [B][dim].
void output_logits(const Model& m, const float* x, int B, float* logits) {
  const int d = m.config.dim;
  std::vector<float> xb(size_t(B) * d);
  for (int b = 0; b < B; ++b)
    rmsnorm(&xb[size_t(b) * d], x + size_t(b) * d, m.weights.final_norm.data(), d, m.config.norm_eps);
  const std::vector<float>& out = m.weights.output.empty() ? m.weights.embedding : m.weights.output;
  matmul(logits, out.data(), xb.data(), m.config.vocab_size, d, B);
}

absl::Status check_geometry(const Config& c) {
  if (c.dim % c.n_heads != 0 || c.head_dim() % 2 != 0) {
    return bad(absl::StrCat("hidden size ", c.dim, " is not an even head dimension times ", c.n_heads, " heads"));
  }
  if (c.n_heads % c.n_kv_heads != 0) {
    return bad(absl::StrCat(c.n_heads, " query heads are not a multiple of ", c.n_kv_heads, " KV heads"));
  }
  return absl::OkStatus();
}

// Reads float32 tensors in order after `r`'s position; the caller checked the total size.
struct Tensor {
  std::vector<float>* dst;
  size_t n;
  const char* name;
};
absl::Status read_tensors(Reader& r, std::span<const Tensor> tensors) {
  for (const Tensor& t : tensors) {
    const size_t at = r.pos();
    t.dst->resize(t.n);
    r.read(t.dst->data(), t.n * 4);
    for (size_t i = 0; i < t.n; ++i) {
      if (!std::isfinite((*t.dst)[i])) {
        return bad(absl::StrCat("tensor ", t.name, " (at byte ", at, ") element ", i, " is not finite"));
      }
    }
  }
  return absl::OkStatus();
}

// The converted format; its layout is documented in convert_gguf.py.
absl::StatusOr<Model> parse_converted(std::span<const uint8_t> bytes) {
  constexpr size_t kFixed = 8 + 4 + 7 * 4 + 2 * 4 + 3 * 4;
  if (bytes.size() < kFixed) {
    return bad(absl::StrCat("truncated header: expected at least ", kFixed, " bytes, got ", bytes.size()));
  }
  Reader r(bytes);
  r.seek(8);
  uint32_t version = 0;
  int32_t dims[7], tied = 0, bos = 0, eos = 0;
  float theta = 0, eps = 0;
  r.read(&version, 4);
  r.read(dims, sizeof(dims));
  r.read(&theta, 4);
  r.read(&eps, 4);
  r.read(&tied, 4);
  r.read(&bos, 4);
  r.read(&eos, 4);
  if (version != 1) return bad(absl::StrCat("bad converted-format version ", version, " (expected 1)"));
  const char* names[7] = {"layers", "hidden size", "FFN size", "query heads", "KV heads", "vocab size",
                          "max context"};
  for (int i = 0; i < 7; ++i) {
    if (dims[i] < 1 || dims[i] > (1 << 20)) return bad(absl::StrCat("bad ", names[i], " ", dims[i]));
  }
  Config c;
  c.n_layers = dims[0];
  c.dim = dims[1];
  c.ffn_dim = dims[2];
  c.n_heads = dims[3];
  c.n_kv_heads = dims[4];
  c.vocab_size = dims[5];
  c.max_seq_len = dims[6];
  c.rope_theta = theta;
  c.norm_eps = eps;
  if (auto s = check_geometry(c); !s.ok()) return s;
  if (!(theta > 1) || !std::isfinite(theta)) return bad(absl::StrCat("bad RoPE theta ", theta));
  if (!(eps > 0) || !(eps < 1)) return bad(absl::StrCat("bad RMS norm epsilon ", eps));
  if (tied != 0 && tied != 1) return bad(absl::StrCat("bad tied_output flag ", tied, " (expected 0 or 1)"));
  if (bos < 0 || bos >= c.vocab_size || eos < 0 || eos >= c.vocab_size) {
    return bad(absl::StrCat("BOS ", bos, " or EOS ", eos, " outside the vocabulary of ", c.vocab_size));
  }

  // A length-prefixed string, refusing one that runs past the end.
  auto read_string = [&](const std::string& what, std::string& s) -> absl::Status {
    const size_t at = r.pos();
    uint32_t len = 0;
    if (!r.read(&len, 4) || len > r.left()) {
      return bad(absl::StrCat(what, " at byte ", at, ": runs past the end of the file (size ", bytes.size(), ")"));
    }
    s.resize(len);
    r.read(s.data(), len);
    return absl::OkStatus();
  };
  std::vector<std::string> tokens(c.vocab_size);
  std::vector<uint8_t> types(c.vocab_size);
  for (int i = 0; i < c.vocab_size; ++i) {
    const std::string what = absl::StrCat("vocab entry ", i);
    if (auto s = read_string(what, tokens[i]); !s.ok()) return s;
    if (tokens[i].empty() || tokens[i].size() > 256) return bad(absl::StrCat("bad ", what, ": length ", tokens[i].size()));
    if (!r.read(&types[i], 1)) return bad(absl::StrCat(what, ": type runs past the end of the file"));
  }
  uint32_t n_merges = 0;
  if (!r.read(&n_merges, 4) || n_merges > r.left() / 4) {
    return bad(absl::StrCat("merge count at byte ", r.pos(), " runs past the end of the file"));
  }
  std::vector<std::string> merges(n_merges);
  for (uint32_t i = 0; i < n_merges; ++i) {
    if (auto s = read_string(absl::StrCat("merge ", i), merges[i]); !s.ok()) return s;
  }
  Model m;
  if (auto s = read_string("chat template", m.chat_template); !s.ok()) return s;

  const size_t L = c.n_layers, d = c.dim, kv = c.kv_dim(), f = c.ffn_dim, V = c.vocab_size;
  const size_t floats =
      V * d + L * d + L * d * d + 2 * L * kv * d + L * d * d + L * d + 3 * L * f * d + d + (tied ? 0 : V * d);
  const size_t expected = r.pos() + floats * 4;
  if (bytes.size() != expected) {
    return bad(absl::StrCat("wrong size: expected ", expected, " bytes, got ", bytes.size(), " (header and tokenizer ",
                            r.pos(), " + ", floats, " float32 weights)"));
  }
  m.config = c;
  Weights& w = m.weights;
  std::vector<Tensor> tensors = {
      {&w.embedding, V * d, "token_embd"}, {&w.attn_norm, L * d, "attn_norm"},   {&w.wq, L * d * d, "attn_q"},
      {&w.wk, L * kv * d, "attn_k"},       {&w.wv, L * kv * d, "attn_v"},        {&w.wo, L * d * d, "attn_output"},
      {&w.ffn_norm, L * d, "ffn_norm"},    {&w.w_gate, L * f * d, "ffn_gate"},   {&w.w_up, L * f * d, "ffn_up"},
      {&w.w_down, L * d * f, "ffn_down"},  {&w.final_norm, d, "output_norm"},
  };
  if (!tied) tensors.push_back({&w.output, V * d, "output"});
  if (auto s = read_tensors(r, tensors); !s.ok()) return s;
  m.bpe = BpeTokenizer(std::move(tokens), std::move(types), merges, bos, eos);
  if (!m.bpe.covers_text_bytes()) return bad("the vocabulary lacks a token for a text byte (not byte-level BPE)");
  return m;
}

}  // namespace

absl::StatusOr<Model> parse_model(std::span<const uint8_t> bytes) {
  if (bytes.size() >= 8 && std::memcmp(bytes.data(), kConvertedMagic, 8) == 0) return parse_converted(bytes);
  if (bytes.size() < kHeaderBytes) {
    return bad(absl::StrCat("truncated header: expected at least ", kHeaderBytes, " bytes, got ", bytes.size()));
  }
  Reader r(bytes);
  uint8_t version = 0;
  int32_t type_len = 0;
  r.read(&version, 1);
  r.read(&type_len, 4);
  if (version != 1) return bad(absl::StrCat("bad version ", int(version), " (expected 1)"));
  if (type_len < 1 || type_len > 64) return bad(absl::StrCat("bad model type length ", type_len, " (expected 1..64)"));
  std::string type(size_t(type_len), '\0');
  r.read(type.data(), type.size());
  if (type != "llama") return bad(absl::StrCat("bad model type '", type, "' (expected 'llama')"));
  int32_t dims[7];
  uint8_t shared = 0;
  r.read(dims, sizeof(dims));
  r.read(&shared, 1);
  Config c{dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], dims[6]};
  const char* names[7] = {"hidden size", "FFN size", "max sequence length", "vocab size", "layers", "query heads",
                          "KV heads"};
  for (int i = 0; i < 7; ++i) {
    if (dims[i] < 1 || dims[i] > (1 << 20)) return bad(absl::StrCat("bad ", names[i], " ", dims[i]));
  }
  if (auto s = check_geometry(c); !s.ok()) return s;
  if (shared != 1) {
    return bad(absl::StrCat("shared_output_weight is ", int(shared), "; only tied output weights (1) are supported"));
  }

  r.seek(kHeaderBytes);
  std::vector<std::string> pieces(c.vocab_size);
  std::vector<float> scores(c.vocab_size);
  for (int i = 0; i < c.vocab_size; ++i) {
    int32_t len = 0;
    const size_t at = r.pos();
    if (!r.read(&scores[i], 4) || !r.read(&len, 4)) {
      return bad(absl::StrCat("vocab entry ", i, " at byte ", at, ": the entry runs past the end of the file (size ", bytes.size(),
                              ")"));
    }
    if (!std::isfinite(scores[i])) return bad(absl::StrCat("vocab entry ", i, " at byte ", at, ": score is not finite"));
    if (len < 1 || len > 256) {
      return bad(absl::StrCat("bad vocab entry ", i, " at byte ", at, ": length ", len, " (expected 1..256)"));
    }
    pieces[i].resize(size_t(len));
    if (!r.read(pieces[i].data(), size_t(len))) {
      return bad(absl::StrCat("vocab entry ", i, " at byte ", at, ": ", len, " bytes run past the end of the file (size ",
                              bytes.size(), ")"));
    }
  }

  const size_t L = c.n_layers, d = c.dim, kv = c.kv_dim(), f = c.ffn_dim, V = c.vocab_size;
  const size_t floats = V * d + L * d + L * d * d + 2 * L * kv * d + L * d * d + L * d + 3 * L * f * d + d;
  const size_t expected = r.pos() + floats * 4;
  if (bytes.size() != expected) {
    return bad(absl::StrCat("wrong size: expected ", expected, " bytes, got ", bytes.size(), " (header ", kHeaderBytes,
                            " + vocabulary ", r.pos() - kHeaderBytes, " + ", floats, " float32 weights)"));
  }
  Model m;
  m.config = c;
  Weights& w = m.weights;
  const Tensor tensors[] = {
      {&w.embedding, V * d, "embedding"}, {&w.attn_norm, L * d, "attention norm"}, {&w.wq, L * d * d, "Wq"},
      {&w.wk, L * kv * d, "Wk"},          {&w.wv, L * kv * d, "Wv"},               {&w.wo, L * d * d, "Wo"},
      {&w.ffn_norm, L * d, "FFN norm"},   {&w.w_gate, L * f * d, "W_gate"},        {&w.w_up, L * f * d, "W_up"},
      {&w.w_down, L * d * f, "W_down"},   {&w.final_norm, d, "final norm"},
  };
  if (auto s = read_tensors(r, tensors); !s.ok()) return s;
  m.tokenizer = Tokenizer(std::move(pieces), std::move(scores));
  return m;
}

absl::StatusOr<Model> load_model(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open model file '", path, "'"));
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto m = parse_model(bytes);
  if (!m.ok()) return absl::Status(m.status().code(), absl::StrCat(path, ": ", m.status().message()));
  return m;
}

void attend(const Config& c, const float* q, const float* k, const float* v, int len, size_t kv_stride,
            float* out) {
  const int D = c.head_dim(), group = c.n_heads / c.n_kv_heads;
  const float scale = 1.0f / std::sqrt(float(D));
  std::vector<float> s(len);
  for (int h = 0; h < c.n_heads; ++h) {
    const int kh = h / group;
    const float* qh = q + size_t(h) * D;
    float mx = -INFINITY;
    for (int t = 0; t < len; ++t) {
      const float* kt = k + t * kv_stride + size_t(kh) * D;
      float dot = 0;
      for (int i = 0; i < D; ++i) dot += qh[i] * kt[i];
      s[t] = dot * scale;
      mx = std::max(mx, s[t]);
    }
    float sum = 0;
    for (int t = 0; t < len; ++t) sum += (s[t] = std::exp(s[t] - mx));
    float* oh = out + size_t(h) * D;
    std::fill(oh, oh + D, 0.0f);
    for (int t = 0; t < len; ++t) {
      const float p = s[t] / sum;
      const float* vt = v + t * kv_stride + size_t(kh) * D;
      for (int i = 0; i < D; ++i) oh[i] += p * vt[i];
    }
  }
}

absl::StatusOr<std::vector<float>> Transformer::prefill(uint64_t seq, std::span<const int> tokens) {
  const Config& c = model_.config;
  const int T = int(tokens.size());
  if (T < 1 || T > c.max_seq_len) {
    return absl::InvalidArgumentError(absl::StrCat("prompt of ", T, " tokens; expected 1..", c.max_seq_len));
  }
  const size_t qd = c.q_dim(), kvd = c.kv_dim();
  std::vector<float> x(size_t(T) * c.dim);
  for (int t = 0; t < T; ++t) {
    if (tokens[t] < 0 || tokens[t] >= c.vocab_size) return absl::InvalidArgumentError("token out of range");
    std::memcpy(&x[size_t(t) * c.dim], &model_.weights.embedding[size_t(tokens[t]) * c.dim], c.dim * 4);
  }
  std::vector<float> K(size_t(c.n_layers) * T * kvd), V(K.size()), Q(size_t(c.n_layers) * T * qd);
  std::vector<float> att(size_t(T) * qd);
  std::vector<int> positions(T);
  for (int t = 0; t < T; ++t) positions[t] = t;
  for (int l = 0; l < c.n_layers; ++l) {
    const Layer layer{c, model_.weights, l};
    float* k = &K[size_t(l) * T * kvd];
    float* v = &V[size_t(l) * T * kvd];
    float* q = &Q[size_t(l) * T * qd];
    layer.qkv(x.data(), positions.data(), T, q, k, v);
    for (int t = 0; t < T; ++t) attend(c, q + t * qd, k, v, t + 1, kvd, &att[t * qd]);
    layer.finish(x.data(), att.data(), T);
  }
  if (auto s = attention_.prefill(seq, T, K, V, Q); !s.ok()) return s;
  std::vector<float> logits(c.vocab_size);
  output_logits(model_, &x[size_t(T - 1) * c.dim], 1, logits.data());
  return logits;
}

absl::Status Transformer::decode(std::span<const uint64_t> seqs, std::span<const int> tokens,
                                 std::span<const int> positions, std::span<float> logits) {
  const Config& c = model_.config;
  const size_t B = seqs.size();
  if (tokens.size() != B || positions.size() != B || logits.size() != B * c.vocab_size) {
    return absl::InvalidArgumentError("decode: seqs, tokens, positions and logits disagree on the batch size");
  }
  const size_t qd = c.q_dim(), kvd = c.kv_dim();
  std::vector<float> x(B * c.dim), q(B * qd), k(B * kvd), v(B * kvd), att(B * qd);
  for (size_t b = 0; b < B; ++b) {
    if (tokens[b] < 0 || tokens[b] >= c.vocab_size) return absl::InvalidArgumentError("token out of range");
    if (positions[b] < 0 || positions[b] >= c.max_seq_len) {
      return absl::OutOfRangeError(absl::StrCat("position ", positions[b], " is past the model's context of ",
                                                c.max_seq_len));
    }
    std::memcpy(&x[b * c.dim], &model_.weights.embedding[size_t(tokens[b]) * c.dim], c.dim * 4);
  }
  for (int l = 0; l < c.n_layers; ++l) {
    const Layer layer{c, model_.weights, l};
    layer.qkv(x.data(), positions.data(), int(B), q.data(), k.data(), v.data());
    if (auto s = attention_.step(l, seqs, k, v, q, att); !s.ok()) return s;
    layer.finish(x.data(), att.data(), int(B));
  }
  output_logits(model_, x.data(), int(B), logits.data());
  return absl::OkStatus();
}

DenseAttention::DenseAttention(const Config& config, std::string dtype) : config_(config), dtype_(std::move(dtype)) {}

float DenseAttention::round_stored(float x) const {
  if (dtype_ == "fp16") return kernels::half_to_float(kernels::float_to_half(x));
  if (dtype_ == "bf16") return kernels::bf16_to_float(kernels::float_to_bf16(x));
  return x;
}

DenseAttention::History* DenseAttention::find(uint64_t seq) {
  for (auto& [id, h] : histories_) {
    if (id == seq) return &h;
  }
  return nullptr;
}

absl::StatusOr<uint64_t> DenseAttention::create_sequence() {
  History h;
  h.k.resize(config_.n_layers);
  h.v.resize(config_.n_layers);
  histories_.emplace_back(next_id_, std::move(h));
  return next_id_++;
}

absl::Status DenseAttention::prefill(uint64_t seq, int num_tokens, std::span<const float> k,
                                     std::span<const float> v, std::span<const float> q) {
  History* h = find(seq);
  if (!h) return absl::NotFoundError(absl::StrCat("no sequence ", seq));
  const size_t per_layer = size_t(num_tokens) * config_.kv_dim();
  for (int l = 0; l < config_.n_layers; ++l) {
    for (size_t i = 0; i < per_layer; ++i) {
      h->k[l].push_back(round_stored(k[l * per_layer + i]));
      h->v[l].push_back(round_stored(v[l * per_layer + i]));
    }
  }
  h->length += num_tokens;
  return absl::OkStatus();
}

absl::Status DenseAttention::step(int layer, std::span<const uint64_t> seqs, std::span<const float> k,
                                  std::span<const float> v, std::span<const float> q, std::span<float> out) {
  const size_t kvd = config_.kv_dim(), qd = config_.q_dim();
  for (size_t b = 0; b < seqs.size(); ++b) {
    History* h = find(seqs[b]);
    if (!h) return absl::NotFoundError(absl::StrCat("no sequence ", seqs[b]));
    for (size_t i = 0; i < kvd; ++i) {
      h->k[layer].push_back(round_stored(k[b * kvd + i]));
      h->v[layer].push_back(round_stored(v[b * kvd + i]));
    }
    const int len = int(h->k[layer].size() / kvd);
    attend(config_, &q[b * qd], h->k[layer].data(), h->v[layer].data(), len, kvd, &out[b * qd]);
    if (layer == config_.n_layers - 1) h->length = len;
  }
  return absl::OkStatus();
}

absl::Status DenseAttention::release(uint64_t seq) {
  auto it = std::find_if(histories_.begin(), histories_.end(), [&](auto& p) { return p.first == seq; });
  if (it == histories_.end()) return absl::NotFoundError(absl::StrCat("no sequence ", seq));
  histories_.erase(it);
  return absl::OkStatus();
}

std::string chat_prompt(const std::string& system, const std::string& user) {
  std::string s;
  if (!system.empty()) s += "<|im_start|>system\n" + system + "<|im_end|>\n";
  return s + "<|im_start|>user\n" + user + "<|im_end|>\n<|im_start|>assistant\n";
}

namespace {
// xorshift64*: a uniform in [0, 1) from the caller's state.
double uniform(uint64_t* rng) {
  uint64_t& s = *rng;
  if (s == 0) s = 0x9E3779B97F4A7C15ull;  // xorshift never leaves 0
  s ^= s >> 12;
  s ^= s << 25;
  s ^= s >> 27;
  return double((s * 0x2545F4914F6CDD1Dull) >> 11) / double(1ull << 53);
}

// softmax(logits)'s normaliser in float64: the largest logit and log(sum(exp(logit))).
struct LogNormaliser {
  double max = -INFINITY, log_z = 0;
};
LogNormaliser log_normaliser(std::span<const float> logits) {
  LogNormaliser n;
  for (float x : logits) n.max = std::max(n.max, double(x));
  double sum = 0;
  for (float x : logits) sum += std::exp(double(x) - n.max);
  n.log_z = n.max + std::log(sum);
  return n;
}

// Token ids by logit, highest first, ties by lower id.
auto by_logit(std::span<const float> logits) {
  return [logits](int a, int b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
}
}  // namespace

int sample(std::span<const float> logits, float temperature, uint64_t* rng) {
  const int n = int(logits.size());
  int best = 0;
  for (int i = 1; i < n; ++i) {
    if (logits[i] > logits[best]) best = i;
  }
  if (temperature <= 0) return best;
  std::vector<double> p(n);
  double sum = 0;
  for (int i = 0; i < n; ++i) sum += (p[i] = std::exp(double(logits[i] - logits[best]) / temperature));
  const double u = uniform(rng) * sum;
  double acc = 0;
  for (int i = 0; i < n; ++i) {
    acc += p[i];
    if (u < acc) return i;
  }
  return n - 1;
}

int sample_top_p(std::span<const float> logits, float temperature, float top_p, std::span<const int> banned,
                 uint64_t* rng) {
  std::vector<float> l(logits.begin(), logits.end());
  for (int id : banned) l[id] = -INFINITY;
  const std::span<const float> view(l);
  if (temperature <= 0) return sample(view, 0, nullptr);
  const int n = int(l.size());
  const int best = sample(view, 0, nullptr);
  std::vector<double> p(n);
  double sum = 0;
  for (int i = 0; i < n; ++i) sum += (p[i] = std::exp(double(l[i] - l[best]) / temperature));
  // The nucleus: the shortest run of tokens, likeliest first, whose mass reaches top_p of the
  // whole. Only that run needs sorting: the likeliest 64, then 4x more until it is covered.
  std::vector<int> order(n);
  for (int i = 0; i < n; ++i) order[i] = i;
  int kept = n;
  for (int k = std::min(64, n);; k = std::min(4 * k, n)) {
    std::partial_sort(order.begin(), order.begin() + k, order.end(), by_logit(view));
    double acc = 0;
    int reached = 0;
    for (int i = 0; i < k && top_p < 1; ++i) {
      acc += p[order[i]];
      if (acc >= top_p * sum) {
        reached = i + 1;
        break;
      }
    }
    if (reached > 0) {
      kept = reached;
      break;
    }
    if (k == n) break;
  }
  double nucleus = 0;
  for (int i = 0; i < kept; ++i) nucleus += p[order[i]];
  const double u = uniform(rng) * nucleus;
  double acc = 0;
  for (int i = 0; i < kept; ++i) {
    acc += p[order[i]];
    if (u < acc) return order[i];
  }
  return order[kept - 1];
}

TopTokens top_tokens(std::span<const float> logits, int k) {
  const int n = int(logits.size());
  k = std::clamp(k, 1, n);
  const auto [mx, log_z] = log_normaliser(logits);
  std::vector<int> order(n);
  for (int i = 0; i < n; ++i) order[i] = i;
  std::partial_sort(order.begin(), order.begin() + k, order.end(), by_logit(logits));
  TopTokens t;
  t.ids.assign(order.begin(), order.begin() + k);
  double rest = 0;
  for (int i = k; i < n; ++i) rest += std::exp(double(logits[order[i]]) - mx);
  for (int id : t.ids) t.logp.push_back(float(double(logits[id]) - log_z));
  t.rest_logp = k == n || rest == 0 ? -INFINITY : std::log(rest) + mx - log_z;
  return t;
}

double kl_divergence(const TopTokens& p, std::span<const float> q_logits) {
  const auto [mx, log_z] = log_normaliser(q_logits);
  double kl = 0;
  std::vector<char> kept(q_logits.size(), 0);
  for (size_t i = 0; i < p.ids.size(); ++i) {
    kept[p.ids[i]] = 1;
    kl += std::exp(double(p.logp[i])) * (double(p.logp[i]) - (double(q_logits[p.ids[i]]) - log_z));
  }
  if (std::isfinite(p.rest_logp)) {
    // q's mass outside p's tokens, summed over them (1 - kept would cancel when q is peaked).
    double q_rest = 0;
    for (size_t i = 0; i < q_logits.size(); ++i) {
      if (!kept[i]) q_rest += std::exp(double(q_logits[i]) - mx);
    }
    const double lq_rest = q_rest > 0 ? std::log(q_rest) + mx - log_z : -INFINITY;
    kl += std::exp(p.rest_logp) * (p.rest_logp - lq_rest);
  }
  return std::max(kl, 0.0);
}

double log_prob(std::span<const float> logits, int token) {
  double mx = logits[0];
  for (float l : logits) mx = std::max(mx, double(l));
  double sum = 0;
  for (float l : logits) sum += std::exp(double(l) - mx);
  return double(logits[token]) - mx - std::log(sum);
}

}  // namespace karakv::llama
