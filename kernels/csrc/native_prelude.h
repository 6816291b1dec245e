// What every translation unit of the native extension includes first, outside any target
// region: torch, the intrinsics and the standard headers the kernel headers use.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

#include "decode_layer_api.h"
