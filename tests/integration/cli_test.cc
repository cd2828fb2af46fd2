// The command-line conventions of karakv and karakvd against a real daemon: --help and --version
// exit 0, the target comes from KARAKV_TARGET (the CLI and the C++ SDK), --json is protobuf's JSON
// printer and parses back into the messages it was printed from (karakv top and synthetic_worker
// included), and gRPC status codes are shown by name.
#include <signal.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "karakv/client.h"
#include "karakv/tools/v1/output.pb.h"
#include "karakv/v1/karakv.pb.h"
#include "tests/integration/daemon.h"

namespace karakv {
namespace {

using ::testing::HasSubstr;
using ::testing::MatchesRegex;
using ::testing::Not;
using testing::Daemon;
namespace tools = karakv::tools::v1;

std::string run(const std::string& cmd, int* exit_code) { return testing::run_command(cmd, exit_code); }

// `json` parsed by protobuf's JSON parser into M; a failure names the text.
template <typename M>
M parse(const std::string& json) {
  M m;
  const auto s = google::protobuf::util::JsonStringToMessage(json, &m);
  EXPECT_TRUE(s.ok()) << s.ToString() << " parsing " << json;
  return m;
}

std::vector<std::string> lines(const std::string& text) {
  return absl::StrSplit(text, '\n', absl::SkipEmpty());
}

std::vector<std::string> geometry() {
  return {"--layers=2", "--q_heads=4", "--kv_heads=2", "--head_dim=8", "--dtype=fp32", "--block_size=16",
          "--pool_bytes=4MiB"};
}

TEST(CliTest, HelpExitsZeroAndPrintsTheUsageOnStdout) {
  int code = -1;
  std::string out = run(std::string(KARAKV_CLI_PATH) + " --help 2>/dev/null", &code);
  EXPECT_EQ(code, 0);
  EXPECT_THAT(out, HasSubstr("karakv: talk to a running karakvd."));
  EXPECT_THAT(out, HasSubstr("--target"));
  run(std::string(KARAKV_CLI_PATH) + " --helpfull > /dev/null 2>&1", &code);
  EXPECT_EQ(code, 0);
  out = run(std::string(KARAKVD_PATH) + " --help 2>/dev/null", &code);
  EXPECT_EQ(code, 0);
  EXPECT_THAT(out, HasSubstr("the karakv KV-cache daemon."));
  EXPECT_THAT(out, HasSubstr("--pool_bytes"));
  // A flag that does not exist is still an error.
  out = run(std::string(KARAKV_CLI_PATH) + " --no_such_flag health 2>&1", &code);
  EXPECT_NE(code, 0);
  EXPECT_THAT(out, HasSubstr("no_such_flag"));
}

TEST(CliTest, VersionPrintsTheProjectVersionAndGitRevision) {
  for (const auto& [program, path] : {std::pair{"karakv", KARAKV_CLI_PATH}, std::pair{"karakvd", KARAKVD_PATH}}) {
    int code = -1;
    const std::string out = run(std::string(path) + " --version 2>&1", &code);
    EXPECT_EQ(code, 0) << program;
    EXPECT_THAT(out, MatchesRegex(absl::StrCat(program, " ", KARAKV_EXPECTED_VERSION,
                                               " \\(git ([0-9a-f]{7,40}|unknown)\\)\n")));
    EXPECT_THAT(out, Not(HasSubstr("NDEBUG")));
  }
}

TEST(CliTest, TargetComesFromKaraKvTargetUnlessGiven) {
  Daemon d(geometry());
  ASSERT_TRUE(d.ready());
  int code = -1;
  EXPECT_EQ(run("KARAKV_TARGET=" + d.target() + " " + KARAKV_CLI_PATH + " health", &code), "SERVING\n");
  EXPECT_EQ(code, 0);
  // --target wins over the environment.
  EXPECT_EQ(run(absl::StrCat("KARAKV_TARGET=unix:/nonexistent.sock ", KARAKV_CLI_PATH, " --target=", d.target(),
                             " health"),
                &code),
            "SERVING\n");
  EXPECT_EQ(code, 0);
  // The environment's target is the one tried; the failure names its status code.
  const std::string out =
      run(absl::StrCat("KARAKV_TARGET=unix:/nonexistent.sock ", KARAKV_CLI_PATH, " --timeout=1 health 2>&1"), &code);
  EXPECT_EQ(code, 1);
  EXPECT_THAT(out, HasSubstr("karakv: health failed (UNAVAILABLE): "));
}

// `karakv liveness` reads the age of the heartbeat file karakvd's maintenance loop keeps fresh
// (<socket>.alive by default): it passes while the daemon runs, fails naming the age once the
// daemon is stopped (SIGSTOP: a wedged daemon as the kubelet sees it), passes again when it runs
// on, and fails when the daemon has exited (the file is gone).
TEST(CliTest, LivenessIsTheAgeOfTheDaemonsHeartbeat) {
  Daemon d(geometry());
  ASSERT_TRUE(d.ready());
  const std::string cli = absl::StrCat(KARAKV_CLI_PATH, " --target=", d.target(), " ");
  int code = -1;
  EXPECT_THAT(run(cli + "liveness", &code), MatchesRegex("alive: heartbeat [0-9.]+ s old\n"));
  EXPECT_EQ(code, 0);
  EXPECT_THAT(run(cli + "--json liveness", &code), MatchesRegex("\\{\"alive\":true,\"heartbeat_age_seconds\":[0-9.]+\\}\n"));
  EXPECT_EQ(code, 0);
  // The explicit path is the same file.
  EXPECT_THAT(run(absl::StrCat(KARAKV_CLI_PATH, " --heartbeat_file=", d.socket(), ".alive liveness"), &code),
              HasSubstr("alive"));
  EXPECT_EQ(code, 0);

  ASSERT_EQ(kill(d.pid(), SIGSTOP), 0);
  absl::SleepFor(absl::Milliseconds(2500));
  const std::string stale = run(cli + "--max_age=1 liveness 2>&1", &code);
  ASSERT_EQ(kill(d.pid(), SIGCONT), 0);
  EXPECT_EQ(code, 1);
  EXPECT_THAT(stale, MatchesRegex("karakv: liveness: heartbeat .*\\.alive is [0-9.]+ s old \\(limit --max_age=1 s\\).*"));
  // Running again, the loop beats within its one-second period.
  bool alive = false;
  for (int i = 0; i < 100 && !alive; ++i) {
    run(cli + "--max_age=1 liveness", &code);
    alive = code == 0;
    if (!alive) absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_TRUE(alive) << "the heartbeat did not resume after SIGCONT";

  // Usage errors: no file to derive from a TCP target, a max_age that is not positive.
  run(absl::StrCat(KARAKV_CLI_PATH, " --target=127.0.0.1:1 liveness 2>/dev/null"), &code);
  EXPECT_EQ(code, 2);
  run(cli + "--max_age=0 liveness 2>/dev/null", &code);
  EXPECT_EQ(code, 2);

  const std::string socket = d.socket();
  d.stop();
  EXPECT_THAT(run(cli + "liveness 2>&1", &code), HasSubstr("(is karakvd running with --heartbeat_file="));
  EXPECT_EQ(code, 1);

  // heartbeat_file=none: no file, so liveness cannot pass.
  std::vector<std::string> args = geometry();
  args.push_back("--heartbeat_file=none");
  Daemon off(args);
  ASSERT_TRUE(off.ready());
  run(absl::StrCat(KARAKV_CLI_PATH, " --target=", off.target(), " liveness 2>/dev/null"), &code);
  EXPECT_EQ(code, 1);
}

TEST(CliTest, SdkReadsKaraKvTargetWhenTheTargetIsEmpty) {
  Daemon d(geometry());
  ASSERT_TRUE(d.ready());
  EXPECT_EQ(ClientOptions().target, "");
  ::unsetenv("KARAKV_TARGET");
  EXPECT_EQ(default_target(), "unix:/tmp/karakv.sock");
  ::setenv("KARAKV_TARGET", d.target().c_str(), 1);
  EXPECT_EQ(default_target(), d.target());
  ClientOptions o = d.options();
  o.target = "";
  auto c = Client::Attach(o);
  ::unsetenv("KARAKV_TARGET");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE((*c)->CreateSequence().ok());
}

TEST(CliTest, JsonIsProtobufsAndParsesBackIntoTheReplies) {
  Daemon d(geometry());
  ASSERT_TRUE(d.ready());
  ClientOptions o = d.options();
  o.tenant = "quote\"back\\slash\nline";  // text that a hand-made escaper gets wrong
  auto c = Client::Attach(o);
  ASSERT_TRUE(c.ok());
  const uint64_t id = *(*c)->CreateSequence();
  Buffer k = *(*c)->alloc((*c)->append_bytes(20)), v = *(*c)->alloc((*c)->append_bytes(20));
  ASSERT_TRUE((*c)->Append(id, 20, k, v).ok());
  const std::string cli = std::string(KARAKV_CLI_PATH) + " --target=" + d.target();
  int code = -1;

  std::string out = run(cli + " --json --check_invariants stats", &code);
  EXPECT_EQ(code, 0);
  ASSERT_EQ(lines(out).size(), 1u) << out;
  const auto stats = parse<v1::StatsReply>(out);
  EXPECT_EQ(stats.blocks_used(), 2u);
  EXPECT_EQ(stats.resident_tokens(), 20u);
  EXPECT_EQ(stats.sequences(), 1u);
  EXPECT_TRUE(stats.invariants_checked());
  EXPECT_EQ(stats.invariant_error(), "");
  EXPECT_EQ(stats.geometry().dtype(), v1::DTYPE_FP32);
  // Every field is there, zeros too, under its proto name; 64-bit integers are strings.
  EXPECT_THAT(out, HasSubstr("\"decode_tokens\":\"0\""));
  EXPECT_THAT(out, HasSubstr("\"blocks_used\":\"2\""));
  EXPECT_THAT(out, HasSubstr("\"dtype\":\"DTYPE_FP32\""));

  out = run(cli + " --json sequences", &code);
  EXPECT_EQ(code, 0);
  const auto seqs = parse<v1::ListSequencesReply>(out);
  ASSERT_EQ(seqs.sequences_size(), 1);
  EXPECT_EQ(seqs.sequences(0).sequence_id(), id);
  EXPECT_EQ(seqs.sequences(0).length(), 20u);
  EXPECT_EQ(seqs.sequences(0).tenant(), o.tenant);

  out = run(cli + " --json inspect " + std::to_string(id), &code);
  EXPECT_EQ(code, 0);
  const auto inspect = parse<v1::InspectReply>(out);
  EXPECT_EQ(inspect.info().sequence_id(), id);
  EXPECT_EQ(inspect.info().length(), 20u);

  // A refused call: the error by the status code's name, in JSON on stdout and as text on stderr.
  EXPECT_EQ((*c)->Append(id + 1000, 20, k, v).status().code(), absl::StatusCode::kNotFound);
  out = run(cli + " --json inspect 999999", &code);
  EXPECT_EQ(code, 1);
  const auto error = parse<tools::ErrorOutput>(out);
  EXPECT_EQ(error.error().rpc(), "Inspect");
  EXPECT_EQ(error.error().code(), "NOT_FOUND");
  EXPECT_THAT(error.error().message(), HasSubstr("unknown sequence 999999"));
  out = run(cli + " inspect 999999 2>&1", &code);
  EXPECT_EQ(code, 1);
  EXPECT_THAT(out, HasSubstr("karakv: Inspect failed (NOT_FOUND): "));
  const auto after = parse<v1::StatsReply>(run(cli + " --json stats", &code));
  ASSERT_EQ(after.rpc_errors_size(), 2) << after.DebugString();
  EXPECT_EQ(after.rpc_errors(0).method(), "Append");
  EXPECT_EQ(after.rpc_errors(0).code(), "NOT_FOUND");
  EXPECT_EQ(after.rpc_errors(0).count(), 1u);

  out = run(cli + " --json --tenant=" + "nobody" + " compact", &code);
  EXPECT_EQ(code, 0);
  const auto compacted = parse<tools::CompactOutput>(out);
  EXPECT_EQ(compacted.sequences_size(), 0);
  EXPECT_EQ(compacted.errors_size(), 0);
}

TEST(CliTest, TopJsonPrintsOneParsableFramePerLine) {
  Daemon d(geometry());
  ASSERT_TRUE(d.ready());
  auto c = Client::Attach(d.options());
  ASSERT_TRUE(c.ok());
  std::vector<uint64_t> ids;
  for (int tokens : {16, 64, 32}) {
    ids.push_back(*(*c)->CreateSequence());
    Buffer k = *(*c)->alloc((*c)->append_bytes(tokens)), v = *(*c)->alloc((*c)->append_bytes(tokens));
    ASSERT_TRUE((*c)->Append(ids.back(), tokens, k, v).ok());
  }
  int code = -1;
  const std::string out = run(absl::StrCat(KARAKV_CLI_PATH, " --target=", d.target(),
                                           " --json --iterations=2 --interval=0.2 --rows=2 top"),
                              &code);
  EXPECT_EQ(code, 0);
  const auto frames = lines(out);
  ASSERT_EQ(frames.size(), 2u) << out;
  const auto first = parse<tools::TopFrame>(frames[0]);
  const auto second = parse<tools::TopFrame>(frames[1]);
  EXPECT_EQ(first.target(), d.target());
  EXPECT_FALSE(first.has_rates());
  ASSERT_TRUE(second.has_rates());
  EXPECT_GE(second.rates().interval_seconds(), 0.2);
  EXPECT_EQ(second.stats().blocks_used(), 7u);  // 1 + 4 + 2 blocks of 16
  EXPECT_DOUBLE_EQ(second.kv_cache_usage(), 7.0 / double(second.stats().blocks_total()));
  ASSERT_EQ(second.sequences_size(), 2);  // --rows=2, largest first
  EXPECT_EQ(second.sequences(0).sequence_id(), ids[1]);
  EXPECT_EQ(second.sequences(1).sequence_id(), ids[2]);
  EXPECT_EQ(second.sequences_not_shown(), 1u);
}

TEST(CliTest, SyntheticWorkerJsonIsOneSummaryMessage) {
  Daemon d(geometry());
  ASSERT_TRUE(d.ready());
  int code = -1;
  const std::string out = run(absl::StrCat(SYNTHETIC_WORKER_PATH, " --target=", d.target(),
                                           " --sequences=2 --prompt=20 --generate=4 --check_every=2 --json 2>/dev/null"),
                              &code);
  EXPECT_EQ(code, 0) << out;
  ASSERT_EQ(lines(out).size(), 1u) << out;
  const auto summary = parse<tools::SyntheticWorkerSummary>(out);
  EXPECT_EQ(summary.sequences(), 2);
  EXPECT_EQ(summary.prompt(), 20);
  EXPECT_EQ(summary.generate(), 4);
  EXPECT_GT(summary.decode_tokens_per_s(), 0);
  EXPECT_GT(summary.checks(), 0);
  EXPECT_EQ(summary.failures(), 0);
  EXPECT_TRUE(summary.invariants_ok());
}

}  // namespace
}  // namespace karakv
