// The kernel headers of one instruction-set region, each in its own namespace (no include
// guard: native.cpp and native_avx512.cpp include it once per region, after vec.h).
namespace int4 {
#include "int4_dequant.h"
#include "int4_gemv.h"
}
namespace int8io {
#include "int8_mm_io.h"
}
namespace fused {
#include "fused_ops.h"
}
namespace decode {
#include "paged_decode_attention.h"
}
namespace layer {
#include "proj_gemv.h"
#include "decode_layer.h"
}
