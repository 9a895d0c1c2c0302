// The batched decode step over a slot pool: B streams advance one position each in one launch per
// op; stream b's K/V live in slot slots[b] of the pool, its position is pos[b] (both read from
// device memory, so one captured graph serves every batch of that size). See
// src/models/batch_decode.rs for the contract; each kernel has a tensor-op twin there.
//
// Shapes (row-major, contiguous): heads / qkv [B, hq + 2 hkv, d] (q heads, k heads, v heads);
// kc, vc [slots, hkv, cap, d]; slots, pos [B] u32; cos, sin [max_pos, d / 2]; w [hq + hkv, d].

#include "common.cuh"


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

// The positions each of `splits` blocks covers for a row at position pos: a whole number of
// `chunk`s (the positions a block takes at a time), the fewest that let `splits` blocks cover
// 0..=pos (one chunk at least). Pass 1 and pass 2 agree on it: the grid is fixed (a captured
// graph replays it at any positions) and the work follows the position, not the slot's capacity.
__device__ __forceinline__ int split_span(int pos, int splits, int chunk) {
  const int per = (pos + splits) / splits;  // ceil((pos + 1) / splits)
  return (per + chunk - 1) / chunk * chunk;
}

// Eight consecutive elements of a K or V row as one lane loads them (16 bytes of bf16 or f16, 32
// of f32), converted to f32 where they are used.
template <typename T> struct Raw8 { uint4 a; };
template <> struct Raw8<float> { float4 a, b; };
template <typename T> __device__ __forceinline__ Raw8<T> load8(const T* p) {
  return Raw8<T>{*reinterpret_cast<const uint4*>(p)};
}
template <> __device__ __forceinline__ Raw8<float> load8<float>(const float* p) {
  const float4* q = reinterpret_cast<const float4*>(p);
  return Raw8<float>{q[0], q[1]};
}
template <typename T> __device__ __forceinline__ Raw8<T> zero8() { return Raw8<T>{make_uint4(0, 0, 0, 0)}; }
template <> __device__ __forceinline__ Raw8<float> zero8<float>() {
  return Raw8<float>{make_float4(0.f, 0.f, 0.f, 0.f), make_float4(0.f, 0.f, 0.f, 0.f)};
}
__device__ __forceinline__ uint32_t word(const uint4& a, int i) {
  return i == 0 ? a.x : i == 1 ? a.y : i == 2 ? a.z : a.w;
}
// element e (0..7, known at compile time once unrolled)
template <typename T> __device__ __forceinline__ float elem(const Raw8<T>& r, int e);
template <> __device__ __forceinline__ float elem<__nv_bfloat16>(const Raw8<__nv_bfloat16>& r, int e) {
  const uint32_t w = word(r.a, e / 2);
  return __uint_as_float(e % 2 == 0 ? w << 16 : w & 0xffff0000u);
}
template <> __device__ __forceinline__ float elem<__half>(const Raw8<__half>& r, int e) {
  const uint32_t w = word(r.a, e / 2);
  return __half2float(__ushort_as_half((unsigned short)(e % 2 == 0 ? w & 0xffffu : w >> 16)));
}
template <> __device__ __forceinline__ float elem<float>(const Raw8<float>& r, int e) {
  const float4& h = e < 4 ? r.a : r.b;
  const int i = e % 4;
  return i == 0 ? h.x : i == 1 ? h.y : i == 2 ? h.z : h.w;
}

#define WARP_CHUNK 16  // positions a block of attn_partial_warps takes at a time (4 a warp)
#define WARPS 4        // per block (128 threads)
// Attention (split-KV, "flash decoding"), pass 1, the form of bf7c205 (`batch_attn_partial`;
// `engine.decode_attention_teams` off), grid (hkv, splits, B), 128 threads: block (j, y, b) covers KV head j's query heads of stream b (K and V read once for all of them) over
// its span of positions (split_span) of 0..=pos[b] in the stream's slot. Each warp takes PER_WARP
// consecutive positions of every WARP_CHUNK of the span and keeps its own running max, sum and
// weighted sum of V rows (online softmax, no barrier inside the loop: each warp's loads are in
// flight together); the warps are merged at the end. For each head the block writes the span's
// max m, its sum of exp(s - m) and its unnormalised weighted sum of V rows (f32) to part_ml /
// part_acc. Blocks past pos[b] return at once. This position's K and V come from heads, never
// from the cache (which the q/k kernel has written before, but need not have). Query head h reads
// KV head h / (hq / hkv); G (1, 2, 4 or 8) is at least hq / hkv and sizes the per-head registers.
template <typename T, int G>
__device__ void attn_partial_warps(const T* __restrict__ heads, const T* __restrict__ kc, const T* __restrict__ vc,
                             const uint32_t* __restrict__ slots, const uint32_t* __restrict__ pos_p,
                             float* __restrict__ part_acc, float* __restrict__ part_ml, int hq, int hkv, int cap,
                             int d) {
  constexpr int PER_WARP = WARP_CHUNK / WARPS;
  __shared__ float w_ml[WARPS][G][2];
  __shared__ float w_acc[WARPS][G][128];
  const int j = blockIdx.x, y = blockIdx.y, b = blockIdx.z, group = hq / hkv, splits = gridDim.y;
  const int rows = hq + 2 * hkv;
  const int pos = min((int)pos_p[b], cap - 1);
  const int span = split_span(pos, splits, WARP_CHUNK);
  const int start = y * span;
  if (start > pos) return;  // beyond the held positions: the combine never reads this split
  const int end = min(start + span, pos + 1);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const T* q = heads + (size_t)b * rows * d;
  const T* k_new = q + (size_t)hq * d;
  const T* v_new = k_new + (size_t)hkv * d;
  const size_t slot = (size_t)slots[b] * hkv * cap * d;
  kc += slot + (size_t)j * cap * d;
  vc += slot + (size_t)j * cap * d;
  k_new += (size_t)j * d;
  v_new += (size_t)j * d;
  part_acc += (size_t)b * hq * splits * d;
  part_ml += (size_t)b * hq * splits * 2;
  float qv[G][4], acc[G][4], m[G], l[G];
#pragma unroll
  for (int r = 0; r < G; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = lane + 32 * e;
      qv[r][e] = r < group && i < d ? to_f(q[((size_t)j * group + r) * d + i]) : 0.f;
      acc[r][e] = 0.f;
    }
  }
  for (int c0 = start + warp * PER_WARP; c0 < end; c0 += WARP_CHUNK) {
    // this warp's positions c0 .. c0 + PER_WARP - 1: every K and V row loaded before any is used
    float kx[PER_WARP][4], vx[PER_WARP][4];
#pragma unroll
    for (int u = 0; u < PER_WARP; ++u) {
      const int t = c0 + u;
      const T* kr = t == pos ? k_new : kc + (size_t)t * d;
      const T* vr = t == pos ? v_new : vc + (size_t)t * d;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = lane + 32 * e;
        const bool in = t < end && i < d;
        kx[u][e] = in ? to_f(kr[i]) : 0.f;
        vx[u][e] = in ? to_f(vr[i]) : 0.f;
      }
    }
#pragma unroll
    for (int r = 0; r < G; ++r) {
      if (r >= group) break;
      float sc[PER_WARP];
      float mx = m[r];
#pragma unroll
      for (int u = 0; u < PER_WARP; ++u) {
        float s = 0.f;
#pragma unroll
        for (int e = 0; e < 4; ++e) s += qv[r][e] * kx[u][e];
        sc[u] = warp_sum(s);  // (every lane holds it)
        if (c0 + u < end) mx = fmaxf(mx, sc[u]);
      }
      // (c0 < end: mx is finite; the first rescale is exp(-inf) = 0)
      const float rescale = expf(m[r] - mx);
      l[r] *= rescale;
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[r][e] *= rescale;
#pragma unroll
      for (int u = 0; u < PER_WARP; ++u) {
        const float p = c0 + u < end ? expf(sc[u] - mx) : 0.f;
        l[r] += p;
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[r][e] += p * vx[u][e];
      }
      m[r] = mx;
    }
  }
  // the warps merged (a warp that held no position: max -inf, sum and weights 0, weight 0 here)
#pragma unroll
  for (int r = 0; r < G; ++r) {
    if (lane == 0) {
      w_ml[warp][r][0] = m[r];
      w_ml[warp][r][1] = l[r];
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      w_acc[warp][r][lane + 32 * e] = acc[r][e];
    }
  }
  __syncthreads();
  const int di = threadIdx.x;
  for (int r = 0; r < group; ++r) {
    float mm = -INFINITY;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) mm = fmaxf(mm, w_ml[w][r][0]);
    float ll = 0.f, a = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      const float f = expf(w_ml[w][r][0] - mm);
      ll += w_ml[w][r][1] * f;
      if (di < d) a += w_acc[w][r][di] * f;
    }
    const size_t at = (size_t)(j * group + r) * splits + y;
    if (di < d) part_acc[at * d + di] = a;
    if (di == 0) {
      part_ml[at * 2] = mm;
      part_ml[at * 2 + 1] = ll;
    }
  }
}

// Attention pass 1 in teams (`batch_attn_teams`; `engine.decode_attention_teams` on), grid (hkv,
// splits, B), 128 threads: block (j, y, b) covers KV head j's query heads of stream b (K and V
// read once for all of them) over its span of positions (split_span) of 0..=pos[b] in the stream's
// slot. A position's row is
// read by a team of `lanes` threads (d / 8 rounded up to a power of two, 16 for d = 128), each
// loading 8 consecutive elements at once; the block's 128 / lanes teams take PER consecutive
// positions each of every chunk (128 / lanes x PER positions) of the span, every row loaded
// before any is used, and each team keeps its own running max, sum and weighted sum of V rows
// (online softmax, no barrier inside the loop); a score is summed over its team in log2(lanes)
// shuffles. The teams are merged at the end. For each head the block writes the span's max m,
// its sum of exp(s - m) and its unnormalised weighted sum of V rows (f32) to part_ml / part_acc.
// Blocks past pos[b] return at once. This position's K and V come from heads, never from the
// cache (which the q/k kernel has written before, but need not have). Query head h reads KV head
// h / (hq / hkv); G (1, 2, 4 or 8) is at least hq / hkv and sizes the per-head registers. The
// host checks d <= 128, d % 8 == 0 and 16-byte aligned rows.
#define PER 4         // positions a team takes at a time
#define THREADS 128   // per block
template <typename T, int G>
__device__ void attn_partial_teams(const T* __restrict__ heads, const T* __restrict__ kc, const T* __restrict__ vc,
                             const uint32_t* __restrict__ slots, const uint32_t* __restrict__ pos_p,
                             float* __restrict__ part_acc, float* __restrict__ part_ml, int hq, int hkv, int cap,
                             int d, int lanes) {
  __shared__ float t_ml[THREADS][G][2];  // (at most 128 teams, of one lane, for d = 8)
  __shared__ float t_acc[THREADS * 8 * G];  // [team][head][d]: teams x d = 8 x THREADS / lanes x lanes
  const int j = blockIdx.x, y = blockIdx.y, b = blockIdx.z, group = hq / hkv, splits = gridDim.y;
  const int teams = THREADS / lanes, chunk = teams * PER;
  const int rows = hq + 2 * hkv;
  const int pos = min((int)pos_p[b], cap - 1);
  const int span = split_span(pos, splits, chunk);
  const int start = y * span;
  if (start > pos) return;  // beyond the held positions: the combine never reads this split
  const int end = min(start + span, pos + 1);
  const int team = threadIdx.x / lanes, lane = threadIdx.x % lanes, at = lane * 8;
  const bool active = at < d;  // (a lane past d holds zeros)
  const T* q = heads + (size_t)b * rows * d;
  const T* k_new = q + (size_t)hq * d;
  const T* v_new = k_new + (size_t)hkv * d;
  const size_t slot = (size_t)slots[b] * hkv * cap * d;
  kc += slot + (size_t)j * cap * d;
  vc += slot + (size_t)j * cap * d;
  k_new += (size_t)j * d;
  v_new += (size_t)j * d;
  part_acc += (size_t)b * hq * splits * d;
  part_ml += (size_t)b * hq * splits * 2;
  float qv[G][8], acc[G][8], m[G], l[G];
#pragma unroll
  for (int r = 0; r < G; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      qv[r][e] = r < group && active ? to_f(q[((size_t)j * group + r) * d + at + e]) : 0.f;
      acc[r][e] = 0.f;
    }
  }
  // every lane runs every round (the shuffles take the whole warp); a team's positions past the
  // span's end read its last row and weigh nothing
  for (int base = start; base < end; base += chunk) {
    const int c0 = base + team * PER;
    Raw8<T> kx[PER], vx[PER];
#pragma unroll
    for (int u = 0; u < PER; ++u) {
      const int t = min(c0 + u, end - 1);
      const T* kr = t == pos ? k_new : kc + (size_t)t * d;
      const T* vr = t == pos ? v_new : vc + (size_t)t * d;
      kx[u] = active ? load8(kr + at) : zero8<T>();
      vx[u] = active ? load8(vr + at) : zero8<T>();
    }
#pragma unroll
    for (int r = 0; r < G; ++r) {
      if (r >= group) break;
      float sc[PER];
      float mx = m[r];
#pragma unroll
      for (int u = 0; u < PER; ++u) {
        float s = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) s += qv[r][e] * elem(kx[u], e);
        for (int o = lanes / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        sc[u] = s;  // (every lane of the team holds it)
        if (c0 + u < end) mx = fmaxf(mx, sc[u]);
      }
      if (mx == -INFINITY) continue;  // (no position of this team yet, none this round)
      const float rescale = expf(m[r] - mx);  // (exp(-inf) = 0 the first time)
      l[r] *= rescale;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[r][e] *= rescale;
#pragma unroll
      for (int u = 0; u < PER; ++u) {
        const float p = c0 + u < end ? expf(sc[u] - mx) : 0.f;
        l[r] += p;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[r][e] += p * elem(vx[u], e);
      }
      m[r] = mx;
    }
  }
  // the teams merged (a team that held no position: max -inf, sum and weights 0, weight 0 here)
#pragma unroll
  for (int r = 0; r < G; ++r) {
    if (lane == 0) {
      t_ml[team][r][0] = m[r];
      t_ml[team][r][1] = l[r];
    }
    if (active) {
#pragma unroll
      for (int e = 0; e < 8; ++e) t_acc[((size_t)team * G + r) * d + at + e] = acc[r][e];
    }
  }
  __syncthreads();
  const int di = threadIdx.x;
  for (int r = 0; r < group; ++r) {
    float mm = -INFINITY;
    for (int w = 0; w < teams; ++w) mm = fmaxf(mm, t_ml[w][r][0]);
    float ll = 0.f, a = 0.f;
    for (int w = 0; w < teams; ++w) {
      const float f = expf(t_ml[w][r][0] - mm);
      ll += t_ml[w][r][1] * f;
      if (di < d) a += t_acc[((size_t)w * G + r) * d + di] * f;
    }
    const size_t at_ = (size_t)(j * group + r) * splits + y;
    if (di < d) part_acc[at_ * d + di] = a;
    if (di == 0) {
      part_ml[at_ * 2] = mm;
      part_ml[at_ * 2 + 1] = ll;
    }
  }
}

// Attention pass 2, grid (hq, B), 128 threads: stream b's splits that hold positions combined
// into out [B, hq, d].
template <typename T>
__device__ void attn_combine(const float* __restrict__ part_acc, const float* __restrict__ part_ml,
                             const uint32_t* __restrict__ pos_p, T* __restrict__ out, int hq, int d, int splits,
                             int cap, int chunk) {
  extern __shared__ float w[];  // [splits]: each split's weight
  __shared__ float red[32];
  const int h = blockIdx.x, b = blockIdx.y;
  const int pos = min((int)pos_p[b], cap - 1);
  const int used = pos / split_span(pos, splits, chunk) + 1;
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

// pass 1 for at most G query heads per KV head: batch_attn_partial_g<G>_<type> (in warps),
// batch_attn_teams_g<G>_<type> (in teams)
#define BATCH_ATTN_PARTIAL(SUFFIX, T, G)                                                                     \
  extern "C" __global__ void batch_attn_partial_g##G##_##SUFFIX(const T* heads, const T* kc, const T* vc,    \
                                                                const uint32_t* slots, const uint32_t* pos,  \
                                                                float* part_acc, float* part_ml, int hq,     \
                                                                int hkv, int cap, int d) {                   \
    attn_partial_warps<T, G>(heads, kc, vc, slots, pos, part_acc, part_ml, hq, hkv, cap, d);                 \
  }                                                                                                          \
  extern "C" __global__ void batch_attn_teams_g##G##_##SUFFIX(const T* heads, const T* kc, const T* vc,      \
                                                              const uint32_t* slots, const uint32_t* pos,    \
                                                              float* part_acc, float* part_ml, int hq,       \
                                                              int hkv, int cap, int d, int lanes) {          \
    attn_partial_teams<T, G>(heads, kc, vc, slots, pos, part_acc, part_ml, hq, hkv, cap, d, lanes);          \
  }

#define BATCH_DECODE(SUFFIX, T)                                                                                    \
  extern "C" __global__ void qk_store_batch_##SUFFIX(const T* qkv, const T* w, const T* cos_t, const T* sin_t,     \
                                                     const uint32_t* slots, const uint32_t* pos, T* out, T* kc,    \
                                                     T* vc, int hq, int hkv, int d, int cap, float eps) {          \
    qk_store<T>(qkv, w, cos_t, sin_t, slots, pos, out, kc, vc, hq, hkv, d, cap, eps);                              \
  }                                                                                                                \
  BATCH_ATTN_PARTIAL(SUFFIX, T, 1)                                                                                 \
  BATCH_ATTN_PARTIAL(SUFFIX, T, 2)                                                                                 \
  BATCH_ATTN_PARTIAL(SUFFIX, T, 4)                                                                                 \
  BATCH_ATTN_PARTIAL(SUFFIX, T, 8)                                                                                 \
  extern "C" __global__ void batch_attn_combine_##SUFFIX(const float* part_acc, const float* part_ml,              \
                                                         const uint32_t* pos, T* out, int hq, int d, int splits,   \
                                                         int cap, int chunk) {                                     \
    attn_combine<T>(part_acc, part_ml, pos, out, hq, d, splits, cap, chunk);                                       \
  }

BATCH_DECODE(f32, float)
BATCH_DECODE(bf16, __nv_bfloat16)
BATCH_DECODE(f16, __half)
