// The sentencepiece-style tokenizer that ships inside a stories260K model file: pieces with scores,
// "▁" (U+2581) for a space, byte-fallback pieces <0x00>..<0xFF>. Encoding is llama2.c's: split
// into UTF-8 characters (a character with no piece becomes its byte tokens), then repeatedly merge
// the adjacent pair whose concatenation is a piece with the best score.
#pragma once

#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace karakv::llama {

class Tokenizer {
 public:
  static constexpr int kBos = 1;
  static constexpr int kEos = 2;

  Tokenizer() = default;
  Tokenizer(std::vector<std::string> pieces, std::vector<float> scores);

  int vocab_size() const { return int(pieces_.size()); }
  const std::string& piece(int id) const { return pieces_[id]; }
  float score(int id) const { return scores_[id]; }

  // Spaces become "▁" and a "▁" is prepended (sentencepiece's dummy prefix) when text is not empty.
  std::vector<int> encode(std::string_view text, bool bos, bool eos) const;

  // The bytes of one token following `prev`: "▁" becomes a space, <0xXX> becomes that byte, the
  // control pieces (<unk>, <s>, </s>) become nothing, and the dummy-prefix space right after BOS
  // is dropped.
  std::string decode(int prev, int token) const;
  // Concatenated decode of a whole stream (prev = BOS before the first token).
  std::string decode(const std::vector<int>& tokens) const;

 private:
  int lookup(std::string_view s) const;

  std::vector<std::string> pieces_;
  std::vector<float> scores_;
  std::unordered_map<std::string, int> ids_;
  int byte_token_[256] = {};
  int space_piece_ = -1;
};

}  // namespace karakv::llama
