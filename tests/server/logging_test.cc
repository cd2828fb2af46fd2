// The JSON log formatter: escaping against hand-written expected strings, and a whole formatted
// line checked field by field.
#include "server/logging.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "spdlog/details/log_msg.h"

namespace karakv::server {
namespace {

std::string escaped(std::string_view s) {
  std::string out;
  append_json_escaped(s, &out);
  return out;
}

TEST(LoggingTest, EscapesQuotesBackslashesAndControlCharacters) {
  EXPECT_EQ(escaped("plain"), "plain");
  EXPECT_EQ(escaped(R"(say "hi" \ bye)"), R"(say \"hi\" \\ bye)");
  EXPECT_EQ(escaped("a\nb\tc\rd"), R"(a\nb\tc\rd)");
  EXPECT_EQ(escaped(std::string("x\x01y\x1f\x7f", 5)), R"(x\u0001y\u001f\u007f)");
  EXPECT_EQ(escaped(std::string("nul\0end", 7)), R"(nul\u0000end)");
}

TEST(LoggingTest, KeepsValidUtf8AndReplacesInvalidBytes) {
  EXPECT_EQ(escaped("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80"), "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80");
  EXPECT_EQ(escaped("bad \xff end"), R"(bad \ufffd end)");
  EXPECT_EQ(escaped("cut \xe2\x82"), R"(cut \ufffd\ufffd)");        // truncated sequence
  EXPECT_EQ(escaped("over \xc0\xaf"), R"(over \ufffd\ufffd)");       // overlong '/'
  EXPECT_EQ(escaped("surrogate \xed\xa0\x80"), R"(surrogate \ufffd\ufffd\ufffd)");
}

TEST(LoggingTest, JsonFormatterWritesOneObjectPerLine) {
  auto f = make_log_formatter("json");
  ASSERT_TRUE(f.ok()) << f.status();
  const std::string text = "worker \"w1\"\nleft";
  spdlog::details::log_msg msg("karakvd", spdlog::level::warn, spdlog::string_view_t(text.data(), text.size()));
  spdlog::memory_buf_t buf;
  (*f)->format(msg, buf);
  std::string line(buf.data(), buf.size());
  ASSERT_FALSE(line.empty());
  EXPECT_EQ(line.back(), '\n');
  EXPECT_EQ(std::count(line.begin(), line.end(), '\n'), 1);
  line.pop_back();
  EXPECT_THAT(line, ::testing::MatchesRegex(
                        R"(\{"time":"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9:.]+[+-][0-9]{2}:[0-9]{2}","level":"warning",)"
                        R"("logger":"karakvd","msg":"worker \\"w1\\"\\nleft"\})"));
}

TEST(LoggingTest, RefusesUnknownFormatNamingTheChoices) {
  auto f = make_log_formatter("xml");
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(f.status().message()), ::testing::HasSubstr("expected text or json"));
}

}  // namespace
}  // namespace karakv::server
