// GEMV for 1-16 rows of activations over int4 weights in torch's CPU packed layout (the layout of
// int4_dequant.h: uint8 [N / B, K, B / 2], low nibbles the block's first B / 2 output rows), with
// group-wise scale and shift (value = q * scale + shift, float32 [groups, N]).
//
// out[m, n] = sum_g (scale[g, n] * sum_{k in g} x[m, k] q[n, k] + shift[g, n] * sum_{k in g} x[m, k])
//
// The codes are widened in registers and multiplied in float32; each group's integer-weighted sum
// is scaled once at the group's end, so the inner loop is one widening and one FMA per code and
// row. Each weight block is read once per MR rows of x (MR rows' accumulators stay in registers;
// more rows re-read the block from L1/L2). Parallel over blocks of output rows.
// Included by native.cpp once per instruction set (see vec.h); written against vec.h.
namespace {

constexpr int64_t kGemvMaxRows = 16;

// Rows m0 .. m0+MR-1 of x against one block: NV vectors per half block.
template <int NV, int MR>
inline void int4_block_rows(const uint8_t* blk, const float* x, const float* xsum, const float* sp, const float* hp,
                            int64_t K, int64_t N, int64_t n0, int64_t group_size, int64_t groups, float* out) {
  using namespace vec;
  constexpr int64_t half = NV * W;
  float res[MR][2 * half];
  for (int m = 0; m < MR; ++m)
    for (int64_t j = 0; j < 2 * half; ++j) res[m][j] = 0.f;
  for (int64_t g = 0; g < groups; ++g) {
    F lo[MR][NV], hi[MR][NV];
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < NV; ++v) lo[m][v] = hi[m][v] = zero();
    for (int64_t k = g * group_size; k < (g + 1) * group_size; ++k) {
      const uint8_t* bytes = blk + k * half;
      F ql[NV], qh[NV];
      for (int v = 0; v < NV; ++v) {
        ql[v] = load_u4_lo(bytes + v * W);
        qh[v] = load_u4_hi(bytes + v * W);
      }
      for (int m = 0; m < MR; ++m) {
        const F xk = set1(x[m * K + k]);
        for (int v = 0; v < NV; ++v) {
          lo[m][v] = fma(xk, ql[v], lo[m][v]);
          hi[m][v] = fma(xk, qh[v], hi[m][v]);
        }
      }
    }
    const float* s = sp + g * N + n0;
    const float* h = hp + g * N + n0;
    for (int m = 0; m < MR; ++m) {
      const F xs = set1(xsum[m * groups + g]);
      for (int v = 0; v < NV; ++v) {
        const int64_t a = v * W, b = half + v * W;
        store(res[m] + a, fma(lo[m][v], load(s + a), fma(xs, load(h + a), load(res[m] + a))));
        store(res[m] + b, fma(hi[m][v], load(s + b), fma(xs, load(h + b), load(res[m] + b))));
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int64_t j = 0; j < 2 * half; ++j) out[m * N + n0 + j] = res[m][j];
}

// All M rows against one block, MR rows at a time.
template <int NV, int MR>
inline void int4_block(const uint8_t* blk, const float* x, const float* xsum, const float* sp, const float* hp,
                       int64_t M, int64_t K, int64_t N, int64_t n0, int64_t group_size, int64_t groups, float* out) {
  int64_t m = 0;
  for (; m + MR <= M; m += MR)
    int4_block_rows<NV, MR>(blk, x + m * K, xsum + m * groups, sp, hp, K, N, n0, group_size, groups, out + m * N);
  for (; m < M; ++m)
    int4_block_rows<NV, 1>(blk, x + m * K, xsum + m * groups, sp, hp, K, N, n0, group_size, groups, out + m * N);
}

// Rows of x kept in registers at once: the accumulators (2 * NV * MR vectors) plus the 2 * NV
// widened codes fit the register file (32 vectors with AVX-512, 16 with AVX2).
template <int NV>
constexpr int rows_in_registers() {
  constexpr int regs = vec::W == 16 ? 32 : 16;
  constexpr int mr = (regs - 2 * NV - 2) / (2 * NV);
  return mr >= 4 ? 4 : (mr >= 2 ? 2 : 1);
}

template <int NV>
void int4_gemv_blocks(const uint8_t* p, const float* x, const float* xsum, const float* sp, const float* hp,
                      int64_t M, int64_t K, int64_t N, int64_t block_n, int64_t group_size, float* out) {
  const int64_t groups = K / group_size;
  at::parallel_for(0, N / block_n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      int4_block<NV, rows_in_registers<NV>()>(p + b * K * (block_n / 2), x, xsum, sp, hp, M, K, N, b * block_n,
                                             group_size, groups, out);
  });
}

}  // namespace

// out [M, N] float32 = x [M, K] float32 @ W^T, W in the packed layout (raw pointers; M <= 16;
// the shapes checked by the caller). Also the fused decode layer's int4 projection.
void int4_gemv_raw(const float* x, int64_t M, int64_t K, const uint8_t* p, const float* sp, const float* hp,
                   int64_t N, int64_t block_n, int64_t group_size, float* out) {
  const int64_t groups = K / group_size;
  std::vector<float> xsum(M * groups);  // each group's sum of x, for the shift term
  float* xs = xsum.data();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.f;
      for (int64_t k = g * group_size; k < (g + 1) * group_size; ++k) s += x[m * K + k];
      xs[m * groups + g] = s;
    }
  switch (block_n / 2 / vec::W) {  // vectors per half block
    case 1: int4_gemv_blocks<1>(p, x, xs, sp, hp, M, K, N, block_n, group_size, out); break;
    case 2: int4_gemv_blocks<2>(p, x, xs, sp, hp, M, K, N, block_n, group_size, out); break;
    case 4: int4_gemv_blocks<4>(p, x, xs, sp, hp, M, K, N, block_n, group_size, out); break;
    case 16: int4_gemv_blocks<16>(p, x, xs, sp, hp, M, K, N, block_n, group_size, out); break;
    default: int4_gemv_blocks<32>(p, x, xs, sp, hp, M, K, N, block_n, group_size, out); break;
  }
}

// float32 `x [M, K] @ W^T` -> [M, N] for M <= 16, W in the packed layout (block_n 32 or 64).
torch::Tensor int4pack_gemv(torch::Tensor x, torch::Tensor packed, torch::Tensor scale, torch::Tensor shift,
                            int64_t group_size, int64_t block_n) {
  TORCH_CHECK(block_n == 32 || block_n == 64, "block_n must be 32 or 64");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32 [M, K]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kGemvMaxRows, "int4pack_gemv takes 1 to 16 rows");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous(),
              "packed must be a contiguous uint8 [N, K / 2] tensor");
  const int64_t M = x.size(0), N = packed.size(0), K = packed.size(1) * 2;
  TORCH_CHECK(x.size(1) == K, "x and packed disagree on K");
  TORCH_CHECK(N % block_n == 0, "N must be a multiple of block_n");
  TORCH_CHECK(group_size > 0 && K % group_size == 0, "group_size must divide K");
  const int64_t groups = K / group_size;
  TORCH_CHECK(scale.scalar_type() == at::kFloat && shift.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  shift.is_contiguous() && scale.dim() == 2 && scale.size(0) == groups && scale.size(1) == N &&
                  shift.sizes() == scale.sizes(),
              "scale and shift must be contiguous float32 [K / group_size, N]");
  torch::Tensor out = torch::empty({M, N}, x.options());
  int4_gemv_raw(x.data_ptr<float>(), M, K, packed.data_ptr<uint8_t>(), scale.data_ptr<float>(),
                shift.data_ptr<float>(), N, block_n, group_size, out.data_ptr<float>());
  return out;
}
