// Row copies for the data-movement ops (write_kv, read_kv, gather_tokens): a row is one head_dim
// vector of one token, contiguous on both sides, and a copy moves whole rows in the widest unit
// (16, 8, 4 or 2 bytes) that the row size and every base pointer allow. Threads of a CTA split into
// row teams of one lane per unit (at most 256; lanes then take several units); teams stride over
// the rows, so the only index arithmetic is the op's once per row (32-bit), not 64-bit divisions
// per element.
//
// Rows: a functor with `static constexpr int kPairs` (copies per row: K and V) and
// `__device__ void addresses(int row, const char* (&src)[kPairs], char* (&dst)[kPairs]) const`.
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "common.cuh"

namespace karakv::kernels::cuda {

// A team of team_size lanes per row (team_size <= units_per_row; lanes loop when a row has more
// units than that).
template <typename U, typename Rows>
__global__ void copy_rows_kernel(Rows rows, int num_rows, int units_per_row, int team_size, int rows_per_block) {
  const int team = threadIdx.x / team_size, lane = threadIdx.x % team_size;
  if (team >= rows_per_block) return;
  constexpr int P = Rows::kPairs;
  for (long long r = (long long)blockIdx.x * rows_per_block + team; r < num_rows;
       r += (long long)gridDim.x * rows_per_block) {
    const char* src[P];
    char* dst[P];
    rows.addresses(int(r), src, dst);
    for (int u = lane; u < units_per_row; u += team_size) {
      U x[P];
#pragma unroll
      for (int p = 0; p < P; ++p) x[p] = reinterpret_cast<const U*>(src[p])[u];  // both loads in flight
#pragma unroll
      for (int p = 0; p < P; ++p) reinterpret_cast<U*>(dst[p])[u] = x[p];
    }
  }
}

// The widest unit dividing row_bytes and the alignment of every pointer in `bases`.
inline int copy_unit(size_t row_bytes, std::initializer_list<const void*> bases) {
  for (int unit : {16, 8, 4}) {
    bool ok = row_bytes % unit == 0;
    for (const void* p : bases) ok = ok && reinterpret_cast<uintptr_t>(p) % unit == 0;
    if (ok) return unit;
  }
  return 2;
}

template <typename U, typename Rows>
KernelStatus launch_copy_rows_as(const Rows& rows, int num_rows, size_t row_bytes, cudaStream_t stream,
                                 const char* name) {
  constexpr int kThreads = 256;
  const int units = int(row_bytes / sizeof(U));
  const int team = std::min(units, kThreads);
  const int rows_per_block = kThreads / team;
  const int blocks = int(std::min<long long>((num_rows + rows_per_block - 1) / rows_per_block, 1 << 16));
  copy_rows_kernel<U, Rows><<<blocks, kThreads, 0, stream>>>(rows, num_rows, units, team, rows_per_block);
  KARAKV_CUDA_CHECK_LAUNCH(name);
  return KernelStatus::ok();
}

// Copies num_rows rows of row_bytes each; `bases` are the pointers whose alignment bounds the unit
// (rows start at multiples of row_bytes from them).
template <typename Rows>
KernelStatus launch_copy_rows(const Rows& rows, long long num_rows, size_t row_bytes,
                              std::initializer_list<const void*> bases, cudaStream_t stream, const char* name) {
  if (num_rows <= 0) return KernelStatus::ok();
  if (num_rows > INT_MAX)
    return KernelStatus::invalid(std::string(name) + ": " + std::to_string(num_rows) + " rows exceed " +
                                 std::to_string(INT_MAX) + " in one call");
  switch (copy_unit(row_bytes, bases)) {
    case 16: return launch_copy_rows_as<uint4>(rows, int(num_rows), row_bytes, stream, name);
    case 8: return launch_copy_rows_as<uint2>(rows, int(num_rows), row_bytes, stream, name);
    case 4: return launch_copy_rows_as<uint32_t>(rows, int(num_rows), row_bytes, stream, name);
    default: return launch_copy_rows_as<uint16_t>(rows, int(num_rows), row_bytes, stream, name);
  }
}

}  // namespace karakv::kernels::cuda
