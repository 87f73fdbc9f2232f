// The SAT rows' low-rank update of a draft pass in one call (sdsat/sat_kernel.py).
#include <torch/extension.h>
#include <vector>

// out[n, :] += (x[n, :] @ a_t.T) @ b for each row n; a_t (R, I) (A transposed: each low-rank column's weights
// contiguous, so that x's dot product with it runs along memory) and b (R, O) float32, contiguous; x and out
// one dtype (float32 or bfloat16) with contiguous rows. The products accumulate in float32.
template <typename T>
static void update(T* out, int64_t out_stride, const T* x, int64_t x_stride, const float* a_t, const float* b,
                   int64_t rows, int64_t I, int64_t R, int64_t O) {
  std::vector<float> xf(I), low(R), acc(O);
  for (int64_t n = 0; n < rows; ++n) {
    const T* xn = x + n * x_stride;
    for (int64_t i = 0; i < I; ++i) xf[i] = static_cast<float>(xn[i]);
    for (int64_t r = 0; r < R; ++r) {
      const float* ar = a_t + r * I;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < I; ++i) sum += xf[i] * ar[i];
      low[r] = sum;
    }
    for (int64_t o = 0; o < O; ++o) acc[o] = 0.f;
    for (int64_t r = 0; r < R; ++r) {
      const float lr = low[r];
      const float* br = b + r * O;
#pragma omp simd
      for (int64_t o = 0; o < O; ++o) acc[o] += lr * br[o];
    }
    T* on = out + n * out_stride;
    for (int64_t o = 0; o < O; ++o) on[o] = static_cast<T>(static_cast<float>(on[o]) + acc[o]);
  }
}

// Adds the update to rows start.. of out (1, T, O) from the same rows of x (1, T, I); returns false, touching
// nothing, where this kernel does not apply (another device or dtype, rows not contiguous): the caller then
// computes the update with PyTorch's ops.
bool sat_update(torch::Tensor out, torch::Tensor x, int64_t start, torch::Tensor a_t, torch::Tensor b) {
  if (!out.is_cpu() || !x.is_cpu() || out.dim() != 3 || x.dim() != 3 || out.size(0) != 1 || x.size(0) != 1 ||
      out.stride(2) != 1 || x.stride(2) != 1 || out.scalar_type() != x.scalar_type() ||
      (out.scalar_type() != at::kFloat && out.scalar_type() != at::kBFloat16))
    return false;
  const int64_t rows = out.size(1) - start, I = x.size(2), R = a_t.size(0), O = b.size(1);
  TORCH_CHECK(a_t.is_contiguous() && b.is_contiguous() && a_t.scalar_type() == at::kFloat &&
              b.scalar_type() == at::kFloat, "sat_update: a_t and b must be contiguous float32");
  TORCH_CHECK(start >= 0 && rows >= 0 && x.size(1) == out.size(1) && a_t.size(1) == I && b.size(0) == R &&
              out.size(2) == O, "sat_update: shapes do not fit");
  if (out.scalar_type() == at::kBFloat16) {
    update(out.data_ptr<at::BFloat16>() + start * out.stride(1), out.stride(1),
           x.data_ptr<at::BFloat16>() + start * x.stride(1), x.stride(1),
           a_t.data_ptr<float>(), b.data_ptr<float>(), rows, I, R, O);
  } else {
    update(out.data_ptr<float>() + start * out.stride(1), out.stride(1),
           x.data_ptr<float>() + start * x.stride(1), x.stride(1),
           a_t.data_ptr<float>(), b.data_ptr<float>(), rows, I, R, O);
  }
  return true;
}
