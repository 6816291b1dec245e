// bf16 x bf16 linear for a few rows (batch-1 decode), for CPUs without bf16 dot products.
//
// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), x [M, K] and w [N, K] bfloat16, accumulated in
// float32 and rounded to bfloat16 once. A bf16 value is the upper half of a float32, so a weight
// is widened by a 16-bit shift: each weight row is read once for all M rows of x (M is small:
// the engine calls this below UpcastLinear's min_rows). The call is bound by reading the weight;
// work is split over output rows with at::parallel_for (torch's OpenMP pool).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kMaxRows = 8;   // rows of x handled per call
constexpr int64_t kGrain = 16;    // output rows per parallel task at least

inline float widen(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

#if defined(__AVX512F__)
inline __m512 widen16(const uint16_t* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#elif defined(__AVX2__) && defined(__FMA__)
inline __m256 widen8(const uint16_t* p) {
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline float reduce_add8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// acc[m] = dot(x[m, :], w_row) for m < M; x is float32 [M, K].
inline void row_dots(const uint16_t* w_row, const float* x, int64_t M, int64_t K, float* acc) {
  int64_t k = 0;
#if defined(__AVX512F__)
  if (M == 1) {
    // One row: four independent FMA chains, or the loop waits on the FMA latency.
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (; k + 64 <= K; k += 64) {
      s0 = _mm512_fmadd_ps(widen16(w_row + k), _mm512_loadu_ps(x + k), s0);
      s1 = _mm512_fmadd_ps(widen16(w_row + k + 16), _mm512_loadu_ps(x + k + 16), s1);
      s2 = _mm512_fmadd_ps(widen16(w_row + k + 32), _mm512_loadu_ps(x + k + 32), s2);
      s3 = _mm512_fmadd_ps(widen16(w_row + k + 48), _mm512_loadu_ps(x + k + 48), s3);
    }
    for (; k + 16 <= K; k += 16) s0 = _mm512_fmadd_ps(widen16(w_row + k), _mm512_loadu_ps(x + k), s0);
    acc[0] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
  } else {
    __m512 sums[kMaxRows];
    for (int64_t m = 0; m < M; ++m) sums[m] = _mm512_setzero_ps();
    for (; k + 16 <= K; k += 16) {
      __m512 wv = widen16(w_row + k);
      for (int64_t m = 0; m < M; ++m) sums[m] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + m * K + k), sums[m]);
    }
    for (int64_t m = 0; m < M; ++m) acc[m] = _mm512_reduce_add_ps(sums[m]);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  // The same with 8-wide vectors (AVX2 CPUs, e.g. AMD Zen 2/3).
  if (M == 1) {
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (; k + 32 <= K; k += 32) {
      s0 = _mm256_fmadd_ps(widen8(w_row + k), _mm256_loadu_ps(x + k), s0);
      s1 = _mm256_fmadd_ps(widen8(w_row + k + 8), _mm256_loadu_ps(x + k + 8), s1);
      s2 = _mm256_fmadd_ps(widen8(w_row + k + 16), _mm256_loadu_ps(x + k + 16), s2);
      s3 = _mm256_fmadd_ps(widen8(w_row + k + 24), _mm256_loadu_ps(x + k + 24), s3);
    }
    for (; k + 8 <= K; k += 8) s0 = _mm256_fmadd_ps(widen8(w_row + k), _mm256_loadu_ps(x + k), s0);
    acc[0] = reduce_add8(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
  } else {
    __m256 sums[kMaxRows];
    for (int64_t m = 0; m < M; ++m) sums[m] = _mm256_setzero_ps();
    for (; k + 8 <= K; k += 8) {
      __m256 wv = widen8(w_row + k);
      for (int64_t m = 0; m < M; ++m) sums[m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * K + k), sums[m]);
    }
    for (int64_t m = 0; m < M; ++m) acc[m] = reduce_add8(sums[m]);
  }
#else
  for (int64_t m = 0; m < M; ++m) acc[m] = 0.0f;
#endif
  for (; k < K; ++k) {
    float wv = widen(w_row[k]);
    for (int64_t m = 0; m < M; ++m) acc[m] += wv * x[m * K + k];
  }
}

}  // namespace

torch::Tensor bf16_linear_few_rows(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "x [M, K] and weight [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "bfloat16 inputs");
  TORCH_CHECK(x.size(1) == weight.size(1), "x and weight disagree on K");
  TORCH_CHECK(x.size(0) <= kMaxRows, "at most 8 rows of x");
  TORCH_CHECK(weight.is_contiguous(), "weight must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  torch::Tensor xf = x.to(at::kFloat).contiguous();
  torch::Tensor out = torch::empty({M, N}, x.options());
  const float* xp = xf.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const at::BFloat16* bp = nullptr;
  torch::Tensor b;
  if (bias.has_value()) {
    b = bias->to(at::kBFloat16).contiguous();
    TORCH_CHECK(b.numel() == N, "bias must have N elements");
    bp = b.data_ptr<at::BFloat16>();
  }
  at::parallel_for(0, N, kGrain, [&](int64_t begin, int64_t end) {
    float acc[kMaxRows];
    for (int64_t n = begin; n < end; ++n) {
      row_dots(wp + n * K, xp, M, K, acc);
      const float add = bp ? static_cast<float>(bp[n]) : 0.0f;
      for (int64_t m = 0; m < M; ++m) op[m * N + n] = at::BFloat16(acc[m] + add);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bf16_linear_few_rows", &bf16_linear_few_rows, "bf16 linear for a few rows, float32 accumulation (CPU)");
}
