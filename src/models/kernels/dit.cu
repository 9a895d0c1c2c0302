// The flow DiT block's fused row-wise ops (see src/models/code2wav/dit_ops.rs for each one's
// contract and its tensor-op twin, which defines the result). Arithmetic in f32, one rounding to
// the storage type at the end. Every kernel: (inputs..., out, ints..., floats...).

#include "common.cuh"

#include <mma.h>

#define ROW_THREADS 256

// mean and reciprocal std of row `x[0..h)` (every thread of the block gets both)
template <typename T>
__device__ void row_stats(const T* __restrict__ x, const T* __restrict__ bias, int h, float eps, float* red, float& mean, float& rstd) {
  float s = 0.f, ss = 0.f;
  for (int i = threadIdx.x; i < h; i += blockDim.x) {
    float v = to_f(x[i]);
    if (bias) v += to_f(bias[i]);
    s += v;
    ss += v * v;
  }
  s = block_reduce<false>(s, red);
  ss = block_reduce<false>(ss, red);
  mean = s / h;
  const float var = fmaxf(ss / h - mean * mean, 0.f);
  rstd = rsqrtf(var + eps);
}

// out = LN(x) * (1 + scale) + shift, LN without affine; x, out [R, h]; shift, scale [h]
template <typename T>
__device__ void ln_modulate(const T* __restrict__ x, const T* __restrict__ shift, const T* __restrict__ scale, T* __restrict__ out, int h,
                            float eps) {
  __shared__ float red[32];
  const size_t row = (size_t)blockIdx.x * h;
  float mean, rstd;
  row_stats<T>(x + row, nullptr, h, eps, red, mean, rstd);
  for (int i = threadIdx.x; i < h; i += blockDim.x) {
    const float y = (to_f(x[row + i]) - mean) * rstd;
    out[row + i] = from_f<T>(y * (1.f + to_f(scale[i])) + to_f(shift[i]));
  }
}

// out = mish(LN(x + bias) * w + b); x, out [R, h]; bias, w, b [h]
template <typename T>
__device__ void bias_ln_mish(const T* __restrict__ x, const T* __restrict__ bias, const T* __restrict__ w, const T* __restrict__ b,
                             T* __restrict__ out, int h, float eps) {
  __shared__ float red[32];
  const size_t row = (size_t)blockIdx.x * h;
  float mean, rstd;
  row_stats<T>(x + row, bias, h, eps, red, mean, rstd);
  for (int i = threadIdx.x; i < h; i += blockDim.x) {
    const float v = (to_f(x[row + i]) + to_f(bias[i]) - mean) * rstd * to_f(w[i]) + to_f(b[i]);
    const float sp = v > 20.f ? v : log1pf(expf(v));
    out[row + i] = from_f<T>(v * tanhf(sp));
  }
}

// out = x + (a + bias) * gate over [R, h]; bias may be null
template <typename T>
__device__ void gate_residual(const T* __restrict__ x, const T* __restrict__ a, const T* __restrict__ bias, const T* __restrict__ gate,
                              T* __restrict__ out, int h, size_t total) {
  for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < total; k += (size_t)gridDim.x * blockDim.x) {
    const int c = k % h;
    const float av = to_f(a[k]) + (bias ? to_f(bias[c]) : 0.f);
    out[k] = from_f<T>(to_f(x[k]) + av * to_f(gate[c]));
  }
}

// gate_residual, then ln_modulate of its (rounded) result, one block per row: out [2, R, h] = the
// residual x + (a + bias) * gate, then LN(residual) * (1 + scale) + shift; bias may be null. Each
// thread reads back only the elements it wrote, and the statistics are ln_modulate's, so both
// halves equal the two kernels' outputs.
template <typename T>
__device__ void gate_residual_ln(const T* __restrict__ x, const T* __restrict__ a, const T* __restrict__ bias, const T* __restrict__ gate,
                                 const T* __restrict__ shift, const T* __restrict__ scale, T* __restrict__ out, int h, int rows, float eps) {
  __shared__ float red[32];
  const size_t row = (size_t)blockIdx.x * h;
  T* res = out + row;
  for (int i = threadIdx.x; i < h; i += blockDim.x) {
    const float av = to_f(a[row + i]) + (bias ? to_f(bias[i]) : 0.f);
    res[i] = from_f<T>(to_f(x[row + i]) + av * to_f(gate[i]));
  }
  float mean, rstd;
  row_stats<T>(res, nullptr, h, eps, red, mean, rstd);
  T* y = out + (size_t)rows * h + row;
  for (int i = threadIdx.x; i < h; i += blockDim.x) {
    const float v = (to_f(res[i]) - mean) * rstd;
    y[i] = from_f<T>(v * (1.f + to_f(scale[i])) + to_f(shift[i]));
  }
}

// out = gelu_tanh(a + bias) over [R, h]
__device__ __forceinline__ float gelu_tanh_of(float v) {
  const float u = 0.7978845608028654f * (v + 0.044715f * v * v * v);
  return 0.5f * v * (1.f + tanhf(u));
}

template <typename T>
__device__ void bias_gelu(const T* __restrict__ a, const T* __restrict__ bias, T* __restrict__ out, int h, size_t total) {
  constexpr int V = 16 / sizeof(T);
  if (h % V == 0 && aligned16(a) && aligned16(bias) && aligned16(out)) {
    // 16 bytes a thread (one index computation for V elements)
    const unsigned hv = h / V;
    for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < total / V; k += (size_t)gridDim.x * blockDim.x) {
      alignas(16) T x[V], b[V];
      *reinterpret_cast<uint4*>(x) = reinterpret_cast<const uint4*>(a)[k];
      *reinterpret_cast<uint4*>(b) = reinterpret_cast<const uint4*>(bias)[(unsigned)(k % hv)];
#pragma unroll
      for (int i = 0; i < V; ++i) x[i] = from_f<T>(gelu_tanh_of(to_f(x[i]) + to_f(b[i])));
      reinterpret_cast<uint4*>(out)[k] = *reinterpret_cast<const uint4*>(x);
    }
    return;
  }
  for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < total; k += (size_t)gridDim.x * blockDim.x) {
    out[k] = from_f<T>(gelu_tanh_of(to_f(a[k]) + to_f(bias[k % h])));
  }
}

// The causal k=3 conv's input rows, time-major: out[n, t, k C + c] = src(n, t + k - 2, c) where
// src(n, j, c) = x[n, j, c] for j >= 0 and tail[n, 2 + j, tail_off + c] for j < 0 (zero when tail is null);
// x [N, T, C], tail [N, 2, W] (its channels tail_off .. tail_off + C; frames tail_stride = W apart), out [N, T, 3 C]
template <typename T>
__device__ void causal_im2col(const T* __restrict__ x, const T* __restrict__ tail, T* __restrict__ out, int t_len, int c,
                              int tail_off, int tail_stride, size_t total) {
  // (the tail's two frames: channels tail_off.. of frames tail_stride apart)
  const T* tp = tail ? tail + tail_off : nullptr;
  constexpr int V = 16 / sizeof(T);
  if (c % V == 0 && aligned16(x) && aligned16(out) && (tp == nullptr || (aligned16(tp) && tail_stride % V == 0))) {
    // 16 bytes a thread: a piece of V channels of one (n, t, k), its indices worked out once
    const unsigned cv = c / V;
    const unsigned sv = tail_stride / V;
    const uint4* xs = reinterpret_cast<const uint4*>(x);
    const uint4* ts = reinterpret_cast<const uint4*>(tp);
    uint4* os = reinterpret_cast<uint4*>(out);
    for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < total / V; k += (size_t)gridDim.x * blockDim.x) {
      const unsigned piece = (unsigned)(k % cv);
      size_t r = k / cv;
      const int kk = (int)(r % 3);
      r /= 3;
      const int t = (int)(r % t_len);
      const size_t n = r / t_len;
      const int j = t + kk - 2;
      if (j >= 0) {
        os[k] = xs[(n * t_len + j) * cv + piece];
      } else {
        os[k] = ts ? ts[(n * 2 + 2 + j) * sv + piece] : make_uint4(0, 0, 0, 0);
      }
    }
    return;
  }
  for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < total; k += (size_t)gridDim.x * blockDim.x) {
    const int cc = k % c;
    size_t r = k / c;
    const int kk = r % 3;
    r /= 3;
    const int t = r % t_len;
    const size_t n = r / t_len;
    const int j = t + kk - 2;
    T v;
    if (j >= 0) {
      v = x[(n * t_len + j) * c + cc];
    } else {
      v = tp ? tp[(n * 2 + 2 + j) * (size_t)tail_stride + cc] : from_f<T>(0.f);
    }
    out[k] = v;
  }
}

// The attention's heads from the fused projection: qkv [N, T, 3, H, D] (+ bias [3 H D]) -> out
// [3, N, H, T, D]: q = LN(q) * qw + qb, k = LN(k) * kw + kb (per head, over D), v as it is. One
// warp per (n, t, part, head); D <= 128.
template <typename T>
__device__ void qkv_heads(const T* __restrict__ qkv, const T* __restrict__ bias, const T* __restrict__ qw, const T* __restrict__ qb,
                          const T* __restrict__ kw, const T* __restrict__ kb, T* __restrict__ out, int n, int t_len, int h, int d,
                          float eps) {
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
  const int total = n * t_len * 3 * h;
  if (warp >= total) return;
  const int head = warp % h;
  const int part = (warp / h) % 3;
  const int t = (warp / (3 * h)) % t_len;
  const int nn = warp / (3 * h * t_len);
  const size_t src = (size_t)warp * d;
  const int bo = (part * h + head) * d;
  float v[4];
  float s = 0.f, ss = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int e = lane + 32 * i;
    v[i] = 0.f;
    if (e < d) {
      v[i] = to_f(qkv[src + e]) + to_f(bias[bo + e]);
      s += v[i];
      ss += v[i] * v[i];
    }
  }
  if (part < 2) {
    s = warp_sum(s);
    ss = warp_sum(ss);
    const float mean = s / d;
    const float rstd = rsqrtf(fmaxf(ss / d - mean * mean, 0.f) + eps);
    const T* w = part == 0 ? qw : kw;
    const T* b = part == 0 ? qb : kb;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int e = lane + 32 * i;
      if (e < d) v[i] = (v[i] - mean) * rstd * to_f(w[e]) + to_f(b[e]);
    }
  }
  const size_t dst = ((((size_t)part * n + nn) * h + head) * t_len + t) * d;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int e = lane + 32 * i;
    if (e < d) out[dst + e] = from_f<T>(v[i]);
  }
}

// out[r] = softmax(att[r] + mask[r / rows_per_mask]) over rows of length l
template <typename T>
__device__ void masked_softmax(const T* __restrict__ att, const T* __restrict__ mask, T* __restrict__ out, int l, int rows_per_mask) {
  __shared__ float red[32];
  const size_t row = (size_t)blockIdx.x * l;
  const size_t mrow = (size_t)(blockIdx.x / rows_per_mask) * l;
  float mx = -INFINITY;
  for (int i = threadIdx.x; i < l; i += blockDim.x) mx = fmaxf(mx, to_f(att[row + i]) + to_f(mask[mrow + i]));
  mx = block_reduce<true>(mx, red);
  float s = 0.f;
  for (int i = threadIdx.x; i < l; i += blockDim.x) s += expf(to_f(att[row + i]) + to_f(mask[mrow + i]) - mx);
  s = block_reduce<false>(s, red);
  const float inv = 1.f / s;
  for (int i = threadIdx.x; i < l; i += blockDim.x) out[row + i] = from_f<T>(expf(to_f(att[row + i]) + to_f(mask[mrow + i]) - mx) * inv);
}

// The same, a warp a row (rows of up to SM_WARP_VALUES * 32 values, held in registers: one read of
// the scores and the mask, one write, no block barriers); a block of 256 threads takes 8 rows.
#define SM_WARP_VALUES 32
template <typename T>
__device__ void masked_softmax_rows(const T* __restrict__ att, const T* __restrict__ mask, T* __restrict__ out, int l, int rows_per_mask,
                                    int n_rows) {
  const int lane = threadIdx.x % 32;
  const int r = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (r >= n_rows) return;
  const size_t row = (size_t)r * l;
  const size_t mrow = (size_t)(r / rows_per_mask) * l;
  float v[SM_WARP_VALUES];
  float mx = -INFINITY;
#pragma unroll
  for (int j = 0; j < SM_WARP_VALUES; ++j) {
    const int i = lane + j * 32;
    v[j] = i < l ? to_f(att[row + i]) + to_f(mask[mrow + i]) : -INFINITY;
    mx = fmaxf(mx, v[j]);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < SM_WARP_VALUES; ++j) {
    v[j] = lane + j * 32 < l ? expf(v[j] - mx) : 0.f;
    s += v[j];
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  const float inv = 1.f / s;
#pragma unroll
  for (int j = 0; j < SM_WARP_VALUES; ++j) {
    const int i = lane + j * 32;
    if (i < l) out[row + i] = from_f<T>(v[j] * inv);
  }
}

// A convolution's columns (see conv_cols.rs): x [B, C, T] -> col [B, R, L] (R: C K + 1
// rounded up to a multiple of 4, the rows after C K zero);
// col[b, c K + j, t] = u(x)[b, c, t s + j d - pad_l] (zero outside), col[b, C K, t] = 1, where u
// repeats every sample `up` times (nearest upsampling); with `alpha` (per channel, may be null) the
// input goes through Snake first, x + sin²(αx) / (α + 1e-9) (zero stays zero, so the padding is the
// same either way). The columns are of type U (the input's, or f16 for the vocoder's f16 products).
// One block per output row at a time: the row's indices are worked out once, the
// threads walk its positions (no 64-bit division per element).
template <typename T, typename U>
__device__ void conv_cols(const T* __restrict__ x, const T* __restrict__ alpha, U* __restrict__ col, int c, int t_in, int k, int d, int pad_l, int l_out,
                          int stride, int up, int rows_per, int rows_total) {
  const int rows = rows_per;
  const int t_up = t_in * up;
  for (int r = blockIdx.x; r < rows_total; r += gridDim.x) {
    const int row = r % rows;
    const int b = r / rows;
    U* __restrict__ out = col + (size_t)r * l_out;
    if (row >= c * k) {
      const U fill = from_f<U>(row == c * k ? 1.f : 0.f);
      for (int t = threadIdx.x; t < l_out; t += blockDim.x) out[t] = fill;
      continue;
    }
    const int cc = row / k, j = row % k;
    const T* __restrict__ src = x + ((size_t)b * c + cc) * t_in;
    const int off = j * d - pad_l;
    if (alpha != nullptr) {
      const float al = to_f(alpha[cc]);
      for (int t = threadIdx.x; t < l_out; t += blockDim.x) {
        const int u = t * stride + off;
        float v = 0.f;
        if (u >= 0 && u < t_up) {
          v = snake_of(to_f(src[up == 1 ? u : u / up]), al);
        }
        out[t] = from_f<U>(v);
      }
      continue;
    }
    for (int t = threadIdx.x; t < l_out; t += blockDim.x) {
      const int u = t * stride + off;
      out[t] = (u >= 0 && u < t_up) ? from_f<U>(to_f(src[up == 1 ? u : u / up])) : from_f<U>(0.f);
    }
  }
}

// A conv block's cache, written in place: dst [N, 2, 2c] (row n, frame f) = x's | y's frame t - 2 + f
// (x, y [N, t, c]).
template <typename T>
__device__ void conv_tails(const T* __restrict__ x, const T* __restrict__ y, T* __restrict__ dst, int t, int c, size_t total) {
  for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < total; k += (size_t)gridDim.x * blockDim.x) {
    const int col = k % (2 * c);
    const size_t r = k / (2 * c);
    const int f = r % 2;
    const size_t n = r / 2;
    const size_t at = (n * t + t - 2 + f) * c;
    dst[k] = col < c ? x[at + col] : y[at + col - c];
  }
}

// conv_tails with each row's own length: row n's frames end at ends[n] (<= t, >= 2), the rest of
// the row is a padded chunk's padding.
template <typename T>
__device__ void conv_tails_at(const T* __restrict__ x, const T* __restrict__ y, const unsigned int* __restrict__ ends, T* __restrict__ dst,
                              int t, int c, size_t total) {
  for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < total; k += (size_t)gridDim.x * blockDim.x) {
    const int col = k % (2 * c);
    const size_t r = k / (2 * c);
    const int f = r % 2;
    const size_t n = r / 2;
    const size_t at = (n * t + ends[n] - 2 + f) * c;
    dst[k] = col < c ? x[at + col] : y[at + col - c];
  }
}

// Keys and values joined on the last axis, written in place: dst [R, 2d] = k [R, d] | v [R, d].
template <typename T>
__device__ void kv_join(const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ dst, int d, size_t total) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
    const int col = i % (2 * d);
    const size_t r = i / (2 * d);
    dst[i] = col < d ? k[r * d + col] : v[r * d + col - d];
  }
}

#define DIT(SUFFIX, T)                                                                                                      \
  extern "C" __global__ void ln_modulate_##SUFFIX(const T* x, const T* shift, const T* scale, T* out, int h, float eps) {    \
    ln_modulate<T>(x, shift, scale, out, h, eps);                                                                          \
  }                                                                                                                        \
  extern "C" __global__ void bias_ln_mish_##SUFFIX(const T* x, const T* bias, const T* w, const T* b, T* out, int h,        \
                                                   float eps) {                                                            \
    bias_ln_mish<T>(x, bias, w, b, out, h, eps);                                                                           \
  }                                                                                                                        \
  extern "C" __global__ void gate_residual_##SUFFIX(const T* x, const T* a, const T* bias, const T* gate, T* out, int h,     \
                                                    unsigned long long total) {                                            \
    gate_residual<T>(x, a, bias, gate, out, h, (size_t)total);                                                             \
  }                                                                                                                        \
  extern "C" __global__ void gate_residual_ln_##SUFFIX(const T* x, const T* a, const T* bias, const T* gate, const T* shift,    \
                                                       const T* scale, T* out, int h, int rows, float eps) {                \
    gate_residual_ln<T>(x, a, bias, gate, shift, scale, out, h, rows, eps);                                                \
  }                                                                                                                        \
  extern "C" __global__ void bias_gelu_##SUFFIX(const T* a, const T* bias, T* out, int h, unsigned long long total) {       \
    bias_gelu<T>(a, bias, out, h, (size_t)total);                                                                          \
  }                                                                                                                        \
  extern "C" __global__ void causal_im2col_##SUFFIX(const T* x, const T* tail, T* out, int t_len, int c, int tail_off,      \
                                                    int tail_stride, unsigned long long total) {                           \
    causal_im2col<T>(x, tail, out, t_len, c, tail_off, tail_stride, (size_t)total);                                        \
  }                                                                                                                        \
  extern "C" __global__ void qkv_heads_##SUFFIX(const T* qkv, const T* bias, const T* qw, const T* qb, const T* kw,         \
                                                const T* kb, T* out, int n, int t_len, int h, int d, float eps) {          \
    qkv_heads<T>(qkv, bias, qw, qb, kw, kb, out, n, t_len, h, d, eps);                                                     \
  }                                                                                                                        \
  extern "C" __global__ void conv_cols_##SUFFIX(const T* x, const T* alpha, T* col, int c, int t_in, int k, int d,       \
                                                int pad_l, int l_out, int stride, int up, int rows_per, int rows_total) {  \
    conv_cols<T, T>(x, alpha, col, c, t_in, k, d, pad_l, l_out, stride, up, rows_per, rows_total);                            \
  }                                                                                                                        \
  extern "C" __global__ void masked_softmax_##SUFFIX(const T* att, const T* mask, T* out, int l, int rows_per_mask) {       \
    masked_softmax<T>(att, mask, out, l, rows_per_mask);                                                                   \
  }                                                                                                                        \
  extern "C" __global__ void masked_softmax_rows_##SUFFIX(const T* att, const T* mask, T* out, int l, int rows_per_mask,      \
                                                        int n_rows) {                                                      \
    masked_softmax_rows<T>(att, mask, out, l, rows_per_mask, n_rows);                                                      \
  }                                                                                                                        \
  extern "C" __global__ void conv_tails_##SUFFIX(const T* x, const T* y, T* dst, int t_len, int c, unsigned long long total) { \
    conv_tails<T>(x, y, dst, t_len, c, (size_t)total);                                                                     \
  }                                                                                                                        \
  extern "C" __global__ void conv_tails_at_##SUFFIX(const T* x, const T* y, const unsigned int* ends, T* dst, int t_len,      \
                                                    int c, unsigned long long total) {                                     \
    conv_tails_at<T>(x, y, ends, dst, t_len, c, (size_t)total);                                                            \
  }                                                                                                                        \
  extern "C" __global__ void kv_join_##SUFFIX(const T* k, const T* v, T* dst, int d, unsigned long long total) {            \
    kv_join<T>(k, v, dst, d, (size_t)total);                                                                               \
  }

DIT(f32, float)
DIT(bf16, __nv_bfloat16)
DIT(f16, __half)

// The pointer arrays of the in-place pool attention (dit_attention_in_place.rs), one entry per
// (row n, head h), i = n heads + h: the queries' plane, the pool's key and value planes of slot row
// rows[n], the scores' and the probabilities' planes, and the output's first column of head h in
// row n's [T, heads d] (its leading dimension heads d). Addresses in bytes (es: an element's size).
extern "C" __global__ void attention_pointers(unsigned long long q, unsigned long long pk, unsigned long long pv, unsigned long long sc,
                                              unsigned long long pr, unsigned long long o, const unsigned int* rows, unsigned long long* ptrs,
                                              int n, int heads, int t, int cap, int d, int es) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  const int total = n * heads;
  if (i >= total) return;
  const int nn = i / heads, hh = i % heads;
  const unsigned long long plane = ((unsigned long long)rows[nn] * heads + hh) * cap * d * es;
  const unsigned long long scores = (unsigned long long)i * t * cap * es;
  ptrs[i] = q + (unsigned long long)i * t * d * es;
  ptrs[total + i] = pk + plane;
  ptrs[2 * total + i] = pv + plane;
  ptrs[3 * total + i] = sc + scores;
  ptrs[4 * total + i] = pr + scores;
  ptrs[5 * total + i] = o + ((unsigned long long)nn * t * heads + hh) * d * es;
}

// f32 input, f16 columns (conv_cols_half in conv_cols.rs): half the bytes written and read again by
// the vocoder's products, which multiply f16 by f16 into f32 sums.
extern "C" __global__ void conv_cols_half_f32(const float* x, const float* alpha, __half* col, int c, int t_in, int k, int d, int pad_l,
                                              int l_out, int stride, int up, int rows_per, int rows_total) {
  conv_cols<float, __half>(x, alpha, col, c, t_in, k, d, pad_l, l_out, stride, up, rows_per, rows_total);
}

// Attention of a chunk's queries over a slot pool's keys and values, in place (flash-style):
// q [N, heads, T, 64]; pk, pv [R, heads, cap, 64] (one block's planes, cap a multiple of 16); rows
// [N] (row n's slot row in the pool); mask [N, cap] (0 or -inf, added to the scores); out [N, T,
// heads 64] = softmax(q k^T + mask) v over row n's planes, the heads side by side. Replaces
// gathering the rows' planes, two products, the masked softmax and the heads' transpose.
// One block of 4 warps per (row, head, 16 queries); the warps split the keys (warp w takes key
// tiles w, w + 4, … of 32 keys, each warp with a running max and sum), then the block joins the 4
// partial sums. A warp reads a tile's keys and values 16 bytes a lane, all at once (the values
// arrive while the scores are worked out), through its own shared memory to the tensor cores.
// Scores and sums in f32, the probabilities rounded to T before their product with the values,
// as the op-by-op path rounds them.
#define PA_HD 64
#define PA_KT 32
#define PA_WARPS 4
#define PA_PIECES (PA_KT * PA_HD * 2 / 16 / 32)  // 16-byte pieces of a tile per lane

template <typename T>
__device__ void pool_attention(const T* __restrict__ q, const T* __restrict__ pk, const T* __restrict__ pv, const T* __restrict__ mask,
                               const unsigned int* __restrict__ rows, T* __restrict__ out, int heads, int t_len, int cap) {
#if __CUDA_ARCH__ >= 800
  using namespace nvcuda;
  __shared__ __align__(128) T qs[16 * PA_HD];                 // the block's queries (rows past T zero)
  __shared__ __align__(128) T kvs[PA_WARPS][PA_KT * PA_HD];    // a warp's tile: its keys, then its values
  __shared__ __align__(128) float sp[PA_WARPS][16 * PA_KT];    // a warp's scores, then its probabilities (as T)
  __shared__ __align__(128) float acc[PA_WARPS][16 * PA_HD];   // a warp's output rows over its keys, unnormalised
  __shared__ float stats[PA_WARPS][16][2];                     // a warp's max and sum per row
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int qtiles = (t_len + 15) / 16;
  const int nh = blockIdx.x / qtiles, t0 = (blockIdx.x % qtiles) * 16;
  const int nn = nh / heads, head = nh % heads;
  const size_t plane = ((size_t)rows[nn] * heads + head) * (size_t)cap * PA_HD;
  const uint4* kp = reinterpret_cast<const uint4*>(pk + plane);
  const uint4* vp = reinterpret_cast<const uint4*>(pv + plane);
  const T* qh = q + ((size_t)nh * t_len + t0) * PA_HD;
  const T* mrow = mask + (size_t)nn * cap;
  T* kv = kvs[warp];
  uint4* kv4 = reinterpret_cast<uint4*>(kv);
  float* s = sp[warp];
  float* o = acc[warp];
  T* p = reinterpret_cast<T*>(s);
  for (int i = threadIdx.x; i < 16 * PA_HD; i += blockDim.x) qs[i] = t0 + i / PA_HD < t_len ? qh[i] : from_f<T>(0.f);
  for (int i = lane; i < 16 * PA_HD; i += 32) o[i] = 0.f;
  __syncthreads();
  wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> qa[PA_HD / 16];
#pragma unroll
  for (int k = 0; k < PA_HD / 16; ++k) wmma::load_matrix_sync(qa[k], qs + k * 16, PA_HD);
  const int r = lane / 2, half = lane % 2;  // the query row this lane keeps, and its 16 columns
  float m = -INFINITY, l = 0.f;
  for (int j0 = warp * PA_KT; j0 < cap; j0 += PA_WARPS * PA_KT) {
    const int nk = min(PA_KT, cap - j0);  // 16 or 32 keys
    const int pieces = nk / 16;
    // the tile's keys and values (and this lane's mask entries) requested at once
    const size_t base = (size_t)j0 * PA_HD * sizeof(T) / 16;
    const int valid = nk * PA_HD * (int)sizeof(T) / 16;
    uint4 kr[PA_PIECES], vr[PA_PIECES];
#pragma unroll
    for (int i = 0; i < PA_PIECES; ++i) {
      const int at = lane + 32 * i;
      kr[i] = at < valid ? kp[base + at] : make_uint4(0, 0, 0, 0);
      vr[i] = at < valid ? vp[base + at] : make_uint4(0, 0, 0, 0);
    }
    float mk[16];
#pragma unroll
    for (int c = 0; c < 16; ++c) {
      const int col = half * 16 + c;
      mk[c] = col < nk ? to_f(mrow[j0 + col]) : -INFINITY;
    }
#pragma unroll
    for (int i = 0; i < PA_PIECES; ++i) kv4[lane + 32 * i] = kr[i];
    __syncwarp();
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> sc;
#pragma unroll
    for (int nt = 0; nt < PA_KT / 16; ++nt) {
      if (nt < pieces) {
        wmma::fill_fragment(sc, 0.f);
#pragma unroll
        for (int k = 0; k < PA_HD / 16; ++k) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> kb;
          wmma::load_matrix_sync(kb, kv + nt * 16 * PA_HD + k * 16, PA_HD);
          wmma::mma_sync(sc, qa[k], kb, sc);
        }
        wmma::store_matrix_sync(s + nt * 16, sc, PA_KT, wmma::mem_row_major);
      }
    }
    __syncwarp();
    // row r's running max and sum over this tile (two lanes a row, 16 columns each)
    float v[16];
    float mx = -INFINITY;
#pragma unroll
    for (int c = 0; c < 16; ++c) {
      const int col = half * 16 + c;
      v[c] = col < nk ? s[r * PA_KT + col] + mk[c] : -INFINITY;
      mx = fmaxf(mx, v[c]);
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    const float mnew = fmaxf(m, mx);
    const float keep = mnew == -INFINITY ? 1.f : __expf(m - mnew);
    float sum = 0.f;
    __syncwarp();  // every lane has read its scores and the keys: p and the values may overwrite them
#pragma unroll
    for (int c = 0; c < 16; ++c) {
      const float e = mnew == -INFINITY ? 0.f : __expf(v[c] - mnew);
      sum += e;
      p[r * PA_KT + half * 16 + c] = from_f<T>(e);
    }
#pragma unroll
    for (int i = 0; i < PA_PIECES; ++i) kv4[lane + 32 * i] = vr[i];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    l = l * keep + sum;
    m = mnew;
#pragma unroll
    for (int c = 0; c < 32; ++c) o[r * PA_HD + half * 32 + c] *= keep;
    __syncwarp();
#pragma unroll
    for (int nt = 0; nt < PA_HD / 16; ++nt) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> oc;
      wmma::load_matrix_sync(oc, o + nt * 16, PA_HD, wmma::mem_row_major);
#pragma unroll
      for (int k = 0; k < PA_KT / 16; ++k) {
        if (k < pieces) {
          wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> pa;
          wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> vb;
          wmma::load_matrix_sync(pa, p + k * 16, PA_KT);
          wmma::load_matrix_sync(vb, kv + k * 16 * PA_HD + nt * 16, PA_HD);
          wmma::mma_sync(oc, pa, vb, oc);
        }
      }
      wmma::store_matrix_sync(o + nt * 16, oc, PA_HD, wmma::mem_row_major);
    }
    __syncwarp();
  }
  if (half == 0) {
    stats[warp][r][0] = m;
    stats[warp][r][1] = l;
  }
  __syncthreads();
  // the warps' partial sums joined: a thread per (row, 8 columns)
  const int rr = threadIdx.x / 8, c0 = (threadIdx.x % 8) * 8;
  if (rr < 16 && t0 + rr < t_len) {
    float mall = -INFINITY;
#pragma unroll
    for (int w = 0; w < PA_WARPS; ++w) mall = fmaxf(mall, stats[w][rr][0]);
    float f[PA_WARPS], lall = 0.f;
#pragma unroll
    for (int w = 0; w < PA_WARPS; ++w) {
      f[w] = stats[w][rr][0] == -INFINITY ? 0.f : __expf(stats[w][rr][0] - mall);
      lall += stats[w][rr][1] * f[w];
    }
    const float inv = lall > 0.f ? 1.f / lall : 0.f;
    alignas(16) T res[8];
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      float a = 0.f;
#pragma unroll
      for (int w = 0; w < PA_WARPS; ++w) a += acc[w][rr * PA_HD + c0 + c] * f[w];
      res[c] = from_f<T>(a * inv);
    }
    *reinterpret_cast<uint4*>(out + ((size_t)nn * t_len + t0 + rr) * heads * PA_HD + head * PA_HD + c0) = *reinterpret_cast<const uint4*>(res);
  }
#else
  __trap();  // the tensor-core path needs sm_80 or later; dit_attention.rs calls it only there
#endif
}

#define POOL_ATTENTION(SUFFIX, T)                                                                                             \
  extern "C" __global__ void __launch_bounds__(128) pool_attention_##SUFFIX(const T* q, const T* pk, const T* pv, const T* mask, \
                                                                          const unsigned int* rows, T* out, int heads,       \
                                                                          int t_len, int cap) {                              \
    pool_attention<T>(q, pk, pv, mask, rows, out, heads, t_len, cap);                                                        \
  }

POOL_ATTENTION(bf16, __nv_bfloat16)
POOL_ATTENTION(f16, __half)
