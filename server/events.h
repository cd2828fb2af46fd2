// The event stream (WatchEvents): what happened to a session's sequences that no reply of its own
// said (preemption, compaction, the session's end). Every stream has a bounded queue; a reader too
// slow for it loses the oldest events and is then told how many, so publishing never blocks the
// daemon (events are published under the core's lock).
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "grpcpp/grpcpp.h"
#include "karakv/v1/karakv.pb.h"
#include "server/core.h"

namespace karakv::server {

namespace v1 = ::karakv::v1;

// One subscriber's queue. Events are numbered 1, 2, ... as they are queued; an EventsDropped
// marker (number 0) comes before the first event after a loss.
class EventQueue {
 public:
  explicit EventQueue(size_t capacity) : capacity_(capacity < 1 ? 1 : capacity) {}
  void push(v1::Event event);
  std::optional<v1::Event> pop();
  size_t size() const { return events_.size(); }
  uint64_t dropped_total() const { return dropped_total_; }

 private:
  size_t capacity_;
  std::deque<v1::Event> events_;
  uint64_t next_number_ = 1;
  uint64_t dropped_ = 0;        // since the last marker
  uint64_t dropped_total_ = 0;
};

// The proto form of a core event.
v1::Event to_event(const CoreEvent& e);

class EventStream;

class EventHub {
 public:
  explicit EventHub(size_t queue_capacity = 1024) : capacity_(queue_capacity) {}

  // A server-streaming reactor for `session_id`, already subscribed; or one that finishes at once
  // with `refusal` when that is not OK.
  grpc::ServerWriteReactor<v1::Event>* open(const std::string& session_id, const grpc::Status& refusal);
  // Queues the event for every stream of its session; a SessionEnded event also ends them (OK).
  void publish(const CoreEvent& event);
  // Ends one session's streams (after what they hold is sent) with `status`.
  void close_session(const std::string& session_id, const grpc::Status& status);
  // Ends every stream with `status` and refuses new ones with it (drain).
  void close_all(const grpc::Status& status);
  int streams() const;
  uint64_t dropped_total() const;

 private:
  friend class EventStream;
  void unsubscribe(EventStream* stream);

  const size_t capacity_;
  mutable std::mutex mu_;
  std::multimap<std::string, std::shared_ptr<EventStream>> streams_;
  std::optional<grpc::Status> closed_;
  uint64_t dropped_total_ = 0;  // of streams that ended
};

}  // namespace karakv::server
