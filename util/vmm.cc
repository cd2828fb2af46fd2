#include "util/vmm.h"

#include "absl/strings/str_cat.h"

#if KARAKV_VMM_CUDA
#include <cuda.h>
#include <cuda_runtime.h>

#include <mutex>
#endif

namespace karakv::vmm {

#if KARAKV_VMM_CUDA

namespace {

// The driver entry points this file uses, looked up once through the runtime.
struct Driver {
  decltype(&::cuInit) init = nullptr;
  decltype(&::cuDeviceGet) device_get = nullptr;
  decltype(&::cuDevicePrimaryCtxRetain) ctx_retain = nullptr;
  decltype(&::cuDevicePrimaryCtxRelease) ctx_release = nullptr;
  decltype(&::cuCtxPushCurrent) ctx_push = nullptr;
  decltype(&::cuCtxPopCurrent) ctx_pop = nullptr;
  decltype(&::cuCtxSynchronize) ctx_sync = nullptr;
  decltype(&::cuMemGetAllocationGranularity) granularity = nullptr;
  decltype(&::cuMemCreate) create = nullptr;
  decltype(&::cuMemRelease) release = nullptr;
  decltype(&::cuMemAddressReserve) reserve = nullptr;
  decltype(&::cuMemAddressFree) address_free = nullptr;
  decltype(&::cuMemMap) map = nullptr;
  decltype(&::cuMemUnmap) unmap = nullptr;
  decltype(&::cuMemSetAccess) set_access = nullptr;
  decltype(&::cuMemsetD8) memset = nullptr;
  decltype(&::cuMemExportToShareableHandle) export_handle = nullptr;
  decltype(&::cuMemImportFromShareableHandle) import_handle = nullptr;
  decltype(&::cuGetErrorName) error_name = nullptr;
  std::string error;  // why the table is incomplete; empty when it is usable
};

template <typename F>
void lookup(const char* symbol, F* out, std::string* error) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult found{};
  const cudaError_t e = cudaGetDriverEntryPointByVersion(symbol, &p, 12000, cudaEnableDefault, &found);
  if (e != cudaSuccess || found != cudaDriverEntryPointSuccess || p == nullptr) {
    cudaGetLastError();
    if (error->empty()) {
      *error = absl::StrCat("the CUDA driver API entry point ", symbol, " is unavailable (",
                            e != cudaSuccess ? cudaGetErrorString(e) : "not found in this driver",
                            "); VMM device staging needs an NVIDIA driver for CUDA 12 or later");
    }
    return;
  }
  *out = reinterpret_cast<F>(p);
}

const Driver& driver() {
  static const Driver* d = [] {
    auto* t = new Driver;
    std::string& err = t->error;
    lookup("cuInit", &t->init, &err);
    lookup("cuDeviceGet", &t->device_get, &err);
    lookup("cuDevicePrimaryCtxRetain", &t->ctx_retain, &err);
    lookup("cuDevicePrimaryCtxRelease", &t->ctx_release, &err);
    lookup("cuCtxPushCurrent", &t->ctx_push, &err);
    lookup("cuCtxPopCurrent", &t->ctx_pop, &err);
    lookup("cuCtxSynchronize", &t->ctx_sync, &err);
    lookup("cuMemGetAllocationGranularity", &t->granularity, &err);
    lookup("cuMemCreate", &t->create, &err);
    lookup("cuMemRelease", &t->release, &err);
    lookup("cuMemAddressReserve", &t->reserve, &err);
    lookup("cuMemAddressFree", &t->address_free, &err);
    lookup("cuMemMap", &t->map, &err);
    lookup("cuMemUnmap", &t->unmap, &err);
    lookup("cuMemSetAccess", &t->set_access, &err);
    lookup("cuMemsetD8", &t->memset, &err);
    lookup("cuMemExportToShareableHandle", &t->export_handle, &err);
    lookup("cuMemImportFromShareableHandle", &t->import_handle, &err);
    lookup("cuGetErrorName", &t->error_name, &err);
    if (err.empty() && t->init(0) != CUDA_SUCCESS) err = "cuInit failed: no usable NVIDIA driver or GPU";
    return t;
  }();
  return *d;
}

std::string name(const Driver& d, CUresult r) {
  const char* s = nullptr;
  if (d.error_name != nullptr) d.error_name(r, &s);
  return s != nullptr ? s : absl::StrCat("CUresult ", static_cast<int>(r));
}

absl::Status failed(const Driver& d, const char* what, CUresult r, const std::string& context) {
  return absl::InternalError(absl::StrCat(context, ": ", what, " failed: ", name(d, r)));
}

// Makes the device's primary context (the one the CUDA runtime uses) current for a scope.
class PrimaryContext {
 public:
  PrimaryContext(const Driver& d, int device) : d_(d) {
    CUdevice dev = 0;
    result_ = d_.device_get(&dev, device);
    if (result_ == CUDA_SUCCESS) result_ = d_.ctx_retain(&ctx_, dev);
    if (result_ == CUDA_SUCCESS) {
      dev_ = dev;
      result_ = d_.ctx_push(ctx_);
      pushed_ = result_ == CUDA_SUCCESS;
    }
  }
  ~PrimaryContext() {
    if (pushed_) {
      CUcontext c = nullptr;
      d_.ctx_pop(&c);
    }
    if (ctx_ != nullptr) d_.ctx_release(dev_);
  }
  CUresult result() const { return result_; }

 private:
  const Driver& d_;
  CUcontext ctx_ = nullptr;
  CUdevice dev_ = 0;
  bool pushed_ = false;
  CUresult result_ = CUDA_SUCCESS;
};

CUmemAllocationProp properties(int device) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

// Reserves, maps and enables read-write access from `device`; on failure undoes what it did.
absl::Status map(const Driver& d, Mapping* m, const std::string& context) {
  CUdeviceptr va = 0;
  CUresult r = d.reserve(&va, m->bytes, 0, 0, 0);
  if (r != CUDA_SUCCESS) return failed(d, "cuMemAddressReserve", r, context);
  r = d.map(va, m->bytes, 0, static_cast<CUmemGenericAllocationHandle>(m->handle), 0);
  if (r != CUDA_SUCCESS) {
    d.address_free(va, m->bytes);
    return failed(d, "cuMemMap", r, context);
  }
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = m->device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  r = d.set_access(va, m->bytes, &access, 1);
  if (r != CUDA_SUCCESS) {
    d.unmap(va, m->bytes);
    d.address_free(va, m->bytes);
    return failed(d, "cuMemSetAccess", r, context);
  }
  m->ptr = reinterpret_cast<void*>(va);
  return absl::OkStatus();
}

}  // namespace

bool built_with_cuda() { return true; }

absl::StatusOr<Mapping> allocate(int device, size_t bytes) {
  const Driver& d = driver();
  const std::string context = absl::StrCat("VMM device staging (", bytes, " bytes on device ", device, ")");
  if (!d.error.empty()) return absl::FailedPreconditionError(absl::StrCat(context, ": ", d.error));
  PrimaryContext ctx(d, device);
  if (ctx.result() != CUDA_SUCCESS) return failed(d, "retaining the primary context", ctx.result(), context);
  const CUmemAllocationProp prop = properties(device);
  size_t granularity = 0;
  CUresult r = d.granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
  if (r != CUDA_SUCCESS) return failed(d, "cuMemGetAllocationGranularity", r, context);
  if (granularity == 0) granularity = size_t(2) << 20;
  Mapping m;
  m.device = device;
  m.bytes = (bytes + granularity - 1) / granularity * granularity;
  CUmemGenericAllocationHandle handle = 0;
  r = d.create(&handle, m.bytes, &prop, 0);
  if (r != CUDA_SUCCESS) {
    return absl::ResourceExhaustedError(
        absl::StrCat(context, ": cuMemCreate of ", m.bytes, " bytes failed: ", name(d, r)));
  }
  m.handle = handle;
  if (absl::Status s = map(d, &m, context); !s.ok()) {
    d.release(handle);
    return s;
  }
  r = d.memset(reinterpret_cast<CUdeviceptr>(m.ptr), 0, m.bytes);
  if (r == CUDA_SUCCESS) r = d.ctx_sync();
  if (r != CUDA_SUCCESS) {
    const absl::Status s = failed(d, "zeroing with cuMemsetD8", r, context);
    release(&m);
    return s;
  }
  return m;
}

absl::StatusOr<int> export_fd(const Mapping& m) {
  const Driver& d = driver();
  if (!d.error.empty()) return absl::FailedPreconditionError(d.error);
  PrimaryContext ctx(d, m.device);
  if (ctx.result() != CUDA_SUCCESS) {
    return failed(d, "retaining the primary context", ctx.result(), "VMM device staging");
  }
  int fd = -1;
  const CUresult r = d.export_handle(&fd, static_cast<CUmemGenericAllocationHandle>(m.handle),
                                     CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  if (r != CUDA_SUCCESS) return failed(d, "cuMemExportToShareableHandle", r, "VMM device staging");
  return fd;
}

absl::StatusOr<Mapping> import_fd(int fd, int device, size_t bytes) {
  const Driver& d = driver();
  const std::string context =
      absl::StrCat("Attach: importing the VMM device staging region (", bytes, " bytes on device ", device, ")");
  if (!d.error.empty()) return absl::FailedPreconditionError(absl::StrCat(context, ": ", d.error));
  PrimaryContext ctx(d, device);
  if (ctx.result() != CUDA_SUCCESS) return failed(d, "retaining the primary context", ctx.result(), context);
  CUmemGenericAllocationHandle handle = 0;
  const CUresult r = d.import_handle(&handle, reinterpret_cast<void*>(static_cast<intptr_t>(fd)),
                                     CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  if (r != CUDA_SUCCESS) return failed(d, "cuMemImportFromShareableHandle", r, context);
  Mapping m;
  m.device = device;
  m.bytes = bytes;
  m.handle = handle;
  if (absl::Status s = map(d, &m, context); !s.ok()) {
    d.release(handle);
    return s;
  }
  return m;
}

void release(Mapping* m) {
  if (m->handle == 0 && m->ptr == nullptr) return;
  const Driver& d = driver();
  if (d.error.empty()) {
    PrimaryContext ctx(d, m->device);
    if (m->ptr != nullptr) {
      d.unmap(reinterpret_cast<CUdeviceptr>(m->ptr), m->bytes);
      d.address_free(reinterpret_cast<CUdeviceptr>(m->ptr), m->bytes);
    }
    if (m->handle != 0) d.release(static_cast<CUmemGenericAllocationHandle>(m->handle));
  }
  *m = Mapping{};
}

#else

namespace {
absl::Status no_cuda() {
  return absl::FailedPreconditionError(
      "VMM device staging (CUDA_VMM_FD) needs a build with CUDA (nvcc found at build time); this one has none");
}
}  // namespace

bool built_with_cuda() { return false; }
absl::StatusOr<Mapping> allocate(int, size_t) { return no_cuda(); }
absl::StatusOr<int> export_fd(const Mapping&) { return no_cuda(); }
absl::StatusOr<Mapping> import_fd(int, int, size_t) { return no_cuda(); }
void release(Mapping* m) { *m = Mapping{}; }

#endif

}  // namespace karakv::vmm
