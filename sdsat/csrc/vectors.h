// Vectors as GCC's vector extensions, shared by the kernels (sdsat/native.py compiles the sources as one unit, this
// first): the same source compiles for AVX-512, AVX2 or NEON.
#include <torch/extension.h>
#include <cstring>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

// Vectors of the vector unit's own width (lf: 8 floats with AVX2, 16 with AVX-512), not wider: wider ones are split
// into halves, their integer steps into scalars, and a kernel's sums no longer fit in its registers.
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
static inline void storev(at::BFloat16* p, lf x) {  // rounded to nearest even, as c10's conversion; NaN stays NaN
  const lu u = (lu)x;
  lu r = (u + (((u >> 16) & 1) + 0x7fff)) >> 16;
  r = x != x ? lu{} + 0x7fc0 : r;
  const lh h = __builtin_convertvector(r, lh);
  std::memcpy(p, &h, sizeof h);
}
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
