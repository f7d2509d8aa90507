// Batched Householder QR of small tall matrices returning only the triangular factor R (Q is never
// formed), one thread block per matrix held in shared memory. Framework-free: raw device pointers
// and a CUDA stream.
//
// Layout contract (row-major, last dim contiguous, matrices packed back to back):
//   x (batch, m, c)  input, 1 <= c <= kMaxCols, m >= c, m * c * sizeof(T) <= kMaxMatrixBytes
//   r (batch, c, c)  upper-triangular R with x = Q R, exact zeros below the diagonal
//
// T is float, double or Complex<float/double> (csrc/scalar.h). Math (LAPACK zgeqr2 / zlarfg,
// dgeqr2 / dlarfg for real T): for column j, with alpha = A[j,j] and x = A[j+1:m, j],
//   xnorm = ||x||_2;  xnorm == 0 and alpha real: tau = 0, beta = alpha, no reflection (a zero
//   column divides by nothing);  otherwise beta = -sign(Re alpha) |(alpha, xnorm)| (real),
//   tau = (beta - alpha) / beta, v = [1; x / (alpha - beta)], and H = I - tau v vᴴ, whose Hᴴ maps
//   A[j:m, j] to beta e_1. Hᴴ is applied to the trailing columns as
//   A[j:m, k] -= conj(tau) (vᴴ A[j:m, k]) v. R[j,j] = beta, R[j,k>j] = A[j,k] after the updates.
//   Sign convention as geqrf: R's diagonal is real and may be negative; for a full-rank x, R is
//   unique up to the signs of its rows (phases, for complex). NaN/Inf propagate through the
//   arithmetic (no data-dependent loops).
//
// Norm: one block reduction of (max of |Re x_i|, |Im x_i|; plain sum of |x_i|² in the real type).
// Accurate whenever that maximum lies in [kSafeLo, kSafeHi] = [2^-56, 2^56] (float),
// [2^-504, 2^504] (double): at most 2m < 2^15 squares of parts <= kSafeHi cannot overflow, and
// what underflow loses (< 2^15 half ulps of the smallest subnormal in all) stays below one unit
// roundoff of the largest square. Outside that range (and finite), a second reduction sums the
// squares scaled by 2^-e, e the exponent of the maximum, as dnrm2 would.
//
// Shared memory: A column-major with leading dimension ld = m | 1. Column accesses (reductions,
// rank-1 update) are stride-1 across lanes; the odd ld makes the row-major global loads and stores,
// which walk a row of A, hit distinct banks (also for 8-byte elements, served per half-warp).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>

#include "csrc/launch.h"
#include "csrc/scalar.h"

namespace jaxforge::qr_r {

constexpr int kMaxCols = 64;
constexpr int kMaxMatrixBytes = 40960;  // with scratch, below 48 KiB for real T (complex: opt-in)
constexpr int kMaxWarps = 8;
constexpr int kElemsPerWarp = 256;  // block size heuristic: about 8 matrix elements per thread
constexpr unsigned kFullMask = 0xffffffffu;

template <typename T>
struct Real;

template <>
struct Real<float> {
  static constexpr float kMax = FLT_MAX;
  static constexpr float kSafeLo = 0x1p-56f;  // see the header comment
  static constexpr float kSafeHi = 0x1p56f;
  static __device__ float sqrt(float x) { return sqrtf(x); }
  static __device__ float hypot(float x, float y) { return hypotf(x, y); }
};

template <>
struct Real<double> {
  static constexpr double kMax = DBL_MAX;
  static constexpr double kSafeLo = 0x1p-504;
  static constexpr double kSafeHi = 0x1p504;
  static __device__ double sqrt(double x) { return ::sqrt(x); }
  static __device__ double hypot(double x, double y) { return ::hypot(x, y); }
};

// Warps of the block that factors an m x c matrix: about kElemsPerWarp elements each.
inline int warps_for(int m, int c) {
  return std::clamp((m * c + kElemsPerWarp - 1) / kElemsPerWarp, 1, kMaxWarps);
}

template <typename T>
inline bool supported(int64_t m, int64_t c) {
  return c >= 1 && c <= kMaxCols && m >= c &&
         m * c * static_cast<int64_t>(sizeof(T)) <= kMaxMatrixBytes;
}

// Dynamic shared memory of one block, offsets in elements of T.
struct Layout {
  int ld;        // leading dimension of the column-major matrix A (at 0)
  int part_off;  // warps x c partial dot products v^T A[:, k], one row per row slice
  int red_off;   // 2 slots x warps x (max |x|, sum of squares) norm partials
  int diag_off;  // c entries: beta_j, kept apart so that A[j,j] = alpha stays readable
  int tau_off;   // c entries: tau_j, for a caller that applies Q (v_j stays below A's diagonal)
  int bytes;
};

template <typename T>
__host__ __device__ inline Layout layout(int m, int c, int warps) {
  Layout l;
  l.ld = m | 1;
  l.part_off = l.ld * c;
  l.red_off = l.part_off + warps * c;
  l.diag_off = l.red_off + 4 * warps;
  l.tau_off = l.diag_off + c;
  l.bytes = ((l.tau_off + c) * static_cast<int>(sizeof(T)) + 15) & ~15;
  return l;
}

// Calls f(idx, i, j) for the row-major elements idx = i * c + j of a rows x c matrix owned by this
// thread (stride blockDim.x), stepping (i, j) without an integer division per element.
template <typename F>
__device__ __forceinline__ void for_each_row_major(int rows, int c, F f) {
  const int n = blockDim.x;
  const int di = n / c;
  const int dj = n - di * c;
  int i = threadIdx.x / c;
  int j = threadIdx.x - i * c;
  for (int idx = threadIdx.x; idx < rows * c; idx += n) {
    f(idx, i, j);
    i += di;
    j += dj;
    if (j >= c) {
      j -= c;
      ++i;
    }
  }
}

template <typename T, typename R = RealOf<T>>
__device__ __forceinline__ void accumulate(T a, R& amax, R& ssq) {
  amax = fmax(amax, max_part(a));  // fmax drops NaN, but ssq carries it
  ssq += abs2(a);
}

// This thread's share of the norm partials of col[first:m].
template <typename T, typename R = RealOf<T>>
__device__ __forceinline__ void column_partials(const T* col, int first, int m, R& amax, R& ssq) {
#pragma unroll 1
  for (int i = first + static_cast<int>(threadIdx.x); i < m; i += blockDim.x) {
    accumulate(col[i], amax, ssq);
  }
}

// Reduces each warp's partials and posts one pair per warp; every thread must call it.
template <typename T>
__device__ __forceinline__ void post_partials(T amax, T ssq, T* red) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    amax = fmax(amax, __shfl_xor_sync(kFullMask, amax, off));
    ssq += __shfl_xor_sync(kFullMask, ssq, off);
  }
  if ((threadIdx.x & 31) == 0) {
    red[2 * (threadIdx.x >> 5)] = amax;
    red[2 * (threadIdx.x >> 5) + 1] = ssq;
  }
}

// After a barrier: every thread combines the posted pairs in the same order, so all threads hold
// the same bits and the control flow derived from them is block-uniform.
template <typename T>
__device__ __forceinline__ void read_partials(const T* red, int warps, T& amax, T& ssq) {
  amax = T(0);
  ssq = T(0);
#pragma unroll 1
  for (int w = 0; w < warps; ++w) {
    amax = fmax(amax, red[2 * w]);
    ssq += red[2 * w + 1];
  }
}

// Sum over aligned groups of g lanes (g a power of two <= 32); all 32 lanes must call it.
template <typename T>
__device__ __forceinline__ T group_sum(T x, int g) {
#pragma unroll 1
  for (int off = g >> 1; off > 0; off >>= 1) x += shfl_xor(x, off);
  return x;
}

// Householder QR of the m x c matrix in A (column-major, loaded by the caller), executed by the
// whole block: R above A's diagonal and in diag, v_j below the diagonal, tau_j in tau. A column
// step costs at most three barriers: norm partials posted, v scaled, dot products posted; the next
// column's norm partials are taken during the rank-1 update, which already holds its updated
// entries in registers.
template <typename T>
__device__ void householder(int m, int c, const Layout& l, T* A) {
  using R = RealOf<T>;
  T* part = A + l.part_off;
  R* red = reinterpret_cast<R*>(A + l.red_off);  // (max |x|, sum of squares) pairs, reals
  T* diag = A + l.diag_off;
  T* taus = A + l.tau_off;
  const int ld = l.ld;
  const int tid = threadIdx.x;
  const int nthreads = blockDim.x;
  const int warps = nthreads >> 5;

  __syncthreads();  // A loaded
  {
    R amax = R(0), ssq = R(0);
    column_partials(A, 1, m, amax, ssq);
    post_partials(amax, ssq, red);
  }

#pragma unroll 1
  for (int j = 0; j < c; ++j) {
    T* const Aj = A + j * ld;
    __syncthreads();  // norm partials of column j posted; its entries final
    R amax, ssq;
    read_partials(red, warps, amax, ssq);
    R xnorm = Real<R>::sqrt(ssq);
    const bool unsafe = amax < Real<R>::kSafeLo || amax > Real<R>::kSafeHi;
    if (amax > R(0) && amax <= Real<R>::kMax && unsafe) {  // finite, nonzero, out of range
      const int e = exponent(amax);
      R scaled = R(0);
#pragma unroll 1
      for (int i = j + 1 + tid; i < m; i += nthreads) {
        scaled += abs2(scale2(Aj[i], -e));  // 2^-e itself may not be representable
      }
      post_partials(R(0), scaled, red + 2 * warps);  // second slot: others may still read the first
      __syncthreads();
      R unused;
      read_partials(red + 2 * warps, warps, unused, scaled);
      xnorm = scale2(Real<R>::sqrt(scaled), e);
    }
    const T alpha = Aj[j];
    R beta = real_part(alpha);
    T tau = T(0);
    if (xnorm != R(0) || imag_part(alpha) != R(0)) {  // true for NaN, which then spreads via tau
      const R h = Real<R>::hypot(magnitude(alpha), xnorm);
      beta = signbit(real_part(alpha)) ? h : -h;
      tau = (T(beta) - alpha) / beta;
    }
    if (tid == 0) {
      diag[j] = T(beta);
      taus[j] = tau;
    }
    const bool reflect = nonzero(tau);
    if (reflect) {
      // |x_i| <= xnorm <= |alpha - beta|: dividing cannot overflow where a reciprocal could.
      const T delta = alpha - T(beta);
#pragma unroll 1
      for (int i = j + 1 + tid; i < m; i += nthreads) Aj[i] /= delta;
    }
    const int nt = c - 1 - j;  // trailing columns
    if (nt == 0) break;  // the last v is kept too, for a caller that applies Q
    __syncthreads();  // v complete; everyone is done reading red, which is posted to again below

    R amax_next = R(0), ssq_next = R(0);
    if (!reflect) {
      column_partials(Aj + ld, j + 2, m, amax_next, ssq_next);
    } else {
      // Work items are (trailing column k, row slice s), each owned by a group of g lanes that
      // strides over the slice's rows: g shrinks with the active rows so that short columns keep
      // the lanes busy, and S slices per column keep all warps busy when few columns remain.
      const int rows = m - j;
      const int g = rows >= 32 ? 32 : 1 << (32 - __clz(rows - 1));
      const int groups = nthreads / g;
      const int slices = max(1, min(groups / nt, (rows + g - 1) / g));
      const int items = nt * slices;
      const int gid = tid / g;
      const int lig = tid & (g - 1);
      const int stride = slices * g;
#pragma unroll 1
      for (int base = 0; base < items; base += groups) {  // block-uniform count: group_sum shuffles
        const int item = base + gid;
        const int k = j + 1 + item / slices;
        const int s = item - (k - j - 1) * slices;
        T dot = T(0);
        if (item < items) {
          const T* Ak = A + k * ld;
#pragma unroll 1
          for (int i = j + s * g + lig; i < m; i += stride) {
            dot += conjugate(i == j ? T(1) : Aj[i]) * Ak[i];
          }
        }
        dot = group_sum(dot, g);
        if (item < items && lig == 0) part[s * c + k] = dot;
      }
      __syncthreads();  // all partial dot products posted
#pragma unroll 1
      for (int base = 0; base < items; base += groups) {
        const int item = base + gid;
        if (item >= items) break;
        const int k = j + 1 + item / slices;
        const int s = item - (k - j - 1) * slices;
        T w = T(0);
#pragma unroll 1
        for (int t = 0; t < slices; ++t) w += part[t * c + k];
        const T coef = conjugate(tau) * w;  // H_jᴴ = I - conj(tau) v vᴴ
        T* Ak = A + k * ld;
#pragma unroll 1
        for (int i = j + s * g + lig; i < m; i += stride) {
          const T a = Ak[i] - coef * (i == j ? T(1) : Aj[i]);
          Ak[i] = a;
          if (k == j + 1 && i > j + 1) accumulate(a, amax_next, ssq_next);
        }
      }
    }
    post_partials(amax_next, ssq_next, red);
  }
  __syncthreads();  // R complete in A and diag
}

// Stores the c x c R of householder() to r, row-major, zeros below the diagonal.
template <typename T>
__device__ __forceinline__ void store_r(T* __restrict__ r, int c, const Layout& l, const T* A) {
  const T* diag = A + l.diag_off;
  for_each_row_major(c, c, [&](int idx, int i, int j) {
    r[idx] = j > i ? A[j * l.ld + i] : (j == i ? diag[i] : T(0));
  });
}

// R of the row-major m x c matrix x, executed by the whole block.
template <typename T>
__device__ void qr_one(const T* __restrict__ x, T* __restrict__ r, int m, int c, const Layout& l,
                       T* A) {
  for_each_row_major(m, c, [&](int idx, int i, int j) { A[j * l.ld + i] = x[idx]; });
  householder(m, c, l, A);
  store_r(r, c, l, A);
}

// Grid-stride over matrices, one per block; the dynamic shared memory is layout<T>(m, c, warps).
template <typename T>
__global__ void __launch_bounds__(kMaxWarps * 32)
    qr_r_kernel(const T* __restrict__ x, T* __restrict__ r, int64_t batch, int m, int c) {
  extern __shared__ __align__(16) unsigned char smem[];
  T* A = reinterpret_cast<T*>(smem);
  const Layout l = layout<T>(m, c, blockDim.x >> 5);
  for (int64_t b = blockIdx.x; b < batch; b += gridDim.x) {
    qr_one(x + b * m * c, r + b * c * c, m, c, l, A);
    __syncthreads();  // the next matrix overwrites shared memory the store may still read
  }
}

// Enqueues the batched R factor on `stream`. Requires supported<T>(m, c). Returns the launch
// error, cudaSuccess otherwise (also for batch == 0, which launches nothing).
template <typename T>
cudaError_t launch(cudaStream_t stream, const T* x, T* r, int64_t batch, int m, int c) {
  if (batch == 0) return cudaSuccess;
  const int warps = warps_for(m, c);
  const Layout l = layout<T>(m, c, warps);
  const int64_t blocks = std::min<int64_t>(batch, INT32_MAX);
  constexpr auto kernel = qr_r_kernel<T>;
  // The matrix takes at most 40 KiB, but complex128's scratch can pass the default 48 KiB.
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, l.bytes);
  if (err != cudaSuccess) return err;
  JAXFORGE_LAUNCH(kernel, static_cast<unsigned>(blocks), warps * 32, l.bytes, stream)(x, r, batch, m, c);
  return cudaGetLastError();
}

}  // namespace jaxforge::qr_r
