// KV-cache events over ZeroMQ in vLLM's wire format (server/kv_events.h).
#include "server/kv_events.h"

#include <algorithm>
#include <chrono>
#include <sstream>
#include <utility>

#include <msgpack.hpp>
#include <zmq.hpp>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/metrics.h"
#include "spdlog/spdlog.h"

namespace karakv::server {
namespace {

using Packer = msgpack::packer<std::stringstream>;

void pack_str(Packer& pk, const std::string& s) {
  pk.pack_str(uint32_t(s.size()));
  pk.pack_str_body(s.data(), uint32_t(s.size()));
}

void pack_hashes(Packer& pk, uint64_t hash) {
  pk.pack_array(1);
  pk.pack_uint64(hash);
}

// An event's header: a map of `fields` + 1 entries starting with "type": `name`, or an array of
// `fields` + 1 elements starting with `name` (vLLM's tag).
void begin_event(Packer& pk, bool map, const char* name, uint32_t fields) {
  if (map) {
    pk.pack_map(fields + 1);
    pack_str(pk, "type");
  } else {
    pk.pack_array(fields + 1);
  }
  pack_str(pk, name);
}

void pack_event(Packer& pk, const KvEvent& e, int block_size, const std::string& medium, bool map) {
  // A field's name, in the map encoding only (the array's order is the struct's).
  auto field = [&](const char* name) {
    if (map) pack_str(pk, name);
  };
  switch (e.kind) {
    case KvEvent::Kind::kStored:
      begin_event(pk, map, "BlockStored", 6);
      field("block_hashes");
      pack_hashes(pk, e.hash);
      field("parent_block_hash");
      if (e.parent) pk.pack_uint64(*e.parent);
      else pk.pack_nil();
      field("token_ids");
      pk.pack_array(uint32_t(e.tokens.size()));
      for (int32_t t : e.tokens) pk.pack_int32(t);
      field("block_size");
      pk.pack_int32(block_size);
      field("lora_id");
      pk.pack_nil();
      field("medium");
      pack_str(pk, medium);
      return;
    case KvEvent::Kind::kRemoved:
      begin_event(pk, map, "BlockRemoved", 2);
      field("block_hashes");
      pack_hashes(pk, e.hash);
      field("medium");
      pack_str(pk, medium);
      return;
    case KvEvent::Kind::kCleared:
      begin_event(pk, map, "AllBlocksCleared", 0);
      return;
  }
}

std::string seq_bytes(int64_t seq) {
  std::string b(8, '\0');
  const uint64_t u = uint64_t(seq);
  for (int i = 0; i < 8; ++i) b[size_t(i)] = char((u >> (56 - 8 * i)) & 0xff);
  return b;
}

}  // namespace

std::string encode_kv_event_batch(double timestamp, const std::vector<KvEvent>& events, int block_size,
                                  const std::string& medium, const std::string& encoding) {
  std::stringstream out;
  Packer pk(out);
  pk.pack_array(3);
  pk.pack_double(timestamp);
  pk.pack_array(uint32_t(events.size()));
  for (const KvEvent& e : events) pack_event(pk, e, block_size, medium, encoding == "map");
  pk.pack_nil();  // data_parallel_rank: karakvd serves one rank's cache
  return out.str();
}

struct KvEventPublisher::Sockets {
  zmq::context_t context{1};
  zmq::socket_t pub{context, zmq::socket_type::pub};
  std::optional<zmq::socket_t> replay;
};

KvEventPublisher::KvEventPublisher(const KvEventsConfig& config, int block_size, Metrics* metrics)
    : config_(config), block_size_(block_size), metrics_(metrics), sockets_(std::make_unique<Sockets>()) {}

absl::Status check_kv_events_options(const std::string& encoding, int buffer_batches) {
  if (encoding != "array" && encoding != "map") {
    return absl::InvalidArgumentError(absl::StrCat("--kv_events_encoding=", encoding, ", expected array or map"));
  }
  if (buffer_batches < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--kv_events_buffer_batches=", buffer_batches,
                                                   ", expected 0 or more batches kept for replay"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<KvEventPublisher>> KvEventPublisher::start(const KvEventsConfig& config,
                                                                          int block_size, Metrics* metrics) {
  if (absl::Status s = check_kv_events_options(config.encoding, config.buffer_batches); !s.ok()) return s;
  std::unique_ptr<KvEventPublisher> p(new KvEventPublisher(config, block_size, metrics));
  try {
    p->sockets_->pub.set(zmq::sockopt::linger, 1000);
    p->sockets_->pub.bind(config.endpoint);
  } catch (const zmq::error_t& e) {
    return absl::InvalidArgumentError(absl::StrCat("--kv_events_endpoint=", config.endpoint, ": cannot bind (",
                                                   e.what(), "); expected e.g. tcp://*:5557 or ipc:///run/karakv/kv-events"));
  }
  if (!config.replay_endpoint.empty()) {
    try {
      p->sockets_->replay.emplace(p->sockets_->context, zmq::socket_type::router);
      p->sockets_->replay->set(zmq::sockopt::linger, 0);
      p->sockets_->replay->bind(config.replay_endpoint);
    } catch (const zmq::error_t& e) {
      return absl::InvalidArgumentError(absl::StrCat("--kv_events_replay_endpoint=", config.replay_endpoint,
                                                     ": cannot bind (", e.what(), ")"));
    }
  }
  p->enqueue(KvEvent{});  // AllBlocksCleared: whatever a subscriber knew of an earlier run is gone
  p->thread_ = std::thread([raw = p.get()] { raw->run(); });
  return p;
}

KvEventPublisher::~KvEventPublisher() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

void KvEventPublisher::enqueue(KvEvent e) {
  absl::MutexLock lock(&mu_);
  if (pending_.size() >= config_.max_pending_events) {
    dropped_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  pending_.push_back(std::move(e));
}

void KvEventPublisher::stored(const PrefixKey& key, const PrefixKey& parent, absl::Span<const int32_t> tokens) {
  KvEvent e;
  e.kind = KvEvent::Kind::kStored;
  e.hash = kv_event_hash(key);
  if (!(parent == PrefixKey{})) e.parent = kv_event_hash(parent);
  e.tokens.assign(tokens.begin(), tokens.end());
  enqueue(std::move(e));
}

void KvEventPublisher::removed(const PrefixKey& key) {
  KvEvent e;
  e.kind = KvEvent::Kind::kRemoved;
  e.hash = kv_event_hash(key);
  enqueue(std::move(e));
}

void KvEventPublisher::run() {
  const auto interval = std::chrono::milliseconds(std::max<int64_t>(1, absl::ToInt64Milliseconds(config_.batch_interval)));
  absl::Time last_drop_log = absl::InfinitePast();
  uint64_t dropped_logged = 0;
  for (;;) {
    // Replay requests while waiting for the next batch.
    if (sockets_->replay) {
      zmq::pollitem_t item{sockets_->replay->handle(), 0, ZMQ_POLLIN, 0};
      zmq::poll(&item, 1, interval);
      while (true) {
        std::vector<zmq::message_t> frames;
        zmq::message_t frame;
        bool more = true;
        while (more) {
          if (!sockets_->replay->recv(frame, zmq::recv_flags::dontwait)) break;
          more = frame.more();
          frames.push_back(std::move(frame));
        }
        if (frames.empty()) break;
        if (metrics_ != nullptr) metrics_->kv_events_replay_request();
        if (frames.size() != 3 || frames[2].size() != 8) {
          spdlog::warn("kv events: a replay request of {} frames ignored; expected [identity, \"\", 8-byte sequence "
                       "number]", frames.size());
          continue;
        }
        uint64_t start = 0;
        const auto* b = static_cast<const uint8_t*>(frames[2].data());
        for (int i = 0; i < 8; ++i) start = (start << 8) | b[i];
        const std::string identity(static_cast<const char*>(frames[0].data()), frames[0].size());
        try {
          for (const auto& [seq, payload] : replay_buffer_) {
            if (seq < start) continue;
            sockets_->replay->send(zmq::buffer(identity), zmq::send_flags::sndmore);
            sockets_->replay->send(zmq::buffer(std::string()), zmq::send_flags::sndmore);
            sockets_->replay->send(zmq::buffer(seq_bytes(int64_t(seq))), zmq::send_flags::sndmore);
            sockets_->replay->send(zmq::buffer(payload), zmq::send_flags::none);
          }
          sockets_->replay->send(zmq::buffer(identity), zmq::send_flags::sndmore);
          sockets_->replay->send(zmq::buffer(std::string()), zmq::send_flags::sndmore);
          sockets_->replay->send(zmq::buffer(seq_bytes(-1)), zmq::send_flags::sndmore);
          sockets_->replay->send(zmq::buffer(std::string()), zmq::send_flags::none);
        } catch (const zmq::error_t& e) {
          spdlog::warn("kv events: replay to a subscriber failed: {}", e.what());
        }
      }
    } else {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&stop_), absl::FromChrono(interval));
    }
    std::vector<KvEvent> batch;
    bool stopping;
    {
      absl::MutexLock lock(&mu_);
      batch.swap(pending_);
      stopping = stop_;
    }
    if (!batch.empty()) {
      const double ts = absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch());
      std::string payload = encode_kv_event_batch(ts, batch, block_size_, config_.medium, config_.encoding);
      const uint64_t seq = next_seq_;
      try {
        sockets_->pub.send(zmq::buffer(config_.topic), zmq::send_flags::sndmore);
        sockets_->pub.send(zmq::buffer(seq_bytes(int64_t(seq))), zmq::send_flags::sndmore);
        sockets_->pub.send(zmq::buffer(payload), zmq::send_flags::none);
      } catch (const zmq::error_t& e) {
        spdlog::warn("kv events: publishing batch {} failed: {}", seq, e.what());
      }
      if (metrics_ != nullptr) metrics_->kv_events_published(batch.size());
      if (config_.buffer_batches > 0) {
        replay_buffer_.emplace_back(seq, std::move(payload));
        while (replay_buffer_.size() > size_t(config_.buffer_batches)) replay_buffer_.pop_front();
      }
      next_seq_ = seq + 1;
    }
    const uint64_t dropped = dropped_.load(std::memory_order_relaxed);
    if (dropped != dropped_logged) {
      if (metrics_ != nullptr) metrics_->kv_events_dropped(dropped - dropped_logged);
      if (absl::Now() - last_drop_log >= absl::Minutes(1)) {
        spdlog::warn("kv events: {} event(s) dropped in all: more than {} queued between two batches (the "
                     "publisher thread fell behind); subscribers' indexes miss them until the next restart",
                     dropped, config_.max_pending_events);
        last_drop_log = absl::Now();
      }
      dropped_logged = dropped;
    }
    if (stopping && batch.empty()) return;
  }
}

}  // namespace karakv::server
