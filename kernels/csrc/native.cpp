// The native CPU extension of pagedserve: every C++ kernel in one module, built once for the
// portable x86-64 baseline (no -march=native) and dispatched at run time on the CPU's features.
//
// Each kernel file is included once per instruction set, inside that set's namespace and a
// `#pragma GCC target` region (per-function target attributes for every function defined there),
// with vec.h's vector width set for it: the kernels are written once, against vec.h.
//
//   ps_avx512bf16  AVX-512F/BW/VL/DQ + AVX512-BF16 (Intel Sapphire Rapids+, AMD Zen 4+): only the
//                  decode attention differs (bf16 dot products for the scores)
//   ps_avx512      AVX-512F/BW/VL/DQ, 16-float vectors
//   ps_avx2        AVX2 + FMA + F16C (Intel Haswell+, AMD Zen 1-3), 8-float vectors
//   ps_scalar      the baseline, plain C++
//
// Every op takes a last argument `isa` ("" = the best this CPU has, capped by the environment
// variable PAGEDSERVE_CPU_ISA; or "avx512_bf16", "avx512", "avx2", "scalar" to force one, which
// the tests use to compare the paths on one machine). `cpu_isa()` names what "" picks.
#include "native_prelude.h"
#include "native_api.h"

// ---- ISA regions -------------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi2")
namespace ps_avx2 {
#define PS_VEC_WIDTH 8
#define PS_HAS_BF16_DOT 0
#include "vec.h"
#include "all_kernels.h"
#undef PS_HAS_BF16_DOT
#undef PS_VEC_WIDTH
}  // namespace ps_avx2
#pragma GCC pop_options

namespace ps_scalar {
#define PS_VEC_WIDTH 1
#define PS_HAS_BF16_DOT 0
#include "vec.h"
#include "all_kernels.h"
#undef PS_HAS_BF16_DOT
#undef PS_VEC_WIDTH
}  // namespace ps_scalar

// The AVX-512 regions are in native_avx512.cpp.
PS_DECLARE_OPS(ps_avx512)
PS_DECLARE_DECODE_OPS(ps_avx512bf16)

// ---- run-time dispatch -------------------------------------------------------------------------
namespace {

enum class Isa { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };
constexpr const char* kIsaNames[] = {"scalar", "avx2", "avx512", "avx512_bf16"};

// The best level this CPU (and OS: libgcc checks the saved register state) runs.
Isa detected_isa() {
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (avx512 && __builtin_cpu_supports("avx512bf16")) return Isa::kAvx512Bf16;
  if (avx512) return Isa::kAvx512;
  return avx2 ? Isa::kAvx2 : Isa::kScalar;
}

Isa parse_isa(const std::string& name, const char* where) {
  for (int i = 0; i < 4; ++i)
    if (name == kIsaNames[i]) return static_cast<Isa>(i);
  TORCH_CHECK(false, where, " must be one of scalar, avx2, avx512, avx512_bf16; got '", name, "'");
}

// `requested` "" = the detected level capped by PAGEDSERVE_CPU_ISA; a name forces that level,
// which this CPU must have.
Isa pick_isa(const std::string& requested) {
  const Isa cpu = detected_isa();
  if (requested.empty()) {
    const char* cap = std::getenv("PAGEDSERVE_CPU_ISA");
    if (cap == nullptr || *cap == '\0') return cpu;
    return std::min(cpu, parse_isa(cap, "PAGEDSERVE_CPU_ISA"));
  }
  const Isa want = parse_isa(requested, "isa");
  TORCH_CHECK(want <= cpu, "isa '", requested, "' is not available on this CPU (best: ", kIsaNames[static_cast<int>(cpu)], ")");
  return want;
}

}  // namespace

// One call of `fn` (a path inside the ISA namespaces) in the picked region; ops that have no
// AVX512-BF16 variant run the AVX-512 one there.
#define PS_CALL(isa, fn, ...)                                                     \
  [&] {                                                                            \
    switch (pick_isa(isa)) {                                                       \
      case Isa::kAvx512Bf16:                                                       \
      case Isa::kAvx512: return ps_avx512::fn(__VA_ARGS__);                        \
      case Isa::kAvx2: return ps_avx2::fn(__VA_ARGS__);                            \
      default: return ps_scalar::fn(__VA_ARGS__);                                  \
    }                                                                              \
  }()
#define PS_CALL_BF16(isa, fn, ...)                                                \
  [&] {                                                                            \
    if (pick_isa(isa) == Isa::kAvx512Bf16) return ps_avx512bf16::fn(__VA_ARGS__);  \
    return PS_CALL(isa, fn, __VA_ARGS__);                                          \
  }()

using torch::Tensor;
namespace py = pybind11;

// ---- fused decode layers (decode_layer.h) --------------------------------------------------------
// A projection as Python hands it over: (kind, weight, bias, scale, shift, group_size, block_n),
// kind 0 plain / 1 int8 / 2 int4 (ps::ProjKind); absent entries None.
using ProjArg = std::tuple<int64_t, Tensor, c10::optional<Tensor>, c10::optional<Tensor>, c10::optional<Tensor>,
                           int64_t, int64_t>;

// Per layer: (attention score scale, sliding window or 0, soft cap or 0).
using LayerParams = std::tuple<double, int64_t, double>;

// One model's layers for the fused decode path (decode_layer.h): the weights (kept alive here) of
// the layers that take it, and a forward that runs a step's decode rows through layers
// [first, last) in one call. Per layer: `tables` = input norm, post-attention norm, pre- and
// post-feedforward norms (Gemma's sandwich, else None), q and k norms (per head, else None), RoPE
// cos, RoPE sin; `projs` = qkv, o, gate_up, down; `params` = LayerParams.
class DecodeStack {
 public:
  DecodeStack(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate, double eps,
              bool gemma_norm, bool gelu, const std::vector<std::vector<c10::optional<Tensor>>>& tables,
              const std::vector<std::vector<ProjArg>>& projs, const std::vector<LayerParams>& params) {
    TORCH_CHECK(!tables.empty() && tables.size() == params.size() && projs.size() == params.size(),
                "tables, projections and parameters per layer, at least one layer");
    TORCH_CHECK(head_dim % 2 == 0 && heads % kv_heads == 0, "head_dim must be even, heads a multiple of kv_heads");
    TORCH_CHECK(tables[0].size() == 8 && tables[0][6].has_value(), "8 tables per layer, RoPE cos at 6");
    const auto dtype = tables[0][6]->scalar_type();
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "weights must be float32 or bfloat16");
    dims_ = {hidden, heads, kv_heads, head_dim, intermediate, static_cast<float>(eps), dtype == at::kBFloat16,
             gemma_norm, gelu};
    dtype_ = dtype;
    const auto norm_dtype = gemma_norm ? at::kFloat : dtype;
    // (out, in) of qkv, o, gate_up, down
    const std::array<std::pair<int64_t, int64_t>, 4> shapes = {
        {{(heads + 2 * kv_heads) * head_dim, hidden}, {hidden, heads * head_dim}, {2 * intermediate, hidden},
         {hidden, intermediate}}};
    for (size_t l = 0; l < tables.size(); ++l) {
      TORCH_CHECK(tables[l].size() == 8 && projs[l].size() == 4, "layer ", l, ": 8 tables and 4 projections");
      const void* t[8];
      for (int i = 0; i < 8; ++i) {
        const auto& x = tables[l][i];
        const bool optional = i >= 2 && i < 6;
        if (!x.has_value()) {
          TORCH_CHECK(optional, "layer ", l, ": table ", i, " is required");
          t[i] = nullptr;
          continue;
        }
        const int64_t n = i < 4 ? hidden : head_dim;
        const bool fits = i < 6 ? x->dim() == 1 && x->size(0) == n : x->dim() == 2 && x->size(1) == head_dim / 2;
        TORCH_CHECK(fits && x->scalar_type() == (i < 6 ? norm_dtype : dtype) && x->is_contiguous() &&
                        x->device().is_cpu(), "layer ", l, ": table ", i,
                    " must be a contiguous CPU tensor of its dtype (norms: float32 for Gemma) and shape");
        t[i] = keep(*x);
      }
      TORCH_CHECK((t[2] == nullptr) == (t[3] == nullptr) && (t[4] == nullptr) == (t[5] == nullptr), "layer ", l,
                  ": the feedforward norms and the q/k norms come in pairs");
      ps::Proj p[4];
      for (int i = 0; i < 4; ++i) p[i] = proj(projs[l][i], shapes[i].first, shapes[i].second, l, i);
      const auto& [scale, window, softcap] = params[l];
      TORCH_CHECK(window >= 0 && softcap >= 0, "layer ", l, ": window and softcap must be >= 0");
      layers_.push_back({t[0], t[1], t[2], t[3], t[4], t[5], p[0], p[1], p[2], p[3], t[6], t[7],
                         static_cast<float>(scale), window, static_cast<float>(softcap)});
      max_positions_.push_back(tables[l][6]->size(0));
    }
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // Returns (h, residual) after layers [first, last); kv_caches: those layers' caches
  // [2, blocks, block_size, kv_heads, head_dim]; residual None before the model's first layer.
  std::vector<Tensor> forward(int64_t first, int64_t last, const Tensor& h, const c10::optional<Tensor>& residual,
                              const std::vector<Tensor>& kv_caches, const Tensor& positions, const Tensor& slots,
                              const Tensor& block_tables, const Tensor& seq_lens, const std::string& isa) const {
    TORCH_CHECK(0 <= first && first < last && last <= num_layers(), "layers [first, last) out of range");
    TORCH_CHECK(static_cast<int64_t>(kv_caches.size()) == last - first, "one KV cache per layer run");
    const int64_t E = dims_.hidden;
    TORCH_CHECK(h.dim() == 2 && h.size(1) == E && h.is_contiguous() && h.scalar_type() == dtype_,
                "h must be contiguous [rows, hidden] of the model dtype");
    const int64_t M = h.size(0);
    TORCH_CHECK(!residual.has_value() || (residual->sizes() == h.sizes() && residual->is_contiguous() &&
                                          residual->scalar_type() == dtype_),
                "residual must match h");
    TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == M,
                "positions must be int64 [rows]");
    TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == M,
                "slots must be int64 [rows]");
    TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.stride(1) == 1 &&
                block_tables.size(0) >= M, "block_tables must be int32 [>= rows, blocks] with contiguous rows");
    TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() && seq_lens.numel() >= M,
                "seq_lens must be int32 [>= rows]");
    std::vector<void*> kp, vp;
    int64_t block_size = 0, slots_total = 0;
    for (const auto& kv : kv_caches) {
      TORCH_CHECK(kv.dim() == 5 && kv.size(0) == 2 && kv.size(3) == dims_.kv_heads && kv.size(4) == dims_.head_dim &&
                  kv.is_contiguous() && kv.scalar_type() == dtype_, "kv cache must be contiguous [2, blocks, "
                  "block_size, kv_heads, head_dim] of the model dtype");
      TORCH_CHECK(block_size == 0 || kv.size(2) == block_size, "the layers' block sizes differ");
      block_size = kv.size(2);
      slots_total = kv.size(1) * block_size;
      char* base = static_cast<char*>(kv.data_ptr());
      kp.push_back(base);
      vp.push_back(base + kv.stride(0) * kv.element_size());
    }
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t* sl = slots.data_ptr<int64_t>();
    const int32_t* lens = seq_lens.data_ptr<int32_t>();
    for (int64_t m = 0; m < M; ++m) {
      TORCH_CHECK(0 <= sl[m] && sl[m] < slots_total, "slot out of the KV cache");
      TORCH_CHECK(lens[m] >= 1 && lens[m] <= block_tables.size(1) * block_size, "seq_len does not fit its block table");
      for (int64_t l = first; l < last; ++l)
        TORCH_CHECK(0 <= pos[m] && pos[m] < max_positions_[l], "position past the RoPE table");
    }
    const ps::DecodeStep step{M, pos, sl, block_tables.data_ptr<int32_t>(), block_tables.stride(0), lens, block_size};
    std::vector<float> hf(M * E), rf(M * E);
    to_float(h, hf.data());
    if (residual.has_value()) to_float(*residual, rf.data());
    const std::vector<ps::DecodeLayerWeights> run(layers_.begin() + first, layers_.begin() + last);
    PS_CALL(isa, layer::decode_layers, run, dims_, step, kp, vp, hf.data(), rf.data(), !residual.has_value());
    return {from_float(hf.data(), h), from_float(rf.data(), h)};
  }

 private:
  static void to_float(const Tensor& t, float* dst) {
    if (t.scalar_type() == at::kFloat) {
      std::memcpy(dst, t.data_ptr<float>(), t.numel() * sizeof(float));
      return;
    }
    const at::BFloat16* src = t.data_ptr<at::BFloat16>();
    for (int64_t i = 0; i < t.numel(); ++i) dst[i] = static_cast<float>(src[i]);
  }
  static Tensor from_float(const float* src, const Tensor& like) {
    Tensor out = torch::empty(like.sizes(), like.options());
    if (out.scalar_type() == at::kFloat) {
      std::memcpy(out.data_ptr<float>(), src, out.numel() * sizeof(float));
    } else {
      at::BFloat16* dst = out.data_ptr<at::BFloat16>();
      for (int64_t i = 0; i < out.numel(); ++i) dst[i] = at::BFloat16(src[i]);
    }
    return out;
  }

  const void* keep(const Tensor& t) {
    keep_.push_back(t);
    return t.data_ptr();
  }

  // Checks one projection's tensors against its kind and shape [N, K]; keeps them alive.
  ps::Proj proj(const ProjArg& a, int64_t N, int64_t K, size_t l, int i) {
    const auto& [kind, w, bias, scale, shift, group_size, block_n] = a;
    auto check = [&](const Tensor& t, at::ScalarType type, std::vector<int64_t> shape, const char* what) {
      TORCH_CHECK(t.scalar_type() == type && t.is_contiguous() && t.device().is_cpu() && t.sizes() == shape, "layer ",
                  l, ", projection ", i, ": ", what, " must be a contiguous CPU tensor of the expected dtype and shape");
      return keep(t);
    };
    ps::Proj p{static_cast<ps::ProjKind>(kind), nullptr, nullptr, nullptr, nullptr, group_size, block_n};
    if (bias.has_value()) p.bias = check(*bias, dtype_, {N}, "bias");
    switch (kind) {
      case 0: p.w = check(w, dtype_, {N, K}, "weight"); break;
      case 1:
        p.w = check(w, at::kChar, {N, K}, "int8 weight");
        TORCH_CHECK(scale.has_value(), "layer ", l, ", projection ", i, ": int8 needs a scale");
        p.scale = check(*scale, dtype_, {N}, "int8 scale");
        break;
      case 2: {
        TORCH_CHECK((block_n == 32 || block_n == 64) && N % block_n == 0 && group_size > 0 && K % group_size == 0,
                    "layer ", l, ", projection ", i, ": int4 block_n must be 32 or 64 dividing N, group_size dividing K");
        p.w = check(w, at::kByte, {N, K / 2}, "int4 packed weight");
        TORCH_CHECK(scale.has_value() && shift.has_value(), "layer ", l, ", projection ", i, ": int4 needs scale and shift");
        p.scale = check(*scale, at::kFloat, {K / group_size, N}, "int4 scale");
        p.shift = static_cast<const float*>(check(*shift, at::kFloat, {K / group_size, N}, "int4 shift"));
        break;
      }
      default: TORCH_CHECK(false, "layer ", l, ", projection ", i, ": kind must be 0 (plain), 1 (int8) or 2 (int4)");
    }
    return p;
  }

  ps::DecodeLayerDims dims_{};
  at::ScalarType dtype_ = at::kFloat;
  std::vector<ps::DecodeLayerWeights> layers_;
  std::vector<int64_t> max_positions_;
  std::vector<Tensor> keep_;
};


PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto isa = py::arg("isa") = "";
  m.def("cpu_isa", [](const std::string& requested) { return std::string(kIsaNames[static_cast<int>(pick_isa(requested))]); },
        "the instruction set the kernels run with (\"\": best available, capped by PAGEDSERVE_CPU_ISA)",
        py::arg("requested") = "");
  m.def("detected_isa", [] { return std::string(kIsaNames[static_cast<int>(detected_isa())]); },
        "the best instruction set of this CPU, ignoring PAGEDSERVE_CPU_ISA");

  m.def("bf16_linear_few_rows",
        [](Tensor x, Tensor w, c10::optional<Tensor> b, const std::string& isa) {
          return PS_CALL(isa, layer::bf16_linear_few_rows, x, w, b);
        },
        "bf16 linear for a few rows, float32 accumulation", py::arg("x"), py::arg("weight"), py::arg("bias"), isa);
  m.def("int4pack_dequant_t",
        [](Tensor p, Tensor s, Tensor h, int64_t g, int64_t bn, const std::string& isa) {
          return PS_CALL(isa, int4::int4pack_dequant_t, p, s, h, g, bn);
        },
        "int4 CPU packed layout -> float32 W^T [K, N]", py::arg("packed"), py::arg("scale"), py::arg("shift"),
        py::arg("group_size"), py::arg("block_n"), isa);
  m.def("int4pack_dequant_t_into",
        [](Tensor p, Tensor s, Tensor h, int64_t g, int64_t bn, int64_t b, int64_t e, Tensor out,
           const std::string& isa) { PS_CALL(isa, int4::int4pack_dequant_t_into, p, s, h, g, bn, b, e, out); },
        "columns [n_begin, n_end) of W^T into out", py::arg("packed"), py::arg("scale"), py::arg("shift"),
        py::arg("group_size"), py::arg("block_n"), py::arg("n_begin"), py::arg("n_end"), py::arg("out"), isa);
  m.def("int4pack_gemv",
        [](Tensor x, Tensor p, Tensor s, Tensor h, int64_t g, int64_t bn, const std::string& isa) {
          return PS_CALL(isa, int4::int4pack_gemv, x, p, s, h, g, bn);
        },
        "float32 x [1-16, K] @ W^T for int4 W in the packed layout", py::arg("x"), py::arg("packed"),
        py::arg("scale"), py::arg("shift"), py::arg("group_size"), py::arg("block_n"), isa);
  m.def("int8_linear_few_rows",
        [](Tensor x, Tensor q, Tensor s, const std::string& isa) { return PS_CALL(isa, layer::int8_linear_few_rows, x, q, s); },
        "weight-only int8 linear for 1-16 rows", py::arg("x"), py::arg("qweight"), py::arg("scale"), isa);
  m.def("int8_quantize_rows",
        [](Tensor x, int64_t j, const std::string& isa) { return PS_CALL(isa, int8io::int8_quantize_rows, x, j); },
        "per-token int8 quantization with outlier channels kept apart", py::arg("x"), py::arg("outliers"), isa);
  m.def("int8_mm_epilogue",
        [](Tensor acc, Tensor xs, Tensor ws, Tensor xo, Tensor wo, bool bf16_out, const std::string& isa) {
          return PS_CALL(isa, int8io::int8_mm_epilogue, acc, xs, ws, xo, wo, bf16_out);
        },
        "int8 product epilogue: scales and outlier channels, one pass", py::arg("acc"), py::arg("x_scale"),
        py::arg("w_scale"), py::arg("x_out"), py::arg("w_out"), py::arg("bf16_out"), isa);
  m.def("rms_norm",
        [](Tensor x, Tensor w, double eps, int64_t vw, const std::string& isa) {
          return PS_CALL(isa, fused::rms_norm, x, w, eps, vw);
        },
        "HF RMSNorm", py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("vec_width"), isa);
  m.def("fused_add_rms_norm",
        [](Tensor x, Tensor r, Tensor w, double eps, int64_t vw, const std::string& isa) {
          return PS_CALL(isa, fused::fused_add_rms_norm, x, r, w, eps, vw);
        },
        "residual += x; RMSNorm(residual)", py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"),
        py::arg("vec_width"), isa);
  m.def("silu_and_mul",
        [](Tensor gu, int64_t vb, const std::string& isa) { return PS_CALL(isa, fused::silu_and_mul, gu, vb); },
        "silu(gate) * up", py::arg("gate_up"), py::arg("vec_bytes"), isa);
  m.def("rotary_embedding_",
        [](Tensor x, Tensor c, Tensor s, const std::string& isa) { PS_CALL(isa, fused::rotary_embedding_, x, c, s); },
        "rotate-half RoPE in place", py::arg("x"), py::arg("cos"), py::arg("sin"), isa);
  m.def("paged_decode_attention",
        [](Tensor q, Tensor k, Tensor v, Tensor t, Tensor l, double scale, const std::string& kvq,
           const std::string& isa) { return PS_CALL_BF16(isa, decode::paged_decode_attention, q, k, v, t, l, scale, kvq); },
        "paged decode attention", py::arg("query"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"),
        py::arg("seq_lens"), py::arg("scale"), py::arg("kv_quant"), isa);
  m.def("gather_dequantize",
        [](Tensor c, Tensor b, Tensor out, const std::string& kvq, const std::string& isa) {
          PS_CALL(isa, decode::gather_dequantize, c, b, out, kvq);
        },
        "one sequence's quantized K or V rows, de-quantized", py::arg("cache"), py::arg("blocks"), py::arg("out"),
        py::arg("kv_quant"), isa);

  py::class_<DecodeStack>(m, "DecodeStack", "fused decode layers of one model (decode_layer.h)")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, bool, bool,
                    const std::vector<std::vector<c10::optional<Tensor>>>&, const std::vector<std::vector<ProjArg>>&,
                    const std::vector<LayerParams>&>(),
           py::arg("hidden"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("intermediate"),
           py::arg("eps"), py::arg("gemma_norm"), py::arg("gelu"), py::arg("tables"), py::arg("projs"),
           py::arg("params"))
      .def_property_readonly("num_layers", &DecodeStack::num_layers)
      .def("forward", &DecodeStack::forward, "(h, residual) after layers [first, last) for the decode rows",
           py::arg("first"), py::arg("last"), py::arg("h"), py::arg("residual"), py::arg("kv_caches"),
           py::arg("positions"), py::arg("slots"), py::arg("block_tables"), py::arg("seq_lens"), isa);
}
