// The baselines' common shape: when the cache reaches c_max tokens, compress the WHOLE cache
// (earlier compressed parts included) to c_target tokens, keeping the first `sinks` positions.
#pragma once

#include <string>

#include "absl/strings/str_cat.h"
#include "server/policy.h"

namespace karakv::server {

class ThresholdPolicy : public Policy {
 public:
  ThresholdPolicy(std::string name, const PolicyParams& p)
      : name_(std::move(name)),
        c_max_(p.geti("c_max")),
        c_target_(p.geti("c_target")),
        sinks_(p.geti("sinks")),
        merge_(p.values().count("cam") ? policy_util::cam_merge_tokens(p) : 0) {}

  int merge_tokens() const override { return merge_; }
  std::vector<kernels::Op> required_ops() const override {
    return {kernels::Op::kTopK, kernels::Op::kGatherTokens};
  }

  const std::string& name() const override { return name_; }
  Trigger trigger() const override { return Trigger::kThreshold; }
  bool due(const SequenceView& seq, bool forced) const override {
    return (forced ? seq.resident > c_target_ : seq.resident >= c_max_) && has_inputs(seq);
  }
  absl::Status ready(const SequenceView& seq) const override {
    if (seq.resident <= c_target_ || has_inputs(seq)) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat("policy '", name_, "' cannot score: ", inputs_needed()));
  }

 protected:
  // Whether the policy's scores can be computed (queries or accumulated attention present).
  virtual bool has_inputs(const SequenceView& seq) const { return true; }
  virtual std::string inputs_needed() const { return ""; }

  const std::string name_;
  const int c_max_, c_target_, sinks_, merge_;
};

// c_max, c_target and sinks, shared by every threshold policy.
inline std::vector<ParamSpec> threshold_params() {
  return {
      {"c_max", 1024, 2, 1 << 24, true, "cache length that triggers compression"},
      {"c_target", 512, 1, 1 << 24, true, "cache length after compression"},
      {"sinks", 4, 0, 1 << 20, true, "S: first positions always kept"},
  };
}

// Checks c_target < c_max and that `reserved` forced tokens fit in c_target.
inline absl::Status check_threshold(const std::string& name, const PolicyParams& p, int reserved) {
  if (p.geti("c_target") >= p.geti("c_max")) {
    return absl::InvalidArgumentError(absl::StrCat("policy '", name, "': c_target=", p.geti("c_target"),
                                                   " must be below c_max=", p.geti("c_max")));
  }
  if (reserved > p.geti("c_target")) {
    return absl::InvalidArgumentError(absl::StrCat("policy '", name, "': c_target=", p.geti("c_target"),
                                                   " cannot hold the ", reserved,
                                                   " tokens always kept (sinks + window)"));
  }
  return absl::OkStatus();
}

// w_obs and pool, the SnapKV scoring parameters (snapkv, chunkkv).
inline std::vector<ParamSpec> snapkv_score_params() {
  return {
      {"w_obs", 32, 1, 4096, true, "observation window: newest tokens whose queries score the cache"},
      {"pool", 5, 1, 63, true, "width of the average pool over scores (odd)"},
  };
}

// check_threshold with the observation window and sinks always kept, and an odd pool width.
inline absl::Status check_snapkv_scored(const std::string& name, const PolicyParams& p) {
  if (auto s = check_threshold(name, p, p.geti("w_obs") + p.geti("sinks")); !s.ok()) return s;
  if (p.geti("pool") % 2 == 0) {
    return absl::InvalidArgumentError(absl::StrCat("policy '", name, "' parameter pool=", p.geti("pool"),
                                                   " must be odd (same padding)"));
  }
  return absl::OkStatus();
}

// threshold_params() plus CaM's, for policies that score tokens.
inline std::vector<ParamSpec> scored_threshold_params() {
  auto p = threshold_params();
  for (ParamSpec& spec : policy_util::cam_params()) p.push_back(std::move(spec));
  return p;
}

// A threshold policy scored by SnapKV (snapkv, chunkkv): it needs the queries of the newest w_obs
// tokens, which the daemon keeps from Step (and a prompt's Append).
class SnapKVScoredPolicy : public ThresholdPolicy {
 public:
  SnapKVScoredPolicy(std::string name, const PolicyParams& p)
      : ThresholdPolicy(std::move(name), p), w_obs_(p.geti("w_obs")), pool_(p.geti("pool")) {}
  int query_window() const override { return w_obs_; }
  std::vector<kernels::Op> required_ops() const override {
    return {kernels::Op::kSnapKVScores, kernels::Op::kTopK, kernels::Op::kGatherTokens};
  }

 protected:
  bool has_inputs(const SequenceView& seq) const override {
    return seq.resident > w_obs_ && seq.queries_first <= seq.resident - w_obs_ &&
           seq.queries_first + seq.num_queries >= seq.resident;
  }
  std::string inputs_needed() const override {
    return absl::StrCat("it needs the queries of the newest ", w_obs_,
                        " tokens (Step sends them; for a prompt, Append q with num_query_tokens)");
  }

  const int w_obs_, pool_;
};

// SnapKV's per-slot scores for every layer and KV head: [num_layers][num_kv_heads][resident].
absl::StatusOr<std::vector<float>> snapkv_all_scores(const SequenceView& seq, const kernels::PagedKV& kv,
                                                     kernels::Backend& backend, int w_obs, int pool);

}  // namespace karakv::server
