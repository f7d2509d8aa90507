// Batched least squares of small tall problems in one kernel: the Householder R of [A | b]
// (qr_r.cuh), then, in the same block and shared memory, the solution by back-substitution and the
// full-rank certificate of lstsq's first rung (lowering/linalg/lstsq/xla.py), so that a batch whose
// every matrix is certified needs nothing else. Framework-free: raw device pointers and a stream.
//
// Layout contract (row-major, matrices packed back to back):
//   x         (batch, m, c)  [A | b]: A has n columns, b has k = c - n >= 1; qr_r::supported<T>(m, c)
//   r         (batch, c, c)  R of [A | b], as qr_r: R of A is r[:n, :n], Qᵀb is r[:n, n:]
//   solution  (batch, n, k)  R⁻¹ Qᵀb, the least-squares solution where A has full column rank
//   certified (batch,) int32 1 where β(R) β(R⁻¹) rcond < 1, which proves s_n > rcond s_1 (numpy's
//                            rank n), with β(X) = ‖XᵀX‖_F^(1/2) >= ‖X‖₂; else 0, also for NaN, Inf
//                            or a zero pivot (then solution holds whatever the division gave)
//
// Math: one thread per column of [Qᵀb | I] back-substitutes Y = R X:
//   X[i] = (Y[i] - Σ_{i<j<=top} R[i,j] X[j]) / R[i,i],  i = top … 0,
// top = n - 1, or t for column t of I, whose X is zero below t (R⁻¹ is upper triangular). The Gram
// norms are taken of R and R⁻¹ scaled by 2^-e, e the exponent of their largest entry, which is
// exact and keeps every product in range: β(X) = 2^e ‖X̂ᵀX̂‖_F^(1/2) with X̂ = 2^-e X.
//
// Shared memory: qr_r's layout, then W, n x c row-major: the solution in columns [0, k), R⁻¹ in
// [k, c). Where it passes 48 KiB the launch opts in to more (at most 72 KiB + scratch).
#pragma once

#include "qr_r.cuh"

namespace jaxforge::qr_r {

struct SolveLayout {
  Layout qr;
  int w_off;  // W, in elements of T from the start
  int bytes;
};

template <typename T>
__host__ __device__ inline SolveLayout solve_layout(int m, int c, int n, int warps) {
  SolveLayout l;
  l.qr = layout<T>(m, c, warps);
  l.w_off = l.qr.bytes / static_cast<int>(sizeof(T));
  l.bytes = ((l.w_off + n * c) * static_cast<int>(sizeof(T)) + 15) & ~15;
  return l;
}

// Back-substitutes this thread's columns of W (see the header) and stores its solution columns;
// returns the largest |entry| of its columns of R⁻¹ (fmax drops NaN: the Gram sums keep it).
template <typename T>
__device__ T back_substitute(T* __restrict__ solution, int c, int n, const SolveLayout& l, T* A) {
  const T* diag = A + l.qr.diag_off;
  const int ld = l.qr.ld;
  const int k = c - n;
  T* W = A + l.w_off;
  T amax = T(0);
#pragma unroll 1
  for (int t = threadIdx.x; t < c; t += blockDim.x) {
    const bool rhs = t < k;
    const int top = rhs ? n - 1 : t - k;
#pragma unroll 1
    for (int i = n - 1; i > top; --i) W[i * c + t] = T(0);
#pragma unroll 1
    for (int i = top; i >= 0; --i) {
      T y = rhs ? A[(n + t) * ld + i] : T(i == top ? 1 : 0);
#pragma unroll 1
      for (int j = i + 1; j <= top; ++j) y -= A[j * ld + i] * W[j * c + t];
      const T xi = y / diag[i];
      W[i * c + t] = xi;
      if (rhs) {
        solution[i * k + t] = xi;
      } else {
        amax = fmax(amax, fabs(xi));
      }
    }
  }
  return amax;
}

// Whether the solution is certified (see the header); executed by the whole block after qr_one,
// whose R (A above the diagonal, diag) it reads; the result is block-uniform.
template <typename T>
__device__ bool solve_one(T* __restrict__ solution, int c, int n, T rcond, const SolveLayout& l,
                          T* A) {
  T* red = A + l.qr.red_off;
  const T* diag = A + l.qr.diag_off;
  T* W = A + l.w_off;
  const int ld = l.qr.ld;
  const int k = c - n;
  const int warps = blockDim.x >> 5;

  const T amax_inv = back_substitute(solution, c, n, l, A);
  T amax_r = T(0);
  for_each_row_major(n, n, [&](int, int i, int j) {
    if (j >= i) amax_r = fmax(amax_r, fabs(i == j ? diag[i] : A[j * ld + i]));
  });
  post_partials(amax_r, T(0), red);
  post_partials(amax_inv, T(0), red + 2 * warps);
  __syncthreads();  // W complete, maxima posted
  T big_r, big_inv, unused;
  read_partials(red, warps, big_r, unused);
  read_partials(red + 2 * warps, warps, big_inv, unused);
  // A zero or non-finite maximum: R is singular (a zero pivot gives R⁻¹ an Inf or NaN) or non-finite.
  if (!(big_r > T(0) && big_r <= Real<T>::kMax && big_inv > T(0) && big_inv <= Real<T>::kMax)) {
    return false;
  }
  const int e_r = Real<T>::ilogb(big_r) + 1;  // 2^-e big in [1/2, 1)
  const int e_inv = Real<T>::ilogb(big_inv) + 1;
  // Scale both upper triangles in place (R's diagonal into A's, where alpha is no longer needed).
  for_each_row_major(n, n, [&](int, int i, int j) {
    if (j < i) return;
    A[j * ld + i] = Real<T>::ldexp(i == j ? diag[i] : A[j * ld + i], -e_r);
    W[i * c + k + j] = Real<T>::ldexp(W[i * c + k + j], -e_inv);
  });
  __syncthreads();  // scaled; everyone is done reading red
  // ‖X̂ᵀX̂‖_F² over the entries p <= q of the symmetric Gram, the off-diagonal ones counted twice.
  T gram_r = T(0), gram_inv = T(0);
  for_each_row_major(n, n, [&](int, int p, int q) {
    if (q < p) return;
    T g_r = T(0), g_inv = T(0);
#pragma unroll 1
    for (int i = 0; i <= p; ++i) {
      g_r += A[p * ld + i] * A[q * ld + i];
      g_inv += W[i * c + k + p] * W[i * c + k + q];
    }
    const T weight = q == p ? T(1) : T(2);
    gram_r += weight * g_r * g_r;
    gram_inv += weight * g_inv * g_inv;
  });
  post_partials(T(0), gram_r, red);
  post_partials(T(0), gram_inv, red + 2 * warps);
  __syncthreads();
  read_partials(red, warps, unused, gram_r);
  read_partials(red + 2 * warps, warps, unused, gram_inv);
  // The scaled Grams' Frobenius norms lie in [1/16, n²]: their fourth roots neither over- nor
  // underflow. Overflow of the unscaled bound means "not certified", which is safe.
  const T bound = Real<T>::ldexp(Real<T>::sqrt(Real<T>::sqrt(gram_r)) *
                                     Real<T>::sqrt(Real<T>::sqrt(gram_inv)),
                                 e_r + e_inv);
  return bound * rcond < T(1);  // false for NaN
}

// Grid-stride over matrices, one per block; the dynamic shared memory is solve_layout<T>(...).
template <typename T>
__global__ void __launch_bounds__(kMaxWarps * 32)
    qr_solve_kernel(const T* __restrict__ x, T* __restrict__ r, T* __restrict__ solution,
                    int32_t* __restrict__ certified, int64_t batch, int m, int c, int n, T rcond) {
  extern __shared__ __align__(16) unsigned char smem[];
  T* A = reinterpret_cast<T*>(smem);
  const SolveLayout l = solve_layout<T>(m, c, n, blockDim.x >> 5);
  const int k = c - n;
  for (int64_t b = blockIdx.x; b < batch; b += gridDim.x) {
    qr_one(x + b * m * c, r + b * c * c, m, c, l.qr, A);
    const bool proven = solve_one(solution + b * n * k, c, n, rcond, l, A);
    if (threadIdx.x == 0) certified[b] = proven;
    __syncthreads();  // the next matrix overwrites shared memory others may still read
  }
}

// Enqueues the batched solve on `stream`. Requires supported<T>(m, c) and 1 <= n < c. Returns the
// launch error, cudaSuccess otherwise (also for batch == 0, which launches nothing).
template <typename T>
cudaError_t launch_solve(cudaStream_t stream, const T* x, T* r, T* solution, int32_t* certified,
                         int64_t batch, int m, int c, int n, T rcond) {
  if (batch == 0) return cudaSuccess;
  const int warps = std::clamp((m * c + kElemsPerWarp - 1) / kElemsPerWarp, 1, kMaxWarps);
  const SolveLayout l = solve_layout<T>(m, c, n, warps);
  constexpr auto kernel = qr_solve_kernel<T>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, l.bytes);
  if (err != cudaSuccess) return err;
  const int64_t blocks = std::min<int64_t>(batch, INT32_MAX);
  JAXFORGE_LAUNCH(kernel, static_cast<unsigned>(blocks), warps * 32, l.bytes, stream)(
      x, r, solution, certified, batch, m, c, n, rcond);
  return cudaGetLastError();
}

}  // namespace jaxforge::qr_r
