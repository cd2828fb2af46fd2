// A decode call's block tables as FlashInfer's CSR pages (kernels/cuda/flashinfer_decode.h): plain
// C++, no CUDA, so the host side of the FlashInfer route is tested where there is no GPU.
#pragma once

#include <cstdint>
#include <vector>

#include "karakv/kernels/types.h"

namespace karakv::kernels::cuda {

struct FlashInferHostPages {
  // FlashInfer's batch is the call's non-empty sequences, in order: batch b holds pages
  // indices[indptr[b] .. indptr[b + 1]), the first ceil(seq_len / block_size) block ids of its
  // table, the last one filled to last_page_len[b] in [1, block_size].
  std::vector<int32_t> indptr{0}, indices, last_page_len;
  // row_map[s]: sequence s's batch index, or -1 for an empty sequence.
  std::vector<int32_t> row_map;
  bool every_row = true;  // no sequence is empty: batch b is sequence b
  int batch() const { return int(last_page_len.size()); }
};

// kv's tables must cover each sequence's tokens (common::validate_decode).
inline FlashInferHostPages flashinfer_pages(const PagedKV& kv) {
  const int32_t b = kv.geometry.block_size;
  FlashInferHostPages p;
  p.row_map.assign(kv.num_seqs, -1);
  for (int s = 0; s < kv.num_seqs; ++s) {
    const int32_t len = kv.seq_len[s];
    if (len <= 0) {
      p.every_row = false;
      continue;
    }
    const int32_t pages = (len + b - 1) / b;
    p.row_map[s] = p.batch();
    p.indices.insert(p.indices.end(), kv.block_table + kv.table_offset[s], kv.block_table + kv.table_offset[s] + pages);
    p.indptr.push_back(p.indptr.back() + pages);
    p.last_page_len.push_back(len - (pages - 1) * b);
  }
  return p;
}

}  // namespace karakv::kernels::cuda
