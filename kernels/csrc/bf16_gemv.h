// bf16 x bf16 linear for a few rows (batch-1 decode), for CPUs without bf16 dot products.
//
// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), x [M, K] and w [N, K] bfloat16, accumulated in
// float32 and rounded to bfloat16 once. A bf16 value is the upper half of a float32, so a weight
// is widened by a 16-bit shift: each weight row is read once for all M rows of x (M is small:
// the engine calls this below UpcastLinear's min_rows). The call is bound by reading the weight;
// work is split over output rows with at::parallel_for (torch's OpenMP pool).
// Included by native.cpp once per instruction set (see vec.h); written against vec.h.
namespace {

constexpr int64_t kMaxRows = 8;   // rows of x handled per call
constexpr int64_t kGrain = 16;    // output rows per parallel task at least

// acc[m] = dot(x[m, :], w_row) for m < M; x is float32 [M, K].
inline void row_dots(const uint16_t* w_row, const float* x, int64_t M, int64_t K, float* acc) {
  using namespace vec;
  int64_t k = 0;
  if (M == 1) {
    // One row: four independent FMA chains, or the loop waits on the FMA latency.
    F s0 = zero(), s1 = s0, s2 = s0, s3 = s0;
    for (; k + 4 * W <= K; k += 4 * W) {
      s0 = fma(load_bf16(w_row + k), load(x + k), s0);
      s1 = fma(load_bf16(w_row + k + W), load(x + k + W), s1);
      s2 = fma(load_bf16(w_row + k + 2 * W), load(x + k + 2 * W), s2);
      s3 = fma(load_bf16(w_row + k + 3 * W), load(x + k + 3 * W), s3);
    }
    for (; k + W <= K; k += W) s0 = fma(load_bf16(w_row + k), load(x + k), s0);
    acc[0] = reduce_add(add(add(s0, s1), add(s2, s3)));
  } else {
    F sums[kMaxRows];
    for (int64_t m = 0; m < M; ++m) sums[m] = zero();
    for (; k + W <= K; k += W) {
      const F wv = load_bf16(w_row + k);
      for (int64_t m = 0; m < M; ++m) sums[m] = fma(wv, load(x + m * K + k), sums[m]);
    }
    for (int64_t m = 0; m < M; ++m) acc[m] = reduce_add(sums[m]);
  }
  for (; k < K; ++k) {
    const float wv = bf16_to_float(w_row[k]);
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
