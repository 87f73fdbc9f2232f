// Vectors as GCC's vector extensions, shared by the kernels (sdsat/native.py compiles the sources as one unit, this
// first): the same source compiles for AVX-512, AVX2 or NEON. v16f: 16 floats whatever the CPU; lf: the vector unit's
// own width.
#include <torch/extension.h>
#include <cstring>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

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

// Vectors of the vector unit's own width (lf: 8 floats with AVX2, 16 with AVX-512): where a kernel's speed depends
// on its values staying in registers, and integer work must not be split into scalar steps.
#if defined(__AVX512F__)
constexpr int LW = 16;  // floats per vector: one register of the widest vector unit compiled for
#else
constexpr int LW = 8;
#endif
typedef float lf __attribute__((vector_size(LW * 4)));
typedef uint32_t lu __attribute__((vector_size(LW * 4)));
typedef uint16_t lh __attribute__((vector_size(LW * 2)));
typedef int32_t li __attribute__((vector_size(LW * 4)));
static inline lf loadv(const float* p) { lf x; std::memcpy(&x, p, sizeof x); return x; }
static inline void storev(float* p, lf x) { std::memcpy(p, &x, sizeof x); }
static inline lf loadv(const at::BFloat16* p) {  // bfloat16 is float's upper half
  lh h; std::memcpy(&h, p, sizeof h);
  return (lf)(__builtin_convertvector(h, lu) << 16);
}

// a * b + c: one rounding where the CPU has fused multiply-adds, always in the same places (a compiler left to
// contract `acc += w * x` itself may fuse it in one shape of tile and not in another)
static inline lf fmadd(lf a, lf b, lf c) {
#if defined(__AVX512F__)
  return (lf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
  return (lf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}

static inline float lane_sum(lf x) {  // one fixed order of additions
  float t[LW];
  std::memcpy(t, &x, sizeof x);
  for (int w = LW / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) t[l] += t[l + w];
  return t[0];
}

}  // namespace
