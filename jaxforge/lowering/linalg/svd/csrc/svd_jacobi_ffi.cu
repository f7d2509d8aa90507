// XLA FFI handlers for the batched one-warp Jacobi SVD (svd_jacobi.cuh), float32 and float64.
//
// Operand a: (*batch, m, n), row-major, m, n <= 32. Results, in order: s (*batch, k) descending,
// u (*batch, m, k), vt (*batch, k, n) with k = min(m, n) and a = u @ diag(s) @ vt, and
// info (*batch) int32: sweeps used, or -1 where the matrix held NaN/Inf or did not converge
// (s, u, vt all NaN there). Shapes beyond the limit are rejected with InvalidArgument.
#include <cuda_runtime.h>

#include <cstdint>

#include "csrc/xla_ffi.h"
#include "svd_jacobi.cuh"

namespace ffi = xla::ffi;
using jaxforge::ShapeString;
namespace sj = jaxforge::svd_jacobi;

namespace {

template <ffi::DataType DT>
ffi::Error SvdJacobiImpl(cudaStream_t stream, ffi::Buffer<DT> a, ffi::ResultBuffer<DT> s,
                         ffi::ResultBuffer<DT> u, ffi::ResultBuffer<DT> vt,
                         ffi::ResultBuffer<ffi::S32> info) {
  const auto dims = a.dimensions();
  if (dims.size() < 2) {
    return ffi::Error::InvalidArgument("svd_jacobi: operand must have rank >= 2, got shape " +
                                       ShapeString(dims));
  }
  const int64_t m = dims[dims.size() - 2];
  const int64_t n = dims[dims.size() - 1];
  if (m > sj::kMaxDim || n > sj::kMaxDim) {
    return ffi::Error::InvalidArgument("svd_jacobi: operand shape " + ShapeString(dims) +
                                       " exceeds the one-warp limit m, n <= " +
                                       std::to_string(sj::kMaxDim));
  }
  int64_t batch = 1;
  for (size_t i = 0; i + 2 < dims.size(); ++i) batch *= dims[i];
  const int64_t k = m < n ? m : n;
  // Guards against a caller whose result shapes disagree with the kernel's writes.
  if (s->element_count() != static_cast<size_t>(batch * k) ||
      u->element_count() != static_cast<size_t>(batch * m * k) ||
      vt->element_count() != static_cast<size_t>(batch * k * n) ||
      info->element_count() != static_cast<size_t>(batch)) {
    return ffi::Error::InvalidArgument("svd_jacobi: result shapes do not match operand shape " +
                                       ShapeString(dims));
  }
  const cudaError_t err =
      sj::launch(stream, a.typed_data(), s->typed_data(), u->typed_data(), vt->typed_data(),
                 info->typed_data(), batch, static_cast<int>(m), static_cast<int>(n));
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string("svd_jacobi: CUDA launch failed: ") +
                                cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

template <ffi::DataType DT>
auto SvdJacobiBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .template Arg<ffi::Buffer<DT>>()         // a
      .template Ret<ffi::Buffer<DT>>()         // s
      .template Ret<ffi::Buffer<DT>>()         // u
      .template Ret<ffi::Buffer<DT>>()         // vt
      .template Ret<ffi::Buffer<ffi::S32>>();  // info
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxforgeSvdJacobiF32, SvdJacobiImpl<ffi::F32>,
                              SvdJacobiBinding<ffi::F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxforgeSvdJacobiF64, SvdJacobiImpl<ffi::F64>,
                              SvdJacobiBinding<ffi::F64>());
