// Batched least squares of tiny tall real problems, one warp per matrix and the matrix in registers:
// no barrier but the warp's, no shared memory but one triangle. The same contract as qr_solve.cuh's
// tall case (r, solution, certified), for the shapes where a thread block per matrix leaves most of
// its threads waiting on barriers (lstsq's 8192 x 64 x 16 anchor). Framework-free: raw pointers.
//
// Limits (supported<T>): T float or double; a (batch, m, n), b (batch, m, k) with k >= 1,
// n + k <= 32 and n + k <= m <= 32 * kMaxSlots<T> (128 for float, 64 for double).
//   r (batch, c, c), c = n + k: R of [A | b], zeros below the diagonal, the diagonal real and of
//     either sign (LAPACK's dgeqr2 / dlarfg convention, as qr_r.cuh); R of A is r[:n, :n] and Qᴴb
//     is r[:n, n:].
//   solution (batch, n, k): R⁻¹ Qᴴb, where A has full rank n.
//   certified (batch,) int32: 1 where ‖R‖_F ‖R⁻¹‖_F rcond < 1, which proves s_n > rcond s_1
//     (‖X‖₂ <= ‖X‖_F); else 0, also for NaN, Inf or a zero pivot. The Frobenius bound is looser
//     than qr_solve's (within √n of the 2-norm per factor, not n^(1/4)): lstsq's rung -1; its
//     tighter rungs certify what it leaves.
//
// Layout: lane l holds rows l + 32 s (s < kSlots) of [A | b], all columns, in registers indexed by
// compile-time constants (the loops over columns are unrolled to kCols, guarded by the runtime
// count; column j is selected, not indexed). Column j's Householder step is qr_r.cuh's: a warp
// reduction for the norm (rescaled by a power of two outside [kSafeLo, kSafeHi]), the pivot
// broadcast from lane j, one reduction per trailing column for vᴴA[:, c]. The reductions
// (csrc/warp.h) leave every lane the same bits, so the branches on tau are warp-uniform. The
// triangle then goes to shared memory, and lane t solves column t of [Qᴴb | I] by back
// substitution, its unknowns in shared memory too (the identity's columns give R⁻¹), accumulating
// the Frobenius sums in double, where no square of a float overflows or underflows.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "csrc/warp.h"
#include "qr_r.cuh"

namespace jaxforge::qr_solve_warp {

using qr_r::kFullMask;
using qr_r::Real;

constexpr int kMaxCols = 32;
template <typename T>
constexpr int kMaxSlots = sizeof(T) == 4 ? 4 : 2;  // register budget: 4 x 32 floats, 2 x 32 doubles
template <typename T>
constexpr int kWarps = sizeof(T) == 4 ? 4 : 2;  // matrices per block

template <typename T>
inline bool supported(int64_t m, int64_t n, int64_t k) {
  return std::is_floating_point_v<T> && n >= 1 && k >= 1 && n + k <= kMaxCols && m >= n + k &&
         m <= 32 * kMaxSlots<T>;
}

// Shared memory of a block: each warp's triangle and unknowns, kCols x (kCols + 1) each.
template <typename T, int kCols>
constexpr int shared_bytes() {
  return kWarps<T> * 2 * kCols * (kCols + 1) * static_cast<int>(sizeof(T));
}

// Column j of this lane's rows: a select over the unrolled columns, so that x stays in registers
// while j is a runtime loop (unrolling j too would square the code and its compile time).
template <typename T, int kSlots, int kCols>
__device__ __forceinline__ T pick(const T (&x)[kSlots][kCols], int s, int j) {
  T out = x[s][0];
#pragma unroll
  for (int col = 1; col < kCols; ++col) out = col == j ? x[s][col] : out;
  return out;
}

// Householder QR of the m x c matrix in x (see the header), in place: R in the rows < c of lane
// slot 0, zeros below the diagonal.
template <typename T, int kSlots, int kCols>
__device__ __forceinline__ void householder(T (&x)[kSlots][kCols], int m, int c) {
  const int lane = threadIdx.x & 31;
#pragma unroll 1
  for (int j = 0; j < c; ++j) {
    T xj[kSlots];
    T amax = T(0), ssq = T(0);
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      const int row = lane + 32 * s;
      xj[s] = pick(x, s, j);
      if (row > j && row < m) {
        amax = fmax(amax, fabs(xj[s]));  // fmax drops NaN; ssq carries it
        ssq += xj[s] * xj[s];
      }
    }
    amax = warp_max(amax);
    T xnorm = Real<T>::sqrt(warp_sum(ssq));
    if (amax > T(0) && amax <= Real<T>::kMax && (amax < Real<T>::kSafeLo || amax > Real<T>::kSafeHi)) {
      const int e = exponent(amax);
      T scaled = T(0);
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
        const int row = lane + 32 * s;
        if (row > j && row < m) scaled += scale2(xj[s], -e) * scale2(xj[s], -e);
      }
      xnorm = scale2(Real<T>::sqrt(warp_sum(scaled)), e);
    }
    const T alpha = __shfl_sync(kFullMask, xj[0], j);  // row j < 32: lane j, slot 0
    T beta = alpha, tau = T(0);
    if (xnorm != T(0)) {  // true for NaN, which then spreads through tau
      const T h = Real<T>::hypot(alpha, xnorm);
      beta = signbit(alpha) ? h : -h;
      tau = (beta - alpha) / beta;
    }
    const T delta = alpha - beta;  // |x_i| <= xnorm <= |delta|: the divisions cannot overflow
    T v[kSlots];
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      const int row = lane + 32 * s;
      v[s] = row == j ? T(1) : (row > j && row < m && tau != T(0) ? xj[s] / delta : T(0));
    }
#pragma unroll
    for (int col = 1; col < kCols; ++col) {
      if (col <= j || col >= c || tau == T(0)) continue;  // warp-uniform
      T dot = T(0);
#pragma unroll
      for (int s = 0; s < kSlots; ++s) dot += v[s] * x[s][col];
      dot = tau * warp_sum(dot);
#pragma unroll
      for (int s = 0; s < kSlots; ++s) x[s][col] -= dot * v[s];
    }
#pragma unroll
    for (int col = 0; col < kCols; ++col) {
      if (col != j) continue;
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
        const int row = lane + 32 * s;
        x[s][col] = row == j ? beta : (row > j ? T(0) : x[s][col]);
      }
    }
  }
}

template <typename T, int kSlots, int kCols>
__global__ void __launch_bounds__(kWarps<T> * 32)
    qr_solve_warp_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ r,
                         T* __restrict__ solution, int32_t* __restrict__ certified, int64_t batch,
                         int m, int n, int k, T rcond) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  // This warp's triangle and, column t for lane t, the substitutions' unknowns.
  T(*tri)[kCols + 1] = reinterpret_cast<T(*)[kCols + 1]>(smem) + 2 * warp * kCols;
  T(*w)[kCols + 1] = tri + kCols;
  const int c = n + k;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarps<T>;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kWarps<T> + warp; i < batch; i += stride) {
    const T* ai = a + i * m * n;
    const T* bi = b + i * m * k;
    T x[kSlots][kCols];
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      const int row = lane + 32 * s;
#pragma unroll
      for (int col = 0; col < kCols; ++col) {
        x[s][col] = row < m && col < c ? (col < n ? ai[row * n + col] : bi[row * k + col - n]) : T(0);
      }
    }
    householder(x, m, c);

    T* ri = r + i * c * c;
    double r_squares = 0.0;  // this lane's row of R of A
    if (lane < c) {
#pragma unroll
      for (int col = 0; col < kCols; ++col) {
        if (col >= c) break;
        const T value = col >= lane ? x[0][col] : T(0);
        ri[lane * c + col] = value;
        tri[lane][col] = value;
        if (lane < n && col < n) r_squares += static_cast<double>(value) * value;
      }
    }
    __syncwarp();  // the triangle is in shared memory

    // Lane t < k: R x = Qᴴb's column t; lane k + t < k + n: R z = e_t, column t of R⁻¹.
    double inverse_squares = 0.0;
    if (lane < k + n) {
      const bool rhs = lane < k;
      const int top = rhs ? n - 1 : lane - k;  // R⁻¹ is upper triangular: rows > t are zero
#pragma unroll 1
      for (int row = top; row >= 0; --row) {
        T y = rhs ? tri[row][n + lane] : T(row == top ? 1 : 0);
#pragma unroll 1
        for (int col = row + 1; col <= top; ++col) y -= tri[row][col] * w[col][lane];
        const T value = y / tri[row][row];
        w[row][lane] = value;
        if (rhs) {
          solution[i * n * k + row * k + lane] = value;
        } else {
          inverse_squares += static_cast<double>(value) * value;
        }
      }
    }
    const double bound = sqrt(warp_sum(r_squares)) * sqrt(warp_sum(inverse_squares));
    if (lane == 0) certified[i] = bound * static_cast<double>(rcond) < 1.0;  // false for NaN
    __syncwarp();  // the next matrix overwrites the triangle
  }
}

// Enqueues the batched solve on `stream` with the layout of the header. Requires
// supported<T>(m, n, k). Returns the launch error, cudaSuccess otherwise (also for batch == 0).
template <typename T>
cudaError_t launch_solve(cudaStream_t stream, const T* a, const T* b, T* r, T* solution,
                         int32_t* certified, int64_t batch, int m, int n, int k, T rcond) {
  if (batch == 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((batch + kWarps<T> - 1) / kWarps<T>, INT32_MAX));
  const auto enqueue = [&](auto kernel, int bytes) {
    JAXFORGE_LAUNCH(kernel, blocks, kWarps<T> * 32, bytes, stream)(a, b, r, solution, certified, batch, m, n, k,
                                                                   rcond);
    return cudaGetLastError();
  };
  const bool narrow = n + k <= 16;
  if (m <= 64) {  // two row slots also serve m <= 32: the empty rows cost little, a kernel compiles long
    return narrow ? enqueue(qr_solve_warp_kernel<T, 2, 16>, shared_bytes<T, 16>())
                  : enqueue(qr_solve_warp_kernel<T, 2, 32>, shared_bytes<T, 32>());
  }
  if constexpr (kMaxSlots<T> == 4) {
    return narrow ? enqueue(qr_solve_warp_kernel<T, 4, 16>, shared_bytes<T, 16>())
                  : enqueue(qr_solve_warp_kernel<T, 4, 32>, shared_bytes<T, 32>());
  }
  return cudaErrorInvalidValue;
}

}  // namespace jaxforge::qr_solve_warp
