// The fused decode layer's arguments (kernels/csrc/decode_layer.h), as raw pointers: the same
// structs for every instruction-set region, so they are defined once, outside the regions.
#pragma once
#include <cstdint>

namespace ps {

// One Llama-family decoder layer (pre-norm, RMSNorm, SiLU-gated MLP): weights in the model dtype
// (float32 or bfloat16), nn.Linear's [out, in] row-major layout; biases may be null.
struct DecodeLayerWeights {
  const void* input_norm;     // [hidden]
  const void* post_norm;      // [hidden]
  const void* qkv;            // [(H + 2 KVH) D, hidden], rows q | k | v
  const void* qkv_bias;       // [(H + 2 KVH) D] or null
  const void* o;              // [hidden, H D]
  const void* o_bias;         // [hidden] or null
  const void* gate_up;        // [2 I, hidden], rows gate | up
  const void* gate_up_bias;   // [2 I] or null
  const void* down;           // [hidden, I]
  const void* down_bias;      // [hidden] or null
  const void* rope_cos;       // [max_len, D / 2]
  const void* rope_sin;       // [max_len, D / 2]
  float scale;                // attention score scale
};

// Shapes shared by the layers of one model.
struct DecodeLayerDims {
  int64_t hidden, heads, kv_heads, head_dim, intermediate;
  float eps;
  bool bf16;  // else float32
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
