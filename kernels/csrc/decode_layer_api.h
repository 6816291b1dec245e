// The fused decode layer's arguments (kernels/csrc/decode_layer.h), as raw pointers: the same
// structs for every instruction-set region, so they are defined once, outside the regions.
#pragma once
#include <cstdint>

namespace ps {

// How a projection's weight is stored (the engine's layers: nn.Linear, Int8Linear, Int4Linear).
enum class ProjKind : int32_t {
  kPlain = 0,  // [out, in] row-major in the model dtype
  kInt8 = 1,   // int8 [out, in] row-major, `scale` [out] in the model dtype (per output channel)
  kInt4 = 2,   // torch's CPU int4 packed layout (int4_gemv.h), float32 `scale`, `shift` [in / group, out]
};

// One projection: y = x W^T (+ bias), the bias in the model dtype or null.
struct Proj {
  ProjKind kind;
  const void* w;
  const void* bias;
  const void* scale;   // kInt8: model dtype [out]; kInt4: float32 [groups, out]
  const float* shift;  // kInt4: float32 [groups, out]
  int64_t group_size;  // kInt4
  int64_t block_n;     // kInt4: output rows per packed block (32 or 64)
};

// One decoder layer of the Llama shape and its variants: the pre-norm layer (Llama, Mistral,
// Qwen2/3, Phi-3), or Gemma 2/3's sandwich (`pre_ff_norm` and `post_ff_norm` set: the attention
// output is normed by `post_norm` before its add, the MLP's input by `pre_ff_norm` and its output
// by `post_ff_norm`). Norm weights are in the model dtype, or float32 for Gemma's norms (the
// model's `gemma_norm`); RoPE tables in the model dtype.
struct DecodeLayerWeights {
  const void* input_norm;    // [hidden]
  const void* post_norm;     // [hidden]
  const void* pre_ff_norm;   // [hidden] or null
  const void* post_ff_norm;  // [hidden] or null
  const void* q_norm;        // [D] per head (Qwen3, Gemma 3) or null
  const void* k_norm;        // [D] or null
  Proj qkv;                  // [(H + 2 KVH) D, hidden], rows q | k | v
  Proj o;                    // [hidden, H D]
  Proj gate_up;              // [2 I, hidden], rows gate | up
  Proj down;                 // [hidden, I]
  const void* rope_cos;      // [max_len, D / 2]
  const void* rope_sin;      // [max_len, D / 2]
  float scale;               // attention score scale
  int64_t window;            // sliding window in tokens, 0: none
  float softcap;             // attention scores' soft cap, 0: none
};

// Shapes and kinds shared by the layers of one model.
struct DecodeLayerDims {
  int64_t hidden, heads, kv_heads, head_dim, intermediate;
  float eps;
  bool bf16;        // else float32
  bool gemma_norm;  // Gemma's RMSNorm: (x / rms) * (1 + w) in float32, rounded once; else Llama's
  bool gelu;        // GELU (tanh approximation) gates the MLP; else SiLU
};

// One step's decode rows: M sequences, one new token each.
struct DecodeStep {
  int64_t rows;                // M
  const int64_t* positions;    // [M]
  const int64_t* slots;        // [M] flat KV slot of each new token
  const int32_t* block_tables; // [M, table_stride]
  int64_t table_stride;
  const int32_t* seq_lens;     // [M], the new token included
  int64_t block_size;
};

}  // namespace ps
