// The least any gRPC Append can cost: a unary call whose request is one slice pointing at the
// caller's bytes (no protobuf, no copy on the client) to an in-process callback server that only
// counts the bytes it received (no parse, no copy). P1 measures it beside the inline Append, so the
// part of an inline Append's time that is gRPC's own shows in the same run.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace karakv::bench {

class GrpcFloor {
 public:
  // Serves on the Unix socket `path` (created; removed on destruction).
  static absl::StatusOr<std::unique_ptr<GrpcFloor>> Start(const std::string& path);
  ~GrpcFloor();

  // One call carrying `size` bytes at `data`; fails unless the server counted exactly `size`.
  absl::Status call(const void* data, size_t size);

 private:
  struct State;
  explicit GrpcFloor(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace karakv::bench
