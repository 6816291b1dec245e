// Paged decode attention for CPU: one query token per sequence against its paged K/V.
//
// q      [B, H, D]                     float32 or bfloat16
// kcache [num_blocks, BS, KVH, D]      same dtype as q (a layer's kv_cache[0])
// vcache [num_blocks, BS, KVH, D]      (kv_cache[1])
// block_tables [B, max_blocks] int32;  seq_lens [B] int32 (context length incl. the new token)
// returns [B, H, D] in q's dtype. Query head h reads KV head h / (H / KVH).
//
// Each sequence is one work item of at::parallel_for (torch's own OpenMP pool: it never
// oversubscribes the cores torch's matmuls use). K and V are read exactly once, one token row
// (all KV heads) at a time, converted to float32; all math is float32. With AVX-512 the dot
// products and the weighted sums of V run on 16-wide vectors; elsewhere plain loops.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

static inline float to_float(float x) { return x; }
static inline float to_float(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;  // bf16 is the top half of a float32
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Converts one token row (n elements) to float32.
static inline void row_to_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
static inline void row_to_float(const at::BFloat16* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    __m512i wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16);
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(wide));
  }
#endif
  for (; i < n; ++i) dst[i] = to_float(src[i]);
}

// out[j] = dot(a, b + j * stride) for j < 4 (rows past the end of a tile are zeros).
static inline void dot4(const float* a, const float* b, int64_t stride, int64_t n, float* out) {
  int64_t i = 0;
  float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#if defined(__AVX512F__)
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(a + i);
    a0 = _mm512_fmadd_ps(x, _mm512_loadu_ps(b + i), a0);
    a1 = _mm512_fmadd_ps(x, _mm512_loadu_ps(b + stride + i), a1);
    a2 = _mm512_fmadd_ps(x, _mm512_loadu_ps(b + 2 * stride + i), a2);
    a3 = _mm512_fmadd_ps(x, _mm512_loadu_ps(b + 3 * stride + i), a3);
  }
  s0 = _mm512_reduce_add_ps(a0);
  s1 = _mm512_reduce_add_ps(a1);
  s2 = _mm512_reduce_add_ps(a2);
  s3 = _mm512_reduce_add_ps(a3);
#endif
  for (; i < n; ++i) {
    s0 += a[i] * b[i];
    s1 += a[i] * b[stride + i];
    s2 += a[i] * b[2 * stride + i];
    s3 += a[i] * b[3 * stride + i];
  }
  out[0] = s0;
  out[1] = s1;
  out[2] = s2;
  out[3] = s3;
}

// y += sum_j p[j] * x[j * stride + :] for j < 4.
static inline void axpy4(const float* p, const float* x, int64_t stride, float* y, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 p0 = _mm512_set1_ps(p[0]), p1 = _mm512_set1_ps(p[1]), p2 = _mm512_set1_ps(p[2]), p3 = _mm512_set1_ps(p[3]);
  for (; i + 16 <= n; i += 16) {
    __m512 acc = _mm512_loadu_ps(y + i);
    acc = _mm512_fmadd_ps(p0, _mm512_loadu_ps(x + i), acc);
    acc = _mm512_fmadd_ps(p1, _mm512_loadu_ps(x + stride + i), acc);
    acc = _mm512_fmadd_ps(p2, _mm512_loadu_ps(x + 2 * stride + i), acc);
    acc = _mm512_fmadd_ps(p3, _mm512_loadu_ps(x + 3 * stride + i), acc);
    _mm512_storeu_ps(y + i, acc);
  }
#endif
  for (; i < n; ++i) y[i] += p[0] * x[i] + p[1] * x[stride + i] + p[2] * x[2 * stride + i] + p[3] * x[3 * stride + i];
}

#if defined(__AVX512F__)
// e^x for x <= 0 (softmax inputs after subtracting the max): 2^(x log2 e) split into an integer
// power (scalef) and 2^f, f in [-0.5, 0.5], by a degree-6 Taylor polynomial (rel. error ~1e-7).
static inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}
#endif

// In place: x[i] = exp(x[i] - max); returns 1 / sum.
static inline float softmax_in_place(float* x, int64_t n) {
  const float m = *std::max_element(x, x + n);
  float sum = 0.f;
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 vm = _mm512_set1_ps(m);
  __m512 vsum = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(x + i), vm));
    _mm512_storeu_ps(x + i, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  sum = _mm512_reduce_add_ps(vsum);
#endif
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - m);
    sum += x[i];
  }
  return 1.f / sum;
}

// Asks for the token row `ahead` positions later (often in another, scattered block) to be
// brought into cache while the current tile is computed.
template <typename T>
static inline void prefetch_row(const T* cache, const int32_t* table, int64_t t, int64_t L, int64_t BS, int64_t row) {
  if (t >= L) return;
  const char* p = reinterpret_cast<const char*>(cache + (static_cast<int64_t>(table[t / BS]) * BS + t % BS) * row);
  for (int64_t off = 0; off < row * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(p + off);
}

// Scores straight from bf16 q and K with AVX512-BF16 dot-product instructions (products exact
// in float32, float32 accumulation), 4 tokens at a time. Returns false where it does not apply.
static inline bool bf16_scores(const float*, const float*, const int32_t*, int64_t, int64_t, int64_t, int64_t,
                               int64_t, int64_t, float, float*) {
  return false;
}
static inline bool bf16_scores(const at::BFloat16* q, const at::BFloat16* kc, const int32_t* table, int64_t L,
                               int64_t H, int64_t G, int64_t D, int64_t BS, int64_t row, float scale,
                               float* scores) {
#if defined(__AVX512BF16__)
  if (D % 32) return false;
  for (int64_t t0 = 0; t0 < L; t0 += 4) {
    const int64_t n = std::min<int64_t>(4, L - t0);
    const at::BFloat16* rows[4];
    for (int64_t j = 0; j < 4; ++j) {
      const int64_t t = t0 + std::min<int64_t>(j, n - 1);  // a short tile repeats its last row
      rows[j] = kc + (static_cast<int64_t>(table[t / BS]) * BS + t % BS) * row;
      prefetch_row(kc, table, t0 + j + 16, L, BS, row);
    }
    for (int64_t h = 0; h < H; ++h) {
      const int64_t off = (h / G) * D;
      __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
      for (int64_t i = 0; i < D; i += 32) {
        const __m512bh x = (__m512bh)_mm512_loadu_si512(q + h * D + i);
        a0 = _mm512_dpbf16_ps(a0, x, (__m512bh)_mm512_loadu_si512(rows[0] + off + i));
        a1 = _mm512_dpbf16_ps(a1, x, (__m512bh)_mm512_loadu_si512(rows[1] + off + i));
        a2 = _mm512_dpbf16_ps(a2, x, (__m512bh)_mm512_loadu_si512(rows[2] + off + i));
        a3 = _mm512_dpbf16_ps(a3, x, (__m512bh)_mm512_loadu_si512(rows[3] + off + i));
      }
      const float dots[4] = {_mm512_reduce_add_ps(a0), _mm512_reduce_add_ps(a1), _mm512_reduce_add_ps(a2),
                             _mm512_reduce_add_ps(a3)};
      for (int64_t j = 0; j < n; ++j) scores[h * L + t0 + j] = dots[j] * scale;
    }
  }
  return true;
#else
  return false;
#endif
}

// acc[h] += sum_t p[h][t] * V[t][h / G] straight from bf16 V: each 16-wide chunk of a V row is
// converted once and used by all G query heads of its KV head. Returns false where it does not apply.
static inline bool bf16_weighted_v(const float*, const int32_t*, const float*, int64_t, int64_t, int64_t, int64_t,
                                   int64_t, int64_t, float*) {
  return false;
}
static inline bool bf16_weighted_v(const at::BFloat16* vc, const int32_t* table, const float* scores, int64_t L,
                                   int64_t H, int64_t G, int64_t D, int64_t BS, int64_t row, float* acc) {
#if defined(__AVX512F__)
  if (D % 16) return false;
  const int64_t KVH = H / G;
  for (int64_t t0 = 0; t0 < L; t0 += 4) {
    const int64_t n = std::min<int64_t>(4, L - t0);
    const at::BFloat16* rows[4];
    for (int64_t j = 0; j < 4; ++j) {
      const int64_t t = t0 + std::min<int64_t>(j, n - 1);  // a short tile repeats its last row (with p = 0)
      rows[j] = vc + (static_cast<int64_t>(table[t / BS]) * BS + t % BS) * row;
      prefetch_row(vc, table, t0 + j + 16, L, BS, row);
    }
    for (int64_t kh = 0; kh < KVH; ++kh) {
      for (int64_t i = 0; i < D; i += 16) {
        __m512 v[4];
        for (int64_t j = 0; j < 4; ++j) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[j] + kh * D + i));
          v[j] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
        }
        for (int64_t g = 0; g < G; ++g) {
          const int64_t h = kh * G + g;
          const float* ph = scores + h * L + t0;
          float* ah = acc + h * D + i;
          __m512 a = _mm512_loadu_ps(ah);
          for (int64_t j = 0; j < n; ++j) a = _mm512_fmadd_ps(_mm512_set1_ps(ph[j]), v[j], a);
          _mm512_storeu_ps(ah, a);
        }
      }
    }
  }
  return true;
#else
  return false;
#endif
}

template <typename T>
static void decode_kernel(const T* q, const T* kc, const T* vc, const int32_t* tables, const int32_t* lens,
                          T* out, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t BS, int64_t max_blocks,
                          float scale) {
  const int64_t G = H / KVH;
  const int64_t row = KVH * D;  // elements of one token in the cache
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(H * D), acc(H * D), ktile(4 * row, 0.f), scores, inv_sum(H);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t L = lens[b];
      scores.resize(H * L);
      for (int64_t i = 0; i < H * D; ++i) qf[i] = to_float(q[b * H * D + i]) * scale;
      const int32_t* table = tables + b * max_blocks;
      // Scores in tiles of 4 tokens: 4 independent dot products per head keep the FMA units busy
      // (one dot product alone is a chain of dependent FMAs plus a horizontal sum).
      if (!bf16_scores(q + b * H * D, kc, table, L, H, G, D, BS, row, scale, scores.data())) {
        for (int64_t t0 = 0; t0 < L; t0 += 4) {
          const int64_t n = std::min<int64_t>(4, L - t0);
          for (int64_t j = 0; j < n; ++j) {
            const int64_t t = t0 + j;
            prefetch_row(kc, table, t + 16, L, BS, row);
            row_to_float(kc + (static_cast<int64_t>(table[t / BS]) * BS + t % BS) * row, ktile.data() + j * row, row);
          }
          for (int64_t h = 0; h < H; ++h) {
            float dots[4];
            dot4(qf.data() + h * D, ktile.data() + (h / G) * D, row, D, dots);
            for (int64_t j = 0; j < n; ++j) scores[h * L + t0 + j] = dots[j];
          }
        }
      }
      for (int64_t h = 0; h < H; ++h) inv_sum[h] = softmax_in_place(scores.data() + h * L, L);
      std::fill(acc.begin(), acc.end(), 0.f);
      // Weighted sum of V in tiles of 4 tokens: each accumulator is loaded and stored once per tile.
      if (!bf16_weighted_v(vc, table, scores.data(), L, H, G, D, BS, row, acc.data()))
      for (int64_t t0 = 0; t0 < L; t0 += 4) {
        const int64_t n = std::min<int64_t>(4, L - t0);
        if (n < 4) std::fill(ktile.begin() + n * row, ktile.end(), 0.f);  // 0 * stale could be NaN
        for (int64_t j = 0; j < n; ++j) {
          const int64_t t = t0 + j;
          prefetch_row(vc, table, t + 16, L, BS, row);
          row_to_float(vc + (static_cast<int64_t>(table[t / BS]) * BS + t % BS) * row, ktile.data() + j * row, row);
        }
        for (int64_t h = 0; h < H; ++h) {
          float p[4] = {0.f, 0.f, 0.f, 0.f};
          for (int64_t j = 0; j < n; ++j) p[j] = scores[h * L + t0 + j];
          axpy4(p, ktile.data() + (h / G) * D, row, acc.data() + h * D, D);
        }
      }
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < D; ++d) out[(b * H + h) * D + d] = static_cast<T>(acc[h * D + d] * inv_sum[h]);
    }
  });
}

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor kcache, torch::Tensor vcache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && kcache.dim() == 4 && vcache.sizes() == kcache.sizes(), "bad shapes");
  TORCH_CHECK(q.is_contiguous() && kcache.is_contiguous() && vcache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt, "tables must be int32");
  TORCH_CHECK(q.scalar_type() == kcache.scalar_type() && q.scalar_type() == vcache.scalar_type(), "dtype mismatch");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = kcache.size(1), KVH = kcache.size(2);
  TORCH_CHECK(kcache.size(3) == D && H % KVH == 0 && tables.size(0) == B && lens.size(0) == B, "bad shapes");
  auto out = torch::empty_like(q);
  if (q.scalar_type() == at::kFloat) {
    decode_kernel<float>(q.data_ptr<float>(), kcache.data_ptr<float>(), vcache.data_ptr<float>(),
                         tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), out.data_ptr<float>(), B, H, KVH, D,
                         BS, tables.size(1), static_cast<float>(scale));
  } else if (q.scalar_type() == at::kBFloat16) {
    using bf16 = at::BFloat16;
    decode_kernel<bf16>(q.data_ptr<bf16>(), kcache.data_ptr<bf16>(), vcache.data_ptr<bf16>(),
                        tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), out.data_ptr<bf16>(), B, H, KVH, D,
                        BS, tables.size(1), static_cast<float>(scale));
  } else {
    TORCH_CHECK(false, "paged_decode_attention supports float32 and bfloat16");
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
}
