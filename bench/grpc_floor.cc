#include "grpc_floor.h"

#include <unistd.h>

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"

namespace karakv::bench {
namespace {

constexpr char kMethod[] = "/karakv.bench.Floor/Put";

// Reads the one request, replies with its size (8 bytes).
class CountingService : public grpc::CallbackGenericService {
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext*) override {
    class Reactor : public grpc::ServerGenericBidiReactor {
     public:
      Reactor() { StartRead(&in_); }
      void OnReadDone(bool ok) override {
        if (!ok) {
          Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "no request"));
          return;
        }
        std::vector<grpc::Slice> slices;
        (void)in_.Dump(&slices);
        uint64_t n = 0;
        for (const grpc::Slice& s : slices) n += s.size();
        grpc::Slice reply(&n, sizeof n);
        out_ = grpc::ByteBuffer(&reply, 1);
        StartWriteAndFinish(&out_, grpc::WriteOptions(), grpc::Status::OK);
      }
      void OnDone() override { delete this; }

     private:
      grpc::ByteBuffer in_, out_;
    };
    return new Reactor;
  }
};

}  // namespace

struct GrpcFloor::State {
  std::string path;
  CountingService service;
  std::unique_ptr<grpc::Server> server;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<grpc::GenericStub> stub;
};

GrpcFloor::GrpcFloor(std::unique_ptr<State> state) : state_(std::move(state)) {}

GrpcFloor::~GrpcFloor() {
  state_->server->Shutdown();
  unlink(state_->path.c_str());
}

absl::StatusOr<std::unique_ptr<GrpcFloor>> GrpcFloor::Start(const std::string& path) {
  auto state = std::make_unique<State>();
  state->path = path;
  const std::string target = "unix:" + path;
  // The HTTP/2 settings karakvd and the SDK use, so only the work around the transport differs.
  grpc::ServerBuilder builder;
  builder.AddListeningPort(target, grpc::InsecureServerCredentials());
  builder.RegisterCallbackGenericService(&state->service);
  builder.SetMaxReceiveMessageSize(1 << 30);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 16 << 20);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, (16 << 20) - 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_WRITE_BUFFER_SIZE, 8 << 20);
  state->server = builder.BuildAndStart();
  if (state->server == nullptr) return absl::UnavailableError(absl::StrCat("cannot serve on ", target));
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(1 << 30);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 16 << 20);
  args.SetInt(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, (16 << 20) - 1);
  args.SetInt(GRPC_ARG_HTTP2_WRITE_BUFFER_SIZE, 8 << 20);
  state->channel = grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
  state->stub = std::make_unique<grpc::GenericStub>(state->channel);
  return std::unique_ptr<GrpcFloor>(new GrpcFloor(std::move(state)));
}

absl::Status GrpcFloor::call(const void* data, size_t size) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  grpc::Slice slice(data, size, grpc::Slice::STATIC_SLICE);  // the caller's bytes, not a copy
  const grpc::ByteBuffer request(&slice, 1);
  grpc::ByteBuffer reply;
  grpc::Status status;
  grpc::CompletionQueue cq;
  {
    auto call = state_->stub->PrepareUnaryCall(&ctx, kMethod, request, &cq);
    call->StartCall();
    call->Finish(&reply, &status, nullptr);
    void* tag = nullptr;
    bool ok = false;
    cq.Next(&tag, &ok);
  }
  cq.Shutdown();
  void* tag = nullptr;
  bool ok = false;
  while (cq.Next(&tag, &ok)) {
  }
  if (!status.ok()) return absl::UnavailableError(absl::StrCat("gRPC floor call: ", status.error_message()));
  grpc::Slice flat;
  uint64_t n = 0;
  if (reply.TrySingleSlice(&flat).ok() || reply.DumpToSingleSlice(&flat).ok()) {
    if (flat.size() == sizeof n) std::memcpy(&n, flat.begin(), sizeof n);
  }
  if (n != size) return absl::InternalError(absl::StrCat("gRPC floor: server counted ", n, " bytes of ", size));
  return absl::OkStatus();
}

}  // namespace karakv::bench
