// Kara: periodic compression of a sequence's cache (docs/COMPRESSION.md section 1). Each sequence
// counts its own decode steps and is looked at on every P-th of them, phase-shifted by its creation
// index. Version 2 (budget 0): once the tail holds W + R tokens, its oldest W tail tokens are scored
// (by the window's own queries, by every decode query that saw them, or both) and replaced by
// B = rho * W of them chosen by Token2Chunk; the newest R stay; compressed windows and (with
// prompt = keep, or the blocks prompt = auto finds shared) the prompt are never touched again.
// Version 3 adds a memory budget (768 tokens by default where it applies): turns act only above it;
// with `fit` (the default with a budget) a turn above the budget re-ranks everything older than the
// recent region, the tail's blocks too, down to the budget (fit 2: by at least W - B); with fit 0 it
// compresses a window, or re-ranks the compressed region when that is what keeps the sequence above
// the budget. `share` sets the budget as a share of the sequence's length. Version 2's alternatives
// to a budget: two levels (`rho2`: the oldest W compressed tokens compressed again) and a recent
// region that grows with the tail (`grow`).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "absl/strings/str_cat.h"
#include "server/policy.h"

namespace karakv::server {
namespace {

enum class Observers { kWindow = 0, kDecode = 1, kBoth = 2 };
enum class Norm { kWindow = 0, kFull = 1 };
enum class Agg { kMean = 0, kSum = 1 };
// What Kara's windows cover of the prompt: none of it, all of it after the sinks, or all but the
// leading blocks the sequence shares (from the prefix cache or a fork).
enum class Prompt { kKeep = 0, kWindow = 1, kAuto = 2 };

// What Kara keeps per sequence. Per-slot arrays cover every resident slot; the per-token ones
// (`seen`, `lse`) are exact for the tail, where a slot is the same token in every (layer, head).
struct KaraState final : PolicyState {
  int32_t tail_start = 0;  // first slot of the uncompressed tail, block-aligned (but after fit's cuts in a grain of part blocks)
  // The compressed region is [compressed_start, tail_start): the tail's start when decoding began.
  int32_t compressed_start = 0;
  // rho2 > 0: the compressed region's level 1 is [level1_start, tail_start); before it, level 2.
  int32_t level1_start = 0;
  // The position of the tail's first slot when decoding began: `logical` minus it is how many tokens
  // have entered the tail (grow > 0).
  int32_t origin = 0;
  // prompt = auto: the leading slots kept because the sequence shares them; they do not count
  // against the budget (they are the prefix cache's and every sharer's, not this sequence's own).
  int32_t shared_kept = 0;
  uint64_t steps = 0;      // decode steps this sequence has taken
  // observers = decode | both: decode attention probabilities each slot received, summed over the
  // group's query heads, per (layer, KV head) [L * Hk][slots]; and for each slot the value of
  // `steps` before its token's first decode step [slots], so that steps - seen[slot] decode steps'
  // queries have seen it (every step sees every slot from its token's arrival on; a slot only
  // leaves the scored range, never comes back to it). Kept so, a step costs nothing per slot. The
  // marks are steps modulo 2^32 and counts their difference in the same arithmetic: exact however
  // long the sequence decodes (as floats they would drift after 2^24 steps).
  std::vector<std::vector<float>> received;
  std::vector<uint32_t> seen;
  // budget > 0 or rho2 > 0, instead of `seen`: the same per (layer, KV head) [L * Hk][slots] (in
  // the compressed region a slot holds a different token in each row).
  std::vector<std::vector<uint32_t>> seen_rows;
  // norm = full: each slot's own decode step's log-sum-exp per (layer, query head),
  // [slots][L][Hq]; NaN where the token came without a decode step (Append). And the softmax scale
  // that step used, per layer [slots][L] (the window's logits must be taken at the same scale).
  std::vector<float> lse;
  std::vector<float> lse_scale;
  absl::StatusOr<std::unique_ptr<PolicyState>> clone() const override { return std::make_unique<KaraState>(*this); }
  size_t bytes() const override {
    size_t n = seen.size() + lse.size() + lse_scale.size();
    for (const auto& row : received) n += row.size();
    for (const auto& row : seen_rows) n += row.size();
    static_assert(sizeof(uint32_t) == sizeof(float));
    return n * sizeof(float);
  }
};

const KaraState& state_of(const SequenceView& seq) { return *static_cast<const KaraState*>(seq.state); }

// Keeps slots [0, begin), then per row the kept ones, then [end, old size) of a per-slot array of
// `width` values a slot. Per-token arrays take row 0's kept slots: only the tail after `end` is
// ever read again, and there a slot is the same token in every row.
template <typename T>
void remap(std::vector<T>& a, size_t width, const CompactionPlan& plan, int32_t resident_before) {
  if (a.empty()) return;
  std::vector<T> next(a.begin(), a.begin() + size_t(plan.begin) * width);
  for (int32_t i = 0; i < plan.num_kept; ++i) {
    const auto from = a.begin() + size_t(plan.kept[i]) * width;
    next.insert(next.end(), from, from + width);
  }
  next.insert(next.end(), a.begin() + size_t(plan.end) * width, a.begin() + size_t(resident_before) * width);
  a = std::move(next);
}

// As remap, for per-(layer, KV head) arrays of one value a slot: row r keeps its own kept slots.
template <typename T>
void remap_rows(std::vector<std::vector<T>>& rows, const CompactionPlan& plan, int32_t resident_before) {
  for (size_t r = 0; r < rows.size(); ++r) {
    std::vector<T>& a = rows[r];
    std::vector<T> next(a.begin(), a.begin() + plan.begin);
    for (int32_t i = 0; i < plan.num_kept; ++i) next.push_back(a[plan.kept[r * plan.num_kept + i]]);
    next.insert(next.end(), a.begin() + plan.end, a.begin() + resident_before);
    a = std::move(next);
  }
}

class KaraPolicy final : public Policy {
 public:
  KaraPolicy(const PolicyParams& p, const kernels::Geometry& g)
      : window_(p.geti("window")),
        budget_(budget_for(p.get("rho"), window_, g.block_size)),
        candidates_(static_cast<int>(std::ceil(p.get("alpha") * budget_))),
        alpha_(p.get("alpha")),
        max_gap_(p.geti("max_gap")),
        period_(p.geti("period")),
        recent_(p.geti("recent")),
        sinks_(p.geti("sinks")),
        observers_(static_cast<Observers>(p.geti("observers"))),
        norm_(static_cast<Norm>(p.geti("norm"))),
        agg_(static_cast<Agg>(p.geti("agg"))),
        prompt_(static_cast<Prompt>(p.geti("prompt"))),
        memory_budget_(memory_budget(p)),
        share_(p.get("share")),
        level2_budget_(p.get("rho2") > 0 ? budget_for(p.get("rho2"), window_, g.block_size) : 0),
        grow_(p.get("grow")),
        fit_(fits(p)),
        grain_(p.geti("grain") > 0 ? p.geti("grain") : g.block_size),
        merge_(policy_util::cam_merge_tokens(p)),
        layers_(g.num_layers),
        kv_heads_(g.num_kv_heads),
        q_heads_(g.num_q_heads),
        block_(g.block_size) {}

  // The budget's default: a fixed size wherever it applies (decode observers, and none of `share`,
  // `rho2` or `grow`, the alternatives to a fixed size), else 0 (unbounded, version 2). Not with
  // quantized storage either: a budget keeps the whole region open for its re-ranks, so nothing
  // would ever be quantized; version 2's windows are final, and quantized as they age.
  static constexpr int kDefaultBudget = 768;
  static int memory_budget(const PolicyParams& p) {
    if (p.given("budget")) return p.geti("budget");
    const bool applies = p.geti("observers") == 1 && p.get("share") == 0 && p.get("rho2") == 0 &&
                         p.get("grow") == 0 && !p.quantized_storage();
    return applies ? kDefaultBudget : 0;
  }
  // fit: as given, or by default 1 wherever it applies (a budget or a share, decode observers).
  static int fits(const PolicyParams& p) {
    if (p.given("fit")) return p.geti("fit");
    return (memory_budget(p) > 0 || p.get("share") > 0) && p.geti("observers") == 1 ? 1 : 0;
  }

  // B = round(rho * W) (halves away from zero), then to the nearest multiple of the block size
  // (halves away from zero), at least one block.
  static int budget_for(double rho, int window, int block) {
    const int b = static_cast<int>(std::lround(rho * window));
    return std::max(block, static_cast<int>(std::lround(double(b) / block)) * block);
  }

  const std::string& name() const override { return name_; }
  Trigger trigger() const override { return Trigger::kPeriodic; }
  // The window's own queries are read when they observe; decode observers need none.
  int query_window() const override { return uses_window_queries() ? -1 : 0; }
  // A window, the recent region, the steps until the next turn, and the prompt's last block.
  int query_capacity_hint() const override { return uses_window_queries() ? window_ + recent_ + 2 * period_ + 16 : 0; }
  int merge_tokens() const override { return merge_; }
  void effective_params(std::map<std::string, double>* params) const override {
    (*params)["fit"] = fit_;
    if (fit_ > 0) (*params)["grain"] = grain_;
    (*params)["budget"] = memory_budget_;
    // auto with window or both observers keeps the prompt (they would need its queries): say so.
    (*params)["prompt"] = prompt_ == Prompt::kAuto && !windows_prompt() ? double(Prompt::kKeep) : double(prompt_);
  }
  // Measured, CaM has not helped Kara (docs/QUALITY.md).
  std::string advice() const override {
    if (merge_ == 0) return "";
    return "cam=1 with kara is not recommended: on the development set (Shakespeare, version 2: W 128, rho 0.25) "
           "kara+cam has perplexity 38.19 against kara's 38.14 (+1.21% vs +1.07% over none), and merging "
           "keys as well was worse still (38.34); see docs/QUALITY.md";
  }
  std::vector<kernels::Op> required_ops() const override {
    std::vector<kernels::Op> ops = {kernels::Op::kToken2Chunk, kernels::Op::kGatherTokens};
    if (uses_window_queries()) {
      ops.push_back(observers_ == Observers::kWindow && norm_ == Norm::kWindow ? kernels::Op::kWindowScores
                                                                               : kernels::Op::kWindowScoresObserved);
    }
    if (records_lse()) {
      ops.push_back(kernels::Op::kDecodeAttentionObserve);
    } else if (observers_ != Observers::kWindow) {
      ops.push_back(kernels::Op::kDecodeAttentionAccumulate);
    }
    return ops;
  }

  // Host memory: the decode step adds only the tail's slots, whose copy back is small, and every
  // tick reads them.
  std::unique_ptr<State> make_state(const kernels::Geometry&, kernels::Backend&) const override {
    auto state = std::make_unique<KaraState>();
    if (observers_ != Observers::kWindow) state->received.resize(size_t(layers_) * kv_heads_);
    if (reopens()) state->seen_rows.resize(size_t(layers_) * kv_heads_);
    return state;
  }
  absl::Status on_grow(State* state, int32_t slots) const override {
    auto& s = *static_cast<KaraState*>(state);
    for (auto& row : s.received) row.resize(slots, 0.0f);
    // A new slot's token is first seen by the next decode step (the one it is appended for, or the
    // next after an Append).
    for (auto& row : s.seen_rows) row.resize(slots, uint32_t(s.steps));
    if (observers_ != Observers::kWindow && !reopens()) s.seen.resize(slots, uint32_t(s.steps));
    if (records_lse()) {
      s.lse.resize(size_t(slots) * lse_width(), std::numeric_limits<float>::quiet_NaN());
      s.lse_scale.resize(size_t(slots) * layers_, std::numeric_limits<float>::quiet_NaN());
    }
    return absl::OkStatus();
  }
  void on_decode_start(State* state, const SequenceView& seq) const override {
    auto& s = *static_cast<KaraState*>(state);
    s.tail_start = first_prompt_slot(seq);
    s.shared_kept = prompt_ == Prompt::kAuto && windows_prompt() && seq.shared_prefix > 0 ? s.tail_start : 0;
    s.compressed_start = s.tail_start;
    s.level1_start = s.tail_start;
    s.origin = s.tail_start + (seq.logical - seq.resident);  // slots after the explicit ones are contiguous
  }
  absl::Status on_compacted(State* state, const CompactionPlan& plan, int32_t resident_before,
                            bool own) const override {
    auto& s = *static_cast<KaraState*>(state);
    remap_rows(s.received, plan, resident_before);
    remap_rows(s.seen_rows, plan, resident_before);
    remap(s.seen, 1, plan, resident_before);
    remap(s.lse, lse_width(), plan, resident_before);
    remap(s.lse_scale, size_t(layers_), plan, resident_before);
    if (!own) return absl::OkStatus();
    if (plan.begin == s.tail_start) {
      // A window: the tail now starts right after what was kept.
      s.tail_start = plan.begin + plan.num_kept;
    } else if (bounded()) {
      // A re-rank of the whole compressed region, which ends at the tail's start (no level 1 then).
      s.tail_start = plan.begin + plan.num_kept;
      s.level1_start = s.tail_start;
    } else {
      // A second-level window, the oldest W tokens of level 1 (which may end at the tail's start).
      s.level1_start = plan.begin + plan.num_kept;
      s.tail_start -= plan.end - plan.begin - plan.num_kept;
    }
    return absl::OkStatus();
  }
  float* accumulator(State* state, int layer, int kv_head) const override {
    auto& s = *static_cast<KaraState*>(state);
    return s.received.empty() ? nullptr : s.received[size_t(layer) * kv_heads_ + kv_head].data();
  }
  // Only the tail is ever scored again: the prompt (unless windowed, and then the tail starts at
  // its first window) and the compressed windows keep what they have. With a budget the compressed
  // region may be re-ranked, and with two levels level 1 compressed again, so those slots keep
  // accumulating too.
  int32_t first_accumulated_slot(const State* state) const override {
    return first_scored(*static_cast<const KaraState*>(state));
  }
  float* lse_output(State* state, int layer, float scale) const override {
    auto& s = *static_cast<KaraState*>(state);
    if (!records_lse() || s.lse.empty()) return nullptr;
    const size_t newest = s.lse.size() / lse_width() - 1;  // the step's token (on_grow ran first)
    s.lse_scale[newest * size_t(layers_) + size_t(layer)] = scale;
    return s.lse.data() + newest * lse_width() + size_t(layer) * q_heads_;
  }
  void on_step(State* state, const SequenceView& seq) const override {
    auto& s = *static_cast<KaraState*>(state);
    ++s.steps;  // every slot's count of steps that saw it grows with it (KaraState::seen)
  }
  // The sequence's own steps n with n mod P == its creation index mod P.
  bool turn(const SequenceView& seq) const override {
    return seq.state != nullptr && state_of(seq).steps % uint64_t(period_) == seq.id % uint64_t(period_);
  }
  // The tail may still be compressed (and the compressed region with a budget, level 1 with two
  // levels). Before decoding nothing is fixed yet, except that where windows may cover the prompt
  // (prompt = window, or auto with decode observers) the prompt after the sinks may be windowed.
  // The shared part auto keeps is settled only when decoding starts.
  int32_t first_open_slot(const SequenceView& seq) const override {
    if (!seq.decoding) return windows_prompt() ? std::min(seq.resident, first_window_start()) : seq.resident;
    if (seq.state == nullptr) return seq.resident;
    return first_scored(state_of(seq));
  }
  // Longest tail first.
  int64_t urgency(const SequenceView& seq) const override {
    return seq.state != nullptr ? seq.resident - state_of(seq).tail_start : 0;
  }

  bool due(const SequenceView& seq, bool) const override {
    if (seq.state == nullptr || !seq.decoding) return false;
    if (!bounded()) return window_due(seq) || level2_due(seq);
    if (seq.resident <= budget_of(seq)) return false;
    if (fit_ > 0) return fit_end(seq) - state_of(seq).compressed_start > fit_floor(state_of(seq));
    return window_due(seq) || rerank_keeps(seq) < state_of(seq).tail_start - state_of(seq).compressed_start;
  }
  absl::Status ready(const SequenceView& seq) const override {
    if (seq.state == nullptr || !seq.decoding) return absl::OkStatus();
    const int32_t tail = state_of(seq).tail_start;
    if (seq.resident - tail < window_ + recent_of(seq) || due(seq, true)) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat("kara: the window's queries (slots ", tail, "..",
                                                      tail + window_ - 1, ") are not all cached"));
  }

  absl::StatusOr<CompactionPlan> plan(const SequenceView& seq, const kernels::PagedKV& kv,
                                      kernels::Backend& backend) const override {
    const kernels::Geometry& g = *seq.geometry;
    if (!due(seq, true)) {
      if (bounded() && seq.state != nullptr && seq.resident <= budget_of(seq)) {
        return absl::FailedPreconditionError(absl::StrCat("kara: ", seq.resident, " resident tokens are within the budget ",
                                                          budget_of(seq)));
      }
      const int32_t level1 = seq.state != nullptr ? state_of(seq).tail_start - state_of(seq).level1_start : 0;
      return absl::FailedPreconditionError(absl::StrCat(
          "kara: tail holds ", seq.state != nullptr ? seq.resident - state_of(seq).tail_start : 0,
          " tokens, a window needs ", window_, " plus the recent ", seq.state != nullptr ? recent_of(seq) : recent_,
          ", with their queries", bounded() ? ", and the compressed region is already within the budget" : "",
          level2_budget_ > 0 ? absl::StrCat("; level 1 holds ", level1, " tokens, a second-level window needs ", window_,
                                            " plus the recent ", recent_)
                             : ""));
    }
    if (fit_ > 0) {
      // Everything older than the recent region, down to what the budget allows (in grains: whole
      // blocks by default).
      const KaraState& s = state_of(seq);
      const int32_t end = fit_end(seq);
      const int32_t len = end - s.compressed_start;
      // The excess in whole grains; with fit = 2 at least what a window compaction removes (W - B),
      // so re-ranks come no more often than windows would and each costs as much per token removed.
      const int32_t excess = round_up(seq.resident - budget_of(seq), grain_);
      const int32_t remove = fit_ == 2 ? std::max<int32_t>(excess, window_ - budget_) : excess;
      return rescore_plan(seq, backend, s.compressed_start, end, std::max<int32_t>(fit_floor(s), len - remove));
    }
    if (!window_due(seq)) {
      const KaraState& s = state_of(seq);
      if (bounded()) return rescore_plan(seq, backend, s.compressed_start, s.tail_start, rerank_keeps(seq));
      return rescore_plan(seq, backend, s.level1_start, s.level1_start + window_, level2_budget_);
    }
    const KaraState& s = state_of(seq);
    CompactionPlan plan;
    plan.begin = s.tail_start;
    plan.end = plan.begin + window_;
    plan.num_kept = budget_;
    plan.kept.resize(size_t(g.num_layers) * g.num_kv_heads * budget_);
    std::vector<float> q, lse;
    if (uses_window_queries()) q.resize(size_t(window_) * g.q_token_elems());
    if (uses_window_queries() && norm_ == Norm::kFull) lse.resize(size_t(window_) * g.num_q_heads);
    std::vector<float> window_part(size_t(g.num_kv_heads) * window_, 0.0f);
    // Every (layer, KV head) row's scores, selected in one backend call at the end.
    std::vector<float> all_scores(size_t(g.num_layers) * g.num_kv_heads * window_);
    for (int l = 0; l < g.num_layers; ++l) {
      float scale = 1.0f / std::sqrt(float(g.head_dim));
      if (uses_window_queries()) {
        policy_util::gather_queries(seq, plan.begin, window_, l, q.data());
        const int slot = plan.begin - seq.fp_offset;
        absl::Status st;
        if (observers_ == Observers::kWindow && norm_ == Norm::kWindow) {  // version 1
          st = to_status(backend.window_scores(kv, 0, l, slot, window_, q.data(), scale, window_part.data()));
        } else {
          // norm = full: p = exp(logit - lse) is a probability only with the logit at the scale the
          // lse was taken at, the query's own Step's. The window takes its first recorded scale; a
          // query whose Step used another (a worker that changed it) gets the window softmax, as a
          // query without a recorded lse does.
          auto scale_of = [&](int t) {
            return s.lse_scale.empty() ? std::numeric_limits<float>::quiet_NaN()
                                       : s.lse_scale[size_t(plan.begin + t) * layers_ + size_t(l)];
          };
          for (int t = 0; t < window_ && !lse.empty(); ++t) {
            if (!std::isnan(scale_of(t))) {
              scale = scale_of(t);
              break;
            }
          }
          for (int t = 0; t < window_ && !lse.empty(); ++t) {
            const float* from = s.lse.empty() || scale_of(t) != scale
                                    ? nullptr
                                    : s.lse.data() + size_t(plan.begin + t) * lse_width() + size_t(l) * g.num_q_heads;
            for (int j = 0; j < g.num_q_heads; ++j) {
              lse[size_t(t) * g.num_q_heads + j] = from != nullptr ? from[j] : std::numeric_limits<float>::quiet_NaN();
            }
          }
          st = to_status(backend.window_scores_observed(kv, 0, l, slot, window_, q.data(), scale,
                                                        lse.empty() ? nullptr : lse.data(),
                                                        observers_ == Observers::kBoth, window_part.data()));
        }
        if (!st.ok()) return st;
      }
      for (int h = 0; h < g.num_kv_heads; ++h) {
        const float* own = window_part.data() + size_t(h) * window_;
        float* scores = all_scores.data() + (size_t(l) * g.num_kv_heads + h) * window_;
        const float* received = s.received.empty() ? nullptr : s.received[size_t(l) * g.num_kv_heads + h].data();
        for (int i = 0; i < window_; ++i) {
          const int32_t slot = plan.begin + i;
          if (observers_ == Observers::kWindow) {
            scores[i] = own[i];
          } else if (agg_ == Agg::kSum) {
            scores[i] = received[slot] + (observers_ == Observers::kBoth ? own[i] : 0.0f);
          } else {
            // The mean of each part over the queries that made it: the decode steps that saw the key,
            // and (both) the window queries before it. One mean over both parts would divide every
            // key of a window built by Step by the same count (i window queries before key i, and
            // the decode steps from i on), which would make agg = mean rank as agg = sum does.
            scores[i] = received[slot] / std::max(1.0f, seen_count(s, size_t(l) * g.num_kv_heads + h, slot));
            if (observers_ == Observers::kBoth) scores[i] += own[i] / std::max(1.0f, float(i));
          }
        }
      }
    }
    if (merge_ > 0) plan.scores = all_scores;  // CaM weighs by the scores before the sinks are forced
    // Attention sinks that fall inside a window (a short prompt, or prompt = window) are kept.
    policy_util::force_sinks(seq, plan.begin, window_, sinks_, all_scores.data());
    if (auto st = to_status(backend.token2chunk(all_scores.data(), g.num_layers * g.num_kv_heads, window_, budget_,
                                                candidates_, max_gap_, plan.kept.data()));
        !st.ok()) {
      return st;
    }
    for (int32_t& slot : plan.kept) slot += plan.begin;
    return plan;
  }

 private:
  // Decode steps whose queries saw `slot` of row (layer * Hk + KV head) `row`: per token in the tail
  // (`seen`), or per row where a budget or two levels keep the compressed region scored (`seen_rows`).
  static float seen_count(const KaraState& s, size_t row, int32_t slot) {
    return float(uint32_t(s.steps) - (s.seen_rows.empty() ? s.seen[slot] : s.seen_rows[row][slot]));
  }

  // Version 2's condition: W + R tail tokens (and, for window observers, the window's queries); R
  // grown to R' with `grow`.
  bool window_due(const SequenceView& seq) const {
    const int32_t tail = state_of(seq).tail_start;
    if (seq.resident - tail < window_ + recent_of(seq)) return false;
    if (!uses_window_queries()) return true;
    return seq.queries_first <= tail && seq.queries_first + seq.num_queries >= tail + window_;
  }

  // R' = max(R, floor_b(grow * t)), t the tokens that entered the tail since decoding began.
  int32_t recent_of(const SequenceView& seq) const {
    if (grow_ <= 0) return recent_;
    const int64_t entered = int64_t(seq.logical) - state_of(seq).origin;
    const int64_t grown = int64_t(std::floor(grow_ * double(std::max<int64_t>(0, entered)))) / block_ * block_;
    return int32_t(std::max<int64_t>(recent_, grown));
  }

  // fit: the fewest tokens the region keeps, a block, or the sinks inside it rounded up to blocks.
  int32_t fit_floor(const KaraState& s) const {
    return std::max<int32_t>(block_, align_up(std::max<int32_t>(0, sinks_ - s.compressed_start)));
  }
  // fit: the end of the region a turn re-ranks, the tail's whole grains (blocks by default) before
  // its newest R tokens.
  int32_t fit_end(const SequenceView& seq) const {
    const int32_t tail = state_of(seq).tail_start;
    return tail + std::max<int32_t>(0, seq.resident - recent_ - tail) / grain_ * grain_;
  }

  // Two levels: level 1 holds W + R tokens.
  bool level2_due(const SequenceView& seq) const {
    const KaraState& s = state_of(seq);
    return level2_budget_ > 0 && s.tail_start - s.level1_start >= window_ + recent_;
  }

  // The first slot whose decode-time scores are still needed.
  int32_t first_scored(const KaraState& s) const {
    if (bounded()) return s.compressed_start;
    return level2_budget_ > 0 ? s.level1_start : s.tail_start;
  }
  // The compressed region may be compressed again (a budget's re-rank, or two levels).
  bool reopens() const { return bounded() || level2_budget_ > 0; }
  // Version 3's budget is set: a fixed size, or a share of the sequence's logical length.
  bool bounded() const { return memory_budget_ > 0 || share_ > 0; }
  // The budget at this turn: `budget`, or floor(share * L) with L the tokens ever appended (at least
  // 1). The product is nudged up by far less than one token so that a share given in decimals
  // floors as in decimals (0.35 * 180 is 63, not the 62.99... of binary floating point).
  int32_t budget_of(const SequenceView& seq) const {
    if (memory_budget_ > 0) return memory_budget_ + (seq.state != nullptr ? state_of(seq).shared_kept : 0);
    return std::max<int32_t>(1, int32_t(std::floor(share_ * double(seq.logical) + 1e-6)));
  }

  // C' = max(b, floor_b(budget - (n - C))): what the compressed region may keep for the sequence to
  // fit its budget.
  int32_t rerank_keeps(const SequenceView& seq) const {
    const KaraState& s = state_of(seq);
    const int64_t outside = int64_t(seq.resident) - (s.tail_start - s.compressed_start);
    const int64_t room = int64_t(budget_of(seq)) - outside;
    return std::max<int32_t>(block_, room > 0 ? int32_t(room / block_ * block_) : 0);
  }

  // Compresses slots [begin, end) of the compressed region to `keep`: the budget's re-rank of the
  // whole region, or a second-level window. Each slot's decode-time score (as the window's with
  // observers = decode), sinks kept, the same Token2Chunk selection.
  absl::StatusOr<CompactionPlan> rescore_plan(const SequenceView& seq, kernels::Backend& backend, int32_t begin,
                                              int32_t end, int32_t keep) const {
    const kernels::Geometry& g = *seq.geometry;
    const KaraState& s = state_of(seq);
    const int32_t len = end - begin;
    CompactionPlan plan;
    plan.begin = begin;
    plan.end = end;
    plan.num_kept = keep;
    const int rows = g.num_layers * g.num_kv_heads;
    plan.kept.resize(size_t(rows) * keep);
    std::vector<float> all_scores(size_t(rows) * len);
    for (int r = 0; r < rows; ++r) {
      for (int32_t i = 0; i < len; ++i) {
        const int32_t slot = plan.begin + i;
        const float received = s.received[r][slot];
        all_scores[size_t(r) * len + i] =
            agg_ == Agg::kSum ? received : received / std::max(1.0f, seen_count(s, r, slot));
      }
    }
    if (merge_ > 0) plan.scores = all_scores;  // CaM weighs by the scores before the sinks are forced
    policy_util::force_sinks(seq, plan.begin, len, sinks_, all_scores.data());
    const int candidates = static_cast<int>(std::ceil(alpha_ * keep));
    if (auto st = to_status(backend.token2chunk(all_scores.data(), rows, len, keep, candidates, max_gap_,
                                                plan.kept.data()));
        !st.ok()) {
      return st;
    }
    for (int32_t& slot : plan.kept) slot += plan.begin;
    return plan;
  }

  bool uses_window_queries() const { return observers_ != Observers::kDecode; }
  bool records_lse() const { return uses_window_queries() && norm_ == Norm::kFull; }
  size_t lse_width() const { return size_t(layers_) * q_heads_; }
  static int32_t round_up(int32_t n, int32_t to) { return (n + to - 1) / to * to; }
  int32_t align_up(int32_t n) const { return round_up(n, block_); }
  // With fit the sinks are kept inside the re-ranked region, so it may start at slot 0.
  int32_t first_window_start() const { return fit_ > 0 ? 0 : align_up(sinks_); }
  // Whether windows may cover the prompt (before decoding: whether its tokens may still be rewritten).
  bool windows_prompt() const {
    return prompt_ == Prompt::kWindow || (prompt_ == Prompt::kAuto && observers_ == Observers::kDecode);
  }
  // Where the tail starts when decoding begins: after the prompt (keep), at the first window
  // (window), or after the prompt's shared blocks where it has any (auto: a shared block windowed
  // would be copied into a compacted one of the sequence's own while the shared one stays).
  int32_t first_prompt_slot(const SequenceView& seq) const {
    if (!windows_prompt()) return align_up(seq.resident);
    if (prompt_ == Prompt::kWindow) return first_window_start();
    return std::max(first_window_start(), std::min(seq.shared_prefix, align_up(seq.resident)));
  }

  const std::string name_ = "kara";
  const int window_, budget_, candidates_;
  const double alpha_;
  const int max_gap_, period_, recent_, sinks_;
  const Observers observers_;
  const Norm norm_;
  const Agg agg_;
  const Prompt prompt_;
  const int memory_budget_;  // version 3's `budget` (tokens; 0: unbounded). budget_ is B, a window's.
  const double share_;       // version 3's `share`: the budget as a share of the logical length (0: none)
  const int level2_budget_;  // B2, a second-level window's (0: one level)
  const double grow_;
  const int fit_;  // with a budget: everything older than the recent region re-ranked to fit it (2: cut >= W - B)
  // fit: the granularity of its cut and of the region's end, in tokens (the block size unless set).
  // One that is not a multiple of the block size leaves the region's last block partly filled, and
  // the compaction moves the newer tokens down behind it.
  const int grain_;
  const int merge_, layers_, kv_heads_, q_heads_, block_;
};

}  // namespace

std::vector<ParamSpec> kara_params(const kernels::Geometry& g) {
  std::vector<ParamSpec> p = {
      {"window", 128, double(g.block_size), 8192, true, "W: tail tokens per window, a multiple of the block size"},
      {"rho", 0.25, 0.01, 0.99, false, "kept fraction of a window"},
      {"recent", 256, 0, 1 << 20, true, "R: newest tail tokens never in a window, a multiple of the block size"},
      {"period", 16, 1, 1 << 20, true, "P: a sequence is looked at every P of its own decode steps"},
      {"observers", 1, 0, 2, true, "which queries score a window: 0 window (its own), 1 decode (every decode query "
                                   "that saw the key), 2 both (decode plus the window's queries before each key)"},
      {"norm", 0, 0, 1, true, "the window queries' softmax: 0 over the window's keys, 1 over every key the query "
                              "saw at its decode step"},
      {"agg", 0, 0, 1, true, "decode-time probabilities: 0 mean over the queries that saw the key, 1 sum"},
      {"alpha", 0.5, 0.01, 1.0, false, "fraction of the budget taken as top-scoring candidates"},
      {"max_gap", 8, 0, 8192, true, "G: longest gap between candidates filled as a chunk"},
      {"prompt", 2, 0, 2, true, "0 keep the prompt, 1 window it too (after the sinks), 2 auto: window it but keep "
                                "its leading blocks shared with other sequences (adopted from the prefix cache, or "
                                "the prompt a fork before decoding shares); with observers other than 1, which need "
                                "the prompt's queries to window it, 2 keeps it"},
      {"sinks", 4, 0, 8192, true, "S: first positions always kept"},
      {"budget", 768, 0, 1 << 30, true, "version 3: resident tokens above which turns compress (with fit, the "
                                        "default, re-ranking everything older than the recent region down to it); "
                                        "768 by default where it applies (observers=1, no share, rho2 or grow), else "
                                        "0 (0: unbounded, version 2)"},
      {"share", 0, 0, 0.99, false, "version 3 without a fixed size: the budget at each turn is floor(share x L), L the "
                                   "tokens ever appended to the sequence (0: none; budget or share, not both)"},
      {"rho2", 0, 0, 0.99, false, "two levels: kept share of a second-level window, the oldest W compressed tokens "
                                  "once W + R of them wait (0: one level)"},
      {"fit", 1, 0, 2, true, "with a budget and observers=1: 1 a turn above the budget re-ranks everything older "
                             "than the recent region down to it, instead of compressing a window to rho (0: windows, "
                             "version 3's first form; 2: as 1, each cut at least W - B, as rare as windows); 1 is the "
                             "default wherever it applies"},
      {"grain", 0, 0, 8192, true, "with fit: the granularity of its cut in tokens (0: the block size); one that "
                                  "does not divide into whole blocks moves the recent tokens down at every cut"},
      {"grow", 0, 0, 0.95, false, "the recent region's share of the tokens that entered the tail, at least R "
                                  "(0: R fixed)"},
  };
  for (ParamSpec& spec : policy_util::cam_params()) p.push_back(std::move(spec));
  return p;
}

absl::StatusOr<std::unique_ptr<Policy>> make_kara(const PolicyParams& p, const kernels::Geometry& g) {
  for (const char* name : {"window", "recent"}) {
    if (p.geti(name) % g.block_size != 0) {
      return absl::InvalidArgumentError(absl::StrCat("policy 'kara' parameter ", name, "=", p.geti(name),
                                                     " must be a multiple of the block size ", g.block_size));
    }
  }
  const int memory_budget = KaraPolicy::memory_budget(p);
  if (memory_budget > 0 && p.get("share") > 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy 'kara': budget=", memory_budget, " and share=", p.get("share"),
        " both set the memory budget (a fixed size, or a share of the sequence's length); set one of them"));
  }
  // The budget as the request set it, for the messages below: "budget=N" or "share=F".
  const bool bounded = memory_budget > 0 || p.get("share") > 0;
  const std::string bound = memory_budget > 0 ? absl::StrCat("budget=", memory_budget)
                                                 : absl::StrCat("share=", p.get("share"));
  if (bounded && p.geti("observers") == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy 'kara': ", bound, " needs decode observations (observers=1 decode or 2 both); "
        "observers=0 (window) cannot re-rank the compressed region, whose own queries are gone"));
  }
  for (const char* name : {"rho2", "grow"}) {
    if (p.get(name) > 0 && bounded) {
      return absl::InvalidArgumentError(absl::StrCat(
          "policy 'kara': ", name, "=", p.get(name), " with ", bound,
          ": two levels and a growing recent region are alternatives to the budget's re-rank; set one of them"));
    }
  }
  if (p.given("fit") && p.geti("fit") > 0 && !bounded) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy 'kara': fit=", p.geti("fit"), " needs a budget (budget > 0 or share > 0): it re-ranks what is "
        "older than the recent region down to the budget, and there is none (budget=0 and share=0; the budget "
        "defaults to 0 with observers other than 1, with rho2 or grow, and with quantized storage)"));
  }
  if (p.given("fit") && p.geti("fit") > 0 && p.geti("observers") != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy 'kara': fit=", p.geti("fit"), " needs observers=1 (decode); observers=", p.geti("observers"),
        " would keep window queries that fit never reads (it scores by decode attention only)"));
  }
  if (p.geti("grain") > 0 && KaraPolicy::fits(p) == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy 'kara': grain=", p.geti("grain"), " sets the granularity of fit's cut, and fit is 0 here (fit "
        "applies with a budget and observers=1; give fit=1 or drop grain)"));
  }
  if (p.geti("grain") > 0 && p.geti("grain") % g.block_size != 0 && policy_util::cam_merge_tokens(p) > 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy 'kara': grain=", p.geti("grain"), " is not a multiple of the block size ", g.block_size,
        ", so cuts move the recent tokens, which CaM merging (cam=1) does not support; expected a multiple of ",
        g.block_size, " or cam=0"));
  }
  if (p.get("rho2") > 0 && p.geti("observers") == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy 'kara': rho2=", p.get("rho2"), " needs decode observations (observers=1 decode or 2 both); "
        "observers=0 (window) cannot score compressed tokens, whose own queries are gone"));
  }
  if (p.get("grow") > 0 && p.geti("observers") != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy 'kara': grow=", p.get("grow"), " needs observers=1 (decode); observers=", p.geti("observers"),
        " would keep the queries of a recent region that grows without end"));
  }
  if (const int b2 = KaraPolicy::budget_for(p.get("rho2"), p.geti("window"), g.block_size);
      p.get("rho2") > 0 && b2 >= p.geti("window")) {
    return absl::InvalidArgumentError(absl::StrCat("policy 'kara': rho2=", p.get("rho2"), " keeps ", b2, " of a ",
                                                   p.geti("window"),
                                                   "-token second-level window after rounding to blocks; expected fewer"));
  }
  const int budget = KaraPolicy::budget_for(p.get("rho"), p.geti("window"), g.block_size);
  if (budget >= p.geti("window")) {
    return absl::InvalidArgumentError(absl::StrCat("policy 'kara': rho=", p.get("rho"), " keeps ", budget,
                                                   " of a ", p.geti("window"),
                                                   "-token window after rounding to blocks; expected fewer"));
  }
  return std::make_unique<KaraPolicy>(p, g);
}

KARAKV_REGISTER_POLICY("kara", kara_params, make_kara);

}  // namespace karakv::server
