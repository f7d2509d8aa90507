// The linalg kernels' XLA FFI handlers (their .cu files, compiled by the host compiler with
// JAXFORGE_HOST_EMULATION) built with this file into one library, which
// tests/lowering/linalg/test_kernels_through_ffi.py registers as CPU targets under the kernels'
// own names: the cuda lowerings' calls then run the handlers and the emulated kernels on a CPU.
#include "cuda_runtime.h"

// The kernels' `extern __shared__ unsigned char smem[]`, one per kernel namespace, registered so
// that every emulated block starts from all-ones bytes.
namespace jaxforge::qr_r {
alignas(16) unsigned char smem[emu::kSharedBytes];
}
namespace jaxforge::qr_solve_warp {
alignas(16) unsigned char smem[emu::kSharedBytes];
}
namespace jaxforge::svd_jacobi {
alignas(16) unsigned char smem[emu::kSharedBytes];
}
namespace jaxforge::svd_jacobi_block {
alignas(16) unsigned char smem[emu::kSharedBytes];
}

namespace {
const bool registered = [] {
  emu::shared_arrays = {jaxforge::qr_r::smem, jaxforge::qr_solve_warp::smem, jaxforge::svd_jacobi::smem,
                        jaxforge::svd_jacobi_block::smem};
  return true;
}();
}  // namespace
