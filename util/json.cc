#include "util/json.h"

#include "google/protobuf/util/json_util.h"

namespace karakv {

std::string to_json(const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  std::string out;
  // Fails only for messages that cannot be represented (an Any of an unknown type); these have none.
  const auto status = google::protobuf::util::MessageToJsonString(message, &out, options);
  if (!status.ok()) return "{\"error\":{\"message\":\"cannot print JSON\"}}";
  return out;
}

}  // namespace karakv
