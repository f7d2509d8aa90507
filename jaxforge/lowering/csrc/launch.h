// JAXFORGE_LAUNCH(kernel, grid, threads, shared_bytes, stream)(args...): a kernel launch, written
// once for nvcc (kernel<<<...>>>(args...)) and for the host emulation the tests compile the kernel
// headers with (tests/cuda_emulation/cuda_runtime.h), where the launcher's own configuration then
// runs on CPU threads.
#pragma once

#ifdef JAXFORGE_HOST_EMULATION
#define JAXFORGE_LAUNCH(kernel, grid, threads, shared_bytes, stream)                         \
  ::emu::launcher((grid), (threads), (shared_bytes), ::emu::kernel_id(kernel),                \
                  [=](auto... args) { kernel(args...); })
#else
#define JAXFORGE_LAUNCH(kernel, grid, threads, shared_bytes, stream) \
  kernel<<<(grid), (threads), (shared_bytes), (stream)>>>
#endif
