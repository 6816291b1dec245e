// De-quantize int4 weights from torch's CPU int4 packed layout into a float32 [K, N] matrix, for
// prefill-sized calls: `x @ W^T` then runs as one float32 GEMM (torch.mm(x, out)).
//
// Layout (aten._convert_weight_to_int4pack_for_cpu with inner k tiles of 2): uint8 [N, K / 2]
// read as [N / B, K, B / 2]: for each block of B output rows and each input k, B / 2 bytes whose
// low nibbles are rows 0..B/2-1 of the block and high nibbles the rest. B is four float vectors
// of torch's CPU capability: 64 under AVX-512, 32 under AVX2 (the launcher passes it; the Python
// side reads it off torch). A code q in 0..15 means
// (q - 8) * scale + zero, with scale and zero per (group of `group_size` inputs, output row);
// the launcher passes them as float32 [groups, N] with `shift` = zero - 8 * scale, so the value
// is q * scale + shift (one FMA).
// Included by native.cpp once per instruction set (see vec.h); written against vec.h.
namespace {

// 16 codes (one nibble of 16 bytes) -> 16 floats q * scale + shift, stored at out.
inline void put16(const uint8_t* bytes, bool high, const float* scale, const float* shift, float* out) {
  using namespace vec;
  for (int j = 0; j < 16; j += W) {
    const F q = high ? load_u4_hi(bytes + j) : load_u4_lo(bytes + j);
    store(out + j, fma(q, load(scale + j), load(shift + j)));
  }
}

}  // namespace

// Columns [n_begin, n_end) of W^T (multiples of block_n) into `out` [K, n_end - n_begin].
void int4pack_dequant_t_into(torch::Tensor packed, torch::Tensor scale, torch::Tensor shift, int64_t group_size,
                             int64_t block_n, int64_t n_begin, int64_t n_end, torch::Tensor out) {
  TORCH_CHECK(block_n == 32 || block_n == 64, "block_n must be 32 or 64");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous(),
              "packed must be a contiguous uint8 [N, K / 2] tensor");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && shift.scalar_type() == at::kFloat, "float32 scale and shift");
  TORCH_CHECK(scale.is_contiguous() && shift.is_contiguous(), "contiguous scale and shift");
  const int64_t N = packed.size(0), K = packed.size(1) * 2;
  TORCH_CHECK(N % block_n == 0, "N must be a multiple of block_n");
  TORCH_CHECK(group_size > 0 && K % group_size == 0, "group_size must divide K");
  const int64_t groups = K / group_size;
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == groups && scale.size(1) == N, "scale must be [K / group_size, N]");
  TORCH_CHECK(shift.sizes() == scale.sizes(), "shift must have scale's shape");
  TORCH_CHECK(0 <= n_begin && n_begin < n_end && n_end <= N && n_begin % block_n == 0 && n_end % block_n == 0,
              "columns must be a non-empty range of multiples of block_n within N");
  const int64_t width = n_end - n_begin;
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 && out.size(0) == K &&
              out.size(1) == width, "out must be a contiguous float32 [K, n_end - n_begin] tensor");
  const uint8_t* p = packed.data_ptr<uint8_t>();
  const int64_t half = block_n / 2;
  const float* sp = scale.data_ptr<float>();
  const float* hp = shift.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, K, 16, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      const int64_t g = k / group_size;
      const float* s_row = sp + g * N;
      const float* h_row = hp + g * N;
      float* o_row = op + k * width - n_begin;
      for (int64_t b = n_begin / block_n; b < n_end / block_n; ++b) {
        const uint8_t* bytes = p + (b * K + k) * half;
        for (int64_t j = 0; j < half; j += 16) {
          const int64_t lo = b * block_n + j, hi = lo + half;
          put16(bytes + j, false, s_row + lo, h_row + lo, o_row + lo);
          put16(bytes + j, true, s_row + hi, h_row + hi, o_row + hi);
        }
      }
    }
  });
}

torch::Tensor int4pack_dequant_t(torch::Tensor packed, torch::Tensor scale, torch::Tensor shift, int64_t group_size,
                                 int64_t block_n) {
  torch::Tensor out = torch::empty({packed.size(1) * 2, packed.size(0)}, scale.options());
  int4pack_dequant_t_into(packed, scale, shift, group_size, block_n, 0, packed.size(0), out);
  return out;
}
