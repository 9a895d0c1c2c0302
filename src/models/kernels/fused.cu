// Fused position-wise kernels of the decoder step (see src/models/fused.rs for the contract of
// each; every one has a tensor-op twin there that defines its result). Arithmetic in f32; each
// value is rounded to the storage type where the op-by-op path rounds it.

#include "common.cuh"

// Residual add then RMSNorm, one row per block of NORM_THREADS threads, the row held in registers
// (h <= NORM_THREADS * NORM_PER): xo = x + a; ho = rmsnorm(xo) * w.
#define NORM_THREADS 1024
#define NORM_PER 8
template <typename T>
__device__ void add_rmsnorm(const T* __restrict__ x, const T* __restrict__ a, const T* __restrict__ w,
                            T* __restrict__ xo, T* __restrict__ ho, int h, float eps) {
  __shared__ float red[32];
  const size_t row = (size_t)blockIdx.x * h;
  float v[NORM_PER];
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < NORM_PER; ++k) {
    const int i = threadIdx.x + k * NORM_THREADS;
    v[k] = 0.f;
    if (i < h) {
      const float s = rnd<T>(to_f(x[row + i]) + to_f(a[row + i]));
      v[k] = s;
      xo[row + i] = from_f<T>(s);
      ss += s * s;
    }
  }
  const float r = rsqrtf(block_reduce<false>(ss, red) / h + eps);
#pragma unroll
  for (int k = 0; k < NORM_PER; ++k) {
    const int i = threadIdx.x + k * NORM_THREADS;
    if (i < h) ho[row + i] = from_f<T>(v[k] * r * to_f(w[i]));
  }
}

// SwiGLU's gate: out[n, I] = silu(gu[n, :I]) * gu[n, I:].
template <typename T>
__device__ void silu_mul(const T* __restrict__ gu, T* __restrict__ out, int inter, size_t total) {
  for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < total; k += (size_t)gridDim.x * blockDim.x) {
    const size_t n = k / inter, i = k % inter;
    const float g = to_f(gu[n * 2 * inter + i]);
    const float s = rnd<T>(g / (1.f + expf(-g)));
    out[k] = from_f<T>(s * to_f(gu[n * 2 * inter + inter + i]));
  }
}

// One position's heads after the fused q/k/v projection, one head per block (32 threads):
// q and k heads get RMSNorm with their row of `w` (when `w` is not null), then rotate-half RoPE at
// position *pos; v heads are copied. k and v heads are also written into the caches at *pos.
// qkv, out: [hq + 2 hkv, d]; w: [hq + hkv, d]; cos, sin: [max_pos, d / 2]; kc, vc: [hkv, cap, d].
template <typename T>
__device__ void qk_norm_rope_store(const T* __restrict__ qkv, const T* __restrict__ w, const T* __restrict__ cos_t,
                                   const T* __restrict__ sin_t, const uint32_t* __restrict__ pos_p,
                                   T* __restrict__ out, T* __restrict__ kc, T* __restrict__ vc, int hq, int hkv, int d,
                                   int cap, float eps) {
  const int r = blockIdx.x, lane = threadIdx.x, half = d / 2;
  const int pos = min((int)*pos_p, cap - 1);
  const T* x = qkv + (size_t)r * d;
  T* o = out + (size_t)r * d;
  if (r >= hq + hkv) {  // v head
    T* c = vc + ((size_t)(r - hq - hkv) * cap + pos) * d;
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
  T* c = r >= hq ? kc + ((size_t)(r - hq) * cap + pos) * d : nullptr;
  for (int i = lane; i < half; i += 32) {
    float x1 = to_f(x[i]), x2 = to_f(x[i + half]);
    if (w != nullptr) {
      // the norm (rounded as its own op), then its weight (rounded)
      x1 = rnd<T>(rnd<T>(x1 * scale) * to_f(w[(size_t)r * d + i]));
      x2 = rnd<T>(rnd<T>(x2 * scale) * to_f(w[(size_t)r * d + i + half]));
    }
    const float cv = to_f(cs[i]), sv = to_f(sn[i]);
    const T a = from_f<T>(x1 * cv - x2 * sv);
    const T b = from_f<T>(x2 * cv + x1 * sv);
    o[i] = a;
    o[i + half] = b;
    if (c != nullptr) {
      c[i] = a;
      c[i + half] = b;
    }
  }
}

#define FUSED(SUFFIX, T)                                                                                          \
  extern "C" __global__ void add_rmsnorm_##SUFFIX(const T* x, const T* a, const T* w, T* xo, T* ho, int h,         \
                                                  float eps) {                                                   \
    add_rmsnorm<T>(x, a, w, xo, ho, h, eps);                                                                     \
  }                                                                                                              \
  extern "C" __global__ void silu_mul_##SUFFIX(const T* gu, T* out, int inter, unsigned long long total) {        \
    silu_mul<T>(gu, out, inter, (size_t)total);                                                                  \
  }                                                                                                              \
  extern "C" __global__ void qk_norm_rope_store_##SUFFIX(const T* qkv, const T* w, const T* cos_t, const T* sin_t, \
                                                         const uint32_t* pos, T* out, T* kc, T* vc, int hq,      \
                                                         int hkv, int d, int cap, float eps) {                   \
    qk_norm_rope_store<T>(qkv, w, cos_t, sin_t, pos, out, kc, vc, hq, hkv, d, cap, eps);                         \
  }

FUSED(f32, float)
FUSED(bf16, __nv_bfloat16)
FUSED(f16, __half)
