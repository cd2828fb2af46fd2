// The compactor: policy bindings, the scheduler, and plan-then-apply.
#include "server/compaction.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "spdlog/spdlog.h"

namespace karakv::server {
namespace {

// UNIMPLEMENTED naming the op when `backend` cannot run one the policy needs (CaM's merge included
// when the policy merges).
absl::Status check_backend_runs(const kernels::Backend& backend, kernels::DType dtype, const Policy& policy,
                                const char* what) {
  std::vector<kernels::Op> ops = policy.required_ops();
  if (policy.merge_tokens() > 0) ops.push_back(kernels::Op::kCamMerge);
  for (kernels::Op op : ops) {
    if (!backend.supports(op, dtype)) {
      return absl::UnimplementedError(absl::StrCat(what, " '", policy.name(), "' needs ", kernels::op_name(op),
                                                   ", which backend ", std::string(backend.name()), " does not run for ",
                                                   kernels::dtype_name(dtype), "; start karakvd with --backend=cpu"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

Compactor::Compactor(SequenceStore& store, int max_sequences_per_tick)
    : store_(store), max_sequences_per_tick_(max_sequences_per_tick) {}

absl::StatusOr<std::shared_ptr<PolicyBinding>> Compactor::bind(const std::string& name,
                                                               const std::map<std::string, double>& params,
                                                               const std::string& prefill_policy,
                                                               const std::map<std::string, double>& prefill_params,
                                                               bool quantized_storage) const {
  const kernels::Geometry& g = store_.geometry();
  kernels::Backend& backend = store_.backend();
  auto policy = make_policy(name, params, g, quantized_storage);
  if (!policy.ok()) return policy.status();
  if (absl::Status s = check_backend_runs(backend, g.dtype, **policy, "policy"); !s.ok()) return s;
  auto binding = std::make_shared<PolicyBinding>();
  binding->params = policy_params(name, params, g)->values();  // make_policy resolved them already
  (**policy).effective_params(&binding->params);
  if (std::string advice = (**policy).advice(); !advice.empty()) {
    std::lock_guard<std::mutex> lock(advised_mu_);
    if (advised_.insert(advice).second) spdlog::warn("{}", advice);  // once per daemon run (one core)
  }
  if (!prefill_policy.empty() && prefill_policy != "none") {
    auto p = make_policy(prefill_policy, prefill_params, g);
    if (!p.ok()) return absl::InvalidArgumentError(absl::StrCat("prefill_policy: ", p.status().message()));
    if (absl::Status s = check_backend_runs(backend, g.dtype, **p, "prefill_policy"); !s.ok()) return s;
    if ((*p)->trigger() != Trigger::kThreshold) {
      return absl::InvalidArgumentError(absl::StrCat("prefill_policy '", prefill_policy,
                                                     "' is not a one-shot policy; expected snapkv, chunkkv, "
                                                     "streaming or h2o-style threshold policies"));
    }
    if ((*p)->needs_attention()) {
      return absl::InvalidArgumentError(absl::StrCat("prefill_policy '", prefill_policy,
                                                     "' needs decode-time attention, which a prompt does not have"));
    }
    binding->prefill = std::move(*p);
    binding->prefill_name = prefill_policy;
    binding->prefill_params = policy_params(prefill_policy, prefill_params, g)->values();
  } else if (!prefill_params.empty()) {
    return absl::InvalidArgumentError("prefill_params given without a prefill_policy");
  }
  binding->state = (*policy)->make_state(g, backend);
  binding->policy = std::move(*policy);
  return binding;
}

absl::StatusOr<std::shared_ptr<PolicyBinding>> Compactor::fork(const Sequence& parent) const {
  auto child = std::make_shared<PolicyBinding>();
  child->policy = parent.policy->policy;
  child->prefill = parent.policy->prefill;
  child->prefill_name = parent.policy->prefill_name;
  child->params = parent.policy->params;
  child->prefill_params = parent.policy->prefill_params;
  if (parent.policy->state) {
    auto state = parent.policy->state->clone();
    if (!state.ok()) return state.status();
    child->state = std::move(*state);
  }
  return child;
}

SequenceView Compactor::view_of(const Sequence& seq, bool own) const {
  SequenceView v;
  v.geometry = &store_.geometry();
  v.id = seq.id;
  v.resident = seq.length;
  v.logical = seq.logical;
  v.prompt = seq.prompt;
  v.decoding = seq.decoding;
  v.shared_prefix = seq.shared_prefix;
  v.fp_offset = seq.quantized();
  v.queries = seq.queries.data();
  v.queries_first = seq.q_first;
  v.num_queries = seq.q_count;
  v.state = own ? seq.policy->state.get() : nullptr;
  const int hk = store_.geometry().num_kv_heads;
  v.position = [&seq, hk](int layer, int head, int32_t slot) { return seq.position(layer * hk + head, slot); };
  return v;
}

// ---- hooks of the data path ----

absl::Status Compactor::check_append(const Sequence& seq, int32_t num_tokens, int32_t num_query_tokens) const {
  const Policy& policy = *seq.policy->policy;
  if (seq.decoding && policy.query_window() < 0 && num_query_tokens != num_tokens) {
    return absl::FailedPreconditionError(absl::StrCat(
        "sequence ", seq.id, " uses '", policy.name(),
        "', which scores generated tokens by their queries: after decoding started, Append must carry "
        "q for every token (num_query_tokens = num_tokens = ", num_tokens, ")"));
  }
  return absl::OkStatus();
}

absl::Status Compactor::on_grow(Sequence& seq, int32_t slots) const {
  if (!seq.policy->state) return absl::OkStatus();
  absl::Status s = seq.policy->policy->on_grow(seq.policy->state.get(), slots);
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat("sequence ", seq.id, " policy '", seq.policy->policy->name(),
                                             "' cannot grow its state to ", slots, " slots: ", s.message()));
}

int Compactor::query_capacity_hint(const Sequence& seq) const { return seq.policy->policy->query_capacity_hint(); }

bool Compactor::keeps_step_queries(const Sequence& seq) const { return seq.policy->policy->query_window() != 0; }

void Compactor::trim_queries(Sequence& seq) const {
  const PolicyBinding& b = *seq.policy;
  const bool prompt_pending = !seq.decoding && b.prefill;
  int window = b.policy->query_window();
  if (prompt_pending) window = std::max(window, b.prefill->query_window());
  int32_t keep_from;  // first slot whose queries stay
  if (window < 0) {
    // Only slots the policy may still rewrite are ever scored.
    keep_from = prompt_pending ? seq.length - b.prefill->query_window() : b.policy->first_open_slot(view_of(seq, true));
  } else {
    keep_from = seq.length - window;
  }
  store_.trim_queries(seq, keep_from);
}

void Compactor::quantize_aged(Sequence& seq) const {
  if (!seq.quantize || seq.pending_layer >= 0) return;
  // Tokens a policy may still rewrite stay in full precision: Kara's tail, and a prompt whose
  // prefill policy has not run yet.
  const int32_t frozen_end = !seq.decoding && seq.policy->prefill ? 0 : seq.policy->policy->first_open_slot(view_of(seq, true));
  store_.quantize_aged(seq, frozen_end);
}

absl::StatusOr<int32_t> Compactor::step_blocks(const Sequence& seq) const {
  const PolicyBinding& b = *seq.policy;
  if (seq.decoding || !b.prefill) return 0;
  const SequenceView view = view_of(seq, false);
  if (absl::Status s = b.prefill->ready(view); !s.ok()) {
    return absl::FailedPreconditionError(absl::StrCat("sequence ", seq.id, " prefill_", s.message()));
  }
  // The prompt's one-time compression gathers into fresh blocks before it frees the old ones.
  const int32_t block = store_.geometry().block_size;
  return b.prefill->due(view, true) ? (seq.length + block - 1) / block : 0;
}

absl::Status Compactor::begin_decode(Sequence& seq) {
  if (seq.policy->prefill) {
    const std::shared_ptr<const Policy> prefill = seq.policy->prefill;
    if (prefill->due(view_of(seq, false), true)) {
      auto r = run_policy(seq, *prefill, false);
      if (!r.ok()) return r.status();
    }
    seq.policy->prefill.reset();
  }
  seq.decoding = true;
  seq.prompt = seq.logical;
  seq.publish = false;  // the prompt is fixed; generated tokens are never published
  seq.prompt_ids.clear();
  seq.prompt_ids.shrink_to_fit();
  if (seq.policy->state) seq.policy->policy->on_decode_start(seq.policy->state.get(), view_of(seq, true));
  trim_queries(seq);
  return absl::OkStatus();
}

Observers Compactor::observers(absl::Span<Sequence* const> seqs, int layer, float scale) const {
  const int hk = store_.geometry().num_kv_heads;
  Observers out;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const PolicyBinding& b = *seqs[i]->policy;
    if (!b.state) continue;
    for (int h = 0; h < hk; ++h) {
      float* acc = b.policy->accumulator(b.state.get(), layer, h);
      if (acc == nullptr) continue;
      if (out.accumulators.empty()) {
        out.accumulators.assign(seqs.size() * hk, nullptr);
        out.first_slot.assign(seqs.size(), 0);
      }
      out.accumulators[i * hk + h] = acc;
      out.first_slot[i] = b.policy->first_accumulated_slot(b.state.get());
    }
    if (float* lse = b.policy->lse_output(b.state.get(), layer, scale); lse != nullptr) {
      if (out.lse.empty()) out.lse.assign(seqs.size(), nullptr);
      out.lse[i] = lse;
    }
  }
  return out;
}

void Compactor::on_step(Sequence& seq) const {
  if (seq.policy->state) seq.policy->policy->on_step(seq.policy->state.get(), view_of(seq, true));
}

// ---- scheduling and compaction ----

int Compactor::run_scheduler(absl::Span<Sequence* const> batch) {
  int ran = 0;
  // Threshold policies: the sequences that just grew.
  for (Sequence* seq : batch) {
    const Policy& policy = *seq->policy->policy;
    if (policy.trigger() != Trigger::kThreshold || !policy.due(view_of(*seq, true), false)) continue;
    auto r = run_policy(*seq, policy, false);
    ran += r.ok() && r->skipped.empty() ? 1 : 0;
  }
  // Periodic policies: every sequence whose turn this step is (each counts its own steps) and that
  // is due, most urgent first (ties: the older sequence).
  std::vector<std::pair<int64_t, Sequence*>> due;
  for (auto& [id, seq] : store_.sequences()) {
    const Policy& policy = *seq.policy->policy;
    if (policy.trigger() != Trigger::kPeriodic || seq.pending_layer >= 0) continue;
    const SequenceView view = view_of(seq, true);
    if (policy.turn(view) && policy.due(view, false)) due.emplace_back(policy.urgency(view), &seq);
  }
  std::sort(due.begin(), due.end(), [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second->id < b.second->id);
  });
  if (max_sequences_per_tick_ > 0 && int(due.size()) > max_sequences_per_tick_) due.resize(max_sequences_per_tick_);
  for (auto& [urgency, seq] : due) {
    auto r = run_policy(*seq, *seq->policy->policy, false);
    ran += r.ok() && r->skipped.empty() ? 1 : 0;
  }
  if (ran > 0) store_.trim_prefix_cache();
  return ran;
}

absl::StatusOr<CompactionResult> Compactor::compact(Sequence& seq, bool dry_run) {
  if (seq.pending_layer >= 0) {
    CompactionResult r;
    r.sequence_id = seq.id;
    r.policy = seq.label;
    r.tokens_before = r.tokens_after = seq.length;
    r.skipped = absl::StrCat("in the middle of a step (expects layer ", seq.pending_layer, ")");
    r.params = seq.policy->params;
    return r;
  }
  return run_policy(seq, *seq.policy->policy, dry_run);
}

absl::StatusOr<CompactionResult> Compactor::run_policy(Sequence& seq, const Policy& policy, bool dry_run) {
  if (seq.qblocks.empty() || policy.trigger() != Trigger::kThreshold) return run_in_place(seq, policy, dry_run);
  // The baselines rewrite the whole cache, quantized prefix included: they work on a copy of the
  // sequence whose prefix is dequantized into fresh blocks, adopted only if the compaction ran.
  // Kept tokens are re-quantized as they age out again, so their error compounds per compaction.
  auto copy = store_.dequantized_copy(seq);
  if (!copy.ok()) {
    if (absl::IsResourceExhausted(copy.status())) return failed(seq.label, seq, copy.status());
    return copy.status();
  }
  auto r = run_in_place(*copy, policy, dry_run);
  if (r.ok() && !dry_run && r->skipped.empty()) {
    store_.adopt_copy(seq, std::move(*copy));
  } else {
    store_.drop_copy(*copy);
  }
  return r;
}

absl::StatusOr<CompactionResult> Compactor::run_in_place(Sequence& seq, const Policy& policy, bool dry_run) {
  const auto start = absl::Now();
  const bool own = &policy == seq.policy->policy.get();
  CompactionResult result;
  result.sequence_id = seq.id;
  result.policy = own ? seq.label : policy.name();
  if (own) result.params = seq.policy->params;
  result.tokens_before = result.tokens_after = seq.length;
  const SequenceView view = view_of(seq, own);
  if (!policy.due(view, true)) {
    if (absl::Status s = policy.ready(view); !s.ok()) {
      result.skipped = std::string(s.message());
    } else {
      result.skipped = policy.trigger() == Trigger::kNever ? "policy 'none' never compacts" : "nothing to compact yet";
    }
    if (dry_run) result.kept = store_.positions_of(seq);
    return result;
  }
  const Sequence* one = &seq;
  const int32_t fp_length = seq.fp_length();
  PagedView pv = store_.view(absl::MakeConstSpan(&one, 1), absl::MakeConstSpan(&fp_length, 1));
  auto plan = policy.plan(view, pv.kv, store_.backend());
  if (!plan.ok()) return failed(result.policy, seq, plan.status());
  const kernels::Geometry& g = store_.geometry();
  const int32_t b = g.block_size;
  const size_t rows = size_t(g.num_layers) * g.num_kv_heads;
  // A policy that breaks the plan contract is a bug, never the user's fault.
  if (plan->begin % b != 0 || plan->begin < 0 || plan->end > seq.length || plan->begin > plan->end ||
      plan->num_kept > plan->end - plan->begin || plan->kept.size() != rows * plan->num_kept ||
      plan->begin < seq.quantized()) {
    return failed(result.policy, seq,
                  absl::InternalError(absl::StrCat("policy ", policy.name(), " produced an invalid plan [", plan->begin,
                                                   ", ", plan->end, ") keeping ", plan->num_kept, " of ", seq.length)));
  }
  for (size_t r = 0; r < rows; ++r) {
    const int32_t* row = plan->kept.data() + r * plan->num_kept;
    for (int32_t i = 0; i < plan->num_kept; ++i) {
      if (row[i] < plan->begin || row[i] >= plan->end || (i > 0 && row[i] <= row[i - 1])) {
        return failed(result.policy, seq,
                      absl::InternalError(absl::StrCat("policy ", policy.name(), " kept slot ", row[i],
                                                       " out of order or outside [", plan->begin, ", ", plan->end, ")")));
      }
    }
  }
  result.tokens_after = seq.length - (plan->end - plan->begin - plan->num_kept);
  if (dry_run) {
    std::vector<std::vector<int32_t>> kept(rows);
    for (size_t r = 0; r < rows; ++r) {
      for (int32_t s = 0; s < plan->begin; ++s) kept[r].push_back(seq.position(int(r), s));
      for (int32_t i = 0; i < plan->num_kept; ++i) kept[r].push_back(seq.position(int(r), plan->kept[r * plan->num_kept + i]));
      for (int32_t s = plan->end; s < seq.length; ++s) kept[r].push_back(seq.position(int(r), s));
    }
    result.kept = std::move(kept);
    return result;
  }
  const int32_t resident_before = seq.length;
  if (absl::Status s = store_.apply_plan(seq, *plan, policy.merge_tokens(), policy.name()); !s.ok()) {
    return failed(result.policy, seq, s);
  }
  // The range's blocks are the sequence's own now (a prefill policy over a cached prompt, say).
  seq.shared_prefix = std::min(seq.shared_prefix, plan->begin);
  const PolicyBinding& binding = *seq.policy;
  if (binding.state) {
    if (absl::Status s = binding.policy->on_compacted(binding.state.get(), *plan, resident_before, own); !s.ok()) {
      return failed(result.policy, seq,
                    absl::Status(s.code(), absl::StrCat("sequence ", seq.id, " was compacted but policy ", policy.name(),
                                                        " could not remap its state: ", s.message())));
    }
  }
  result.seconds = absl::ToDoubleSeconds(absl::Now() - start);
  record(result, seq, result.tokens_before - result.tokens_after);
  return result;
}

absl::Status Compactor::failed(const std::string& policy, const Sequence& seq, absl::Status error) {
  ++policy_stats_[policy].failures;
  if (!event_observer_) return error;
  CoreEvent e;
  e.kind = CoreEvent::Kind::kCompactionFailed;
  e.session_id = seq.session_id;
  e.sequence_id = seq.id;
  e.policy = policy;
  e.message = absl::StrCat(absl::StatusCodeToString(error.code()), ": ", error.message());
  event_observer_(e);
  return error;
}

void Compactor::record(const CompactionResult& r, const Sequence& seq, int32_t removed) {
  PolicyStats& ps = policy_stats_[r.policy];
  ++ps.compactions;
  ps.tokens_removed += uint64_t(removed);
  ps.seconds += r.seconds;
  if (observer_) observer_(r);
  if (r.skipped.empty() && event_observer_) {
    CoreEvent e;
    e.kind = CoreEvent::Kind::kCompaction;
    e.session_id = seq.session_id;
    e.sequence_id = seq.id;
    e.policy = r.policy;
    e.tokens_before = r.tokens_before;
    e.tokens_after = r.tokens_after;
    event_observer_(e);
  }
}

void Compactor::describe(const Sequence& seq, SequenceInfo& info) const {
  info.prefill_policy = seq.policy->prefill_name;
  info.params = seq.policy->params;
  if (seq.quantize) info.params["residual"] = seq.residual;
  info.prefill_params = seq.policy->prefill_params;
}

void Compactor::fill_stats(CoreStats& s) const {
  for (const auto& [name, ps] : policy_stats_) {
    PolicyStats& out = s.policies[name];
    out.compactions += ps.compactions;
    out.tokens_removed += ps.tokens_removed;
    out.failures += ps.failures;
    out.seconds += ps.seconds;
  }
  for (const auto& [id, seq] : store_.sequences()) {
    if (seq.policy->state) s.score_bytes += seq.policy->state->bytes();
  }
}

}  // namespace karakv::server
