// The daemon the fuzz harnesses drive, in process: a core with a small pool, the service whose
// handlers the gRPC methods call (KaraKVService::Handle) and a ring server without threads
// (RingServer::poll runs a session's commands on the caller's thread). A fresh one per input, so
// every input replays alike.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "google/protobuf/stubs/logging.h"
#include "karakv/kernels/backend.h"
#include "server/metrics.h"
#include "server/core.h"
#include "server/ring.h"
#include "server/service.h"
#include "spdlog/spdlog.h"

namespace karakv::fuzz {

// 2 layers, 4 query heads over 2 KV heads, head_dim 8, 4 tokens a block (the server tests' geometry).
inline kernels::Geometry fuzz_geometry(kernels::DType dtype) {
  kernels::Geometry g;
  g.num_layers = 2;
  g.num_q_heads = 4;
  g.num_kv_heads = 2;
  g.head_dim = 8;
  g.block_size = 4;
  g.dtype = dtype;
  return g;
}
inline constexpr int kPoolBlocks = 48;
inline constexpr uint64_t kMaxStagingBytes = 1 << 20;

// Metrics outlive the daemons: prometheus families are cheap to keep, costly to rebuild.
inline server::Metrics* fuzz_metrics() {
  static server::Metrics* m = [] {
    spdlog::set_level(spdlog::level::off);
    // Garbage strings make protobuf log a UTF-8 complaint per field; the parse result is what counts.
    google::protobuf::SetLogHandler(nullptr);
    return server::Metrics::create("").value().release();
  }();
  return m;
}

struct Daemon {
  std::unique_ptr<server::Core> core;
  std::unique_ptr<server::KaraKVService> service;
  std::unique_ptr<server::RingServer> rings;

  explicit Daemon(const server::CoreConfig& config) {
    auto r = server::Core::create(config, kernels::make_cpu_backend(1));
    if (!r.ok()) {
      std::fprintf(stderr, "fuzz: Core::create: %s\n", r.status().ToString().c_str());
      std::abort();
    }
    core = std::move(*r);
    service = std::make_unique<server::KaraKVService>(core.get(), fuzz_metrics(), false);
    server::RingConfig rc;
    rc.threads = false;
    rings = std::make_unique<server::RingServer>(&service->gate(), core.get(), fuzz_metrics(), rc);
    service->set_rings(rings.get());
  }
  ~Daemon() { rings->stop_all(); }

  // The pool invariant after every call: a broken one is a finding.
  void check(const char* after) const {
    absl::Status s = core->check_invariants();
    if (!s.ok()) {
      std::fprintf(stderr, "fuzz: pool invariant broken after %s: %s\n", after, s.ToString().c_str());
      std::abort();
    }
  }
};

// Every refusal names what was wrong (DESIGN.md): an error without a message is a finding.
inline void check_refusal(const absl::Status& s, const char* method) {
  if (!s.ok() && s.message().empty()) {
    std::fprintf(stderr, "fuzz: %s refused with %s and no message\n", method,
                 absl::StatusCodeToString(s.code()).c_str());
    std::abort();
  }
}

}  // namespace karakv::fuzz
