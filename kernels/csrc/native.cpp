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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto isa = py::arg("isa") = "";
  m.def("cpu_isa", [](const std::string& requested) { return std::string(kIsaNames[static_cast<int>(pick_isa(requested))]); },
        "the instruction set the kernels run with (\"\": best available, capped by PAGEDSERVE_CPU_ISA)",
        py::arg("requested") = "");
  m.def("detected_isa", [] { return std::string(kIsaNames[static_cast<int>(detected_isa())]); },
        "the best instruction set of this CPU, ignoring PAGEDSERVE_CPU_ISA");

  m.def("bf16_linear_few_rows",
        [](Tensor x, Tensor w, c10::optional<Tensor> b, const std::string& isa) {
          return PS_CALL(isa, gemv::bf16_linear_few_rows, x, w, b);
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
}
