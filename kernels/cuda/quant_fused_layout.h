// The fused quantized decode's launch shape and shared memory (kernels/cuda/quant.cu, "fused
// attention"): plain C++ so that the host tests can check that every format and head_dim the
// kernels take fits the shared memory a launch gets without opting in (48 KiB).
#pragma once

#include <algorithm>
#include <cstddef>

#include "../common/quant_layout.h"

namespace karakv::kernels::cuda {

constexpr int kFusedThreads = 128;
constexpr int kFusedWarps = kFusedThreads / 32;
constexpr int kFusedHeads = 8;    // query heads of one KV head per CTA (GQA groups up to 8 in one pass)
constexpr int kFusedSplit = 256;  // slots per CTA; a multiple of KIVI's 32-token key groups
constexpr int kFusedTile = 32;    // records staged at once (a warp's tokens; KIVI keys: one group)
constexpr int kFusedChannels = 4;  // value channels per thread (head_dims are multiples of 8)
static_assert(kFusedChannels == 4, "the value sums are added as float4");
static_assert(kFusedSplit % common::kKiviGroup == 0, "a split holds whole KIVI key groups");
static_assert(kFusedTile == common::kKiviGroup, "a warp's lanes are one KIVI key group's tokens");
constexpr size_t kFusedSharedLimit = 48 * 1024;  // dynamic + static, without cudaFuncSetAttribute

KARAKV_HOST_DEVICE constexpr int fused_passes(int group) { return (group + kFusedHeads - 1) / kFusedHeads; }

// Bytes of staging for kFusedTile records of `rec` bytes that may lie in as many blocks: each
// contiguous piece is copied from its 4-byte-aligned start, so it takes up to 3 bytes before and
// after its records; rounded to 16.
KARAKV_HOST_DEVICE constexpr int fused_stage_bytes(int rec) { return (kFusedTile * (rec + 8) + 15) / 16 * 16; }

// Per warp, for the keys: one KIVI key group or kFusedTile TurboQuant records.
KARAKV_HOST_DEVICE constexpr int fused_key_stage(bool kivi, int bits, int d) {
  return kivi ? (int(common::kivi_key_group_bytes(bits, d)) + 8 + 15) / 16 * 16
              : fused_stage_bytes(int(common::tq_token_bytes(bits, d)));
}
// For the CTA's values: kFusedTile records.
KARAKV_HOST_DEVICE constexpr int fused_value_stage(bool kivi, int bits, int d) {
  return fused_stage_bytes(int(kivi ? common::kivi_value_token_bytes(bits, d) : common::tq_token_bytes(bits, d)));
}

// The token groups' value sums, [head][quantized, unquantized][d] floats, added in the staging area.
KARAKV_HOST_DEVICE constexpr int fused_value_sums(int d) { return kFusedHeads * 2 * d * 4; }

// Dynamic shared memory of the fused kernel: the queries (and TurboQuant's rotations of them), the
// split's logits, and the staging (per warp for the keys; the values' records, then their sums,
// share that area).
KARAKV_HOST_DEVICE constexpr size_t fused_shared_bytes(bool kivi, int bits, int d) {
  const size_t floats = size_t(kFusedHeads) * d * (kivi ? 1 : 2) + size_t(kFusedHeads) * kFusedSplit;
  const int keys = fused_key_stage(kivi, bits, d) * kFusedWarps, values = fused_value_stage(kivi, bits, d);
  const int sums = fused_value_sums(d);
  const int stage = keys > values ? keys : values;
  return floats * sizeof(float) + size_t(stage > sums ? stage : sums);
}

// Its static shared memory: the codebook, each head's (max, sum), the values' record offsets.
constexpr size_t kFusedStaticShared = (16 + 2 * kFusedHeads + kFusedTile) * 4;

}  // namespace karakv::kernels::cuda
