// The XLA FFI API for jaxforge's handlers, and what they share: nvcc's front end and the host
// compiler flag benign patterns in the XLA headers (a missing return after an exhaustive switch,
// always_inline on templates), which are kept out of each build's warnings here, once.
#pragma once

#include <cuda_runtime.h>

#include <complex>
#include <cstdint>
#include <optional>
#include <string>

#pragma nv_diagnostic push
#pragma nv_diag_suppress 940, 2473
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wreturn-type"
#include "xla/ffi/api/ffi.h"
#pragma GCC diagnostic pop
#pragma nv_diagnostic pop

#include "csrc/scalar.h"

namespace jaxforge {

// The context a handler binds for its stream: the CUDA stream XLA runs it on; under the host
// emulation (tests/cuda_emulation/, where the tests register the handlers as CPU targets) a null
// one, as the emulated kernels run on the calling thread.
#ifdef JAXFORGE_HOST_EMULATION
struct Stream {};
#else
using Stream = xla::ffi::PlatformStream<cudaStream_t>;
#endif

// The kernels' element type for an FFI buffer's: Complex<R> for std::complex<R> (same layout).
template <typename N>
struct KernelType {
  using type = N;
};
template <typename R>
struct KernelType<std::complex<R>> {
  using type = Complex<R>;
};

// An FFI buffer's data as the kernels' element type.
template <typename N>
typename KernelType<N>::type* KernelData(N* data) {
  return reinterpret_cast<typename KernelType<N>::type*>(data);
}
template <typename N>
const typename KernelType<N>::type* KernelData(const N* data) {
  return reinterpret_cast<const typename KernelType<N>::type*>(data);
}

// The product of the batch dims, all but the last two.
inline int64_t BatchSize(xla::ffi::Span<const int64_t> dims) {
  int64_t batch = 1;
  for (size_t i = 0; i + 2 < dims.size(); ++i) batch *= dims[i];
  return batch;
}

// "(d0, d1, ...)", for error messages that name the shape they refuse.
inline std::string ShapeString(xla::ffi::Span<const int64_t> dims) {
  std::string out = "(";
  for (size_t i = 0; i < dims.size(); ++i) out += (i ? ", " : "") + std::to_string(dims[i]);
  return out + ")";
}

}  // namespace jaxforge

#ifdef JAXFORGE_HOST_EMULATION
template <>
struct xla::ffi::CtxDecoding<jaxforge::Stream> {
  using Type = cudaStream_t;
  static std::optional<Type> Decode(const XLA_FFI_Api*, XLA_FFI_ExecutionContext*, DiagnosticEngine&) {
    return nullptr;
  }
};
#endif
