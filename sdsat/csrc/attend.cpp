// Row-invariant attention in one call per layer (sdsat/attention.py, the compiled form): each query row attends over
// exactly the keys it sees, with every sum in one fixed order, so a row's bits depend on its query and its keys
// alone, never on how many rows share the call or how threads split them. float32 arithmetic on float32 or
// bfloat16 inputs, in the vector unit's own width (vectors.h).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

static inline lf vexp(lf x) {  // e^x for x <= 0, about 1e-7 relative; below -87 it gives e^-87
  const lf low = lf{} - 87.f;
  x = x < low ? low : x;
  const lf t = x * 1.44269504088896341f;
  li n = __builtin_convertvector(t, li);  // toward zero
  n += (li)(__builtin_convertvector(n, lf) > t);  // -1 where that rounded up: floor
  const lf f = t - __builtin_convertvector(n, lf);
  lf p = f * 1.535336188319500e-4f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  return p * (lf)((n + 127) << 23);
}

// One query row over its n keys for the G query heads of one key head (D a multiple of the vector width).
// q (G, D) float32; keys and values rows idx[s] (or s); scores room for G * padded n floats. Every sum runs in
// one fixed order whatever else the call holds, so a row's bits depend on its query and its keys alone.
// Not inlined: a pass's rows and a long prompt's, on any thread, run one compiled body. The scores key by key (a key
// read once for the G heads), the outputs head by head (a head's D / LW sums stay in registers over the keys).
template <typename T, int D>
__attribute__((noinline)) static void attend_row(const float* q, int64_t G, const T* k, const T* v, int64_t kstride,
                                                 int64_t vstride, const int64_t* idx, int64_t n, float scaling,
                                                 float* scores, T* out) {
  constexpr int V = D / LW;
  const int64_t width = (n + LW - 1) / LW * LW;
  lf qs[8 * V];  // the queries, scaled (G <= 8: `applies`)
  for (int64_t g = 0; g < G; ++g)
    for (int j = 0; j < V; ++j) qs[g * V + j] = loadv(q + g * D + j * LW) * scaling;
  for (int64_t s = 0; s < n; ++s) {  // a key read (and widened) once for the G heads
    const T* ks = k + (idx ? idx[s] : s) * kstride;
    lf kv[V];
    for (int j = 0; j < V; ++j) kv[j] = loadv(ks + j * LW);
    for (int64_t g = 0; g < G; ++g) {
      const lf* qg = qs + g * V;
      lf acc = qg[0] * kv[0];
      for (int j = 1; j < V; ++j) acc = fmadd(qg[j], kv[j], acc);
      scores[g * width + s] = lane_sum(acc);
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * width;
    float m = sg[0];
    for (int64_t s = 1; s < n; ++s) m = sg[s] > m ? sg[s] : m;
    for (int64_t s = n; s < width; ++s) sg[s] = m;
    lf sum = {};
    for (int64_t s = 0; s < width; s += LW) {
      const lf e = vexp(loadv(sg + s) - m);
      storev(sg + s, e);
      if (s + LW <= n) sum += e;
    }
    float total = lane_sum(sum);
    for (int64_t s = n / LW * LW; s < n; ++s) total += sg[s];
    const float inv = 1.f / total;
    lf o[V] = {};
    for (int64_t s = 0; s < n; ++s) {
      const T* vs = v + (idx ? idx[s] : s) * vstride;
      const lf p = lf{} + sg[s];
      for (int j = 0; j < V; ++j) o[j] = fmadd(p, loadv(vs + j * LW), o[j]);
    }
    for (int j = 0; j < V; ++j) {
      float tmp[LW];
      storev(tmp, o[j] * inv);
      for (int l = 0; l < LW; ++l) out[g * D + j * LW + l] = static_cast<T>(tmp[l]);
    }
  }
}

template <typename T>
static void attend_all(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                       const torch::Tensor& counts, const torch::Tensor& index, double scaling, torch::Tensor& out) {
  const int64_t H = query.size(1), R = query.size(2), D = query.size(3), Hkv = key.size(1);
  const int64_t G = H / Hkv;
  const T* qp = query.data_ptr<T>();
  const T* kp = key.data_ptr<T>();
  const T* vp = value.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* cp = counts.data_ptr<int64_t>();
  const bool gathered = index.numel() > 0;
  const int64_t* ip = gathered ? index.data_ptr<int64_t>() : nullptr;
  const int64_t W = gathered ? index.size(1) : 0;
  int64_t widest = 0;
  for (int64_t r = 0; r < R; ++r) widest = cp[r] > widest ? cp[r] : widest;
  const int64_t qs1 = query.stride(1), qs2 = query.stride(2), ks1 = key.stride(1), ks2 = key.stride(2),
                vs1 = value.stride(1), vs2 = value.stride(2);
  // one task per key head and row, a head's rows in turn (its keys still in cache for the next row): each task writes
  // its own outputs, so threads splitting them change no bits
  auto tasks = [&](int64_t begin, int64_t end) {
    std::vector<float> q(G * D), scores(G * ((widest + LW - 1) / LW * LW));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / R, r = task % R;
      const int64_t* idx = gathered ? ip + r * W : nullptr;
      for (int64_t g = 0; g < G; ++g) {
        const T* qr = qp + (h * G + g) * qs1 + r * qs2;
        for (int64_t d = 0; d < D; ++d) q[g * D + d] = static_cast<float>(qr[d]);
      }
      auto row = D == 64 ? attend_row<T, 64> : D == 128 ? attend_row<T, 128> : D == 32 ? attend_row<T, 32>
                                                                                       : attend_row<T, 256>;
      row(q.data(), G, kp + h * ks1, vp + h * vs1, ks2, vs2, idx, cp[r], static_cast<float>(scaling),
          scores.data(), op + (r * H + h * G) * D);
    }
  };
  // tiny calls on the calling thread (waking another costs more than they do)
  if (R * widest * H * D < (int64_t{1} << 15))
    tasks(0, R * Hkv);
  else
    at::parallel_for(0, R * Hkv, 1, tasks);
}

}  // namespace

// Whether `attend` takes a model with these heads and head size.
bool applies(int64_t heads, int64_t kv_heads, int64_t dim) {
  return kv_heads > 0 && heads % kv_heads == 0 && heads / kv_heads <= 8 && (dim == 32 || dim == 64 || dim == 128 || dim == 256);
}

// query (1, H, R, D), key and value (1, Hkv, S, D), each with its last dimension contiguous (other strides free:
// a view of a cache's room); counts (R,) int64, the keys row r sees; index empty (row r sees keys 0..counts[r]-1)
// or (R, W) int64, row r's keys in order in its first counts[r] places. Returns (1, R, H, D) in query's dtype.
torch::Tensor attend(torch::Tensor query, torch::Tensor key, torch::Tensor value, torch::Tensor counts,
                     torch::Tensor index, double scaling) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4 && query.size(0) == 1, "attend: shapes");
  TORCH_CHECK(query.stride(3) == 1 && key.stride(3) == 1 && value.stride(3) == 1, "attend: last dim contiguous");
  TORCH_CHECK(key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type(), "attend: dtypes");
  TORCH_CHECK(counts.scalar_type() == at::kLong && counts.is_contiguous() && counts.numel() == query.size(2), "attend: counts");
  TORCH_CHECK(index.numel() == 0 || (index.scalar_type() == at::kLong && index.is_contiguous() && index.dim() == 2),
              "attend: index");
  TORCH_CHECK(applies(query.size(1), key.size(1), query.size(3)) && key.size(3) == query.size(3) &&
              value.sizes() == key.sizes(), "attend: heads or head size");
  const int64_t S = key.size(2);
  const int64_t* cp = counts.data_ptr<int64_t>();
  for (int64_t r = 0; r < counts.numel(); ++r)
    TORCH_CHECK(cp[r] >= 1 && cp[r] <= S && (index.numel() == 0 || cp[r] <= index.size(1)), "attend: a row's key count");
  if (index.numel() > 0) {
    TORCH_CHECK(index.size(0) == query.size(2), "attend: index rows");
    const int64_t* ip = index.data_ptr<int64_t>();
    for (int64_t i = 0; i < index.numel(); ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < S, "attend: a key index");
  }
  auto out = torch::empty({1, query.size(2), query.size(1), query.size(3)}, query.options());
  if (query.scalar_type() == at::kBFloat16)
    attend_all<at::BFloat16>(query, key, value, counts, index, scaling, out);
  else if (query.scalar_type() == at::kFloat)
    attend_all<float>(query, key, value, counts, index, scaling, out);
  else
    TORCH_CHECK(false, "attend: float32 or bfloat16");
  return out;
}
