// The ops of one instruction-set region as the dispatcher calls them: PS_DECLARE_OPS(ns)
// declares those of namespace `ns` where another translation unit defines them.
#pragma once

#define PS_DECLARE_DECODE_OPS(ns)                                                                              \
  namespace ns::decode {                                                                                       \
  torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor kcache, torch::Tensor vcache,            \
                                       torch::Tensor block_tables, torch::Tensor seq_lens, double scale,       \
                                       const std::string& kv_quant);                                           \
  void gather_dequantize(torch::Tensor cache, torch::Tensor blocks, torch::Tensor out, const std::string& kv_quant); \
  }

#define PS_DECLARE_OPS(ns)                                                                                     \
  PS_DECLARE_DECODE_OPS(ns)                                                                                    \
  namespace ns::int4 {                                                                                         \
  void int4pack_dequant_t_into(torch::Tensor packed, torch::Tensor scale, torch::Tensor shift, int64_t group_size, \
                               int64_t block_n, int64_t n_begin, int64_t n_end, torch::Tensor out);            \
  torch::Tensor int4pack_dequant_t(torch::Tensor packed, torch::Tensor scale, torch::Tensor shift,             \
                                   int64_t group_size, int64_t block_n);                                       \
  torch::Tensor int4pack_gemv(torch::Tensor x, torch::Tensor packed, torch::Tensor scale, torch::Tensor shift,  \
                              int64_t group_size, int64_t block_n);                                            \
  }                                                                                                            \
  namespace ns::int8io {                                                                                       \
  std::vector<torch::Tensor> int8_quantize_rows(torch::Tensor x, int64_t outliers);                            \
  torch::Tensor int8_mm_epilogue(torch::Tensor acc, torch::Tensor x_scale, torch::Tensor w_scale,              \
                                 torch::Tensor x_out, torch::Tensor w_out, bool bf16_out);                     \
  }                                                                                                            \
  namespace ns::fused {                                                                                        \
  torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps, int64_t vec_width);                     \
  torch::Tensor fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps,       \
                                   int64_t vec_width);                                                         \
  torch::Tensor silu_and_mul(torch::Tensor gate_up, int64_t vec_bytes);                                       \
  void rotary_embedding_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);                               \
  }                                                                                                            \
  namespace ns::layer {                                                                                        \
  torch::Tensor bf16_linear_few_rows(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias); \
  torch::Tensor int8_linear_few_rows(torch::Tensor x, torch::Tensor qweight, torch::Tensor scale);             \
  void decode_layers(const std::vector<ps::DecodeLayerWeights>& layers, const ps::DecodeLayerDims& d,          \
                     const ps::DecodeStep& s, const std::vector<void*>& k_caches,                              \
                     const std::vector<void*>& v_caches, float* h, float* residual, bool first);               \
  }
