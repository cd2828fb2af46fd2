// Links the installed SDK and checks its behaviour without a daemon: Attach to a socket nobody
// serves must fail with UNAVAILABLE, and the header's helpers must work.
#include <cstdio>

#include "karakv/client.h"
#include "karakv/kernels/half.h"

int main() {
  karakv::ClientOptions o;
  o.target = "unix:/nonexistent/karakv.sock";
  o.rpc_timeout = absl::Seconds(2);
  auto c = karakv::Client::Attach(o);
  if (c.ok() || c.status().code() != absl::StatusCode::kUnavailable) {
    std::printf("unexpected Attach result: %s\n", c.ok() ? "ok" : std::string(c.status().ToString()).c_str());
    return 1;
  }
  karakv::Buffer b = karakv::Client::alloc_heap(16);
  if (b.size() != 16 || b.in_staging() || karakv::kernels::half_to_float(0x3c00) != 1.0f) return 1;
  std::printf("consumer ok: %s\n", std::string(c.status().message()).c_str());
  return 0;
}
