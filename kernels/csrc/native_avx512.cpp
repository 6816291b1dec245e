// The AVX-512 regions of the native extension (see native.cpp), a translation unit of their own
// so that a 2-core build compiles them beside native.cpp.
#include "native_prelude.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c,bmi2")
namespace ps_avx512bf16 {
#define PS_VEC_WIDTH 16
#define PS_HAS_BF16_DOT 1
#include "vec.h"
namespace decode {
#include "paged_decode_attention.h"
}
#undef PS_HAS_BF16_DOT
#undef PS_VEC_WIDTH
}  // namespace ps_avx512bf16
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi2")
namespace ps_avx512 {
#define PS_VEC_WIDTH 16
#define PS_HAS_BF16_DOT 0
#include "vec.h"
#include "all_kernels.h"
#undef PS_HAS_BF16_DOT
#undef PS_VEC_WIDTH
}  // namespace ps_avx512
#pragma GCC pop_options
