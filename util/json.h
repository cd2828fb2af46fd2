// JSON output of the tools: protobuf's JSON printer, one line per message.
#pragma once

#include <string>

#include "google/protobuf/message.h"

namespace karakv {

// `message` as one line of JSON (no trailing newline): the proto field names, every field present
// (zeros and empty strings too), 64-bit integers as strings and enums by name.
std::string to_json(const google::protobuf::Message& message);

}  // namespace karakv
