// Unit tests of the CUDA emulator (csrc/emu): each test is a small CUDA kernel whose result is known exactly.
// Built three ways by csrc/emu/CMakeLists.txt (plain, AddressSanitizer, ThreadSanitizer).
//   test_emu                 run every test
//   test_emu NAME...         run the named tests
//   test_emu --abort CASE    run one misuse case that must abort with a message (driven by the abort tests)
//   test_emu --race          (ThreadSanitizer build only) a kernel with a missing __syncthreads()
#include "common/cuda_compat.h"
#include "common/cuda_kernels.cuh"

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

int g_failures = 0;
#define CHECK(cond, ...)                                                              \
  do {                                                                                \
    if (!(cond)) {                                                                    \
      ++g_failures;                                                                   \
      std::fprintf(stderr, "  %s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                              \
      std::fprintf(stderr, "\n");                                                     \
    }                                                                                 \
  } while (0)
#define CHECK_LAUNCH_OK() CHECK(cudaGetLastError() == cudaSuccess, "launch failed")

template <class T>
bool same_bits(const T& a, const T& b) {
  return std::memcmp(static_cast<const void*>(&a), static_cast<const void*>(&b), sizeof(T)) == 0;
}
template <class T>
T all_ones() {
  T v;
  std::memset(static_cast<void*>(&v), 0xff, sizeof v);
  return v;
}

// ---- block sum: shuffles + shared memory, any block size ----------------------------------------------------
// A warp of `lanes` existing lanes; shfl_down from a lane that does not exist is undefined, hence the guard.
__device__ float warp_sum(float v, unsigned lanes) {
  const unsigned lane = threadIdx.x & 31;
  for (int o = 16; o > 0; o >>= 1) {
    float other = __shfl_down_sync(0xffffffffu, v, o);
    if (lane + o < lanes) v += other;
  }
  return v;
}

template <class T, int kScale>
__global__ void block_sum_kernel(const T* x, float* out, int n) {
  __shared__ float partial[32];
  const unsigned tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = (blockDim.x + 31) / 32;
  const unsigned lanes = min(32u, blockDim.x - warp * 32);
  float acc = 0;
  for (int i = tid; i < n; i += blockDim.x) acc += float(x[blockIdx.x * n + i]);
  acc = warp_sum(acc, lanes);
  if (lane == 0) partial[warp] = acc;
  __syncthreads();
  if (warp == 0) {
    float v = lane < nwarps ? partial[lane] : 0.f;
    v = warp_sum(v, lanes);
    if (lane == 0) out[blockIdx.x] = v * kScale;
  }
}

template <class T>
void check_block_sum(const char* tname) {
  const int rows = 3, n = 1000;
  std::vector<T> x(rows * n);
  std::vector<double> want(rows, 0.0);
  for (int i = 0; i < rows * n; ++i) {
    float v = float(i % 17) * 0.25f - 2.0f;  // exact in bf16, and every partial sum is exact in fp32
    x[i] = T(v);
    want[i / n] += 2.0 * v;
  }
  for (unsigned block : {32u, 96u, 100u, 256u, 1024u}) {
    std::vector<float> out(rows, -1.f);
    MK_LAUNCH((block_sum_kernel<T, 2>), dim3(rows), dim3(block), 0, nullptr, x.data(), out.data(), n);
    CHECK_LAUNCH_OK();
    for (int r = 0; r < rows; ++r)
      CHECK(out[r] == float(want[r]), "%s block %u row %d: got %g, want %g", tname, block, r, out[r], want[r]);
  }
}

void test_block_sum() {
  check_block_sum<float>("float");
  check_block_sum<__nv_bfloat16>("bf16");
}

// ---- each shuffle against the PTX definition ------------------------------------------------------------
template <class T>
T lane_value(int i) {
  return T(float(3 * i + 1));
}

template <class T>
__global__ void shuffle_kernel(T* out, int src, unsigned delta, int lane_mask, int width) {
  const unsigned t = threadIdx.x, n = blockDim.x;
  const T v = lane_value<T>(int(t));
  out[0 * n + t] = __shfl_sync(0xffffffffu, v, src, width);
  out[1 * n + t] = __shfl_up_sync(0xffffffffu, v, delta, width);
  out[2 * n + t] = __shfl_down_sync(0xffffffffu, v, delta, width);
  out[3 * n + t] = __shfl_xor_sync(0xffffffffu, v, lane_mask, width);
}

// Expected source lane, written from the CUDA programming guide's description rather than the PTX formula.
int want_source(int kind, int lane, int src, int delta, int lane_mask, int width) {
  const int base = lane / width * width;
  switch (kind) {
    case 0: return base + src % width;
    case 1: return lane - base >= delta ? lane - delta : lane;
    case 2: return lane - base + delta < width ? lane + delta : lane;
    default: {
      int s = lane ^ lane_mask;  // later groups are out of reach, earlier ones are not
      return s / width > lane / width ? lane : s;
    }
  }
}

template <class T>
void check_shuffles(const char* tname) {
  for (unsigned n : {64u, 48u}) {  // 48: the second warp has 16 lanes
    for (int width : {32, 16, 8, 4, 2, 1}) {
      for (int p = 0; p < 3; ++p) {
        const int src = p == 0 ? 0 : p == 1 ? 5 : 31;
        const unsigned delta = p == 0 ? 1 : p == 1 ? 3 : 16;
        const int lane_mask = p == 0 ? 1 : p == 1 ? 6 : 16;
        std::vector<T> out(4 * n);
        MK_LAUNCH(shuffle_kernel<T>, 1, n, 0, 0, out.data(), src, delta, lane_mask, width);
        CHECK_LAUNCH_OK();
        for (int kind = 0; kind < 4; ++kind)
          for (unsigned t = 0; t < n; ++t) {
            const int lane = t % 32, warp_base = t / 32 * 32;
            const int s = want_source(kind, lane, src, int(delta), lane_mask, width);
            const unsigned lanes_in_warp = std::min(32u, n - warp_base);
            const T want = unsigned(s) < lanes_in_warp ? lane_value<T>(warp_base + s) : all_ones<T>();
            CHECK(same_bits(out[kind * n + t], want), "%s shuffle kind %d n %u width %d p %d thread %u", tname, kind, n,
                  width, p, t);
          }
      }
    }
  }
}

void test_shuffles() {
  check_shuffles<int>("int");
  check_shuffles<unsigned>("unsigned");
  check_shuffles<long long>("long long");
  check_shuffles<unsigned long long>("unsigned long long");
  check_shuffles<float>("float");
  check_shuffles<double>("double");
  check_shuffles<__half>("half");
  check_shuffles<__nv_bfloat16>("bf16");
}

// ---- votes, match, reduce, block-wide predicates ----------------------------------------------------------
__global__ void vote_kernel(unsigned* out) {
  const unsigned t = threadIdx.x, n = blockDim.x, lane = t & 31;
  out[0 * n + t] = __ballot_sync(0xffffffffu, t % 3 == 0);
  out[1 * n + t] = __any_sync(0xffffffffu, t == 70);
  out[2 * n + t] = __all_sync(0xffffffffu, t < 70);
  out[3 * n + t] = __activemask();
  // Divergent halves with their own masks: each half sees only its own lanes.
  if (lane < 16)
    out[4 * n + t] = __ballot_sync(0x0000ffffu, 1);
  else
    out[4 * n + t] = __ballot_sync(0xffff0000u, 1);
  out[5 * n + t] = __syncthreads_count(t % 4 == 0);
  out[6 * n + t] = __syncthreads_and(t < 1000);
  out[7 * n + t] = __syncthreads_or(t == 77);
  out[8 * n + t] = __match_any_sync(0xffffffffu, int(lane / 8));
  int pred = -1;
  out[9 * n + t] = __match_all_sync(0xffffffffu, 5.0f, &pred);
  out[10 * n + t] = unsigned(pred);
  out[11 * n + t] = __reduce_add_sync(0xffffffffu, t);
  out[12 * n + t] = unsigned(__reduce_min_sync(0xffffffffu, int(lane) - 3));
  out[13 * n + t] = __reduce_max_sync(0xffffffffu, t);
  out[14 * n + t] = __reduce_or_sync(0xffffffffu, 1u << (lane % 8));
  __syncwarp();
}

void test_votes() {
  const unsigned n = 80;  // warps of 32, 32 and 16 lanes
  std::vector<unsigned> out(15 * n);
  MK_LAUNCH(vote_kernel, 1, n, 0, 0, out.data());
  CHECK_LAUNCH_OK();
  for (unsigned t = 0; t < n; ++t) {
    const unsigned w = t / 32, lane = t % 32, lanes = std::min(32u, n - w * 32);
    const unsigned exist = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1;
    unsigned ballot = 0, sum = 0, mx = 0, any70 = 0, all70 = 1;
    for (unsigned l = 0; l < lanes; ++l) {
      const unsigned u = w * 32 + l;
      ballot |= unsigned(u % 3 == 0) << l;
      sum += u;
      mx = std::max(mx, u);
      any70 |= u == 70;
      all70 &= u < 70;
    }
    CHECK(out[0 * n + t] == ballot, "ballot thread %u: %08x vs %08x", t, out[t], ballot);
    CHECK(out[1 * n + t] == any70, "any thread %u", t);
    CHECK(out[2 * n + t] == all70, "all thread %u", t);
    CHECK(out[3 * n + t] == exist, "activemask thread %u: %08x", t, out[3 * n + t]);
    const unsigned half = lane < 16 ? 0x0000ffffu : 0xffff0000u;
    CHECK(out[4 * n + t] == (half & exist), "divergent ballot thread %u: %08x", t, out[4 * n + t]);
    CHECK(out[5 * n + t] == 20, "syncthreads_count thread %u: %u", t, out[5 * n + t]);
    CHECK(out[6 * n + t] == 1, "syncthreads_and thread %u", t);
    CHECK(out[7 * n + t] == 1, "syncthreads_or thread %u", t);
    CHECK(out[8 * n + t] == ((0xffu << (lane / 8 * 8)) & exist), "match_any thread %u: %08x", t, out[8 * n + t]);
    CHECK(out[9 * n + t] == exist && out[10 * n + t] == 1, "match_all thread %u", t);
    CHECK(out[11 * n + t] == sum, "reduce_add thread %u", t);
    CHECK(int(out[12 * n + t]) == -3, "reduce_min thread %u", t);
    CHECK(out[13 * n + t] == mx, "reduce_max thread %u", t);
    CHECK(out[14 * n + t] == (lanes >= 8 ? 0xffu : (1u << lanes) - 1), "reduce_or thread %u", t);
  }
}

// ---- atomics: every thread of every block hits the same counters ------------------------------------------
struct Counters {
  int i;
  unsigned u;
  unsigned long long ull;
  float f;
  double d;
  int sub, mx, mn, cas_count;
  unsigned inc;
  unsigned xor_bits;
  __half h;
  __nv_bfloat16 bf;
  int shared_ok;
};

__global__ void atomics_kernel(Counters* c) {
  __shared__ int block_count;
  const int g = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (threadIdx.x == 0) block_count = 0;
  __syncthreads();
  atomicAdd(&block_count, 1);
  atomicAdd(&c->i, 1);
  atomicAdd(&c->u, 2u);
  atomicAdd(&c->ull, 1ull << 33);
  atomicAdd(&c->f, 1.0f);
  atomicAdd(&c->d, 0.5);
  atomicSub(&c->sub, 1);
  atomicMax(&c->mx, g);
  atomicMin(&c->mn, g);
  atomicInc(&c->inc, 99u);  // wraps to 0 after 99
  atomicXor(&c->xor_bits, 1u << (g % 32));
  if (g < 64) {
    atomicAdd(&c->h, __float2half(1.0f));
    atomicAdd(&c->bf, __float2bfloat16(1.0f));
  }
  // Increment through a CAS loop, the way lock-free device code does. (The first read is an atomic too: a
  // plain read racing with other threads' atomicCAS is a data race that ThreadSanitizer reports.)
  int old = atomicAdd(&c->cas_count, 0), assumed;
  do {
    assumed = old;
    old = atomicCAS(&c->cas_count, assumed, assumed + 1);
  } while (old != assumed);
  __syncthreads();
  if (threadIdx.x == 0 && block_count == int(blockDim.x)) atomicAdd(&c->shared_ok, 1);
}

void test_atomics() {
  Counters c{};
  c.mn = 1 << 30;
  c.h = __float2half(0.f);
  c.bf = __float2bfloat16(0.f);
  const int blocks = 16, threads = 256, total = blocks * threads;
  MK_LAUNCH(atomics_kernel, blocks, threads, 0, 0, &c);
  CHECK_LAUNCH_OK();
  CHECK(c.i == total, "atomicAdd int %d", c.i);
  CHECK(c.u == 2u * total, "atomicAdd unsigned %u", c.u);
  CHECK(c.ull == (1ull << 33) * total, "atomicAdd ull");
  CHECK(c.f == float(total), "atomicAdd float %g", c.f);
  CHECK(c.d == 0.5 * total, "atomicAdd double %g", c.d);
  CHECK(c.sub == -total, "atomicSub %d", c.sub);
  CHECK(c.mx == total - 1 && c.mn == 0, "atomicMax/Min %d %d", c.mx, c.mn);
  CHECK(c.inc == unsigned(total % 100), "atomicInc %u", c.inc);
  CHECK(c.xor_bits == 0u, "atomicXor %08x", c.xor_bits);  // every bit flipped an even number of times
  CHECK(__half2float(c.h) == 64.f && __bfloat162float(c.bf) == 64.f, "atomicAdd half/bf16");
  CHECK(c.cas_count == total, "atomicCAS loop %d", c.cas_count);
  CHECK(c.shared_ok == blocks, "shared-memory atomics %d", c.shared_ok);
}

// ---- dynamic shared memory ------------------------------------------------------------------------------
__global__ void dynamic_smem_kernel(float* out, unsigned* flags, int per_thread) {
  MK_DYNAMIC_SHARED(float, buf);
  MK_DYNAMIC_SHARED(unsigned, raw);  // a second view of the same bytes
  const int t = threadIdx.x, n = blockDim.x * per_thread;
  unsigned fresh = 1;
  for (int k = 0; k < per_thread; ++k) fresh &= raw[t * per_thread + k] == 0xffffffffu;  // poisoned, per block
  flags[blockIdx.x * blockDim.x + t] = fresh | (reinterpret_cast<uintptr_t>(buf) % 16 == 0 ? 2u : 0u);
  __syncthreads();
  for (int k = 0; k < per_thread; ++k) buf[t * per_thread + k] = float(blockIdx.x * 10000 + t * per_thread + k);
  __syncthreads();
  for (int k = 0; k < per_thread; ++k) {
    const int j = t * per_thread + k;
    out[blockIdx.x * n + j] = buf[n - 1 - j];
  }
}

void test_dynamic_smem() {
  const int blocks = 2, threads = 128, per = 2, n = threads * per;
  std::vector<float> out(blocks * n);
  std::vector<unsigned> flags(blocks * threads);
  MK_LAUNCH(dynamic_smem_kernel, blocks, threads, n * sizeof(float), 0, out.data(), flags.data(), per);
  CHECK_LAUNCH_OK();
  for (int b = 0; b < blocks; ++b)
    for (int j = 0; j < n; ++j) CHECK(out[b * n + j] == float(b * 10000 + n - 1 - j), "block %d element %d", b, j);
  for (unsigned f : flags) CHECK(f == 3u, "poisoned+aligned flags %u", f);

  // Above 48 KiB a kernel needs the opt-in, and nothing beyond the device's 227 KiB is possible.
  const int big_threads = 256, big_per = 64;  // 64 KiB
  std::vector<float> big_out(big_threads * big_per);
  std::vector<unsigned> big_flags(big_threads);
  const size_t big = size_t(big_threads) * big_per * sizeof(float);
  MK_LAUNCH(dynamic_smem_kernel, 1, big_threads, big, 0, big_out.data(), big_flags.data(), big_per);
  CHECK(cudaGetLastError() == cudaErrorInvalidValue, "64 KiB without opt-in must fail");
  CHECK(cudaFuncSetAttribute(dynamic_smem_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(big)) == cudaSuccess,
        "opt-in");
  MK_LAUNCH(dynamic_smem_kernel, 1, big_threads, big, 0, big_out.data(), big_flags.data(), big_per);
  CHECK_LAUNCH_OK();
  CHECK(big_out[0] == float(big_threads * big_per - 1), "64 KiB result");
  CHECK(cudaFuncSetAttribute(dynamic_smem_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 232449) ==
            cudaErrorInvalidValue,
        "opt-in beyond the device limit");
  cudaGetLastError();
}

// ---- 2D/3D grids and blocks -----------------------------------------------------------------------------
struct Where {
  uint3 t, b;
  dim3 bd, gd;
  unsigned lane_of_linear0;  // the linear id held by lane 0 of this thread's warp
};

__global__ void index_kernel(Where* out) {
  const unsigned linear = threadIdx.x + threadIdx.y * blockDim.x + threadIdx.z * blockDim.x * blockDim.y;
  const unsigned block = blockIdx.x + blockIdx.y * gridDim.x + blockIdx.z * gridDim.x * gridDim.y;
  Where& w = out[block * blockDim.x * blockDim.y * blockDim.z + linear];
  w.t = threadIdx;
  w.b = blockIdx;
  w.bd = blockDim;
  w.gd = gridDim;
  w.lane_of_linear0 = __shfl_sync(__activemask(), linear, 0);
}

void test_index_math() {
  for (int c = 0; c < 2; ++c) {
    const dim3 block = c == 0 ? dim3(4, 3, 2) : dim3(8, 8, 1), grid = c == 0 ? dim3(3, 2, 2) : dim3(2, 3, 1);
    const unsigned nt = block.x * block.y * block.z, nb = grid.x * grid.y * grid.z;
    std::vector<Where> out(nt * nb);
    MK_LAUNCH(index_kernel, grid, block, 0, 0, out.data());
    CHECK_LAUNCH_OK();
    for (unsigned b = 0; b < nb; ++b)
      for (unsigned t = 0; t < nt; ++t) {
        const Where& w = out[b * nt + t];
        CHECK(w.t.x == t % block.x && w.t.y == t / block.x % block.y && w.t.z == t / (block.x * block.y),
              "threadIdx of %u", t);
        CHECK(w.b.x == b % grid.x && w.b.y == b / grid.x % grid.y && w.b.z == b / (grid.x * grid.y), "blockIdx %u", b);
        CHECK(w.bd.x == block.x && w.bd.y == block.y && w.bd.z == block.z, "blockDim");
        CHECK(w.gd.x == grid.x && w.gd.y == grid.y && w.gd.z == grid.z, "gridDim");
        CHECK(w.lane_of_linear0 == t / 32 * 32, "warps follow the linear thread id: %u", w.lane_of_linear0);
      }
  }
}

// ---- exited threads do not block barriers ---------------------------------------------------------------
__global__ void early_exit_kernel(int* out, int live) {
  __shared__ int s[256];
  const int t = threadIdx.x;
  if (t >= live + 50) return;  // leaves before any barrier
  __syncthreads();
  if (t >= live) return;  // leaves after one barrier, while the others wait in the next
  if (t == 0) std::this_thread::sleep_for(std::chrono::milliseconds(2));  // late arrival
  s[t] = t;
  __syncthreads();
  int sum = 0;
  for (int i = 0; i < live; ++i) sum += s[i];
  const int count = __syncthreads_count(1);
  const int lane_sum = __reduce_add_sync(__activemask(), 1u);  // lanes still alive in this warp
  out[t] = sum * 1000 + count;
  out[256 + t] = lane_sum;
}

void test_early_exit() {
  const int live = 100;
  std::vector<int> out(512, -1);
  MK_LAUNCH(early_exit_kernel, 1, 256, 0, 0, out.data(), live);
  CHECK_LAUNCH_OK();
  for (int t = 0; t < 256; ++t) {
    if (t < live) {
      CHECK(out[t] == (live * (live - 1) / 2) * 1000 + live, "thread %d: %d", t, out[t]);
      CHECK(out[256 + t] == (t < 96 ? 32 : live - 96), "live lanes seen by thread %d: %d", t, out[256 + t]);
    } else {
      CHECK(out[t] == -1, "exited thread %d wrote", t);
    }
  }
}

// ---- a thread spin-waits (with __nanosleep) for a flag that a later thread of its block sets --------------
__global__ void spin_wait_kernel(int* flag, int* out) {
  const int t = threadIdx.x;
  if (t == 0) {
    while (atomicAdd(flag, 0) == 0) __nanosleep(100);  // fibers: lets the other threads run
    out[0] = atomicAdd(flag, 0);
  } else if (t == int(blockDim.x) - 1) {
    atomicExch(flag, 7);
  }
}

void test_spin_wait() {
  int flag = 0, out = -1;
  MK_LAUNCH(spin_wait_kernel, 1, 64, 0, 0, &flag, &out);
  CHECK_LAUNCH_OK();
  CHECK(out == 7, "spin-waiting thread read %d", out);
}

// Random 2D blocks whose threads leave at random rounds: every round's barrier and warp reduction must count
// exactly the threads still alive.
__global__ void random_exit_kernel(const int* exit_round, int* out, int rounds) {
  const int n = blockDim.x * blockDim.y, t = threadIdx.x + threadIdx.y * blockDim.x;
  int acc = 0;
  for (int r = 0; r < rounds; ++r) {
    if (exit_round[blockIdx.x * n + t] == r) return;
    acc += __syncthreads_count(1);  // live threads of the block
    // The lanes of this warp still live in round r, from the exit schedule: __activemask() would race with
    // lanes that are exiting in this very round (a GPU gives no guarantee there either).
    unsigned live = 0;
    const int w0 = t & ~31;
    for (int u = w0; u < w0 + 32 && u < n; ++u) live |= unsigned(exit_round[blockIdx.x * n + u] > r) << (u - w0);
    acc += __reduce_add_sync(live, 1u);  // live lanes of the warp
    __syncthreads();
  }
  out[blockIdx.x * n + t] = acc;
}

void test_random_exits() {
  uint32_t seed = 12345;
  auto rnd = [&seed](uint32_t m) { return ((seed = seed * 1664525u + 1013904223u) >> 8) % m; };
  for (int it = 0; it < 60; ++it) {
    const dim3 block(1 + rnd(64), 1 + rnd(4));
    const int n = int(block.x * block.y), blocks = 1 + int(rnd(3)), rounds = 1 + int(rnd(5));
    std::vector<int> ex(blocks * n), out(blocks * n, -1);
    for (int& e : ex) e = rnd(3) == 0 ? int(rnd(rounds + 1)) : rounds + 1;
    MK_LAUNCH(random_exit_kernel, blocks, block, 0, 0, ex.data(), out.data(), rounds);
    CHECK_LAUNCH_OK();
    for (int b = 0; b < blocks; ++b)
      for (int t = 0; t < n; ++t) {
        if (ex[b * n + t] <= rounds) continue;
        int want = 0;
        for (int r = 0; r < rounds; ++r)
          for (int u = 0; u < n; ++u) want += (ex[b * n + u] > r) * (1 + (u / 32 == t / 32));
        CHECK(out[b * n + t] == want, "iteration %d block %d thread %d: %d vs %d", it, b, t, out[b * n + t], want);
      }
  }
}

// ---- invalid launch configurations ---------------------------------------------------------------------
__global__ void mark_kernel(int* count) { atomicAdd(count, 1); }

void test_invalid_launches() {
  int flag = 0;
  struct Case {
    dim3 grid, block;
    size_t smem;
    cudaError_t want;
  } cases[] = {
      {dim3(0), dim3(32), 0, cudaErrorInvalidConfiguration},
      {dim3(1, 0), dim3(32), 0, cudaErrorInvalidConfiguration},
      {dim3(1), dim3(0), 0, cudaErrorInvalidConfiguration},
      {dim3(1), dim3(1025), 0, cudaErrorInvalidConfiguration},
      {dim3(1), dim3(64, 32), 0, cudaErrorInvalidConfiguration},  // 2048 threads
      {dim3(1), dim3(1, 1, 65), 0, cudaErrorInvalidConfiguration},
      {dim3(1, 65536), dim3(32), 0, cudaErrorInvalidConfiguration},
      {dim3(1), dim3(32), 232449, cudaErrorInvalidValue},
  };
  for (const Case& c : cases) {
    MK_LAUNCH(mark_kernel, c.grid, c.block, c.smem, 0, &flag);
    CHECK(cudaPeekAtLastError() == c.want, "peek: %s", cudaGetErrorString(cudaPeekAtLastError()));
    CHECK(cudaGetLastError() == c.want, "error for grid (%u,%u,%u) block (%u,%u,%u) smem %zu", c.grid.x, c.grid.y,
          c.grid.z, c.block.x, c.block.y, c.block.z, c.smem);
    CHECK(cudaGetLastError() == cudaSuccess, "the error is cleared once read");
    CHECK(flag == 0, "an invalid launch ran the kernel");
  }
  MK_LAUNCH(mark_kernel, dim3(2), dim3(1024), 0, 0, &flag);
  CHECK(cudaGetLastError() == cudaSuccess && flag == 2048, "the largest valid block: %d", flag);
  CHECK(std::strcmp(cudaGetErrorString(cudaErrorInvalidConfiguration), "invalid configuration argument") == 0,
        "error string");
}

// ---- bf16/fp16: the conversions are CUDA's own code, so they round like the GPU ---------------------------
__global__ void convert_kernel(const float* in, __nv_bfloat16* bf, __half* h, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    bf[i] = __float2bfloat16_rn(in[i]);
    h[i] = __float2half_rn(in[i]);
  }
}

void test_half_rounding() {
  const float in[] = {1.00390625f,     // 1 + 2^-8: halfway in bf16, ties to even -> 1
                      1.01171875f,     // 1 + 3*2^-8: halfway, ties to even -> 1 + 2^-6
                      1.00048828125f,  // 1 + 2^-11: halfway in fp16 -> 1
                      1.00146484375f,  // 1 + 3*2^-11: halfway in fp16 -> 1 + 2^-9
                      3.4e38f,         // beyond the largest finite bf16/fp16 after rounding -> inf
                      -0.0f};
  const float want_bf[] = {1.0f, 1.015625f, 1.0f, 1.0f, INFINITY, -0.0f};
  const float want_h[] = {1.00390625f, 1.01171875f, 1.0f, 1.001953125f, INFINITY, -0.0f};
  const int n = sizeof(in) / sizeof(in[0]);
  std::vector<__nv_bfloat16> bf(n);
  std::vector<__half> h(n);
  MK_LAUNCH(convert_kernel, 1, 32, 0, 0, in, bf.data(), h.data(), n);
  CHECK_LAUNCH_OK();
  for (int i = 0; i < n; ++i) {
    CHECK(same_bits(__bfloat162float(bf[i]), want_bf[i]), "bf16(%.10g) = %.10g", in[i], __bfloat162float(bf[i]));
    CHECK(same_bits(__half2float(h[i]), want_h[i]), "fp16(%.10g) = %.10g", in[i], __half2float(h[i]));
  }
  for (unsigned bits = 0; bits < 65536; ++bits) {  // every finite bf16 survives the round trip through float
    const __nv_bfloat16 b = __ushort_as_bfloat16(static_cast<unsigned short>(bits));
    const float f = __bfloat162float(b);
    if (f != f) continue;
    CHECK(__bfloat16_as_ushort(__float2bfloat16_rn(f)) == bits, "bf16 round trip %04x", bits);
  }
}

// ---- odds and ends: per-thread argument copies, host threads launching at once, runtime queries ------------
MK_HD float twice(float x) { return 2.0f * x; }

__global__ void args_kernel(int base, float* out) {
  base += threadIdx.x;  // a kernel parameter is a per-thread local
  out[threadIdx.x] = twice(float(base));
}

void test_runtime_and_args() {
  std::vector<float> out(64);
  MK_LAUNCH(args_kernel, 1, 64, 0, 0, 10, out.data());
  CHECK_LAUNCH_OK();
  for (int t = 0; t < 64; ++t) CHECK(out[t] == 2.0f * (10 + t), "args thread %d: %g", t, out[t]);
  CHECK(twice(3.0f) == 6.0f, "MK_HD on the host");

  std::vector<std::thread> hosts;
  std::vector<std::vector<float>> results(4, std::vector<float>(64));
  for (int h = 0; h < 4; ++h)
    hosts.emplace_back([h, &results] {
      for (int k = 0; k < 20; ++k) MK_LAUNCH(args_kernel, 1, 64, 0, 0, h * 100 + k, results[h].data());
    });
  for (auto& t : hosts) t.join();
  for (int h = 0; h < 4; ++h) CHECK(results[h][1] == 2.0f * (h * 100 + 19 + 1), "host thread %d", h);

  int dev = -1, v = 0;
  CHECK(cudaGetDevice(&dev) == cudaSuccess && dev == 0, "cudaGetDevice");
  CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess && v == 4, "SMs %d", v);
  CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) == cudaSuccess && v == 232448,
        "smem opt-in %d", v);
  CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMaxThreadsPerBlock, dev) == cudaSuccess && v == 1024, "threads %d", v);
  CHECK(cudaFuncSetAttribute(args_kernel, cudaFuncAttributePreferredSharedMemoryCarveout, 50) == cudaSuccess,
        "carve-out is accepted");

  CHECK(__popc(0xf0f0u) == 8 && __clz(1) == 31 && __clz(0) == 32 && __ffs(8) == 4 && __ffs(0) == 0, "bit counts");
  CHECK(__brev(1u) == 0x80000000u && __byte_perm(0x33221100u, 0x77665544u, 0x5140u) == 0x55114400u, "brev/perm");
  CHECK(__funnelshift_l(0x80000000u, 1u, 1) == 3u && __funnelshift_r(2u, 1u, 1) == 0x80000001u, "funnel shifts");
  CHECK(__saturatef(-1.f) == 0.f && __saturatef(2.f) == 1.f && __saturatef(NAN) == 0.f, "saturate");
  CHECK(__float_as_int(1.0f) == 0x3f800000 && __int_as_float(0x40000000) == 2.0f, "reinterpret");
  CHECK(rsqrtf(4.0f) == 0.5f && __fdividef(1.f, 4.f) == 0.25f && __expf(0.f) == 1.f, "math intrinsics");
  CHECK(__float2int_rn(2.5f) == 2 && __float2int_rn(3.5f) == 4 && __float2int_rz(NAN) == 0 &&
            __float2int_rz(1e20f) == 2147483647,
        "saturating conversions");
  CHECK(min(3, 4) == 3 && max(2.5f, 1.0f) == 2.5f, "min/max");
}

// ---- __constant__ memory and libm calls as device code writes them (unqualified) ---------------------------
__constant__ float c_table[4];

__global__ void math_kernel(const float* x, float* out) {
  const int t = threadIdx.x;
  const float v = __ldg(x + t);
  out[t] = (isnan(v) || isinf(v) ? -1.f : fmaxf(fabsf(v), 0.5f)) * c_table[t % 4] + rsqrtf(4.0f) +
           float(min(t, 2) + max(t, 2));
}

void test_constant_and_math() {
  const float table[4] = {1.f, 2.f, 3.f, 4.f};
  CHECK(cudaMemcpyToSymbol(c_table, table, sizeof table) == cudaSuccess, "cudaMemcpyToSymbol");
  const float x[4] = {NAN, -3.f, 0.25f, INFINITY};
  float out[4];
  MK_LAUNCH(math_kernel, 1, 4, 0, 0, x, out);
  CHECK_LAUNCH_OK();
  const float want[4] = {-1.f * 1 + 0.5f + 2, 3.f * 2 + 0.5f + 3, 0.5f * 3 + 0.5f + 4, -1.f * 4 + 0.5f + 5};
  for (int t = 0; t < 4; ++t) CHECK(out[t] == want[t], "thread %d: %g vs %g", t, out[t], want[t]);
  float back[4] = {};
  CHECK(cudaMemcpyFromSymbol(back, c_table, sizeof back) == cudaSuccess && back[3] == 4.f, "cudaMemcpyFromSymbol");
}

// ---- timing (printed, never asserted: sanitizers and loaded machines differ) ------------------------------
__global__ void barrier_kernel(float* out, int rounds) {
  __shared__ float s[1024];
  float v = float(threadIdx.x);
  for (int i = 0; i < rounds; ++i) {
    s[threadIdx.x] = v;
    __syncthreads();
    v = s[(threadIdx.x + 1) % blockDim.x] + 1.f;
    __syncthreads();
  }
  out[threadIdx.x] = v;
}

void test_timing() {
  std::vector<float> out(256);
  MK_LAUNCH(barrier_kernel, 1, 256, 0, 0, out.data(), 10);
  auto t0 = std::chrono::steady_clock::now();
  const int reps = 20;
  for (int r = 0; r < reps; ++r) MK_LAUNCH(barrier_kernel, 1, 256, 0, 0, out.data(), 10);
  auto t1 = std::chrono::steady_clock::now();
  for (int r = 0; r < 500; ++r) MK_LAUNCH(args_kernel, 1, 32, 0, 0, r, out.data());
  auto t2 = std::chrono::steady_clock::now();
  CHECK_LAUNCH_OK();
  CHECK(out[0] == 2.0f * 499, "last small launch");
  std::printf("    256 threads x 20 __syncthreads: %.2f ms per block; 32-thread launch: %.3f ms\n",
              std::chrono::duration<double, std::milli>(t1 - t0).count() / reps,
              std::chrono::duration<double, std::milli>(t2 - t1).count() / 500);
}

// ---- misuse that must abort with a message (each case runs in a child process) ---------------------------
__global__ void warp_vs_block_deadlock_kernel() {
  if (threadIdx.x == 0)
    __syncwarp(0x3u);  // waits for lane 1 ...
  else
    __syncthreads();  // ... which waits for thread 0
}
__global__ void mask_mismatch_kernel() {  // lane 0 names lanes {0,1}; lanes 1 and 2 name {0,1,2}
  if (threadIdx.x == 0)
    __syncwarp(0x3u);
  else
    __syncwarp(0x7u);
}
__global__ void lane_not_in_mask_kernel(int* out) { out[threadIdx.x] = __shfl_sync(0x1u, 1, 0); }
__global__ void bad_width_kernel(int* out) { out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1, 1, 3); }
__global__ void spin_on_other_block_kernel(volatile int* flag) {
  if (blockIdx.x == 0) {
    while (*flag == 0) {  // block 1 would set it; blocks run one after another here
    }
  } else {
    *flag = 1;
  }
}
__global__ void trap_kernel() {
  if (threadIdx.x == 3) __trap();
}

// A 16-byte pack load from an address that is only 4-byte aligned: a fault on a GPU, a trap in the emulator.
__global__ void misaligned_pack_kernel(const float* x, float* out) {
  float v[4];
  megakernels::MK_NS::load_pack<float, 4>(x, 1, v);
  out[threadIdx.x] = v[0];
}
alignas(16) float g_pack_src[16];

struct AbortCase {
  const char* name;
  const char* expect;  // substring of the message
  void (*run)();
};
int g_flag_storage = 0;
int g_out_storage[64];
const AbortCase kAbortCases[] = {
    {"deadlock", "deadlock: __sync", [] { MK_LAUNCH(warp_vs_block_deadlock_kernel, 1, 2, 0, 0); }},
    {"mask-mismatch", "disagrees", [] { MK_LAUNCH(mask_mismatch_kernel, 1, 3, 0, 0); }},
    {"not-in-mask", "not in mask", [] { MK_LAUNCH(lane_not_in_mask_kernel, 1, 2, 0, 0, g_out_storage); }},
    {"bad-width", "power of two", [] { MK_LAUNCH(bad_width_kernel, 1, 32, 0, 0, g_out_storage); }},
    {"spin", "made no progress", [] { MK_LAUNCH(spin_on_other_block_kernel, 2, 1, 0, 0, &g_flag_storage); }},
    {"trap", "__trap()", [] { MK_LAUNCH(trap_kernel, 1, 8, 0, 0); }},
    {"misaligned-pack", "misaligned 16-byte vector access",
     [] { MK_LAUNCH(misaligned_pack_kernel, 1, 1, 0, 0, g_pack_src, reinterpret_cast<float*>(g_out_storage)); }},
};

// Re-executes this binary (a fresh process: no inherited worker threads, sanitizers stay happy) on one case.
void test_misuse_aborts() {
  for (const AbortCase& c : kAbortCases) {
    int pipefd[2];
    if (pipe(pipefd) != 0) {
      CHECK(false, "pipe");
      return;
    }
    const pid_t pid = fork();
    if (pid == 0) {
      dup2(pipefd[1], 2);
      close(pipefd[0]);
      setenv("MEGAKERNELS_EMU_TIMEOUT_S", "0.5", 1);
      execl("/proc/self/exe", "test_emu", "--abort", c.name, static_cast<char*>(nullptr));
      _exit(127);
    }
    close(pipefd[1]);
    std::string text;
    char buf[4096];
    for (ssize_t k; (k = read(pipefd[0], buf, sizeof buf)) > 0;) text.append(buf, size_t(k));
    close(pipefd[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT, "%s: expected an abort, status %d", c.name, status);
    CHECK(text.find(c.expect) != std::string::npos, "%s: message lacks \"%s\":\n%s", c.name, c.expect, text.c_str());
  }
}

#if defined(__SANITIZE_THREAD__)
// Thread t writes s[t] and reads s[t+1] with no __syncthreads() between: ThreadSanitizer must call it a race.
__global__ void missing_barrier_kernel(float* out) {
  __shared__ float s[64];
  __syncthreads();  // every thread past here, none ordered against another
  s[threadIdx.x] = float(threadIdx.x);
  out[threadIdx.x] = s[(threadIdx.x + 1) % blockDim.x];
}
#endif

struct TestCase {
  const char* name;
  void (*fn)();
};
const TestCase kTests[] = {
    {"block_sum", test_block_sum},
    {"shuffles", test_shuffles},
    {"votes", test_votes},
    {"atomics", test_atomics},
    {"dynamic_smem", test_dynamic_smem},
    {"index_math", test_index_math},
    {"early_exit", test_early_exit},
    {"random_exits", test_random_exits},
    {"spin_wait", test_spin_wait},
    {"invalid_launches", test_invalid_launches},
    {"half_rounding", test_half_rounding},
    {"runtime_and_args", test_runtime_and_args},
    {"constant_and_math", test_constant_and_math},
    {"misuse_aborts", test_misuse_aborts},
    {"timing", test_timing},
};

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3 && std::strcmp(argv[1], "--abort") == 0) {
    for (const AbortCase& c : kAbortCases)
      if (std::strcmp(c.name, argv[2]) == 0) c.run();
    std::fprintf(stderr, "case %s did not abort\n", argv[2]);
    return 1;
  }
  if (argc == 2 && std::strcmp(argv[1], "--race") == 0) {
#if defined(__SANITIZE_THREAD__)
    float out[64];
    MK_LAUNCH(missing_barrier_kernel, 1, 64, 0, 0, out);
    return 0;
#else
    std::fprintf(stderr, "--race needs the ThreadSanitizer build\n");
    return 1;
#endif
  }
  int run = 0;
  for (const TestCase& t : kTests) {
    bool selected = argc == 1;
    for (int i = 1; i < argc; ++i) selected = selected || std::strcmp(argv[i], t.name) == 0;
    if (!selected) continue;
    const int before = g_failures;
    auto t0 = std::chrono::steady_clock::now();
    t.fn();
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    std::printf("%-18s %s (%.0f ms)\n", t.name, g_failures == before ? "ok" : "FAILED", ms);
    std::fflush(stdout);
    ++run;
  }
  if (run == 0) {
    std::fprintf(stderr, "no test matched\n");
    return 1;
  }
  std::printf("%d test(s), %d failed check(s)\n", run, g_failures);
  return g_failures ? 1 : 0;
}
