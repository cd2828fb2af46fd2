// Compaction: which policy each sequence runs and the state that policy keeps for it, the
// scheduler that decides when policies run, and plan-then-apply. It asks policies (trigger, due,
// urgency, first_open_slot); it knows none by name. Not thread-safe: the core calls it under its
// lock.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "server/core_types.h"
#include "server/policy.h"
#include "server/sequence.h"
#include "server/sequence_store.h"

namespace karakv::server {

// A sequence's policies and its policy's state; the store keeps it opaque (Sequence::policy).
struct PolicyBinding {
  std::shared_ptr<const Policy> policy;
  std::shared_ptr<const Policy> prefill;  // null: none, or already applied
  std::string prefill_name;               // as asked for; kept after the prefill policy ran
  std::unique_ptr<PolicyState> state;     // made by `policy`; null when it keeps none
  // The parameters as resolved (defaults filled in), for Inspect and Compact.
  std::map<std::string, double> params, prefill_params;
};

class Compactor {
 public:
  Compactor(SequenceStore& store, int max_sequences_per_tick);

  // The binding CreateSequence asks for: the policy and the prefill policy built and checked
  // against the backend (UNIMPLEMENTED naming the op it cannot run); `quantized_storage`: the
  // sequence stores aged tokens in a quantized format.
  absl::StatusOr<std::shared_ptr<PolicyBinding>> bind(const std::string& policy,
                                                      const std::map<std::string, double>& params,
                                                      const std::string& prefill_policy,
                                                      const std::map<std::string, double>& prefill_params,
                                                      bool quantized_storage = false) const;
  // A deep copy for a forked sequence (its state is its own from now on); an error when the state's
  // copy cannot be had (memory).
  absl::StatusOr<std::shared_ptr<PolicyBinding>> fork(const Sequence& parent) const;

  // ---- hooks of the data path ----
  // FAILED_PRECONDITION when the policy needs queries the Append does not carry.
  absl::Status check_append(const Sequence& seq, int32_t num_tokens, int32_t num_query_tokens) const;
  // The cache is about to cover `slots` slots; an error (the policy state's memory) refuses the
  // request.
  absl::Status on_grow(Sequence& seq, int32_t slots) const;
  // How many queries to reserve room for, and whether a Step's queries are kept at all.
  int query_capacity_hint(const Sequence& seq) const;
  bool keeps_step_queries(const Sequence& seq) const;
  // Drops the queries no policy of the sequence will read again.
  void trim_queries(Sequence& seq) const;
  // Quantizes what the storage format may: aged tokens the policy will never rewrite.
  void quantize_aged(Sequence& seq) const;
  // Layer 0 of a Step: extra blocks the prompt's one-time compression will take (FAILED_PRECONDITION
  // when it cannot run yet).
  absl::StatusOr<int32_t> step_blocks(const Sequence& seq) const;
  // The first Step: runs the prefill policy, fixes the prompt and tells the policy.
  absl::Status begin_decode(Sequence& seq);
  // What a Step's decode attention records for the policies (Observers); empty when nothing.
  // `scale`: the step's softmax scale (the log-sum-exp a policy records is taken at it).
  Observers observers(absl::Span<Sequence* const> seqs, int layer, float scale) const;
  // A decode step (every layer) completed for the sequence.
  void on_step(Sequence& seq) const;

  // ---- scheduling and compaction ----
  // After a decode step completed for `batch`: threshold policies of the batch's sequences, then
  // periodic policies of every sequence whose turn it is, most urgent first. Returns how many
  // compactions ran.
  int run_scheduler(absl::Span<Sequence* const> batch);
  // The sequence's own policy now (Compact RPC); skipped while a step is in progress.
  absl::StatusOr<CompactionResult> compact(Sequence& seq, bool dry_run);

  // The policy's side of a sequence's info: prefill policy and resolved parameters.
  void describe(const Sequence& seq, SequenceInfo& info) const;
  // Per-policy compaction counters and the policies' state bytes into `s`.
  void fill_stats(CoreStats& s) const;
  // Called after every compaction that ran, and for each compaction event.
  void set_compaction_observer(std::function<void(const CompactionResult&)> observer) { observer_ = std::move(observer); }
  void set_event_observer(std::function<void(const CoreEvent&)> observer) { event_observer_ = std::move(observer); }

 private:
  mutable std::mutex advised_mu_;
  mutable std::set<std::string> advised_;  // Policy::advice() texts bind() has logged
  SequenceView view_of(const Sequence& seq, bool own) const;
  // Plans and (unless dry_run) applies `policy` to `seq`. A failure leaves the sequence unchanged.
  absl::StatusOr<CompactionResult> run_policy(Sequence& seq, const Policy& policy, bool dry_run);
  // run_policy for a sequence whose slots the plan may take from are all unquantized.
  absl::StatusOr<CompactionResult> run_in_place(Sequence& seq, const Policy& policy, bool dry_run);
  // A compaction that ran: counted, observed, and announced on the sequence's session's events.
  void record(const CompactionResult& r, const Sequence& seq, int32_t removed);
  // One that failed: counted and announced (kCompactionFailed); returns `error`.
  absl::Status failed(const std::string& policy, const Sequence& seq, absl::Status error);

  SequenceStore& store_;
  const int max_sequences_per_tick_;
  std::map<std::string, PolicyStats> policy_stats_;
  std::function<void(const CompactionResult&)> observer_;
  std::function<void(const CoreEvent&)> event_observer_;
};

}  // namespace karakv::server
