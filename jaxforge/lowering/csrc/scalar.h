// Real and complex element types for kernels templated on T: a complex number is a pair of reals
// laid out as std::complex (so as XLA's C64/C128 buffers), with the few operations the kernels
// need, written once for the device and for the host emulation the tests compile them with.
// For real T every helper reduces to the plain operation.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <type_traits>

namespace jaxforge {

template <typename R>
struct Complex {
  R re, im;
  __host__ __device__ constexpr Complex(R re_ = R(0), R im_ = R(0)) : re(re_), im(im_) {}
  template <typename S>  // another width: rounded part by part
  __host__ __device__ explicit constexpr Complex(Complex<S> x) : re(static_cast<R>(x.re)), im(static_cast<R>(x.im)) {}
  __host__ __device__ Complex operator+(Complex b) const { return {re + b.re, im + b.im}; }
  __host__ __device__ Complex operator-(Complex b) const { return {re - b.re, im - b.im}; }
  __host__ __device__ Complex operator*(Complex b) const {
    return {re * b.re - im * b.im, re * b.im + im * b.re};
  }
  __host__ __device__ Complex operator*(R b) const { return {re * b, im * b}; }
  __host__ __device__ Complex operator/(R b) const { return {re / b, im / b}; }
  // Smith's algorithm: no intermediate |b|² to overflow or underflow.
  __host__ __device__ Complex operator/(Complex b) const {
    if (fabs(b.re) >= fabs(b.im)) {
      const R ratio = b.im / b.re, den = b.re + b.im * ratio;
      return {(re + im * ratio) / den, (im - re * ratio) / den};
    }
    const R ratio = b.re / b.im, den = b.re * ratio + b.im;
    return {(re * ratio + im) / den, (im * ratio - re) / den};
  }
  __host__ __device__ Complex& operator+=(Complex b) { return *this = *this + b; }
  __host__ __device__ Complex& operator-=(Complex b) { return *this = *this - b; }
  __host__ __device__ Complex& operator/=(Complex b) { return *this = *this / b; }
};

template <typename R>
__host__ __device__ inline Complex<R> operator*(R a, Complex<R> b) {
  return {a * b.re, a * b.im};
}

template <typename T>
struct Scalar {
  using Real = T;
};
template <typename R>
struct Scalar<Complex<R>> {
  using Real = R;
};
template <typename T>
using RealOf = typename Scalar<T>::Real;

template <typename R>
__host__ __device__ inline R conjugate(R x) { return x; }
template <typename R>
__host__ __device__ inline Complex<R> conjugate(Complex<R> x) { return {x.re, -x.im}; }

template <typename R>
__host__ __device__ inline R real_part(R x) { return x; }
template <typename R>
__host__ __device__ inline R real_part(Complex<R> x) { return x.re; }

template <typename R>
__host__ __device__ inline R imag_part(R) { return R(0); }
template <typename R>
__host__ __device__ inline R imag_part(Complex<R> x) { return x.im; }

// |x|²
template <typename R>
__host__ __device__ inline R abs2(R x) { return x * x; }
template <typename R>
__host__ __device__ inline R abs2(Complex<R> x) { return x.re * x.re + x.im * x.im; }

// |x| for real x, max(|Re x|, |Im x|) for complex: the magnitude that scaling decisions use (within
// √2 of |x|). fmax drops a NaN part, as it drops a NaN real.
template <typename R>
__host__ __device__ inline R max_part(R x) { return fabs(x); }
template <typename R>
__host__ __device__ inline R max_part(Complex<R> x) { return fmax(fabs(x.re), fabs(x.im)); }

// |x|
template <typename R>
__host__ __device__ inline R magnitude(R x) { return fabs(x); }
template <typename R>
__host__ __device__ inline R magnitude(Complex<R> x) { return hypot(x.re, x.im); }

template <typename R>
__host__ __device__ inline bool nonzero(R x) { return x != R(0); }  // true for NaN
template <typename R>
__host__ __device__ inline bool nonzero(Complex<R> x) { return x.re != R(0) || x.im != R(0); }

template <typename R>
__host__ __device__ inline bool finite(R x) { return isfinite(x); }
template <typename R>
__host__ __device__ inline bool finite(Complex<R> x) { return isfinite(x.re) && isfinite(x.im); }

// The T whose every part is x (a NaN marker, say).
template <typename T>
__host__ __device__ inline T splat(RealOf<T> x) {
  if constexpr (std::is_same_v<T, RealOf<T>>) {
    return x;
  } else {
    return T(x, x);
  }
}

// frexp's exponent: x = f 2^e with |f| in [1/2, 1), so x 2^-e lies there too; 0 for 0.
__host__ __device__ inline int exponent(float x) {
  int e;
  frexpf(x, &e);
  return e;
}
__host__ __device__ inline int exponent(double x) {
  int e;
  frexp(x, &e);
  return e;
}

// x 2^e, exact where the result is normal.
__host__ __device__ inline float scale2(float x, int e) { return ldexpf(x, e); }
__host__ __device__ inline double scale2(double x, int e) { return ldexp(x, e); }
template <typename R>
__host__ __device__ inline Complex<R> scale2(Complex<R> x, int e) {
  return {scale2(x.re, e), scale2(x.im, e)};
}

template <typename R>
__device__ inline R shfl_xor(R x, int offset) { return __shfl_xor_sync(0xffffffffu, x, offset); }
template <typename R>
__device__ inline Complex<R> shfl_xor(Complex<R> x, int offset) {
  return {shfl_xor(x.re, offset), shfl_xor(x.im, offset)};
}

}  // namespace jaxforge
