// The kernels' `extern __shared__ unsigned char smem[]`, one per kernel namespace, and their
// registration, so that every emulated block starts from all-ones bytes (NaN for floats). Defines
// them: included by one file of each program the tests build (run_kernel.cc, ffi_handlers.cc).
#pragma once

#include "cuda_runtime.h"

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

inline void register_shared_memory() {
  emu::shared_arrays = {jaxforge::qr_r::smem, jaxforge::qr_solve_warp::smem, jaxforge::svd_jacobi::smem,
                        jaxforge::svd_jacobi_block::smem};
}
