// The byte-level BPE tokenizer of GPT-2 style models (SmolLM2): text is split into chunks, each
// chunk's bytes become GPT-2's printable byte-to-unicode characters, then the adjacent pair with
// the lowest merge rank is merged until none applies. Control tokens (<|im_start|>, ...) written
// literally in the text become their own ids. Decoding maps characters back to bytes, so
// decode(encode(text)) == text for any text made of bytes the vocabulary has. SmolLM2's lacks 21:
// the control characters 0x04 0x06 0x13 0x14 0x16 0x1D, 0xC0 0xC1 and 0xF5..0xFF (never in valid
// UTF-8), and 0xF1..0xF4 (lead bytes of code points U+40000 and up, which hold no assigned
// characters in common use); encode drops such bytes (llama.cpp would fail), so only text
// containing them changes.
//
// Pre-tokenization approximates SmolLM2's (Hugging Face: Split(\p{N}, isolated), then ByteLevel's
// GPT-2 regex 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+) with
// ASCII classes: \p{N} is 0-9, \s is ASCII whitespace plus the Unicode space separators, and every
// other non-ASCII code point counts as a letter (\p{L}). Text whose non-ASCII characters are
// punctuation, symbols, emoji or non-ASCII digits may therefore split (and tokenize) differently
// from the reference; ASCII text splits the same. Round trips are exact either way.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace karakv::llama {

class BpeTokenizer {
 public:
  static constexpr int kControlType = 3;  // GGUF token type of control tokens

  BpeTokenizer() = default;
  // tokens: in byte-to-unicode form; types: GGUF token types; merges: "left right" by rank.
  BpeTokenizer(std::vector<std::string> tokens, std::vector<uint8_t> types, const std::vector<std::string>& merges,
               int bos, int eos);

  bool empty() const { return tokens_.empty(); }
  int vocab_size() const { return int(tokens_.size()); }
  const std::string& token(int id) const { return tokens_[id]; }
  int bos() const { return bos_; }
  int eos() const { return eos_; }
  bool is_control(int id) const { return types_[id] == kControlType; }
  int lookup(std::string_view token) const;  // -1 when absent
  // Whether `byte` has a token; the loader requires it for printable ASCII, tab, newline, carriage
  // return and the bytes of every UTF-8 character below U+40000.
  bool has_byte(uint8_t byte) const { return byte_token_[byte] >= 0; }
  bool covers_text_bytes() const;

  std::vector<int> encode(std::string_view text) const;
  // The bytes of one token; a control token is its literal text ("<|im_end|>").
  std::string decode(int id) const;
  std::string decode(const std::vector<int>& ids) const;

  // The pre-tokenizer's chunks (exposed for tests).
  static std::vector<std::string_view> split(std::string_view text);

 private:
  void encode_chunk(std::string_view chunk, std::vector<int>& out) const;

  std::vector<std::string> tokens_;
  std::vector<uint8_t> types_;
  std::vector<std::string> decoded_;  // bytes of each token
  std::unordered_map<std::string, int> ids_;
  std::unordered_map<uint64_t, std::pair<int, int>> merges_;  // (left, right) -> (rank, merged id)
  std::vector<std::pair<std::string, int>> controls_;          // literal text -> id
  int byte_token_[256] = {};
  int bos_ = -1, eos_ = -1;
};

}  // namespace karakv::llama
