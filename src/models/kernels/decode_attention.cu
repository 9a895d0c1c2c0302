// One-position decode attention over a fixed-capacity KV cache whose length is read from device
// memory (so one captured CUDA graph serves every position): split-KV ("flash decoding").
//
// Shapes (row-major, contiguous): q [hq, d] (the 1/sqrt(d) scale already applied); k_new, v_new
// [hkv, d]: this position's K and V; kc, vc [hkv, cap, d]: the cache; pos: one u32, this
// position. Position `pos` is read from k_new / v_new, never from the cache, so the cache may be
// written at `pos` before, after or concurrently. Query head h reads KV head h / (hq / hkv).
//
// Pass 1 (grid hkv x cap/CHUNK, 128 threads): block (j, y) covers KV head j's query heads (K and
// V read once for all of them) over positions [y*CHUNK, (y+1)*CHUNK) of 0..=pos; for each head it
// writes the split's max m, its sum of exp(s - m) and its unnormalised weighted sum of V rows
// (all f32) to part_ml / part_acc. Blocks past pos return at once.
// Pass 2 (grid hq, 128 threads): combines the splits that hold positions into out [hq, d]. The
// work of both grows with pos, not with the capacity.
// Arithmetic is f32 throughout; d <= 128, at most MAX_GROUP query heads per KV head.

#include "common.cuh"

#define MAX_GROUP 8  // query heads per KV head
#define CHUNK 16     // positions per block
#define WARPS 4      // per block (128 threads); each warp scores CHUNK / WARPS positions

template <typename T>
__device__ void partial(const T* __restrict__ q, const T* __restrict__ k_new, const T* __restrict__ v_new,
                        const T* __restrict__ kc, const T* __restrict__ vc, const uint32_t* __restrict__ pos_p,
                        float* __restrict__ part_acc, float* __restrict__ part_ml, int hq, int hkv, int cap, int d) {
  __shared__ float sc[MAX_GROUP][CHUNK];
  __shared__ float ml_sh[MAX_GROUP][2];
  const int j = blockIdx.x, y = blockIdx.y, group = hq / hkv, splits = gridDim.y;
  const int pos = min((int)*pos_p, cap - 1);
  const int start = y * CHUNK;
  if (start > pos) return;  // beyond the held positions: the combine never reads this split
  const int end = min(start + CHUNK, pos + 1);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  constexpr int PER = CHUNK / WARPS;
  // 0. every load of the block first, none waiting on another: the lane's elements (lane + 32 e,
  //    d <= 128) of the group's q rows and of its warp's K rows; the thread's dimension of every
  //    V row of the split
  float qv[MAX_GROUP][4], kv[PER][4], vv[CHUNK];
#pragma unroll
  for (int r = 0; r < MAX_GROUP; ++r)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = lane + 32 * e;
      qv[r][e] = r < group && i < d ? to_f(q[((size_t)j * group + r) * d + i]) : 0.f;
    }
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    const int t = start + warp + WARPS * k;
    const T* row = t == pos ? k_new + (size_t)j * d : kc + ((size_t)j * cap + t) * d;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = lane + 32 * e;
      kv[k][e] = t < end && i < d ? to_f(row[i]) : 0.f;
    }
  }
  const int di = threadIdx.x;
#pragma unroll
  for (int k = 0; k < CHUNK; ++k) {
    const int t = start + k;
    const T* row = t == pos ? v_new + (size_t)j * d : vc + ((size_t)j * cap + t) * d;
    vv[k] = t < end && di < d ? to_f(row[di]) : 0.f;
  }
  // 1. scores of the warp's positions for each head of the group
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    const int t = start + warp + WARPS * k;
#pragma unroll
    for (int r = 0; r < MAX_GROUP; ++r) {
      if (r >= group) break;
      float s = 0.f;
#pragma unroll
      for (int e = 0; e < 4; ++e) s += qv[r][e] * kv[k][e];
      s = warp_sum(s);
      if (lane == 0 && t < end) sc[r][t - start] = s;
    }
  }
  __syncthreads();
  // 2. per head (one warp each): the split's max and sum of exponentials
  const int n = end - start;
  for (int r = warp; r < group; r += WARPS) {
    const float v = lane < n ? sc[r][lane] : -INFINITY;
    const float m = warp_max(v);
    const float p = lane < n ? expf(v - m) : 0.f;
    const float l = warp_sum(p);
    if (lane < n) sc[r][lane] = p;
    if (lane == 0) {
      ml_sh[r][0] = m;
      ml_sh[r][1] = l;
    }
  }
  __syncthreads();
  // 3. weighted sum of the V rows: one thread per dimension, every head of the group
  if (di < d) {
#pragma unroll
    for (int r = 0; r < MAX_GROUP; ++r) {
      if (r >= group) break;
      float acc = 0.f;
#pragma unroll
      for (int k = 0; k < CHUNK; ++k) acc += sc[r][k] * vv[k];  // (vv is 0 past the split's end)
      part_acc[((size_t)(j * group + r) * splits + y) * d + di] = acc;
    }
  }
  if (threadIdx.x < group) {
    const size_t at = (size_t)(j * group + threadIdx.x) * splits + y;
    part_ml[at * 2] = ml_sh[threadIdx.x][0];
    part_ml[at * 2 + 1] = ml_sh[threadIdx.x][1];
  }
}

// One block per query head: the splits that hold positions (0..=pos, CHUNK each) combined.
template <typename T>
__device__ void combine(const float* __restrict__ part_acc, const float* __restrict__ part_ml,
                        const uint32_t* __restrict__ pos_p, T* __restrict__ out, int d, int splits, int cap) {
  extern __shared__ float w[];  // [splits]: each split's weight
  __shared__ float red[32];
  const int h = blockIdx.x;
  const int used = min((int)*pos_p, cap - 1) / CHUNK + 1;
  const float* ml = part_ml + (size_t)h * splits * 2;
  float m = -INFINITY;
  for (int y = threadIdx.x; y < used; y += blockDim.x) m = fmaxf(m, ml[2 * y]);
  m = block_reduce<true>(m, red);
  float l = 0.f;
  for (int y = threadIdx.x; y < used; y += blockDim.x) {
    const float e = expf(ml[2 * y] - m);
    w[y] = e;
    l += ml[2 * y + 1] * e;
  }
  l = block_reduce<false>(l, red);  // (its barriers also publish w)
  const float inv = 1.f / l;
  const float* acc = part_acc + (size_t)h * splits * d;
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    float a = 0.f;
#pragma unroll 8
    for (int y = 0; y < used; ++y) a += acc[(size_t)y * d + i] * w[y];
    out[(size_t)h * d + i] = from_f<T>(a * inv);
  }
}

#define DECODE_ATTENTION(SUFFIX, T)                                                                              \
  extern "C" __global__ void decode_attn_partial_##SUFFIX(const T* q, const T* k_new, const T* v_new, const T* kc, \
                                                          const T* vc, const uint32_t* pos, float* part_acc,     \
                                                          float* part_ml, int hq, int hkv, int cap, int d) {     \
    partial<T>(q, k_new, v_new, kc, vc, pos, part_acc, part_ml, hq, hkv, cap, d);                                \
  }                                                                                                              \
  extern "C" __global__ void decode_attn_combine_##SUFFIX(const float* part_acc, const float* part_ml,             \
                                                          const uint32_t* pos, T* out, int d, int splits,        \
                                                          int cap) {                                             \
    combine<T>(part_acc, part_ml, pos, out, d, splits, cap);                                                     \
  }

DECODE_ATTENTION(f32, float)
DECODE_ATTENTION(bf16, __nv_bfloat16)
DECODE_ATTENTION(f16, __half)
