// A CPU XLA FFI handler for tests/transforms/test_sharding_rules.py: the sums of the rows of a
// batch of matrices, (..., m, n) -> (..., m), and for each matrix the number of matrices the call
// was handed, which tells whether XLA's partitioner split the batch.
#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

static ffi::Error RowSumsImpl(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> sums,
                              ffi::ResultBuffer<ffi::S32> seen) {
  const int64_t n = x.dimensions().back();
  for (int64_t row = 0; row < static_cast<int64_t>(sums->element_count()); ++row) {
    float sum = 0.0f;
    for (int64_t col = 0; col < n; ++col) sum += x.typed_data()[row * n + col];
    sums->typed_data()[row] = sum;
  }
  const int64_t matrices = static_cast<int64_t>(seen->element_count());
  for (int64_t b = 0; b < matrices; ++b) seen->typed_data()[b] = static_cast<int32_t>(matrices);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(RowSums, RowSumsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
