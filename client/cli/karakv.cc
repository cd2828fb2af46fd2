// karakv: the operator's command line for karakvd. `karakv health | stats | sequences | inspect |
// compact | top | liveness`, text or --json (protobuf's JSON printer: the messages of karakv.v1 and of
// karakv/tools/v1/output.proto, one line each). Exit status: 0 ok (--help and --version too), 1 the
// daemon answered with an error or is not serving, 2 usage.
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <tuple>
#include <chrono>
#include <cstdio>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "util/flags.h"
#include "util/json.h"
#include "karakv/tools/v1/output.pb.h"
#include "karakv/v1/karakv.grpc.pb.h"

ABSL_FLAG(std::string, target, "",
          "karakvd address: unix:/path or host:port (empty: $KARAKV_TARGET, else unix:/tmp/karakv.sock)");
ABSL_FLAG(bool, json, false, "Print JSON instead of text (top: one line per frame)");
ABSL_FLAG(bool, tls, false, "Connect with TLS (implied by --tls_ca / --tls_cert); CA: --tls_ca or the system's roots");
ABSL_FLAG(std::string, tls_ca, "", "PEM file of the CA that signed karakvd's certificate (karakvd --tls_cert)");
ABSL_FLAG(std::string, tls_cert, "", "Mutual TLS: PEM file of this client's certificate (karakvd --tls_client_ca)");
ABSL_FLAG(std::string, tls_key, "", "Mutual TLS: PEM file of this client's private key");
ABSL_FLAG(double, timeout, 5.0, "Seconds to wait for the daemon");
ABSL_FLAG(bool, check_invariants, false, "stats: also run the pool invariant check");
ABSL_FLAG(std::string, session, "", "sequences: only this session's sequences");
ABSL_FLAG(std::string, tenant, "default", "compact: the tenant whose sequences to compact");
ABSL_FLAG(bool, dry_run, false, "compact: show what would be kept, change nothing");
ABSL_FLAG(int, iterations, 0, "top: frames to show before exiting (0: until interrupted)");
ABSL_FLAG(double, interval, 1.0, "top: seconds between frames");
ABSL_FLAG(std::string, heartbeat_file, "",
          "liveness: the file karakvd --heartbeat_file keeps fresh (default: <socket>.alive of --target)");
ABSL_FLAG(double, max_age, 60.0, "liveness: seconds the heartbeat may be old before the daemon counts as wedged");
ABSL_FLAG(int, rows, 20, "top: most sequences listed (largest first)");

namespace {

namespace v1 = karakv::v1;
namespace tools = karakv::tools::v1;

// --target, else $KARAKV_TARGET (what the Helm chart sets), else karakvd's default socket; the
// C++ SDK's karakv::default_target() resolves an empty target the same way.
std::string target() {
  const std::string flag = absl::GetFlag(FLAGS_target);
  if (!flag.empty()) return flag;
  const char* env = std::getenv("KARAKV_TARGET");
  return env != nullptr && *env != '\0' ? std::string(env) : std::string("unix:/tmp/karakv.sock");
}

void print_json(const google::protobuf::Message& m) { std::printf("%s\n", karakv::to_json(m).c_str()); }

// The gRPC status code's name: NOT_FOUND, UNAVAILABLE, ... (gRPC's codes are Abseil's).
std::string code_name(const grpc::Status& s) {
  return absl::StatusCodeToString(static_cast<absl::StatusCode>(s.error_code()));
}

tools::RpcError rpc_error(const char* what, const grpc::Status& s) {
  tools::RpcError e;
  e.set_rpc(what);
  e.set_code(code_name(s));
  e.set_message(s.error_message());
  return e;
}

void set_deadline(grpc::ClientContext* ctx) {
  ctx->set_deadline(std::chrono::system_clock::now() +
                    std::chrono::milliseconds(static_cast<int64_t>(absl::GetFlag(FLAGS_timeout) * 1000)));
}

int report_error(const char* what, const grpc::Status& s) {
  if (absl::GetFlag(FLAGS_json)) {
    tools::ErrorOutput out;
    *out.mutable_error() = rpc_error(what, s);
    print_json(out);
  } else {
    std::fprintf(stderr, "karakv: %s failed (%s): %s\n", what, code_name(s).c_str(), s.error_message().c_str());
  }
  return 1;
}

const char* dtype_name(v1::DType d) {
  switch (d) {
    case v1::DTYPE_FP32: return "fp32";
    case v1::DTYPE_BF16: return "bf16";
    case v1::DTYPE_FP16: return "fp16";
    default: return "unspecified";
  }
}

// Liveness without a call: karakvd's maintenance loop, which takes the core's lock, sets the
// heartbeat file's mtime every second. A daemon whose gRPC threads are all busy (a slow, loaded
// daemon) still beats; a deadlocked or stopped one does not. So the kubelet's liveness probe kills
// only a wedged daemon, never one that is merely slow to answer health.
int cmd_liveness() {
  std::string path = absl::GetFlag(FLAGS_heartbeat_file);
  if (path.empty()) {
    const std::string t = target();
    if (!absl::StartsWith(t, "unix:")) {
      std::fprintf(stderr, "karakv: liveness needs --heartbeat_file (the target %s is not a Unix socket to derive it from)\n",
                   t.c_str());
      return 2;
    }
    path = t.substr(5) + ".alive";
  }
  const double max_age = absl::GetFlag(FLAGS_max_age);
  if (!(max_age > 0)) {
    std::fprintf(stderr, "karakv: --max_age=%g, expected seconds > 0\n", max_age);
    return 2;
  }
  struct stat st;
  if (stat(path.c_str(), &st) != 0) {
    std::fprintf(stderr, "karakv: liveness: heartbeat %s: %s (is karakvd running with --heartbeat_file=%s?)\n",
                 path.c_str(), std::strerror(errno), path.c_str());
    return 1;
  }
  struct timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  const double age = double(now.tv_sec - st.st_mtim.tv_sec) + 1e-9 * double(now.tv_nsec - st.st_mtim.tv_nsec);
  if (age > max_age) {
    std::fprintf(stderr,
                 "karakv: liveness: heartbeat %s is %.1f s old (limit --max_age=%g s): karakvd's maintenance loop "
                 "has not run since; the daemon is wedged or stopped\n",
                 path.c_str(), age, max_age);
    return 1;
  }
  if (absl::GetFlag(FLAGS_json)) std::printf("{\"alive\":true,\"heartbeat_age_seconds\":%.3f}\n", std::max(0.0, age));
  else std::printf("alive: heartbeat %.1f s old\n", std::max(0.0, age));
  return 0;
}

int cmd_health(const std::shared_ptr<grpc::Channel>& ch) {
  auto stub = grpc::health::v1::Health::NewStub(ch);
  grpc::health::v1::HealthCheckRequest req;
  grpc::health::v1::HealthCheckResponse resp;
  grpc::ClientContext ctx;
  set_deadline(&ctx);
  grpc::Status s = stub->Check(&ctx, req, &resp);
  if (!s.ok()) return report_error("health", s);
  const bool serving = resp.status() == grpc::health::v1::HealthCheckResponse::SERVING;
  if (absl::GetFlag(FLAGS_json)) print_json(resp);
  else std::printf("%s\n", grpc::health::v1::HealthCheckResponse::ServingStatus_Name(resp.status()).c_str());
  return serving ? 0 : 1;
}

double prefix_hit_rate(const v1::StatsReply& r) {
  return r.prefix_lookup_tokens() ? double(r.prefix_hit_tokens()) / double(r.prefix_lookup_tokens()) : 0.0;
}

int cmd_stats(const std::shared_ptr<grpc::Channel>& ch) {
  auto stub = v1::KaraKV::NewStub(ch);
  v1::StatsRequest req;
  req.set_check_invariants(absl::GetFlag(FLAGS_check_invariants));
  v1::StatsReply r;
  grpc::ClientContext ctx;
  set_deadline(&ctx);
  grpc::Status s = stub->Stats(&ctx, req, &r);
  if (!s.ok()) return report_error("Stats", s);
  const auto& g = r.geometry();
  const double used_pct = r.blocks_total() ? 100.0 * r.blocks_used() / r.blocks_total() : 0.0;
  if (absl::GetFlag(FLAGS_json)) {
    print_json(r);
  } else {
    std::printf("backend          %s\n", r.backend().c_str());
    std::printf("geometry         layers=%d q_heads=%d kv_heads=%d head_dim=%d dtype=%s block_size=%d\n",
                g.num_layers(), g.num_q_heads(), g.num_kv_heads(), g.head_dim(), dtype_name(g.dtype()),
                g.block_size());
    std::printf("pool             %llu blocks x %llu B = %.1f MiB\n", (unsigned long long)r.blocks_total(),
                (unsigned long long)r.block_bytes(), r.pool_bytes() / 1048576.0);
    std::printf("blocks used/free %llu / %llu (%.1f%% used)\n", (unsigned long long)r.blocks_used(),
                (unsigned long long)r.blocks_free(), used_pct);
    std::printf("resident tokens  %llu\n", (unsigned long long)r.resident_tokens());
    std::printf("sequences        %u in %u sessions\n", r.sequences(), r.sessions());
    std::printf("decode steps     %llu (%llu tokens)\n", (unsigned long long)r.decode_steps(),
                (unsigned long long)r.decode_tokens());
    uint64_t failed = 0;
    std::string by_code;
    for (const auto& e : r.rpc_errors()) {
      failed += e.count();
      absl::StrAppend(&by_code, by_code.empty() ? "" : ", ", e.method(), " ", e.code(), " x", e.count());
    }
    std::printf("failed RPCs      %llu%s%s\n", (unsigned long long)failed, by_code.empty() ? "" : ": ",
                by_code.c_str());
    std::printf("tokens appended  %llu\n", (unsigned long long)r.tokens_appended());
    std::printf("lease expiries   %llu\n", (unsigned long long)r.lease_expiries());
    std::printf("uptime           %.1f s\n", r.uptime_seconds());
    std::printf("logical tokens   %llu (resident / logical = %.3f)\n", (unsigned long long)r.logical_tokens(),
                r.logical_tokens() ? double(r.resident_tokens()) / r.logical_tokens() : 1.0);
    std::printf("query cache      %.1f MiB, scores %.1f MiB\n", r.query_cache_bytes() / 1048576.0,
                r.score_bytes() / 1048576.0);
    std::printf("prefix cache     %s: %llu lookups, %llu of %llu tokens hit (%.1f%%), %llu blocks cached "
                "(%llu unused), %llu evicted\n",
                r.prefix_cache_enabled() ? "on" : "off", (unsigned long long)r.prefix_lookups(),
                (unsigned long long)r.prefix_hit_tokens(), (unsigned long long)r.prefix_lookup_tokens(),
                100.0 * prefix_hit_rate(r), (unsigned long long)r.prefix_cached_blocks(),
                (unsigned long long)r.prefix_unused_blocks(), (unsigned long long)r.prefix_evictions());
    if (r.heap_held_bytes() > 0) {
      std::printf("heap             %.1f MiB in use of %.1f MiB held by malloc\n", r.heap_in_use_bytes() / 1048576.0,
                  r.heap_held_bytes() / 1048576.0);
    } else {
      std::printf("heap             not reported: karakvd's malloc is not glibc's (a sanitizer's or a preloaded one)\n");
    }
    if (r.invariants_checked()) {
      std::printf("invariants       %s\n", r.invariant_error().empty() ? "ok" : r.invariant_error().c_str());
    }
    if (r.policies_size() > 0) {
      std::printf("\n%-14s %5s %10s %10s %8s %12s %9s %6s %8s %8s\n", "POLICY", "SEQS", "RESIDENT", "LOGICAL",
                  "COMPACT", "REMOVED", "TIME(s)", "FAILED", "NOMINAL", "ACTUAL");
      for (const auto& p : r.policies()) {
        std::printf("%-14s %5u %10llu %10llu %8llu %12llu %9.3f %6llu %7.2fx %7.2fx\n", p.policy().c_str(),
                    p.sequences(), (unsigned long long)p.resident_tokens(), (unsigned long long)p.logical_tokens(),
                    (unsigned long long)p.compactions(), (unsigned long long)p.tokens_removed(),
                    p.compaction_seconds(), (unsigned long long)p.compaction_failures(), p.nominal_ratio(),
                    p.actual_ratio());
      }
    }
  }
  return r.invariants_checked() && !r.invariant_error().empty() ? 1 : 0;
}

int cmd_sequences(const std::shared_ptr<grpc::Channel>& ch) {
  auto stub = v1::KaraKV::NewStub(ch);
  v1::ListSequencesRequest req;
  req.set_session_id(absl::GetFlag(FLAGS_session));
  v1::ListSequencesReply r;
  grpc::ClientContext ctx;
  set_deadline(&ctx);
  grpc::Status s = stub->ListSequences(&ctx, req, &r);
  if (!s.ok()) return report_error("ListSequences", s);
  if (absl::GetFlag(FLAGS_json)) {
    print_json(r);
  } else {
    std::printf("%-8s %-28s %-10s %-10s %8s %8s %7s %7s %7s %5s\n", "ID", "SESSION", "TENANT", "POLICY", "RESIDENT",
                "LOGICAL", "COMPACT", "BLOCKS", "SHARED", "PRIO");
    for (const auto& q : r.sequences()) {
      std::printf("%-8llu %-28s %-10s %-10s %8u %8u %7u %7u %7u %5d\n", (unsigned long long)q.sequence_id(),
                  q.session_id().c_str(), q.tenant().c_str(), q.policy().c_str(), q.length(), q.logical_length(),
                  q.compactions(), q.blocks(), q.shared_blocks(), q.priority());
    }
  }
  return 0;
}

// "0-3 128-131 140 ..." : sorted positions as ranges.
std::string ranges(const google::protobuf::RepeatedField<int32_t>& pos) {
  std::string out;
  for (int i = 0; i < pos.size();) {
    int j = i;
    while (j + 1 < pos.size() && pos[j + 1] == pos[j] + 1) ++j;
    if (!out.empty()) out += ' ';
    out += j == i ? absl::StrFormat("%d", pos[i]) : absl::StrFormat("%d-%d", pos[i], pos[j]);
    i = j + 1;
  }
  return out;
}

// A policy's parameters as "name=value ..." (sorted by name).
std::string params_text(const google::protobuf::Map<std::string, double>& params) {
  std::map<std::string, double> sorted(params.begin(), params.end());
  std::string out;
  for (const auto& [name, value] : sorted) absl::StrAppend(&out, out.empty() ? "" : " ", name, "=", value);
  return out.empty() ? "-" : out;
}
int cmd_inspect(const std::shared_ptr<grpc::Channel>& ch, const std::string& id_text) {
  uint64_t id = 0;
  if (!absl::SimpleAtoi(id_text, &id)) {
    std::fprintf(stderr, "karakv: inspect expects a sequence id, got '%s'\n", id_text.c_str());
    return 2;
  }
  auto stub = v1::KaraKV::NewStub(ch);
  v1::InspectRequest req;
  req.set_sequence_id(id);
  v1::InspectReply r;
  grpc::ClientContext ctx;
  set_deadline(&ctx);
  grpc::Status s = stub->Inspect(&ctx, req, &r);
  if (!s.ok()) return report_error("Inspect", s);
  const auto& i = r.info();
  if (absl::GetFlag(FLAGS_json)) {
    print_json(r);
    return 0;
  }
  std::printf("sequence %llu  policy %s%s%s  resident %u of %u logical tokens  prompt %u  compactions %u\n",
              (unsigned long long)i.sequence_id(), i.policy().c_str(), i.prefill_policy().empty() ? "" : " prefill ",
              i.prefill_policy().c_str(), i.length(), i.logical_length(), i.prompt_length(), i.compactions());
  std::printf("params %s%s%s\n", params_text(i.params()).c_str(), i.prefill_policy().empty() ? "" : "  prefill params ",
              i.prefill_policy().empty() ? "" : params_text(i.prefill_params()).c_str());
  // One line per (layer, head): a 64-column map of the history (# all resident, + some, . none),
  // then the resident positions as ranges.
  const int cols = static_cast<int>(std::clamp<uint32_t>(i.logical_length(), 1, 64));
  const double span = std::max<uint32_t>(1, i.logical_length());
  for (const auto& h : r.heads()) {
    std::vector<int> have(cols, 0), total(cols, 0);
    for (uint32_t p = 0; p < i.logical_length(); ++p) ++total[std::min(cols - 1, int(p * cols / span))];
    for (int32_t p : h.positions()) ++have[std::min(cols - 1, int(p * cols / span))];
    std::string map;
    for (int c = 0; c < cols; ++c) map += total[c] == 0 ? ' ' : have[c] == total[c] ? '#' : have[c] > 0 ? '+' : '.';
    std::printf("L%-2d H%-2d [%s] %s\n", h.layer(), h.head(), map.c_str(), ranges(h.positions()).c_str());
  }
  return 0;
}

// Compacts one sequence (or every sequence of --tenant) through a short-lived session.
int cmd_compact(const std::shared_ptr<grpc::Channel>& ch, const std::string& id_text) {
  uint64_t id = 0;
  if (!id_text.empty() && !absl::SimpleAtoi(id_text, &id)) {
    std::fprintf(stderr, "karakv: compact expects a sequence id or nothing (all), got '%s'\n", id_text.c_str());
    return 2;
  }
  auto stub = v1::KaraKV::NewStub(ch);
  v1::AttachRequest a;
  a.set_worker_id("karakv-cli");
  a.set_tenant(absl::GetFlag(FLAGS_tenant));
  v1::AttachReply ar;
  {
    grpc::ClientContext ctx;
    set_deadline(&ctx);
    grpc::Status s = stub->Attach(&ctx, a, &ar);
    if (!s.ok()) return report_error("Attach", s);
  }
  std::vector<uint64_t> ids;
  if (id != 0) {
    ids.push_back(id);
  } else {
    v1::ListSequencesReply l;
    grpc::ClientContext ctx;
    set_deadline(&ctx);
    grpc::Status s = stub->ListSequences(&ctx, v1::ListSequencesRequest(), &l);
    if (!s.ok()) return report_error("ListSequences", s);
    for (const auto& q : l.sequences()) {
      if (q.tenant() == absl::GetFlag(FLAGS_tenant)) ids.push_back(q.sequence_id());
    }
  }
  int rc = 0;
  const bool json = absl::GetFlag(FLAGS_json);
  tools::CompactOutput out;
  out.set_dry_run(absl::GetFlag(FLAGS_dry_run));
  for (uint64_t sid : ids) {
    v1::CompactRequest req;
    req.set_session_id(ar.session_id());
    req.set_sequence_id(sid);
    req.set_dry_run(absl::GetFlag(FLAGS_dry_run));
    v1::CompactReply r;
    grpc::ClientContext ctx;
    set_deadline(&ctx);
    grpc::Status s = stub->Compact(&ctx, req, &r);
    if (!s.ok()) {
      rc = 1;
      if (json) *out.add_errors() = rpc_error("Compact", s);
      else report_error("Compact", s);
      continue;
    }
    for (const auto& c : r.sequences()) {
      if (json) {
        *out.add_sequences() = c;
      } else {
        std::printf("sequence %llu (%s %s): %u -> %u resident tokens%s%s%s\n", (unsigned long long)c.sequence_id(),
                    c.policy().c_str(), params_text(c.params()).c_str(), c.tokens_before(), c.tokens_after(),
                    absl::GetFlag(FLAGS_dry_run) ? " (dry run)" : "", c.skipped().empty() ? "" : "; skipped: ",
                    c.skipped().c_str());
      }
    }
  }
  if (json) print_json(out);
  v1::DetachRequest d;
  d.set_session_id(ar.session_id());
  v1::DetachReply dr;
  grpc::ClientContext ctx;
  set_deadline(&ctx);
  stub->Detach(&ctx, d, &dr);
  return rc;
}


// One frame of `karakv top`: what Stats and ListSequences say now, with rates over the time since
// the previous frame (`prev`, absent on the first).
struct TopSample {
  v1::StatsReply stats;
  std::chrono::steady_clock::time_point at;
};

uint64_t total_compactions(const v1::StatsReply& r) {
  uint64_t n = 0;
  for (const auto& p : r.policies()) n += p.compactions();
  return n;
}
double total_compaction_seconds(const v1::StatsReply& r) {
  double t = 0;
  for (const auto& p : r.policies()) t += p.compaction_seconds();
  return t;
}
uint64_t total_errors(const v1::StatsReply& r) {
  uint64_t n = 0;
  for (const auto& e : r.rpc_errors()) n += e.count();
  return n;
}

// Rates over the time between two frames.
tools::TopRates rates_between(const TopSample& now, const TopSample& prev) {
  const double dt = std::max(1e-9, std::chrono::duration<double>(now.at - prev.at).count());
  // Counters only grow while the daemon lives; a restart between frames would make these negative.
  auto rate = [dt](uint64_t a, uint64_t b) { return a >= b ? double(a - b) / dt : 0.0; };
  tools::TopRates r;
  r.set_interval_seconds(dt);
  r.set_decode_steps_per_second(rate(now.stats.decode_steps(), prev.stats.decode_steps()));
  r.set_decode_tokens_per_second(rate(now.stats.decode_tokens(), prev.stats.decode_tokens()));
  r.set_compactions_per_second(rate(total_compactions(now.stats), total_compactions(prev.stats)));
  r.set_compaction_time_fraction(
      std::max(0.0, total_compaction_seconds(now.stats) - total_compaction_seconds(prev.stats)) / dt);
  r.set_rpc_errors_per_second(rate(total_errors(now.stats), total_errors(prev.stats)));
  return r;
}

// The largest sequences first: they are what fills the pool.
std::vector<const v1::SequenceInfo*> largest_first(const v1::ListSequencesReply& seqs) {
  std::vector<const v1::SequenceInfo*> rows;
  for (const auto& q : seqs.sequences()) rows.push_back(&q);
  std::sort(rows.begin(), rows.end(), [](const v1::SequenceInfo* a, const v1::SequenceInfo* b) {
    return a->blocks() != b->blocks() ? a->blocks() > b->blocks() : a->sequence_id() < b->sequence_id();
  });
  return rows;
}

tools::TopFrame top_json(const TopSample& now, const TopSample* prev, const v1::ListSequencesReply& seqs,
                         const std::string& target, int max_rows) {
  tools::TopFrame f;
  f.set_target(target);
  *f.mutable_stats() = now.stats;
  f.set_kv_cache_usage(now.stats.blocks_total() ? double(now.stats.blocks_used()) / now.stats.blocks_total() : 0.0);
  if (prev != nullptr) *f.mutable_rates() = rates_between(now, *prev);
  const auto rows = largest_first(seqs);
  for (size_t i = 0; i < rows.size() && int(i) < max_rows; ++i) *f.add_sequences() = *rows[i];
  f.set_sequences_not_shown(rows.size() > size_t(std::max(0, max_rows)) ? uint32_t(rows.size() - max_rows) : 0);
  return f;
}

std::string top_frame(const TopSample& now, const TopSample* prev, const v1::ListSequencesReply& seqs,
                      const std::string& target, int max_rows) {
  const v1::StatsReply& r = now.stats;
  std::string out;
  const double used_pct = r.blocks_total() ? 100.0 * r.blocks_used() / r.blocks_total() : 0.0;
  constexpr int kBar = 40;
  const int filled = static_cast<int>(used_pct / 100.0 * kBar + 0.5);
  uint64_t compactions = 0, failures = 0;
  double compaction_seconds = 0;
  for (const auto& p : r.policies()) {
    compactions += p.compactions();
    failures += p.compaction_failures();
    compaction_seconds += p.compaction_seconds();
  }
  uint64_t errors = 0;
  for (const auto& e : r.rpc_errors()) errors += e.count();
  absl::StrAppendFormat(&out, "karakv top  %s  backend %s  uptime %.0f s\n", target, r.backend(), r.uptime_seconds());
  absl::StrAppendFormat(&out, "pool        [%s%s] %.1f%%  blocks used %llu / %llu, free %llu  (%.1f of %.1f MiB)\n",
                        std::string(filled, '#'), std::string(kBar - filled, '.'), used_pct,
                        (unsigned long long)r.blocks_used(), (unsigned long long)r.blocks_total(),
                        (unsigned long long)r.blocks_free(), r.blocks_used() * double(r.block_bytes()) / 1048576.0,
                        r.pool_bytes() / 1048576.0);
  absl::StrAppendFormat(&out, "tokens      resident %llu  logical %llu  (resident/logical %.3f)\n",
                        (unsigned long long)r.resident_tokens(), (unsigned long long)r.logical_tokens(),
                        r.logical_tokens() ? double(r.resident_tokens()) / r.logical_tokens() : 1.0);
  absl::StrAppendFormat(&out, "sessions    %u  sequences %u  lease expiries %llu\n", r.sessions(), r.sequences(),
                        (unsigned long long)r.lease_expiries());
  if (prev != nullptr) {
    const tools::TopRates rates = rates_between(now, *prev);
    absl::StrAppendFormat(&out, "throughput  steps/s %.1f  tokens/s %.1f  (decode steps %llu, tokens %llu)\n",
                          rates.decode_steps_per_second(), rates.decode_tokens_per_second(),
                          (unsigned long long)r.decode_steps(), (unsigned long long)r.decode_tokens());
    absl::StrAppendFormat(&out,
                          "compaction  %llu total, %.1f/s, %.1f%% of wall time  (%.3f s total, %llu failed)\n",
                          (unsigned long long)compactions, rates.compactions_per_second(),
                          100.0 * rates.compaction_time_fraction(), compaction_seconds, (unsigned long long)failures);
    absl::StrAppendFormat(&out, "errors      %llu total, %.1f/s", (unsigned long long)errors,
                          rates.rpc_errors_per_second());
  } else {
    absl::StrAppendFormat(&out, "throughput  steps/s -  tokens/s -  (decode steps %llu, tokens %llu)\n",
                          (unsigned long long)r.decode_steps(), (unsigned long long)r.decode_tokens());
    absl::StrAppendFormat(&out, "compaction  %llu total, -/s  (%.3f s total, %llu failed)\n",
                          (unsigned long long)compactions, compaction_seconds, (unsigned long long)failures);
    absl::StrAppendFormat(&out, "errors      %llu total", (unsigned long long)errors);
  }
  for (const auto& e : r.rpc_errors()) {
    absl::StrAppendFormat(&out, "  %s %s=%llu", e.method(), e.code(), (unsigned long long)e.count());
  }
  out += "\n";
  if (r.policies_size() > 0) {
    absl::StrAppendFormat(&out, "\n%-14s %5s %10s %10s %8s %8s\n", "POLICY", "SEQS", "RESIDENT", "LOGICAL", "COMPACT",
                          "RATIO");
    for (const auto& p : r.policies()) {
      if (p.sequences() == 0) continue;
      absl::StrAppendFormat(&out, "%-14s %5u %10llu %10llu %8llu %7.2fx\n", p.policy(), p.sequences(),
                            (unsigned long long)p.resident_tokens(), (unsigned long long)p.logical_tokens(),
                            (unsigned long long)p.compactions(), p.actual_ratio());
    }
  }
  const std::vector<const v1::SequenceInfo*> rows = largest_first(seqs);
  absl::StrAppendFormat(&out, "\n%-8s %-10s %-12s %8s %8s %7s %7s %7s\n", "ID", "TENANT", "POLICY", "RESIDENT",
                        "LOGICAL", "BLOCKS", "SHARED", "COMPACT");
  for (size_t i = 0; i < rows.size() && int(i) < max_rows; ++i) {
    const v1::SequenceInfo& q = *rows[i];
    absl::StrAppendFormat(&out, "%-8llu %-10s %-12s %8u %8u %7u %7u %7u\n", (unsigned long long)q.sequence_id(),
                          q.tenant(), q.policy() + (q.storage().empty() ? "" : "+" + q.storage()), q.length(),
                          q.logical_length(), q.blocks(), q.shared_blocks(), q.compactions());
  }
  if (int(rows.size()) > max_rows) absl::StrAppendFormat(&out, "... and %d more\n", int(rows.size()) - max_rows);
  return out;
}

// A live view refreshed every --interval seconds, --iterations times (0: until interrupted). On a
// terminal each frame replaces the last; otherwise frames follow each other, separated by a blank
// line. --json: one TopFrame per line.
int cmd_top(const std::shared_ptr<grpc::Channel>& ch) {
  auto stub = v1::KaraKV::NewStub(ch);
  const int iterations = absl::GetFlag(FLAGS_iterations);
  const double interval = absl::GetFlag(FLAGS_interval);
  if (iterations < 0 || !(interval > 0)) {
    std::fprintf(stderr, "karakv: top needs --iterations >= 0 (0: forever) and --interval > 0, got %d and %g\n",
                 iterations, interval);
    return 2;
  }
  const bool tty = isatty(STDOUT_FILENO);
  std::optional<TopSample> prev;
  for (int i = 0; iterations == 0 || i < iterations; ++i) {
    if (i > 0) std::this_thread::sleep_for(std::chrono::duration<double>(interval));
    TopSample now;
    {
      grpc::ClientContext ctx;
      set_deadline(&ctx);
      grpc::Status s = stub->Stats(&ctx, v1::StatsRequest(), &now.stats);
      if (!s.ok()) return report_error("Stats", s);
    }
    now.at = std::chrono::steady_clock::now();
    v1::ListSequencesReply seqs;
    {
      grpc::ClientContext ctx;
      set_deadline(&ctx);
      grpc::Status s = stub->ListSequences(&ctx, v1::ListSequencesRequest(), &seqs);
      if (!s.ok()) return report_error("ListSequences", s);
    }
    if (absl::GetFlag(FLAGS_json)) {
      print_json(top_json(now, prev ? &*prev : nullptr, seqs, target(), absl::GetFlag(FLAGS_rows)));
    } else {
      const std::string frame = top_frame(now, prev ? &*prev : nullptr, seqs, target(), absl::GetFlag(FLAGS_rows));
      if (tty) std::fputs("\033[H\033[2J", stdout);  // home and clear: the new frame replaces the old
      else if (i > 0) std::fputs("\n", stdout);
      std::fputs(frame.c_str(), stdout);
    }
    std::fflush(stdout);
    prev = std::move(now);
  }
  return 0;
}

}  // namespace

// Plaintext, or TLS when any --tls* flag is set; nullptr (after a message) when a file is unreadable.
std::shared_ptr<grpc::ChannelCredentials> channel_credentials() {
  const std::string ca = absl::GetFlag(FLAGS_tls_ca), cert = absl::GetFlag(FLAGS_tls_cert),
                    key = absl::GetFlag(FLAGS_tls_key);
  if (!absl::GetFlag(FLAGS_tls) && ca.empty() && cert.empty() && key.empty()) return grpc::InsecureChannelCredentials();
  if (cert.empty() != key.empty()) {
    std::fprintf(stderr, "karakv: --tls_cert and --tls_key go together (mutual TLS)\n");
    return nullptr;
  }
  grpc::SslCredentialsOptions tls;
  for (auto [flag, path, out] : {std::tuple{"tls_ca", ca, &tls.pem_root_certs},
                                 std::tuple{"tls_cert", cert, &tls.pem_cert_chain},
                                 std::tuple{"tls_key", key, &tls.pem_private_key}}) {
    if (path.empty()) continue;
    std::ifstream in(path, std::ios::binary);
    if (!in) {
      std::fprintf(stderr, "karakv: --%s=%s: cannot read it (%s)\n", flag, path.c_str(), std::strerror(errno));
      return nullptr;
    }
    std::ostringstream text;
    text << in.rdbuf();
    *out = text.str();
  }
  return grpc::SslCredentials(tls);
}

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "talk to a running karakvd.\n"
      "  karakv [--target=unix:/tmp/karakv.sock] [--json] health | stats | sequences | inspect SEQ |\n"
      "         compact [SEQ] [--dry_run] [--tenant=T] | top [--iterations=N] [--interval=S] |\n"
      "         liveness [--heartbeat_file=F] [--max_age=S]   (no call: the age of karakvd's heartbeat file)\n"
      "The target defaults to $KARAKV_TARGET, else unix:/tmp/karakv.sock.");
  std::vector<char*> args = karakv::parse_command_line(argc, argv, "karakv");
  if (args.size() < 2 || args.size() > 3) {
    std::fprintf(stderr,
                 "usage: karakv [flags] health | stats | sequences | inspect SEQ | compact [SEQ] | top | liveness   (karakv --help for flags)\n");
    return 2;
  }
  const std::string cmd = args[1];
  const std::string arg = args.size() == 3 ? args[2] : "";
  if (cmd == "liveness") return cmd_liveness();
  auto credentials = channel_credentials();
  if (!credentials) return 2;
  auto channel = grpc::CreateChannel(target(), credentials);
  if (cmd == "health") return cmd_health(channel);
  if (cmd == "stats") return cmd_stats(channel);
  if (cmd == "sequences") return cmd_sequences(channel);
  if (cmd == "inspect") return cmd_inspect(channel, arg);
  if (cmd == "compact") return cmd_compact(channel, arg);
  if (cmd == "top") return cmd_top(channel);
  std::fprintf(stderr, "karakv: unknown command '%s'; expected health, stats, sequences, inspect, compact, top or liveness\n",
               cmd.c_str());
  return 2;
}
