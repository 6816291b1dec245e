// Fused decode layers of the Llama family for CPU: a step's decode rows (one new token per
// sequence) through whole decoder layers in one call, without a torch op inside:
//
//   residual += h; x = RMSNorm(residual)            (the first layer: residual = h)
//   qkv = x W_qkv^T (+ b); RoPE on q and k; k, v written to the paged cache at each row's slot
//   a = paged decode attention (decode::decode_kernel, the same kernel the backend calls)
//   residual += a W_o^T (+ b); x = RMSNorm(residual)
//   h = (silu(x W_gate^T) * x W_up^T) W_down^T     (biases where the checkpoint has them)
//
// Activations stay float32 between the ops; with a bfloat16 model every result is rounded to
// bf16 where the torch layers round it (each linear's output, the residual adds, the norm before
// and after its weight, RoPE's products and sums, SiLU and its product), so the values follow the
// unfused path's up to summation order. The linears are proj_gemv.h's GEMVs, in the format of
// each projection's weight (float32 / bf16, int8, int4); the small elementwise steps run on one
// thread. Included by native.cpp once per instruction set, after paged_decode_attention.h and
// proj_gemv.h.
// out [M, n] = RMSNorm(r) * weight as HF's LlamaRMSNorm rounds it: normalised in float32, cast
// to T, then times the weight in T.
template <typename T>
static void rms_norm_rows(const float* r, const T* w, int64_t M, int64_t n, float eps, float* out) {
  for (int64_t m = 0; m < M; ++m) {
    const float* x = r + m * n;
    vec::F s = vec::zero();
    int64_t i = 0;
    for (; i + vec::W <= n; i += vec::W) s = vec::fma(vec::load(x + i), vec::load(x + i), s);
    float ss = vec::reduce_add(s);
    for (; i < n; ++i) ss += x[i] * x[i];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
    for (i = 0; i < n; ++i) out[m * n + i] = round_as<T>(round_as<T>(x[i] * inv) * widen(w[i]));
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
  if (first) std::memcpy(residual, h, M * E * sizeof(float));
  else add_residual<T>(residual, h, M * E);
  rms_norm_rows(residual, static_cast<const T*>(L.input_norm), M, E, d.eps, b.x.data());
  project<T>(L.qkv, b.x.data(), M, E, QKV, b.qkv.data());
  for (int64_t m = 0; m < M; ++m) {
    float* row = b.qkv.data() + m * QKV;
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
                           s.block_size, s.table_stride, L.scale);
  for (int64_t i = 0; i < M * H * D; ++i) b.attn[i] = widen(b.attn_t[i]);
  project<T>(L.o, b.attn.data(), M, H * D, E, b.o.data());
  add_residual<T>(residual, b.o.data(), M * E);
  rms_norm_rows(residual, static_cast<const T*>(L.post_norm), M, E, d.eps, b.x.data());
  project<T>(L.gate_up, b.x.data(), M, E, 2 * I, b.gate_up.data());
  for (int64_t m = 0; m < M; ++m) {
    const float* g = b.gate_up.data() + m * 2 * I;
    for (int64_t i = 0; i < I; ++i) {
      const float silu = round_as<T>(g[i] / (1.f + std::exp(-g[i])));
      b.act[m * I + i] = round_as<T>(silu * g[I + i]);
    }
  }
  project<T>(L.down, b.act.data(), M, I, E, h);
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
