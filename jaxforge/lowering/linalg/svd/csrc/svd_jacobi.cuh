// Batched thin SVD of small matrices (m, n <= 32) by one-sided (Hestenes) Jacobi, one warp per
// matrix. Framework-free: raw device pointers and a CUDA stream.
//
// Layout contract (row-major, last dim contiguous, matrices packed back to back), k = min(m, n),
// T float, double or Complex<float/double> (csrc/scalar.h; the column-per-lane sweeps: real only):
//   a    (batch, m, n)  input
//   s    (batch, k)     singular values (real), descending, >= 0
//   u    (batch, m, k)  left singular vectors as columns
//   vt   (batch, k, n)  right singular vectors as rows;   a = u @ diag(s) @ vt (vt = Vᴴ)
//   info (batch)        sweeps used (>= 1, the last one applied no rotation), or -1 if the matrix
//                       held NaN/Inf or did not converge within the sweep cap; s, u and vt of that
//                       matrix are then all NaN.
// Values alone (kVectors false, for compute_uv=False): s and info only, u and vt null. V is then
// neither held nor rotated; W's rotations, which alone decide s and the sweeps, are the same
// operations as with the vectors, so s and info are bit-identical to theirs.
// Zero singular values: the factor built by normalising the work matrix (u when m >= n, vt when
// m < n) has no vector where the corresponding column's squared norm is exactly 0 (all of them for
// a zero matrix); complete_basis fills those with an orthonormal completion, as LAPACK's, so both
// factors are orthonormal (the other being a product of rotations). Only such matrices pay for it.
//
// Work matrix W = A (m >= n) or Aᴴ (m < n), R = max(m, n) rows by C = min(m, n) columns. Lane i
// owns row i of W and of the C x C rotation accumulator V, stored in a per-warp slice of shared
// memory rather than in registers: the pair loop indexes columns p and q at runtime, which would
// demote register arrays to local memory, and unrolling all 496 pairs at compile time would make
// the sweep far larger than the instruction cache. Shared memory also lets the global loads and
// stores run coalesced over the row-major layout while W is transposed on the fly.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <atomic>
#include <cstdint>
#include <type_traits>

#include "csrc/launch.h"
#include "csrc/scalar.h"
#include "csrc/warp.h"

namespace jaxforge::svd_jacobi {

constexpr int kMaxDim = 32;           // rows of the work matrix live in the 32 lanes of a warp
constexpr int kMaxWarpsPerBlock = 8;  // one matrix per warp
constexpr int kSmemBudget = 48 * 1024;  // per block; stays below the default dynamic-smem limit
constexpr unsigned kFullMask = 0xffffffffu;
// Which lanes hold what in the one-warp sweeps: a row of W each (jacobi_sweeps, any T), a column
// each (jacobi_sweeps_lanes, real), or a row half of two columns each (jacobi_sweeps_pairs, real).
enum class Sweeps { kRows, kLanes, kPairs };
// Loops with runtime bounds carry `#pragma unroll 1`: the Jacobi loops are latency-bound chains
// of shuffles that unrolling cannot overlap, and unrolled index loops (integer division per
// element) double the register count, which caps occupancy for small matrices, where shared memory
// does not.

template <typename T>
struct Real;

template <>
struct Real<float> {
  static constexpr float kEps = FLT_EPSILON;
  static constexpr float kMax = FLT_MAX;
  static constexpr int kMaxSweeps = 30;
  static __device__ float nan() { return __int_as_float(0x7fc00000); }
  static __device__ float sqrt(float x) { return sqrtf(x); }
  static __device__ float hypot(float x, float y) { return hypotf(x, y); }
  // Explicitly rounded ops keep nvcc from contracting the warp reductions into FMAs whose
  // rounding would differ per lane (see warp_sum).
  static __device__ float mul_rn(float x, float y) { return __fmul_rn(x, y); }
  static __device__ float add_rn(float x, float y) { return __fadd_rn(x, y); }
  static __device__ float fma_rn(float x, float y, float z) { return __fmaf_rn(x, y, z); }
};

template <>
struct Real<double> {
  static constexpr double kEps = DBL_EPSILON;
  static constexpr double kMax = DBL_MAX;
  static constexpr int kMaxSweeps = 40;
  static __device__ double nan() { return __longlong_as_double(0x7ff8000000000000ll); }
  static __device__ double sqrt(double x) { return ::sqrt(x); }
  static __device__ double hypot(double x, double y) { return ::hypot(x, y); }
  static __device__ double mul_rn(double x, double y) { return __dmul_rn(x, y); }
  static __device__ double add_rn(double x, double y) { return __dadd_rn(x, y); }
  static __device__ double fma_rn(double x, double y, double z) { return __fma_rn(x, y, z); }
};

// Per-warp slice of dynamic shared memory. W (R x C work matrix) and V (C x C) are column-major so
// that lane i's element of column p sits at p*ld + i: a column access is stride-1 across lanes.
// Odd leading dimensions spread the row-major global loads/stores, which walk a row of W or V,
// across banks instead of hitting one bank 32 times.
struct WarpLayout {
  int ldw, ldv;   // leading dims of W and V
  int v_off;      // V, in elements of T from the slice start (W is at 0)
  int s_off;      // C column norms, in elements of T
  int perm_byte;  // C ints: perm[r] = column holding the r-th largest norm
  int bytes;      // slice size, a multiple of 16
};

template <typename T>
__host__ __device__ inline WarpLayout warp_layout(int rows, int cols, bool vectors = true) {
  WarpLayout l;
  l.ldw = rows | 1;
  l.ldv = cols | 1;
  l.v_off = l.ldw * cols;
  l.s_off = l.v_off + (vectors ? l.ldv * cols : 0);
  l.perm_byte = (l.s_off + cols) * static_cast<int>(sizeof(T));
  l.bytes = (l.perm_byte + cols * static_cast<int>(sizeof(int)) + 15) & ~15;
  return l;
}

// Butterfly sum: every lane ends with the same bits because IEEE addition is commutative and each
// pair of partners adds the same two values; the Jacobi control flow relies on this uniformity.
template <typename T>
__device__ __forceinline__ void warp_sum3(T& x, T& y, T& z) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const T xo = __shfl_xor_sync(kFullMask, x, off);
    const T yo = __shfl_xor_sync(kFullMask, y, off);
    const T zo = __shfl_xor_sync(kFullMask, z, off);
    x = Real<T>::add_rn(x, xo);
    y = Real<T>::add_rn(y, yo);
    z = Real<T>::add_rn(z, zo);
  }
}

// The Gram entries of a column pair over the warp: real gamma as warp_sum3, complex gamma as its
// two parts.
template <typename R>
__device__ __forceinline__ void warp_sum_gram(R& alpha, R& beta, R& gamma) {
  warp_sum3(alpha, beta, gamma);
}
template <typename R>
__device__ __forceinline__ void warp_sum_gram(R& alpha, R& beta, Complex<R>& gamma) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const R ao = __shfl_xor_sync(kFullMask, alpha, off);
    const R bo = __shfl_xor_sync(kFullMask, beta, off);
    const R ro = __shfl_xor_sync(kFullMask, gamma.re, off);
    const R io = __shfl_xor_sync(kFullMask, gamma.im, off);
    alpha = Real<R>::add_rn(alpha, ao);
    beta = Real<R>::add_rn(beta, bo);
    gamma.re = Real<R>::add_rn(gamma.re, ro);
    gamma.im = Real<R>::add_rn(gamma.im, io);
  }
}

// The rotation threshold of both Jacobi kernels: a pair (p, q) is skipped when
// |gamma| <= tol ||a_p|| ||a_q||, tol = max(sqrt(R), ceil(R / 32) + 7) eps. A warp's dot product of
// two R-long columns (ceil(R / 32) products or fused steps per lane, then a 5-level butterfly) errs
// by at most (ceil(R / 32) + 5) eps ||a_p|| ||a_q||, so rounding alone cannot keep a sweep rotating.
// Stopping at tol leaves the columns, hence the normalised factor, orthogonal to about tol each:
// sqrt(R) eps (LAPACK gesvj's) meets the 50 eps sqrt(n) accuracy bar. The one-warp kernel's earlier
// 2 R eps missed it on the H200 (orthogonality 7.7e-5 at 32 x 32, bar 3.4e-5), as its model in
// tools/svd_jacobi_block_model.py --warp predicts (7.1e-5; 8e-6 with this threshold, same sweeps).
template <typename T>
__host__ __device__ inline T jacobi_tolerance(int rows) {
  const T floor = T((rows + 31) / 32 + 7);
  const T root = static_cast<T>(std::sqrt(static_cast<double>(rows)));
  return (root > floor ? root : floor) * Real<T>::kEps;
}

// Whether columns with squared norms alpha, beta and inner product gamma still need a rotation: not
// when either is zero (a squared norm that underflows counts as zero) or |gamma| <= tol |a_p| |a_q|.
template <typename T>
__device__ __forceinline__ bool needs_rotation(T alpha, T beta, T gamma, T tol) {
  return alpha != T(0) && beta != T(0) && fabs(gamma) > tol * Real<T>::sqrt(alpha) * Real<T>::sqrt(beta);
}

// Rutishauser's rotation of columns p, q: a_p <- c a_p - s a_q, a_q <- s a_p + c a_q, with t = s/c
// the smaller root of t^2 + 2 zeta t - 1 = 0, |t| <= 1, so the angle is at most pi/4. hypot keeps
// zeta^2 from overflowing for very unequal norms.
template <typename A>
__device__ __forceinline__ void rutishauser(A alpha, A beta, A gamma, A& c, A& s) {
  const A zeta = (beta - alpha) / (A(2) * gamma);
  const A t = (zeta < A(0) ? A(-1) : A(1)) / (fabs(zeta) + Real<A>::hypot(A(1), zeta));
  c = A(1) / Real<A>::sqrt(A(1) + t * t);
  s = c * t;
}

// The rotation of columns p, q as a_p <- c a_p - sq a_q, a_q <- sp a_p + c a_q. Real: Rutishauser's
// (sp = sq = s). Complex, with gamma = |gamma| e^(i phi): Rutishauser's on (alpha, beta, |gamma|)
// and sq = s e^(-i phi), sp = s e^(i phi), which is unitary and zeroes the pair's Gram entry (it
// is the real rotation of a_p and e^(-i phi) a_q); for real gamma it is the real rotation itself.
template <typename T>
struct Rotation {
  RealOf<T> c;
  T sp, sq;
};

template <typename R>
__device__ __forceinline__ Rotation<R> jacobi_rotation(R alpha, R beta, R gamma) {
  R c, s;
  rutishauser(alpha, beta, gamma, c, s);
  return {c, s, s};
}

template <typename R>
__device__ __forceinline__ Rotation<Complex<R>> jacobi_rotation(R alpha, R beta, Complex<R> gamma) {
  const R g = magnitude(gamma);
  R c, s;
  rutishauser(alpha, beta, g, c, s);
  const Complex<R> phase = conjugate(gamma) / g;  // e^(-i phi)
  return {c, conjugate(phase) * s, phase * s};
}

// The player at position `pos` in round `t` of the circle method over `players` (even): position 0
// keeps player 0, the others turn by one each round; round t pairs positions i and players-1-i, so
// over players - 1 rounds every pair meets once.
__device__ __forceinline__ int player(int pos, int t, int players) {
  return pos == 0 ? 0 : (pos - 1 + t) % (players - 1) + 1;
}

// Whom `who` meets in round `t` of that tournament: the player at the mirrored position.
__device__ __forceinline__ int opponent(int who, int t, int players) {
  const int n = players - 1;
  const int pos = who == 0 ? 0 : ((who - 1 - t) % n + n) % n + 1;
  return player(players - 1 - pos, t, players);
}

// Cyclic-by-rows one-sided Jacobi on W (R x C, R >= C), accumulating the rotations into V (kV).
// Lane i touches only row i of W and V, so no __syncwarp is needed inside. Returns the sweeps used,
// or -1 at the cap. Stopping at jacobi_tolerance leaves relative errors in the singular values of
// order tol times the condition number of A with unit-norm columns (Demmel-Veselic). A column whose
// squared norm underflows to 0 is treated as zero: no rotation involves it.
template <typename T, bool kV = true>
__device__ int jacobi_sweeps(T* W, int ldw, T* V, int ldv, int rows, int cols, int lane) {
  using R = RealOf<T>;
  const bool in_w = lane < rows;
  const bool in_v = kV && lane < cols;
  const R tol = jacobi_tolerance<R>(rows);
#pragma unroll 1
  for (int sweep = 1; sweep <= Real<R>::kMaxSweeps; ++sweep) {
    bool rotated = false;
#pragma unroll 1
    for (int p = 0; p < cols - 1; ++p) {
      // Column p stays in registers for the whole q loop.
      T ap = in_w ? W[p * ldw + lane] : T(0);
      T vp = in_v ? V[p * ldv + lane] : T(0);
#pragma unroll 1
      for (int q = p + 1; q < cols; ++q) {
        const T aq = in_w ? W[q * ldw + lane] : T(0);
        R alpha = abs2(ap);
        R beta = abs2(aq);
        T gamma = conjugate(ap) * aq;
        warp_sum_gram(alpha, beta, gamma);
        if (!needs_rotation(alpha, beta, magnitude(gamma), tol)) continue;
        rotated = true;
        const Rotation<T> rot = jacobi_rotation(alpha, beta, gamma);
        const T ap_new = rot.c * ap - rot.sq * aq;
        if (in_w) W[q * ldw + lane] = rot.sp * ap + rot.c * aq;
        ap = ap_new;
        if (in_v) {
          const T vq = V[q * ldv + lane];
          V[q * ldv + lane] = rot.sp * vp + rot.c * vq;
          vp = rot.c * vp - rot.sq * vq;
        }
      }
      if (in_w) W[p * ldw + lane] = ap;
      if (in_v) V[p * ldv + lane] = vp;
    }
    if (!rotated) return sweep;
  }
  return -1;
}

// x . y by pairwise summation over kMaxDim entries: error at most (log2(kMaxDim) + 1) eps |x|.|y|,
// below jacobi_tolerance. Each product and sum is rounded once in a fixed order, and x_i y_i =
// y_i x_i, so the two lanes of a pair, each calling it with the pair's columns swapped, agree bitwise.
template <typename T>
__device__ __forceinline__ T tree_dot(const T (&x)[kMaxDim], const T (&y)[kMaxDim]) {
  static_assert(kMaxDim == 32);
  T p16[16], p8[8], p4[4];  // one array a level: constant indices, so all of them stay in registers
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    p16[i] = Real<T>::add_rn(Real<T>::mul_rn(x[2 * i], y[2 * i]), Real<T>::mul_rn(x[2 * i + 1], y[2 * i + 1]));
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) p8[i] = Real<T>::add_rn(p16[2 * i], p16[2 * i + 1]);
#pragma unroll
  for (int i = 0; i < 4; ++i) p4[i] = Real<T>::add_rn(p8[2 * i], p8[2 * i + 1]);
  return Real<T>::add_rn(Real<T>::add_rn(p4[0], p4[1]), Real<T>::add_rn(p4[2], p4[3]));
}

// The same one-sided Jacobi as jacobi_sweeps, with another division of labour: lane j holds column
// j of W and of V in registers, and each step of a sweep pairs the lanes by the circle method
// (`opponent`), so up to 16 disjoint pairs rotate at once. A pair's two lanes fetch each other's
// columns by shuffle and compute the same sums, hence the same rotation; nothing waits on a
// 5-level butterfly. Lanes past cols hold zero columns (a bye for odd counts), which never rotate.
// Same tolerance, rotation and return value as jacobi_sweeps; W and V are read and written back
// column-wise, then the warp syncs (the caller reads rows).
template <typename T, bool kV = true>
__device__ int jacobi_sweeps_lanes(T* W, int ldw, T* V, int ldv, int rows, int cols, int lane) {
  T a[kMaxDim], v[kV ? kMaxDim : 1];
  const bool mine = lane < cols;
#pragma unroll
  for (int i = 0; i < kMaxDim; ++i) {
    a[i] = mine && i < rows ? W[lane * ldw + i] : T(0);
    if constexpr (kV) v[i] = mine && i < cols ? V[lane * ldv + i] : T(0);
  }
  const int players = cols + (cols & 1);
  const T tol = jacobi_tolerance<T>(rows);
  int sweeps = -1;
#pragma unroll 1
  for (int sweep = 1; sweep <= Real<T>::kMaxSweeps && sweeps < 0; ++sweep) {
    bool rotated = false;
#pragma unroll 1
    for (int round = 0; round < players - 1; ++round) {
      const int partner = lane < players ? opponent(lane, round, players) : lane;
      T b[kMaxDim];
#pragma unroll
      for (int i = 0; i < kMaxDim; ++i) b[i] = __shfl_sync(kFullMask, a[i], partner);
      const bool low = lane < partner;
      const T own = tree_dot(a, a);
      const T other = tree_dot(b, b);
      const T gamma = tree_dot(a, b);
      const T alpha = low ? own : other;  // the pair's lower column's squared norm
      const T beta = low ? other : own;
      const bool rotate = partner != lane && needs_rotation(alpha, beta, gamma, tol);
      T c = T(1), s = T(0);
      if (rotate) rutishauser(alpha, beta, gamma, c, s);
      rotated = rotated || rotate;
      // lower column: c a_p - s a_q; upper: s a_p + c a_q, the partner's column being the other
      const T signed_s = low ? -s : s;
#pragma unroll
      for (int i = 0; i < kMaxDim; ++i) a[i] = c * a[i] + signed_s * b[i];
      if constexpr (kV) {
#pragma unroll
        for (int i = 0; i < kMaxDim; ++i) {
          const T w = __shfl_sync(kFullMask, v[i], partner);
          v[i] = c * v[i] + signed_s * w;
        }
      }
    }
    if (!__any_sync(kFullMask, rotated)) sweeps = sweep;
  }
  if (mine) {
#pragma unroll
    for (int i = 0; i < kMaxDim; ++i) {
      if (i < rows) W[lane * ldw + i] = a[i];
      if constexpr (kV) {
        if (i < cols) V[lane * ldv + i] = v[i];
      }
    }
  }
  __syncwarp();
  return sweeps;
}

// The rows of each of its two columns a lane of jacobi_sweeps_pairs holds.
constexpr int kPairRows = kMaxDim / 2;

// A lane's part of x . y over its kPairRows rows: four 4-term FMA chains, then a 2-level tree, so
// each product is rounded at most 6 times; the pair's one cross-lane add makes 7, within
// jacobi_tolerance's floor of 8 eps. The lanes of a pair add each other's parts in swapped order,
// which IEEE addition makes bitwise equal.
template <typename T>
__device__ __forceinline__ T lane_dot(const T (&x)[kPairRows], const T (&y)[kPairRows]) {
  static_assert(kPairRows == 16);
  T part[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    part[j] = Real<T>::mul_rn(x[j], y[j]);
#pragma unroll
    for (int i = j + 4; i < kPairRows; i += 4) part[j] = Real<T>::fma_rn(x[i], y[i], part[j]);
  }
  return Real<T>::add_rn(Real<T>::add_rn(part[0], part[1]), Real<T>::add_rn(part[2], part[3]));
}

// A slot's move before round t of a group of `group` slots (of `slots`) in the column-pair sweeps
// tournament (jacobi_sweeps_pairs): Y goes round the group, or, at a group's first round after the
// first group, the parent group splits and the slots of its second half keep their Y as X and send
// their X (`second`). A slot takes its new Y from slot `from` and gives its old one to slot `to`.
struct TournamentMove {
  bool split, second;
  int from, to;
};

__device__ __forceinline__ TournamentMove tournament_move(int slot, int group, int t, int slots) {
  TournamentMove move;
  move.split = t == 0 && group < slots;
  const int offset = slot & (move.split ? 2 * group - 1 : group - 1);
  move.second = move.split && offset >= group;
  const int base = slot - offset;
  move.from = move.split ? (move.second ? slot - group : slot + group) : base + ((offset + group - 1) & (group - 1));
  move.to = move.split ? move.from : base + ((offset + 1) & (group - 1));
  return move;
}

// Two columns, X and Y, of W (in T) and of V (in S; kV false: V is not held) as one thread of the
// column-pair sweeps holds them: rows [row0, row0 + kPairRows) of each, and the columns' indices
// (past `cols`: a zero column). The members are unrolled over, so the arrays stay in registers.
template <typename T, typename S, bool kV = true>
struct ColumnPair {
  T xw[kPairRows], yw[kPairRows];
  S xv[kV ? kPairRows : 1], yv[kV ? kPairRows : 1];
  int xid, yid;

  // Reads the rows from W (`rows` long columns) and V (`cols` long), zero past them.
  __device__ __forceinline__ void load(const T* W, int ldw, const S* V, int ldv, int rows, int cols, int row0) {
#pragma unroll
    for (int i = 0; i < kPairRows; ++i) {
      const int r = row0 + i;
      xw[i] = xid < cols && r < rows ? W[xid * ldw + r] : T(0);
      yw[i] = yid < cols && r < rows ? W[yid * ldw + r] : T(0);
      if constexpr (kV) {
        xv[i] = xid < cols && r < cols ? V[xid * ldv + r] : S(0);
        yv[i] = yid < cols && r < cols ? V[yid * ldv + r] : S(0);
      }
    }
  }

  __device__ __forceinline__ void store(T* W, int ldw, S* V, int ldv, int rows, int cols, int row0) const {
#pragma unroll
    for (int i = 0; i < kPairRows; ++i) {
      const int r = row0 + i;
      if (xid < cols && r < rows) W[xid * ldw + r] = xw[i];
      if (yid < cols && r < rows) W[yid * ldw + r] = yw[i];
      if constexpr (kV) {
        if (xid < cols && r < cols) V[xid * ldv + r] = xv[i];
        if (yid < cols && r < cols) V[yid * ldv + r] = yv[i];
      }
    }
  }

  // ||X||^2, ||Y||^2 and X . Y over W's rows: this thread's parts, summed by an xor-butterfly over
  // the `lanes` aligned lanes (a power of two) that hold the pair, which all get the same bits.
  __device__ __forceinline__ void gram(int lanes, T& alpha, T& beta, T& gamma) const {
    alpha = lane_dot(xw, xw);
    beta = lane_dot(yw, yw);
    gamma = lane_dot(xw, yw);
    for (int off = 1; off < lanes; off *= 2) {
      alpha = Real<T>::add_rn(alpha, __shfl_xor_sync(kFullMask, alpha, off));
      beta = Real<T>::add_rn(beta, __shfl_xor_sync(kFullMask, beta, off));
      gamma = Real<T>::add_rn(gamma, __shfl_xor_sync(kFullMask, gamma, off));
    }
  }

  // X <- c X - s Y, Y <- s X + c Y (Rutishauser's, X as column p); W's rows in T.
  __device__ __forceinline__ void rotate(S c, S s) {
    const T cw = static_cast<T>(c), sw = static_cast<T>(s);
#pragma unroll
    for (int i = 0; i < kPairRows; ++i) {
      const T x = xw[i], y = yw[i];
      xw[i] = cw * x - sw * y;
      yw[i] = sw * x + cw * y;
      if constexpr (kV) {
        const S p = xv[i], q = yv[i];
        xv[i] = c * p - s * q;
        yv[i] = s * p + c * q;
      }
    }
  }

  // X and Y trade places (registers only): before a move that sends X and keeps Y.
  __device__ __forceinline__ void swap() {
#pragma unroll
    for (int i = 0; i < kPairRows; ++i) {
      const T w = xw[i];
      xw[i] = yw[i];
      yw[i] = w;
      if constexpr (kV) {
        const S v = xv[i];
        xv[i] = yv[i];
        yv[i] = v;
      }
    }
    const int id = xid;
    xid = yid;
    yid = id;
  }

  // Y <- lane `source`'s Y, shuffled in place: the move before a round.
  __device__ __forceinline__ void move(int source) {
#pragma unroll
    for (int i = 0; i < kPairRows; ++i) {
      yw[i] = __shfl_sync(kFullMask, yw[i], source);
      if constexpr (kV) yv[i] = __shfl_sync(kFullMask, yv[i], source);
    }
    yid = __shfl_sync(kFullMask, yid, source);
  }
};

// The same one-sided Jacobi as jacobi_sweeps, with two lanes per column pair: lanes 2j and 2j + 1
// hold rows [0, 16) and [16, 32) of a pair's two columns, X and Y, of W and of V, so the pair's
// Gram entries take three partial sums and one xor-shuffle each, and the rotation is all registers.
// Between two rounds one column of each pair changes lanes (16 + 16 values a lane). The ordering
// is a recursive tournament of P players (C rounded up to a power of two) in S = P / 2 slots: in a
// group of G slots the X columns stay while the Y columns go round the group, so in G rounds every
// X meets every Y; then one move gathers the group's X columns in its first half and its Y columns
// in its second, and each half plays the same tournament within itself. S + S/2 + ... + 1 = P - 1
// rounds a sweep, every pair once. Players past C are zero columns, which never rotate; each
// column's index travels with it, for the write-back. Same tolerance, rotation (X as column p) and
// return value as jacobi_sweeps.
template <typename T, bool kV = true>
__device__ int jacobi_sweeps_pairs(T* W, int ldw, T* V, int ldv, int rows, int cols, int lane) {
  int players = 2;
  while (players < cols) players *= 2;
  const int slots = players / 2;
  const int slot = lane >> 1;
  const int row0 = (lane & 1) * kPairRows;
  const bool playing = slot < slots;
  ColumnPair<T, T, kV> pair;
  pair.xid = playing ? slot : players;
  pair.yid = playing ? slot + slots : players;
  pair.load(W, ldw, V, ldv, rows, cols, row0);
  const T tol = jacobi_tolerance<T>(rows);
  int sweeps = -1;
#pragma unroll 1
  for (int sweep = 1; sweep <= Real<T>::kMaxSweeps && sweeps < 0; ++sweep) {
    bool rotated = false;
#pragma unroll 1
    for (int group = slots; group >= 1; group >>= 1) {
#pragma unroll 1
      for (int t = 0; t < group; ++t) {
        const TournamentMove move = tournament_move(slot, group, t, slots);
        if (move.second) pair.swap();
        pair.move(playing ? 2 * move.from + (lane & 1) : lane);

        T alpha, beta, gamma;
        pair.gram(2, alpha, beta, gamma);
        if (needs_rotation(alpha, beta, gamma, tol)) {
          rotated = true;
          T c, s;
          rutishauser(alpha, beta, gamma, c, s);
          pair.rotate(c, s);
        }
      }
    }
    if (!__any_sync(kFullMask, rotated)) sweeps = sweep;
  }
  __syncwarp();  // a column comes back to another lane than loaded it; shuffles order no memory
  pair.store(W, ldw, V, ldv, rows, cols, row0);
  __syncwarp();
  return sweeps;
}

// Rows i of two columns x, y (length len) become c x_i - sq y_i and sp x_i + c y_i (a Rotation;
// sp = sq = s for real S); the threads of one warp share the loop, this one being `lane`. W's
// columns rotate in T, V's in its own type.
template <typename S>
__device__ __forceinline__ void rotate_columns(S* x, S* y, int len, RealOf<S> c, S sp, S sq, int lane) {
#pragma unroll 1
  for (int i = lane; i < len; i += 32) {
    const S xi = x[i];
    const S yi = y[i];
    x[i] = c * xi - sq * yi;
    y[i] = sp * xi + c * yi;
  }
}

// W (column-major, leading dim ldw) = a (m x n, row-major) scaled by 2^-e, conjugate-transposed
// when m < n; `threads` threads share the loop, this one being `tid`.
template <typename T>
__device__ void load_scaled(const T* a, T* W, int ldw, int m, int n, int e, int tid, int threads) {
  const bool transposed = m < n;
#pragma unroll 1
  for (int idx = tid; idx < m * n; idx += threads) {
    const int i = idx / n;
    const int j = idx % n;
    const T x = scale2(a[idx], -e);
    W[transposed ? i * ldw + j : j * ldw + i] = transposed ? conjugate(x) : x;
  }
}

// perm[r] = the column of the r-th largest of sv[0..cols), by rank counting; ties keep column
// order, so the ranks are a permutation.
template <typename T>
__device__ void rank_order(const T* sv, int* perm, int cols, int tid, int threads) {
#pragma unroll 1
  for (int c = tid; c < cols; c += threads) {
    const T mine = sv[c];
    int rank = 0;
#pragma unroll 1
    for (int i = 0; i < cols; ++i) rank += (sv[i] > mine) || (sv[i] == mine && i < c);
    perm[rank] = c;
  }
}

// dst holds k vectors of length len, the r-th being column perm[r] of src (column-major, leading
// dim ld, elements of T or wider), divided by its norm sv[perm[r]] when `normalize` (0 where that
// norm is 0). The vectors are the columns of dst (len x k) or, with `as_rows`, its rows (k x len),
// conjugated (rows of a factor's adjoint).
// The loop runs over dst's linear index so that global stores coalesce; `threads` threads share
// it, this one being `tid`.
template <typename T, typename S>
__device__ void store_vectors(T* dst, int len, int k, bool as_rows, const S* src, int ld,
                              const RealOf<T>* sv, bool normalize, const int* perm, int tid,
                              int threads) {
#pragma unroll 1
  for (int idx = tid; idx < len * k; idx += threads) {
    const int r = as_rows ? idx / len : idx % k;
    const int i = as_rows ? idx % len : idx / k;
    const int j = perm[r];
    T x = static_cast<T>(src[j * ld + i]);
    if (normalize) x = sv[j] > RealOf<T>(0) ? x / sv[j] : T(0);
    dst[idx] = as_rows ? conjugate(x) : x;
  }
}

// dst's vectors of ranks [nonzero, k) (laid out as store_vectors writes them: zero where their
// singular value is exactly 0), each replaced in turn by the unit vector e_p less its projection
// on the vectors before it, projected out twice (Gram-Schmidt with reorthogonalisation, so
// orthogonal to rounding), then normalised. The pivot p is the element where the vectors before
// weigh least: those r < len weights Σ_t |f_t(p)|² add up to r, so e_p keeps at least 1 - r/len of
// its squared norm. Rows are completed as they are stored (conjugated or not, a set of vectors is
// orthonormal alike). One warp, all 32 lanes, after a barrier that makes dst's stores visible;
// lane l then reads and writes only elements l, l + 32, ... of each vector.
template <typename T>
__device__ __forceinline__ void complete_basis(T* dst, int len, int k, bool as_rows, int nonzero, int lane) {
  using R = RealOf<T>;
  const int apart = as_rows ? len : 1;  // from one vector to the next
  const int step = as_rows ? 1 : k;     // from one element to the next
#pragma unroll 1
  for (int r = nonzero; r < k; ++r) {
    T* x = dst + r * apart;
    R least = Real<R>::kMax;
    int pivot = len;
#pragma unroll 1
    for (int i = lane; i < len; i += 32) {
      R weight = R(0);
#pragma unroll 1
      for (int t = 0; t < r; ++t) weight += abs2(dst[t * apart + i * step]);
      if (weight < least) least = weight, pivot = i;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {  // the least (weight, index) pair: the same in every lane
      const R other = __shfl_xor_sync(kFullMask, least, off);
      const int other_pivot = __shfl_xor_sync(kFullMask, pivot, off);
      if (other < least || (other == least && other_pivot < pivot)) least = other, pivot = other_pivot;
    }
#pragma unroll 1
    for (int i = lane; i < len; i += 32) x[i * step] = T(i == pivot);
#pragma unroll 1
    for (int pass = 0; pass < 2 * r; ++pass) {
      const T* f = dst + pass % r * apart;
      T dot = T(0);
#pragma unroll 1
      for (int i = lane; i < len; i += 32) dot += conjugate(f[i * step]) * x[i * step];
      dot = warp_sum(dot);
#pragma unroll 1
      for (int i = lane; i < len; i += 32) x[i * step] -= f[i * step] * dot;
    }
    R norm2 = R(0);
#pragma unroll 1
    for (int i = lane; i < len; i += 32) norm2 += abs2(x[i * step]);
    const R norm = Real<R>::sqrt(warp_sum(norm2));
#pragma unroll 1
    for (int i = lane; i < len; i += 32) x[i * step] = x[i * step] / norm;
  }
}

// How many of the cols column norms sv are nonzero: the ranks complete_basis keeps.
template <typename R>
__device__ int count_nonzero(const R* sv, int cols) {
  int count = 0;
#pragma unroll 1
  for (int j = 0; j < cols; ++j) count += sv[j] > R(0);
  return count;
}

template <typename T>
__device__ void fill(T* dst, int count, T value, int tid, int threads) {
#pragma unroll 1
  for (int idx = tid; idx < count; idx += threads) dst[idx] = value;
}

// One matrix, executed by a whole warp (all control flow is warp-uniform).
// m >= n: W = A (m x n) and A = (W / s) diag(s) Vᴴ, so u = W / s and vt = Vᴴ.
// m <  n: W = Aᴴ (n x m) and A = V diag(s) (W / s)ᴴ, so u = V and vt = (W / s)ᴴ.
// Without kVectors, s and info alone (V, u and vt unused).
template <typename T, Sweeps kSweeps, bool kVectors>
__device__ void svd_one(const T* a, RealOf<T>* s, T* u, T* vt, int32_t* info, int m, int n,
                        const WarpLayout& l, T* W, T* V, RealOf<T>* sv, int* perm, int lane) {
  using R = RealOf<T>;
  const bool transposed = m < n;
  const int rows = transposed ? n : m;
  const int cols = transposed ? m : n;
  const int k = cols;

  // Scale by a power of two (exact) so that max |a_ij| lies in [0.5, 1): squared norms, at most
  // 32, can then neither overflow nor lose the large entries to underflow.
  R amax = R(0);
  bool finite = true;
#pragma unroll 1
  for (int idx = lane; idx < m * n; idx += 32) {
    finite = finite && jaxforge::finite(a[idx]);
    amax = fmax(amax, max_part(a[idx]));
  }
  int sweeps = -1;
  int e = 0;
  if (__all_sync(kFullMask, finite)) {
    e = exponent(warp_max(amax));
    load_scaled(a, W, l.ldw, m, n, e, lane, 32);
    if (kVectors && lane < cols) {
#pragma unroll 1
      for (int j = 0; j < cols; ++j) V[j * l.ldv + lane] = T(j == lane);
    }
    __syncwarp();  // the load above wrote other lanes' rows of W
    static_assert(kSweeps == Sweeps::kRows || std::is_floating_point_v<T>, "lanes and pairs: real only");
    if constexpr (kSweeps == Sweeps::kLanes) {
      sweeps = jacobi_sweeps_lanes<T, kVectors>(W, l.ldw, V, l.ldv, rows, cols, lane);
    } else if constexpr (kSweeps == Sweeps::kPairs) {
      sweeps = jacobi_sweeps_pairs<T, kVectors>(W, l.ldw, V, l.ldv, rows, cols, lane);
    } else {
      sweeps = jacobi_sweeps<T, kVectors>(W, l.ldw, V, l.ldv, rows, cols, lane);
    }
  }
  if (lane == 0) *info = sweeps;
  if (sweeps < 0) {
    const R nan = Real<R>::nan();
    fill(s, k, nan, lane, 32);
    if constexpr (kVectors) {
      fill(u, m * k, splat<T>(nan), lane, 32);
      fill(vt, k * n, splat<T>(nan), lane, 32);
    }
    return;
  }

#pragma unroll 1
  for (int j = 0; j < cols; ++j) {
    const T aj = lane < rows ? W[j * l.ldw + lane] : T(0);
    const R norm = Real<R>::sqrt(warp_sum(abs2(aj)));
    if (lane == j) sv[j] = norm;
  }
  __syncwarp();
  rank_order(sv, perm, cols, lane, 32);
  __syncwarp();

  if (lane < k) s[lane] = scale2(sv[perm[lane]], e);
  if constexpr (kVectors) {
    store_vectors(u, m, k, false, transposed ? V : W, transposed ? l.ldv : l.ldw, sv, !transposed,
                  perm, lane, 32);
    store_vectors(vt, n, k, true, transposed ? W : V, transposed ? l.ldw : l.ldv, sv, transposed,
                  perm, lane, 32);
    if (sv[perm[k - 1]] == R(0)) {  // the least norm: some vector of the normalised factor is zero
      __syncwarp();
      complete_basis(transposed ? vt : u, rows, k, transposed, count_nonzero(sv, cols), lane);
    }
  }
}

// Grid-stride over matrices, one per warp; the dynamic shared memory is blockDim.x / 32 slices of
// warp_layout<T>(max(m, n), min(m, n), kVectors).bytes; u and vt are null without kVectors. The
// explicit minimum of 1 block per SM matters: with the thread bound alone, ptxas 13.0 squeezed the
// f64 kernel to 48 registers and spilled on sm_90a.
// The pairs' sweeps ask for 2 blocks, at most 128 registers: their 64 values a lane fit, and 16
// warps an SM hide more of the latency of a round's shuffles than 8.
template <typename T, Sweeps kSweeps, bool kVectors>
__global__ void __launch_bounds__(kMaxWarpsPerBlock * 32, kSweeps == Sweeps::kPairs ? 2 : 1)
    svd_jacobi_kernel(const T* __restrict__ a, RealOf<T>* __restrict__ s, T* __restrict__ u,
                      T* __restrict__ vt, int32_t* __restrict__ info, int64_t batch, int m, int n) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  const int k = min(m, n);
  const WarpLayout l = warp_layout<T>(max(m, n), k, kVectors);
  unsigned char* slice = smem + warp * l.bytes;
  T* W = reinterpret_cast<T*>(slice);
  int* perm = reinterpret_cast<int*>(slice + l.perm_byte);
  for (int64_t b = blockIdx.x * int64_t{warps} + warp; b < batch; b += int64_t{gridDim.x} * warps) {
    svd_one<T, kSweeps, kVectors>(a + b * m * n, s + b * k, kVectors ? u + b * m * k : nullptr,
                                  kVectors ? vt + b * k * n : nullptr, info + b, m, n, l, W, W + l.v_off,
                                  reinterpret_cast<RealOf<T>*>(W + l.s_off), perm, lane);
    __syncwarp();  // the next matrix overwrites shared memory other lanes may still be reading
  }
}

// Warps a block of `kernel`: as many as kSmemBudget holds slices of `bytes`, fewer where that
// lets more warps run on an SM. The register file decides it: at 225 registers a thread (the
// column-per-lane sweeps) an SM holds 8 warps, one 5-warp block but two 4-warp ones. Up to
// kMaxWarpsPerBlock occupancy queries: launch() asks once per shape.
template <typename Kernel>
int warps_per_block(Kernel kernel, int bytes) {
  const int most = std::clamp(kSmemBudget / bytes, 1, kMaxWarpsPerBlock);
  int best = most, best_resident = 0;
  for (int warps = most; warps >= 1; --warps) {
    int blocks = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, warps * 32, warps * bytes) != cudaSuccess) {
      return most;
    }
    if (blocks * warps > best_resident) best = warps, best_resident = blocks * warps;
  }
  return best;
}

// Enqueues the batched SVD on `stream`. Requires batch >= 1 and 1 <= m, n <= kMaxDim (the FFI
// handler answers empty problems); u and vt may be null without kVectors. Returns the launch error,
// cudaSuccess otherwise.
template <typename T, Sweeps kSweeps = Sweeps::kRows, bool kVectors = true>
cudaError_t launch(cudaStream_t stream, const T* a, RealOf<T>* s, T* u, T* vt, int32_t* info,
                   int64_t batch, int m, int n) {
  const WarpLayout l = warp_layout<T>(std::max(m, n), std::min(m, n), kVectors);
  constexpr auto kernel = svd_jacobi_kernel<T, kSweeps, kVectors>;
  static std::atomic<int> known_warps[kMaxDim][kMaxDim];  // per (m, n); 0 until asked (races only repeat the query)
  std::atomic<int>& known = known_warps[m - 1][n - 1];
  int warps = known.load(std::memory_order_relaxed);
  if (warps == 0) {
    warps = warps_per_block(kernel, l.bytes);
    known.store(warps, std::memory_order_relaxed);
  }
  const int64_t blocks = std::min<int64_t>((batch + warps - 1) / warps, INT32_MAX);
  JAXFORGE_LAUNCH(kernel, static_cast<unsigned>(blocks), warps * 32, warps * l.bytes, stream)(
      a, s, u, vt, info, batch, m, n);
  return cudaGetLastError();
}

}  // namespace jaxforge::svd_jacobi
