// The pieces several karakv-bench modes share (declared and described in bench_common.h).
#include "bench_common.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"

namespace karakv::bench {

std::vector<std::string>& extra_reports() {
  static std::vector<std::string> r;
  return r;
}

std::vector<int> parse_lengths(const std::string& s) {
  std::vector<int> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (!item.empty()) v.push_back(std::max(1, std::atoi(item.c_str())));
  }
  return v;
}

kn::Geometry smollm_geometry() {
  kn::Geometry g;
  g.num_layers = 30;
  g.num_q_heads = 9;
  g.num_kv_heads = 3;
  g.head_dim = 64;
  g.block_size = 16;
  g.dtype = kn::DType::kFloat16;
  return g;
}

absl::StatusOr<kn::Geometry> smollm_geometry_with_block(std::string_view flag, int block_size) {
  if (block_size < 1 || block_size > 1024) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s=%d: expected 1 to 1024 tokens per block", flag, block_size));
  }
  kn::Geometry g = smollm_geometry();
  g.block_size = block_size;
  return g;
}

std::vector<std::string> smollm_flags(size_t pool_bytes, int block_size) {
  return {"--layers=30", "--q_heads=9", "--kv_heads=3", "--head_dim=64", "--dtype=fp16",
          absl::StrCat("--block_size=", block_size), absl::StrCat("--pool_bytes=", pool_bytes)};
}

size_t append_tensor_bytes(const kn::Geometry& g, int tokens) {
  return size_t(g.num_layers) * tokens * g.kv_token_elems() * kn::dtype_size(g.dtype);
}

uint64_t decode_staging_bytes(const kn::Geometry& g, int prompt, int batch) {
  const int chunk = std::min(prompt, 256);
  return 2 * append_tensor_bytes(g, chunk) + 2 * size_t(batch) * g.kv_token_elems() * kn::dtype_size(g.dtype) +
         2 * size_t(batch) * g.q_token_elems() * sizeof(float) + (4 << 20);
}

absl::Status prefill(DecodeSet& set, const kn::Geometry& g, const std::vector<std::string>& policies, int prompt,
                     const std::map<std::string, double>& params) {
  karakv::Client& c = *set.c;
  const int batch = int(policies.size());
  const int chunk = std::min(prompt, 256);
  auto k = c.alloc(c.append_bytes(chunk)), v = c.alloc(c.append_bytes(chunk));
  auto sk = c.alloc(c.step_kv_bytes(batch)), sv = c.alloc(c.step_kv_bytes(batch));
  auto q = c.alloc(c.q_bytes(batch)), out = c.alloc(c.q_bytes(batch));
  for (auto* b : {&k, &v, &sk, &sv, &q, &out}) {
    if (!b->ok()) return b->status();
  }
  set.sk = *sk, set.sv = *sv, set.q = *q, set.out = *out;
  for (int s = 0; s < batch; ++s) {
    karakv::SequenceOptions o;
    o.policy = policies[s];
    o.params = params;
    auto id = c.CreateSequence(o);
    if (!id.ok()) return id.status();
    set.ids.push_back(*id);
    for (int done = 0; done < prompt; done += chunk) {
      const int n = std::min(chunk, prompt - done);
      // The layout is [L][T][Hk][D], so a shorter tail is filled at its own size.
      karakv::synthetic::fill_prompt(k->data(), g, 1, Tensor::kKey, s, done, n);
      karakv::synthetic::fill_prompt(v->data(), g, 1, Tensor::kValue, s, done, n);
      if (n == chunk) {
        if (auto r = c.Append(*id, n, *k, *v); !r.ok()) return r.status();
      } else {
        karakv::Buffer hk = karakv::Client::alloc_heap(c.append_bytes(n)), hv = karakv::Client::alloc_heap(c.append_bytes(n));
        std::memcpy(hk.data(), k->data(), hk.size());
        std::memcpy(hv.data(), v->data(), hv.size());
        if (auto r = c.Append(*id, n, hk, hv); !r.ok()) return r.status();
      }
    }
  }
  return absl::OkStatus();
}

size_t decode_pool_bytes(const kn::Geometry& g, int seqs, int tokens) {
  const size_t blocks = size_t(seqs) * ((tokens + g.block_size - 1) / g.block_size + 2) + 64;
  return blocks * g.block_bytes();
}

double cpu_seconds(pid_t pid) {
  FILE* f = std::fopen(absl::StrCat("/proc/", pid, "/stat").c_str(), "r");
  if (f == nullptr) return -1;
  char buf[1024];
  const size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  // Fields after the command name (which may hold spaces) start after the last ')'.
  const char* p = std::strrchr(buf, ')');
  if (p == nullptr) return -1;
  std::vector<std::string> fields = absl::StrSplit(absl::string_view(p + 2), ' ');
  uint64_t utime = 0, stime = 0;  // fields 14 and 15 of stat(5); fields[0] is field 3
  if (fields.size() < 13 || !absl::SimpleAtoi(fields[11], &utime) || !absl::SimpleAtoi(fields[12], &stime)) return -1;
  return double(utime + stime) / double(sysconf(_SC_CLK_TCK));
}

}  // namespace karakv::bench
