// The vector abstraction of the native CPU extension: a float vector `vec::F` of `vec::W` lanes
// and the few operations the kernels use (loads that widen bf16 / int8 / e4m3 / 4-bit codes to
// float32, FMA, horizontal sum, exp for softmax, bf16 stores with round-to-nearest-even).
//
// native.cpp includes this header once per instruction set, inside that set's namespace and
// `#pragma GCC target` region, with PS_VEC_WIDTH set to 16 (AVX-512F/BW/VL/DQ), 8 (AVX2 + FMA +
// F16C) or 1 (plain C++). The kernels are written once against it. No include guard on purpose.
#ifndef PS_VEC_WIDTH
#error "PS_VEC_WIDTH must be defined (16, 8 or 1) before including vec.h"
#endif

namespace vec {

constexpr int W = PS_VEC_WIDTH;

inline float bf16_to_float(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;  // bf16 is the top half of a float32
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// float32 -> bf16 bits, round to nearest even (as c10::BFloat16 and torch's .to(); no NaN here).
inline uint16_t float_to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

#if PS_VEC_WIDTH == 16
struct F { __m512 v; };
inline F zero() { return {_mm512_setzero_ps()}; }
inline F set1(float x) { return {_mm512_set1_ps(x)}; }
inline F load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void store(float* p, F a) { _mm512_storeu_ps(p, a.v); }
inline F add(F a, F b) { return {_mm512_add_ps(a.v, b.v)}; }
inline F sub(F a, F b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline F mul(F a, F b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline F max(F a, F b) { return {_mm512_max_ps(a.v, b.v)}; }
inline F fma(F a, F b, F c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }  // a * b + c
inline float reduce_add(F a) { return _mm512_reduce_add_ps(a.v); }
inline F load_bf16(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))};
}
inline void store_bf16(uint16_t* p, F a) {
  const __m512i u = _mm512_castps_si512(a.v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb)), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}
inline F load_i8(const uint8_t* p) {  // W signed bytes
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
inline F load_u8(const uint8_t* p) {  // W unsigned bytes
  return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
// The low / high nibbles of W bytes, as floats 0..15.
inline F load_u4_lo(const uint8_t* p) {
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return {_mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(0x0F)))};
}
inline F load_u4_hi(const uint8_t* p) {
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return {_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4))};
}
// W e4m3fn codes -> value / 256: sign, exponent and mantissa moved into fp16 bits (fp16's
// exponent bias is 8 more, so the fp16 number is the value * 2^-8, subnormals included).
inline F load_e4m3_units(const uint8_t* p) {
  const __m256i w = _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 7);
  return {_mm512_cvtph_ps(_mm256_and_si256(w, _mm256_set1_epi16(static_cast<short>(0xBFFF))))};
}
// x * 2^n for integral n (as floats).
inline F scale_by_pow2(F x, F n) { return {_mm512_scalef_ps(x.v, n.v)}; }
inline F round_nearest(F x) { return {_mm512_roundscale_ps(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }

#elif PS_VEC_WIDTH == 8
struct F { __m256 v; };
inline F zero() { return {_mm256_setzero_ps()}; }
inline F set1(float x) { return {_mm256_set1_ps(x)}; }
inline F load(const float* p) { return {_mm256_loadu_ps(p)}; }
inline void store(float* p, F a) { _mm256_storeu_ps(p, a.v); }
inline F add(F a, F b) { return {_mm256_add_ps(a.v, b.v)}; }
inline F sub(F a, F b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline F mul(F a, F b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline F max(F a, F b) { return {_mm256_max_ps(a.v, b.v)}; }
inline F fma(F a, F b, F c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline float reduce_add(F a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline F load_bf16(const uint16_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16))};
}
inline void store_bf16(uint16_t* p, F a) {
  const __m256i u = _mm256_castps_si256(a.v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb)), 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
inline F load_i8(const uint8_t* p) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))))};
}
inline F load_u8(const uint8_t* p) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))))};
}
inline F load_u4_lo(const uint8_t* p) {
  const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return {_mm256_cvtepi32_ps(_mm256_and_si256(q, _mm256_set1_epi32(0x0F)))};
}
inline F load_u4_hi(const uint8_t* p) {
  const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return {_mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4))};
}
inline F load_e4m3_units(const uint8_t* p) {  // as the 16-lane version, with F16C
  const __m128i w = _mm_slli_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), 7);
  return {_mm256_cvtph_ps(_mm_and_si128(w, _mm_set1_epi16(static_cast<short>(0xBFFF))))};
}
inline F scale_by_pow2(F x, F n) {  // n in [-126, 127] here (exp's argument is clamped)
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n.v), _mm256_set1_epi32(127)), 23);
  return {_mm256_mul_ps(x.v, _mm256_castsi256_ps(e))};
}
inline F round_nearest(F x) { return {_mm256_round_ps(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }

#elif PS_VEC_WIDTH == 1
struct F { float v; };
inline F zero() { return {0.f}; }
inline F set1(float x) { return {x}; }
inline F load(const float* p) { return {*p}; }
inline void store(float* p, F a) { *p = a.v; }
inline F add(F a, F b) { return {a.v + b.v}; }
inline F sub(F a, F b) { return {a.v - b.v}; }
inline F mul(F a, F b) { return {a.v * b.v}; }
inline F max(F a, F b) { return {a.v > b.v ? a.v : b.v}; }
inline F fma(F a, F b, F c) { return {std::fma(a.v, b.v, c.v)}; }
inline float reduce_add(F a) { return a.v; }
inline F load_bf16(const uint16_t* p) { return {bf16_to_float(*p)}; }
inline void store_bf16(uint16_t* p, F a) { *p = float_to_bf16(a.v); }
inline F load_i8(const uint8_t* p) { return {static_cast<float>(static_cast<int8_t>(*p))}; }
inline F load_u8(const uint8_t* p) { return {static_cast<float>(*p)}; }
inline F load_u4_lo(const uint8_t* p) { return {static_cast<float>(*p & 0x0F)}; }
inline F load_u4_hi(const uint8_t* p) { return {static_cast<float>(*p >> 4)}; }
inline F load_e4m3_units(const uint8_t* p) {
  const int c = *p, e = (c >> 3) & 15, m = c & 7;
  const float mag = e ? std::ldexp(8.f + m, e - 18) : std::ldexp(static_cast<float>(m), -17);
  return {(c & 0x80) ? -mag : mag};
}
inline F scale_by_pow2(F x, F n) { return {std::ldexp(x.v, static_cast<int>(n.v))}; }
inline F round_nearest(F x) { return {std::nearbyint(x.v)}; }
#else
#error "PS_VEC_WIDTH must be 16, 8 or 1"
#endif

// e^x for x <= 0 (softmax inputs after subtracting the max): 2^(x log2 e) split into an integer
// power and 2^f, f in [-0.5, 0.5], by a degree-6 Taylor polynomial (rel. error ~1e-7).
inline F exp_nonpositive(F x) {
  x = max(x, set1(-87.0f));
  const F t = mul(x, set1(1.4426950408889634f));
  const F n = round_nearest(t);
  const F f = sub(t, n);
  F p = set1(1.5403530393381606e-4f);
  p = fma(p, f, set1(1.3333558146428443e-3f));
  p = fma(p, f, set1(9.6181291076284772e-3f));
  p = fma(p, f, set1(5.5504108664821580e-2f));
  p = fma(p, f, set1(2.4022650695910071e-1f));
  p = fma(p, f, set1(6.9314718055994531e-1f));
  p = fma(p, f, set1(1.0f));
  return scale_by_pow2(p, n);
}

}  // namespace vec
