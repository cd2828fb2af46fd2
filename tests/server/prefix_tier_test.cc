// The prefix tier against real redis-server processes: the value format and its checks, writes
// and chained reads, a corrupt value, a Redis that dies and comes back, and a three-node Redis
// Cluster with MOVED and ASK redirections. Slots are checked against the cluster's own CLUSTER
// KEYSLOT.
#include "server/prefix_tier.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <random>

#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/redis_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

namespace karakv::server {
namespace {

using ::testing::HasSubstr;
using testing::RedisCluster;
using testing::RedisServer;

kernels::Geometry geometry() {
  kernels::Geometry g;
  g.num_layers = 2;
  g.num_q_heads = 4;
  g.num_kv_heads = 2;
  g.head_dim = 8;
  g.block_size = 4;
  g.dtype = kernels::DType::kFloat16;
  return g;
}

std::string block_bytes(uint32_t seed) {
  std::string b(geometry().block_bytes(), '\0');
  std::mt19937 rng(seed);
  for (char& c : b) c = static_cast<char>(rng());
  return b;
}

PrefixKey key(uint64_t i) { return PrefixKey{0x1234500000000000ull + i, 0xabcdef0000000000ull ^ (i * 7919)}; }

// A tier whose "pool" is a map from block id to bytes (a block not in it cannot be written), and
// which records the pins given back.
struct FakePool {
  absl::Mutex mu;
  std::map<int32_t, std::string> blocks;
  std::vector<int32_t> unpinned;
  TierBlockSource source(bool host = true) {
    TierBlockSource s;
    if (host) {
      s.host_block = [this](int32_t b) -> const char* {
        absl::MutexLock lock(&mu);
        return blocks.contains(b) ? blocks[b].data() : nullptr;
      };
    }
    s.copy_block = [this](int32_t b) {
      absl::MutexLock lock(&mu);
      return blocks.contains(b) ? blocks[b] : std::string();
    };
    s.unpin = [this](const std::vector<int32_t>& bs) {
      absl::MutexLock lock(&mu);
      unpinned.insert(unpinned.end(), bs.begin(), bs.end());
    };
    return s;
  }
  std::vector<int32_t> given_back() {
    absl::MutexLock lock(&mu);
    std::vector<int32_t> out = unpinned;
    std::sort(out.begin(), out.end());
    return out;
  }
};

PrefixTierConfig config_for(const std::string& address) {
  auto c = parse_prefix_tier("redis://" + address, "");
  EXPECT_TRUE(c.ok()) << c.status();
  c->timeout = absl::Milliseconds(500);  // a loaded CI machine; the daemon's default is 50 ms
  c->retry_after = absl::Milliseconds(100);
  return *c;
}

TEST(PrefixTierFormat, ParsesTheFlagAndThePasswordFileOrSaysWhatItExpected) {
  auto c = parse_prefix_tier("redis://10.0.0.1:7000,redis-b:7001", "");
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_EQ(c->seeds.size(), 2u);
  EXPECT_EQ(c->seeds[0].str(), "10.0.0.1:7000");
  EXPECT_EQ(c->seeds[1].str(), "redis-b:7001");
  EXPECT_THAT(std::string(parse_prefix_tier("10.0.0.1:7000", "").status().message()), HasSubstr("expected redis://"));
  EXPECT_THAT(std::string(parse_prefix_tier("redis://host", "").status().message()), HasSubstr("'host' is not host:port"));
  EXPECT_THAT(std::string(parse_prefix_tier("redis://", "").status().message()), HasSubstr("names no node"));
  const std::string file = "/tmp/karakv-tier-pw-" + std::to_string(getpid());
  std::ofstream(file) << "karakv s3cret\n";
  auto with_user = parse_prefix_tier("redis://h:1", file);
  ASSERT_TRUE(with_user.ok());
  EXPECT_EQ(with_user->user, "karakv");
  EXPECT_EQ(with_user->password, "s3cret");
  std::ofstream(file) << "a b c\n";
  EXPECT_THAT(std::string(parse_prefix_tier("redis://h:1", file).status().message()), HasSubstr("3 words"));
  std::remove(file.c_str());
  EXPECT_THAT(std::string(parse_prefix_tier("redis://h:1", file).status().message()), HasSubstr("cannot be read"));
}

TEST(PrefixTierFormat, ValueRoundTripsAndEveryCorruptionIsRefusedWithItsReason) {
  auto tier = PrefixTier::start(config_for("127.0.0.1:1"), geometry(), TierBlockSource{}, nullptr);
  const std::string payload = block_bytes(1);
  const std::string value = tier->encode(key(1), payload);
  ASSERT_EQ(value.size(), 64 + payload.size());
  std::string why;
  ASSERT_TRUE(tier->check(key(1), value, &why)) << why;
  EXPECT_EQ(value.substr(64), payload);
  // The header as docs/CLUSTER.md lays it out, read field by field.
  auto u32 = [&](size_t at) { uint32_t x; std::memcpy(&x, value.data() + at, 4); return x; };
  auto u64 = [&](size_t at) { uint64_t x; std::memcpy(&x, value.data() + at, 8); return x; };
  EXPECT_EQ(value.substr(0, 4), "KKVB");
  EXPECT_EQ(u32(4), 1u);
  EXPECT_EQ(u32(8), 2u);   // layers
  EXPECT_EQ(u32(12), 2u);  // kv heads
  EXPECT_EQ(u32(16), 8u);  // head_dim
  EXPECT_EQ(u32(20), 4u);  // block_size
  EXPECT_EQ(u32(24), 1u);  // fp16
  EXPECT_EQ(u32(28), 0u);
  EXPECT_EQ(u64(32), key(1).hi);
  EXPECT_EQ(u64(40), key(1).lo);
  EXPECT_EQ(u64(48), payload.size());
  EXPECT_EQ(u64(56), XXH3_64bits_withSeed(payload.data(), payload.size(), 0x6b6172616b763174ull));

  EXPECT_FALSE(tier->check(key(2), value, &why));
  EXPECT_THAT(why, HasSubstr("another block"));
  std::string flipped = value;
  flipped[100] ^= 1;
  EXPECT_FALSE(tier->check(key(1), flipped, &why));
  EXPECT_THAT(why, HasSubstr("checksum"));
  EXPECT_FALSE(tier->check(key(1), value.substr(0, value.size() - 1), &why));
  EXPECT_THAT(why, HasSubstr("payload of"));
  EXPECT_FALSE(tier->check(key(1), "garbage", &why));
  EXPECT_THAT(why, HasSubstr("not a karakv block"));
  kernels::Geometry other = geometry();
  other.head_dim = 16;
  auto other_tier = PrefixTier::start(config_for("127.0.0.1:1"), other, TierBlockSource{}, nullptr);
  EXPECT_FALSE(other_tier->check(key(1), value, &why));
  EXPECT_THAT(why, HasSubstr("head_dim 8"));
  std::string version = value;
  version[4] = 2;
  EXPECT_FALSE(tier->check(key(1), version, &why));
  EXPECT_THAT(why, HasSubstr("format version 2"));
}

TEST(PrefixTierRedis, WritesPublishedBlocksAndReadsTheLeadingChainBack) {
  RedisServer redis;
  ASSERT_TRUE(redis.ready()) << "redis-server did not start (apt install redis-server)";
  FakePool pool;
  for (int b = 0; b < 6; ++b) pool.blocks[b] = block_bytes(100 + b);
  auto tier = PrefixTier::start(config_for(redis.address()), geometry(), pool.source(), nullptr);
  for (int b = 0; b < 4; ++b) EXPECT_TRUE(tier->published(key(b), b));
  EXPECT_TRUE(tier->published(key(5), 42));  // its bytes unavailable: dropped, not written
  tier->flush();
  PrefixTierStats s = tier->stats();
  EXPECT_EQ(s.writes, 4u);
  EXPECT_EQ(s.write_dropped, 1u);
  EXPECT_EQ(s.bytes_written, 4 * (64 + geometry().block_bytes()));
  EXPECT_EQ(redis.command({"EXISTS", PrefixTier::redis_key(key(5))}), "0");
  // Every pin comes back once, written or not.
  EXPECT_EQ(pool.given_back(), (std::vector<int32_t>{0, 1, 2, 3, 42}));
  // The value in Redis is the documented header and the block, whichever way it was sent.
  EXPECT_EQ(redis.command({"GET", PrefixTier::redis_key(key(1))}), tier->encode(key(1), pool.blocks[1]));

  // Blocks 0..3 are there; 4 is not, so a chain 0..5 stops after 3 even though 5 might exist.
  std::vector<PrefixKey> chain = {key(0), key(1), key(2), key(3), key(4), key(5)};
  std::vector<std::string> got = tier->fetch(chain);
  ASSERT_EQ(got.size(), 4u);
  for (int b = 0; b < 4; ++b) EXPECT_EQ(got[size_t(b)].substr(64), pool.blocks[b]) << "block " << b;
  s = tier->stats();
  EXPECT_EQ(s.hits, 4u);
  EXPECT_EQ(s.misses, 2u);
  EXPECT_EQ(s.errors, 0u);

  // A corrupt value (a bit flipped in Redis) is a miss and a count, not a wrong block.
  std::string value = redis.command({"GET", PrefixTier::redis_key(key(2))});
  value[200] ^= 0x40;
  ASSERT_EQ(redis.command({"SET", PrefixTier::redis_key(key(2)), value}), "OK");
  got = tier->fetch(chain);
  EXPECT_EQ(got.size(), 2u);
  EXPECT_EQ(tier->stats().corrupt, 1u);
}

TEST(PrefixTierRedis, ADeadRedisIsALocalMissThenAPauseAndHitsResumeWhenItReturns) {
  auto redis = std::make_unique<RedisServer>();
  ASSERT_TRUE(redis->ready());
  const int port = redis->port();
  FakePool pool;
  pool.blocks[0] = block_bytes(7);
  auto tier = PrefixTier::start(config_for(redis->address()), geometry(), pool.source(), nullptr);
  tier->published(key(0), 0);
  tier->flush();
  ASSERT_EQ(tier->fetch({key(0)}).size(), 1u);

  redis->kill_now();
  EXPECT_TRUE(tier->fetch({key(0)}).empty());
  PrefixTierStats s = tier->stats();
  EXPECT_EQ(s.errors, 1u);
  // Paused: the next lookup is not sent at all.
  EXPECT_TRUE(tier->fetch({key(0)}).empty());
  EXPECT_EQ(tier->stats().skipped, 1u);
  EXPECT_EQ(tier->stats().errors, 1u);
  // Writes while it is down are dropped and counted, never queued forever.
  tier->published(key(0), 0);
  tier->flush();
  EXPECT_GE(tier->stats().write_dropped, 1u);

  redis = std::make_unique<RedisServer>(std::vector<std::string>{}, port);  // empty: a restarted cache
  ASSERT_TRUE(redis->ready());
  // Back after the pause (100 ms, doubling while errors go on): writes and hits resume.
  bool hit = false;
  for (int i = 0; i < 100 && !hit; ++i) {
    absl::SleepFor(absl::Milliseconds(50));
    tier->published(key(0), 0);
    tier->flush();
    hit = tier->fetch({key(0)}).size() == 1;
  }
  EXPECT_TRUE(hit) << "no hit after Redis came back";
}

TEST(PrefixTierRedis, AuthenticatesWithTheUserAndPasswordOfTheFile) {
  RedisServer redis({"--user", "default", "off", "--user", "karakv", "on", ">s3cret", "~karakv:*", "+@all"});
  ASSERT_TRUE(redis.ready());
  FakePool pool;
  pool.blocks[0] = block_bytes(9);
  PrefixTierConfig c = config_for(redis.address());
  auto tier_without = PrefixTier::start(c, geometry(), pool.source(), nullptr);
  tier_without->published(key(0), 0);
  tier_without->flush();
  EXPECT_EQ(tier_without->stats().writes, 0u);
  EXPECT_EQ(tier_without->stats().errors, 1u);  // NOAUTH
  c.user = "karakv";
  c.password = "s3cret";
  auto tier = PrefixTier::start(c, geometry(), pool.source(), nullptr);
  tier->published(key(0), 0);
  tier->flush();
  EXPECT_EQ(tier->stats().writes, 1u);
  EXPECT_EQ(tier->fetch({key(0)}).size(), 1u);
}

TEST(RedisClusterClient, SlotsMatchTheClustersOwnKeyslot) {
  RedisCluster cluster;
  ASSERT_TRUE(cluster.ready()) << "the test's Redis Cluster did not form";
  EXPECT_EQ(redis_key_slot("123456789"), 12739);  // CRC16/XMODEM check value 0x31C3
  EXPECT_EQ(redis_key_slot("{user1000}.following"), redis_key_slot("{user1000}.followers"));
  for (const std::string k : {"foo{}{bar}", "foo{{bar}}zap", "foo{bar}{zap}", "{}", "{", "}x{"}) {
    EXPECT_EQ(std::to_string(redis_key_slot(k)), cluster.node(0).command({"CLUSTER", "KEYSLOT", k})) << k;
  }
  std::mt19937_64 rng(3);
  for (int i = 0; i < 200; ++i) {
    std::string k = PrefixTier::redis_key(PrefixKey{rng(), rng()});
    if (i % 10 == 0) k = "{tag" + std::to_string(i) + "}" + k;
    EXPECT_EQ(std::to_string(redis_key_slot(k)), cluster.node(0).command({"CLUSTER", "KEYSLOT", k})) << k;
  }
}

TEST(RedisClusterClient, FollowsMovedAndAskWhileASlotMigrates) {
  RedisCluster cluster;
  ASSERT_TRUE(cluster.ready()) << "the test's Redis Cluster did not form";
  PrefixTierConfig c = config_for(cluster.node(1).address());  // one seed; the map comes from it
  RedisClient client(c);
  std::vector<std::vector<std::string>> sets, gets;
  for (int i = 0; i < 300; ++i) {
    sets.push_back({"SET", "karakv:test:" + std::to_string(i), "v" + std::to_string(i)});
    gets.push_back({"GET", "karakv:test:" + std::to_string(i)});
  }
  auto r = client.run(sets);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(client.is_cluster());
  std::vector<int> per_node(3, 0);
  for (int i = 0; i < 300; ++i) {
    const std::string k = gets[size_t(i)][1];
    const int owner = cluster.owner(redis_key_slot(k));
    ++per_node[size_t(owner)];
    EXPECT_EQ(cluster.node(owner).command({"GET", k}), "v" + std::to_string(i)) << k << " not on its slot's node";
  }
  for (int n : per_node) EXPECT_GT(n, 50);  // the keys really spread over the three nodes
  EXPECT_EQ(client.moved(), 0u);

  // MOVED: slot of key 0 moves from its node to another, behind the client's back.
  const std::string k0 = gets[0][1];
  const int slot = redis_key_slot(k0);
  const int from = cluster.owner(slot), to = (from + 1) % 3;
  const std::string from_id = cluster.id(from), to_id = cluster.id(to), s = std::to_string(slot);
  ASSERT_EQ(cluster.node(to).command({"CLUSTER", "SETSLOT", s, "IMPORTING", from_id}), "OK");
  ASSERT_EQ(cluster.node(from).command({"CLUSTER", "SETSLOT", s, "MIGRATING", to_id}), "OK");
  // ASK: a new key of the migrating slot is absent on the old owner, which sends the client on.
  std::string fresh;
  for (int i = 0; fresh.empty(); ++i) {
    const std::string k = "karakv:fresh:" + std::to_string(i);
    if (redis_key_slot(k) == slot) fresh = k;
  }
  auto asked = client.run({{"SET", fresh, "during-migration"}});
  ASSERT_TRUE(asked.ok()) << asked.status();
  EXPECT_EQ((*asked)[0].kind, RedisClient::Reply::Kind::kStatus);
  EXPECT_GE(client.asked(), 1u);
  // The old owner does not hold it (it answers its own ASK: not here, ask the importing node).
  EXPECT_THAT(cluster.node(from).command({"EXISTS", fresh}), ::testing::StartsWith("ASK "));
  // The same through the writer's path (the value's parts written with writev, ASKING first).
  const uint64_t asked_before = client.asked();
  std::string fresh2;
  for (int i = 0; fresh2.empty(); ++i) {
    const std::string k = "karakv:fresh2:" + std::to_string(i);
    if (redis_key_slot(k) == slot) fresh2 = k;
  }
  auto set = client.set({{fresh2, {"part-one|", "part-two"}}});
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ((*set)[0].kind, RedisClient::Reply::Kind::kStatus);
  EXPECT_GT(client.asked(), asked_before);
  // Move the old keys of the slot over and finish the migration on every node.
  ASSERT_EQ(cluster.node(from).command({"MIGRATE", "127.0.0.1", std::to_string(cluster.node(to).port()), k0, "0",
                                        "5000"}),
            "OK");
  for (int n = 0; n < 3; ++n) cluster.node(n).command({"CLUSTER", "SETSLOT", s, "NODE", to_id});
  auto moved = client.run({gets[0], {"GET", fresh}, {"GET", fresh2}});
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ((*moved)[0].str, "v0");
  EXPECT_EQ((*moved)[1].str, "during-migration");
  EXPECT_EQ((*moved)[2].str, "part-one|part-two");  // on the importing node: never migrated, yet there
  EXPECT_GE(client.moved(), 1u);
  EXPECT_EQ(cluster.node(to).command({"GET", k0}), "v0");
  // Every other key is still read from where it lives, in one call.
  auto all = client.run(gets);
  ASSERT_TRUE(all.ok()) << all.status();
  for (int i = 0; i < 300; ++i) EXPECT_EQ((*all)[size_t(i)].str, "v" + std::to_string(i));
}

TEST(PrefixTierRedis, AFullQueueRefusesAndEveryPinComesBackOnStop) {
  // A "Redis" that accepts connections and never answers: the writer waits out its timeout on
  // the first batch while the queue fills.
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(listen(fd, 16), 0);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len), 0);
  FakePool pool;
  for (int b = 0; b < 10; ++b) pool.blocks[b] = block_bytes(b);
  PrefixTierConfig c = config_for("127.0.0.1:" + std::to_string(ntohs(a.sin_port)));
  c.timeout = absl::Seconds(2);
  c.max_queued_blocks = 3;
  std::vector<int32_t> accepted;
  {
    auto tier = PrefixTier::start(c, geometry(), pool.source(/*host=*/false), nullptr);
    ASSERT_TRUE(tier->published(key(0), 0));
    accepted.push_back(0);
    absl::SleepFor(absl::Milliseconds(200));  // the writer takes it and waits for an answer
    for (int b = 1; b < 10; ++b) {
      if (tier->published(key(b), b)) accepted.push_back(b);
    }
    // At most the queue's 3 (and block 0 in flight, or one more if the writer had not taken it).
    EXPECT_GE(accepted.size(), 3u);
    EXPECT_LE(accepted.size(), 4u);
    EXPECT_EQ(tier->stats().write_dropped, 10u - accepted.size());
  }
  // Stopped: the tier gave back exactly the pins it had taken, written or not.
  EXPECT_EQ(pool.given_back(), accepted);
  // A lookup against it is a miss after the timeout, counted as an error; the next one is not sent.
  c.timeout = absl::Milliseconds(200);
  auto reader = PrefixTier::start(c, geometry(), pool.source(), nullptr);
  EXPECT_TRUE(reader->fetch({key(0), key(1)}).empty());
  EXPECT_EQ(reader->stats().errors, 1u);
  EXPECT_EQ(reader->stats().misses, 2u);
  EXPECT_TRUE(reader->fetch({key(0)}).empty());
  EXPECT_EQ(reader->stats().skipped, 1u);
  close(fd);
}

TEST(RedisClusterClient, TheTierWritesAndReadsBlocksAcrossTheNodes) {
  RedisCluster cluster;
  ASSERT_TRUE(cluster.ready()) << "the test's Redis Cluster did not form";
  FakePool pool;
  for (int b = 0; b < 24; ++b) pool.blocks[b] = block_bytes(300 + b);
  PrefixTierConfig c = config_for(cluster.node(2).address());
  auto tier = PrefixTier::start(c, geometry(), pool.source(), nullptr);
  std::vector<PrefixKey> chain;
  for (int b = 0; b < 24; ++b) {
    tier->published(key(b), b);
    chain.push_back(key(b));
  }
  tier->flush();
  EXPECT_EQ(tier->stats().writes, 24u);
  std::vector<std::string> got = tier->fetch(chain);
  ASSERT_EQ(got.size(), 24u);
  for (int b = 0; b < 24; ++b) EXPECT_EQ(got[size_t(b)].substr(64), pool.blocks[b]);
}

}  // namespace
}  // namespace karakv::server
