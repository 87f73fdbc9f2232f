// A row-invariant matrix product for the few rows of a decoding pass (sdsat/cpu_kernels.py, the "native" invariant
// backend): out = x W^T with every output's sum in one fixed order whatever the number of rows, and float32
// arithmetic on float32 or bfloat16 weights. Where oneDNN has no bfloat16 kernel (CPUs without AVX-512's bfloat16
// instructions), this reads bfloat16 weights, half float32's bytes, and multiplies in float32 with the vector unit
// the CPU has. Threads split the outputs, which changes no output's sum.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

// outputs by rows of a tile: its sums, weight vectors and an input vector in registers (AVX2 has 16, AVX-512 32);
// four rows, a draft pass's and a verify pass's usual count, in one tile
constexpr int OT = LW == 16 ? 4 : 3;
constexpr int MT = 4;
// bfloat16 weights are read 2 LW at a time: each 32-bit lane holds two, the even one in its low half and the odd one
// in its high half, so a shift and a mask make two float vectors of them (a widening per LW weights costs twice the
// vector unit's work). The input is laid out to match (`paired`): per block of 2 LW, its even entries, then its odd.
constexpr int BL = 2 * LW;
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "load_pair takes a lane's low half as its even entry");

static inline lf load_tail(const float* p, int64_t n) {  // n < LW floats, zeros after
  float t[LW] = {};
  std::memcpy(t, p, n * sizeof(float));
  return loadv(t);
}
static inline void load_pair(const at::BFloat16* p, lf& even, lf& odd) {
  lu u;
  std::memcpy(&u, p, sizeof u);
  even = (lf)(u << 16);
  odd = (lf)(u & 0xffff0000u);
}
static inline void load_pair_tail(const at::BFloat16* p, int64_t n, lf& even, lf& odd) {  // n < BL, zeros after
  at::BFloat16 t[BL] = {};
  std::memcpy(t, p, n * sizeof(at::BFloat16));
  load_pair(t, even, odd);
}

// acc[a][b] += even[a] x's even entries, then odd[a] its odd ones, for B rows of x (P apart) at one block
template <int A, int B>
__attribute__((always_inline)) inline void add_pairs(lf (&acc)[A][B], const lf (&even)[A], const lf (&odd)[A],
                                                     const float* x, int64_t P) {
  for (int b = 0; b < B; ++b) {
    const lf xv = loadv(x + b * P);
    for (int a = 0; a < A; ++a) acc[a][b] = fmadd(even[a], xv, acc[a][b]);
  }
  for (int b = 0; b < B; ++b) {
    const lf xv = loadv(x + b * P + LW);
    for (int a = 0; a < A; ++a) acc[a][b] = fmadd(odd[a], xv, acc[a][b]);
  }
}

// Outputs o0..o0+A of rows m0..m0+B: w's rows are `S` apart, x's `P` (zeros past I). Each sum runs over the input
// in vectors (the last one zero-padded), then over its lanes: the same operations for any A, B and place in the
// tile, so any tiling gives every output the same bits. `ahead`, where not null, is read (prefetched) beside w's
// rows: the rows PF further on.
template <int A, int B, typename W, typename T>
__attribute__((always_inline)) inline void tile(const float* xf, int64_t P, int64_t I, const W* w, int64_t S,
                                                const W* ahead, int64_t m0, T* out, int64_t O) {
  lf acc[A][B] = {};
  const int64_t whole = I / LW * LW;
  for (int64_t i = 0; i < whole; i += LW) {
    lf wv[A];
    for (int a = 0; a < A; ++a) wv[a] = loadv(w + a * S + i);
    if (ahead)
      for (int a = 0; a < A; ++a) __builtin_prefetch(ahead + a * S + i);
    for (int b = 0; b < B; ++b) {
      const lf xv = loadv(xf + (m0 + b) * P + i);
      for (int a = 0; a < A; ++a) acc[a][b] = fmadd(wv[a], xv, acc[a][b]);
    }
  }
  if (whole < I) {
    lf wv[A];
    for (int a = 0; a < A; ++a) wv[a] = load_tail(w + a * S + whole, I - whole);
    for (int b = 0; b < B; ++b) {
      const lf xv = loadv(xf + (m0 + b) * P + whole);
      for (int a = 0; a < A; ++a) acc[a][b] = fmadd(wv[a], xv, acc[a][b]);
    }
  }
  for (int a = 0; a < A; ++a)
    for (int b = 0; b < B; ++b) out[(m0 + b) * O + a] = static_cast<T>(lane_sum(acc[a][b]));
}

// `tile` for bfloat16 weights, two vectors a read: the same sums as reading them widened into the paired layout
template <int A, int B, typename T>
__attribute__((always_inline)) inline void tile(const float* xf, int64_t P, int64_t I, const at::BFloat16* w,
                                                int64_t S, const at::BFloat16* ahead, int64_t m0, T* out, int64_t O) {
  lf acc[A][B] = {};
  const int64_t whole = I / BL * BL;
  for (int64_t i = 0; i < whole; i += BL) {
    lf even[A], odd[A];
    for (int a = 0; a < A; ++a) load_pair(w + a * S + i, even[a], odd[a]);
    if (ahead)
      for (int a = 0; a < A; ++a) __builtin_prefetch(ahead + a * S + i);
    add_pairs<A, B>(acc, even, odd, xf + m0 * P + i, P);
  }
  if (whole < I) {
    lf even[A], odd[A];
    for (int a = 0; a < A; ++a) load_pair_tail(w + a * S + whole, I - whole, even[a], odd[a]);
    add_pairs<A, B>(acc, even, odd, xf + m0 * P + whole, P);
  }
  for (int a = 0; a < A; ++a)
    for (int b = 0; b < B; ++b) out[(m0 + b) * O + a] = static_cast<T>(lane_sum(acc[a][b]));
}

// All M rows of outputs o0..o0+A in tiles of R rows (out points at output o0 of row 0, w at its weight row). Inlined
// into the loop over tiles: as a call of its own, the one-row products of bfloat16 weights ran slower.
template <int A, int R, typename W, typename T>
__attribute__((always_inline)) inline void column(const float* xf, int64_t P, int64_t M, int64_t I, const W* w,
                                                  int64_t S, const W* ahead, T* out, int64_t O) {
  int64_t m0 = 0;
  for (; m0 + R <= M; m0 += R) tile<A, R>(xf, P, I, w, S, ahead, m0, out, O);
  switch (M - m0) {
    case 1: tile<A, 1>(xf, P, I, w, S, ahead, m0, out, O); break;
    case 2: if constexpr (R > 2) tile<A, 2>(xf, P, I, w, S, ahead, m0, out, O); break;
    case 3: if constexpr (R > 3) tile<A, 3>(xf, P, I, w, S, ahead, m0, out, O); break;
    case 4: if constexpr (R > 4) tile<A, 4>(xf, P, I, w, S, ahead, m0, out, O); break;
    case 5: if constexpr (R > 5) tile<A, 5>(xf, P, I, w, S, ahead, m0, out, O); break;
    default: break;
  }
}

template <int OUTS, int R, typename W, typename T>
inline void column_of(int64_t n, const float* xf, int64_t P, int64_t M, int64_t I, const W* w, int64_t S,
                      const W* ahead, T* out, int64_t O) {
  switch (n) {
    case 1: return column<1, R>(xf, P, M, I, w, S, ahead, out, O);
    case 2: if constexpr (OUTS > 2) return column<2, R>(xf, P, M, I, w, S, ahead, out, O); break;
    case 3: if constexpr (OUTS > 3) return column<3, R>(xf, P, M, I, w, S, ahead, out, O); break;
    default: break;
  }
  return column<OUTS, R>(xf, P, M, I, w, S, ahead, out, O);
}

// n rows of bfloat16 weights (I apart) widened into the paired layout, P floats a row (whole blocks, zeros past I)
inline void widen_pairs(const at::BFloat16* w, int64_t n, int64_t I, int64_t P, const at::BFloat16* ahead,
                        float* into) {
  for (int64_t a = 0; a < n; ++a) {
    const at::BFloat16* row = w + a * I;
    float* to = into + a * P;
    for (int64_t i = 0; i < I; i += BL) {
      lf even, odd;
      if (i + BL <= I)
        load_pair(row + i, even, odd);
      else
        load_pair_tail(row + i, I - i, even, odd);
      storev(to + i, even);
      storev(to + i + LW, odd);
      if (ahead) __builtin_prefetch(ahead + a * I + i);
    }
  }
}

// Tiles of OUTS outputs by R rows; the weight rows PF = 4 tiles on are read ahead: the memory's latency outlasts a tile
template <int OUTS, int R, typename W, typename T>
void product_in(const float* xf, int64_t P, int64_t M, int64_t I, const W* w, int64_t O, T* out) {
  constexpr int64_t PF = 4 * OUTS;
  const int64_t tiles = (O + OUTS - 1) / OUTS;
  // with more than two tiles of rows, bfloat16 weights are widened to float32 (exactly) once per tile of outputs
  // into a buffer, rather than once per tile of rows (for two, converting twice costs less than the buffer)
  const bool widen = M > 2 * R && !std::is_same<W, float>::value;
  if constexpr (!std::is_same<W, float>::value) {
    if (widen) {  // into the paired layout, P (a whole number of blocks) floats a row, zeros past I
      at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
        std::vector<float> widened(OUTS * P, 0.f);
        for (int64_t t = begin; t < end; ++t) {
          const int64_t o0 = t * OUTS, n = O - o0 < OUTS ? O - o0 : OUTS;
          widen_pairs(w + o0 * I, n, I, P, o0 + PF + OUTS <= O ? w + (o0 + PF) * I : nullptr, widened.data());
          column_of<OUTS, R>(n, xf, P, M, P, widened.data(), P, static_cast<const float*>(nullptr), out + o0, O);
        }
      });
      return;
    }
  }
  // a loop of its own (not a branch in the one above): the compiler then keeps the direct tiles as lean as alone
  at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t o0 = t * OUTS, n = O - o0 < OUTS ? O - o0 : OUTS;
      const W* ahead = o0 + PF + OUTS <= O ? w + (o0 + PF) * I : nullptr;
      column_of<OUTS, R>(n, xf, P, M, I, w + o0 * I, I, ahead, out + o0, O);
    }
  });
}

// The tile's shape by the number of rows, where AVX2's 16 registers make it matter: 3 outputs by up to 4 rows, and 2
// by 6 for 6 rows (one tile of rows, not 4 and a tile of 2 that converts the weights again for little work); float32
// weights take 2 by 5 for 5 rows too. For bfloat16 weights, read in pairs, 5 rows ran faster as 4 and 1 than as one
// tile of 2 by 5, and 9 to 12 rows faster widened once into a buffer (`product_in`) than as tiles of 2 by 6.
template <typename W, typename T>
void product(const float* xf, int64_t P, int64_t M, int64_t I, const W* w, int64_t O, T* out) {
  const bool two_by_six = LW == 8 && (std::is_same<W, float>::value ? M > MT && M <= 6 : M == 6);
  if (two_by_six) return product_in<2, 6>(xf, P, M, I, w, O, out);
  product_in<OT, MT>(xf, P, M, I, w, O, out);
}

template <typename T>
void product_as(const torch::Tensor& x, const torch::Tensor& w, torch::Tensor& out) {
  const bool paired = w.scalar_type() == at::kBFloat16;  // x laid out as the paired reads of the weights want
  const int64_t M = x.size(0), I = x.size(1), O = w.size(0), step = paired ? BL : LW, P = (I + step - 1) / step * step;
  std::vector<float> xf(M * P, 0.f);  // float32 rows, zero-padded to whole vectors (whole blocks, paired)
  const T* xp = x.data_ptr<T>();
  for (int64_t m = 0; m < M; ++m) {
    float* row = xf.data() + m * P;
    const T* from = xp + m * I;
    if (!paired) {
      for (int64_t i = 0; i < I; ++i) row[i] = static_cast<float>(from[i]);
      continue;
    }
    for (int64_t i = 0; i < I; ++i)  // per block: the even entries into its first LW floats, the odd into the next
      row[i / BL * BL + (i % 2) * LW + (i % BL) / 2] = static_cast<float>(from[i]);
  }
  if (paired)
    product(xf.data(), P, M, I, w.data_ptr<at::BFloat16>(), O, out.data_ptr<T>());
  else
    product(xf.data(), P, M, I, w.data_ptr<float>(), O, out.data_ptr<T>());
}

}  // namespace

// x (M, I) times w (O, I) transposed: (M, O) in x's dtype; x and w contiguous, each float32 or bfloat16.
torch::Tensor linear(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.is_cpu() && w.is_cpu() && x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "linear: x (M, I) and w (O, I) on the CPU");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "linear: contiguous x and w");
  const auto xt = x.scalar_type(), wt = w.scalar_type();
  TORCH_CHECK((xt == at::kFloat || xt == at::kBFloat16) && (wt == at::kFloat || wt == at::kBFloat16),
              "linear: float32 or bfloat16");
  auto out = torch::empty({x.size(0), w.size(0)}, x.options());
  if (x.size(0) == 0 || w.size(0) == 0) return out;
  if (xt == at::kBFloat16)
    product_as<at::BFloat16>(x, w, out);
  else
    product_as<float>(x, w, out);
  return out;
}
