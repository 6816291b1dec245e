// GEMVs for a few rows of activations (decode) over a projection's weight in any of the
// engine's formats: float32 / bfloat16 rows, int8 codes with a scale per output channel, or int4
// in torch's packed layout (int4_gemv.h). Each weight row is read once for all rows of x (up to
// four rows' sums stay in registers), multiplied in float32 with vec.h's FMAs, and split over
// output rows with at::parallel_for (torch's thread pool). The results are rounded as the
// engine's layer of that format rounds them, so the fused decode layer (decode_layer.h) and the
// layers' own few-row paths agree.
// Included by native.cpp once per instruction set, in the `layer` namespace before decode_layer.h.
using bf16 = at::BFloat16;

static inline float widen(float x) { return x; }
static inline float widen(bf16 x) { return vec::bf16_to_float(x.x); }
static inline float widen(int8_t x) { return static_cast<float>(x); }
static inline vec::F wload(const float* p) { return vec::load(p); }
static inline vec::F wload(const bf16* p) { return vec::load_bf16(reinterpret_cast<const uint16_t*>(p)); }
static inline vec::F wload(const int8_t* p) { return vec::load_i8(reinterpret_cast<const uint8_t*>(p)); }

// x rounded to T's precision (bf16: nearest even, as torch rounds each bf16 op's result).
template <typename T>
static inline float round_as(float x) {
  if constexpr (std::is_same_v<T, bf16>) return vec::bf16_to_float(vec::float_to_bf16(x));
  else return x;
}
template <typename T>
static inline void store_as(T* dst, float x) {
  if constexpr (std::is_same_v<T, bf16>) dst->x = vec::float_to_bf16(x);
  else *dst = x;
}

// acc[j] = dot(x[j * K :], w_row) for j < MR (MR rows of x, float32, row stride K; the weight
// row in WT: float, bf16 or int8 codes).
template <int MR, typename WT>
static inline void row_dots(const WT* w_row, const float* x, int64_t K, float* acc) {
  using namespace vec;
  int64_t k = 0;
  if constexpr (MR == 1) {  // four independent FMA chains, else the loop waits on the FMA latency
    F s0 = zero(), s1 = s0, s2 = s0, s3 = s0;
    for (; k + 4 * W <= K; k += 4 * W) {
      s0 = fma(wload(w_row + k), load(x + k), s0);
      s1 = fma(wload(w_row + k + W), load(x + k + W), s1);
      s2 = fma(wload(w_row + k + 2 * W), load(x + k + 2 * W), s2);
      s3 = fma(wload(w_row + k + 3 * W), load(x + k + 3 * W), s3);
    }
    for (; k + W <= K; k += W) s0 = fma(wload(w_row + k), load(x + k), s0);
    acc[0] = reduce_add(add(add(s0, s1), add(s2, s3)));
  } else {
    F s[MR];
    for (int j = 0; j < MR; ++j) s[j] = zero();
    for (; k + W <= K; k += W) {
      const F wv = wload(w_row + k);
      for (int j = 0; j < MR; ++j) s[j] = fma(wv, load(x + j * K + k), s[j]);
    }
    for (int j = 0; j < MR; ++j) acc[j] = reduce_add(s[j]);
  }
  for (; k < K; ++k) {
    const float wv = widen(w_row[k]);
    for (int j = 0; j < MR; ++j) acc[j] += wv * x[j * K + k];
  }
}

// y [M, N] = x [M, K] W^T as float32 sums (no rounding); W [N, K] row-major in WT.
template <typename WT>
static void gemv(const float* x, int64_t M, int64_t K, const WT* w, int64_t N, float* y) {
  constexpr int64_t kGrain = 32;  // output rows per task at least
  at::parallel_for(0, N, kGrain, [&](int64_t begin, int64_t end) {
    float acc[4];
    for (int64_t n = begin; n < end; ++n) {
      const WT* wr = w + n * K;
      for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const int64_t mr = std::min<int64_t>(4, M - m0);
        const float* xm = x + m0 * K;
        switch (mr) {
          case 1: row_dots<1>(wr, xm, K, acc); break;
          case 2: row_dots<2>(wr, xm, K, acc); break;
          case 3: row_dots<3>(wr, xm, K, acc); break;
          default: row_dots<4>(wr, xm, K, acc); break;
        }
        for (int64_t j = 0; j < mr; ++j) y[(m0 + j) * N + n] = acc[j];
      }
    }
  });
}

// y [M, N] = x [M, K] W^T (+ bias) rounded to T as the engine's layer of that kind rounds it:
// nn.Linear once (bias included); Int8Linear (sum * channel scale) and Int4Linear (the sum) once,
// then the bias added in T.
template <typename T>
static void project(const ps::Proj& p, const float* x, int64_t M, int64_t K, int64_t N, float* y) {
  const T* bias = static_cast<const T*>(p.bias);
  switch (p.kind) {
    case ps::ProjKind::kPlain:
      gemv(x, M, K, static_cast<const T*>(p.w), N, y);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) y[m * N + n] = round_as<T>(y[m * N + n] + (bias ? widen(bias[n]) : 0.f));
      return;
    case ps::ProjKind::kInt8: {
      gemv(x, M, K, static_cast<const int8_t*>(p.w), N, y);
      const T* scale = static_cast<const T*>(p.scale);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) y[m * N + n] = round_as<T>(y[m * N + n] * widen(scale[n]));
      break;
    }
    case ps::ProjKind::kInt4:
      int4::int4_gemv_raw(x, M, K, static_cast<const uint8_t*>(p.w), static_cast<const float*>(p.scale), p.shift, N,
                          p.block_n, p.group_size, y);
      for (int64_t i = 0; i < M * N; ++i) y[i] = round_as<T>(y[i]);
      break;
  }
  if (bias)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) y[m * N + n] = round_as<T>(y[m * N + n] + widen(bias[n]));
}

// The weight-only int8 linear for 1-16 rows: x [M, K] float32 or bfloat16, qweight int8 [N, K],
// scale [N] in x's dtype -> [M, N] in x's dtype (sum * scale, rounded once), as
// aten::_weight_int8pack_mm computes it.
torch::Tensor int8_linear_few_rows(torch::Tensor x, torch::Tensor qweight, torch::Tensor scale) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= 16, "x must be [1-16 rows, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.dim() == 2 && qweight.is_contiguous() &&
                  qweight.size(1) == x.size(1), "qweight must be a contiguous int8 [N, K]");
  TORCH_CHECK(scale.scalar_type() == x.scalar_type() && scale.is_contiguous() && scale.numel() == qweight.size(0),
              "scale must be [N] in x's dtype");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  torch::Tensor xf = x.to(at::kFloat).contiguous();
  torch::Tensor y = torch::empty({M, N}, xf.options());
  const ps::Proj p{ps::ProjKind::kInt8, qweight.data_ptr(), nullptr, scale.data_ptr(), nullptr, 0, 0};
  if (x.scalar_type() == at::kFloat) project<float>(p, xf.data_ptr<float>(), M, K, N, y.data_ptr<float>());
  else project<bf16>(p, xf.data_ptr<float>(), M, K, N, y.data_ptr<float>());
  return y.to(x.scalar_type());
}

// The bf16 linear for up to 8 rows (UpcastLinear's and PackedLinear's few-row path on CPUs
// without bf16 dot products): x [M, K] and weight [N, K] bfloat16, bias [N] or none -> [M, N]
// bfloat16, the float32 sum and the bias rounded once.
torch::Tensor bf16_linear_few_rows(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "x [M, K] and weight [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "bfloat16 inputs");
  TORCH_CHECK(x.size(1) == weight.size(1), "x and weight disagree on K");
  TORCH_CHECK(x.size(0) <= 8, "at most 8 rows of x");
  TORCH_CHECK(weight.is_contiguous(), "weight must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  torch::Tensor b;
  if (bias.has_value()) {
    b = bias->to(at::kBFloat16).contiguous();
    TORCH_CHECK(b.numel() == N, "bias must have N elements");
  }
  torch::Tensor xf = x.to(at::kFloat).contiguous();
  torch::Tensor y = torch::empty({M, N}, xf.options());
  const ps::Proj p{ps::ProjKind::kPlain, weight.data_ptr(), b.defined() ? b.data_ptr() : nullptr, nullptr, nullptr, 0, 0};
  project<bf16>(p, xf.data_ptr<float>(), M, K, N, y.data_ptr<float>());
  return y.to(at::kBFloat16);
}
