// TurboQuant's codebook, shared by every backend so that codes mean the same centroid everywhere:
// the Lloyd-Max centroids of N(0, 1) for 2, 3 and 4 bits (docs/COMPRESSION.md section 3) and the
// nearest-centroid decision thresholds between them. Plain C++17 (nvcc includes it); the CPU
// reference (cpu/quant.cc) uses the tables at compile time, the CUDA backend passes them to its
// kernels as arguments.
#pragma once

namespace karakv::kernels::common {

// Ascending: code k is entry k (code 0 is the most negative centroid).
template <int B>
struct Codebook;
template <>
struct Codebook<2> {
  static constexpr float centroid[4] = {-1.5104f, -0.4528f, 0.4528f, 1.5104f};
};
template <>
struct Codebook<3> {
  static constexpr float centroid[8] = {-2.1519f, -1.3439f, -0.7560f, -0.2451f,
                                        0.2451f,  0.7560f,  1.3439f,  2.1519f};
};
template <>
struct Codebook<4> {
  static constexpr float centroid[16] = {-2.7326f, -2.0690f, -1.6180f, -1.2562f, -0.9423f, -0.6568f,
                                         -0.3880f, -0.1284f, 0.1284f,  0.3880f,  0.6568f,  0.9423f,
                                         1.2562f,  1.6180f,  2.0690f,  2.7326f};
};

// Decision thresholds of the nearest-centroid quantizer: midpoints of adjacent centroids, in fp32.
// A coordinate u gets code = the number of thresholds it exceeds (u > threshold), so a tie goes to
// the lower centroid.
template <int B>
struct Thresholds {
  float value[(1 << B) - 1];
  constexpr Thresholds() : value() {
    for (int k = 0; k + 1 < (1 << B); ++k) value[k] = 0.5f * (Codebook<B>::centroid[k] + Codebook<B>::centroid[k + 1]);
  }
};

}  // namespace karakv::kernels::common
