#include "llama/bpe_tokenizer.h"

#include <algorithm>
#include <climits>

namespace karakv::llama {
namespace {

// GPT-2's byte-to-unicode table: printable Latin-1 bytes map to themselves, the other 68 bytes to
// U+0100.. in byte order, so every byte has a visible character (a space is "Ġ", U+0120).
struct ByteUnicode {
  uint32_t to_cp[256];
  std::unordered_map<uint32_t, uint8_t> to_byte;
  ByteUnicode() {
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      to_cp[b] = printable ? uint32_t(b) : uint32_t(256 + n++);
      to_byte[to_cp[b]] = uint8_t(b);
    }
  }
};
const ByteUnicode& byte_unicode() {
  static const ByteUnicode table;
  return table;
}

void append_utf8(std::string& s, uint32_t cp) {
  if (cp < 0x80) {
    s += char(cp);
  } else if (cp < 0x800) {
    s += char(0xC0 | (cp >> 6));
    s += char(0x80 | (cp & 0x3F));
  } else {
    s += char(0xE0 | (cp >> 12));
    s += char(0x80 | ((cp >> 6) & 0x3F));
    s += char(0x80 | (cp & 0x3F));
  }
}

// The code point at s[i] and its length in bytes; an invalid byte is its own 1-byte "character".
std::pair<uint32_t, int> next_cp(std::string_view s, size_t i) {
  const uint8_t c = uint8_t(s[i]);
  int len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
  if (len == 0 || i + len > s.size()) return {c, 1};
  uint32_t cp = len == 1 ? c : len == 2 ? (c & 0x1F) : len == 3 ? (c & 0x0F) : (c & 0x07);
  for (int k = 1; k < len; ++k) {
    const uint8_t cc = uint8_t(s[i + k]);
    if ((cc & 0xC0) != 0x80) return {c, 1};
    cp = (cp << 6) | (cc & 0x3F);
  }
  return {cp, len};
}

enum class CharClass { kSpace, kLetter, kDigit, kOther };

CharClass classify(uint32_t cp) {
  if (cp == ' ' || (cp >= '\t' && cp <= '\r') || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
      (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000) {
    return CharClass::kSpace;
  }
  if (cp >= '0' && cp <= '9') return CharClass::kDigit;
  if ((cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z') || cp >= 0x80) return CharClass::kLetter;
  return CharClass::kOther;
}

uint64_t pair_key(int a, int b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); }

}  // namespace

BpeTokenizer::BpeTokenizer(std::vector<std::string> tokens, std::vector<uint8_t> types,
                           const std::vector<std::string>& merges, int bos, int eos)
    : tokens_(std::move(tokens)), types_(std::move(types)), bos_(bos), eos_(eos) {
  const ByteUnicode& bu = byte_unicode();
  decoded_.resize(tokens_.size());
  for (int i = 0; i < int(tokens_.size()); ++i) {
    ids_.emplace(tokens_[i], i);
    if (types_[i] == kControlType) {
      decoded_[i] = tokens_[i];
      controls_.emplace_back(tokens_[i], i);
      continue;
    }
    std::string& bytes = decoded_[i];
    for (size_t p = 0; p < tokens_[i].size();) {
      auto [cp, len] = next_cp(tokens_[i], p);
      auto it = bu.to_byte.find(cp);
      if (it != bu.to_byte.end()) {
        bytes += char(it->second);
      } else {
        bytes.append(tokens_[i], p, len);  // not byte-level: keep the text as it is
      }
      p += len;
    }
  }
  for (int b = 0; b < 256; ++b) {
    std::string ch;
    append_utf8(ch, bu.to_cp[b]);
    byte_token_[b] = lookup(ch);
  }
  for (int rank = 0; rank < int(merges.size()); ++rank) {
    const std::string& m = merges[rank];
    const size_t sp = m.find(' ');
    if (sp == std::string::npos) continue;
    const int a = lookup(std::string_view(m).substr(0, sp)), b = lookup(std::string_view(m).substr(sp + 1));
    const int merged = lookup(m.substr(0, sp) + m.substr(sp + 1));
    if (a < 0 || b < 0 || merged < 0) continue;
    merges_.emplace(pair_key(a, b), std::make_pair(rank, merged));  // first (best) rank wins
  }
}

int BpeTokenizer::lookup(std::string_view token) const {
  auto it = ids_.find(std::string(token));
  return it == ids_.end() ? -1 : it->second;
}

bool BpeTokenizer::covers_text_bytes() const {
  for (int b = 0; b < 256; ++b) {
    const bool needed = (b >= 0x20 && b <= 0x7E) || b == '\t' || b == '\n' || b == '\r' || (b >= 0x80 && b <= 0xBF) ||
                        (b >= 0xC2 && b <= 0xF0);
    if (needed && byte_token_[b] < 0) return false;
  }
  return true;
}

std::vector<std::string_view> BpeTokenizer::split(std::string_view text) {
  std::vector<std::string_view> out;
  // Character classes and byte offsets, with a sentinel at the end.
  std::vector<CharClass> cls;
  std::vector<size_t> at;
  std::vector<uint32_t> cps;
  for (size_t p = 0; p < text.size();) {
    auto [cp, len] = next_cp(text, p);
    cls.push_back(classify(cp));
    cps.push_back(cp);
    at.push_back(p);
    p += len;
  }
  const size_t n = cls.size();
  at.push_back(text.size());
  auto emit = [&](size_t from, size_t to) { out.push_back(text.substr(at[from], at[to] - at[from])); };
  // Digits split first (each is its own chunk); the GPT-2 regex runs on the text between them.
  size_t i = 0;
  while (i < n) {
    if (cls[i] == CharClass::kDigit) {
      emit(i, i + 1);
      ++i;
      continue;
    }
    size_t end = i;
    while (end < n && cls[end] != CharClass::kDigit) ++end;
    auto run = [&](size_t j, CharClass c) {
      while (j < end && cls[j] == c) ++j;
      return j;
    };
    while (i < end) {
      // 's|'t|'re|'ve|'m|'ll|'d
      if (cps[i] == '\'' && i + 1 < end) {
        const uint32_t a = cps[i + 1], b = i + 2 < end ? cps[i + 2] : 0;
        size_t len = 0;
        if (a == 's' || a == 't' || a == 'm' || a == 'd') len = 2;
        if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) len = 3;
        if (len) {
          emit(i, i + len);
          i += len;
          continue;
        }
      }
      // ' ?\p{L}+' and ' ?[^\s\p{L}\p{N}]+'
      const size_t j = (cps[i] == ' ' && i + 1 < end && cls[i + 1] != CharClass::kSpace) ? i + 1 : i;
      if (cls[j] == CharClass::kLetter || cls[j] == CharClass::kOther) {
        const size_t k = run(j, cls[j]);
        emit(i, k);
        i = k;
        continue;
      }
      // '\s+(?!\S)' leaves the last space of a run for the next word; '\s+' takes a lone one.
      size_t k = run(i, CharClass::kSpace);
      if (k < end && k - i > 1) --k;
      emit(i, k);
      i = k;
    }
  }
  return out;
}

void BpeTokenizer::encode_chunk(std::string_view chunk, std::vector<int>& out) const {
  std::vector<int> syms;
  syms.reserve(chunk.size());
  for (char c : chunk) {
    if (byte_token_[uint8_t(c)] >= 0) syms.push_back(byte_token_[uint8_t(c)]);  // else dropped (see header)
  }
  while (syms.size() > 1) {
    int best_rank = INT_MAX, best = -1, merged = -1;
    for (size_t i = 0; i + 1 < syms.size(); ++i) {
      auto it = merges_.find(pair_key(syms[i], syms[i + 1]));
      if (it != merges_.end() && it->second.first < best_rank) {
        best_rank = it->second.first;
        best = int(i);
        merged = it->second.second;
      }
    }
    if (best < 0) break;
    syms[best] = merged;
    syms.erase(syms.begin() + best + 1);
  }
  out.insert(out.end(), syms.begin(), syms.end());
}

std::vector<int> BpeTokenizer::encode(std::string_view text) const {
  std::vector<int> out;
  while (!text.empty()) {
    // The earliest control token written in the text (longest on a tie) ends this plain stretch.
    size_t best_at = std::string_view::npos, best_len = 0;
    int best_id = -1;
    for (const auto& [literal, id] : controls_) {
      const size_t p = text.find(literal);
      if (p != std::string_view::npos && (p < best_at || (p == best_at && literal.size() > best_len))) {
        best_at = p;
        best_len = literal.size();
        best_id = id;
      }
    }
    const std::string_view plain = text.substr(0, best_at);
    for (std::string_view chunk : split(plain)) encode_chunk(chunk, out);
    if (best_id < 0) break;
    out.push_back(best_id);
    text.remove_prefix(best_at + best_len);
  }
  return out;
}

std::string BpeTokenizer::decode(int id) const {
  if (id < 0 || id >= int(decoded_.size())) return {};
  return decoded_[id];
}

std::string BpeTokenizer::decode(const std::vector<int>& ids) const {
  std::string s;
  for (int id : ids) s += decode(id);
  return s;
}

}  // namespace karakv::llama
