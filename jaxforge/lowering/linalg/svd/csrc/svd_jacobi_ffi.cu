// XLA FFI handlers for the batched Jacobi SVDs: one warp per matrix (svd_jacobi.cuh, m, n <= 32,
// float32, float64, complex64 and complex128 with a row a lane; float32 also with a column a lane or
// two lanes a column pair) and one block per matrix (svd_jacobi_block.cuh, all four types,
// max(m, n) <= 256, min(m, n) <= 128, within the device's shared memory per block; the column pairs
// in shared memory, or, for float32 with max(m, n) <= 128, in registers).
//
// Operand a: (*batch, m, n), row-major. Results, in order: s (*batch, k) descending and real,
// u (*batch, m, k), vt (*batch, k, n) with k = min(m, n) and a = u @ diag(s) @ vt, and
// info (*batch) int32: sweeps used, or -1 where the matrix held NaN/Inf or did not converge
// (s, u, vt all NaN there); 0 for empty matrices, which launch no kernel. Shapes beyond a
// kernel's limit are rejected with InvalidArgument. Each handler has a twin for the values alone
// (its symbol ending in Values): results s and info only, the same bits as the full one's.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "csrc/xla_ffi.h"
#include "svd_jacobi.cuh"
#include "svd_jacobi_block.cuh"

namespace ffi = xla::ffi;
using jaxforge::KernelData;
using jaxforge::ShapeString;
namespace sj = jaxforge::svd_jacobi;
namespace sjb = jaxforge::svd_jacobi_block;

namespace {

enum class Kernel { kWarp, kWarpLanes, kWarpPairs, kBlock, kBlockSlots };

// u and vt: the singular vectors' results, or both null for the values alone.
template <ffi::DataType DT, Kernel K>
ffi::Error SvdJacobiImpl(cudaStream_t stream, ffi::Buffer<DT> a, ffi::ResultBuffer<ffi::ToReal(DT)> s,
                         ffi::ResultBuffer<DT>* u, ffi::ResultBuffer<DT>* vt,
                         ffi::ResultBuffer<ffi::S32> info) {
  const std::string name = K == Kernel::kWarp        ? "svd_jacobi"
                           : K == Kernel::kWarpLanes ? "svd_jacobi_lanes"
                           : K == Kernel::kWarpPairs ? "svd_jacobi_pairs"
                           : K == Kernel::kBlock     ? "svd_jacobi_block"
                                                     : "svd_jacobi_slots";
  constexpr bool kOneWarp = K != Kernel::kBlock && K != Kernel::kBlockSlots;
  const auto dims = a.dimensions();
  if (dims.size() < 2) {
    return ffi::Error::InvalidArgument(name + ": operand must have rank >= 2, got shape " +
                                       ShapeString(dims));
  }
  const int64_t m = dims[dims.size() - 2];
  const int64_t n = dims[dims.size() - 1];
  const int64_t rows = std::max(m, n), cols = std::min(m, n);
  const bool fits = kOneWarp              ? m <= sj::kMaxDim && n <= sj::kMaxDim
                    : K == Kernel::kBlock ? rows <= sjb::kMaxRows && cols <= sjb::kMaxCols
                                          : sjb::slots_fit(rows, cols);
  if (!fits) {
    const std::string limit = kOneWarp              ? "m, n <= 32"
                              : K == Kernel::kBlock ? "max(m, n) <= 256, min(m, n) <= 128"
                                                    : "max(m, n) <= 128";
    return ffi::Error::InvalidArgument(name + ": operand shape " + ShapeString(dims) +
                                       " exceeds the limit " + limit);
  }
  const int64_t batch = jaxforge::BatchSize(dims);
  const int64_t k = std::min(m, n);
  // Guards against a caller whose result shapes disagree with the kernel's writes.
  const bool vectors = u != nullptr;
  if (s->element_count() != static_cast<size_t>(batch * k) ||
      (vectors && ((*u)->element_count() != static_cast<size_t>(batch * m * k) ||
                   (*vt)->element_count() != static_cast<size_t>(batch * k * n))) ||
      info->element_count() != static_cast<size_t>(batch)) {
    return ffi::Error::InvalidArgument(name + ": result shapes do not match operand shape " +
                                       ShapeString(dims));
  }
  using T = typename jaxforge::KernelType<ffi::NativeType<DT>>::type;
  T* u_data = vectors ? KernelData((*u)->typed_data()) : nullptr;
  T* vt_data = vectors ? KernelData((*vt)->typed_data()) : nullptr;
  const auto launch = [&](auto with_vectors) -> cudaError_t {
    constexpr bool kVectors = decltype(with_vectors)::value;
    // Instantiates only this kernel's launcher.
    if constexpr (kOneWarp) {
      constexpr sj::Sweeps kSweeps = K == Kernel::kWarpLanes   ? sj::Sweeps::kLanes
                                     : K == Kernel::kWarpPairs ? sj::Sweeps::kPairs
                                                               : sj::Sweeps::kRows;
      return sj::launch<T, kSweeps, kVectors>(stream, KernelData(a.typed_data()), s->typed_data(), u_data,
                                              vt_data, info->typed_data(), batch, static_cast<int>(m),
                                              static_cast<int>(n));
    } else {
      return sjb::launch<T, K == Kernel::kBlockSlots, kVectors>(stream, KernelData(a.typed_data()), s->typed_data(), u_data,
                                                                vt_data, info->typed_data(), batch,
                                                                static_cast<int>(m), static_cast<int>(n));
    }
  };
  cudaError_t err = cudaSuccess;  // nothing to launch for an empty batch, for either kernel
  if (batch > 0 && k == 0) {
    err = cudaMemsetAsync(info->typed_data(), 0, batch * sizeof(int32_t), stream);
  } else if (batch > 0) {
    err = vectors ? launch(std::true_type()) : launch(std::false_type());
  }
  if (err != cudaSuccess) {
    return ffi::Error::Internal(name + ": CUDA launch failed: " + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

template <ffi::DataType DT, Kernel K>
ffi::Error SvdJacobiVectors(cudaStream_t stream, ffi::Buffer<DT> a, ffi::ResultBuffer<ffi::ToReal(DT)> s,
                            ffi::ResultBuffer<DT> u, ffi::ResultBuffer<DT> vt, ffi::ResultBuffer<ffi::S32> info) {
  return SvdJacobiImpl<DT, K>(stream, a, s, &u, &vt, info);
}

template <ffi::DataType DT, Kernel K>
ffi::Error SvdJacobiValues(cudaStream_t stream, ffi::Buffer<DT> a, ffi::ResultBuffer<ffi::ToReal(DT)> s,
                           ffi::ResultBuffer<ffi::S32> info) {
  return SvdJacobiImpl<DT, K>(stream, a, s, nullptr, nullptr, info);
}

template <ffi::DataType DT>
auto SvdJacobiBinding() {
  return ffi::Ffi::Bind()
      .Ctx<jaxforge::Stream>()
      .template Arg<ffi::Buffer<DT>>()         // a
      .template Ret<ffi::Buffer<ffi::ToReal(DT)>>()  // s
      .template Ret<ffi::Buffer<DT>>()         // u
      .template Ret<ffi::Buffer<DT>>()         // vt
      .template Ret<ffi::Buffer<ffi::S32>>();  // info
}

template <ffi::DataType DT>
auto SvdJacobiValuesBinding() {
  return ffi::Ffi::Bind()
      .Ctx<jaxforge::Stream>()
      .template Arg<ffi::Buffer<DT>>()         // a
      .template Ret<ffi::Buffer<ffi::ToReal(DT)>>()  // s
      .template Ret<ffi::Buffer<ffi::S32>>();  // info
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxforgeSvdJacobiF32, (SvdJacobiVectors<ffi::F32, Kernel::kWarp>),
                              SvdJacobiBinding<ffi::F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxforgeSvdJacobiF32Values, (SvdJacobiValues<ffi::F32, Kernel::kWarp>),
                              SvdJacobiValuesBinding<ffi::F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxforgeSvdJacobiF64, (SvdJacobiVectors<ffi::F64, Kernel::kWarp>),
                              SvdJacobiBinding<ffi::F64>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxforgeSvdJacobiF64Values, (SvdJacobiValues<ffi::F64, Kernel::kWarp>),
                              SvdJacobiValuesBinding<ffi::F64>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxforgeSvdJacobiC64, (SvdJacobiVectors<ffi::C64, Kernel::kWarp>),
                              SvdJacobiBinding<ffi::C64>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxforgeSvdJacobiC64Values, (SvdJacobiValues<ffi::C64, Kernel::kWarp>),
                              SvdJacobiValuesBinding<ffi::C64>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxforgeSvdJacobiC128, (SvdJacobiVectors<ffi::C128, Kernel::kWarp>),
                              SvdJacobiBinding<ffi::C128>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxforgeSvdJacobiC128Values, (SvdJacobiValues<ffi::C128, Kernel::kWarp>),
                              SvdJacobiValuesBinding<ffi::C128>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxforgeSvdJacobiLanesF32, (SvdJacobiVectors<ffi::F32, Kernel::kWarpLanes>),
                              SvdJacobiBinding<ffi::F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxforgeSvdJacobiLanesF32Values, (SvdJacobiValues<ffi::F32, Kernel::kWarpLanes>),
                              SvdJacobiValuesBinding<ffi::F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxforgeSvdJacobiPairsF32, (SvdJacobiVectors<ffi::F32, Kernel::kWarpPairs>),
                              SvdJacobiBinding<ffi::F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxforgeSvdJacobiPairsF32Values, (SvdJacobiValues<ffi::F32, Kernel::kWarpPairs>),
                              SvdJacobiValuesBinding<ffi::F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxforgeSvdJacobiBlockF32, (SvdJacobiVectors<ffi::F32, Kernel::kBlock>),
                              SvdJacobiBinding<ffi::F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxforgeSvdJacobiBlockF32Values, (SvdJacobiValues<ffi::F32, Kernel::kBlock>),
                              SvdJacobiValuesBinding<ffi::F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxforgeSvdJacobiBlockF64, (SvdJacobiVectors<ffi::F64, Kernel::kBlock>),
                              SvdJacobiBinding<ffi::F64>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxforgeSvdJacobiBlockF64Values, (SvdJacobiValues<ffi::F64, Kernel::kBlock>),
                              SvdJacobiValuesBinding<ffi::F64>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxforgeSvdJacobiBlockC64, (SvdJacobiVectors<ffi::C64, Kernel::kBlock>),
                              SvdJacobiBinding<ffi::C64>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxforgeSvdJacobiBlockC64Values, (SvdJacobiValues<ffi::C64, Kernel::kBlock>),
                              SvdJacobiValuesBinding<ffi::C64>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxforgeSvdJacobiBlockC128, (SvdJacobiVectors<ffi::C128, Kernel::kBlock>),
                              SvdJacobiBinding<ffi::C128>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxforgeSvdJacobiBlockC128Values, (SvdJacobiValues<ffi::C128, Kernel::kBlock>),
                              SvdJacobiValuesBinding<ffi::C128>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxforgeSvdJacobiSlotsF32, (SvdJacobiVectors<ffi::F32, Kernel::kBlockSlots>),
                              SvdJacobiBinding<ffi::F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxforgeSvdJacobiSlotsF32Values, (SvdJacobiValues<ffi::F32, Kernel::kBlockSlots>),
                              SvdJacobiValuesBinding<ffi::F32>());
