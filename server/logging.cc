// Log formatting for karakvd: text, or JSON lines {"time","level","logger","msg"}.
#include "server/logging.h"

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "google/protobuf/stubs/logging.h"
#include "grpc/support/log.h"
#include "spdlog/pattern_formatter.h"
#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/spdlog.h"

namespace karakv::server {

namespace {

// Length of the valid UTF-8 sequence starting at s[i], or 0 if it is not one.
size_t utf8_sequence(std::string_view s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  size_t n;
  unsigned char lo = 0x80, hi = 0xBF;  // range of the second byte
  if (c >= 0xC2 && c <= 0xDF) n = 2;
  else if (c >= 0xE0 && c <= 0xEF) {
    n = 3;
    if (c == 0xE0) lo = 0xA0;        // no overlong forms
    if (c == 0xED) hi = 0x9F;        // no surrogates
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;        // nothing above U+10FFFF
  } else {
    return 0;
  }
  if (i + n > s.size()) return 0;
  if (b(i + 1) < lo || b(i + 1) > hi) return 0;
  for (size_t k = 2; k < n; ++k) {
    if (b(i + k) < 0x80 || b(i + k) > 0xBF) return 0;
  }
  return n;
}

// %* in the pattern: the message, escaped for a JSON string.
class JsonMessageFlag : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm&, spdlog::memory_buf_t& dest) override {
    std::string escaped;
    append_json_escaped(std::string_view(msg.payload.data(), msg.payload.size()), &escaped);
    dest.append(escaped.data(), escaped.data() + escaped.size());
  }
  std::unique_ptr<custom_flag_formatter> clone() const override { return std::make_unique<JsonMessageFlag>(); }
};

void grpc_log_to_spdlog(gpr_log_func_args* args) {
  const auto level = args->severity == GPR_LOG_SEVERITY_ERROR  ? spdlog::level::err
                     : args->severity == GPR_LOG_SEVERITY_INFO ? spdlog::level::info
                                                               : spdlog::level::debug;
  spdlog::log(level, "grpc {}:{}: {}", args->file, args->line, args->message);
}

void protobuf_log_to_spdlog(google::protobuf::LogLevel severity, const char* file, int line, const std::string& message) {
  const auto level = severity == google::protobuf::LOGLEVEL_INFO      ? spdlog::level::info
                     : severity == google::protobuf::LOGLEVEL_WARNING ? spdlog::level::warn
                                                                      : spdlog::level::err;
  spdlog::log(level, "protobuf {}:{}: {}", file, line, message);
}

}  // namespace

void append_json_escaped(std::string_view text, std::string* out) {
  for (size_t i = 0; i < text.size();) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (c >= 0x80) {
      const size_t n = utf8_sequence(text, i);
      if (n == 0) {
        out->append("\\ufffd");
        ++i;
      } else {
        out->append(text.substr(i, n));
        i += n;
      }
      continue;
    }
    switch (c) {
      case '"': out->append("\\\""); break;
      case '\\': out->append("\\\\"); break;
      case '\n': out->append("\\n"); break;
      case '\r': out->append("\\r"); break;
      case '\t': out->append("\\t"); break;
      default:
        if (c < 0x20 || c == 0x7f) absl::StrAppendFormat(out, "\\u%04x", c);
        else out->push_back(static_cast<char>(c));
    }
    ++i;
  }
}

absl::StatusOr<std::unique_ptr<spdlog::formatter>> make_log_formatter(const std::string& format) {
  auto f = std::make_unique<spdlog::pattern_formatter>();
  if (format == "json") {
    f->add_flag<JsonMessageFlag>('*').set_pattern(
        R"({"time":"%Y-%m-%dT%H:%M:%S.%e%z","level":"%l","logger":"karakvd","msg":"%*"})");
  } else if (format == "text") {
    f->set_pattern("%Y-%m-%d %H:%M:%S.%e %^%l%$ karakvd: %v");
  } else {
    return absl::InvalidArgumentError(absl::StrCat("--log_format is '", format, "', expected text or json"));
  }
  return f;
}

absl::Status setup_logging(const std::string& format, const std::string& level) {
  auto f = make_log_formatter(format);
  if (!f.ok()) return f.status();
  // stderr, like every line the libraries below might print, so one stream holds the whole log.
  auto logger = std::make_shared<spdlog::logger>("karakvd", std::make_shared<spdlog::sinks::stderr_color_sink_mt>());
  spdlog::set_default_logger(logger);
  spdlog::set_formatter(std::move(*f));
  spdlog::set_level(spdlog::level::from_str(level));
  gpr_set_log_function(grpc_log_to_spdlog);
  google::protobuf::SetLogHandler(protobuf_log_to_spdlog);
  return absl::OkStatus();
}

}  // namespace karakv::server
