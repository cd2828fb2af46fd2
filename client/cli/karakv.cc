// karakv: the operator's command line for karakvd. `karakv health | stats | sequences`, text or
// --json. Exit status: 0 ok, 1 the daemon answered with an error or is not serving, 2 usage.
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_format.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "karakv/v1/karakv.grpc.pb.h"

ABSL_FLAG(std::string, target, "unix:/tmp/karakv.sock", "karakvd address: unix:/path or host:port");
ABSL_FLAG(bool, json, false, "Print JSON instead of text");
ABSL_FLAG(double, timeout, 5.0, "Seconds to wait for the daemon");
ABSL_FLAG(bool, check_invariants, false, "stats: also run the pool invariant check");
ABSL_FLAG(std::string, session, "", "sequences: only this session's sequences");

namespace {

namespace v1 = karakv::v1;

std::string json_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) out += absl::StrFormat("\\u%04x", c);
        else out += c;
    }
  }
  return out;
}

void set_deadline(grpc::ClientContext* ctx) {
  ctx->set_deadline(std::chrono::system_clock::now() +
                    std::chrono::milliseconds(static_cast<int64_t>(absl::GetFlag(FLAGS_timeout) * 1000)));
}

int report_error(const char* what, const grpc::Status& s) {
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("{\"error\":{\"rpc\":\"%s\",\"code\":%d,\"message\":\"%s\"}}\n", what, int(s.error_code()),
                json_escape(s.error_message()).c_str());
  } else {
    std::fprintf(stderr, "karakv: %s failed (code %d): %s\n", what, int(s.error_code()),
                 s.error_message().c_str());
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

int cmd_health(const std::shared_ptr<grpc::Channel>& ch) {
  auto stub = grpc::health::v1::Health::NewStub(ch);
  grpc::health::v1::HealthCheckRequest req;
  grpc::health::v1::HealthCheckResponse resp;
  grpc::ClientContext ctx;
  set_deadline(&ctx);
  grpc::Status s = stub->Check(&ctx, req, &resp);
  if (!s.ok()) return report_error("health", s);
  const bool serving = resp.status() == grpc::health::v1::HealthCheckResponse::SERVING;
  const char* name = grpc::health::v1::HealthCheckResponse::ServingStatus_Name(resp.status()).c_str();
  if (absl::GetFlag(FLAGS_json)) std::printf("{\"status\":\"%s\"}\n", name);
  else std::printf("%s\n", name);
  return serving ? 0 : 1;
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
    std::printf(
        "{\"backend\":\"%s\",\"geometry\":{\"layers\":%d,\"q_heads\":%d,\"kv_heads\":%d,\"head_dim\":%d,"
        "\"dtype\":\"%s\",\"block_size\":%d},\"blocks_total\":%llu,\"blocks_used\":%llu,"
        "\"blocks_free\":%llu,\"block_bytes\":%llu,\"pool_bytes\":%llu,\"resident_tokens\":%llu,"
        "\"sequences\":%u,\"sessions\":%u,\"decode_steps\":%llu,\"tokens_appended\":%llu,"
        "\"lease_expiries\":%llu,\"uptime_seconds\":%.3f",
        json_escape(r.backend()).c_str(), g.num_layers(), g.num_q_heads(), g.num_kv_heads(), g.head_dim(),
        dtype_name(g.dtype()), g.block_size(), (unsigned long long)r.blocks_total(),
        (unsigned long long)r.blocks_used(), (unsigned long long)r.blocks_free(),
        (unsigned long long)r.block_bytes(), (unsigned long long)r.pool_bytes(),
        (unsigned long long)r.resident_tokens(), r.sequences(), r.sessions(),
        (unsigned long long)r.decode_steps(), (unsigned long long)r.tokens_appended(),
        (unsigned long long)r.lease_expiries(), r.uptime_seconds());
    if (r.invariants_checked()) {
      std::printf(",\"invariants_ok\":%s,\"invariant_error\":\"%s\"", r.invariant_error().empty() ? "true" : "false",
                  json_escape(r.invariant_error()).c_str());
    }
    std::printf("}\n");
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
    std::printf("decode steps     %llu\n", (unsigned long long)r.decode_steps());
    std::printf("tokens appended  %llu\n", (unsigned long long)r.tokens_appended());
    std::printf("lease expiries   %llu\n", (unsigned long long)r.lease_expiries());
    std::printf("uptime           %.1f s\n", r.uptime_seconds());
    if (r.invariants_checked()) {
      std::printf("invariants       %s\n", r.invariant_error().empty() ? "ok" : r.invariant_error().c_str());
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
    std::printf("{\"sequences\":[");
    for (int i = 0; i < r.sequences_size(); ++i) {
      const auto& q = r.sequences(i);
      std::printf("%s{\"id\":%llu,\"session\":\"%s\",\"tenant\":\"%s\",\"policy\":\"%s\",\"length\":%u,"
                  "\"blocks\":%u,\"shared_blocks\":%u,\"priority\":%d,\"pending_layer\":%d}",
                  i ? "," : "", (unsigned long long)q.sequence_id(), json_escape(q.session_id()).c_str(),
                  json_escape(q.tenant()).c_str(), json_escape(q.policy()).c_str(), q.length(), q.blocks(),
                  q.shared_blocks(), q.priority(), q.pending_layer());
    }
    std::printf("]}\n");
  } else {
    std::printf("%-8s %-28s %-10s %-8s %8s %7s %7s %5s\n", "ID", "SESSION", "TENANT", "POLICY", "LENGTH",
                "BLOCKS", "SHARED", "PRIO");
    for (const auto& q : r.sequences()) {
      std::printf("%-8llu %-28s %-10s %-8s %8u %7u %7u %5d\n", (unsigned long long)q.sequence_id(),
                  q.session_id().c_str(), q.tenant().c_str(), q.policy().c_str(), q.length(), q.blocks(),
                  q.shared_blocks(), q.priority());
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "karakv: talk to a running karakvd.\n"
      "  karakv [--target=unix:/tmp/karakv.sock] [--json] health | stats | sequences");
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() != 2) {
    std::fprintf(stderr, "usage: karakv [flags] health | stats | sequences   (karakv --help for flags)\n");
    return 2;
  }
  const std::string cmd = args[1];
  auto channel = grpc::CreateChannel(absl::GetFlag(FLAGS_target), grpc::InsecureChannelCredentials());
  if (cmd == "health") return cmd_health(channel);
  if (cmd == "stats") return cmd_stats(channel);
  if (cmd == "sequences") return cmd_sequences(channel);
  std::fprintf(stderr, "karakv: unknown command '%s'; expected health, stats or sequences\n", cmd.c_str());
  return 2;
}
