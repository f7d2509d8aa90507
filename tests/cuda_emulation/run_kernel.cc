// Runs one of jaxforge's CUDA kernels under the host emulation (cuda_runtime.h here), through the
// kernel header's own launch(): reads the input matrices from a raw file and writes the outputs,
// back to back, to another. tests/lowering/linalg/test_kernels_emulated.py builds and drives it.
//
//   run_kernel qr_r             f32|f64|c64|c128 BATCH M C IN OUT   -> r (BATCH, C, C)
//   run_kernel qr_solve         f32|f64|c64|c128 BATCH M N IN OUT K RCOND   IN: a (BATCH, M, N), b (BATCH, M, K)
//                       -> r (BATCH, C, C), solution (BATCH, N, K), certified (BATCH,) int32
//                          with C = N + K when M >= N, else M
//   run_kernel qr_solve_warp    f32|f64 BATCH M N IN OUT K RCOND   the same, one warp per matrix (tall)
//   run_kernel svd_jacobi       f32|f64|c64|c128 BATCH M N IN OUT   -> s (BATCH, K) real, u (BATCH, M, K),
//   run_kernel svd_jacobi_lanes f32|f64 BATCH M N IN OUT      vt (BATCH, K, N), info (BATCH,) int32
//   run_kernel svd_jacobi_pairs f32|f64 BATCH M N IN OUT
//   run_kernel svd_jacobi_block f32|f64|c64|c128 BATCH M N IN OUT
//   run_kernel svd_jacobi_slots f32     BATCH M N IN OUT
//   run_kernel svd_jacobi..._values ...                           the same kernels, values alone:
//                                                                 -> s (BATCH, K), info (BATCH,)
#include "cuda_runtime.h"
#include "linalg/lstsq/csrc/qr_solve.cuh"
#include "linalg/lstsq/csrc/qr_solve_warp.cuh"
#include "linalg/svd/csrc/svd_jacobi_block.cuh"
#include "shared_memory.h"

#include <algorithm>
#include <cstdio>
#include <string>
#include <type_traits>
#include <vector>

namespace {

template <typename T>
std::vector<T> read(const char* path, size_t count) {
  std::vector<T> data(count);
  FILE* f = std::fopen(path, "rb");
  if (!f || std::fread(data.data(), sizeof(T), count, f) != count) {
    std::fprintf(stderr, "cannot read %zu values from %s\n", count, path);
    std::exit(2);
  }
  std::fclose(f);
  return data;
}

template <typename V>
void write(FILE* f, const V& values) {
  if (!values.empty()) std::fwrite(values.data(), sizeof(values[0]), values.size(), f);
}

template <typename T>
int run(const std::string& kernel, int64_t batch, int m, int n, const char* in, const char* out,
        char** extra) {
  const bool solve = kernel == "qr_solve" || kernel == "qr_solve_warp";
  const int rhs = solve ? std::stoi(extra[0]) : 0;  // b's columns, read after a
  const std::vector<T> x = read<T>(in, static_cast<size_t>(batch * m * (n + rhs)));
  FILE* f = std::fopen(out, "wb");
  if (kernel == "qr_r") {
    std::vector<T> r(static_cast<size_t>(batch * n * n));
    if (!jaxforge::qr_r::supported<T>(m, n)) return 3;
    jaxforge::qr_r::launch<T>(nullptr, x.data(), r.data(), batch, m, n);
    write(f, r);
  } else if (solve) {
    const auto rcond = static_cast<jaxforge::RealOf<T>>(std::stod(extra[1]));
    const int c = m >= n ? n + rhs : m;
    std::vector<T> r(batch * c * c), solution(batch * n * rhs);
    std::vector<int32_t> certified(batch);
    const T* a = x.data();
    const T* b = x.data() + batch * m * n;
    if (kernel == "qr_solve") {
      if (!jaxforge::qr_r::supported_solve<T>(m, n, rhs)) return 3;
      jaxforge::qr_r::launch_solve<T>(nullptr, a, b, r.data(), solution.data(), certified.data(), batch, m, n,
                                      rhs, rcond);
    } else if constexpr (std::is_floating_point_v<T>) {
      if (!jaxforge::qr_solve_warp::supported<T>(m, n, rhs)) return 3;
      jaxforge::qr_solve_warp::launch_solve<T>(nullptr, a, b, r.data(), solution.data(), certified.data(), batch,
                                               m, n, rhs, rcond);
    } else {
      return 4;
    }
    write(f, r), write(f, solution), write(f, certified);
  } else {
    const std::string values_suffix = "_values";
    const bool values = kernel.ends_with(values_suffix);
    const std::string sweeps = values ? kernel.substr(0, kernel.size() - values_suffix.size()) : kernel;
    const int k = std::min(m, n);
    std::vector<jaxforge::RealOf<T>> s(batch * k);
    std::vector<T> u(values ? 0 : batch * m * k), vt(values ? 0 : batch * k * n);
    std::vector<int32_t> info(batch);
    const auto call = [&](auto with_vectors) {
      constexpr bool kVectors = decltype(with_vectors)::value;
      using jaxforge::svd_jacobi::Sweeps;
      auto launch = jaxforge::svd_jacobi::launch<T, Sweeps::kRows, kVectors>;
      if (sweeps == "svd_jacobi_block") launch = jaxforge::svd_jacobi_block::launch<T, false, kVectors>;
      if constexpr (std::is_floating_point_v<T>) {  // the other sweeps are real only
        if (sweeps == "svd_jacobi_lanes") launch = jaxforge::svd_jacobi::launch<T, Sweeps::kLanes, kVectors>;
        if (sweeps == "svd_jacobi_pairs") launch = jaxforge::svd_jacobi::launch<T, Sweeps::kPairs, kVectors>;
      } else if (sweeps != "svd_jacobi" && sweeps != "svd_jacobi_block") {
        return false;
      }
      if constexpr (std::is_same_v<T, float>) {  // the slot sweeps are float32's
        if (sweeps == "svd_jacobi_slots") launch = jaxforge::svd_jacobi_block::launch<T, true, kVectors>;
      } else if (sweeps == "svd_jacobi_slots") {
        return false;
      }
      launch(nullptr, x.data(), s.data(), kVectors ? u.data() : nullptr, kVectors ? vt.data() : nullptr,
             info.data(), batch, m, n);
      return true;
    };
    if (!(values ? call(std::false_type()) : call(std::true_type()))) return 4;
    write(f, s), write(f, u), write(f, vt), write(f, info);  // u, vt empty for the values alone
  }
  std::fclose(f);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const bool solve = argc > 1 && (std::string(argv[1]) == "qr_solve" || std::string(argv[1]) == "qr_solve_warp");
  if (argc != (solve ? 10 : 8)) {
    std::fprintf(stderr, "usage: %s KERNEL f32|f64|c64|c128 BATCH M N IN OUT [K RCOND for qr_solve]\n", argv[0]);
    return 2;
  }
  register_shared_memory();
  const std::string kernel = argv[1], dtype = argv[2];
  const int64_t batch = std::stoll(argv[3]);
  const int m = std::stoi(argv[4]), n = std::stoi(argv[5]);
  const auto go = [&](auto zero) { return run<decltype(zero)>(kernel, batch, m, n, argv[6], argv[7], argv + 8); };
  if (dtype == "f32") return go(0.0f);
  if (dtype == "f64") return go(0.0);
  if (dtype == "c64") return go(jaxforge::Complex<float>());
  return go(jaxforge::Complex<double>());
}
