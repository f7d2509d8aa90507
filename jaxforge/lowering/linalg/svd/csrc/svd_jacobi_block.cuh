// Batched thin SVD of medium matrices (max(m, n) <= 256, min(m, n) <= 128, within the shared
// memory a block may have; float32, float64, complex64, complex128) by one-sided (Hestenes) Jacobi,
// one thread block per matrix, the column pairs in the round-robin parallel order. Same contract as
// svd_jacobi.cuh (layout, descending real s, info = sweeps used or -1 with NaN results, the basis
// completed where singular values are exactly 0). The slot sweeps (column pairs in registers)
// are float32's only: wider pairs would not fit a thread's registers. Complex pairs rotate by the
// warp kernel's unitary rotation (svd_jacobi::jacobi_rotation), V then in complex double.
//
// W = A (m >= n) or A^T (m < n), R x C with R >= C, and the rotation accumulator V (C x C) live in
// the block's shared memory, column-major. V is accumulated in float64, the rotations computed in
// float64 from W's float32 sums: a column of V takes (C - 1) rotations a sweep, and in float32
// their rounding left V's orthogonality at 8e-5 (C = 64) to 3e-4 (C = 128), over the 50 eps
// sqrt(n) accuracy bar, in a float32 model of this kernel; in float64 it stays near 3e-7, and the
// factor from W (limited by the tolerance below) decides the accuracy. A sweep is P - 1 steps of the circle method over
// P = C rounded up to even columns (an odd C adds a dummy that pairs with nothing). The P / 2
// pairs of one step are disjoint, so the block's warps rotate them concurrently, one pair per warp
// at a time, lane i taking rows i, i + 32, ...; a __syncthreads separates the steps.
//
// Rotation threshold: svd_jacobi::jacobi_tolerance, shared with the warp kernel.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "svd_jacobi.cuh"

namespace jaxforge::svd_jacobi_block {

using svd_jacobi::Real;

constexpr int kThreads = 256;  // the shared-memory sweeps' block
constexpr int kWarps = kThreads / 32;
constexpr int kMaxThreads = 512;  // the slot sweeps' largest block (64 slots of 8 threads)
constexpr int kMaxRows = 256;  // R = max(m, n)
constexpr int kMaxCols = 128;  // C = min(m, n)
// The sweep cap. A float32 model of this kernel took 7-12 sweeps at condition 100, up to 24 at 1e6
// (C = 128) and 13-18 on rank-deficient matrices.
constexpr int kMaxSweeps = 40;

using Acc = double;  // V and the rotations (their real parts, for complex T)

template <typename T>
struct AccType {
  using type = Acc;
};
template <typename R>
struct AccType<Complex<R>> {
  using type = Complex<Acc>;
};
template <typename T>
using AccOf = typename AccType<T>::type;  // V's element

// The block's dynamic shared memory, in bytes from its start: V (C x C of AccOf<T>; none for the
// values alone) first, for its alignment, then W (R x C of T), the C column norms, a reduction slot
// a warp (both real) and perm (C ints: perm[r] = column holding the r-th largest norm). V and W
// are column-major with odd leading dims, as in the warp kernel: a column is stride-1 across lanes,
// a row spreads over the banks. jaxforge/lowering/linalg/svd/config.py mirrors `bytes` (with V).
struct BlockLayout {
  int ldw, ldv;
  int w_byte, s_byte, red_byte, perm_byte;
  int bytes;  // a multiple of 16
};

template <typename T>
__host__ __device__ inline BlockLayout block_layout(int rows, int cols, bool vectors = true) {
  BlockLayout l;
  l.ldw = rows | 1;
  l.ldv = cols | 1;
  l.w_byte = vectors ? l.ldv * cols * static_cast<int>(sizeof(AccOf<T>)) : 0;
  l.s_byte = l.w_byte + l.ldw * cols * static_cast<int>(sizeof(T));
  l.red_byte = l.s_byte + cols * static_cast<int>(sizeof(RealOf<T>));
  l.perm_byte = l.red_byte + kMaxThreads / 32 * static_cast<int>(sizeof(RealOf<T>));
  l.bytes = (l.perm_byte + cols * static_cast<int>(sizeof(int)) + 15) & ~15;
  return l;
}

// Orthogonalises columns p and q of W (rows long) and applies the same rotation to columns p and q
// of V (cols long; kV); one warp, warp-uniform control flow (the butterfly gives every lane the same
// sums). The rotation is the warp kernel's (svd_jacobi::jacobi_rotation: Rutishauser's, made unitary
// by the Gram entry's phase for complex T), computed in AccOf<T> from W's sums. Returns whether it
// rotated.
template <typename T, bool kV>
__device__ bool rotate_pair(T* W, int ldw, AccOf<T>* V, int ldv, int rows, int cols, int p, int q,
                            RealOf<T> tol, int lane) {
  using R = RealOf<T>;
  T* wp = W + p * ldw;
  T* wq = W + q * ldw;
  R alpha = R(0), beta = R(0);
  T gamma = T(0);
#pragma unroll 1
  for (int i = lane; i < rows; i += 32) {
    const T x = wp[i];
    const T y = wq[i];
    if constexpr (std::is_floating_point_v<T>) {
      alpha = Real<T>::fma_rn(x, x, alpha);
      beta = Real<T>::fma_rn(y, y, beta);
      gamma = Real<T>::fma_rn(x, y, gamma);
    } else {
      alpha += abs2(x);
      beta += abs2(y);
      gamma += conjugate(x) * y;
    }
  }
  svd_jacobi::warp_sum_gram(alpha, beta, gamma);
  if (!svd_jacobi::needs_rotation(alpha, beta, magnitude(gamma), tol)) return false;
  const auto rot = svd_jacobi::jacobi_rotation(Acc(alpha), Acc(beta), AccOf<T>(gamma));
  const T sp(rot.sp), sq(rot.sq);
  svd_jacobi::rotate_columns(wp, wq, rows, static_cast<R>(rot.c), sp, sq, lane);
  if constexpr (kV) svd_jacobi::rotate_columns(V + p * ldv, V + q * ldv, cols, rot.c, rot.sp, rot.sq, lane);
  return true;
}

// Sweeps of the parallel-ordered one-sided Jacobi on W, accumulating into V (kV). Block-uniform.
// Returns the sweeps used (the last rotated nothing), or -1 at the cap.
template <typename T, bool kV>
__device__ int jacobi_sweeps(T* W, int ldw, AccOf<T>* V, int ldv, int rows, int cols) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const RealOf<T> tol = svd_jacobi::jacobi_tolerance<RealOf<T>>(rows);
  const int players = cols + (cols & 1);
#pragma unroll 1
  for (int sweep = 1; sweep <= kMaxSweeps; ++sweep) {
    bool rotated = false;
#pragma unroll 1
    for (int t = 0; t < players - 1; ++t) {
#pragma unroll 1
      for (int pair = warp; pair < players / 2; pair += kWarps) {
        const int x = svd_jacobi::player(pair, t, players);
        const int y = svd_jacobi::player(players - 1 - pair, t, players);
        const int p = min(x, y);
        const int q = max(x, y);
        if (q < cols) rotated |= rotate_pair<T, kV>(W, ldw, V, ldv, rows, cols, p, q, tol, lane);
      }
      if (t < players - 2) __syncthreads();  // the next step pairs these columns with others
    }
    // The last step's barrier, which also tells every thread whether any warp rotated (a vote, not
    // a flag in shared memory that the warps would write at once).
    if (!__syncthreads_or(rotated)) return sweep;
  }
  return -1;
}

// The slot sweeps: for R <= 128, the one-warp kernel's column-pair sweeps
// (svd_jacobi::jacobi_sweeps_pairs) spread over a block. slot_count(R, C) slots of slot_lanes(R)
// threads (4 or 8 past 32 rows) each hold a pair of columns, X and Y, of W and of V in registers,
// a thread rows [16 j, 16 j + 16) of the four; the pair's Gram entries are the threads' partial
// sums added by an xor-butterfly inside the slot, and the rotation (computed, and applied to V, in
// Acc) touches no memory. The tournament is jacobi_sweeps_pairs' over twice as many players as
// slots, those past C zero columns. Between rounds one column of each
// pair moves: by shuffle where its next slot is in the same warp, else through shared memory (the
// `exchange` buffers, two so that one barrier a round suffices), which only the first slot of each
// warp needs in most rounds. Rounds whose moves all stay within warps pass no barrier. A Gram
// entry is rounded at most 6 + log2(lanes) times (svd_jacobi::lane_dot, then the butterfly),
// within jacobi_tolerance's floor for those rows (8 eps up to 32 rows, 9 to 64, 10 to 128).
//
// Past 64 columns (64 slots of 8 threads, 512 a block, at most 128 registers a thread) V's 16
// float64 rows of two columns do not fit beside W's: V stays in shared memory, where a column
// never moves and its slot's threads rotate their rows of it in place (rows part + lanes i, so the
// threads of a slot touch consecutive words). A column's rows of V are its W column's owner's to
// touch: when the W column moves inside a warp a __syncwarp orders the two owners, across warps
// the round's barrier does. For the values alone no V is held, and W's pairs fit registers up to
// 128 columns.
constexpr int kSlotsMaxCols = 128;
constexpr int kSlotsMaxColsInRegisters = 64;
constexpr int kSlotsMaxRows = 128;
constexpr int kSlotRows = svd_jacobi::kPairRows;

__host__ __device__ inline bool slots_fit(int rows, int cols) {
  return cols >= 1 && cols <= kSlotsMaxCols && rows >= cols && rows <= kSlotsMaxRows;
}

// Where the slot sweeps keep V: in registers, in shared memory (past kSlotsMaxColsInRegisters
// columns) or, for the values alone, nowhere.
enum class SlotV { kRegisters, kShared, kNone };

__host__ __device__ inline SlotV slot_v(int cols, bool vectors) {
  return !vectors ? SlotV::kNone : cols > kSlotsMaxColsInRegisters ? SlotV::kShared : SlotV::kRegisters;
}

// Threads a slot: R / 16 rounded up to a power of two (at least 2).
__host__ __device__ inline int slot_lanes(int rows) {
  int lanes = 2;
  while (lanes * kSlotRows < rows) lanes *= 2;
  return lanes;
}

// Slots: half of C rounded up to a power of two, and at least a warp's worth.
__host__ __device__ inline int slot_count(int rows, int cols) {
  int players = 2;
  while (players < cols) players *= 2;
  return max(players / 2, 32 / slot_lanes(rows));
}

// Bytes a thread sends through an exchange buffer: kSlotRows values of W, of V where V is in
// registers, and a column index.
template <typename T>
__host__ __device__ inline int slot_message_bytes(SlotV place) {
  const int v = place == SlotV::kRegisters ? static_cast<int>(sizeof(Acc)) : 0;
  return kSlotRows * (v + static_cast<int>(sizeof(T))) + static_cast<int>(sizeof(int));
}

// Where the two exchange buffers start: over W (which is in registers while they are in use), and
// over V too unless V stays in shared memory.
template <typename T>
__host__ __device__ inline int slots_exchange_byte(int rows, int cols, bool vectors) {
  return slot_v(cols, vectors) == SlotV::kShared ? block_layout<T>(rows, cols).w_byte : 0;
}

// The dynamic shared memory of the slot sweeps' launch.
template <typename T>
__host__ __device__ inline int slots_bytes(int rows, int cols, bool vectors = true) {
  const int threads = slot_count(rows, cols) * slot_lanes(rows);
  const int buffers = 2 * threads * slot_message_bytes<T>(slot_v(cols, vectors));
  const int exchange_end = slots_exchange_byte<T>(rows, cols, vectors) + buffers;
  return max(block_layout<T>(rows, cols, vectors).bytes, (exchange_end + 15) & ~15);
}

// One of the two exchange buffers: per thread kSlotRows values of V (where in registers) and of W,
// and a column index.
template <typename T>
struct SlotBuffers {
  Acc* v;
  T* w;
  int* id;
};

template <typename T, SlotV kV>
struct ExchangeBuffers {
  unsigned char* base;
  int threads;
  __device__ SlotBuffers<T> at(int which) const {  // the layout slot_message_bytes counts
    const int v_rows = kV == SlotV::kRegisters ? kSlotRows : 0;
    Acc* v = reinterpret_cast<Acc*>(base + which * threads * slot_message_bytes<T>(kV));
    T* w = reinterpret_cast<T*>(v + threads * v_rows);
    return {v, w, reinterpret_cast<int*>(w + threads * kSlotRows)};
  }
};

template <SlotV kV, typename T>
using SlotPair = svd_jacobi::ColumnPair<T, Acc, kV == SlotV::kRegisters>;

// The move before a round (svd_jacobi::ColumnPair::move from lane `source`, X and Y swapped first
// where `second`). With `write`, a slot of another warp reads ours: Y also goes to `sent`, at
// thread `tid`'s entries. With `cross` the block then meets the round's barrier, and where the
// new Y came from another warp (not `near`) it is read from `sent` at thread `src`'s entries.
// Without, a __syncwarp hands V's columns (in shared memory) over inside the warp.
template <SlotV kV, typename T>
__device__ __forceinline__ void move_pair(SlotPair<kV, T>& pair, int source, bool second, bool write,
                                          bool cross, bool near, int src, SlotBuffers<T> sent, int tid) {
  if (second) pair.swap();
  if (write) {
#pragma unroll
    for (int i = 0; i < kSlotRows; ++i) {
      sent.w[tid * kSlotRows + i] = pair.yw[i];
      if constexpr (kV == SlotV::kRegisters) sent.v[tid * kSlotRows + i] = pair.yv[i];
    }
    sent.id[tid] = pair.yid;
  }
  pair.move(source);
  if (!cross) {
    if constexpr (kV == SlotV::kShared) __syncwarp();
    return;
  }
  __syncthreads();
  if (near) return;
#pragma unroll
  for (int i = 0; i < kSlotRows; ++i) {
    pair.yw[i] = sent.w[src * kSlotRows + i];
    if constexpr (kV == SlotV::kRegisters) pair.yv[i] = sent.v[src * kSlotRows + i];
  }
  pair.yid = sent.id[src];
}

// Columns x and y of V (shared memory, `cols` long) rotated in place: rows part + lanes i.
__device__ __forceinline__ void rotate_shared_v(Acc* V, int ldv, int cols, int x, int y, Acc c, Acc s, int part,
                                                int lanes) {
#pragma unroll 4
  for (int r = part; r < cols; r += lanes) {
    const Acc p = V[x * ldv + r], q = V[y * ldv + r];
    V[x * ldv + r] = c * p - s * q;
    V[y * ldv + r] = s * p + c * q;
  }
}

// jacobi_sweeps for slots_fit shapes with slot_count * slot_lanes threads, V where slot_v places it;
// W (and V, where in registers) are read at the start and written at the end. Returns the sweeps
// used, or -1 at the cap.
template <SlotV kV, typename T>
__device__ int jacobi_sweeps_slots(T* W, int ldw, Acc* V, int ldv, int rows, int cols, unsigned char* smem) {
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int lanes = slot_lanes(rows);
  const int slots = slot_count(rows, cols);
  const int per_warp = 32 / lanes;  // slots a warp
  const int slot = tid / lanes;
  const int part = tid % lanes;
  const int row0 = part * kSlotRows;
  SlotPair<kV, T> pair;
  pair.xid = slot;  // past cols: a zero player
  pair.yid = slot + slots;
  pair.load(W, ldw, V, ldv, rows, cols, row0);
  const ExchangeBuffers<T, kV> buffers{smem + slots_exchange_byte<T>(rows, cols, kV != SlotV::kNone),
                                      slots * lanes};
  int buffer = 0;
  __syncthreads();  // the exchange buffers overlay W (and V)

  const T tol = svd_jacobi::jacobi_tolerance<T>(rows);
  int sweeps = -1;
#pragma unroll 1
  for (int sweep = 1; sweep <= kMaxSweeps && sweeps < 0; ++sweep) {
    bool rotated = false;
#pragma unroll 1
    for (int group = slots; group >= 1; group >>= 1) {
#pragma unroll 1
      for (int t = 0; t < group; ++t) {
        const svd_jacobi::TournamentMove move = svd_jacobi::tournament_move(slot, group, t, slots);
        const bool cross = move.split ? group >= per_warp : group > per_warp;  // block-uniform
        const bool near_from = move.from / per_warp == slot / per_warp;
        const bool write = cross && move.to / per_warp != slot / per_warp;
        const int source = near_from ? (move.from % per_warp) * lanes + part : lane;
        move_pair<kV>(pair, source, move.second, write, cross, near_from, move.from * lanes + part,
                            buffers.at(buffer), tid);
        buffer ^= cross;

        T alpha, beta, gamma;
        pair.gram(lanes, alpha, beta, gamma);
        if (svd_jacobi::needs_rotation(alpha, beta, gamma, tol)) {
          rotated = true;
          Acc c, s;
          svd_jacobi::rutishauser(Acc(alpha), Acc(beta), Acc(gamma), c, s);
          pair.rotate(c, s);
          if constexpr (kV == SlotV::kShared) rotate_shared_v(V, ldv, cols, pair.xid, pair.yid, c, s, part, lanes);
        }
      }
    }
    if (!__syncthreads_or(rotated)) sweeps = sweep;
  }
  // Every thread has read its last exchange (the sweep's last barrier) before W (and V) return.
  pair.store(W, ldw, V, ldv, rows, cols, row0);
  __syncthreads();
  return sweeps;
}

// Which sweeps a block runs: column pairs in shared memory (jacobi_sweeps), or in registers
// (jacobi_sweeps_slots) with V there too or, past kSlotsMaxColsInRegisters columns, in shared memory.
enum class BlockSweeps { kShared, kSlots, kSlotsSharedV };

// One matrix, executed by the whole block. The factors as in svd_jacobi::svd_one; without kVectors,
// s and info alone (no V in the layout; u and vt unused).
template <typename T, BlockSweeps kSweeps, bool kVectors>
__device__ void svd_one(const T* a, RealOf<T>* s, T* u, T* vt, int32_t* info, int m, int n,
                        const BlockLayout& l, unsigned char* smem) {
  using R = RealOf<T>;
  AccOf<T>* V = reinterpret_cast<AccOf<T>*>(smem);
  T* W = reinterpret_cast<T*>(smem + l.w_byte);
  R* sv = reinterpret_cast<R*>(smem + l.s_byte);
  R* red = reinterpret_cast<R*>(smem + l.red_byte);
  int* perm = reinterpret_cast<int*>(smem + l.perm_byte);
  const int tid = threadIdx.x;
  const int threads = blockDim.x;  // kThreads, or the slots' (at most kMaxThreads)
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int warps = threads >> 5;
  const bool transposed = m < n;
  const int rows = transposed ? n : m;
  const int cols = transposed ? m : n;
  const int k = cols;

  // Scale by a power of two (exact) so that max |a_ij| lies in [0.5, 1): squared norms, at most
  // 256 (512 complex), neither overflow nor lose the large entries to underflow.
  R amax = R(0);
  bool finite = true;
#pragma unroll 1
  for (int idx = tid; idx < m * n; idx += threads) {
    finite = finite && jaxforge::finite(a[idx]);
    amax = fmax(amax, max_part(a[idx]));
  }
  finite = __syncthreads_and(finite);
  amax = warp_max(amax);
  if (lane == 0) red[warp] = amax;
  __syncthreads();
  int sweeps = -1;
  int e = 0;
  if (finite) {
    R top = R(0);
    for (int w = 0; w < warps; ++w) top = fmax(top, red[w]);
    e = exponent(top);
    svd_jacobi::load_scaled(a, W, l.ldw, m, n, e, tid, threads);
#pragma unroll 1
    for (int idx = tid; kVectors && idx < cols * cols; idx += threads) {
      const int j = idx / cols;
      const int i = idx % cols;
      V[j * l.ldv + i] = AccOf<T>(Acc(i == j));
    }
    __syncthreads();
    if constexpr (kSweeps != BlockSweeps::kShared) {
      constexpr SlotV kV = !kVectors                               ? SlotV::kNone
                           : kSweeps == BlockSweeps::kSlotsSharedV ? SlotV::kShared
                                                                   : SlotV::kRegisters;
      sweeps = jacobi_sweeps_slots<kV>(W, l.ldw, V, l.ldv, rows, cols, smem);
    } else {
      sweeps = jacobi_sweeps<T, kVectors>(W, l.ldw, V, l.ldv, rows, cols);
    }
  }
  if (tid == 0) *info = sweeps;
  if (sweeps < 0) {
    svd_jacobi::fill(s, k, Real<R>::nan(), tid, threads);
    if constexpr (kVectors) {
      svd_jacobi::fill(u, m * k, splat<T>(Real<R>::nan()), tid, threads);
      svd_jacobi::fill(vt, k * n, splat<T>(Real<R>::nan()), tid, threads);
    }
    return;
  }

#pragma unroll 1
  for (int j = warp; j < cols; j += warps) {
    R sum = R(0);
#pragma unroll 1
    for (int i = lane; i < rows; i += 32) {
      const T x = W[j * l.ldw + i];
      if constexpr (std::is_floating_point_v<T>) {
        sum = Real<T>::fma_rn(x, x, sum);
      } else {
        sum = Real<R>::fma_rn(x.im, x.im, Real<R>::fma_rn(x.re, x.re, sum));
      }
    }
    sum = warp_sum(sum);
    if (lane == 0) sv[j] = Real<R>::sqrt(sum);
  }
  __syncthreads();
  svd_jacobi::rank_order(sv, perm, cols, tid, threads);
  __syncthreads();

#pragma unroll 1
  for (int r = tid; r < k; r += threads) s[r] = scale2(sv[perm[r]], e);
  if constexpr (!kVectors) return;
  if (transposed) {  // u = V, vt = (W / s)^T
    svd_jacobi::store_vectors(u, m, k, false, V, l.ldv, sv, false, perm, tid, threads);
    svd_jacobi::store_vectors(vt, n, k, true, W, l.ldw, sv, true, perm, tid, threads);
  } else {  // u = W / s, vt = V^T
    svd_jacobi::store_vectors(u, m, k, false, W, l.ldw, sv, true, perm, tid, threads);
    svd_jacobi::store_vectors(vt, n, k, true, V, l.ldv, sv, false, perm, tid, threads);
  }
  if (sv[perm[k - 1]] == R(0)) {  // the least norm: some vector of the normalised factor is zero
    __syncthreads();
    if (warp == 0) {
      svd_jacobi::complete_basis(transposed ? vt : u, rows, k, transposed, svd_jacobi::count_nonzero(sv, cols), lane);
    }
  }
}

// Grid-stride over matrices, one per block; u and vt are null without kVectors. The slot sweeps
// past 64 columns take 512 threads (V in shared memory, or none).
template <typename T, BlockSweeps kSweeps, bool kVectors>
__global__ void __launch_bounds__(kSweeps == BlockSweeps::kSlotsSharedV || (!kVectors && kSweeps == BlockSweeps::kSlots)
                                      ? kMaxThreads
                                      : kThreads)
    svd_jacobi_block_kernel(const T* __restrict__ a, RealOf<T>* __restrict__ s, T* __restrict__ u,
                            T* __restrict__ vt, int32_t* __restrict__ info, int64_t batch, int m,
                            int n) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int k = min(m, n);
  const BlockLayout l = block_layout<T>(max(m, n), k, kVectors);
  for (int64_t b = blockIdx.x; b < batch; b += gridDim.x) {
    svd_one<T, kSweeps, kVectors>(a + b * m * n, s + b * k, kVectors ? u + b * m * k : nullptr,
                                  kVectors ? vt + b * k * n : nullptr, info + b, m, n, l, smem);
    __syncthreads();  // the next matrix overwrites shared memory other warps may still be reading
  }
}

// Enqueues the batched SVD on `stream`. Requires batch >= 1, 1 <= m, n, max(m, n) <= kMaxRows,
// min(m, n) <= kMaxCols (kSlotSweeps: slots_fit) and the launch's shared memory (block_layout's
// bytes, or slots_bytes) within the device's opt-in per block (the FFI handler answers empty
// problems); u and vt may be null without kVectors. Returns the first CUDA error, cudaSuccess
// otherwise.
template <typename T, bool kSlotSweeps = false, bool kVectors = true>
cudaError_t launch(cudaStream_t stream, const T* a, RealOf<T>* s, T* u, T* vt, int32_t* info,
                   int64_t batch, int m, int n) {
  static_assert(!kSlotSweeps || std::is_same_v<T, float>, "the slot sweeps are float32's");
  const int rows = std::max(m, n), cols = std::min(m, n);
  const int bytes = kSlotSweeps ? slots_bytes<T>(rows, cols, kVectors) : block_layout<T>(rows, cols, kVectors).bytes;
  const int threads = kSlotSweeps ? slot_count(rows, cols) * slot_lanes(rows) : kThreads;
  auto kernel = svd_jacobi_block_kernel<T, BlockSweeps::kShared, kVectors>;
  if constexpr (kSlotSweeps) {  // (the values alone have no kSlotsSharedV kernel: it would never run)
    constexpr BlockSweeps kSharedV = kVectors ? BlockSweeps::kSlotsSharedV : BlockSweeps::kSlots;
    kernel = slot_v(cols, kVectors) == SlotV::kShared ? svd_jacobi_block_kernel<T, kSharedV, kVectors>
                                                      : svd_jacobi_block_kernel<T, BlockSweeps::kSlots, kVectors>;
  }
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err != cudaSuccess) return err;
  const int64_t blocks = std::min<int64_t>(batch, INT32_MAX);
  JAXFORGE_LAUNCH(kernel, static_cast<unsigned>(blocks), threads, bytes, stream)(a, s, u, vt, info, batch, m, n);
  return cudaGetLastError();
}

}  // namespace jaxforge::svd_jacobi_block
