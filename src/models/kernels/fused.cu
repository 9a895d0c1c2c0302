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

// Snake (the vocoder's activation): out[r, c, t] = x + sin(a_c x)^2 / (a_c + 1e-9) over x [R, C, T]
// contiguous, a [C] (f32 arithmetic; the op-by-op path rounds after each op in the storage type).
template <typename T>
__device__ void snake(const T* __restrict__ x, const T* __restrict__ a, T* __restrict__ out, int c, int t, size_t total) {
  for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < total; k += (size_t)gridDim.x * blockDim.x) {
    const float al = to_f(a[(k / t) % c]);
    const float v = to_f(x[k]);
    out[k] = from_f<T>(snake_of(v, al));
  }
}


// The flow's slot pool store: new keys and values k, v [P, N, H, T, D] (contiguous) written into
// pools kp, vp [P, R, H, CAP, D] (plane stride `plane`) at row rows[n] and position pos[n, t].
template <typename T>
__device__ void kv_rows_store(const T* __restrict__ k, const T* __restrict__ v, T* kp, T* vp, const unsigned* __restrict__ rows,
                              const unsigned* __restrict__ pos, int n, int h, int t, int d, int cap, size_t plane, size_t total) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
    size_t r = i / d;
    const int dd = i % d;
    const int tt = r % t;
    r /= t;
    const int hh = r % h;
    r /= h;
    const int row = r % n;
    const size_t p = r / n;
    const size_t dst = p * plane + (((size_t)rows[row] * h + hh) * cap + pos[row * t + tt]) * d + dd;
    kp[dst] = k[i];
    vp[dst] = v[i];
  }
}

// Softmax over each row of att [R, l] (contiguous) where row r holds query i = r % n of the last n
// of l positions: it sees positions j <= l - n + i (attention.rs's causal mask, which the
// op-by-op path adds before its softmax), the others get 0. One block a row; f32 arithmetic.
template <typename T>
__device__ void causal_softmax(const T* __restrict__ x, T* __restrict__ y, int l, int n) {
  __shared__ float red[32];
  const size_t r = blockIdx.x;
  const int last = l - n + (int)(r % n);
  const T* xr = x + r * l;
  T* yr = y + r * l;
  float m = -INFINITY;
  for (int j = threadIdx.x; j <= last; j += blockDim.x) m = fmaxf(m, to_f(xr[j]));
  m = block_reduce<true>(m, red);
  float s = 0.f;
  for (int j = threadIdx.x; j <= last; j += blockDim.x) s += expf(to_f(xr[j]) - m);
  s = block_reduce<false>(s, red);
  const float inv = 1.f / s;
  for (int j = threadIdx.x; j < l; j += blockDim.x) yr[j] = from_f<T>(j <= last ? expf(to_f(xr[j]) - m) * inv : 0.f);
}

#define FUSED(SUFFIX, T)                                                                                          \
  extern "C" __global__ void add_rmsnorm_##SUFFIX(const T* x, const T* a, const T* w, T* xo, T* ho, int h,         \
                                                  float eps) {                                                   \
    add_rmsnorm<T>(x, a, w, xo, ho, h, eps);                                                                     \
  }                                                                                                              \
  extern "C" __global__ void silu_mul_##SUFFIX(const T* gu, T* out, int inter, unsigned long long total) {        \
    silu_mul<T>(gu, out, inter, (size_t)total);                                                                  \
  }                                                                                                              \
  extern "C" __global__ void causal_softmax_##SUFFIX(const T* x, T* y, int l, int n) {                             \
    causal_softmax<T>(x, y, l, n);                                                                               \
  }                                                                                                              \
  extern "C" __global__ void snake_##SUFFIX(const T* x, const T* a, T* out, int c, int t,                        \
                                            unsigned long long total) {                                          \
    snake<T>(x, a, out, c, t, (size_t)total);                                                                    \
  }                                                                                                              \
  extern "C" __global__ void kv_rows_store_##SUFFIX(const T* k, const T* v, T* kp, T* vp, const unsigned* rows,     \
                                                    const unsigned* pos, int n, int h, int t, int d, int cap,      \
                                                    unsigned long long plane, unsigned long long total) {          \
    kv_rows_store<T>(k, v, kp, vp, rows, pos, n, h, t, d, cap, (size_t)plane, (size_t)total);                    \
  }

FUSED(f32, float)
FUSED(bf16, __nv_bfloat16)
FUSED(f16, __half)

// Rows `rows[r]` of a contiguous [S, row] tensor into a new [N, row] one, 16 bytes at a time
// (any dtype; the row's bytes and both starts 16-byte aligned): blockIdx.y is the output row.
extern "C" __global__ void rows_gather_u4(const uint4* __restrict__ src, const unsigned* __restrict__ rows, uint4* __restrict__ out,
                                          unsigned long long row_vecs) {
  const uint4* s = src + (size_t)rows[blockIdx.y] * row_vecs;
  uint4* o = out + (size_t)blockIdx.y * row_vecs;
  for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < row_vecs; e += (size_t)gridDim.x * blockDim.x) {
    o[e] = s[e];
  }
}
