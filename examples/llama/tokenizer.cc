#include "llama/tokenizer.h"

#include <cstdio>

namespace karakv::llama {
namespace {

constexpr std::string_view kSpace = "\xe2\x96\x81";  // U+2581, sentencepiece's space

// Parses "<0xXX>" into its byte; -1 for anything else.
int byte_piece(std::string_view p) {
  if (p.size() != 6 || p.substr(0, 3) != "<0x" || p[5] != '>') return -1;
  auto hex = [](char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  const int hi = hex(p[3]), lo = hex(p[4]);
  return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

}  // namespace

Tokenizer::Tokenizer(std::vector<std::string> pieces, std::vector<float> scores)
    : pieces_(std::move(pieces)), scores_(std::move(scores)) {
  for (int& t : byte_token_) t = -1;
  for (int i = 0; i < int(pieces_.size()); ++i) {
    ids_.emplace(pieces_[i], i);  // first wins on duplicates
    if (int b = byte_piece(pieces_[i]); b >= 0 && byte_token_[b] < 0) byte_token_[b] = i;
  }
  space_piece_ = lookup(kSpace);
}

int Tokenizer::lookup(std::string_view s) const {
  auto it = ids_.find(std::string(s));
  return it == ids_.end() ? -1 : it->second;
}

std::vector<int> Tokenizer::encode(std::string_view text, bool bos, bool eos) const {
  std::string norm;
  if (!text.empty()) norm = std::string(kSpace);
  for (char c : text) {
    if (c == ' ') norm += kSpace;
    else norm += c;
  }

  std::vector<int> tokens;
  if (bos) tokens.push_back(kBos);
  const size_t first = tokens.size();
  // UTF-8 characters (a lead byte plus up to three continuation bytes) to pieces or bytes.
  for (size_t i = 0; i < norm.size();) {
    size_t j = i + 1;
    while (j < norm.size() && (uint8_t(norm[j]) & 0xC0) == 0x80 && j - i < 4) ++j;
    const std::string_view ch(norm.data() + i, j - i);
    if (int id = lookup(ch); id >= 0) {
      tokens.push_back(id);
    } else {
      for (char b : ch) {
        const int id_b = byte_token_[uint8_t(b)];
        tokens.push_back(id_b >= 0 ? id_b : 0);  // <unk> if the vocabulary lacks byte fallback
      }
    }
    i = j;
  }
  // Merge the best-scoring adjacent pair until none merges.
  std::string pair;
  while (true) {
    float best = -1e30f;
    int best_id = -1;
    size_t best_at = 0;
    for (size_t i = first; i + 1 < tokens.size(); ++i) {
      pair = pieces_[tokens[i]];
      pair += pieces_[tokens[i + 1]];
      if (int id = lookup(pair); id >= 0 && scores_[id] > best) {
        best = scores_[id];
        best_id = id;
        best_at = i;
      }
    }
    if (best_id < 0) break;
    tokens[best_at] = best_id;
    tokens.erase(tokens.begin() + best_at + 1);
  }
  if (eos) tokens.push_back(kEos);
  return tokens;
}

std::string Tokenizer::decode(int prev, int token) const {
  if (token < 0 || token >= vocab_size()) return "";
  if (token == 0 || token == kBos || token == kEos) return "";
  const std::string& p = pieces_[token];
  if (int b = byte_piece(p); b >= 0) return std::string(1, char(b));
  std::string out;
  for (size_t i = 0; i < p.size();) {
    if (p.compare(i, kSpace.size(), kSpace) == 0) {
      out += ' ';
      i += kSpace.size();
    } else {
      out += p[i++];
    }
  }
  if (prev == kBos && !out.empty() && out[0] == ' ') out.erase(0, 1);
  return out;
}

std::string Tokenizer::decode(const std::vector<int>& tokens) const {
  std::string out;
  int prev = kBos;
  for (int t : tokens) {
    out += decode(prev, t);
    prev = t;
  }
  return out;
}

}  // namespace karakv::llama
