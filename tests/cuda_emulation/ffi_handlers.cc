// The linalg kernels' XLA FFI handlers (their .cu files, compiled by the host compiler with
// JAXFORGE_HOST_EMULATION) built with this file into one library, which
// tests/lowering/linalg/test_kernels_through_ffi.py registers as CPU targets under the kernels'
// own names: the cuda lowerings' calls then run the handlers and the emulated kernels on a CPU.
#include "shared_memory.h"

namespace {
const bool registered = (register_shared_memory(), true);
}  // namespace
