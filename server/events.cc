#include "server/events.h"

#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace karakv::server {

void EventQueue::push(v1::Event event) {
  event.set_number(next_number_++);
  if (events_.size() >= capacity_) {
    events_.pop_front();
    ++dropped_;
    ++dropped_total_;
  }
  events_.push_back(std::move(event));
}

std::optional<v1::Event> EventQueue::pop() {
  if (dropped_ > 0) {
    v1::Event marker;
    marker.set_time_unix(absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()));
    marker.mutable_dropped()->set_count(dropped_);
    dropped_ = 0;
    return marker;
  }
  if (events_.empty()) return std::nullopt;
  v1::Event e = std::move(events_.front());
  events_.pop_front();
  return e;
}

v1::Event to_event(const CoreEvent& e) {
  v1::Event out;
  out.set_time_unix(absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()));
  switch (e.kind) {
    case CoreEvent::Kind::kPreempted: {
      auto* p = out.mutable_preempted();
      p->set_sequence_id(e.sequence_id);
      p->set_reason(e.message);
      p->set_priority(e.priority);
      p->set_blocks_freed(static_cast<uint32_t>(e.blocks_freed));
      p->set_tokens_lost(static_cast<uint32_t>(e.tokens));
      break;
    }
    case CoreEvent::Kind::kCompaction: {
      auto* c = out.mutable_compaction();
      c->set_sequence_id(e.sequence_id);
      c->set_policy(e.policy);
      c->set_tokens_before(static_cast<uint32_t>(e.tokens_before));
      c->set_tokens_after(static_cast<uint32_t>(e.tokens_after));
      break;
    }
    case CoreEvent::Kind::kCompactionFailed: {
      auto* c = out.mutable_compaction_failed();
      c->set_sequence_id(e.sequence_id);
      c->set_policy(e.policy);
      c->set_reason(e.message);
      break;
    }
    case CoreEvent::Kind::kDeviceFailed:
      out.mutable_device_failed()->set_reason(e.message);
      break;
    case CoreEvent::Kind::kSessionEnded: {
      auto* s = out.mutable_session_ended();
      s->set_lease_expired(e.lease_expired);
      s->set_sequences_released(static_cast<uint32_t>(e.sequences_released));
      s->set_reason(e.message);
      break;
    }
  }
  return out;
}

// One WatchEvents call. gRPC calls are made outside mu_, and only in states where the reactor
// cannot have finished: a write starts only while none is in flight and Finish was not called.
// The hub's shared_ptr keeps the object alive after OnDone; by then it makes no more calls.
class EventStream : public grpc::ServerWriteReactor<v1::Event>,
                    public std::enable_shared_from_this<EventStream> {
 public:
  EventStream(EventHub* hub, std::string session_id, size_t capacity)
      : hub_(hub), session_id_(std::move(session_id)), queue_(capacity) {}

  const std::string& session_id() const { return session_id_; }
  void hold() { self_ = shared_from_this(); }
  // Sent once subscribed, before any event can be written: a client that waits for the initial
  // metadata knows that every later event of its session reaches it.
  void send_initial_metadata() {
    std::lock_guard<std::mutex> lock(mu_);
    StartSendInitialMetadata();
  }

  void deliver(const v1::Event& e) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (finishing_) return;
      queue_.push(e);
    }
    pump();
  }
  // Sends what is queued, then finishes with `status`.
  void close(const grpc::Status& status) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (finishing_) return;
      finishing_ = true;
      final_ = status;
    }
    pump();
  }
  uint64_t dropped_total() {
    std::lock_guard<std::mutex> lock(mu_);
    return queue_.dropped_total();
  }

  void OnWriteDone(bool ok) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      writing_ = false;
      if (!ok) {  // the reader went away: nothing more can be sent
        finishing_ = true;
        final_ = grpc::Status(grpc::StatusCode::CANCELLED, "the reader went away");
        while (queue_.pop()) {
        }
      }
    }
    pump();
  }
  void OnCancel() override { close(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled by the reader")); }
  void OnDone() override {
    hub_->unsubscribe(this);
    std::shared_ptr<EventStream> last = std::move(self_);  // may destroy this on return
  }

 private:
  void pump() {
    std::unique_lock<std::mutex> lock(mu_);
    if (writing_ || finish_called_) return;
    if (finishing_ && final_.error_code() == grpc::StatusCode::CANCELLED) {
      while (queue_.pop()) {
      }
    }
    if (std::optional<v1::Event> e = queue_.pop()) {
      current_ = std::move(*e);
      writing_ = true;
      lock.unlock();
      StartWrite(&current_);
      return;
    }
    if (finishing_) {
      finish_called_ = true;
      const grpc::Status status = final_;
      lock.unlock();
      Finish(status);
    }
  }

  EventHub* const hub_;
  const std::string session_id_;
  std::shared_ptr<EventStream> self_;
  std::mutex mu_;
  EventQueue queue_;
  v1::Event current_;
  bool writing_ = false, finishing_ = false, finish_called_ = false;
  grpc::Status final_;
};

grpc::ServerWriteReactor<v1::Event>* EventHub::open(const std::string& session_id, const grpc::Status& refusal) {
  auto stream = std::make_shared<EventStream>(this, session_id, capacity_);
  stream->hold();
  grpc::Status status = refusal;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (status.ok() && closed_) status = *closed_;
    if (status.ok()) {
      streams_.emplace(session_id, stream);
      stream->send_initial_metadata();  // under mu_: no event is delivered before it
    }
  }
  if (!status.ok()) stream->close(status);
  return stream.get();
}

void EventHub::publish(const CoreEvent& event) {
  std::vector<std::shared_ptr<EventStream>> targets;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto [begin, end] = streams_.equal_range(event.session_id);
    for (auto it = begin; it != end; ++it) targets.push_back(it->second);
  }
  if (targets.empty()) return;
  const v1::Event e = to_event(event);
  for (auto& s : targets) s->deliver(e);
  if (event.kind == CoreEvent::Kind::kSessionEnded) {
    for (auto& s : targets) s->close(grpc::Status::OK);
  }
}

void EventHub::close_session(const std::string& session_id, const grpc::Status& status) {
  std::vector<std::shared_ptr<EventStream>> targets;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto [begin, end] = streams_.equal_range(session_id);
    for (auto it = begin; it != end; ++it) targets.push_back(it->second);
  }
  for (auto& s : targets) s->close(status);
}

void EventHub::close_all(const grpc::Status& status) {
  std::vector<std::shared_ptr<EventStream>> targets;
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = status;
    for (auto& [id, s] : streams_) targets.push_back(s);
  }
  for (auto& s : targets) s->close(status);
}

int EventHub::streams() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(streams_.size());
}

uint64_t EventHub::dropped_total() const {
  std::vector<std::shared_ptr<EventStream>> live;
  uint64_t n = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    n = dropped_total_;
    for (auto& [id, s] : streams_) live.push_back(s);
  }
  for (auto& s : live) n += s->dropped_total();
  return n;
}

void EventHub::unsubscribe(EventStream* stream) {
  std::shared_ptr<EventStream> removed;  // released after the lock
  std::lock_guard<std::mutex> lock(mu_);
  auto [begin, end] = streams_.equal_range(stream->session_id());
  for (auto it = begin; it != end; ++it) {
    if (it->second.get() == stream) {
      dropped_total_ += stream->dropped_total();
      removed = std::move(it->second);
      streams_.erase(it);
      break;
    }
  }
}

}  // namespace karakv::server
