// SipHash-2-4 block keys and the cached-block index (entries, block -> key, LRU order).
#include "server/prefix_cache.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace karakv::server {
namespace {

uint64_t load_le64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

uint64_t rotl(uint64_t x, int b) { return (x << b) | (x >> (64 - b)); }

void sip_round(uint64_t& v0, uint64_t& v1, uint64_t& v2, uint64_t& v3) {
  v0 += v1; v1 = rotl(v1, 13); v1 ^= v0; v0 = rotl(v0, 32);
  v2 += v3; v3 = rotl(v3, 16); v3 ^= v2;
  v0 += v3; v3 = rotl(v3, 21); v3 ^= v0;
  v2 += v1; v1 = rotl(v1, 17); v1 ^= v2; v2 = rotl(v2, 32);
}

void put_u32(std::vector<uint8_t>& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(uint8_t(v >> (8 * i)));
}
void put_u64(std::vector<uint8_t>& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(uint8_t(v >> (8 * i)));
}

// Fixed, public keys: the hash only has to be stable, isolation comes from the namespace and every
// hit is verified. Changing them (or the layout below) invalidates nothing persistent: the cache
// lives in one daemon's memory.
constexpr uint8_t kKeyHi[16] = {'k', 'a', 'r', 'a', 'k', 'v', '-', 'p', 'r', 'e', 'f', 'i', 'x', '-', 'h', 'i'};
constexpr uint8_t kKeyLo[16] = {'k', 'a', 'r', 'a', 'k', 'v', '-', 'p', 'r', 'e', 'f', 'i', 'x', '-', 'l', 'o'};

}  // namespace

uint64_t siphash24(const uint8_t key[16], const void* data, size_t size) {
  const uint8_t* in = static_cast<const uint8_t*>(data);
  const uint64_t k0 = load_le64(key), k1 = load_le64(key + 8);
  uint64_t v0 = 0x736f6d6570736575ull ^ k0, v1 = 0x646f72616e646f6dull ^ k1;
  uint64_t v2 = 0x6c7967656e657261ull ^ k0, v3 = 0x7465646279746573ull ^ k1;
  const uint8_t* end = in + size - size % 8;
  for (; in != end; in += 8) {
    const uint64_t m = load_le64(in);
    v3 ^= m;
    sip_round(v0, v1, v2, v3);
    sip_round(v0, v1, v2, v3);
    v0 ^= m;
  }
  uint64_t b = uint64_t(size) << 56;
  for (size_t i = 0; i < size % 8; ++i) b |= uint64_t(in[i]) << (8 * i);
  v3 ^= b;
  sip_round(v0, v1, v2, v3);
  sip_round(v0, v1, v2, v3);
  v0 ^= b;
  v2 ^= 0xff;
  for (int i = 0; i < 4; ++i) sip_round(v0, v1, v2, v3);
  return v0 ^ v1 ^ v2 ^ v3;
}

PrefixKey prefix_block_key(const PrefixKey& parent, absl::Span<const int32_t> tokens,
                           const kernels::Geometry& g, std::string_view ns) {
  // Every field has a fixed width or a length prefix, so distinct inputs never serialise alike.
  std::vector<uint8_t> bytes;
  bytes.reserve(64 + ns.size() + 4 * tokens.size());
  put_u64(bytes, parent.hi);
  put_u64(bytes, parent.lo);
  for (int v : {g.num_layers, g.num_q_heads, g.num_kv_heads, g.head_dim, g.block_size, int(g.dtype)}) {
    put_u32(bytes, uint32_t(v));
  }
  put_u32(bytes, uint32_t(ns.size()));
  bytes.insert(bytes.end(), ns.begin(), ns.end());
  put_u32(bytes, uint32_t(tokens.size()));
  for (int32_t t : tokens) put_u32(bytes, uint32_t(t));
  return PrefixKey{siphash24(kKeyHi, bytes.data(), bytes.size()), siphash24(kKeyLo, bytes.data(), bytes.size())};
}

std::vector<PrefixKey> prefix_chain_keys(absl::Span<const int32_t> tokens, const kernels::Geometry& g,
                                         std::string_view ns) {
  const size_t b = size_t(g.block_size);
  std::vector<PrefixKey> keys;
  keys.reserve(tokens.size() / b);
  PrefixKey parent;
  for (size_t start = 0; start + b <= tokens.size(); start += b) {
    parent = prefix_block_key(parent, tokens.subspan(start, b), g, ns);
    keys.push_back(parent);
  }
  return keys;
}

std::vector<PrefixCache::Hit> PrefixCache::match(absl::Span<const int32_t> tokens, const kernels::Geometry& g,
                                                 std::string_view ns) const {
  std::vector<Hit> hits;
  const size_t b = size_t(g.block_size);
  PrefixKey parent;
  for (size_t start = 0; start + b <= tokens.size(); start += b) {
    const absl::Span<const int32_t> block = tokens.subspan(start, b);
    const PrefixKey key = prefix_block_key(parent, block, g, ns);
    auto it = entries_.find(key);
    if (it == entries_.end()) break;
    const Entry& e = it->second;
    // Verify what the key stands for: a hash collision becomes a miss.
    if (!(e.parent == parent) || e.cache_namespace != ns ||
        !std::equal(e.tokens.begin(), e.tokens.end(), block.begin(), block.end())) {
      break;
    }
    hits.push_back(Hit{key, e.block});
    parent = key;
  }
  return hits;
}

bool PrefixCache::insert(const PrefixKey& key, Entry entry) {
  if (entries_.contains(key) || by_block_.contains(entry.block)) return false;
  entry.tick = ++clock_;
  lru_[entry.tick] = key;
  by_block_[entry.block] = key;
  entries_.emplace(key, std::move(entry));
  return true;
}

void PrefixCache::touch(const std::vector<Hit>& hits) {
  std::vector<PrefixKey> chain;
  chain.reserve(hits.size());
  for (const Hit& h : hits) chain.push_back(h.key);
  touch(chain);
}

void PrefixCache::touch(absl::Span<const PrefixKey> chain) {
  for (auto it = chain.rbegin(); it != chain.rend(); ++it) {
    auto e = entries_.find(*it);
    if (e == entries_.end()) continue;
    lru_.erase(e->second.tick);
    e->second.tick = ++clock_;
    lru_[e->second.tick] = *it;
  }
}

int32_t PrefixCache::erase(const PrefixKey& key) {
  auto it = entries_.find(key);
  if (it == entries_.end()) return -1;
  const int32_t block = it->second.block;
  lru_.erase(it->second.tick);
  by_block_.erase(block);
  entries_.erase(it);
  return block;
}

std::vector<PrefixKey> PrefixCache::lru_order() const {
  std::vector<PrefixKey> out;
  out.reserve(lru_.size());
  for (const auto& [tick, key] : lru_) out.push_back(key);
  return out;
}

std::string PrefixCache::check() const {
  if (by_block_.size() != entries_.size() || lru_.size() != entries_.size()) {
    return absl::StrCat("prefix cache indexes disagree: ", entries_.size(), " entries, ", by_block_.size(),
                        " blocks, ", lru_.size(), " LRU slots");
  }
  for (const auto& [key, e] : entries_) {
    auto b = by_block_.find(e.block);
    auto t = lru_.find(e.tick);
    if (b == by_block_.end() || !(b->second == key) || t == lru_.end() || !(t->second == key)) {
      return absl::StrCat("prefix cache entry of block ", e.block, " is not indexed consistently");
    }
  }
  return "";
}

}  // namespace karakv::server
