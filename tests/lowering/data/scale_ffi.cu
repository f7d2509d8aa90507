// A minimal XLA FFI handler (y = s·x), for testing the kernel build and cache without a GPU.
#include <cuda_runtime.h>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

__global__ void ScaleKernel(const float* x, float* y, long n, float s) {
  long i = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x;
  if (i < n) y[i] = s * x[i];
}

static ffi::Error ScaleImpl(cudaStream_t stream, float s, ffi::Buffer<ffi::F32> x,
                            ffi::ResultBuffer<ffi::F32> y) {
  long n = static_cast<long>(x.element_count());
  if (n > 0) ScaleKernel<<<(n + 255) / 256, 256, 0, stream>>>(x.typed_data(), y->typed_data(), n, s);
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? ffi::Error::Success() : ffi::Error::Internal(cudaGetErrorString(e));
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxforgeTestScale, ScaleImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Attr<float>("s")
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
