#include "server/prefix_tier.h"

#include <hiredis/hiredis.h>
#define XXH_INLINE_ALL  // header-only: nothing to link or ship
#include <xxhash.h>

#include <sys/resource.h>
#include <sys/uio.h>
#include <unistd.h>
#include <climits>
#include <cerrno>

#include <algorithm>
#include <bit>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "server/metrics.h"
#include "spdlog/spdlog.h"

namespace karakv::server {
namespace {

static_assert(std::endian::native == std::endian::little, "the tier's value header is written little-endian");

constexpr int kSlots = 16384;
constexpr char kMagic[4] = {'K', 'K', 'V', 'B'};
constexpr uint32_t kFormatVersion = 1;
constexpr size_t kHeaderBytes = PrefixTier::kHeaderBytes;
constexpr uint64_t kChecksumSeed = 0x6b6172616b763174ull;  // "karakv1t"

uint64_t checksum(const char* data, size_t size) { return XXH3_64bits_withSeed(data, size, kChecksumSeed); }
constexpr absl::Duration kMaxPause = absl::Seconds(30);
constexpr absl::Duration kLogEvery = absl::Minutes(1);

timeval to_timeval(absl::Duration d) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(absl::ToInt64Seconds(d));
  tv.tv_usec = static_cast<suseconds_t>(absl::ToInt64Microseconds(d - absl::Seconds(tv.tv_sec)));
  return tv;
}

absl::StatusOr<RedisAddress> parse_address(absl::string_view s) {
  const size_t colon = s.rfind(':');
  RedisAddress a;
  int port = 0;
  if (colon == std::string_view::npos || colon == 0 || !absl::SimpleAtoi(s.substr(colon + 1), &port) || port <= 0 ||
      port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("'", s, "' is not host:port"));
  }
  a.host = std::string(s.substr(0, colon));
  a.port = port;
  return a;
}

template <typename T>
void put(std::string& out, size_t at, T v) {
  std::memcpy(out.data() + at, &v, sizeof(T));
}
template <typename T>
T get(absl::string_view in, size_t at) {
  T v;
  std::memcpy(&v, in.data() + at, sizeof(T));
  return v;
}

// "MOVED 3999 127.0.0.1:6381" or "ASK ..." -> slot and address.
bool parse_redirect(absl::string_view msg, absl::string_view kind, int* slot, std::string* address) {
  if (!absl::ConsumePrefix(&msg, kind) || !absl::ConsumePrefix(&msg, " ")) return false;
  std::vector<absl::string_view> parts = absl::StrSplit(msg, ' ');
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], slot) || *slot < 0 || *slot >= kSlots) return false;
  // Redis 7 may leave the host empty (":6381"): the node's own announced address is unknown.
  *address = std::string(parts[1]);
  return !address->empty();
}

}  // namespace

std::string RedisAddress::str() const { return absl::StrCat(host, ":", port); }

absl::StatusOr<PrefixTierConfig> parse_prefix_tier(const std::string& spec, const std::string& password_file) {
  PrefixTierConfig c;
  absl::string_view rest = spec;
  if (!absl::ConsumePrefix(&rest, "redis://")) {
    return absl::InvalidArgumentError(absl::StrCat("--prefix_tier='", spec,
                                                   "': expected redis://HOST:PORT[,HOST:PORT...] (several nodes: "
                                                   "seeds of one Redis Cluster)"));
  }
  for (absl::string_view part : absl::StrSplit(rest, ',', absl::SkipEmpty())) {
    auto a = parse_address(part);
    if (!a.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--prefix_tier='", spec, "': ", a.status().message(),
                                                     "; expected redis://HOST:PORT[,HOST:PORT...]"));
    }
    c.seeds.push_back(*a);
  }
  if (c.seeds.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--prefix_tier='", spec, "' names no node; expected redis://HOST:PORT[,HOST:PORT...]"));
  }
  if (!password_file.empty()) {
    std::ifstream in(password_file);
    std::string line;
    if (!in || !std::getline(in, line)) {
      return absl::InvalidArgumentError(absl::StrCat("--prefix_tier_password_file=", password_file,
                                                     " cannot be read; expected a file whose first line is "
                                                     "'PASSWORD' or 'USER PASSWORD'"));
    }
    std::vector<std::string> words = absl::StrSplit(absl::StripAsciiWhitespace(line), ' ', absl::SkipEmpty());
    if (words.size() == 1) {
      c.password = words[0];
    } else if (words.size() == 2) {
      c.user = words[0];
      c.password = words[1];
    } else {
      return absl::InvalidArgumentError(absl::StrCat("--prefix_tier_password_file=", password_file, ": its first line has ",
                                                     words.size(), " words; expected 'PASSWORD' or 'USER PASSWORD'"));
    }
  }
  return c;
}

int redis_key_slot(std::string_view key) {
  const size_t open = key.find('{');
  if (open != std::string_view::npos) {
    const size_t close = key.find('}', open + 1);
    if (close != std::string_view::npos && close > open + 1) key = key.substr(open + 1, close - open - 1);
  }
  uint16_t crc = 0;
  for (unsigned char ch : key) {
    crc ^= uint16_t(ch) << 8;
    for (int i = 0; i < 8; ++i) crc = (crc & 0x8000) ? uint16_t((crc << 1) ^ 0x1021) : uint16_t(crc << 1);
  }
  return crc & (kSlots - 1);
}

// ---- RedisClient ----

struct RedisClient::Node {
  std::string address;
  redisContext* ctx = nullptr;
  ~Node() {
    if (ctx != nullptr) redisFree(ctx);
  }
};

RedisClient::RedisClient(PrefixTierConfig config) : config_(std::move(config)) {}
RedisClient::~RedisClient() = default;

absl::StatusOr<RedisClient::Node*> RedisClient::node(const std::string& address) {
  for (auto& n : nodes_) {
    if (n->address == address) return n.get();
  }
  auto a = parse_address(address);
  if (!a.ok()) return absl::UnavailableError(absl::StrCat("Redis named node '", address, "': ", a.status().message()));
  redisContext* ctx = redisConnectWithTimeout(a->host.c_str(), a->port, to_timeval(config_.timeout));
  if (ctx == nullptr || ctx->err != 0) {
    std::string why = ctx == nullptr ? "out of memory" : ctx->errstr;
    if (ctx != nullptr) redisFree(ctx);
    return absl::UnavailableError(absl::StrCat("cannot connect to Redis at ", address, ": ", why));
  }
  auto n = std::make_unique<Node>();
  n->address = address;
  n->ctx = ctx;
  redisSetTimeout(ctx, to_timeval(config_.timeout));
  if (!config_.password.empty()) {
    std::vector<const char*> argv = {"AUTH"};
    std::vector<size_t> len = {4};
    if (!config_.user.empty()) {
      argv.push_back(config_.user.c_str());
      len.push_back(config_.user.size());
    }
    argv.push_back(config_.password.c_str());
    len.push_back(config_.password.size());
    auto* r = static_cast<redisReply*>(redisCommandArgv(ctx, int(argv.size()), argv.data(), len.data()));
    std::string why = r == nullptr ? std::string(ctx->errstr) : r->type == REDIS_REPLY_ERROR ? std::string(r->str, r->len) : "";
    if (r != nullptr) freeReplyObject(r);
    if (!why.empty()) return absl::UnauthenticatedError(absl::StrCat("Redis at ", address, " refused AUTH: ", why));
  }
  nodes_.push_back(std::move(n));
  return nodes_.back().get();
}

void RedisClient::drop(const std::string& address) {
  std::erase_if(nodes_, [&](const auto& n) { return n->address == address; });
}

absl::Status RedisClient::discover() {
  absl::Status last;
  for (const RedisAddress& seed : config_.seeds) {
    auto n = node(seed.str());
    if (!n.ok()) {
      last = n.status();
      continue;
    }
    const char* argv[] = {"CLUSTER", "SLOTS"};
    const size_t len[] = {7, 5};
    auto* r = static_cast<redisReply*>(redisCommandArgv((*n)->ctx, 2, argv, len));
    if (r == nullptr) {
      last = absl::UnavailableError(absl::StrCat("Redis at ", seed.str(), ": ", (*n)->ctx->errstr));
      drop(seed.str());
      continue;
    }
    if (r->type == REDIS_REPLY_ERROR) {
      cluster_ = false;  // "cluster support disabled": a single node
      slots_.assign(kSlots, seed.str());
    } else if (r->type == REDIS_REPLY_ARRAY) {
      cluster_ = true;
      slots_.assign(kSlots, "");
      for (size_t i = 0; i < r->elements; ++i) {
        const redisReply* range = r->element[i];
        if (range->type != REDIS_REPLY_ARRAY || range->elements < 3) continue;
        const redisReply* master = range->element[2];
        if (master->type != REDIS_REPLY_ARRAY || master->elements < 2) continue;
        std::string host(master->element[0]->str == nullptr ? "" : master->element[0]->str, master->element[0]->len);
        if (host.empty() || host == "?") host = seed.host;
        const std::string address = absl::StrCat(host, ":", master->element[1]->integer);
        const long long lo = std::clamp<long long>(range->element[0]->integer, 0, kSlots - 1);
        const long long hi = std::clamp<long long>(range->element[1]->integer, 0, kSlots - 1);
        for (long long s = lo; s <= hi; ++s) slots_[size_t(s)] = address;
      }
    } else {
      freeReplyObject(r);
      last = absl::UnavailableError(absl::StrCat("Redis at ", seed.str(), " answered CLUSTER SLOTS with reply type ",
                                                 r->type));
      continue;
    }
    freeReplyObject(r);
    discovered_ = true;
    return absl::OkStatus();
  }
  return last.ok() ? absl::UnavailableError("no Redis node to ask") : last;
}

absl::StatusOr<std::vector<RedisClient::Reply>> RedisClient::execute(
    const std::vector<std::string_view>& keys, const SendFn& send) {
  if (!discovered_) {
    if (absl::Status s = discover(); !s.ok()) return s;
  }
  const size_t n = keys.size();
  std::vector<Reply> out(n);
  std::vector<std::string> target(n);
  std::vector<char> asking(n, 0);
  std::vector<size_t> pending(n);
  for (size_t i = 0; i < n; ++i) {
    pending[i] = i;
    const std::string& slot_node = slots_[size_t(redis_key_slot(keys[i]))];
    target[i] = slot_node.empty() ? config_.seeds.front().str() : slot_node;
  }
  for (int round = 0; !pending.empty(); ++round) {
    if (round >= 5) {
      return absl::UnavailableError(absl::StrCat("Redis redirected a command ", round, " times (a cluster resharding?)"));
    }
    std::map<std::string, std::vector<size_t>> groups;  // by node, commands in order
    for (size_t i : pending) groups[target[i]].push_back(i);
    std::vector<size_t> next;
    // Every node's share goes out before any reply is read: one round trip, not one per node. A
    // failure anywhere drops every connection of the round (none may keep unread replies).
    auto fail = [&](const std::string& address, const std::string& why) {
      for (const auto& group : groups) drop(group.first);
      return absl::UnavailableError(absl::StrCat("Redis at ", address, ": ", why));
    };
    std::vector<redisContext*> contexts;
    for (const auto& [address, members] : groups) {
      auto nd = node(address);
      if (!nd.ok()) {
        for (const auto& group : groups) drop(group.first);
        return nd.status();
      }
      redisContext* ctx = (*nd)->ctx;
      contexts.push_back(ctx);
      if (absl::Status s = send(ctx, members, asking); !s.ok()) return fail(address, std::string(s.message()));
      for (int done = 0; !done;) {  // run()'s commands wait in hiredis's buffer: out now
        if (redisBufferWrite(ctx, &done) == REDIS_ERR) return fail(address, ctx->errstr);
      }
    }
    size_t g = 0;
    for (const auto& [address, members] : groups) {
      redisContext* ctx = contexts[g++];
      for (size_t i : members) {
        void* raw = nullptr;
        const int replies = asking[i] ? 2 : 1;  // ASKING's OK, then the command's reply
        for (int k = 0; k < replies; ++k) {
          if (raw != nullptr) freeReplyObject(raw);
          raw = nullptr;
          if (redisGetReply(ctx, &raw) != REDIS_OK || raw == nullptr) {
            return fail(address, ctx->err == REDIS_ERR_IO && (errno == EAGAIN || errno == EWOULDBLOCK)
                                     ? absl::StrCat("no answer within ", absl::FormatDuration(config_.timeout))
                                     : std::string(ctx->errstr));
          }
        }
        auto* r = static_cast<redisReply*>(raw);
        Reply& o = out[i];
        asking[i] = 0;
        int slot = 0;
        std::string to;
        switch (r->type) {
          case REDIS_REPLY_NIL: o.kind = Reply::Kind::kNil; break;
          case REDIS_REPLY_STRING: o.kind = Reply::Kind::kString; o.str.assign(r->str, r->len); break;
          case REDIS_REPLY_STATUS: o.kind = Reply::Kind::kStatus; o.str.assign(r->str, r->len); break;
          case REDIS_REPLY_INTEGER: o.kind = Reply::Kind::kInteger; o.integer = r->integer; break;
          case REDIS_REPLY_ERROR: {
            const absl::string_view msg(r->str, r->len);
            if (parse_redirect(msg, "MOVED", &slot, &to)) {
              if (to.front() == ':') to = absl::StrCat(address.substr(0, address.rfind(':')), to);
              slots_[size_t(slot)] = to;
              target[i] = to;
              ++moved_;
              next.push_back(i);
            } else if (parse_redirect(msg, "ASK", &slot, &to)) {
              if (to.front() == ':') to = absl::StrCat(address.substr(0, address.rfind(':')), to);
              target[i] = to;
              asking[i] = 1;
              ++asked_;
              next.push_back(i);
            } else {
              o.kind = Reply::Kind::kError;
              o.str = std::string(msg);
            }
            break;
          }
          default: o.kind = Reply::Kind::kOther; break;
        }
        freeReplyObject(r);
      }
    }
    pending = std::move(next);
  }
  return out;
}

absl::StatusOr<std::vector<RedisClient::Reply>> RedisClient::run(const std::vector<std::vector<std::string>>& commands) {
  std::vector<std::string_view> keys;
  keys.reserve(commands.size());
  for (const auto& c : commands) keys.push_back(c.size() > 1 ? std::string_view(c[1]) : std::string_view());
  return execute(keys, [&](redisContext* ctx, const std::vector<size_t>& members, const std::vector<char>& asking) {
    static const char* kAsking = "ASKING";
    static const size_t kAskingLen = 6;
    for (size_t i : members) {
      if (asking[i]) redisAppendCommandArgv(ctx, 1, &kAsking, &kAskingLen);
      std::vector<const char*> argv;
      std::vector<size_t> len;
      for (const std::string& a : commands[i]) {
        argv.push_back(a.data());
        len.push_back(a.size());
      }
      redisAppendCommandArgv(ctx, int(argv.size()), argv.data(), len.data());
    }
    return absl::OkStatus();
  });
}

absl::StatusOr<std::vector<RedisClient::Reply>> RedisClient::set(const std::vector<SetItem>& items) {
  std::vector<std::string_view> keys;
  keys.reserve(items.size());
  for (const SetItem& it : items) keys.push_back(it.key);
  return execute(keys, [&](redisContext* ctx, const std::vector<size_t>& members, const std::vector<char>& asking) {
    // The RESP of "SET key value", written with writev from where the value's parts lie: hiredis
    // would copy a large value twice into its output buffer first.
    static constexpr std::string_view kAsking = "*1\r\n$6\r\nASKING\r\n";
    static constexpr std::string_view kEnd = "\r\n";
    std::vector<std::string> prefixes;
    prefixes.reserve(members.size());
    std::vector<iovec> iov;
    auto add = [&](std::string_view part) {
      if (!part.empty()) iov.push_back({const_cast<char*>(part.data()), part.size()});
    };
    for (size_t i : members) {
      const SetItem& it = items[i];
      size_t value = 0;
      for (std::string_view part : it.value) value += part.size();
      prefixes.push_back(absl::StrCat("*3\r\n$3\r\nSET\r\n$", it.key.size(), "\r\n", it.key, "\r\n$", value, "\r\n"));
    }
    for (size_t m = 0; m < members.size(); ++m) {
      if (asking[members[m]]) add(kAsking);
      add(prefixes[m]);
      for (std::string_view part : items[members[m]].value) add(part);
      add(kEnd);
    }
    // The context's own buffer is empty (every command before went out with its replies read).
    size_t first = 0;
    while (first < iov.size()) {
      const int count = int(std::min<size_t>(iov.size() - first, IOV_MAX));
      const ssize_t w = writev(ctx->fd, iov.data() + first, count);
      if (w < 0) {
        if (errno == EINTR) continue;
        return absl::UnavailableError(errno == EAGAIN || errno == EWOULDBLOCK
                                          ? absl::StrCat("could not send within ", absl::FormatDuration(config_.timeout))
                                          : absl::StrCat("write: ", std::strerror(errno)));
      }
      size_t left = size_t(w);
      while (first < iov.size() && left >= iov[first].iov_len) left -= iov[first++].iov_len;
      if (left > 0) {
        iov[first].iov_base = static_cast<char*>(iov[first].iov_base) + left;
        iov[first].iov_len -= left;
      }
    }
    return absl::OkStatus();
  });
}

// ---- PrefixTier ----

PrefixTier::PrefixTier(const PrefixTierConfig& config, const kernels::Geometry& geometry, TierBlockSource source,
                       Metrics* metrics)
    : config_(config), geometry_(geometry), source_(std::move(source)), metrics_(metrics), pause_(config.retry_after) {}

std::unique_ptr<PrefixTier> PrefixTier::start(const PrefixTierConfig& config, const kernels::Geometry& geometry,
                                              TierBlockSource source, Metrics* metrics) {
  std::unique_ptr<PrefixTier> t(new PrefixTier(config, geometry, std::move(source), metrics));
  t->thread_ = std::thread([p = t.get()] { p->run(); });
  return t;
}

PrefixTier::~PrefixTier() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    update_flags();
  }
  thread_.join();
}

std::string PrefixTier::redis_key(const PrefixKey& key) {
  char hex[33];
  std::snprintf(hex, sizeof(hex), "%016llx%016llx", static_cast<unsigned long long>(key.hi),
                static_cast<unsigned long long>(key.lo));
  return absl::StrCat("karakv:kv1:", hex);
}

std::string PrefixTier::header(const PrefixKey& key, std::string_view payload) const {
  std::string out(kHeaderBytes, '\0');
  std::memcpy(out.data(), kMagic, 4);
  put<uint32_t>(out, 4, kFormatVersion);
  put<int32_t>(out, 8, geometry_.num_layers);
  put<int32_t>(out, 12, geometry_.num_kv_heads);
  put<int32_t>(out, 16, geometry_.head_dim);
  put<int32_t>(out, 20, geometry_.block_size);
  put<int32_t>(out, 24, static_cast<int32_t>(geometry_.dtype));
  put<uint64_t>(out, 32, key.hi);
  put<uint64_t>(out, 40, key.lo);
  put<uint64_t>(out, 48, payload.size());
  put<uint64_t>(out, 56, checksum(payload.data(), payload.size()));
  return out;
}

std::string PrefixTier::encode(const PrefixKey& key, std::string_view payload) const {
  return absl::StrCat(header(key, payload), absl::string_view(payload.data(), payload.size()));
}

bool PrefixTier::check(const PrefixKey& key, std::string_view v, std::string* why) const {
  const absl::string_view value(v.data(), v.size());
  if (value.size() < kHeaderBytes || std::memcmp(value.data(), kMagic, 4) != 0) {
    *why = absl::StrCat("not a karakv block (", value.size(), " bytes, no KKVB header)");
    return false;
  }
  if (get<uint32_t>(value, 4) != kFormatVersion) {
    *why = absl::StrCat("format version ", get<uint32_t>(value, 4), ", this karakvd reads ", kFormatVersion);
    return false;
  }
  if (get<int32_t>(value, 8) != geometry_.num_layers || get<int32_t>(value, 12) != geometry_.num_kv_heads ||
      get<int32_t>(value, 16) != geometry_.head_dim || get<int32_t>(value, 20) != geometry_.block_size ||
      get<int32_t>(value, 24) != static_cast<int32_t>(geometry_.dtype)) {
    *why = absl::StrCat("geometry layers ", get<int32_t>(value, 8), " kv_heads ", get<int32_t>(value, 12), " head_dim ",
                        get<int32_t>(value, 16), " block_size ", get<int32_t>(value, 20), " dtype ",
                        get<int32_t>(value, 24), " differs from the daemon's");
    return false;
  }
  if (get<uint64_t>(value, 32) != key.hi || get<uint64_t>(value, 40) != key.lo) {
    *why = "the header names another block";
    return false;
  }
  const uint64_t size = get<uint64_t>(value, 48);
  if (size != geometry_.block_bytes() || value.size() != kHeaderBytes + size) {
    *why = absl::StrCat("payload of ", value.size() - kHeaderBytes, " bytes (header says ", size, "), a block is ",
                        geometry_.block_bytes());
    return false;
  }
  if (checksum(value.data() + kHeaderBytes, size) != get<uint64_t>(value, 56)) {
    *why = "checksum mismatch";
    return false;
  }
  return true;
}

void PrefixTier::update_flags() {
  work_ = stop_ || !queue_.empty();
  idle_ = stop_ || (queue_.empty() && in_flight_ == 0);
}

bool PrefixTier::published(const PrefixKey& key, int32_t block) {
  absl::MutexLock lock(&mu_);
  if (stop_ || queue_.size() >= config_.max_queued_blocks) {
    write_dropped_.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  queue_.emplace_back(key, block);
  update_flags();
  return true;
}

void PrefixTier::flush() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(&idle_));
}

bool PrefixTier::paused() {
  absl::MutexLock lock(&health_mu_);
  return absl::Now() < paused_until_;
}

void PrefixTier::log_limited(const std::string& line) {
  const absl::Time now = absl::Now();
  if (now - last_log_ < kLogEvery) {
    ++unlogged_;
    return;
  }
  spdlog::warn("prefix tier: {}{}", line,
               unlogged_ > 0 ? absl::StrCat("; ", unlogged_, " more problems since the last message") : "");
  last_log_ = now;
  unlogged_ = 0;
}

void PrefixTier::failed(const absl::Status& s, const char* what) {
  errors_.fetch_add(1, std::memory_order_relaxed);
  absl::MutexLock lock(&health_mu_);
  paused_until_ = absl::Now() + pause_;
  log_limited(absl::StrCat(what, " failed: ", s.message(), "; local misses until it answers (next try in ",
                           absl::FormatDuration(pause_), ")"));
  pause_ = std::min(pause_ * 2, kMaxPause);
}

void PrefixTier::answered() {
  absl::MutexLock lock(&health_mu_);
  pause_ = config_.retry_after;
}

std::unique_ptr<RedisClient> PrefixTier::take_client() {
  {
    absl::MutexLock lock(&mu_);
    if (!idle_clients_.empty()) {
      auto c = std::move(idle_clients_.back());
      idle_clients_.pop_back();
      return c;
    }
  }
  return std::make_unique<RedisClient>(config_);
}

void PrefixTier::give_back(std::unique_ptr<RedisClient> c) {
  absl::MutexLock lock(&mu_);
  if (idle_clients_.size() < 8) idle_clients_.push_back(std::move(c));
}

std::vector<std::string> PrefixTier::fetch(const std::vector<PrefixKey>& keys) {
  std::vector<std::string> out;
  if (keys.empty()) return out;
  if (paused()) {
    skipped_.fetch_add(1, std::memory_order_relaxed);
    misses_.fetch_add(keys.size(), std::memory_order_relaxed);
    return out;
  }
  std::vector<std::vector<std::string>> commands;
  commands.reserve(keys.size());
  for (const PrefixKey& k : keys) commands.push_back({"GET", redis_key(k)});
  const absl::Time t0 = absl::Now();
  std::unique_ptr<RedisClient> client = take_client();
  auto replies = client->run(commands);
  give_back(std::move(client));
  if (metrics_ != nullptr) metrics_->prefix_tier_fetch(absl::ToDoubleSeconds(absl::Now() - t0));
  if (!replies.ok()) {
    failed(replies.status(), "a lookup");
    misses_.fetch_add(keys.size(), std::memory_order_relaxed);
    return out;
  }
  answered();
  for (size_t i = 0; i < keys.size(); ++i) {
    RedisClient::Reply& r = (*replies)[i];
    if (r.kind == RedisClient::Reply::Kind::kNil) break;
    std::string why;
    if (r.kind != RedisClient::Reply::Kind::kString) {
      failed(absl::UnavailableError(r.str), "a lookup");
      break;
    }
    if (!check(keys[i], r.str, &why)) {
      corrupt_.fetch_add(1, std::memory_order_relaxed);
      absl::MutexLock lock(&health_mu_);
      log_limited(absl::StrCat("value of ", redis_key(keys[i]), " refused (", why, "); a local miss"));
      break;
    }
    bytes_read_.fetch_add(r.str.size(), std::memory_order_relaxed);
    out.push_back(std::move((*replies)[i].str));
  }
  hits_.fetch_add(out.size(), std::memory_order_relaxed);
  misses_.fetch_add(keys.size() - out.size(), std::memory_order_relaxed);
  return out;
}

void PrefixTier::write(RedisClient& client, const std::vector<std::pair<PrefixKey, int32_t>>& batch) {
  if (paused()) {
    skipped_.fetch_add(1, std::memory_order_relaxed);
    write_dropped_.fetch_add(batch.size(), std::memory_order_relaxed);
    return;
  }
  const size_t bytes = geometry_.block_bytes();
  std::vector<std::string> copies;  // device pools: the blocks' bytes copied out
  copies.reserve(batch.size());
  std::vector<std::string> headers;
  headers.reserve(batch.size());
  std::vector<RedisClient::SetItem> items;
  for (const auto& [key, block] : batch) {
    std::string_view payload;
    if (const char* p = source_.host_block ? source_.host_block(block) : nullptr; p != nullptr) {
      payload = std::string_view(p, bytes);
    } else {
      copies.push_back(source_.copy_block ? source_.copy_block(block) : std::string());
      payload = copies.back();
    }
    if (payload.size() != bytes) {
      write_dropped_.fetch_add(1, std::memory_order_relaxed);
      continue;
    }
    headers.push_back(header(key, payload));
    items.push_back({redis_key(key), {headers.back(), payload}});
  }
  if (items.empty()) return;
  size_t value_bytes = 0;
  for (const auto& it : items) value_bytes += kHeaderBytes + it.value[1].size();
  auto replies = client.set(items);
  if (!replies.ok()) {
    failed(replies.status(), "a write");
    write_dropped_.fetch_add(items.size(), std::memory_order_relaxed);
    return;
  }
  bool error = false;
  for (const RedisClient::Reply& r : *replies) {
    if (r.kind == RedisClient::Reply::Kind::kError) {
      // OOM with maxmemory-policy noeviction, READONLY replica, NOAUTH ...: the block is not shared.
      if (!error) failed(absl::UnavailableError(r.str), "a write");
      error = true;
      write_dropped_.fetch_add(1, std::memory_order_relaxed);
      value_bytes -= kHeaderBytes + bytes;
      continue;
    }
    writes_.fetch_add(1, std::memory_order_relaxed);
  }
  bytes_written_.fetch_add(value_bytes, std::memory_order_relaxed);
  if (!error) answered();
}

void PrefixTier::run() {
  // Requests come first: on a busy node the writer gets the CPU the request threads leave (a nice
  // of 10, this thread only), and what it cannot keep up with waits in the queue or is not written.
  setpriority(PRIO_PROCESS, static_cast<id_t>(gettid()), 10);
  RedisClient client(config_);
  for (;;) {
    std::vector<std::pair<PrefixKey, int32_t>> batch;
    bool stopping = false;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(&work_));
      if (stop_) {
        stopping = true;
        write_dropped_.fetch_add(queue_.size(), std::memory_order_relaxed);
        batch.assign(queue_.begin(), queue_.end());
        queue_.clear();
        update_flags();
      } else {
        const size_t n = std::min(queue_.size(), size_t(std::max(1, config_.write_batch)));
        batch.assign(queue_.begin(), queue_.begin() + ptrdiff_t(n));
        queue_.erase(queue_.begin(), queue_.begin() + ptrdiff_t(n));
        in_flight_ = static_cast<int>(n);
        update_flags();
      }
    }
    if (!stopping) write(client, batch);
    std::vector<int32_t> blocks;
    blocks.reserve(batch.size());
    for (const auto& kb : batch) blocks.push_back(kb.second);
    if (source_.unpin && !blocks.empty()) source_.unpin(blocks);  // without mu_: it takes the core's lock
    if (stopping) return;
    absl::MutexLock lock(&mu_);
    in_flight_ = 0;
    update_flags();
  }
}

PrefixTierStats PrefixTier::stats() const {
  PrefixTierStats s;
  s.hits = hits_.load();
  s.misses = misses_.load();
  s.corrupt = corrupt_.load();
  s.errors = errors_.load();
  s.skipped = skipped_.load();
  s.writes = writes_.load();
  s.write_dropped = write_dropped_.load();
  s.bytes_read = bytes_read_.load();
  s.bytes_written = bytes_written_.load();
  return s;
}

}  // namespace karakv::server
