// docs/COMPRESSION.md section 1's candidate selection and Token2Chunk, written as plainly as the text
// reads: the independent reference of the kernel tests (tests/kernels/compress_test.cc) and of
// Kara's end-to-end selection through the registry (tests/server/policy_test.cc).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace karakv::kernels::test {

// Token i is in the top k iff fewer than k tokens beat it (higher score, or equal score and lower
// index). Ascending by construction.
inline std::vector<int32_t> naive_top_k(const std::vector<float>& s, int k) {
  std::vector<int32_t> out;
  for (int i = 0; i < int(s.size()); ++i) {
    int beaten_by = 0;
    for (int j = 0; j < int(s.size()); ++j)
      if (s[j] > s[i] || (s[j] == s[i] && j < i)) ++beaten_by;
    if (beaten_by < k) out.push_back(i);
  }
  return out;
}

// Section 1, "Candidates" and "Token2Chunk", step by step.
inline std::vector<int32_t> naive_token2chunk(const std::vector<float>& s, int budget, int num_candidates, int max_gap) {
  const int n = int(s.size());
  const std::vector<int32_t> c = naive_top_k(s, num_candidates);  // ascending positions
  std::vector<bool> kept(n, false);
  for (int32_t x : c) kept[x] = true;
  int count = int(c.size());
  struct Chunk { double score; int left, right; bool used; };
  std::vector<Chunk> chunks;
  for (size_t m = 0; m + 1 < c.size(); ++m) {
    const int interior = c[m + 1] - c[m] - 1;
    if (interior >= 1 && interior <= max_gap)
      chunks.push_back({std::min(double(s[c[m]]), double(s[c[m + 1]])), c[m], c[m + 1], false});
  }
  // Repeatedly the best unused chunk: highest score, then lowest position.
  for (size_t round = 0; round < chunks.size(); ++round) {
    Chunk* best = nullptr;
    for (Chunk& ch : chunks)
      if (!ch.used && (best == nullptr || ch.score > best->score || (ch.score == best->score && ch.left < best->left)))
        best = &ch;
    best->used = true;
    const int size = best->right - best->left - 1;
    if (count + size <= budget) {
      for (int t = best->left + 1; t < best->right; ++t) kept[t] = true;
      count += size;
    }
  }
  // Fill one token at a time with the best not yet kept.
  while (count < budget) {
    int best = -1;
    for (int i = 0; i < n; ++i)
      if (!kept[i] && (best < 0 || s[i] > s[best])) best = i;
    kept[best] = true;
    ++count;
  }
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i)
    if (kept[i]) out.push_back(i);
  return out;
}

}  // namespace karakv::kernels::test
