// Fused elementwise ops of the Llama decoder for CPU: RMSNorm (optionally with the residual add),
// SiLU-and-mul and rotate-half RoPE, for float32 and bfloat16.
//
// Each op reproduces the plain-torch code in engine/model/llama.py bit for bit, so switching the
// fused path on never changes a result:
// - every torch bf16 elementwise op computes in float32 and rounds its result to bf16 (round to
//   nearest even); the kernels round after the same ops;
// - the RMSNorm mean is torch's float32 inner-dim sum (a cascade over W-float vectors), replayed
//   in the same order, then divided by n;
// - SiLU's exp is Sleef's expf_u10 on whole vector chunks, like torch's vectorised loop, and
//   std::exp on a row's tail, like torch's scalar loop.
// The vector widths are arguments: the launcher knows which of torch's kernels run here.
// For that the file is built WITHOUT -ffast-math and with -ffp-contract=off: no reassociation,
// no FMA contraction, no reciprocal approximations.
// Included by native.cpp once per instruction set (see vec.h).
// torch's own SiLU calls Sleef's exp of its vector width; declared here, in the target region
// (sleef.h declares them only where the compiler's baseline has the instruction set).
#if PS_VEC_WIDTH >= 16
extern "C" __m512 Sleef_expf16_u10(__m512);
#endif
#if PS_VEC_WIDTH >= 8
extern "C" __m256 Sleef_expf8_u10(__m256);
#endif
using bf16 = at::BFloat16;

static inline float to_float(float x) { return x; }
static inline float to_float(bf16 x) { return static_cast<float>(x); }

// Rounds a float32 result to T (round to nearest even for bf16) and back to float32.
static inline float round_to(float x, float) { return x; }
static inline float round_to(float x, bf16) { return static_cast<float>(bf16(x)); }

// Rows per at::parallel_for task: at least ~16k elements each, so small batches stay serial.
static inline int64_t row_grain(int64_t row_elems) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_elems)); }

static inline int64_t ceil_log2(int64_t x) {  // at::native::utils::CeilLog2
  if (x <= 2) return 1;
  return 64 - __builtin_clzll(static_cast<uint64_t>(x - 1));
}

// torch's row_sum over `count` chunks of L floats (L = 1: scalars), ATen/native/cpu/SumKernel.cpp:
// 4 interleaved accumulators in a 4-level cascade, then the leftover chunks, then acc 1..3 into 0.
template <int L>
static void torch_row_sum(const float* d, int64_t count, float* out) {
  const int64_t size = count / 4;  // rows of 4 chunks
  constexpr int levels = 4;
  float acc[levels][4][L] = {};
  const int64_t power = std::max<int64_t>(4, ceil_log2(size) / levels);
  const int64_t step = int64_t{1} << power, mask = step - 1;
  auto add_row = [&](int64_t i) {
    for (int k = 0; k < 4; ++k)
      for (int l = 0; l < L; ++l) acc[0][k][l] += d[(i * 4 + k) * L + l];
  };
  int64_t i = 0;
  while (i + step <= size) {
    for (int64_t j = 0; j < step; ++j, ++i) add_row(i);
    for (int j = 1; j < levels; ++j) {
      for (int k = 0; k < 4; ++k)
        for (int l = 0; l < L; ++l) {
          acc[j][k][l] += acc[j - 1][k][l];
          acc[j - 1][k][l] = 0.f;
        }
      if ((i & (mask << (j * power))) != 0) break;
    }
  }
  for (; i < size; ++i) add_row(i);
  for (int j = 1; j < levels; ++j)
    for (int k = 0; k < 4; ++k)
      for (int l = 0; l < L; ++l) acc[0][k][l] += acc[j][k][l];
  for (int64_t c = size * 4; c < count; ++c)
    for (int l = 0; l < L; ++l) acc[0][0][l] += d[c * L + l];
  for (int k = 1; k < 4; ++k)
    for (int l = 0; l < L; ++l) acc[0][0][l] += acc[0][k][l];
  for (int l = 0; l < L; ++l) out[l] = acc[0][0][l];
}

// torch's float32 sum of a contiguous row (cascade_sum): rows of at least W elements take
// vectorized_inner_sum (W-float vectors, then the scalar tail, then the lanes), shorter ones
// scalar_inner_sum. torch registers its sum kernel for AVX2 at most, so W is 8 on x86.
template <int W>
static float torch_sum(const float* d, int64_t n) {
  if (n < W) {
    float s;
    torch_row_sum<1>(d, n, &s);
    return s;
  }
  const int64_t vec_size = n / W;
  float lanes[W];
  torch_row_sum<W>(d, vec_size, lanes);
  float total = 0.f;
  for (int64_t k = vec_size * W; k < n; ++k) total += d[k];
  for (int l = 0; l < W; ++l) total += lanes[l];
  return total;
}

// One row of HF RMSNorm: xf is the row in float32, out = weight * T(xf * rsqrt(mean(xf^2) + eps)).
template <typename T>
static inline void norm_row(const float* xf, float* sq, const T* w, T* out, int64_t n, float eps, int vec_width) {
  for (int64_t i = 0; i < n; ++i) sq[i] = xf[i] * xf[i];
  const float sum = vec_width == 16 ? torch_sum<16>(sq, n) : torch_sum<8>(sq, n);
  const float r = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(to_float(w[i]) * round_to(xf[i] * r, T{}));
}

template <typename T>
static void rms_norm_kernel(const T* x, T* residual, const T* w, T* out, int64_t rows, int64_t n, float eps,
                            int vec_width) {
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    std::vector<float> xf(n), sq(n);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * n;
      if (residual != nullptr) {  // residual += x in T, then normalise the new residual
        T* rr = residual + r * n;
        for (int64_t i = 0; i < n; ++i) {
          rr[i] = static_cast<T>(to_float(rr[i]) + to_float(xr[i]));
          xf[i] = to_float(rr[i]);
        }
      } else {
        for (int64_t i = 0; i < n; ++i) xf[i] = to_float(xr[i]);
      }
      norm_row(xf.data(), sq.data(), w, out + r * n, n, eps, vec_width);
    }
  });
}

static void check_norm_args(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w.dim() == 1 && w.is_contiguous(), "expected x [T, n], w [n]");
  TORCH_CHECK(x.size(1) == w.size(0) && x.scalar_type() == w.scalar_type(), "x/weight shape or dtype mismatch");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps, int64_t vec_width) {
  check_norm_args(x, w);
  auto out = torch::empty_like(x);
  if (x.scalar_type() == at::kFloat)
    rms_norm_kernel<float>(x.data_ptr<float>(), nullptr, w.data_ptr<float>(), out.data_ptr<float>(), x.size(0),
                           x.size(1), static_cast<float>(eps), static_cast<int>(vec_width));
  else
    rms_norm_kernel<bf16>(x.data_ptr<bf16>(), nullptr, w.data_ptr<bf16>(), out.data_ptr<bf16>(), x.size(0),
                          x.size(1), static_cast<float>(eps), static_cast<int>(vec_width));
  return out;
}

// residual += x (in place), returns rms_norm(residual).
torch::Tensor fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps,
                                 int64_t vec_width) {
  check_norm_args(x, w);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() && residual.scalar_type() == x.scalar_type(),
              "residual must match x");
  auto out = torch::empty_like(x);
  if (x.scalar_type() == at::kFloat)
    rms_norm_kernel<float>(x.data_ptr<float>(), residual.data_ptr<float>(), w.data_ptr<float>(),
                           out.data_ptr<float>(), x.size(0), x.size(1), static_cast<float>(eps),
                           static_cast<int>(vec_width));
  else
    rms_norm_kernel<bf16>(x.data_ptr<bf16>(), residual.data_ptr<bf16>(), w.data_ptr<bf16>(), out.data_ptr<bf16>(),
                          x.size(0), x.size(1), static_cast<float>(eps), static_cast<int>(vec_width));
  return out;
}

// out[t, i] = T(T(silu(gate)) * up) with gate = gu[t, :n], up = gu[t, n:].
// torch's vectorised loop (cpu_kernel_vec) covers whole chunks of two Vectorized<T> from the row
// start (`chunk` elements) with Sleef's exp; the rest of the row takes the scalar loop and
// std::exp. chunk 0: all scalar.
template <typename T>
static void silu_and_mul_kernel(const T* gu, T* out, int64_t rows, int64_t n, int64_t chunk) {
  const int64_t n_vec = chunk > 0 ? n / chunk * chunk : 0;
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    std::vector<float> s(n);
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gu + r * 2 * n;
      const T* u = g + n;
      int64_t i = 0;
#if PS_VEC_WIDTH >= 16
      for (; i + 16 <= n_vec; i += 16) {
        float gf[16];
        for (int l = 0; l < 16; ++l) gf[l] = to_float(g[i + l]);
        const __m512 x = _mm512_loadu_ps(gf);
        const __m512 e = Sleef_expf16_u10(_mm512_sub_ps(_mm512_setzero_ps(), x));
        _mm512_storeu_ps(s.data() + i, _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
      }
#endif
#if PS_VEC_WIDTH >= 8
      for (; i + 8 <= n_vec; i += 8) {  // torch's AVX2 kernels: 8-float vectors
        float gf[8];
        for (int l = 0; l < 8; ++l) gf[l] = to_float(g[i + l]);
        const __m256 x = _mm256_loadu_ps(gf);
        const __m256 e = Sleef_expf8_u10(_mm256_sub_ps(_mm256_setzero_ps(), x));
        _mm256_storeu_ps(s.data() + i, _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), e)));
      }
#endif
      for (; i < n; ++i) {
        const float x = to_float(g[i]);
        s[i] = x / (1.f + std::exp(-x));
      }
      T* o = out + r * n;
      for (i = 0; i < n; ++i) o[i] = static_cast<T>(round_to(s[i], T{}) * to_float(u[i]));
    }
  });
}

// vec_bytes: the width of torch's SiLU vectors (64 with AVX512 kernels, 32 with AVX2), 0 = scalar.
torch::Tensor silu_and_mul(torch::Tensor gate_up, int64_t vec_bytes) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0, "expected gate_up [T, 2n]");
  TORCH_CHECK(vec_bytes == 0 || vec_bytes == 32 || vec_bytes == 64, "vec_bytes must be 0, 32 or 64");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  auto out = torch::empty({rows, n}, gate_up.options());
#if PS_VEC_WIDTH < 16
  if (vec_bytes == 64) vec_bytes = 0;  // not built here: all scalar
#endif
#if PS_VEC_WIDTH < 8
  vec_bytes = 0;
#endif
  if (gate_up.scalar_type() == at::kFloat)
    silu_and_mul_kernel<float>(gate_up.data_ptr<float>(), out.data_ptr<float>(), rows, n, 2 * vec_bytes / 4);
  else if (gate_up.scalar_type() == at::kBFloat16)
    silu_and_mul_kernel<bf16>(gate_up.data_ptr<bf16>(), out.data_ptr<bf16>(), rows, n, 2 * vec_bytes / 2);
  else
    TORCH_CHECK(false, "silu_and_mul supports float32 and bfloat16");
  return out;
}

// In place on x [T, heads, D] (token stride free, heads and D contiguous), cos/sin [T, D/2]:
// x1, x2 = halves; x = cat(x1*cos - x2*sin, x2*cos + x1*sin), each product and sum rounded to T.
template <typename T>
static void rope_kernel(T* x, const T* cos, const T* sin, int64_t tokens, int64_t heads, int64_t d,
                        int64_t token_stride) {
  const int64_t half = d / 2;
  at::parallel_for(0, tokens, row_grain(heads * d), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * half;
      const T* s = sin + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        T* x1 = x + t * token_stride + h * d;
        T* x2 = x1 + half;
        for (int64_t i = 0; i < half; ++i) {
          const float a = to_float(x1[i]), b = to_float(x2[i]), ci = to_float(c[i]), si = to_float(s[i]);
          const float o1 = round_to(a * ci, T{}) - round_to(b * si, T{});
          const float o2 = round_to(b * ci, T{}) + round_to(a * si, T{});
          x1[i] = static_cast<T>(o1);
          x2[i] = static_cast<T>(o2);
        }
      }
    }
  });
}

void rotary_embedding_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2) && x.size(2) % 2 == 0,
              "expected x [T, heads, D] with heads and D contiguous, D even");
  TORCH_CHECK(cos.dim() == 2 && cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() &&
                  cos.size(0) == x.size(0) && cos.size(1) == x.size(2) / 2,
              "expected cos/sin [T, D/2]");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(), "dtype mismatch");
  if (x.scalar_type() == at::kFloat)
    rope_kernel<float>(x.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), x.size(0), x.size(1),
                       x.size(2), x.stride(0));
  else if (x.scalar_type() == at::kBFloat16)
    rope_kernel<bf16>(x.data_ptr<bf16>(), cos.data_ptr<bf16>(), sin.data_ptr<bf16>(), x.size(0), x.size(1),
                      x.size(2), x.stride(0));
  else
    TORCH_CHECK(false, "rotary_embedding_ supports float32 and bfloat16");
}
