// Butterfly (xor-shuffle) reductions over a warp that leave the same bits in every lane: lane l adds
// x_l + x_{l^off} and lane l^off the same two operands, and the rounded add (no contraction into an
// FMA with a product feeding it) keeps both sums identical, so control flow on the result stays
// warp-uniform. All 32 lanes must call them.
#pragma once

#include <cuda_runtime.h>

#include "csrc/scalar.h"

namespace jaxforge {

__device__ __forceinline__ float add_rn(float x, float y) { return __fadd_rn(x, y); }
__device__ __forceinline__ double add_rn(double x, double y) { return __dadd_rn(x, y); }

template <typename T>
__device__ __forceinline__ T warp_sum(T x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x = add_rn(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}

template <typename R>
__device__ __forceinline__ Complex<R> warp_sum(Complex<R> x) {
  return {warp_sum(x.re), warp_sum(x.im)};
}

template <typename T>
__device__ __forceinline__ T warp_max(T x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x = fmax(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}

}  // namespace jaxforge
