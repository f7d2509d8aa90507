// Checks the emulation's own machinery (cuda_runtime.h): fibers meeting at barriers, warp
// shuffles, threads that exit before a barrier, and a barrier no thread can complete.
// tests/lowering/linalg/test_kernels_emulated.py builds and runs it.
//
//   emulation_check barriers   prints, per block, the sum over live threads of their warp's tid sum
//   emulation_check deadlock   lane 0 waits for the block, the rest of warp 0 for the warp: aborts
//   emulation_check shuffled   lane 0 prints what lane 1 wrote before a shuffle they share: a race
//   emulation_check synced     the same after a __syncwarp: none (ThreadSanitizer tells them apart)
#include "cuda_runtime.h"

#include <cstdio>
#include <string>

namespace {

constexpr unsigned kThreads = 96;
int warp_sums[kThreads];

void barriers() {
  int sum = static_cast<int>(threadIdx.x);
  for (int mask = 16; mask >= 1; mask /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, mask);
  if (threadIdx.x % 3 == 0) return;  // drops out of the barriers below
  warp_sums[threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.x == 1) {
    long total = 0;
    for (unsigned t = 0; t < kThreads; ++t) total += t % 3 == 0 ? 0 : warp_sums[t];
    std::printf("block %u: %ld\n", blockIdx.x, total);
  }
  __syncthreads();
}

void deadlock() {
  if (threadIdx.x == 0 || threadIdx.x >= 32) {
    __syncthreads();
  } else {
    __syncwarp();
  }
}

int posted;

template <bool kSynced>
void handoff() {
  if (threadIdx.x == 1) posted = 7;
  const int lane_1 = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x), 1);
  if constexpr (kSynced) __syncwarp();
  if (threadIdx.x == 0) std::printf("lane %d posted %d\n", lane_1, posted);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc == 2 ? argv[1] : "";
  if (mode == "barriers") emu::launch(2, kThreads, 0, barriers);
  else if (mode == "deadlock") emu::launch(1, 64, 0, deadlock);
  else if (mode == "shuffled") emu::launch(1, 32, 0, handoff<false>);
  else if (mode == "synced") emu::launch(1, 32, 0, handoff<true>);
  else return 2;
  return 0;
}
