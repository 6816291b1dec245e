// The passes around an int8 x int8 product (torch._int_mm) with per-token activation scales and
// outlier channels (engine/model/quant_linear.py `_w8a8_mm`, whose torch form is the reference):
//
// int8_quantize_rows(x [M, K] float32 or bf16, outliers J) -> (xq int8 [M, K], x_scale float32 [M],
//   x_out float32 [M, J], cols int64 [J]): the J input channels of largest max |x| over the rows
//   are left out (0 in xq, their values in x_out); each row is scaled by the max |x| of its other
//   channels / 127 and rounded half to even, as torch.round does. Two passes over x, where torch
//   took about ten.
// int8_mm_epilogue(acc int32 [M, N], x_scale [M], w_scale [N], x_out [M, J], w_out [J, N]) ->
//   out[m, n] = (acc[m, n] * x_scale[m] + sum_j x_out[m, j] * w_out[j, n]) * w_scale[n], in one
//   pass, float32 or bf16 (rounded once, to nearest even); torch took five passes.
// Included by native.cpp once per instruction set (see vec.h).
namespace {

constexpr int64_t kChunk = 256;  // output columns per epilogue task: its partial sums stay in L1

template <typename In>
std::vector<torch::Tensor> quantize_rows(const In* x, int64_t M, int64_t K, int64_t J) {
  // Max |x| per channel: each task its own rows into its own array, then combined.
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), M));
  std::vector<float> part(tasks * K, 0.0f);
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* mx = part.data() + t * K;
      for (int64_t m = t * M / tasks; m < (t + 1) * M / tasks; ++m)
        for (int64_t k = 0; k < K; ++k) mx[k] = std::max(mx[k], std::fabs(static_cast<float>(x[m * K + k])));
    }
  });
  std::vector<float> col_max(part.begin(), part.begin() + K);
  for (int64_t t = 1; t < tasks; ++t)
    for (int64_t k = 0; k < K; ++k) col_max[k] = std::max(col_max[k], part[t * K + k]);
  std::vector<int64_t> order(K);
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + J, order.end(),
                    [&](int64_t a, int64_t b) { return col_max[a] > col_max[b] || (col_max[a] == col_max[b] && a < b); });
  std::vector<uint8_t> is_out(K, 0);
  torch::Tensor cols = torch::empty({J}, torch::kLong);
  for (int64_t j = 0; j < J; ++j) {
    cols.data_ptr<int64_t>()[j] = order[j];
    is_out[order[j]] = 1;
  }
  torch::Tensor xq = torch::empty({M, K}, torch::kChar);
  torch::Tensor x_scale = torch::empty({M}, torch::kFloat);
  torch::Tensor x_out = torch::empty({M, J}, torch::kFloat);
  int8_t* q = xq.data_ptr<int8_t>();
  float *sp = x_scale.data_ptr<float>(), *op = x_out.data_ptr<float>();
  const int64_t* cp = cols.data_ptr<int64_t>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const In* row = x + m * K;
      float mx = 0.0f;
      for (int64_t k = 0; k < K; ++k)
        if (!is_out[k]) mx = std::max(mx, std::fabs(static_cast<float>(row[k])));
      const float scale = std::max(mx, 1e-12f) / 127.0f;
      sp[m] = scale;
      for (int64_t k = 0; k < K; ++k)
        q[m * K + k] = is_out[k] ? 0 : static_cast<int8_t>(std::nearbyint(static_cast<float>(row[k]) / scale));
      for (int64_t j = 0; j < J; ++j) op[m * J + j] = static_cast<float>(row[cp[j]]);
    }
  });
  return {xq, x_scale, x_out, cols};
}

template <typename Out>
void epilogue(const int32_t* acc, const float* xs, const float* ws, const float* xo, const float* wo,
              Out* out, int64_t M, int64_t N, int64_t J) {
  const int64_t chunks = (N + kChunk - 1) / kChunk;
  at::parallel_for(0, M * chunks, 1, [&](int64_t begin, int64_t end) {
    float tmp[kChunk];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t m = task / chunks, n0 = (task % chunks) * kChunk, len = std::min(kChunk, N - n0);
      const int32_t* a = acc + m * N + n0;
      const float s = xs[m];
      for (int64_t i = 0; i < len; ++i) tmp[i] = static_cast<float>(a[i]) * s;
      for (int64_t j = 0; j < J; ++j) {
        const float x = xo[m * J + j];
        const float* w = wo + j * N + n0;
        for (int64_t i = 0; i < len; ++i) tmp[i] += x * w[i];
      }
      Out* o = out + m * N + n0;
      const float* sc = ws + n0;
      for (int64_t i = 0; i < len; ++i) o[i] = static_cast<Out>(tmp[i] * sc[i]);
    }
  });
}

}  // namespace

std::vector<torch::Tensor> int8_quantize_rows(torch::Tensor x, int64_t outliers) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: contiguous [M, K]");
  TORCH_CHECK(outliers >= 0 && outliers <= x.size(1), "outliers: 0..K channels");
  const int64_t M = x.size(0), K = x.size(1);
  if (x.scalar_type() == at::kBFloat16) return quantize_rows(x.data_ptr<at::BFloat16>(), M, K, outliers);
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x: float32 or bfloat16");
  return quantize_rows(x.data_ptr<float>(), M, K, outliers);
}

torch::Tensor int8_mm_epilogue(torch::Tensor acc, torch::Tensor x_scale, torch::Tensor w_scale,
                               torch::Tensor x_out, torch::Tensor w_out, bool bf16_out) {
  TORCH_CHECK(acc.dim() == 2 && acc.scalar_type() == at::kInt && acc.is_contiguous(), "acc: contiguous int32 [M, N]");
  const int64_t M = acc.size(0), N = acc.size(1);
  TORCH_CHECK(x_scale.scalar_type() == at::kFloat && x_scale.is_contiguous() && x_scale.numel() == M,
              "x_scale: contiguous float32 [M]");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.is_contiguous() && w_scale.numel() == N,
              "w_scale: contiguous float32 [N]");
  TORCH_CHECK(x_out.dim() == 2 && x_out.size(0) == M && x_out.scalar_type() == at::kFloat && x_out.is_contiguous(),
              "x_out: contiguous float32 [M, J]");
  const int64_t J = x_out.size(1);
  TORCH_CHECK(w_out.dim() == 2 && w_out.size(0) == J && w_out.size(1) == N && w_out.scalar_type() == at::kFloat &&
              w_out.is_contiguous(), "w_out: contiguous float32 [J, N]");
  torch::Tensor out = torch::empty({M, N}, acc.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  const int32_t* a = acc.data_ptr<int32_t>();
  const float *xs = x_scale.data_ptr<float>(), *ws = w_scale.data_ptr<float>();
  const float *xo = x_out.data_ptr<float>(), *wo = w_out.data_ptr<float>();
  if (bf16_out) {
    epilogue(a, xs, ws, xo, wo, out.data_ptr<at::BFloat16>(), M, N, J);
  } else {
    epilogue(a, xs, ws, xo, wo, out.data_ptr<float>(), M, N, J);
  }
  return out;
}
