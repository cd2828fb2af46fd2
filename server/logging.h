// karakvd's log output: spdlog with a text pattern, or one JSON object per line for log shippers
// (--log_format=json), on stderr; gRPC's and protobuf's own log lines go through the same sink.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "spdlog/formatter.h"

namespace karakv::server {

// "text" or "json"; anything else is refused with the accepted values.
absl::StatusOr<std::unique_ptr<spdlog::formatter>> make_log_formatter(const std::string& format);

// Appends `text` as the inside of a JSON string: quotes, backslashes and control characters are
// escaped, and bytes that are not valid UTF-8 become U+FFFD, so every line parses.
void append_json_escaped(std::string_view text, std::string* out);

// Sets the default logger's formatter and level, and routes gRPC's log lines to spdlog.
absl::Status setup_logging(const std::string& format, const std::string& level);

}  // namespace karakv::server
