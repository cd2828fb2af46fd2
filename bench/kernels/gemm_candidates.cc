// The scorers' products (docs/BENCHMARKS.md, "GEMM candidates for the scorers") timed with the
// project's code and with each packaged GEMM library found at configure time, side by side.
//
// One "layer" is what window_scores / snapkv_scores compute for one layer of one sequence: for
// every query head qh, C[M][N] = Q_qh[M][K] . K_h^T with h = qh / group, Q rows strided by
// num_q_heads * head_dim as the scorers receive them, keys pre-widened to fp32 as [K][N] (the
// head_dim-major layout the widening already produces; the widening itself is not timed here).
//
//   project    Backend::window_scores (N == M) or snapkv_scores (M obs queries, N keys) on an
//              fp32 PagedKV: the real entry point, so widening, softmax and column sums are in it,
//              once with each of its products (CpuGemm: the tile, the base of every ratio, and
//              libxsmm where the build has it)
//   tile       compress.cc's register tile (cpu::tile_product, two rows at a time): the product alone
//   naive      i-k-j triple loop
//   openblas, blis   cblas_sgemm, each dlopen'ed on its own (both export the cblas symbols)
//   eigen      Map<row-major> products
//   libxsmm    JIT kernel from libxsmm_smmdispatch, N blocked by 128
//   onednn     dnnl_sgemm
//
// Modes: 1T (one thread, serial over heads); 2T (an OpenMP team of 2 over the heads, each call
// single-threaded: how the scorers split work today); 2T-lib (serial over heads, the library's own
// 2 threads). Each product is checked against a float64 loop (max abs error).
#include <dlfcn.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cpu/compress.h"
#include "karakv/kernels/backend.h"

#if KARAKV_HAVE_EIGEN
#include <Eigen/Core>
#endif
#if KARAKV_HAVE_LIBXSMM
#include <libxsmm.h>
#endif
#if KARAKV_HAVE_ONEDNN
#include <dnnl.h>
#endif

using namespace karakv::kernels;

namespace {

struct Shape {
  const char* name;
  int hq, hkv, hd, M, N;
  double flops() const { return 2.0 * hq * M * double(N) * hd; }
};

struct Data {
  Shape s;
  std::vector<float> q;                // [M][hq][hd]
  std::vector<std::vector<float>> kt;  // per kv head [hd][N]
  std::vector<std::vector<float>> tiles;  // per kv head [N/8][hd][8]
  std::vector<float> c;                // [hq][M][N]
  std::vector<double> ref;             // [hq][M][N]
  const float* qh(int h) const { return q.data() + size_t(h) * s.hd; }
  size_t lda() const { return size_t(s.hq) * s.hd; }
  float* ch(int h) { return c.data() + size_t(h) * s.M * s.N; }
};

Data make_data(const Shape& s, std::mt19937& rng) {
  Data d;
  d.s = s;
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  d.q.resize(size_t(s.M) * s.hq * s.hd);
  for (float& x : d.q) x = u(rng);
  d.kt.resize(s.hkv);
  d.tiles.resize(s.hkv);
  for (int h = 0; h < s.hkv; ++h) {
    d.kt[h].resize(size_t(s.hd) * s.N);
    for (float& x : d.kt[h]) x = u(rng);
    d.tiles[h].resize(size_t(s.hd) * s.N);
    for (int n = 0; n < s.N; ++n)
      for (int k = 0; k < s.hd; ++k)
        d.tiles[h][size_t(n / 8) * s.hd * 8 + k * 8 + n % 8] = d.kt[h][size_t(k) * s.N + n];
  }
  d.c.assign(size_t(s.hq) * s.M * s.N, 0.0f);
  d.ref.assign(d.c.size(), 0.0);
  const int g = s.hq / s.hkv;
  for (int h = 0; h < s.hq; ++h)
    for (int m = 0; m < s.M; ++m)
      for (int k = 0; k < s.hd; ++k) {
        const double a = d.q[m * d.lda() + h * s.hd + k];
        const float* b = d.kt[h / g].data() + size_t(k) * s.N;
        double* r = d.ref.data() + (size_t(h) * s.M + m) * s.N;
        for (int n = 0; n < s.N; ++n) r[n] += a * b[n];
      }
  return d;
}

double max_err(const Data& d) {
  double e = 0;
  for (size_t i = 0; i < d.c.size(); ++i) {
    const double x = std::abs(double(d.c[i]) - d.ref[i]);
    if (!(x <= e)) e = std::isnan(x) ? INFINITY : x;  // an unwritten (NaN) element counts as infinite
  }
  return e;
}

// One product per query head: f(data, qh). `threads` 2 runs the heads on an OpenMP team.
using HeadFn = std::function<void(Data&, int)>;

void run_layer(Data& d, const HeadFn& f, int threads) {
  if (threads == 1) {
    for (int h = 0; h < d.s.hq; ++h) f(d, h);
  } else {
#pragma omp parallel for schedule(dynamic) num_threads(2)
    for (int h = 0; h < d.s.hq; ++h) f(d, h);
  }
}

// Best of `samples` of the mean over enough repeats to take ~20 ms.
double best_seconds(const std::function<void()>& f, int samples = 15) {
  using Clock = std::chrono::steady_clock;
  f();
  auto t0 = Clock::now();
  f();
  const double once = std::max(1e-7, std::chrono::duration<double>(Clock::now() - t0).count());
  const int reps = std::max(1, int(0.02 / once));
  double best = 1e30;
  for (int s = 0; s < samples; ++s) {
    t0 = Clock::now();
    for (int r = 0; r < reps; ++r) f();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count() / reps);
  }
  return best;
}

using cblas_sgemm_t = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*,
                               int);
struct Cblas {
  std::string name;
  void* handle = nullptr;
  cblas_sgemm_t sgemm = nullptr;
  std::function<void(int)> set_threads;
};

Cblas open_cblas(const char* name, const char* path, const char* set_threads_symbol) {
  Cblas c;
  c.name = name;
  c.handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (c.handle == nullptr) {
    std::fprintf(stderr, "# %s: dlopen %s failed: %s\n", name, path, dlerror());
    return c;
  }
  c.sgemm = reinterpret_cast<cblas_sgemm_t>(dlsym(c.handle, "cblas_sgemm"));
  auto* st = reinterpret_cast<void (*)(int)>(dlsym(c.handle, set_threads_symbol));
  c.set_threads = [st](int n) {
    if (st != nullptr) st(n);
  };
  return c;
}

struct Candidate {
  std::string name;
  HeadFn head;                          // one product (single-threaded library)
  std::function<void(int)> set_threads;  // library threads for 2T-lib; null: no such mode
  bool check = true;
};

}  // namespace

int main() {
  const Shape shapes[] = {
      {"kara smollm2 (9/3 heads, hd 64) 128x128", 9, 3, 64, 128, 128},
      {"kara smollm2 128x256", 9, 3, 64, 128, 256},
      {"kara smollm2 128x512", 9, 3, 64, 128, 512},
      {"kara llama8b (32/8 heads, hd 128) 128x128", 32, 8, 128, 128, 128},
      {"snapkv smollm2 32x4096", 9, 3, 64, 32, 4096},
      {"one decode query smollm2 1x1024", 9, 3, 64, 1, 1024},
  };
  std::vector<Candidate> cands;
  cands.push_back({"tile", [](Data& d, int h) {
                     // The scorers copy each query row (pre-scaled) before their product too.
                     const int g = d.s.hq / d.s.hkv;
                     static thread_local std::vector<float> q;
                     q.resize(size_t(d.s.M) * d.s.hd);
                     for (int m = 0; m < d.s.M; ++m)
                       std::memcpy(q.data() + size_t(m) * d.s.hd, d.qh(h) + m * d.lda(), d.s.hd * sizeof(float));
                     cpu::tile_product(q.data(), d.s.M, d.s.hd, d.tiles[h / g].data(), d.s.N, d.ch(h), d.s.N);
                   }, nullptr});
  cands.push_back({"naive", [](Data& d, int h) {
                     const int g = d.s.hq / d.s.hkv;
                     const int M = d.s.M, N = d.s.N, K = d.s.hd;
                     float* c = d.ch(h);
                     std::fill(c, c + size_t(M) * N, 0.0f);
                     for (int m = 0; m < M; ++m)
                       for (int k = 0; k < K; ++k) {
                         const float a = d.qh(h)[m * d.lda() + k];
                         const float* b = d.kt[h / g].data() + size_t(k) * N;
                         for (int n = 0; n < N; ++n) c[size_t(m) * N + n] += a * b[n];
                       }
                   }, nullptr});
  std::vector<Cblas> blas;
#ifdef KARAKV_OPENBLAS_LIB
  blas.push_back(open_cblas("openblas", KARAKV_OPENBLAS_LIB, "openblas_set_num_threads"));
#endif
#ifdef KARAKV_BLIS_LIB
  blas.push_back(open_cblas("blis", KARAKV_BLIS_LIB, "bli_thread_set_num_threads"));
#endif
  for (Cblas& b : blas) {
    if (b.sgemm == nullptr) continue;
    const cblas_sgemm_t sgemm = b.sgemm;
    cands.push_back({b.name, [sgemm](Data& d, int h) {
                       const int g = d.s.hq / d.s.hkv;
                       sgemm(101, 111, 111, d.s.M, d.s.N, d.s.hd, 1.0f, d.qh(h), int(d.lda()), d.kt[h / g].data(),
                             d.s.N, 0.0f, d.ch(h), d.s.N);
                     }, b.set_threads});
  }
#if KARAKV_HAVE_EIGEN
  using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  cands.push_back({"eigen", [](Data& d, int h) {
                     const int g = d.s.hq / d.s.hkv;
                     Eigen::Map<const RowMat, 0, Eigen::OuterStride<>> a(d.qh(h), d.s.M, d.s.hd,
                                                                          Eigen::OuterStride<>(d.lda()));
                     Eigen::Map<const RowMat> b(d.kt[h / g].data(), d.s.hd, d.s.N);
                     Eigen::Map<RowMat> c(d.ch(h), d.s.M, d.s.N);
                     c.noalias() = a * b;
                   }, [](int n) { Eigen::setNbThreads(n); }});
#endif
#if KARAKV_HAVE_LIBXSMM
  libxsmm_init();
  cands.push_back({"libxsmm", [](Data& d, int h) {
                     // Column-major: C^T (N x M) = K^T-as-[N x K] . Q^T-as-[K x M]; N in blocks of 128.
                     const int g = d.s.hq / d.s.hkv;
                     const libxsmm_blasint nb = std::min(d.s.N, 128), lda = d.s.N, ldb = libxsmm_blasint(d.lda()),
                                           ldc = d.s.N;
                     const float alpha = 1.0f, beta = 0.0f;  // (null beta means 1: C += A B)
                     const libxsmm_smmfunction f = libxsmm_smmdispatch(nb, d.s.M, d.s.hd, &lda, &ldb, &ldc, &alpha,
                                                                        &beta, nullptr, nullptr);
                     if (f == nullptr) {
                       std::fprintf(stderr, "libxsmm: no kernel\n");
                       std::exit(1);
                     }
                     for (int n0 = 0; n0 < d.s.N; n0 += nb) f(d.kt[h / g].data() + n0, d.qh(h), d.ch(h) + n0);
                   }, nullptr});
#endif
#if KARAKV_HAVE_ONEDNN
  cands.push_back({"onednn", [](Data& d, int h) {
                     const int g = d.s.hq / d.s.hkv;
                     dnnl_sgemm('N', 'N', d.s.M, d.s.N, d.s.hd, 1.0f, d.qh(h), dnnl_dim_t(d.lda()),
                                d.kt[h / g].data(), d.s.N, 0.0f, d.ch(h), d.s.N);
                   }, [](int n) { omp_set_num_threads(n); }});
#endif

  // The project's scorers with each of their products: the tile (the base of every ratio) and, where
  // the build has it, libxsmm (what they use by default then).
  std::string why;
  const CpuIsa isa = best_cpu_isa();
  std::unique_ptr<Backend> tile1 = make_cpu_backend(1, isa, CpuGemm::kTile, &why),
                           tile2 = make_cpu_backend(2, isa, CpuGemm::kTile, &why);
  std::unique_ptr<Backend> xsmm1 = make_cpu_backend(1, isa, CpuGemm::kLibxsmm, &why),
                           xsmm2 = make_cpu_backend(2, isa, CpuGemm::kLibxsmm, &why);
  if (xsmm1 == nullptr) std::printf("# project (libxsmm) not run: %s\n", why.c_str());
  std::mt19937 rng(7);
  std::printf("| shape | GFLOP/layer | method | 1T GFLOP/s | x project | 2T GFLOP/s | x project | 2T-lib GFLOP/s "
              "| max abs err |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|\n");
  for (const Shape& s : shapes) {
    Data d = make_data(s, rng);
    // The project's scorer on an fp32 paged cache holding N tokens of one sequence (one layer).
    Geometry geo;
    geo.num_layers = 1, geo.num_q_heads = s.hq, geo.num_kv_heads = s.hkv, geo.head_dim = s.hd, geo.block_size = 16;
    geo.dtype = DType::kFloat32;
    const int blocks = s.N / geo.block_size;
    std::vector<float> pool(size_t(blocks) * geo.block_elems());
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (float& x : pool) x = u(rng);
    std::vector<int32_t> table(blocks), offsets{0, blocks}, lens{s.N};
    for (int i = 0; i < blocks; ++i) table[i] = i;
    PagedKV kv;
    kv.pool = pool.data(), kv.geometry = geo, kv.block_table = table.data(), kv.table_offset = offsets.data();
    kv.seq_len = lens.data(), kv.num_seqs = 1;
    std::vector<float> out(size_t(s.hkv) * s.N);
    const float scale = 1.0f / std::sqrt(float(s.hd));
    auto project = [&](Backend& be) {
      const KernelStatus st = s.M == s.N ? be.window_scores(kv, 0, 0, 0, s.N, d.q.data(), scale, out.data())
                                         : be.snapkv_scores(kv, 0, 0, s.M, d.q.data(), scale, 7, out.data());
      if (!st.is_ok()) {
        std::fprintf(stderr, "project scorer: %s\n", st.message.c_str());
        std::exit(1);
      }
    };
    const double gf = s.flops() * 1e-9;
    const char* entry = s.M == s.N ? "window_scores" : "snapkv_scores";
    const double p1 = gf / best_seconds([&] { project(*tile1); });
    const double p2 = gf / best_seconds([&] { project(*tile2); });
    std::printf("| %s | %.4f | project, tile (%s) | %.1f | 1.00 | %.1f | 1.00 | - | (tests) |\n", s.name, gf, entry,
                p1, p2);
    if (xsmm1 != nullptr) {
      const double x1 = gf / best_seconds([&] { project(*xsmm1); });
      const double x2 = gf / best_seconds([&] { project(*xsmm2); });
      std::printf("| | | project, libxsmm (%s) | %.1f | %.2f | %.1f | %.2f | - | (tests) |\n", entry, x1, x1 / p1, x2,
                  x2 / p2);
    }
    for (Candidate& c : cands) {
      if (c.set_threads) c.set_threads(1);
      omp_set_num_threads(1);
#if KARAKV_HAVE_EIGEN
      Eigen::setNbThreads(1);
#endif
      std::fill(d.c.begin(), d.c.end(), NAN);
      const double t1 = gf / best_seconds([&] { run_layer(d, c.head, 1); });
      const double err = max_err(d);
      std::fill(d.c.begin(), d.c.end(), NAN);
      const double t2 = gf / best_seconds([&] { run_layer(d, c.head, 2); });
      const double err2 = max_err(d);
      char lib2[32] = "-";
      if (c.set_threads) {
        c.set_threads(2);
        omp_set_num_threads(2);
        std::fill(d.c.begin(), d.c.end(), NAN);
        std::snprintf(lib2, sizeof lib2, "%.1f", gf / best_seconds([&] { run_layer(d, c.head, 1); }));
        if (max_err(d) > std::max(err, err2)) std::snprintf(lib2 + std::strlen(lib2), 16, " (err %.1e)", max_err(d));
      }
      std::printf("| | | %s | %.1f | %.2f | %.1f | %.2f | %s | %.1e |\n", c.name.c_str(), t1, t1 / p1, t2, t2 / p2,
                  lib2, std::max(err, err2));
      std::fflush(stdout);
    }
  }
  return 0;
}
