// Vectors of 16 floats as GCC's vector extensions, shared by the kernels (sdsat/native.py compiles the sources as
// one unit, this first): the same source compiles for AVX-512, AVX2 or NEON.
#include <torch/extension.h>
#include <cstring>

namespace {

typedef float v16f __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
constexpr int L = 16;  // floats per vector

static inline v16f load(const float* p) { v16f x; std::memcpy(&x, p, sizeof x); return x; }
static inline v16f load(const at::BFloat16* p) {  // bfloat16 is float's upper half
  v16h h; std::memcpy(&h, p, sizeof h);
  return (v16f)(__builtin_convertvector(h, v16u) << 16);
}
static inline void store(float* p, v16f x) { std::memcpy(p, &x, sizeof x); }
static inline void store(at::BFloat16* p, v16f x) {  // rounded to nearest even, as c10's conversion; NaN stays NaN
  const v16u u = (v16u)x;
  v16u r = (u + (((u >> 16) & 1) + 0x7fff)) >> 16;
  r = x != x ? (v16u){} + 0x7fc0 : r;
  const v16h h = __builtin_convertvector(r, v16h);
  std::memcpy(p, &h, sizeof h);
}

static inline float hsum(v16f x) {  // one fixed order of additions
  v8f a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
  v4f b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

}  // namespace
