// The batched decode step over a slot pool: B streams advance one position each in one launch per
// op; stream b's K/V live in slot slots[b] of the pool, its position is pos[b] (both read from
// device memory, so one captured graph serves every batch of that size). See
// src/models/batch_decode.rs for the contract; each kernel has a tensor-op twin there.
//
// Shapes (row-major, contiguous): heads / qkv [B, hq + 2 hkv, d] (q heads, k heads, v heads);
// kc, vc [slots, hkv, cap, d]; slots, pos [B] u32; cos, sin [max_pos, d / 2]; w [hq + hkv, d].

#include "common.cuh"

#define MAX_GROUP 8  // query heads per KV head
#define CHUNK 16     // positions a block of the first attention pass takes at a time
#define WARPS 4      // per block (128 threads)

// grid (hq + 2 hkv, B), 32 threads: head r of stream b normed (q, k; when w is given), rotated at
// pos[b] (q, k), copied (v); k and v written into slot slots[b] at pos[b].
template <typename T>
__device__ void qk_store(const T* __restrict__ qkv, const T* __restrict__ w, const T* __restrict__ cos_t,
                         const T* __restrict__ sin_t, const uint32_t* __restrict__ slots,
                         const uint32_t* __restrict__ pos_p, T* __restrict__ out, T* __restrict__ kc,
                         T* __restrict__ vc, int hq, int hkv, int d, int cap, float eps) {
  const int r = blockIdx.x, b = blockIdx.y, lane = threadIdx.x, half = d / 2;
  const int rows = hq + 2 * hkv;
  const int pos = min((int)pos_p[b], cap - 1);
  const size_t slot = (size_t)slots[b] * hkv * cap * d;
  const T* x = qkv + ((size_t)b * rows + r) * d;
  T* o = out + ((size_t)b * rows + r) * d;
  if (r >= hq + hkv) {  // v head
    T* c = vc + slot + ((size_t)(r - hq - hkv) * cap + pos) * d;
    for (int i = lane; i < d; i += 32) {
      o[i] = x[i];
      c[i] = x[i];
    }
    return;
  }
  float scale = 1.f;
  if (w != nullptr) {
    float ss = 0.f;
    for (int i = lane; i < d; i += 32) {
      const float v = to_f(x[i]);
      ss += v * v;
    }
    scale = rsqrtf(warp_sum(ss) / d + eps);
  }
  const T* cs = cos_t + (size_t)pos * half;
  const T* sn = sin_t + (size_t)pos * half;
  T* c = r >= hq ? kc + slot + ((size_t)(r - hq) * cap + pos) * d : nullptr;
  for (int i = lane; i < half; i += 32) {
    float x1 = to_f(x[i]), x2 = to_f(x[i + half]);
    if (w != nullptr) {
      // the norm (rounded as its own op), then its weight (rounded)
      x1 = rnd<T>(rnd<T>(x1 * scale) * to_f(w[(size_t)r * d + i]));
      x2 = rnd<T>(rnd<T>(x2 * scale) * to_f(w[(size_t)r * d + i + half]));
    }
    const float cv = to_f(cs[i]), sv = to_f(sn[i]);
    const T a = from_f<T>(x1 * cv - x2 * sv);
    const T bb = from_f<T>(x2 * cv + x1 * sv);
    o[i] = a;
    o[i + half] = bb;
    if (c != nullptr) {
      c[i] = a;
      c[i + half] = bb;
    }
  }
}

// The positions each of `splits` blocks covers for a row at position pos: a whole number of CHUNKs,
// the fewest that let `splits` blocks cover 0..=pos (one CHUNK at least). Pass 1 and pass 2 agree
// on it: the grid is fixed (a captured graph replays it at any positions) and the work follows
// the position, not the slot's capacity.
__device__ __forceinline__ int split_span(int pos, int splits) {
  const int per = (pos + splits) / splits;  // ceil((pos + 1) / splits)
  return (per + CHUNK - 1) / CHUNK * CHUNK;
}

// Attention (split-KV, "flash decoding"), pass 1, grid (hkv, splits, B), 128 threads: block
// (j, y, b) covers KV head j's query heads of stream b (K and V read once for all of them) over
// its span of positions (split_span) of 0..=pos[b] in the stream's slot, CHUNK positions at a
// time with a running max and sum (online softmax); for each head it writes the split's max m,
// its sum of exp(s - m) and its unnormalised weighted sum of V rows (f32) to part_ml / part_acc.
// Blocks past pos[b] return at once. This position's K and V come from heads, never from the
// cache (which the q/k kernel has written before, but need not have). Query head h reads KV head
// h / (hq / hkv).
template <typename T>
__device__ void attn_partial(const T* __restrict__ heads, const T* __restrict__ kc, const T* __restrict__ vc,
                             const uint32_t* __restrict__ slots, const uint32_t* __restrict__ pos_p,
                             float* __restrict__ part_acc, float* __restrict__ part_ml, int hq, int hkv, int cap,
                             int d) {
  __shared__ float sc[MAX_GROUP][CHUNK];
  // per query head: the running max, the running sum, and this chunk's rescale of the earlier ones
  __shared__ float ml_sh[MAX_GROUP][3];
  const int j = blockIdx.x, y = blockIdx.y, b = blockIdx.z, group = hq / hkv, splits = gridDim.y;
  const int rows = hq + 2 * hkv;
  const int pos = min((int)pos_p[b], cap - 1);
  const int span = split_span(pos, splits);
  const int start = y * span;
  if (start > pos) return;  // beyond the held positions: the combine never reads this split
  const int end = min(start + span, pos + 1);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  constexpr int PER = CHUNK / WARPS;
  const T* q = heads + (size_t)b * rows * d;
  const T* k_new = q + (size_t)hq * d;
  const T* v_new = k_new + (size_t)hkv * d;
  const size_t slot = (size_t)slots[b] * hkv * cap * d;
  kc += slot;
  vc += slot;
  part_acc += (size_t)b * hq * splits * d;
  part_ml += (size_t)b * hq * splits * 2;
  float qv[MAX_GROUP][4], kv[PER][4], vv[CHUNK], acc[MAX_GROUP];
#pragma unroll
  for (int r = 0; r < MAX_GROUP; ++r) {
    acc[r] = 0.f;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = lane + 32 * e;
      qv[r][e] = r < group && i < d ? to_f(q[((size_t)j * group + r) * d + i]) : 0.f;
    }
  }
  if (threadIdx.x < MAX_GROUP) {  // (read after the first barrier below)
    ml_sh[threadIdx.x][0] = -INFINITY;
    ml_sh[threadIdx.x][1] = 0.f;
  }
  const int di = threadIdx.x;
  for (int c0 = start; c0 < end; c0 += CHUNK) {
    const int cend = min(c0 + CHUNK, end);
#pragma unroll
    for (int k = 0; k < PER; ++k) {
      const int t = c0 + warp + WARPS * k;
      const T* row = t == pos ? k_new + (size_t)j * d : kc + ((size_t)j * cap + t) * d;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = lane + 32 * e;
        kv[k][e] = t < cend && i < d ? to_f(row[i]) : 0.f;
      }
    }
#pragma unroll
    for (int k = 0; k < CHUNK; ++k) {
      const int t = c0 + k;
      const T* row = t == pos ? v_new + (size_t)j * d : vc + ((size_t)j * cap + t) * d;
      vv[k] = t < cend && di < d ? to_f(row[di]) : 0.f;
    }
#pragma unroll
    for (int k = 0; k < PER; ++k) {
      const int t = c0 + warp + WARPS * k;
#pragma unroll
      for (int r = 0; r < MAX_GROUP; ++r) {
        if (r >= group) break;
        float s = 0.f;
#pragma unroll
        for (int e = 0; e < 4; ++e) s += qv[r][e] * kv[k][e];
        s = warp_sum(s);
        if (lane == 0 && t < cend) sc[r][t - c0] = s;
      }
    }
    __syncthreads();
    const int n = cend - c0;
    for (int r = warp; r < group; r += WARPS) {
      const float v = lane < n ? sc[r][lane] : -INFINITY;
      const float m_old = ml_sh[r][0];
      const float m = fmaxf(m_old, warp_max(v));
      const float p = lane < n ? expf(v - m) : 0.f;
      const float l = warp_sum(p);
      if (lane < CHUNK) sc[r][lane] = p;  // (0 past the chunk's positions: no stale value read)
      if (lane == 0) {
        const float rescale = expf(m_old - m);  // (0 before the first chunk: m_old is -inf)
        ml_sh[r][0] = m;
        ml_sh[r][1] = ml_sh[r][1] * rescale + l;
        ml_sh[r][2] = rescale;
      }
    }
    __syncthreads();
    if (di < d) {
#pragma unroll
      for (int r = 0; r < MAX_GROUP; ++r) {
        if (r >= group) break;
        float a = 0.f;
#pragma unroll
        for (int k = 0; k < CHUNK; ++k) a += sc[r][k] * vv[k];
        acc[r] = acc[r] * ml_sh[r][2] + a;
      }
    }
    __syncthreads();  // (the next chunk writes sc and ml_sh again)
  }
  if (di < d) {
#pragma unroll
    for (int r = 0; r < MAX_GROUP; ++r) {
      if (r >= group) break;
      part_acc[((size_t)(j * group + r) * splits + y) * d + di] = acc[r];
    }
  }
  if (threadIdx.x < group) {
    const size_t at = (size_t)(j * group + threadIdx.x) * splits + y;
    part_ml[at * 2] = ml_sh[threadIdx.x][0];
    part_ml[at * 2 + 1] = ml_sh[threadIdx.x][1];
  }
}

// Attention pass 2, grid (hq, B), 128 threads: stream b's splits that hold positions combined
// into out [B, hq, d].
template <typename T>
__device__ void attn_combine(const float* __restrict__ part_acc, const float* __restrict__ part_ml,
                             const uint32_t* __restrict__ pos_p, T* __restrict__ out, int hq, int d, int splits,
                             int cap) {
  extern __shared__ float w[];  // [splits]: each split's weight
  __shared__ float red[32];
  const int h = blockIdx.x, b = blockIdx.y;
  const int pos = min((int)pos_p[b], cap - 1);
  const int used = pos / split_span(pos, splits) + 1;
  const float* ml = part_ml + ((size_t)b * hq + h) * splits * 2;
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
  const float* acc = part_acc + ((size_t)b * hq + h) * splits * d;
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    float a = 0.f;
#pragma unroll 8
    for (int y = 0; y < used; ++y) a += acc[(size_t)y * d + i] * w[y];
    out[((size_t)b * hq + h) * d + i] = from_f<T>(a * inv);
  }
}

#define BATCH_DECODE(SUFFIX, T)                                                                                    \
  extern "C" __global__ void qk_store_batch_##SUFFIX(const T* qkv, const T* w, const T* cos_t, const T* sin_t,     \
                                                     const uint32_t* slots, const uint32_t* pos, T* out, T* kc,    \
                                                     T* vc, int hq, int hkv, int d, int cap, float eps) {          \
    qk_store<T>(qkv, w, cos_t, sin_t, slots, pos, out, kc, vc, hq, hkv, d, cap, eps);                              \
  }                                                                                                                \
  extern "C" __global__ void batch_attn_partial_##SUFFIX(const T* heads, const T* kc, const T* vc,                 \
                                                         const uint32_t* slots, const uint32_t* pos,               \
                                                         float* part_acc, float* part_ml, int hq, int hkv,         \
                                                         int cap, int d) {                                         \
    attn_partial<T>(heads, kc, vc, slots, pos, part_acc, part_ml, hq, hkv, cap, d);                                \
  }                                                                                                                \
  extern "C" __global__ void batch_attn_combine_##SUFFIX(const float* part_acc, const float* part_ml,              \
                                                         const uint32_t* pos, T* out, int hq, int d, int splits,   \
                                                         int cap) {                                                \
    attn_combine<T>(part_acc, part_ml, pos, out, hq, d, splits, cap);                                              \
  }

BATCH_DECODE(f32, float)
BATCH_DECODE(bf16, __nv_bfloat16)
BATCH_DECODE(f16, __half)
