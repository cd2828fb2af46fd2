// `karakv top` against a real karakvd: the frames it prints carry the daemon's own numbers (pool,
// sequences, decode counters, errors by method and code), rates appear from the second frame on.
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "karakv/client.h"
#include "tests/integration/daemon.h"

namespace karakv {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

std::string run(const std::string& cmd, int* exit_code) { return testing::run_command(cmd, exit_code); }

int count(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST(TopTest, FramesShowTheDaemonsPoolSequencesStepsAndErrors) {
  testing::Daemon d({"--layers=2", "--q_heads=4", "--kv_heads=2", "--head_dim=16", "--block_size=16",
                     "--dtype=fp32", "--pool_bytes=4MiB"});
  ASSERT_TRUE(d.ready());
  auto c = Client::Attach(d.options());
  ASSERT_TRUE(c.ok()) << c.status();
  Client& client = **c;
  const std::vector<int> prompts = {20, 40};
  std::vector<uint64_t> ids;
  for (int p : prompts) {
    auto id = client.CreateSequence();
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
    client.reset_staging();
    Buffer k = *client.alloc(client.append_bytes(p)), v = *client.alloc(client.append_bytes(p));
    ASSERT_TRUE(client.Append(*id, p, k, v).ok());
  }
  client.reset_staging();
  const size_t n = ids.size();
  Buffer k = *client.alloc(client.step_kv_bytes(n)), v = *client.alloc(client.step_kv_bytes(n));
  Buffer q = *client.alloc(client.q_bytes(n)), out = *client.alloc(client.q_bytes(n));
  for (int step = 0; step < 3; ++step) {
    for (int layer = 0; layer < client.geometry().num_layers; ++layer) {
      ASSERT_TRUE(client.Step(layer, ids, k, v, q, out).ok());
    }
  }
  EXPECT_EQ(client.Release(ids.back() + 100).status().code(), absl::StatusCode::kNotFound);
  auto stats = client.Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->decode_steps, 3u);
  EXPECT_EQ(stats->decode_tokens, 6u);

  int code;
  const std::string cli = absl::StrCat(KARAKV_CLI_PATH, " --target=", d.target(), " top");
  const std::string text = run(cli + " --iterations=2 --interval=0.2", &code);
  ASSERT_EQ(code, 0) << text;
  EXPECT_EQ(count(text, "karakv top "), 2) << text;
  EXPECT_THAT(text, Not(HasSubstr("\033"))) << "no terminal control codes when stdout is a pipe";
  const std::vector<std::string> frames = absl::StrSplit(text, "\n\nkarakv top ");
  ASSERT_EQ(frames.size(), 2u) << text;
  for (const std::string& f : frames) {
    EXPECT_THAT(f, HasSubstr(absl::StrCat("blocks used ", stats->blocks_used, " / ", stats->blocks_total, ", free ",
                                          stats->blocks_free)));
    EXPECT_THAT(f, HasSubstr("resident 66  logical 66"));  // 20 + 40 prompt tokens + 2 x 3 decoded
    EXPECT_THAT(f, HasSubstr("sessions    1  sequences 2"));
    EXPECT_THAT(f, HasSubstr("(decode steps 3, tokens 6)"));
    EXPECT_THAT(f, HasSubstr("errors      1 total"));
    EXPECT_THAT(f, HasSubstr("ReleaseSequence NOT_FOUND=1"));
    // The larger sequence first: 43 tokens in 3 blocks, then 23 in 2.
    const size_t big = f.find(absl::StrCat("\n", ids[1], " "));
    const size_t small = f.find(absl::StrCat("\n", ids[0], " "));
    ASSERT_NE(big, std::string::npos) << f;
    ASSERT_NE(small, std::string::npos) << f;
    EXPECT_LT(big, small);
    EXPECT_THAT(f.substr(big, f.find('\n', big + 1) - big), ::testing::MatchesRegex(".* 43 +43 +3 +0 +0"));
  }
  // Rates need two frames; nothing ran between them, so they are exactly zero.
  EXPECT_THAT(frames[0], HasSubstr("steps/s -  tokens/s -"));
  EXPECT_THAT(frames[1], HasSubstr("steps/s 0.0  tokens/s 0.0"));
  EXPECT_THAT(frames[1], HasSubstr("errors      1 total, 0.0/s"));

  run(cli + " --iterations=-1 2>&1", &code);
  EXPECT_EQ(code, 2);
  run(absl::StrCat(KARAKV_CLI_PATH, " --target=unix:/nonexistent.sock --timeout=1 top --iterations=1 2>&1"), &code);
  EXPECT_EQ(code, 1);
}

}  // namespace
}  // namespace karakv
