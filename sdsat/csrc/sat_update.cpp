// The SAT rows' low-rank update of a draft pass in one call (sdsat/sat_kernel.py), in the vectors of vectors.h.
#include <torch/extension.h>
#include <vector>

namespace {

// Rows n0..n0+G of the update, G <= 4 rows side by side, in vectors of the CPU's own width (lf): each of a's and b's
// vectors is loaded once for the G rows, and the G rows' sums are independent chains of multiply-adds (one row's
// chain alone waits on each step). R = V * LW.
template <int G, int V, typename T, typename W>
void rows_of(T* out, int64_t out_stride, const float* xf, const W* a, const W* b, float scale, int64_t I,
             int64_t O) {
  lf low[G][V] = {};
  for (int64_t i = 0; i < I; ++i)
    for (int j = 0; j < V; ++j) {
      const lf aij = loadv(a + (i * V + j) * LW);
      for (int n = 0; n < G; ++n) low[n][j] = fmadd(lf{} + xf[n * I + i], aij, low[n][j]);
    }
  float lows[G][V * LW];
  for (int n = 0; n < G; ++n)
    for (int j = 0; j < V; ++j) storev(lows[n] + j * LW, low[n][j] * scale);
  for (int64_t o = 0; o < O; o += LW) {
    lf acc[G] = {};
    for (int64_t r = 0; r < V * LW; ++r) {
      const lf br = loadv(b + r * O + o);
      for (int n = 0; n < G; ++n) acc[n] = fmadd(lf{} + lows[n][r], br, acc[n]);
    }
    for (int n = 0; n < G; ++n) storev(out + n * out_stride + o, loadv(out + n * out_stride + o) + acc[n]);
  }
}

template <int V, typename T, typename W>
void rows_by_vectors(T* out, int64_t out_stride, const float* xf, const W* a, const W* b, float scale, int64_t rows,
                     int64_t I, int64_t O) {
  for (int64_t n = 0; n < rows; n += 4) {
    T* on = out + n * out_stride;
    const float* xn = xf + n * I;
    switch (rows - n) {
      case 1: rows_of<1, V>(on, out_stride, xn, a, b, scale, I, O); break;
      case 2: rows_of<2, V>(on, out_stride, xn, a, b, scale, I, O); break;
      case 3: rows_of<3, V>(on, out_stride, xn, a, b, scale, I, O); break;
      default: rows_of<4, V>(on, out_stride, xn, a, b, scale, I, O);
    }
  }
}

// Any shape, one row and one sum at a time.
template <typename T, typename W>
void rows_by_scalars(T* out, int64_t out_stride, const float* xf, const W* a, const W* b, float scale, int64_t rows,
                     int64_t I, int64_t R, int64_t O) {
  std::vector<float> low(R);
  for (int64_t n = 0; n < rows; ++n) {
    for (int64_t r = 0; r < R; ++r) {
      float sum = 0.f;
      for (int64_t i = 0; i < I; ++i) sum += xf[n * I + i] * static_cast<float>(a[i * R + r]);
      low[r] = sum * scale;
    }
    T* on = out + n * out_stride;
    for (int64_t o = 0; o < O; ++o) {
      float acc = 0.f;
      for (int64_t r = 0; r < R; ++r) acc += low[r] * static_cast<float>(b[r * O + o]);
      on[o] = static_cast<T>(static_cast<float>(on[o]) + acc);
    }
  }
}

// out[n, :] += scale * (x[n, :] @ a) @ b for each of `rows` rows; a (I, R) and b (R, O) contiguous, x and out rows
// contiguous. Sums in float32, in one fixed order for any number of rows.
template <typename T, typename W>
void update(T* out, int64_t out_stride, const T* x, int64_t x_stride, const W* a, const W* b, float scale,
            int64_t rows, int64_t I, int64_t R, int64_t O) {
  std::vector<float> xf(rows * I);
  for (int64_t n = 0; n < rows; ++n)
    for (int64_t i = 0; i < I; ++i) xf[n * I + i] = static_cast<float>(x[n * x_stride + i]);
  switch (O % LW == 0 && R % LW == 0 ? R / LW : 0) {
    case 1: return rows_by_vectors<1>(out, out_stride, xf.data(), a, b, scale, rows, I, O);
    case 2: return rows_by_vectors<2>(out, out_stride, xf.data(), a, b, scale, rows, I, O);
    case 3: return rows_by_vectors<3>(out, out_stride, xf.data(), a, b, scale, rows, I, O);
    case 4: return rows_by_vectors<4>(out, out_stride, xf.data(), a, b, scale, rows, I, O);
    case 6: return rows_by_vectors<6>(out, out_stride, xf.data(), a, b, scale, rows, I, O);
    case 8: return rows_by_vectors<8>(out, out_stride, xf.data(), a, b, scale, rows, I, O);
    default: return rows_by_scalars(out, out_stride, xf.data(), a, b, scale, rows, I, R, O);  // rank 0 too
  }
}

template <typename T>
void update_as(torch::Tensor& out, const torch::Tensor& x, int64_t start, const torch::Tensor& a,
               const torch::Tensor& b, double scale) {
  const int64_t rows = out.size(1) - start, I = x.size(2), R = a.size(1), O = b.size(1);
  T* o = out.data_ptr<T>() + start * out.stride(1);
  const T* xs = x.data_ptr<T>() + start * x.stride(1);
  if (a.scalar_type() == at::kBFloat16)
    update(o, out.stride(1), xs, x.stride(1), a.data_ptr<at::BFloat16>(), b.data_ptr<at::BFloat16>(),
           static_cast<float>(scale), rows, I, R, O);
  else
    update(o, out.stride(1), xs, x.stride(1), a.data_ptr<float>(), b.data_ptr<float>(), static_cast<float>(scale),
           rows, I, R, O);
}

bool supported(const torch::Tensor& t) {
  return t.is_cpu() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16);
}

}  // namespace

// Adds scale * (x A) B to rows start.. of out (1, T, O) from the same rows of x (1, T, I), A (I, R) and B (R, O) of
// one dtype; returns false, touching nothing, where this kernel does not apply (another device or dtype, rows or
// weights not contiguous): the caller then computes the update with PyTorch's ops.
bool sat_update(torch::Tensor out, torch::Tensor x, int64_t start, torch::Tensor a, torch::Tensor b, double scale) {
  if (!supported(out) || !supported(a) || !x.is_cpu() || !b.is_cpu() || out.dim() != 3 || x.dim() != 3 ||
      out.size(0) != 1 || x.size(0) != 1 || out.stride(2) != 1 || x.stride(2) != 1 ||
      out.scalar_type() != x.scalar_type() ||
      a.scalar_type() != b.scalar_type() || !a.is_contiguous() || !b.is_contiguous())
    return false;
  TORCH_CHECK(start >= 0 && start <= out.size(1) && x.size(1) == out.size(1) && a.dim() == 2 && b.dim() == 2 &&
              a.size(0) == x.size(2) && b.size(0) == a.size(1) && out.size(2) == b.size(1),
              "sat_update: shapes do not fit");
  if (out.scalar_type() == at::kBFloat16)
    update_as<at::BFloat16>(out, x, start, a, b, scale);
  else
    update_as<float>(out, x, start, a, b, scale);
  return true;
}
