// Each row's best K logits, best first, so that only they go to the host (src/models/top_k.rs,
// whose host twin defines the result). Order: f32::total_cmp on the value, ties to the larger id
// (the host argmax's rule).

#include "common.cuh"

#define TOPK_THREADS 1024

// a float's bits as an unsigned key ordered as f32::total_cmp orders the floats
__device__ __forceinline__ unsigned int ordered_bits(float v) {
  const unsigned int b = __float_as_uint(v);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ unsigned long long max_u64(unsigned long long a, unsigned long long b) { return a > b ? a : b; }

// x [R, v]; out [R, 2k] u32: the k ids, then the k values' f32 bits. One block per row; round r
// finds the largest key below the one of round r - 1 (keys are (value, id) + 1, so 0 is "none").
template <typename T>
__device__ void top_k(const T* __restrict__ x, unsigned int* __restrict__ out, int v, int k) {
  __shared__ unsigned long long red[32];
  const T* row = x + (size_t)blockIdx.x * v;
  unsigned int* o = out + (size_t)blockIdx.x * 2 * k;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nwarps = blockDim.x / 32;
  unsigned long long below = ~0ull;
  for (int r = 0; r < k; ++r) {
    unsigned long long best = 0;
    for (int i = threadIdx.x; i < v; i += blockDim.x) {
      const unsigned long long key = ((((unsigned long long)ordered_bits(to_f(row[i]))) << 32) | (unsigned int)i) + 1ull;
      if (key < below && key > best) best = key;
    }
    for (int off = 16; off > 0; off >>= 1) best = max_u64(best, __shfl_xor_sync(0xffffffffu, best, off));
    __syncthreads();
    if (lane == 0) red[warp] = best;
    __syncthreads();
    best = 0;
    for (int w = 0; w < nwarps; ++w) best = max_u64(best, red[w]);
    if (threadIdx.x == 0) {
      const unsigned int id = (unsigned int)((best - 1ull) & 0xffffffffull);
      o[r] = id;
      o[k + r] = __float_as_uint(to_f(row[id]));
    }
    below = best;
  }
}

#define SAMPLE(SUFFIX, T)                                                                          \
  extern "C" __global__ void top_k_##SUFFIX(const T* x, unsigned int* out, int v, int k) {      \
    top_k<T>(x, out, v, k);                                                                        \
  }

SAMPLE(f32, float)
SAMPLE(bf16, __nv_bfloat16)
SAMPLE(f16, __half)
