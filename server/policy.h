// The compression policy interface. A policy looks at one sequence's resident cache (through the
// kernels) and returns a CompactionPlan: which slots of a slot range to keep, per layer and KV
// head, the same count for every head. The compactor applies plans; policies never touch the pool.
// A policy keeps what it learns about one sequence (Kara's tail, H2O's accumulated attention) in a
// PolicyState it makes itself; the compactor holds that state and hands it back on every hook.
// Adding a policy: one file under policies/ that ends with KARAKV_REGISTER_POLICY (CMake picks up
// every file there).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "karakv/kernels/backend.h"
#include "server/validation.h"

namespace karakv::server {

// One tunable number of a policy: default and allowed range (docs/COMPRESSION.md).
struct ParamSpec {
  std::string name;
  double default_value;
  double min, max;
  bool integer;
  std::string help;
};

// Parameter values after validation, by name.
class PolicyParams {
 public:
  double get(const std::string& name) const { return values_.at(name); }
  int geti(const std::string& name) const { return static_cast<int>(values_.at(name)); }
  const std::map<std::string, double>& values() const { return values_; }
  void set(const std::string& name, double v) { values_[name] = v; }
  // Whether the request named the parameter (false: its default).
  bool given(const std::string& name) const { return given_.contains(name); }
  void mark_given(const std::string& name) { given_.insert(name); }
  // Not a parameter: whether the sequence stores aged tokens in a quantized format (kara+kivi4),
  // which a policy's defaults may depend on.
  bool quantized_storage() const { return quantized_storage_; }
  void set_quantized_storage(bool q) { quantized_storage_ = q; }

 private:
  std::map<std::string, double> values_;
  std::set<std::string> given_;
  bool quantized_storage_ = false;
};

// Fills defaults and refuses unknown names or values out of range, naming the parameter and the
// allowed range.
absl::StatusOr<PolicyParams> resolve_params(const std::string& policy, const std::vector<ParamSpec>& specs,
                                            const std::map<std::string, double>& given);

// A policy's per-sequence state, opaque to everything but the policy that made it.
class PolicyState {
 public:
  virtual ~PolicyState() = default;
  // For ForkSequence: the child starts with the parent's state (an error when its memory cannot be
  // had).
  virtual absl::StatusOr<std::unique_ptr<PolicyState>> clone() const = 0;
  // Memory it holds, on the host or in the backend (Stats' score_bytes).
  virtual size_t bytes() const { return 0; }
};

// What a policy sees of a sequence. Slots are indices into the resident cache (0..resident-1).
struct SequenceView {
  const kernels::Geometry* geometry = nullptr;
  uint64_t id = 0;             // the sequence's id: its creation index (ids count up from 1)
  int32_t resident = 0;        // tokens in the cache
  int32_t logical = 0;         // tokens ever appended (next position)
  int32_t prompt = 0;          // tokens appended before the first decode step
  bool decoding = false;       // a Step has run: the prompt is fixed
  int32_t shared_prefix = 0;   // leading slots, whole blocks, shared with others (prefix cache, fork)
  // Slots [0, fp_offset) are quantized; the PagedKV a policy gets holds slots from fp_offset on,
  // so kernel slot indices are slot - fp_offset.
  int32_t fp_offset = 0;
  // Query cache: the queries of slots [queries_first, queries_first + num_queries), all layers:
  //   [num_queries][num_layers][num_q_heads][head_dim] fp32
  const float* queries = nullptr;
  int32_t queries_first = 0;
  int32_t num_queries = 0;
  // The sequence's state made by its own policy (Policy::make_state); null when it keeps none, and
  // when the viewer is another policy (a prefill policy sees no state).
  const PolicyState* state = nullptr;
  // Position of slot `slot` for (layer, head).
  std::function<int32_t(int layer, int head, int32_t slot)> position;

  const float* queries_of(int32_t slot, int layer) const {
    const kernels::Geometry& g = *geometry;
    return queries + (size_t(slot - queries_first) * g.num_layers + layer) * g.q_token_elems();
  }
};

// What to keep: slots [begin, end) of the cache are replaced by `num_kept` of them per (layer,
// KV head). begin is block-aligned. When end < resident and the range's kept tokens do not end on a
// block boundary (end or begin + num_kept inside a block), the slots after the range move down
// behind the kept ones (SequenceStore::apply_plan), so slots stay consecutive: where the range
// removes a multiple of the block size, only the rest of the block it ends in; otherwise everything
// after the range, a copy that whole-block plans do not pay.
struct CompactionPlan {
  int32_t begin = 0, end = 0;
  int32_t num_kept = 0;
  std::vector<int32_t> kept;  // [num_layers][num_kv_heads][num_kept] absolute slots, ascending per row
  // Attention mass of every slot of the range, [num_layers][num_kv_heads][end - begin], for CaM
  // merging; empty when the policy has no scores (streaming) or merging is off.
  std::vector<float> scores;
  bool empty() const { return end <= begin; }
};

// When the scheduler asks a policy to run.
enum class Trigger {
  kNever,      // none
  kPeriodic,   // Kara: on the sequence's own turns (Policy::turn), when due
  kThreshold,  // baselines: when the cache reaches its limit
};

class Policy {
 public:
  using State = PolicyState;
  virtual ~Policy() = default;
  virtual const std::string& name() const = 0;
  virtual Trigger trigger() const = 0;
  // How many of the newest tokens' queries the daemon must keep (Kara: the whole tail, -1).
  virtual int query_window() const { return 0; }
  // Tokens of queries the cache typically holds at most (reserved up front, so the cache does not
  // reallocate and copy itself on the decode path).
  virtual int query_capacity_hint() const { return query_window() > 0 ? query_window() + 1 : 0; }
  // Whether the daemon must accumulate decode attention per slot (H2O).
  virtual bool needs_attention() const { return false; }
  // CaM: evicted values are merged into the next this-many kept tokens (0: no merging).
  virtual int merge_tokens() const { return 0; }
  // A warning for the daemon's log when measurements advise against this parameter set (logged
  // once per daemon run and text); empty: none.
  virtual std::string advice() const { return ""; }
  // The resolved parameters as the policy applies them, where a default depends on other
  // parameters (Kara's `budget` and `fit`); what GetSequence reports.
  virtual void effective_params(std::map<std::string, double>* /*params*/) const {}
  // The kernel ops its plans and compactions call (CaM's merge excluded: see merge_tokens), so a
  // sequence is refused at creation when the daemon's backend cannot run one of them.
  virtual std::vector<kernels::Op> required_ops() const { return {}; }
  // Whether the policy would compact now (Kara: a full window in the tail; threshold: the limit).
  // `forced` (Compact RPC) asks whether there is anything to compact at all.
  virtual bool due(const SequenceView& seq, bool forced) const = 0;
  // Why the policy cannot run although the cache is over its budget (missing queries or scores);
  // OK when it can, or when there is nothing to do.
  virtual absl::Status ready(const SequenceView& seq) const { return absl::OkStatus(); }
  // The plan for this sequence now. `kv` holds this one sequence as index 0.
  virtual absl::StatusOr<CompactionPlan> plan(const SequenceView& seq, const kernels::PagedKV& kv,
                                              kernels::Backend& backend) const = 0;

  // Per-sequence state. The hooks below get the state this returned (null: the policy keeps none).
  // A state may keep memory of `backend` (allocate(): device memory on a GPU) and free it when it
  // is destroyed; the backend outlives every sequence.
  virtual std::unique_ptr<State> make_state(const kernels::Geometry& geometry, kernels::Backend& backend) const {
    return nullptr;
  }
  // The cache is about to cover `slots` slots (an Append, a prefix hit, or a Step's new token before
  // its layers run): grow per-slot state. An error (memory) refuses the request that grows it.
  virtual absl::Status on_grow(State* state, int32_t slots) const { return absl::OkStatus(); }
  // The prompt is complete and fixed (the first Step); `seq` is the sequence at that moment.
  virtual void on_decode_start(State* state, const SequenceView& seq) const {}
  // `plan` was applied to the sequence (by this policy when `own`, else by its prefill policy);
  // `resident_before` is the cache length the plan was made for.
  virtual absl::Status on_compacted(State* state, const CompactionPlan& plan, int32_t resident_before,
                                    bool own) const {
    return absl::OkStatus();
  }
  // Where a decode step adds each resident slot's attention for (layer, KV head), or null: the
  // daemon then runs the plain decode kernel. [>= resident + 1] fp32, host memory or memory from
  // the backend's allocate() (Backend::decode_attention_accumulate).
  virtual float* accumulator(State* state, int layer, int kv_head) const { return nullptr; }
  // The first slot whose accumulator the decode step must add to: older slots' scores are never
  // read again (Kara: the tail's start), so their keys are not scored at all. Default: every slot.
  virtual int32_t first_accumulated_slot(const State* state) const { return 0; }
  // Where a decode step writes, for its new token at `layer`, each query head's log-sum-exp over
  // the keys it attended (Backend::decode_attention_observe), or null. [num_q_heads] fp32. `scale`
  // is the step's softmax scale, the one the log-sum-exp is taken at.
  virtual float* lse_output(State* state, int layer, float scale) const { return nullptr; }
  // A decode step (every layer) completed for the sequence; `seq` includes the step's token.
  virtual void on_step(State* state, const SequenceView& seq) const {}
  // Periodic policies: whether the step just completed is one of the sequence's turns to be
  // looked at (the scheduler then asks due()).
  virtual bool turn(const SequenceView& seq) const { return true; }
  // The first slot the policy may still rewrite: older slots may be quantized by the storage
  // format, and (query_window() < 0) their queries dropped. Default: none (the resident length).
  virtual int32_t first_open_slot(const SequenceView& seq) const { return seq.resident; }
  // Among sequences due at the same tick, larger goes first (Kara: the longer tail).
  virtual int64_t urgency(const SequenceView& seq) const { return 0; }
};

// The policy table: every file under policies/ registers its policy with one
// KARAKV_REGISTER_POLICY(name, params_function, make_function) line.
struct PolicyEntry {
  std::string name;
  std::vector<ParamSpec> (*params)(const kernels::Geometry&);
  absl::StatusOr<std::unique_ptr<Policy>> (*make)(const PolicyParams&, const kernels::Geometry&);
};
// Adds an entry; refuses (aborts at start-up) a name registered twice.
bool register_policy(PolicyEntry entry);
#define KARAKV_REGISTER_POLICY(name, params, make) \
  static const bool karakv_policy_registered_##params = ::karakv::server::register_policy({name, params, make})

// Builds the named policy with the given parameters (defaults filled, ranges checked).
// The geometry is needed to check block alignment of budgets; `quantized_storage`: the sequence
// stores aged tokens quantized (PolicyParams::quantized_storage).
absl::StatusOr<std::unique_ptr<Policy>> make_policy(const std::string& name,
                                                    const std::map<std::string, double>& params,
                                                    const kernels::Geometry& geometry, bool quantized_storage = false);
// The parameters `make_policy` would build the named policy with: defaults filled, ranges checked.
absl::StatusOr<PolicyParams> policy_params(const std::string& name, const std::map<std::string, double>& params,
                                           const kernels::Geometry& geometry);
// Names of every registered policy, sorted, for error messages and --help.
std::vector<std::string> policy_names();

// Helpers shared by the policies (policy.cc).
namespace policy_util {
// Score that wins every top-k: for tokens a policy must keep (sinks, observation window).
inline constexpr float kMustKeep = 3.0e38f;
// Copies the queries of slots [first, first + n) at `layer` out of the query cache:
//   out: [n][num_q_heads][head_dim] fp32
void gather_queries(const SequenceView& seq, int32_t first, int32_t n, int layer, float* out);
// Sets to kMustKeep the scores of the sinks (positions < sinks) among slots [begin, begin + len) of
// every (layer, KV head) row:
//   scores: [num_layers][num_kv_heads][len]
// A row's positions rise with its slots (a compaction keeps its tokens in order; nothing else
// writes positions), so each row's scan ends at its first slot past the sinks instead of looking
// up every slot's position.
void force_sinks(const SequenceView& seq, int32_t begin, int32_t len, int sinks, float* scores);
// Whole-cache plan from per-(layer, head) slot scores: top `budget` slots of every row, after the
// sinks (positions < sinks) and the last `keep_last` slots are forced in.
//   scores: [num_layers][num_kv_heads][resident], modified in place
// With keep_scores, the plan carries the scores as they were before forcing (for CaM).
absl::StatusOr<CompactionPlan> top_budget_plan(const SequenceView& seq, std::vector<float>& scores, int budget,
                                               int sinks, int keep_last, kernels::Backend& backend,
                                               bool keep_scores = false);
// The CaM parameters every scoring policy takes: cam (0 or 1) and merge (M).
std::vector<ParamSpec> cam_params();
// merge width when the parameters turn CaM on, else 0.
int cam_merge_tokens(const PolicyParams& p);
}  // namespace policy_util

}  // namespace karakv::server
