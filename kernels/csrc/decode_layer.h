// Fused decode layers for CPU: a step's decode rows (one new token per sequence) through whole
// decoder layers in one call, without a torch op inside. The pre-norm layer (Llama):
//
//   residual += h; x = RMSNorm(residual)            (the first layer: residual = h)
//   qkv = x W_qkv^T (+ b); [q/k RMSNorm per head]; RoPE on q and k; k, v written to the paged
//     cache at each row's slot
//   a = paged decode attention (decode::decode_kernel, the same kernel the backend calls; a
//     sliding window and soft-capped scores where the layer has them)
//   residual += a W_o^T (+ b); x = RMSNorm(residual)
//   h = (act(x W_gate^T) * x W_up^T) W_down^T       (SiLU or GELU-tanh; biases where present)
//
// Gemma's sandwich layer norms the attention output before its add and the MLP's output after
// it (DecodeLayerWeights), with Gemma's RMSNorm.
//
// Activations stay float32 between the ops; with a bfloat16 model every result is rounded to
// bf16 where the torch layers round it (each linear's output, the residual adds, the norm before
// and after its weight, RoPE's products and sums, SiLU and its product), so the values follow the
// unfused path's up to summation order. The linears are proj_gemv.h's GEMVs, in the format of
// each projection's weight (float32 / bf16, int8, int4); the small elementwise steps run on one
// thread. Included by native.cpp once per instruction set, after paged_decode_attention.h and
// proj_gemv.h.
// out [M, n] = RMSNorm of each row of r (out may be r): HF's LlamaRMSNorm (normalised in float32,
// cast to T, then times the weight in T) or, `gemma`, Gemma's ((x / rms) * (1 + w) in float32 with
// a float32 weight, cast to T once).
template <typename T>
static void norm_rows(const float* r, const void* w, int64_t M, int64_t n, float eps, bool gemma, float* out) {
  for (int64_t m = 0; m < M; ++m) {
    const float* x = r + m * n;
    vec::F s = vec::zero();
    int64_t i = 0;
    for (; i + vec::W <= n; i += vec::W) s = vec::fma(vec::load(x + i), vec::load(x + i), s);
    float ss = vec::reduce_add(s);
    for (; i < n; ++i) ss += x[i] * x[i];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
    if (gemma) {
      const float* wf = static_cast<const float*>(w);
      for (i = 0; i < n; ++i) out[m * n + i] = round_as<T>(x[i] * inv * (1.f + wf[i]));
    } else {
      const T* wt = static_cast<const T*>(w);
      for (i = 0; i < n; ++i) out[m * n + i] = round_as<T>(round_as<T>(x[i] * inv) * widen(wt[i]));
    }
  }
}

// act(gate) * up for each row of gate_up [M, 2 I] into act [M, I], rounded as torch rounds:
// SiLU or GELU with the tanh approximation (torch's formula), each result and the product in T.
template <typename T>
static void gated_act(const float* gate_up, int64_t M, int64_t I, bool gelu, float* act) {
  constexpr float kBeta = 0.7978845608028654f;  // sqrt(2 / pi)
  for (int64_t m = 0; m < M; ++m) {
    const float* g = gate_up + m * 2 * I;
    for (int64_t i = 0; i < I; ++i) {
      const float x = g[i];
      const float a = gelu ? 0.5f * x * (1.f + std::tanh(kBeta * (x + 0.044715f * (x * x * x))))
                           : x / (1.f + std::exp(-x));
      act[m * I + i] = round_as<T>(round_as<T>(a) * g[I + i]);
    }
  }
}

// residual += x, rounded to T.
template <typename T>
static inline void add_residual(float* residual, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) residual[i] = round_as<T>(residual[i] + x[i]);
}

// Rotate-half RoPE in place on `heads` heads of D values at x, for position `pos`.
template <typename T>
static void rope_row(float* x, int64_t heads, int64_t D, const T* cos, const T* sin, int64_t pos) {
  const int64_t half = D / 2;
  const T* c = cos + pos * half;
  const T* s = sin + pos * half;
  for (int64_t h = 0; h < heads; ++h) {
    float* v = x + h * D;
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = v[i], x2 = v[i + half], ci = widen(c[i]), si = widen(s[i]);
      v[i] = round_as<T>(round_as<T>(x1 * ci) - round_as<T>(x2 * si));
      v[i + half] = round_as<T>(round_as<T>(x2 * ci) + round_as<T>(x1 * si));
    }
  }
}

// Per-call buffers, float32 unless T.
template <typename T>
struct Scratch {
  std::vector<float> x, qkv, attn, o, gate_up, act;
  std::vector<T> q, attn_t;
  Scratch(const ps::DecodeLayerDims& d, int64_t M)
      : x(M * d.hidden),
        qkv(M * (d.heads + 2 * d.kv_heads) * d.head_dim),
        attn(M * d.heads * d.head_dim),
        o(M * d.hidden),
        gate_up(M * 2 * d.intermediate),
        act(M * d.intermediate),
        q(M * d.heads * d.head_dim),
        attn_t(M * d.heads * d.head_dim) {}
};

// One layer: h [M, hidden] (this layer's input, then its output) and residual [M, hidden] float32.
template <typename T>
static void layer_forward(const ps::DecodeLayerWeights& L, const ps::DecodeLayerDims& d, const ps::DecodeStep& s,
                          T* kc, T* vc, float* h, float* residual, bool first, Scratch<T>& b) {
  const int64_t M = s.rows, E = d.hidden, H = d.heads, KVH = d.kv_heads, D = d.head_dim, I = d.intermediate;
  const int64_t QKV = (H + 2 * KVH) * D;
  const bool sandwich = L.pre_ff_norm != nullptr;
  if (first) std::memcpy(residual, h, M * E * sizeof(float));
  else add_residual<T>(residual, h, M * E);
  norm_rows<T>(residual, L.input_norm, M, E, d.eps, d.gemma_norm, b.x.data());
  project<T>(L.qkv, b.x.data(), M, E, QKV, b.qkv.data());
  for (int64_t m = 0; m < M; ++m) {
    float* row = b.qkv.data() + m * QKV;
    if (L.q_norm != nullptr) {  // per head, before RoPE
      norm_rows<T>(row, L.q_norm, H, D, d.eps, d.gemma_norm, row);
      norm_rows<T>(row + H * D, L.k_norm, KVH, D, d.eps, d.gemma_norm, row + H * D);
    }
    rope_row(row, H + KVH, D, static_cast<const T*>(L.rope_cos), static_cast<const T*>(L.rope_sin), s.positions[m]);
    for (int64_t i = 0; i < H * D; ++i) store_as(&b.q[m * H * D + i], row[i]);
    T* kdst = kc + s.slots[m] * KVH * D;
    T* vdst = vc + s.slots[m] * KVH * D;
    for (int64_t i = 0; i < KVH * D; ++i) {
      store_as(kdst + i, row[H * D + i]);
      store_as(vdst + i, row[(H + KVH) * D + i]);
    }
  }
  decode::decode_kernel<T>(b.q.data(), kc, vc, s.block_tables, s.seq_lens, b.attn_t.data(), M, H, KVH, D,
                           s.block_size, s.table_stride, L.scale, L.window, L.softcap);
  for (int64_t i = 0; i < M * H * D; ++i) b.attn[i] = widen(b.attn_t[i]);
  project<T>(L.o, b.attn.data(), M, H * D, E, b.o.data());
  if (sandwich) norm_rows<T>(b.o.data(), L.post_norm, M, E, d.eps, d.gemma_norm, b.o.data());
  add_residual<T>(residual, b.o.data(), M * E);
  norm_rows<T>(residual, sandwich ? L.pre_ff_norm : L.post_norm, M, E, d.eps, d.gemma_norm, b.x.data());
  project<T>(L.gate_up, b.x.data(), M, E, 2 * I, b.gate_up.data());
  gated_act<T>(b.gate_up.data(), M, I, d.gelu, b.act.data());
  project<T>(L.down, b.act.data(), M, I, E, h);
  if (sandwich) norm_rows<T>(h, L.post_ff_norm, M, E, d.eps, d.gemma_norm, h);
}

template <typename T>
static void run_layers(const std::vector<ps::DecodeLayerWeights>& layers, const ps::DecodeLayerDims& d,
                       const ps::DecodeStep& s, const std::vector<void*>& k_caches,
                       const std::vector<void*>& v_caches, float* h, float* residual, bool first) {
  Scratch<T> b(d, s.rows);
  for (size_t i = 0; i < layers.size(); ++i) {
    layer_forward<T>(layers[i], d, s, static_cast<T*>(k_caches[i]), static_cast<T*>(v_caches[i]), h, residual,
                     first && i == 0, b);
  }
}

// Layers layers[0..n) in order on the step's decode rows; h and residual [M, hidden] float32 in
// place (first: no residual yet, the stack's first layer: residual = h).
void decode_layers(const std::vector<ps::DecodeLayerWeights>& layers, const ps::DecodeLayerDims& d,
                   const ps::DecodeStep& s, const std::vector<void*>& k_caches, const std::vector<void*>& v_caches,
                   float* h, float* residual, bool first) {
  if (d.bf16) run_layers<bf16>(layers, d, s, k_caches, v_caches, h, residual, first);
  else run_layers<float>(layers, d, s, k_caches, v_caches, h, residual, first);
}
