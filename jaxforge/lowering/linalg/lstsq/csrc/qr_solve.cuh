// Batched least squares of small problems in one kernel, one thread block per matrix: Householder
// QR in shared memory (qr_r.cuh), then, in the same block, the solution and the full-rank
// certificate of lstsq's Gram rung (squarings 0, lowering/linalg/lstsq/xla.py), so that a batch whose every
// matrix is certified needs nothing else. Q is never formed. Framework-free: raw device pointers.
//
// Layout contract (row-major, matrices packed back to back; T real or complex as in qr_r.cuh),
// a (batch, m, n), b (batch, m, k), k >= 1, supported_solve<T>(m, n, k):
//   tall, m >= n: QR of [A | b], p = n.  r (batch, n + k, n + k): R of [A | b] as qr_r, so R of A
//     is r[:n, :n] and Qᴴb is r[:n, n:]; solution x = R⁻¹ Qᴴb.
//   wide, m < n: QR of Aᴴ, p = m.  r (batch, m, m): R of Aᴴ; solution x = Q R⁻ᴴ b, the
//     minimum-norm one, with Q applied as its reflectors H_0 ⋯ H_{m-1} to [R⁻ᴴ b; 0].
//   solution (batch, n, k): as above, where A has full rank p.
//   certified (batch,) int32: 1 where β(R) β(R⁻¹) rcond < 1, which proves s_p > rcond s_1 (numpy's
//     full rank), with β(X) = ‖XᴴX‖_F^(1/2) >= ‖X‖₂; else 0, also for NaN, Inf or a zero pivot
//     (the solution then holds whatever the divisions gave).
//
// Math: one thread per column of [y | I] solves by substitution, with y = Qᴴb (tall: R x = y,
// backward) or y = b (wide: Rᴴ z = y, forward); column t of I gives column t of R⁻¹ by backward
// substitution from row t (R⁻¹ is upper triangular). The Gram norms are taken of R and R⁻¹ scaled
// by 2^-e, e the exponent of their largest part, which is exact and keeps every product in range:
// β(X) = 2^e ‖X̂ᴴX̂‖_F^(1/2) with X̂ = 2^-e X.
//
// Shared memory: qr_r's layout for the factored matrix ([A | b], or Aᴴ), then W, p x (k + p)
// row-major: y's solutions in columns [0, k), R⁻¹ in [k, k + p); wide also Y, n x k, where Q
// is applied. The launch opts in to more than 48 KiB where needed, up to kMaxSolveBytes, which
// every supported GPU (sm_80 to sm_90a) grants.
#pragma once

#include "qr_r.cuh"

namespace jaxforge::qr_r {

constexpr int kMaxSolveBytes = 96 * 1024;
constexpr int64_t kMaxDim = 1 << 16;  // beyond any supported shape; keeps the int arithmetic exact

struct SolveLayout {
  Layout qr;
  int w_off;  // W, in elements of T from the start
  int y_off;  // Y (wide only)
  int bytes;
};

// The factored matrix: [A | b] (m x (n + k)) when tall, Aᴴ (n x m) when wide.
struct Factored {
  int rows, cols, p;
};

inline __host__ __device__ Factored factored(int m, int n, int k) {
  return m >= n ? Factored{m, n + k, n} : Factored{n, m, m};
}

template <typename T>
__host__ __device__ inline SolveLayout solve_layout(int m, int n, int k, int warps) {
  const Factored f = factored(m, n, k);
  SolveLayout l;
  l.qr = layout<T>(f.rows, f.cols, warps);
  l.w_off = l.qr.bytes / static_cast<int>(sizeof(T));
  l.y_off = l.w_off + f.p * (k + f.p);
  const int y_size = m >= n ? 0 : n * k;
  l.bytes = ((l.y_off + y_size) * static_cast<int>(sizeof(T)) + 15) & ~15;
  return l;
}

template <typename T>
inline bool supported_solve(int64_t m, int64_t n, int64_t k) {
  if (m < 1 || n < 1 || k < 1 || m > kMaxDim || n > kMaxDim || k > kMaxDim) return false;
  const Factored f = factored(static_cast<int>(m), static_cast<int>(n), static_cast<int>(k));
  return supported<T>(f.rows, f.cols) &&
         solve_layout<T>(m, n, k, warps_for(f.rows, f.cols)).bytes <= kMaxSolveBytes;
}

// Substitutes this thread's columns of W (see the header); tall: stores its solution columns.
// Returns the largest |entry| of its columns of R⁻¹ (fmax drops NaN: the Gram sums keep it).
template <typename T, bool kWide, typename R = RealOf<T>>
__device__ R substitute(const T* __restrict__ b, T* __restrict__ solution, int p, int k,
                        const SolveLayout& l, T* A) {
  const T* diag = A + l.qr.diag_off;
  T* W = A + l.w_off;
  const int ld = l.qr.ld;
  const int stride = k + p;
  R amax = R(0);
#pragma unroll 1
  for (int t = threadIdx.x; t < stride; t += blockDim.x) {
    if constexpr (kWide) {
      if (t < k) {  // Rᴴ z = b, forward; R[j, i] (j < i) is A[i * ld + j]
#pragma unroll 1
        for (int i = 0; i < p; ++i) {
          T y = b[i * k + t];
#pragma unroll 1
          for (int j = 0; j < i; ++j) y -= conjugate(A[i * ld + j]) * W[j * stride + t];
          W[i * stride + t] = y / real_part(diag[i]);
        }
        continue;
      }
    }
    const bool rhs = t < k;  // tall: R x = Qᴴb, the Qᴴb in [A | b]'s columns p + t
    const int top = rhs ? p - 1 : t - k;
#pragma unroll 1
    for (int i = p - 1; i > top; --i) W[i * stride + t] = T(0);
#pragma unroll 1
    for (int i = top; i >= 0; --i) {
      T y = rhs ? A[(p + t) * ld + i] : T(i == top ? 1 : 0);
#pragma unroll 1
      for (int j = i + 1; j <= top; ++j) y -= A[j * ld + i] * W[j * stride + t];
      const T xi = y / real_part(diag[i]);
      W[i * stride + t] = xi;
      if (rhs) {
        solution[i * k + t] = xi;
      } else {
        amax = fmax(amax, max_part(xi));
      }
    }
  }
  return amax;
}

// Wide: solution = H_0 ⋯ H_{p-1} [z; 0] for the z in W, H_j = I - tau_j v_j v_jᴴ with v_j below
// the diagonal of Aᴴ's column j (v_j[j] = 1). One warp per right-hand side; each lane keeps the
// same rows throughout, so no lane reads what another wrote.
template <typename T>
__device__ void apply_q(T* __restrict__ solution, int rows, int p, int k, const SolveLayout& l,
                        T* A) {
  const T* taus = A + l.qr.tau_off;
  const T* W = A + l.w_off;
  T* Y = A + l.y_off;
  const int ld = l.qr.ld;
  const int lane = threadIdx.x & 31;
#pragma unroll 1
  for (int t = threadIdx.x >> 5; t < k; t += blockDim.x >> 5) {  // warp-uniform
#pragma unroll 1
    for (int i = lane; i < rows; i += 32) Y[i * k + t] = i < p ? W[i * (k + p) + t] : T(0);
#pragma unroll 1
    for (int j = p - 1; j >= 0; --j) {
      const T* v = A + j * ld;
      T dot = T(0);
#pragma unroll 1
      for (int i = lane; i < rows; i += 32) {
        if (i >= j) dot += conjugate(i == j ? T(1) : v[i]) * Y[i * k + t];
      }
      const T coef = taus[j] * group_sum(dot, 32);
#pragma unroll 1
      for (int i = lane; i < rows; i += 32) {
        if (i >= j) Y[i * k + t] -= coef * (i == j ? T(1) : v[i]);
      }
    }
#pragma unroll 1
    for (int i = lane; i < rows; i += 32) solution[i * k + t] = Y[i * k + t];
  }
}

// After householder(): the solution (see the header) and whether it is certified, executed by the
// whole block; the result is block-uniform.
template <typename T, bool kWide, typename R = RealOf<T>>
__device__ bool solve_one(const T* __restrict__ b, T* __restrict__ solution, const Factored& f,
                          int k, R rcond, const SolveLayout& l, T* A) {
  R* red = reinterpret_cast<R*>(A + l.qr.red_off);
  const T* diag = A + l.qr.diag_off;
  T* W = A + l.w_off;
  const int ld = l.qr.ld;
  const int p = f.p;
  const int stride = k + p;
  const int warps = blockDim.x >> 5;

  const R amax_inv = substitute<T, kWide>(b, solution, p, k, l, A);
  R amax_r = R(0);
  for_each_row_major(p, p, [&](int, int i, int j) {
    if (j >= i) amax_r = fmax(amax_r, max_part(i == j ? diag[i] : A[j * ld + i]));
  });
  post_partials(amax_r, R(0), red);
  post_partials(amax_inv, R(0), red + 2 * warps);
  __syncthreads();  // W complete, maxima posted
  // Reads A below its diagonal and W's columns [0, k); what follows writes neither.
  if constexpr (kWide) apply_q(solution, f.rows, p, k, l, A);
  R big_r, big_inv, unused;
  read_partials(red, warps, big_r, unused);
  read_partials(red + 2 * warps, warps, big_inv, unused);
  // A zero or non-finite maximum: R is singular (a zero pivot gives R⁻¹ an Inf or NaN) or non-finite.
  if (!(big_r > R(0) && big_r <= Real<R>::kMax && big_inv > R(0) && big_inv <= Real<R>::kMax)) {
    return false;
  }
  const int e_r = exponent(big_r);  // 2^-e big in [1/2, 1)
  const int e_inv = exponent(big_inv);
  // Scale both upper triangles in place (R's diagonal into A's, where alpha is no longer needed).
  for_each_row_major(p, p, [&](int, int i, int j) {
    if (j < i) return;
    A[j * ld + i] = scale2(i == j ? diag[i] : A[j * ld + i], -e_r);
    W[i * stride + k + j] = scale2(W[i * stride + k + j], -e_inv);
  });
  __syncthreads();  // scaled; everyone is done reading red
  // ‖X̂ᴴX̂‖_F² over the entries i <= j of the Hermitian Gram, the off-diagonal ones counted twice.
  R gram_r = R(0), gram_inv = R(0);
  for_each_row_major(p, p, [&](int, int i, int j) {
    if (j < i) return;
    T g_r = T(0), g_inv = T(0);
#pragma unroll 1
    for (int h = 0; h <= i; ++h) {
      g_r += conjugate(A[i * ld + h]) * A[j * ld + h];
      g_inv += conjugate(W[h * stride + k + i]) * W[h * stride + k + j];
    }
    const R weight = i == j ? R(1) : R(2);
    gram_r += weight * abs2(g_r);
    gram_inv += weight * abs2(g_inv);
  });
  post_partials(R(0), gram_r, red);
  post_partials(R(0), gram_inv, red + 2 * warps);
  __syncthreads();
  read_partials(red, warps, unused, gram_r);
  read_partials(red + 2 * warps, warps, unused, gram_inv);
  // The scaled Grams' Frobenius norms lie in [1/16, 2p²]: their fourth roots neither over- nor
  // underflow. Overflow of the unscaled bound means "not certified", which is safe.
  const R bound = scale2(Real<R>::sqrt(Real<R>::sqrt(gram_r)) * Real<R>::sqrt(Real<R>::sqrt(gram_inv)),
                         e_r + e_inv);
  return bound * rcond < R(1);  // false for NaN
}

// Grid-stride over problems, one per block; the dynamic shared memory is solve_layout<T>(m, n, k).
template <typename T, bool kWide>
__global__ void __launch_bounds__(kMaxWarps * 32)
    qr_solve_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ r,
                    T* __restrict__ solution, int32_t* __restrict__ certified, int64_t batch, int m,
                    int n, int k, RealOf<T> rcond) {
  extern __shared__ __align__(16) unsigned char smem[];
  T* A = reinterpret_cast<T*>(smem);
  const Factored f = factored(m, n, k);
  const SolveLayout l = solve_layout<T>(m, n, k, blockDim.x >> 5);
  const int ld = l.qr.ld;
  for (int64_t i = blockIdx.x; i < batch; i += gridDim.x) {
    const T* ai = a + i * m * n;
    const T* bi = b + i * m * k;
    if constexpr (kWide) {  // Aᴴ's column j is A's row j, conjugated
      for_each_row_major(m, n, [&](int idx, int row, int col) { A[row * ld + col] = conjugate(ai[idx]); });
    } else {  // [A | b]
      for_each_row_major(m, f.cols, [&](int, int row, int col) {
        A[col * ld + row] = col < n ? ai[row * n + col] : bi[row * k + col - n];
      });
    }
    householder(f.rows, f.cols, l.qr, A);
    store_r(r + i * f.cols * f.cols, f.cols, l.qr, A);
    const bool proven = solve_one<T, kWide>(bi, solution + i * n * k, f, k, rcond, l, A);
    if (threadIdx.x == 0) certified[i] = proven;
    __syncthreads();  // the next problem overwrites shared memory others may still read
  }
}

// Enqueues the batched solve on `stream`; a is (batch, m, n), b (batch, m, k), r (batch, c, c)
// with c = n + k when m >= n, else m. Requires supported_solve<T>(m, n, k). Returns the launch
// error, cudaSuccess otherwise (also for batch == 0, which launches nothing).
template <typename T>
cudaError_t launch_solve(cudaStream_t stream, const T* a, const T* b, T* r, T* solution,
                         int32_t* certified, int64_t batch, int m, int n, int k, RealOf<T> rcond) {
  if (batch == 0) return cudaSuccess;
  const Factored f = factored(m, n, k);
  const int warps = warps_for(f.rows, f.cols);
  const SolveLayout l = solve_layout<T>(m, n, k, warps);
  const int64_t blocks = std::min<int64_t>(batch, INT32_MAX);
  const auto enqueue = [&](auto kernel) {
    cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, l.bytes);
    if (err != cudaSuccess) return err;
    JAXFORGE_LAUNCH(kernel, static_cast<unsigned>(blocks), warps * 32, l.bytes, stream)(
        a, b, r, solution, certified, batch, m, n, k, rcond);
    return cudaGetLastError();
  };
  return m >= n ? enqueue(qr_solve_kernel<T, false>) : enqueue(qr_solve_kernel<T, true>);
}

}  // namespace jaxforge::qr_r
