// The sequence store: blocks, tables and the data path. Every mutating function either fully
// succeeds or leaves the sequence as it was; callers count and reserve blocks first.
#include "server/sequence_store.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "server/validation.h"

namespace karakv::server {

using kernels::Geometry;

absl::StatusOr<std::unique_ptr<SequenceStore>> SequenceStore::create(const StoreConfig& config,
                                                                     kernels::Backend& backend) {
  if (absl::Status s = validate_geometry(config.geometry); !s.ok()) return s;
  const size_t block_bytes = config.geometry.block_bytes();
  const int64_t num_blocks = config.pool_bytes / static_cast<int64_t>(block_bytes);
  if (num_blocks < 1) {
    return absl::InvalidArgumentError(absl::StrCat("pool of ", config.pool_bytes,
                                                   " bytes holds no block of ", block_bytes, " bytes"));
  }
  if (num_blocks > INT32_MAX) return absl::InvalidArgumentError("pool holds more than 2^31 blocks");
  for (kernels::Op op : {kernels::Op::kWriteKV, kernels::Op::kDecodeAttention,
                         kernels::Op::kCausalAttention, kernels::Op::kReadKV, kernels::Op::kCopyBlock}) {
    if (!backend.supports(op, config.geometry.dtype)) {
      return absl::UnimplementedError(absl::StrCat("backend ", std::string(backend.name()), " cannot run ",
                                                   kernels::op_name(op), " for dtype ",
                                                   kernels::dtype_name(config.geometry.dtype)));
    }
  }
  void* memory = nullptr;
  const size_t pool_bytes = static_cast<size_t>(num_blocks) * block_bytes;
  if (auto s = backend.allocate(pool_bytes, &memory); !s.is_ok()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate a ", pool_bytes, "-byte pool on ", std::string(backend.name()), ": ", s.message));
  }
  return std::unique_ptr<SequenceStore>(new SequenceStore(config, backend, memory, static_cast<int32_t>(num_blocks)));
}

SequenceStore::SequenceStore(const StoreConfig& config, kernels::Backend& backend, void* pool_memory,
                             int32_t num_blocks)
    : config_(config), backend_(backend), pool_memory_(pool_memory), pool_(num_blocks) {}

SequenceStore::~SequenceStore() {
  sequences_.clear();
  backend_.free(pool_memory_);
}

size_t append_bytes(const Geometry& g, int64_t num_tokens) {
  return size_t(g.num_layers) * num_tokens * g.kv_token_elems() * kernels::dtype_size(g.dtype);
}
size_t step_kv_bytes(const Geometry& g, size_t batch) {
  return batch * g.kv_token_elems() * kernels::dtype_size(g.dtype);
}
size_t q_bytes(const Geometry& g, size_t rows) { return rows * g.q_token_elems() * 4; }

// ---- records ----

Sequence& SequenceStore::add() {
  const uint64_t id = next_id_++;
  Sequence& seq = sequences_[id];
  seq.id = id;
  return seq;
}

Sequence* SequenceStore::find(uint64_t id) {
  auto it = sequences_.find(id);
  return it == sequences_.end() ? nullptr : &it->second;
}

const Sequence* SequenceStore::find(uint64_t id) const {
  auto it = sequences_.find(id);
  return it == sequences_.end() ? nullptr : &it->second;
}

Sequence& SequenceStore::fork(const Sequence& parent) {
  Sequence child = parent;  // copies the table; the blocks are now shared
  child.id = next_id_++;
  child.first_append.reset();  // the parent's TTFT is the parent's
  for (int32_t b : child.blocks) pool_.add_ref(b);
  for (int32_t b : child.qblocks) pool_.add_ref(b);
  const uint64_t id = child.id;
  return sequences_[id] = std::move(child);
}

int SequenceStore::release(Sequence& seq) {
  int freed = 0;
  for (int32_t b : seq.blocks) freed += pool_.release(b) ? 1 : 0;
  for (int32_t b : seq.qblocks) freed += pool_.release(b) ? 1 : 0;
  seq.blocks.clear();
  seq.qblocks.clear();
  return freed;
}

int SequenceStore::erase(uint64_t id) {
  auto it = sequences_.find(id);
  if (it == sequences_.end()) return 0;
  const int freed = release(it->second);
  sequences_.erase(it);
  return freed;
}

// ---- blocks ----

int32_t SequenceStore::blocks_needed(const Sequence& seq, int32_t new_length) const {
  const int32_t b = config_.geometry.block_size;
  const int32_t have = static_cast<int32_t>(seq.blocks.size());
  const int32_t fp_new = new_length - seq.quantized();  // the block table covers unquantized slots
  const int32_t want = (fp_new + b - 1) / b;
  int32_t n = want > have ? want - have : 0;
  // Writing into a partly filled block that a fork shares needs a private copy first.
  const int32_t first = seq.fp_length() / b;
  if (new_length > seq.length && first < have && pool_.refcount(seq.blocks[first]) > 1) ++n;
  return n;
}

absl::Status SequenceStore::reserve(Sequence& seq, int32_t new_length) {
  const int32_t b = config_.geometry.block_size;
  const int32_t have = static_cast<int32_t>(seq.blocks.size());
  const int32_t first = seq.fp_length() / b;
  if (new_length > seq.length && first < have && pool_.refcount(seq.blocks[first]) > 1) {
    std::vector<int32_t> fresh;
    if (absl::Status s = pool_.allocate(1, &fresh); !s.ok()) return s;
    kernels::PagedKV kv;
    kv.pool = pool_memory_;
    kv.geometry = config_.geometry;
    if (auto s = backend_.copy_block(kv, seq.blocks[first], fresh[0]); !s.is_ok()) {
      pool_.release(fresh[0]);
      return to_status(s);
    }
    pool_.release(seq.blocks[first]);
    seq.blocks[first] = fresh[0];
  }
  const int32_t want = (new_length - seq.quantized() + b - 1) / b;
  if (want > have) {
    if (absl::Status s = pool_.allocate(want - static_cast<int32_t>(seq.blocks.size()), &seq.blocks); !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

int32_t SequenceStore::unused_cached_blocks() const {
  int32_t n = 0;
  for (const auto& [key, e] : prefix_cache_.entries()) n += pool_.refcount(e.block) == 1 ? 1 : 0;
  return n;
}

std::vector<int32_t> SequenceStore::cached_blocks() const {
  std::vector<int32_t> out;
  out.reserve(prefix_cache_.size());
  for (const auto& [key, e] : prefix_cache_.entries()) out.push_back(e.block);
  return out;
}

int32_t SequenceStore::evict_unused_cached(int32_t count) {
  int32_t evicted = 0;
  for (const PrefixKey& key : prefix_cache_.lru_order()) {
    if (evicted >= count) break;
    const int32_t block = prefix_cache_.entries().at(key).block;
    if (pool_.refcount(block) != 1) continue;  // a sequence still reads it
    prefix_cache_.erase(key);
    if (prefix_events_ != nullptr) prefix_events_->removed(key);
    pool_.release(block);  // the cache held the only reference: one block freed
    ++prefix_evictions_;
    ++evicted;
  }
  return evicted;
}

bool SequenceStore::make_room(int32_t need) {
  if (pool_.free_count() >= need) return true;
  if (prefix_cache_.size() == 0 || pool_.free_count() + unused_cached_blocks() < need) return false;
  evict_unused_cached(need - pool_.free_count());
  return pool_.free_count() >= need;
}

void SequenceStore::trim_prefix_cache() {
  if (config_.prefix_cache_max_fraction >= 1.0 || prefix_cache_.size() == 0) return;
  const int32_t limit = static_cast<int32_t>(config_.prefix_cache_max_fraction * pool_.total());
  const int32_t unused = unused_cached_blocks();
  if (unused > limit) evict_unused_cached(unused - limit);
}

// ---- prefix cache ----

std::vector<PrefixCache::Hit> SequenceStore::match_prefix(absl::Span<const int32_t> token_ids,
                                                          const std::string& cache_namespace) {
  if (!config_.prefix_cache || token_ids.empty()) return {};
  return prefix_cache_.match(token_ids, config_.geometry, cache_namespace);
}

void SequenceStore::count_lookup(size_t tokens, int32_t hit) {
  ++prefix_lookups_;
  prefix_lookup_tokens_ += tokens;
  prefix_hit_tokens_ += hit;
}

int32_t SequenceStore::adopt_prefix(Sequence& seq, const std::vector<PrefixCache::Hit>& hits,
                                    absl::Span<const int32_t> token_ids) {
  prefix_cache_.touch(hits);
  const int32_t cached = static_cast<int32_t>(hits.size()) * config_.geometry.block_size;
  for (const PrefixCache::Hit& h : hits) {
    pool_.add_ref(h.block);  // shared like a fork's: the first write past them copies nothing
    seq.blocks.push_back(h.block);
    seq.prompt_keys.push_back(h.key);
  }
  seq.prompt_ids.assign(token_ids.begin(), token_ids.begin() + cached);
  seq.length = seq.logical = cached;
  seq.shared_prefix = cached;
  return cached;
}

void SequenceStore::publish_prompt(Sequence& seq, absl::Span<const int32_t> token_ids, int32_t num_tokens) {
  if (seq.decoding || !seq.publish) return;
  // The prompt keeps its ids only while every prompt token came with one.
  if (token_ids.empty() || seq.prompt_ids.size() + size_t(num_tokens) != size_t(seq.logical)) {
    seq.publish = false;
    seq.prompt_ids.clear();
    return;
  }
  seq.prompt_ids.insert(seq.prompt_ids.end(), token_ids.begin(), token_ids.end());
  if (seq.compactions > 0 || seq.length != seq.logical) {
    seq.publish = false;  // the resident prompt is no longer the appended one
    return;
  }
  const Geometry& g = config_.geometry;
  const size_t b = size_t(g.block_size);
  bool published = false;
  while ((seq.prompt_keys.size() + 1) * b <= seq.prompt_ids.size()) {
    const size_t i = seq.prompt_keys.size();
    const PrefixKey parent = i == 0 ? PrefixKey{} : seq.prompt_keys[i - 1];
    const absl::Span<const int32_t> tokens(seq.prompt_ids.data() + i * b, b);
    const PrefixKey key = prefix_block_key(parent, tokens, g, seq.cache_namespace);
    seq.prompt_keys.push_back(key);
    const int32_t slot = static_cast<int32_t>(i * b);
    if (slot < seq.quantized()) continue;  // its full-precision block is gone
    const int32_t block = seq.blocks[size_t(slot - seq.quantized()) / b];
    PrefixCache::Entry e;
    e.parent = parent;
    e.cache_namespace = seq.cache_namespace;
    e.tokens.assign(tokens.begin(), tokens.end());
    e.block = block;
    if (prefix_cache_.insert(key, std::move(e))) {
      if (prefix_events_ != nullptr) prefix_events_->stored(key, parent, tokens);
      pool_.add_ref(block);
      if (prefix_tier_ != nullptr && seq.share_tier) {
        pool_.add_ref(block);
        ++tier_pins_[block];
        if (!prefix_tier_->published(key, block)) unpin_for_tier(block);
      }
      ++prefix_published_;
      published = true;
    }
  }
  // The chain's earlier blocks become newer than its new end: eviction takes chains from the end.
  if (published) prefix_cache_.touch(seq.prompt_keys);
}

void SequenceStore::unpin_for_tier(int32_t block) {
  auto it = tier_pins_.find(block);
  if (it == tier_pins_.end()) return;
  if (--it->second == 0) tier_pins_.erase(it);
  pool_.release(block);
}

int32_t SequenceStore::tier_pinned_blocks() const {
  int32_t n = 0;
  for (const auto& [block, pins] : tier_pins_) n += pins;
  return n;
}

const char* SequenceStore::host_block(int32_t block) const {
  if (backend_.is_device_memory(pool_memory_)) return nullptr;
  return static_cast<const char*>(pool_memory_) + size_t(block) * config_.geometry.block_bytes();
}

std::string SequenceStore::copy_block(int32_t block) const {
  const size_t bytes = config_.geometry.block_bytes();
  std::string out(bytes, '\0');
  if (!backend_.copy_out(out.data(), static_cast<const char*>(pool_memory_) + size_t(block) * bytes, bytes).is_ok()) {
    return {};
  }
  return out;
}

int32_t SequenceStore::install_prefix(const std::string& cache_namespace, absl::Span<const int32_t> token_ids,
                                      const std::vector<PrefixKey>& keys, size_t first,
                                      const std::vector<std::string>& payloads, size_t offset) {
  if (!config_.prefix_cache) return 0;
  const size_t b = size_t(config_.geometry.block_size);
  const size_t bytes = config_.geometry.block_bytes();
  int32_t added = 0;
  // The chain's cached start becomes the newest: making room below must not evict a parent.
  prefix_cache_.touch(absl::MakeConstSpan(keys).subspan(0, std::min(keys.size(), first)));
  for (size_t j = 0; j < payloads.size() && first + j < keys.size(); ++j) {
    const size_t i = first + j;
    const PrefixKey& key = keys[i];
    if (prefix_cache_.entries().contains(key)) continue;  // filled meanwhile (another request, a prompt)
    const PrefixKey parent = i == 0 ? PrefixKey{} : keys[i - 1];
    if (i > 0 && !prefix_cache_.entries().contains(parent)) break;  // a chain must start cached
    if (payloads[j].size() != offset + bytes || !make_room(1)) break;
    std::vector<int32_t> got;
    if (!pool_.allocate(1, &got).ok()) break;
    const int32_t block = got[0];
    if (!backend_.copy_in(static_cast<char*>(pool_memory_) + size_t(block) * bytes, payloads[j].data() + offset, bytes)
             .is_ok()) {
      pool_.release(block);
      break;
    }
    const absl::Span<const int32_t> tokens = token_ids.subspan(i * b, b);
    PrefixCache::Entry e;
    e.parent = parent;
    e.cache_namespace = cache_namespace;
    e.tokens.assign(tokens.begin(), tokens.end());
    e.block = block;
    prefix_cache_.insert(key, std::move(e));  // the cache holds the allocation's reference
    if (prefix_events_ != nullptr) prefix_events_->stored(key, parent, tokens);
    ++added;
  }
  if (added > 0) {
    prefix_cache_.touch(absl::MakeConstSpan(keys).subspan(0, std::min(keys.size(), first + payloads.size())));
  }
  return added;
}

// ---- views and data ----

PagedView SequenceStore::view(absl::Span<const Sequence* const> seqs, absl::Span<const int32_t> lengths) const {
  PagedView v;
  v.offsets.assign(1, 0);
  for (const Sequence* s : seqs) {
    v.table.insert(v.table.end(), s->blocks.begin(), s->blocks.end());
    v.offsets.push_back(static_cast<int32_t>(v.table.size()));
  }
  v.lengths.assign(lengths.begin(), lengths.end());
  v.kv.pool = pool_memory_;
  v.kv.geometry = config_.geometry;
  v.kv.block_table = v.table.data();
  v.kv.table_offset = v.offsets.data();
  v.kv.seq_len = v.lengths.data();
  v.kv.num_seqs = static_cast<int>(seqs.size());
  if (!seqs.empty() && !seqs.front()->qblocks.empty()) {
    v.quantized = true;
    v.qoffsets.assign(1, 0);
    for (const Sequence* s : seqs) {
      v.qtable.insert(v.qtable.end(), s->qblocks.begin(), s->qblocks.end());
      v.qoffsets.push_back(static_cast<int32_t>(v.qtable.size()));
    }
    v.qkv.format = seqs.front()->format;
    v.qkv.tokens_per_block = seqs.front()->tokens_per_qblock;
    v.qkv.seed = seqs.front()->qseed;
    v.qkv.block_table = v.qtable.data();
    v.qkv.table_offset = v.qoffsets.data();
  } else if (!seqs.empty() && seqs.front()->quantize) {
    // Nothing quantized yet, but quantize_aged needs the format to write the first block.
    v.qoffsets.assign(seqs.size() + 1, 0);
    v.qkv.format = seqs.front()->format;
    v.qkv.tokens_per_block = seqs.front()->tokens_per_qblock;
    v.qkv.seed = seqs.front()->qseed;
    v.qkv.block_table = v.qtable.data();
    v.qkv.table_offset = v.qoffsets.data();
  }
  return v;
}

absl::Status SequenceStore::write_prompt(Sequence& seq, int32_t num_tokens, ConstBytes k, ConstBytes v) {
  const Sequence* one = &seq;
  const int32_t length = seq.fp_length() + num_tokens;
  PagedView pv = view(absl::MakeConstSpan(&one, 1), absl::MakeConstSpan(&length, 1));
  if (auto s = backend_.write_kv(pv.kv, 0, seq.fp_length(), num_tokens, 0, config_.geometry.num_layers, k.data(),
                                 v.data());
      !s.is_ok()) {
    return to_status(s);
  }
  tokens_appended_ += num_tokens;
  return absl::OkStatus();
}

absl::Status SequenceStore::write_step(absl::Span<Sequence* const> seqs, int layer, ConstBytes k, ConstBytes v) {
  std::vector<int32_t> positions, lengths;  // the new token's slot; the view covers it
  positions.reserve(seqs.size());
  lengths.reserve(seqs.size());
  for (const Sequence* seq : seqs) {
    positions.push_back(seq->fp_length());
    lengths.push_back(seq->fp_length() + 1);
  }
  std::vector<const Sequence*> members(seqs.begin(), seqs.end());
  PagedView pv = view(members, lengths);
  // One backend call for the batch: on a device, one upload, launch and synchronize per step.
  return to_status(backend_.write_step_kv(pv.kv, layer, positions.data(), k.data(), v.data()));
}

absl::Status SequenceStore::decode_attention(absl::Span<Sequence* const> seqs, int layer, const float* q, float* out,
                                             float scale, const Observers& observers) {
  const Geometry& g = config_.geometry;
  const size_t row = g.q_token_elems();
  const std::vector<float*>& accumulators = observers.accumulators;
  const bool accumulate = !accumulators.empty() || !observers.lse.empty();
  // Groups of sequences one kernel call can serve: unquantized ones together, quantized ones by
  // their format and rotation seed (one QuantizedKV describes a call).
  std::vector<std::vector<size_t>> groups;
  std::vector<size_t> plain;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const Sequence& s = *seqs[i];
    if (s.qblocks.empty()) {
      plain.push_back(i);
      continue;
    }
    auto same = [&](const std::vector<size_t>& group) {
      const Sequence& f = *seqs[group.front()];
      return f.format == s.format && f.tokens_per_qblock == s.tokens_per_qblock && f.qseed == s.qseed;
    };
    auto it = std::find_if(groups.begin(), groups.end(), same);
    if (it == groups.end()) groups.push_back({i});
    else it->push_back(i);
  }
  if (!plain.empty()) groups.insert(groups.begin(), plain);
  if (groups.size() > 1 && (backend_.is_device_memory(q) || backend_.is_device_memory(out))) {
    // Device staging and a batch split into groups: the groups' rows are gathered on the host, so
    // the batch goes through host copies of q and out (a batch of unquantized sequences does not).
    std::vector<float> host_q(seqs.size() * row), host_out(seqs.size() * row);
    if (auto s = backend_.copy_out(host_q.data(), q, host_q.size() * 4); !s.is_ok()) return to_status(s);
    if (absl::Status s = decode_attention(seqs, layer, host_q.data(), host_out.data(), scale, observers); !s.ok()) {
      return s;
    }
    return to_status(backend_.copy_in(out, host_out.data(), host_out.size() * 4));
  }
  for (const std::vector<size_t>& group : groups) {
    const bool whole = group.size() == seqs.size();
    std::vector<const Sequence*> members;
    std::vector<int32_t> lengths;
    std::vector<float> gq, gout;
    for (size_t i : group) {
      members.push_back(seqs[i]);
      lengths.push_back(seqs[i]->fp_length() + 1);
      if (!whole) gq.insert(gq.end(), q + i * row, q + (i + 1) * row);
    }
    if (!whole) gout.resize(gq.size());
    const float* gqp = whole ? q : gq.data();
    float* goutp = whole ? out : gout.data();
    std::vector<float*> acc, lse;
    std::vector<int32_t> first_slot;
    bool any_lse = false;
    if (accumulate) {
      acc.assign(group.size() * g.num_kv_heads, nullptr);
      first_slot.assign(group.size(), 0);
      lse.assign(group.size(), nullptr);
      for (size_t j = 0; j < group.size(); ++j) {
        if (!accumulators.empty()) {
          for (int h = 0; h < g.num_kv_heads; ++h) acc[j * g.num_kv_heads + h] = accumulators[group[j] * g.num_kv_heads + h];
          // A policy's first slot may lie past the cache (Kara's block-aligned tail start). Slots
          // count the quantized tokens first.
          const int32_t slots = lengths[j] + seqs[group[j]]->quantized();
          first_slot[j] = std::min(observers.first_slot[group[j]], slots);
        }
        if (!observers.lse.empty()) lse[j] = observers.lse[group[j]];
        any_lse |= lse[j] != nullptr;
      }
    }
    PagedView pv = view(members, lengths);
    kernels::KernelStatus ks;
    if (pv.quantized) {
      ks = backend_.decode_attention_quantized(pv.kv, pv.qkv, layer, gqp, goutp, scale,
                                               accumulators.empty() ? nullptr : acc.data(),
                                               accumulators.empty() ? nullptr : first_slot.data(),
                                               any_lse ? lse.data() : nullptr);
    } else if (any_lse) {
      ks = backend_.decode_attention_observe(pv.kv, layer, gqp, goutp, scale, acc.data(), first_slot.data(), lse.data());
    } else if (accumulate) {
      ks = backend_.decode_attention_accumulate(pv.kv, layer, gqp, goutp, scale, acc.data(), first_slot.data());
    } else {
      ks = backend_.decode_attention(pv.kv, layer, gqp, goutp, scale);
    }
    if (!ks.is_ok()) return to_status(ks);
    if (!whole) {
      for (size_t j = 0; j < group.size(); ++j) std::copy_n(gout.data() + j * row, row, out + group[j] * row);
    }
  }
  return absl::OkStatus();
}

absl::Status SequenceStore::attend(const Sequence& seq, int layer, int32_t num_queries, const float* q, float* out,
                                   float scale) const {
  const Sequence* one = &seq;
  const int32_t length = seq.fp_length();
  PagedView pv = view(absl::MakeConstSpan(&one, 1), absl::MakeConstSpan(&length, 1));
  if (pv.quantized) {
    return to_status(backend_.causal_attention_quantized(pv.kv, pv.qkv, 0, layer, num_queries, q, out, scale));
  }
  return to_status(backend_.causal_attention(pv.kv, 0, layer, num_queries, q, out, scale));
}

absl::StatusOr<int32_t> SequenceStore::read_kv(
    const Sequence& seq, absl::FunctionRef<absl::StatusOr<ReadKVTargets>(int32_t)> targets) const {
  auto out = targets(seq.length);
  if (!out.ok()) return out.status();
  const size_t want = append_bytes(config_.geometry, seq.length);
  const size_t rows = size_t(config_.geometry.num_layers) * config_.geometry.num_kv_heads;
  if (out->k.size() < want || out->v.size() < want || out->positions.size() < rows * seq.length * 4) {
    return absl::InvalidArgumentError(absl::StrCat("ReadKV outputs too small for ", seq.length,
                                                   " tokens: k and v need ", want,
                                                   " bytes each, positions ", rows * seq.length * 4));
  }
  // Device staging: assembled on the host (the layout mixes dequantized and plain slots), then
  // copied into the device outputs through the backend.
  const bool device = backend_.is_device_memory(out->k.data()) || backend_.is_device_memory(out->v.data()) ||
                      backend_.is_device_memory(out->positions.data());
  std::vector<uint8_t> host_k, host_v, host_positions;
  ReadKVTargets device_out;
  if (device) {
    device_out = *out;
    host_k.resize(want);
    host_v.resize(want);
    host_positions.resize(rows * seq.length * 4);
    out->k = MutableBytes(host_k.data(), host_k.size());
    out->v = MutableBytes(host_v.data(), host_v.size());
    out->positions = MutableBytes(host_positions.data(), host_positions.size());
  }
  if (seq.length > 0) {
    // Quantized blocks come back dequantized (what attention sees), then the unquantized slots.
    const Geometry& g = config_.geometry;
    const size_t tok = g.kv_token_elems() * kernels::dtype_size(g.dtype);  // one token, one layer
    const int32_t nq = seq.quantized(), nf = seq.fp_length();
    const Sequence* one = &seq;
    PagedView pv = view(absl::MakeConstSpan(&one, 1), absl::MakeConstSpan(&nf, 1));
    auto place = [&](const uint8_t* src_k, const uint8_t* src_v, int32_t n, int32_t at) {
      for (int l = 0; l < g.num_layers; ++l) {
        std::memcpy(out->k.data() + (size_t(l) * seq.length + at) * tok, src_k + size_t(l) * n * tok, n * tok);
        std::memcpy(out->v.data() + (size_t(l) * seq.length + at) * tok, src_v + size_t(l) * n * tok, n * tok);
      }
    };
    if (nq > 0) {
      std::vector<uint8_t> bk(size_t(g.num_layers) * seq.tokens_per_qblock * tok), bv(bk.size());
      for (size_t i = 0; i < seq.qblocks.size(); ++i) {
        if (auto s = backend_.dequantize_block(pv.kv, pv.qkv, seq.qblocks[i], bk.data(), bv.data()); !s.is_ok()) {
          return to_status(s);
        }
        place(bk.data(), bv.data(), seq.tokens_per_qblock, int32_t(i) * seq.tokens_per_qblock);
      }
    }
    if (nf > 0) {
      std::vector<uint8_t> fk(size_t(g.num_layers) * nf * tok), fv(fk.size());
      if (auto s = backend_.read_kv(pv.kv, 0, fk.data(), fv.data()); !s.is_ok()) return to_status(s);
      place(fk.data(), fv.data(), nf, nq);
    }
  }
  int32_t* pos = reinterpret_cast<int32_t*>(out->positions.data());
  for (size_t r = 0; r < rows; ++r) {
    for (int32_t t = 0; t < seq.length; ++t) pos[r * seq.length + t] = seq.position(int(r), t);
  }
  if (device) {
    for (auto [dst, src] : {std::pair{device_out.k, &host_k}, std::pair{device_out.v, &host_v},
                            std::pair{device_out.positions, &host_positions}}) {
      if (auto s = backend_.copy_in(dst.data(), src->data(), src->size()); !s.is_ok()) return to_status(s);
    }
  }
  return seq.length;
}

// ---- query cache ----

float* SequenceStore::query_entry(Sequence& seq, int32_t slot, int capacity_hint) {
  const size_t entry = size_t(config_.geometry.num_layers) * config_.geometry.q_token_elems();
  if (seq.q_count > 0 && slot >= seq.q_first && slot < seq.q_first + seq.q_count) {
    return seq.queries.data() + size_t(slot - seq.q_first) * entry;  // a restarted step
  }
  if (seq.q_count == 0 || slot != seq.q_first + seq.q_count) {
    // Not contiguous with what is cached (tokens arrived without queries): start afresh.
    seq.q_first = slot;
    seq.q_count = 0;
    seq.queries.clear();
  }
  if (seq.queries.capacity() == 0) seq.queries.reserve(size_t(std::max(1, capacity_hint)) * entry);
  seq.queries.resize((size_t(seq.q_count) + 1) * entry);
  return seq.queries.data() + size_t(seq.q_count++) * entry;
}

void SequenceStore::trim_queries(Sequence& seq, int32_t keep_from) {
  const int32_t drop = std::clamp(keep_from - seq.q_first, 0, seq.q_count);
  if (drop == 0) return;
  const size_t entry = size_t(config_.geometry.num_layers) * config_.geometry.q_token_elems();
  seq.queries.erase(seq.queries.begin(), seq.queries.begin() + drop * entry);
  seq.q_first += drop;
  seq.q_count -= drop;
  if (seq.q_count == 0) seq.queries.shrink_to_fit();
}

// ---- quantized storage ----

void SequenceStore::quantize_aged(Sequence& seq, int32_t frozen_end) {
  if (!seq.quantize || seq.pending_layer >= 0) return;
  const int32_t limit = std::min(seq.length - seq.residual, frozen_end);
  const int32_t b = config_.geometry.block_size;
  while (seq.quantized() + seq.tokens_per_qblock <= limit) {
    std::vector<int32_t> fresh;
    if (!make_room(1) || !pool_.allocate(1, &fresh).ok()) return;  // retried after the next step
    const Sequence* one = &seq;
    const int32_t length = seq.fp_length();
    PagedView pv = view(absl::MakeConstSpan(&one, 1), absl::MakeConstSpan(&length, 1));
    if (!backend_.quantize_tokens(pv.kv, 0, 0, pv.qkv, fresh[0]).is_ok()) {
      pool_.release(fresh[0]);
      return;
    }
    const int32_t freed_blocks = seq.tokens_per_qblock / b;
    for (int32_t i = 0; i < freed_blocks; ++i) pool_.release(seq.blocks[i]);
    seq.blocks.erase(seq.blocks.begin(), seq.blocks.begin() + freed_blocks);
    seq.qblocks.push_back(fresh[0]);
  }
}

absl::StatusOr<Sequence> SequenceStore::dequantized_copy(const Sequence& seq) {
  const Geometry& g = config_.geometry;
  const int32_t fresh_count = seq.quantized() / g.block_size;
  std::vector<int32_t> fresh;
  make_room(fresh_count);
  if (absl::Status s = pool_.allocate(fresh_count, &fresh); !s.ok()) {
    return absl::ResourceExhaustedError(absl::StrCat("compaction of quantized sequence ", seq.id, " by ", seq.label,
                                                     " must first dequantize into ", fresh_count, " blocks: ",
                                                     s.message()));
  }
  Sequence copy = seq;
  copy.qblocks.clear();
  copy.blocks = fresh;
  copy.blocks.insert(copy.blocks.end(), seq.blocks.begin(), seq.blocks.end());
  // The copy holds its own reference to every unquantized block it shares with the sequence, as a
  // fork does: a compaction of the copy then writes only blocks of its own, and releasing what it
  // replaced leaves the sequence's intact if the copy is dropped.
  for (int32_t blk : seq.blocks) pool_.add_ref(blk);
  const size_t bytes = size_t(g.num_layers) * seq.tokens_per_qblock * g.kv_token_elems() * kernels::dtype_size(g.dtype);
  std::vector<uint8_t> k(bytes), v(bytes);
  const Sequence* source = &seq;
  const Sequence* target = &copy;
  const int32_t zero = 0, length = copy.length;
  PagedView qv = view(absl::MakeConstSpan(&source, 1), absl::MakeConstSpan(&zero, 1));
  PagedView pv = view(absl::MakeConstSpan(&target, 1), absl::MakeConstSpan(&length, 1));
  for (size_t i = 0; i < seq.qblocks.size(); ++i) {
    kernels::KernelStatus ks = backend_.dequantize_block(pv.kv, qv.qkv, seq.qblocks[i], k.data(), v.data());
    if (ks.is_ok()) {
      ks = backend_.write_kv(pv.kv, 0, int(i) * seq.tokens_per_qblock, seq.tokens_per_qblock, 0, g.num_layers,
                             k.data(), v.data());
    }
    if (!ks.is_ok()) {
      for (int32_t blk : copy.blocks) pool_.release(blk);
      return to_status(ks);
    }
  }
  return copy;
}

void SequenceStore::adopt_copy(Sequence& seq, Sequence&& copy) {
  // The copy's table holds references of its own: the sequence's go.
  for (int32_t blk : seq.qblocks) pool_.release(blk);
  for (int32_t blk : seq.blocks) pool_.release(blk);
  seq = std::move(copy);
}

void SequenceStore::drop_copy(const Sequence& copy) {
  for (int32_t blk : copy.blocks) pool_.release(blk);
}

// ---- compaction ----

absl::Status SequenceStore::apply_plan(Sequence& seq, const CompactionPlan& plan, int merge_tokens,
                                       const std::string& by) {
  const Geometry& g = config_.geometry;
  const int32_t b = g.block_size;
  const Sequence* one = &seq;
  const int32_t length = seq.fp_length();
  PagedView pv = view(absl::MakeConstSpan(&one, 1), absl::MakeConstSpan(&length, 1));
  // Kernels address unquantized slots from 0; plans speak of all resident slots.
  const int32_t q0 = seq.quantized();
  // The tokens after the range stay in their blocks when the range ends on a block boundary and its
  // kept tokens fill whole blocks. Otherwise (a cut at token granularity, Kara's `grain`) some move
  // down behind the kept ones, so the slots stay consecutive: the gather covers them too, each row
  // keeping its own kept slots and then the slots from the range's end on. When the range removes
  // whole blocks' worth of tokens, the slots after it keep their offsets within a block, so only the
  // rest of the block the range ends in moves and the blocks after it stay; otherwise everything
  // after the range moves.
  const size_t rows = size_t(g.num_layers) * g.num_kv_heads;
  const int32_t removed = plan.end - plan.begin - plan.num_kept;
  int32_t moved_after = 0;
  if (plan.end < seq.length && ((plan.end - q0) % b != 0 || (plan.begin + plan.num_kept - q0) % b != 0)) {
    moved_after = removed % b == 0 ? std::min(seq.length, (plan.end - q0 + b - 1) / b * b + q0) - plan.end
                                   : seq.length - plan.end;
  }
  const int32_t num_gathered = plan.num_kept + moved_after;
  if (moved_after > 0 && merge_tokens > 0) {
    return absl::InvalidArgumentError(absl::StrCat("compaction of sequence ", seq.id, " by ", by, " keeps ",
                                                   plan.num_kept, " tokens of slots [", plan.begin, ", ", plan.end,
                                                   "), not whole blocks, which CaM merging does not support"));
  }
  std::vector<int32_t> local;
  local.reserve(rows * size_t(num_gathered));
  for (size_t r = 0; r < rows; ++r) {
    for (int32_t i = 0; i < plan.num_kept; ++i) local.push_back(plan.kept[r * plan.num_kept + i] - q0);
    for (int32_t s = plan.end; s < plan.end + moved_after; ++s) local.push_back(s - q0);
  }
  const int32_t fresh_count = (num_gathered + b - 1) / b;
  const int32_t first_old = (plan.begin - q0) / b;
  const int32_t end_old = (plan.end + moved_after - q0 + b - 1) / b;
  // The kept tokens move down inside the range's own blocks where nothing else can see them: every
  // block of the range is this sequence's alone (no fork, prefix-cache entry or tier pin holds a
  // reference; a dequantized copy holds one beside the sequence's), CaM does not need the evicted
  // values afterwards, and the backend can. Then no block is allocated (a full pool does not stop
  // the compaction), the range's trailing blocks go back, and a row whose kept prefix is already
  // in place copies only what follows it.
  // (plan.begin is block-aligned, and so is q0: a quantized block holds whole blocks of tokens.)
  bool in_place = merge_tokens == 0 && backend_.supports(kernels::Op::kGatherTokensInPlace, g.dtype);
  for (int32_t i = first_old; in_place && i < end_old; ++i) in_place = pool_.refcount(seq.blocks[i]) == 1;
  std::vector<int32_t> fresh;
  if (in_place) {
    if (auto s = backend_.gather_tokens_in_place(pv.kv, 0, plan.begin - q0, local.data(), num_gathered);
        !s.is_ok()) {
      if (s.code != kernels::KernelStatus::Code::kUnsupported) return to_status(s);
      in_place = false;  // nothing was written: gather into fresh blocks instead
    }
  }
  if (!in_place) {
    make_room(fresh_count);
    if (absl::Status s = pool_.allocate(fresh_count, &fresh); !s.ok()) {
      return absl::ResourceExhaustedError(absl::StrCat("compaction of sequence ", seq.id, " by ", by, " needs ",
                                                       fresh_count, " fresh blocks: ", s.message()));
    }
    if (auto s = backend_.gather_tokens(pv.kv, 0, local.data(), num_gathered, fresh.data()); !s.is_ok()) {
      for (int32_t blk : fresh) pool_.release(blk);
      return to_status(s);
    }
  }
  if (merge_tokens > 0 && !plan.scores.empty()) {
    // CaM reads the evicted values from the old blocks, which are still the sequence's here.
    if (auto s = backend_.cam_merge_values(pv.kv, 0, plan.begin - q0, plan.end - q0, local.data(), plan.num_kept,
                                           plan.scores.data(), merge_tokens, fresh.data());
        !s.is_ok()) {
      for (int32_t blk : fresh) pool_.release(blk);
      return to_status(s);
    }
  }
  // From here on nothing can fail: rewrite positions, table, caches.
  std::vector<std::vector<int32_t>> pos(rows);
  for (size_t r = 0; r < rows; ++r) {
    pos[r].reserve(plan.begin + plan.num_kept);
    for (int32_t s = 0; s < plan.begin; ++s) pos[r].push_back(seq.position(int(r), s));
    for (int32_t i = 0; i < plan.num_kept; ++i) pos[r].push_back(seq.position(int(r), plan.kept[r * plan.num_kept + i]));
    // A plan inside the explicit part (a second compression of compacted slots) moves the rest of it down.
    for (int32_t s = plan.end; s < seq.explicit_end; ++s) pos[r].push_back(seq.position(int(r), s));
  }
  // In place the range's first fresh_count blocks hold the kept tokens and stay; otherwise the
  // fresh blocks replace the whole range.
  const int32_t stay = in_place ? fresh_count : 0;
  for (int32_t i = first_old + stay; i < end_old; ++i) pool_.release(seq.blocks[i]);
  std::vector<int32_t> blocks(seq.blocks.begin(), seq.blocks.begin() + first_old + stay);
  blocks.insert(blocks.end(), fresh.begin(), fresh.end());
  blocks.insert(blocks.end(), seq.blocks.begin() + end_old, seq.blocks.end());
  seq.blocks = std::move(blocks);
  // Queries are per token (every layer). After the plan, new slot j is the token of old slot
  // src(j) when that is the same in every row (always outside the range; inside it only when all
  // rows kept the same slot, as the baselines' observation window); the cache keeps the longest run
  // of such slots with cached queries that ends at the newest one (a window's queries, which
  // SnapKV needs again at the next c_max, survive the compaction that kept them).
  if (seq.q_count > 0) {
    const int32_t new_length = seq.length - removed;
    auto source = [&](int32_t j) -> int32_t {
      if (j < plan.begin) return j;
      if (j >= plan.begin + plan.num_kept) return j + removed;
      const int32_t i = j - plan.begin, s0 = plan.kept[i];
      for (size_t r = 1; r < rows; ++r) {
        if (plan.kept[r * plan.num_kept + i] != s0) return -1;
      }
      return s0;
    };
    auto cached = [&](int32_t s) { return s >= seq.q_first && s < seq.q_first + seq.q_count; };
    int32_t last = new_length - 1;
    while (last >= 0 && !(source(last) >= 0 && cached(source(last)))) --last;
    int32_t first = last;
    while (first > 0 && source(first - 1) >= 0 && cached(source(first - 1))) --first;
    const size_t entry = size_t(g.num_layers) * g.q_token_elems();
    std::vector<float> kept_queries;
    if (last >= 0) {
      kept_queries.reserve(size_t(last - first + 1) * entry);
      for (int32_t j = first; j <= last; ++j) {
        const auto from = seq.queries.begin() + size_t(source(j) - seq.q_first) * entry;
        kept_queries.insert(kept_queries.end(), from, from + entry);
      }
    }
    seq.queries = std::move(kept_queries);
    seq.q_first = last >= 0 ? first : new_length;
    seq.q_count = last >= 0 ? last - first + 1 : 0;
  } else {
    seq.q_first = seq.length - removed;
  }
  seq.length -= removed;
  seq.explicit_end = std::max(plan.begin + plan.num_kept, seq.explicit_end - removed);
  seq.explicit_pos = std::move(pos);
  ++seq.compactions;
  seq.publish = false;  // compacted blocks are never content-addressed
  return absl::OkStatus();
}

// ---- introspection ----

std::vector<std::vector<int32_t>> SequenceStore::positions_of(const Sequence& seq) const {
  const size_t rows = size_t(config_.geometry.num_layers) * config_.geometry.num_kv_heads;
  std::vector<std::vector<int32_t>> out(rows);
  for (size_t r = 0; r < rows; ++r) {
    out[r].reserve(seq.length);
    for (int32_t s = 0; s < seq.length; ++s) out[r].push_back(seq.position(int(r), s));
  }
  return out;
}

SequenceInfo SequenceStore::info_of(const Sequence& seq) const {
  SequenceInfo info;
  info.id = seq.id;
  info.session_id = seq.session_id;
  info.tenant = seq.tenant;
  info.policy = seq.label;
  info.length = seq.length;
  info.logical_length = seq.logical;
  info.prompt_length = seq.prompt;
  info.compactions = seq.compactions;
  info.storage = seq.storage;
  info.quantized = seq.quantized();
  info.quantized_blocks = static_cast<int32_t>(seq.qblocks.size());
  info.blocks = static_cast<int32_t>(seq.blocks.size() + seq.qblocks.size());
  for (int32_t b : seq.blocks) info.shared_blocks += pool_.refcount(b) > 1 ? 1 : 0;
  for (int32_t b : seq.qblocks) info.shared_blocks += pool_.refcount(b) > 1 ? 1 : 0;
  const Geometry& g = config_.geometry;
  info.kv_bytes = uint64_t(info.blocks) * g.block_bytes();
  info.fp16_bytes = uint64_t(seq.logical) * g.num_layers * g.kv_token_elems() * 2 * 2;
  const int bits = !seq.quantize ? 8 * int(kernels::dtype_size(g.dtype))
                   : seq.format == kernels::QuantFormat::kKivi2 || seq.format == kernels::QuantFormat::kTq2 ? 2
                   : seq.format == kernels::QuantFormat::kTq3                                               ? 3
                                                                                                             : 4;
  info.nominal_ratio = 16.0 / bits;
  info.priority = seq.priority;
  info.pending_layer = seq.pending_layer;
  return info;
}

void SequenceStore::fill_stats(CoreStats& s) const {
  s.blocks_total = pool_.total();
  s.blocks_used = pool_.used_count();
  s.blocks_free = pool_.free_count();
  s.sequences = static_cast<int32_t>(sequences_.size());
  s.tokens_appended = tokens_appended_;
  s.prefix_lookups = prefix_lookups_;
  s.prefix_lookup_tokens = prefix_lookup_tokens_;
  s.prefix_hit_tokens = prefix_hit_tokens_;
  s.prefix_cached_blocks = static_cast<int32_t>(prefix_cache_.size());
  s.prefix_unused_blocks = unused_cached_blocks();
  s.tier_pinned_blocks = tier_pinned_blocks();
  s.prefix_evictions = prefix_evictions_;
  s.prefix_published_blocks = prefix_published_;
  for (const auto& [id, seq] : sequences_) {
    s.resident_tokens += seq.length;
    s.logical_tokens += seq.logical;
    s.query_cache_bytes += seq.queries.size() * sizeof(float);
    const SequenceInfo info = info_of(seq);
    PolicyStats& ps = s.policies[info.policy];
    ++ps.sequences;
    ps.resident_tokens += seq.length;
    ps.logical_tokens += seq.logical;
    ps.kv_bytes += info.kv_bytes;
    ps.fp16_bytes += info.fp16_bytes;
    ps.nominal_ratio = info.nominal_ratio;
  }
}

absl::Status SequenceStore::check_invariants() const {
  std::vector<int32_t> references(pool_.total(), 0);
  const int32_t b = config_.geometry.block_size;
  for (const auto& [id, seq] : sequences_) {
    const int32_t covered = seq.fp_length() + (seq.pending_layer >= 0 ? 1 : 0);
    if (static_cast<int32_t>(seq.blocks.size()) != (covered + b - 1) / b) {
      return absl::InternalError(absl::StrCat("sequence ", id, " holds ", seq.blocks.size(),
                                              " blocks for ", covered, " unquantized tokens"));
    }
    for (int32_t block : seq.qblocks) {
      if (block < 0 || block >= pool_.total()) {
        return absl::InternalError(absl::StrCat("sequence ", id, " holds bad quantized block id ", block));
      }
      ++references[block];
    }
    for (int32_t block : seq.blocks) {
      if (block < 0 || block >= pool_.total()) {
        return absl::InternalError(absl::StrCat("sequence ", id, " holds bad block id ", block));
      }
      ++references[block];
    }
  }
  // The prefix cache holds one reference on each block it indexes.
  if (std::string e = prefix_cache_.check(); !e.empty()) return absl::InternalError(e);
  for (const auto& [key, e] : prefix_cache_.entries()) {
    if (e.block < 0 || e.block >= pool_.total()) {
      return absl::InternalError(absl::StrCat("prefix cache holds bad block id ", e.block));
    }
    ++references[e.block];
  }
  // The prefix tier's writer holds a pin on each block it has yet to write.
  for (const auto& [block, pins] : tier_pins_) {
    if (block < 0 || block >= pool_.total()) {
      return absl::InternalError(absl::StrCat("prefix tier pins bad block id ", block));
    }
    references[block] += pins;
  }
  return pool_.check(references);
}

}  // namespace karakv::server
