// Paged decode attention for CPU: one query token per sequence against its paged K/V.
//
// q      [B, H, D]                     float32 or bfloat16
// kcache [num_blocks, BS, KVH, D]      same dtype as q (a layer's kv_cache[0])
// vcache [num_blocks, BS, KVH, D]      (kv_cache[1])
// block_tables [B, max_blocks] int32;  seq_lens [B] int32 (context length incl. the new token)
// returns [B, H, D] in q's dtype. Query head h reads KV head h / (H / KVH).
//
// With kv_quant "int8" or "fp8_e4m3" the caches are the engine's quantized rows instead
// (engine/attention/kv_quant.py): uint8 [num_blocks, BS, KVH, D + 2], per token and KV head D
// codes then the row's scale as one little-endian bf16, value = code * scale. The codes are
// de-quantized in the inner loop (about half the bytes of bf16 are read); `gather_dequantize`
// de-quantizes one sequence's rows for the prefill path.
//
// Each sequence is one work item of at::parallel_for (torch's own OpenMP pool: it never
// oversubscribes the cores torch's matmuls use). K and V are read exactly once, one token row
// (all KV heads) at a time, converted to float32; all math is float32. The dot products and the
// weighted sums of V run on vec.h's vectors: 16 floats under AVX-512, 8 under AVX2.
// Included by native.cpp once per instruction set (see vec.h); the vector parts are written
// against vec.h, the bf16 dot products (PS_HAS_BF16_DOT) only in the AVX512-BF16 region.
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
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  for (; i + vec::W <= n; i += vec::W) vec::store(dst + i, vec::load_bf16(bits + i));
  for (; i < n; ++i) dst[i] = to_float(src[i]);
}

// out[j] = dot(a, b + j * stride) for j < 4 (rows past the end of a tile are zeros).
static inline void dot4(const float* a, const float* b, int64_t stride, int64_t n, float* out) {
  int64_t i = 0;
  using namespace vec;
  F a0 = zero(), a1 = zero(), a2 = zero(), a3 = zero();
  for (; i + W <= n; i += W) {
    const F x = load(a + i);
    a0 = fma(x, load(b + i), a0);
    a1 = fma(x, load(b + stride + i), a1);
    a2 = fma(x, load(b + 2 * stride + i), a2);
    a3 = fma(x, load(b + 3 * stride + i), a3);
  }
  float s0 = reduce_add(a0), s1 = reduce_add(a1), s2 = reduce_add(a2), s3 = reduce_add(a3);
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

// out[j] = dot(a, b + j * stride) for j < 16; with AVX-512 and n a multiple of 16 (else 4 x dot4): the 16
// dot products are reduced together by a transposing tree (45 instructions instead of 16 separate
// horizontal sums of ~8 each).
static inline void dot16(const float* a, const float* b, int64_t stride, int64_t n, float* out) {
#if PS_VEC_WIDTH == 16
  if (n % 16 == 0) {
    // Accumulator k holds row kRow[k]: the tree below leaves the sum of accumulator kRow[p] at
    // position p, and kRow is its own inverse, so position p ends up with row p.
    static constexpr int kRow[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};
    __m512 acc[16];
    for (int k = 0; k < 16; ++k) acc[k] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
      const __m512 x = _mm512_loadu_ps(a + i);
      for (int k = 0; k < 16; ++k) acc[k] = _mm512_fmadd_ps(x, _mm512_loadu_ps(b + kRow[k] * stride + i), acc[k]);
    }
    for (int k = 0; k < 8; ++k)  // 128-bit lanes 0+2 and 1+3 of acc[k] and acc[k + 8]
      acc[k] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[k], acc[k + 8], 0x44), _mm512_shuffle_f32x4(acc[k], acc[k + 8], 0xEE));
    for (int k = 0; k < 4; ++k)  // then each lane one vector's 4 partial sums
      acc[k] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[k], acc[k + 4], 0x88), _mm512_shuffle_f32x4(acc[k], acc[k + 4], 0xDD));
    for (int k = 0; k < 2; ++k)
      acc[k] = _mm512_add_ps(_mm512_shuffle_ps(acc[k], acc[k + 2], 0x44), _mm512_shuffle_ps(acc[k], acc[k + 2], 0xEE));
    _mm512_storeu_ps(out, _mm512_add_ps(_mm512_shuffle_ps(acc[0], acc[1], 0x88), _mm512_shuffle_ps(acc[0], acc[1], 0xDD)));
    return;
  }
#endif
  for (int64_t j = 0; j < 16; j += 4) dot4(a, b + j * stride, stride, n, out + j);
}

// y += sum_j p[j] * x[j * stride + :] for j < 4.
static inline void axpy4(const float* p, const float* x, int64_t stride, float* y, int64_t n) {
  int64_t i = 0;
  using namespace vec;
  const F p0 = set1(p[0]), p1 = set1(p[1]), p2 = set1(p[2]), p3 = set1(p[3]);
  for (; i + W <= n; i += W) {
    F acc = load(y + i);
    acc = fma(p0, load(x + i), acc);
    acc = fma(p1, load(x + stride + i), acc);
    acc = fma(p2, load(x + 2 * stride + i), acc);
    acc = fma(p3, load(x + 3 * stride + i), acc);
    store(y + i, acc);
  }
  for (; i < n; ++i) y[i] += p[0] * x[i] + p[1] * x[stride + i] + p[2] * x[2 * stride + i] + p[3] * x[3 * stride + i];
}

// In place: x[i] = exp(x[i] - max); returns 1 / sum.
static inline float softmax_in_place(float* x, int64_t n) {
  const float m = *std::max_element(x, x + n);
  float sum = 0.f;
  int64_t i = 0;
  const vec::F vm = vec::set1(m);
  vec::F vsum = vec::zero();
  for (; i + vec::W <= n; i += vec::W) {
    const vec::F e = vec::exp_nonpositive(vec::sub(vec::load(x + i), vm));
    vec::store(x + i, e);
    vsum = vec::add(vsum, e);
  }
  sum = vec::reduce_add(vsum);
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
                               int64_t, int64_t, int64_t, float, float*) {
  return false;
}
static inline bool bf16_scores(const at::BFloat16* q, const at::BFloat16* kc, const int32_t* table, int64_t first,
                               int64_t L, int64_t H, int64_t G, int64_t D, int64_t BS, int64_t row, float scale,
                               float* scores) {
#if PS_HAS_BF16_DOT
  if (D % 32) return false;
  for (int64_t t0 = 0; t0 < L; t0 += 4) {
    const int64_t n = std::min<int64_t>(4, L - t0);
    const at::BFloat16* rows[4];
    for (int64_t j = 0; j < 4; ++j) {
      const int64_t t = first + t0 + std::min<int64_t>(j, n - 1);  // a short tile repeats its last row
      rows[j] = kc + (static_cast<int64_t>(table[t / BS]) * BS + t % BS) * row;
      prefetch_row(kc, table, first + t0 + j + 16, first + L, BS, row);
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
                                   int64_t, int64_t, int64_t, float*) {
  return false;
}
static inline bool bf16_weighted_v(const at::BFloat16* vc, const int32_t* table, const float* scores, int64_t first,
                                   int64_t L, int64_t H, int64_t G, int64_t D, int64_t BS, int64_t row, float* acc) {
  using namespace vec;
  if (D % W) return false;
  const int64_t KVH = H / G;
  for (int64_t t0 = 0; t0 < L; t0 += 4) {
    const int64_t n = std::min<int64_t>(4, L - t0);
    const at::BFloat16* rows[4];
    for (int64_t j = 0; j < 4; ++j) {
      const int64_t t = first + t0 + std::min<int64_t>(j, n - 1);  // a short tile repeats its last row (with p = 0)
      rows[j] = vc + (static_cast<int64_t>(table[t / BS]) * BS + t % BS) * row;
      prefetch_row(vc, table, first + t0 + j + 16, first + L, BS, row);
    }
    for (int64_t kh = 0; kh < KVH; ++kh) {
      for (int64_t i = 0; i < D; i += W) {
        F v[4];
        for (int64_t j = 0; j < 4; ++j) v[j] = load_bf16(reinterpret_cast<const uint16_t*>(rows[j] + kh * D + i));
        for (int64_t g = 0; g < G; ++g) {
          const int64_t h = kh * G + g;
          const float* ph = scores + h * L + t0;
          float* ah = acc + h * D + i;
          F a = load(ah);
          for (int64_t j = 0; j < n; ++j) a = fma(set1(ph[j]), v[j], a);
          store(ah, a);
        }
      }
    }
  }
  return true;
}

// ---- Quantized rows -------------------------------------------------------------------------
// Codes are first converted to "units": an int8 code to its integer value, an e4m3 code to its
// value / 256 (the AVX-512 path widens e4m3 to fp16 bits, exact but 2^-8 off). A row's factor is
// its bf16 scale times the inverse unit, so unit * factor == code * scale exactly (scaling by a
// power of two does not round).
enum class Codes { kInt8, kE4M3 };

template <Codes C>
constexpr float kInverseUnit = C == Codes::kE4M3 ? 256.f : 1.f;

// e4m3fn code -> its value / 256, as the AVX-512 path decodes it. Codes 0x7F / 0xFF (NaN in
// e4m3fn) are never written (quantize_kv clamps to +-448); they read as +-480 / 256 here.
static const float* e4m3_units() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int c = 0; c < 256; ++c) {
      const int e = (c >> 3) & 15, m = c & 7;
      const float mag = e ? std::ldexp(8.f + m, e - 18) : std::ldexp(static_cast<float>(m), -17);
      t[c] = (c & 0x80) ? -mag : mag;
    }
    return t;
  }();
  return table.data();
}

// vec::W codes -> vec::W units.
template <Codes C>
static inline vec::F units_vec(const uint8_t* p) {
  if constexpr (C == Codes::kInt8) return vec::load_i8(p);
  else return vec::load_e4m3_units(p);
}

// n codes -> n units.
template <Codes C>
static inline void codes_to_units(const uint8_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + vec::W <= n; i += vec::W) vec::store(dst + i, units_vec<C>(src + i));
  if constexpr (C == Codes::kInt8) {
    for (; i < n; ++i) dst[i] = static_cast<float>(static_cast<int8_t>(src[i]));
  } else {
    const float* table = e4m3_units();
    for (; i < n; ++i) dst[i] = table[src[i]];
  }
}

// The factor of the row whose scale (bf16, little-endian) is at `p`.
template <Codes C>
static inline float row_factor(const uint8_t* p) {
  const uint32_t bits = (static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f * kInverseUnit<C>;
}

// acc[h] += sum_t p[h][t] * factor[t] * V units[t][h / G], as bf16_weighted_v: each 16 codes of a V
// row are converted once, in registers, for all G query heads. Returns false where it does not apply.
template <Codes C>
static inline bool quant_weighted_v(const uint8_t* vc, const int32_t* table, const float* scores, int64_t L,
                                    int64_t H, int64_t G, int64_t D, int64_t BS, int64_t row, float* acc) {
  using vec::F;
  if (D % vec::W) return false;
  const int64_t KVH = H / G, W = D + 2;
  std::vector<float> pf(G * 4);
  for (int64_t t0 = 0; t0 < L; t0 += 4) {
    const int64_t n = std::min<int64_t>(4, L - t0);
    const uint8_t* rows[4];
    for (int64_t j = 0; j < 4; ++j) {
      const int64_t t = t0 + std::min<int64_t>(j, n - 1);  // a short tile repeats its last row (with p = 0)
      rows[j] = vc + (static_cast<int64_t>(table[t / BS]) * BS + t % BS) * row;
      prefetch_row(vc, table, t0 + j + 16, L, BS, row);
    }
    for (int64_t kh = 0; kh < KVH; ++kh) {
      float f[4];
      for (int64_t j = 0; j < n; ++j) f[j] = row_factor<C>(rows[j] + kh * W + D);
      for (int64_t g = 0; g < G; ++g)  // the weights of this tile: probability * factor
        for (int64_t j = 0; j < n; ++j) pf[g * 4 + j] = scores[(kh * G + g) * L + t0 + j] * f[j];
      for (int64_t i = 0; i < D; i += vec::W) {
        F v[4];
        for (int64_t j = 0; j < n; ++j) v[j] = units_vec<C>(rows[j] + kh * W + i);
        for (int64_t g = 0; g < G; ++g) {
          float* ah = acc + (kh * G + g) * D + i;
          F a = vec::load(ah);
          for (int64_t j = 0; j < n; ++j) a = vec::fma(vec::set1(pf[g * 4 + j]), v[j], a);
          vec::store(ah, a);
        }
      }
    }
  }
  return true;
}

template <typename T, Codes C>
static void decode_kernel_quant(const T* q, const uint8_t* kc, const uint8_t* vc, const int32_t* tables,
                                const int32_t* lens, T* out, int64_t B, int64_t H, int64_t KVH, int64_t D,
                                int64_t BS, int64_t max_blocks, float scale) {
  const int64_t G = H / KVH;
  const int64_t W = D + 2;      // bytes of one (token, KV head) row
  const int64_t row = KVH * W;  // bytes of one token in the cache
  const int64_t trow = KVH * D; // floats of one token in the tile
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(H * D), acc(H * D), tile(16 * trow, 0.f), factor(16 * KVH, 0.f), scores, inv_sum(H);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t L = lens[b];
      scores.resize(H * L);
      for (int64_t i = 0; i < H * D; ++i) qf[i] = to_float(q[b * H * D + i]) * scale;
      const int32_t* table = tables + b * max_blocks;
      // Tokens t0 .. t0+n-1 (n <= 16) of `cache` as units into the tile (token j at j * trow), their
      // factors into factor[j * KVH + kv head]: each code is converted once for all G query heads.
      auto load_tile = [&](const uint8_t* cache, int64_t t0, int64_t n) {
        for (int64_t j = 0; j < n; ++j) {
          const int64_t t = t0 + j;
          prefetch_row(cache, table, t + 16, L, BS, row);
          const uint8_t* r = cache + (static_cast<int64_t>(table[t / BS]) * BS + t % BS) * row;
          for (int64_t kh = 0; kh < KVH; ++kh) {
            codes_to_units<C>(r + kh * W, tile.data() + j * trow + kh * D, D);
            factor[j * KVH + kh] = row_factor<C>(r + kh * W + D);
          }
        }
      };
      // Scores in tiles of 16 tokens: dot(q, units) * factor. Rows past n hold finite stale units.
      for (int64_t t0 = 0; t0 < L; t0 += 16) {
        const int64_t n = std::min<int64_t>(16, L - t0);
        load_tile(kc, t0, n);
        for (int64_t kh = 0, h = 0; kh < KVH; ++kh) {
          for (int64_t g = 0; g < G; ++g, ++h) {
            float dots[16];
            dot16(qf.data() + h * D, tile.data() + kh * D, trow, D, dots);
            for (int64_t j = 0; j < n; ++j) scores[h * L + t0 + j] = dots[j] * factor[j * KVH + kh];
          }
        }
      }
      for (int64_t h = 0; h < H; ++h) inv_sum[h] = softmax_in_place(scores.data() + h * L, L);
      std::fill(acc.begin(), acc.end(), 0.f);
      // Weighted sum of V units, each probability times its row's factor.
      if (!quant_weighted_v<C>(vc, table, scores.data(), L, H, G, D, BS, row, acc.data()))
      for (int64_t t0 = 0; t0 < L; t0 += 4) {
        const int64_t n = std::min<int64_t>(4, L - t0);
        load_tile(vc, t0, n);
        for (int64_t h = 0; h < H; ++h) {
          float p[4] = {0.f, 0.f, 0.f, 0.f};
          for (int64_t j = 0; j < n; ++j) p[j] = scores[h * L + t0 + j] * factor[j * KVH + h / G];
          axpy4(p, tile.data() + (h / G) * D, trow, acc.data() + h * D, D);
        }
      }
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < D; ++d) out[(b * H + h) * D + d] = static_cast<T>(acc[h * D + d] * inv_sum[h]);
    }
  });
}

// Writes n values units[i] * f as T.
static inline void store_scaled(const float* units, float f, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = units[i] * f;
}
static inline void store_scaled(const float* units, float f, at::BFloat16* dst, int64_t n) {
  int64_t i = 0;
  const vec::F vf = vec::set1(f);
  uint16_t* bits = reinterpret_cast<uint16_t*>(dst);
  for (; i + vec::W <= n; i += vec::W) vec::store_bf16(bits + i, vec::mul(vec::load(units + i), vf));
  for (; i < n; ++i) bits[i] = vec::float_to_bf16(units[i] * f);
}

template <typename T, Codes C>
static void gather_dequantize_kernel(const uint8_t* cache, const int32_t* blocks, T* out, int64_t length,
                                     int64_t KVH, int64_t D, int64_t BS) {
  const int64_t W = D + 2;
  at::parallel_for(0, length, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> units(D);
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* r = cache + (static_cast<int64_t>(blocks[t / BS]) * BS + t % BS) * KVH * W;
      for (int64_t kh = 0; kh < KVH; ++kh) {
        codes_to_units<C>(r + kh * W, units.data(), D);
        store_scaled(units.data(), row_factor<C>(r + kh * W + D), out + (t * KVH + kh) * D, D);
      }
    }
  });
}

static Codes parse_codes(const std::string& kv_quant) {
  if (kv_quant == "int8") return Codes::kInt8;
  TORCH_CHECK(kv_quant == "fp8_e4m3", "kv_quant must be int8 or fp8_e4m3, got ", kv_quant);
  return Codes::kE4M3;
}

// `window` > 0: each row attends only to its last `window` tokens (a sliding layer: positions
// (p - window, p]); `softcap` > 0: scores s become softcap * tanh(s / softcap) (Gemma 2).
template <typename T>
static void decode_kernel(const T* q, const T* kc, const T* vc, const int32_t* tables, const int32_t* lens,
                          T* out, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t BS, int64_t max_blocks,
                          float scale, int64_t window = 0, float softcap = 0.f) {
  const int64_t G = H / KVH;
  const int64_t row = KVH * D;  // elements of one token in the cache
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(H * D), acc(H * D), ktile(4 * row, 0.f), scores, inv_sum(H);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t first = window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0;  // first visible token
      const int64_t L = lens[b] - first, end_t = lens[b];
      scores.resize(H * L);
      for (int64_t i = 0; i < H * D; ++i) qf[i] = to_float(q[b * H * D + i]) * scale;
      const int32_t* table = tables + b * max_blocks;
      // Scores in tiles of 4 tokens: 4 independent dot products per head keep the FMA units busy
      // (one dot product alone is a chain of dependent FMAs plus a horizontal sum).
      if (!bf16_scores(q + b * H * D, kc, table, first, L, H, G, D, BS, row, scale, scores.data())) {
        for (int64_t t0 = 0; t0 < L; t0 += 4) {
          const int64_t n = std::min<int64_t>(4, L - t0);
          for (int64_t j = 0; j < n; ++j) {
            const int64_t t = first + t0 + j;
            prefetch_row(kc, table, t + 16, end_t, BS, row);
            row_to_float(kc + (static_cast<int64_t>(table[t / BS]) * BS + t % BS) * row, ktile.data() + j * row, row);
          }
          for (int64_t h = 0; h < H; ++h) {
            float dots[4];
            dot4(qf.data() + h * D, ktile.data() + (h / G) * D, row, D, dots);
            for (int64_t j = 0; j < n; ++j) scores[h * L + t0 + j] = dots[j];
          }
        }
      }
      if (softcap > 0.f)
        for (float& x : scores) x = softcap * std::tanh(x / softcap);
      for (int64_t h = 0; h < H; ++h) inv_sum[h] = softmax_in_place(scores.data() + h * L, L);
      std::fill(acc.begin(), acc.end(), 0.f);
      // Weighted sum of V in tiles of 4 tokens: each accumulator is loaded and stored once per tile.
      if (!bf16_weighted_v(vc, table, scores.data(), first, L, H, G, D, BS, row, acc.data()))
      for (int64_t t0 = 0; t0 < L; t0 += 4) {
        const int64_t n = std::min<int64_t>(4, L - t0);
        if (n < 4) std::fill(ktile.begin() + n * row, ktile.end(), 0.f);  // 0 * stale could be NaN
        for (int64_t j = 0; j < n; ++j) {
          const int64_t t = first + t0 + j;
          prefetch_row(vc, table, t + 16, end_t, BS, row);
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

template <typename T>
static void run_decode_quant(Codes codes, const torch::Tensor& q, const torch::Tensor& kc, const torch::Tensor& vc,
                             const torch::Tensor& tables, const torch::Tensor& lens, torch::Tensor& out,
                             int64_t KVH, int64_t BS, float scale) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  auto kernel = codes == Codes::kInt8 ? decode_kernel_quant<T, Codes::kInt8> : decode_kernel_quant<T, Codes::kE4M3>;
  kernel(q.data_ptr<T>(), kc.data_ptr<uint8_t>(), vc.data_ptr<uint8_t>(), tables.data_ptr<int32_t>(),
         lens.data_ptr<int32_t>(), out.data_ptr<T>(), B, H, KVH, D, BS, tables.size(1), scale);
}

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor kcache, torch::Tensor vcache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                                     const std::string& kv_quant) {
  TORCH_CHECK(q.dim() == 3 && kcache.dim() == 4 && vcache.sizes() == kcache.sizes(), "bad shapes");
  TORCH_CHECK(q.is_contiguous() && kcache.is_contiguous() && vcache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt, "tables must be int32");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "paged_decode_attention supports float32 and bfloat16");
  const bool quantized = !kv_quant.empty();
  if (quantized) {
    TORCH_CHECK(kcache.scalar_type() == at::kByte && vcache.scalar_type() == at::kByte, "a quantized cache is uint8");
  } else {
    TORCH_CHECK(q.scalar_type() == kcache.scalar_type() && q.scalar_type() == vcache.scalar_type(), "dtype mismatch");
  }
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = kcache.size(1), KVH = kcache.size(2);
  TORCH_CHECK(kcache.size(3) == (quantized ? D + 2 : D) && H % KVH == 0 && tables.size(0) == B && lens.size(0) == B,
              "bad shapes");
  auto out = torch::empty_like(q);
  if (quantized) {
    const Codes codes = parse_codes(kv_quant);
    if (q.scalar_type() == at::kFloat) {
      run_decode_quant<float>(codes, q, kcache, vcache, tables, lens, out, KVH, BS, static_cast<float>(scale));
    } else {
      run_decode_quant<at::BFloat16>(codes, q, kcache, vcache, tables, lens, out, KVH, BS, static_cast<float>(scale));
    }
  } else if (q.scalar_type() == at::kFloat) {
    decode_kernel<float>(q.data_ptr<float>(), kcache.data_ptr<float>(), vcache.data_ptr<float>(),
                         tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), out.data_ptr<float>(), B, H, KVH, D,
                         BS, tables.size(1), static_cast<float>(scale));
  } else {
    using bf16 = at::BFloat16;
    decode_kernel<bf16>(q.data_ptr<bf16>(), kcache.data_ptr<bf16>(), vcache.data_ptr<bf16>(),
                        tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), out.data_ptr<bf16>(), B, H, KVH, D,
                        BS, tables.size(1), static_cast<float>(scale));
  }
  return out;
}

// out [length, KVH, D] (float32 or bfloat16) = tokens 0 .. length-1 of one sequence, de-quantized from
// cache [num_blocks, BS, KVH, D + 2] uint8 through its blocks (int32): each value code * scale in
// float32, rounded once to out's dtype (the same values as engine.attention.kv_quant.dequantize_kv).
void gather_dequantize(torch::Tensor cache, torch::Tensor blocks, torch::Tensor out, const std::string& kv_quant) {
  TORCH_CHECK(cache.dim() == 4 && cache.scalar_type() == at::kByte && cache.is_contiguous(),
              "cache must be contiguous uint8 [num_blocks, block_size, kv_heads, head_dim + 2]");
  TORCH_CHECK(blocks.dim() == 1 && blocks.scalar_type() == at::kInt && blocks.is_contiguous(), "blocks must be int32");
  TORCH_CHECK(out.dim() == 3 && out.is_contiguous(), "out must be contiguous [length, kv_heads, head_dim]");
  const int64_t length = out.size(0), KVH = cache.size(2), D = cache.size(3) - 2, BS = cache.size(1);
  TORCH_CHECK(out.size(1) == KVH && out.size(2) == D, "out does not fit the cache");
  TORCH_CHECK(blocks.size(0) * BS >= length, "too few blocks for the length");
  const Codes codes = parse_codes(kv_quant);
  const uint8_t* c = cache.data_ptr<uint8_t>();
  const int32_t* bl = blocks.data_ptr<int32_t>();
  if (out.scalar_type() == at::kFloat) {
    auto kernel = codes == Codes::kInt8 ? gather_dequantize_kernel<float, Codes::kInt8>
                                        : gather_dequantize_kernel<float, Codes::kE4M3>;
    kernel(c, bl, out.data_ptr<float>(), length, KVH, D, BS);
  } else {
    TORCH_CHECK(out.scalar_type() == at::kBFloat16, "out must be float32 or bfloat16");
    auto kernel = codes == Codes::kInt8 ? gather_dequantize_kernel<at::BFloat16, Codes::kInt8>
                                        : gather_dequantize_kernel<at::BFloat16, Codes::kE4M3>;
    kernel(c, bl, out.data_ptr<at::BFloat16>(), length, KVH, D, BS);
  }
}
