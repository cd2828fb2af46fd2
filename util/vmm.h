// CUDA VMM allocations shared by file descriptor (device staging, staging_kind CUDA_VMM_FD): the
// daemon creates one with cuMemCreate (POSIX file descriptor handles), maps it for itself and
// exports a file descriptor per importer; the worker imports that descriptor and maps it. Used by
// karakvd and by the SDK.
//
// The driver API is reached through cudaGetDriverEntryPointByVersion (the CUDA runtime, linked
// statically, loads libcuda at run time), so neither karakvd nor libkarakv_client needs libcuda
// to load on a machine without a GPU. Without CUDA at build time every call refuses, saying so.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"

namespace karakv::vmm {

struct Mapping {
  void* ptr = nullptr;  // this process's device address of the first byte
  size_t bytes = 0;     // mapped bytes (a multiple of the allocation granularity)
  int device = -1;      // CUDA device ordinal
  uint64_t handle = 0;  // CUmemGenericAllocationHandle
};

// Whether this build can make or import VMM allocations (CUDA found at build time).
bool built_with_cuda();

// karakvd: `bytes` rounded up to the device's allocation granularity, created pinned on `device`
// with POSIX file descriptor handles, reserved, mapped, readable and writable from `device`, zeroed.
absl::StatusOr<Mapping> allocate(int device, size_t bytes);
// A new file descriptor for `m` (cuMemExportToShareableHandle); the caller owns and closes it.
absl::StatusOr<int> export_fd(const Mapping& m);
// The worker: imports `fd` (cuMemImportFromShareableHandle; the caller still owns and closes
// `fd`), reserves `bytes` of address space, maps and enables access from `device`.
absl::StatusOr<Mapping> import_fd(int fd, int device, size_t bytes);
// Unmaps, frees the address range and releases the handle; *m is reset. Safe on an empty mapping.
void release(Mapping* m);

}  // namespace karakv::vmm
