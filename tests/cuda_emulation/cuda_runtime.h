// Host emulation of the CUDA subset jaxforge's kernels use, so that their logic runs on a CPU.
//
// Shadows <cuda_runtime.h> (it comes first on the include path) when a kernel header, or a
// kernel's FFI handler, is compiled by the host compiler with JAXFORGE_HOST_EMULATION defined.
// Every CUDA thread of a block is a fiber on the calling OS thread (started by
// makecontext/setcontext, then switched by __builtin_setjmp and __builtin_longjmp, which unlike
// swapcontext make no signal-mask syscall: the block SVD of a 72x66 matrix, 512 threads, runs in
// 2 s instead of 20), run round-robin and switched only where it waits:
// __syncthreads and __syncwarp are barriers of the block's and the warp's fibers, shuffles and
// votes exchange through a per-warp slot array between two warp barriers, and a thread that
// returns drops out of both barriers (as an exited thread does). Blocks run one after another.
// Between two barriers each thread runs alone, in thread order (or the reverse, where the
// environment sets JAXFORGE_EMULATED_THREAD_ORDER=reverse), so a read of memory that another
// thread writes without a sync between sees the old bytes (all ones, NaN, for shared memory at
// first) for every writer after it: such races give wrong results here, or results that differ
// between the two orders. A barrier some thread can never reach stops the run with a message
// instead of hanging, and a launch that asks for more than 48 KiB of dynamic shared memory without
// the kernel's cudaFuncSetAttribute opt-in aborts, as a GPU refuses it. Built with
// AddressSanitizer, it reports an access past the dynamic shared memory a launch asked for; built
// with ThreadSanitizer, any race within a block, whatever the order (see happens_before below).
// JAXFORGE_EMULATED_GRID caps the blocks a launch runs (see grid_limit).
//
// It checks logic (indexing, reductions, convergence, NaN paths) and, sanitized, CUDA's ordering
// of memory within a block, not timing, occupancy or register limits; a kernel still has to pass
// its gpu tests on a GPU.
#pragma once

#include <math.h>
#include <ucontext.h>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#endif
#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
#endif

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__
#define __align__(n)
#define __launch_bounds__(...)

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};

namespace emu {

// Dynamic shared memory: the harness defines each kernel namespace's `smem` with kSharedBytes and
// registers it, so that every block starts from all-ones bytes (NaN for floats), not zeros. Under
// AddressSanitizer the bytes past a launch's dynamic shared memory are poisoned.
constexpr size_t kSharedBytes = 256 * 1024;
inline std::vector<unsigned char*> shared_arrays;

inline void shared_memory_for(size_t bytes) {
  for (unsigned char* shared : shared_arrays) {
#if defined(__SANITIZE_ADDRESS__)
    ASAN_UNPOISON_MEMORY_REGION(shared, kSharedBytes);
    const size_t usable = (bytes + 7) / 8 * 8;  // ASan's granule
    ASAN_POISON_MEMORY_REGION(shared + usable, kSharedBytes - usable);
#endif
    std::memset(shared, 0xff, bytes);
  }
}

// Under ThreadSanitizer every fiber is a TSan fiber, switched without ordering anything, and the
// only happens-before edges are the ones CUDA promises within a block: __syncthreads and __syncwarp
// (shuffles and votes exchange values but order no memory), and a block's start after the launch
// and its end before the next block (blocks run in turn, so races between blocks go unseen). TSan
// then reports any two accesses of a block's threads, one a write, that no barrier orders: in
// whatever order the threads run. The emulation's own bookkeeping is left uninstrumented (and out of
// line, so that it stays so).
#if defined(__SANITIZE_THREAD__)
#define EMU_UNCHECKED gnu::no_sanitize_thread, gnu::noinline
inline void happens_before(void* sync) { __tsan_release(sync); }
inline void happens_after(void* sync) { __tsan_acquire(sync); }
#else
#define EMU_UNCHECKED gnu::noinline
inline void happens_before(void*) {}
inline void happens_after(void*) {}
#endif

inline dim3 block_dim, grid_dim, thread_idx, block_idx;  // thread_idx: the running fiber's
inline long progress = 0;  // arrivals and finished threads; a pass of the block without any: deadlock

// Where a fiber or the scheduler waits: saved by __builtin_setjmp (0, then 1 when resumed),
// resumed by jump_to. The switches are kept from AddressSanitizer (no_sanitize_address; the builtins
// have no interceptor): before each jump out of a function it would unpoison the whole stack it
// leaves, at a syscall a switch, which made the sanitized runs 25 times slower.
using Context = void* [5];

[[gnu::no_sanitize_address, EMU_UNCHECKED]] inline void jump_to(Context& context) { __builtin_longjmp(context, 1); }

// A fiber's first entry (its own stack) and, once it has run, where it waits to be resumed.
struct Fiber {
  ucontext_t start;
  Context resume;
  bool started = false;
#if defined(__SANITIZE_THREAD__)
  void* tsan = __tsan_create_fiber(0);
  Fiber() = default;
  Fiber(const Fiber&) = delete;
  ~Fiber() { __tsan_destroy_fiber(tsan); }
#endif
};
inline Context scheduler;
inline Fiber* running = nullptr;

// Tells ThreadSanitizer which fiber runs next (`fiber`, or the scheduler for nullptr), just before
// the jump there; a switch orders nothing.
inline void* scheduler_tsan = nullptr;
inline void switching_to([[maybe_unused]] Fiber* fiber) {
#if defined(__SANITIZE_THREAD__)
  __tsan_switch_to_fiber(fiber ? fiber->tsan : scheduler_tsan, __tsan_switch_to_fiber_no_sync);
#endif
}

[[gnu::no_sanitize_address, EMU_UNCHECKED]] inline void yield() {
  if (__builtin_setjmp(running->resume) == 0) {
    switching_to(nullptr);
    jump_to(scheduler);
  }
}

// Runs `fiber` until it yields or finishes, then returns here, on the scheduler's stack.
[[gnu::no_sanitize_address, EMU_UNCHECKED]] inline void resume(Fiber& fiber) {
  running = &fiber;
  if (__builtin_setjmp(scheduler) != 0) return;
  switching_to(&fiber);
  if (!fiber.started) {
    fiber.started = true;
    setcontext(&fiber.start);
  }
  jump_to(fiber.resume);
}

// A barrier of `expected` fibers; phases complete when the last one arrives. Where it orders
// memory (a sync, not a shuffle), what each fiber did before it happens before what any does after
// it; the phases alternate two sync addresses, so that a fiber already at the next phase's barrier
// adds nothing to this one's.
struct Barrier {
  int expected;
  int arrived = 0;
  unsigned phase = 0;
  char sync[2] = {};
  [[EMU_UNCHECKED]] void arrive_and_wait(bool orders_memory) {
    ++progress;
    const unsigned mine = phase;
    if (orders_memory) happens_before(&sync[mine % 2]);
    if (++arrived == expected) {
      arrived = 0, ++phase;
    } else {
      while (phase == mine) yield();
    }
    if (orders_memory) happens_after(&sync[mine % 2]);
  }
  [[EMU_UNCHECKED]] void arrive_and_drop() {
    if (--expected > 0 && arrived == expected) arrived = 0, ++phase;
  }
};

struct Block {
  explicit Block(int threads) : all{threads}, vote(threads), slots(threads) {
    for (int w = 0; w < (threads + 31) / 32; ++w) warps.push_back({std::min(32, threads - 32 * w)});
  }
  Barrier all;
  std::vector<Barrier> warps;
  std::vector<int> vote;
  std::vector<uint64_t> slots;  // one 8-byte exchange slot per thread
};

inline Block* block = nullptr;
inline std::function<void()> kernel_body;
inline std::vector<char>* finished = nullptr;

inline unsigned tid() { return thread_idx.x; }
inline Barrier& warp() { return block->warps[tid() / 32]; }

// A block's start and end, as sync addresses: after the launch's writes, before its reads.
inline char block_start, block_end;

[[gnu::no_sanitize_address, EMU_UNCHECKED]] inline void fiber_entry() {
  happens_after(&block_start);
  kernel_body();
  block->all.arrive_and_drop();
  warp().arrive_and_drop();
  (*finished)[tid()] = 1;
  ++progress;
  happens_before(&block_end);
  switching_to(nullptr);
  jump_to(scheduler);  // never returns: its stack is freed with the block
}

// Whether threads run in reverse order between barriers (see the top).
inline bool reverse_order() {
  static const bool reverse = [] {
    const char* order = std::getenv("JAXFORGE_EMULATED_THREAD_ORDER");
    return order != nullptr && std::strcmp(order, "reverse") == 0;
  }();
  return reverse;
}

// At most how many blocks a launch runs (JAXFORGE_EMULATED_GRID; else all it asks for). The kernels'
// grid-stride loops then take each block through several matrices, and through the syncs that keep
// one matrix's writes from another's reads, which a grid of one block a matrix never reaches.
inline unsigned grid_limit() {
  static const unsigned limit = [] {
    const char* blocks = std::getenv("JAXFORGE_EMULATED_GRID");
    return blocks != nullptr ? std::max(1u, static_cast<unsigned>(std::strtoul(blocks, nullptr, 10))) : ~0u;
  }();
  return limit;
}

// Launches run one at a time (the state above is shared): XLA may call the handlers that make them
// from several threads, one a device.
inline std::mutex launching;

// Runs body() as grid blocks of `threads` threads (1-D launches, as the kernels make) with
// `shared_bytes` of dynamic shared memory.
template <typename Body>
[[EMU_UNCHECKED]] void launch(unsigned grid, unsigned threads, size_t shared_bytes, Body body) {
  constexpr size_t kStackBytes = 128 * 1024;
  const std::lock_guard<std::mutex> one_at_a_time(launching);
  grid = std::min(grid, grid_limit());
  grid_dim = {grid, 1, 1};
  block_dim = {threads, 1, 1};
  kernel_body = body;
#if defined(__SANITIZE_THREAD__)
  scheduler_tsan = __tsan_get_current_fiber();
#endif
  for (unsigned b = 0; b < grid; ++b) {
    shared_memory_for(shared_bytes);
    Block state(static_cast<int>(threads));
    std::vector<char> done(threads, 0);
    block = &state, finished = &done, block_idx = {b, 0, 0};
    std::vector<Fiber> fibers(threads);
    std::vector<std::unique_ptr<char[]>> stacks;
    for (Fiber& fiber : fibers) {
      stacks.push_back(std::make_unique<char[]>(kStackBytes));
      getcontext(&fiber.start);
      fiber.start.uc_stack.ss_sp = stacks.back().get();
      fiber.start.uc_stack.ss_size = kStackBytes;
      fiber.start.uc_link = nullptr;
      makecontext(&fiber.start, fiber_entry, 0);
    }
    happens_before(&block_start);
    for (unsigned left = threads; left > 0;) {
      const long before = progress;
      for (unsigned i = 0; i < threads; ++i) {
        const unsigned t = reverse_order() ? threads - 1 - i : i;
        if (done[t]) continue;
        thread_idx = {t, 0, 0};
        resume(fibers[t]);
        left -= done[t];
      }
      if (left > 0 && progress == before) {
        std::fprintf(stderr, "emulated block %u: deadlock, %u threads wait at barriers that cannot complete\n", b, left);
        std::abort();
      }
    }
    happens_after(&block_end);
    block = nullptr, finished = nullptr;
  }
}

// A shuffle's value from `source_lane`; like a vote below, it orders no memory.
template <typename T>
[[EMU_UNCHECKED]] T exchange(T value, unsigned source_lane) {
  static_assert(sizeof(T) <= 8);
  std::memcpy(&block->slots[tid()], &value, sizeof(T));
  warp().arrive_and_wait(false);
  T out;
  std::memcpy(&out, &block->slots[tid() / 32 * 32 + source_lane], sizeof(T));
  warp().arrive_and_wait(false);
  return out;
}

// How many lanes of this thread's warp hold a true predicate.
[[EMU_UNCHECKED]] inline int votes(int predicate) {
  block->slots[tid()] = predicate != 0;
  warp().arrive_and_wait(false);
  int count = 0;
  for (unsigned lane = 0; lane < 32; ++lane) count += static_cast<int>(block->slots[tid() / 32 * 32 + lane]);
  warp().arrive_and_wait(false);
  return count;
}

// Dynamic shared memory past the default 48 KiB needs the kernel's opt-in
// (cudaFuncSetAttribute, recorded here), and at most what an H100/H200 grants a block.
constexpr size_t kDefaultSharedBytes = 48 * 1024;
constexpr size_t kOptInSharedBytes = 232448;
inline std::vector<std::pair<const void*, size_t>> opted_in;

// A kernel's identity: its address, whether named or held in a pointer.
template <typename K>
const void* kernel_id(K kernel) {
  return reinterpret_cast<const void*>(kernel);
}

inline size_t shared_limit(const void* kernel) {
  size_t limit = kDefaultSharedBytes;
  for (const auto& [k, bytes] : opted_in) limit = k == kernel ? bytes : limit;
  return limit;
}

// What JAXFORGE_LAUNCH(kernel, grid, threads, shared_bytes, stream) expands to here.
template <typename Kernel>
auto launcher(unsigned grid, unsigned threads, size_t shared_bytes, const void* id, Kernel kernel) {
  return [=](auto... args) {
    if (shared_bytes > shared_limit(id) || threads == 0 || threads > 1024) {
      std::fprintf(stderr, "emulated launch refused: %u threads, %zu shared bytes (limit %zu)\n", threads,
                   shared_bytes, shared_limit(id));
      std::abort();
    }
    launch(grid, threads, shared_bytes, [=] { kernel(args...); });
  };
}

}  // namespace emu

using cudaError_t = int;
using cudaStream_t = void*;
constexpr cudaError_t cudaSuccess = 0;
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize };
constexpr cudaError_t cudaErrorInvalidValue = 1;
template <typename F>
cudaError_t cudaFuncSetAttribute(F kernel, cudaFuncAttribute, int bytes) {
  if (bytes < 0 || static_cast<size_t>(bytes) > emu::kOptInSharedBytes) return cudaErrorInvalidValue;
  emu::opted_in.emplace_back(emu::kernel_id(kernel), bytes);
  return cudaSuccess;
}
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline const char* cudaGetErrorString(cudaError_t err) { return err == cudaSuccess ? "no error" : "invalid value"; }
inline cudaError_t cudaMemsetAsync(void* data, int value, size_t bytes, cudaStream_t = nullptr) {
  std::memset(data, value, bytes);
  return cudaSuccess;
}
// Blocks an SM holds by shared memory and threads only: registers are not emulated.
template <typename F>
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, F, int threads, size_t shared_bytes) {
  constexpr size_t kSharedPerSm = 233472, kThreadsPerSm = 2048;
  *blocks = static_cast<int>(std::min(kSharedPerSm / std::max<size_t>(shared_bytes, 1), kThreadsPerSm / threads));
  return cudaSuccess;
}

#define threadIdx (::emu::thread_idx)
#define blockIdx (::emu::block_idx)
#define blockDim (::emu::block_dim)
#define gridDim (::emu::grid_dim)

inline void __syncthreads() { emu::block->all.arrive_and_wait(true); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::warp().arrive_and_wait(true); }

inline int __syncthreads_and(int predicate) {
  emu::block->vote[emu::tid()] = predicate != 0;
  __syncthreads();
  int all = 1;
  for (int v : emu::block->vote) all &= v;
  __syncthreads();
  return all;
}

inline int __syncthreads_or(int predicate) { return !__syncthreads_and(!predicate); }

template <typename T>
T __shfl_xor_sync(unsigned, T value, int lane_mask, int width = 32) {
  return emu::exchange(value, (emu::tid() % 32) ^ static_cast<unsigned>(lane_mask & (width - 1)));
}

template <typename T>
T __shfl_sync(unsigned, T value, int source_lane, int width = 32) {
  return emu::exchange(value, emu::tid() % 32 / width * width + static_cast<unsigned>(source_lane % width));
}

inline int __all_sync(unsigned, int predicate) { return emu::votes(predicate) == 32; }
inline int __any_sync(unsigned, int predicate) { return emu::votes(predicate) > 0; }

// CUDA's device-side integer helpers.
template <typename T>
constexpr T min(T a, T b) {
  return b < a ? b : a;
}
template <typename T>
constexpr T max(T a, T b) {
  return a < b ? b : a;
}
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }

inline float __int_as_float(int x) {
  float f;
  std::memcpy(&f, &x, sizeof f);
  return f;
}
inline double __longlong_as_double(long long x) {
  double d;
  std::memcpy(&d, &x, sizeof d);
  return d;
}
// Rounded once each: the emulator is compiled with -ffp-contract=off, as these forbid contraction.
inline float __fmul_rn(float x, float y) { return x * y; }
inline float __fadd_rn(float x, float y) { return x + y; }
inline float __fmaf_rn(float x, float y, float z) { return std::fma(x, y, z); }
inline double __dmul_rn(double x, double y) { return x * y; }
inline double __dadd_rn(double x, double y) { return x + y; }
inline double __fma_rn(double x, double y, double z) { return std::fma(x, y, z); }
