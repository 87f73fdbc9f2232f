// Row-invariant attention in one call per layer (sdsat/attention.py, the compiled form): each query row attends over
// exactly the keys it sees, with every sum in one fixed order, so a row's bits depend on its query and its keys
// alone, never on how many rows share the call or how threads split them. float32 arithmetic on float32 or
// bfloat16 inputs, in the vectors of vectors.h.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

static inline v16f vexp(v16f x) {  // e^x for x <= 0, about 1e-7 relative; below -87 it gives e^-87
  const v16f zero = {};
  x = x < zero - 87.f ? zero - 87.f : x;
  const v16f t = x * 1.44269504088896341f;
  v16i n = __builtin_convertvector(t, v16i);  // toward zero
  n += (v16i)(__builtin_convertvector(n, v16f) > t);  // -1 where that rounded up: floor
  const v16f f = t - __builtin_convertvector(n, v16f);
  v16f p = f * 1.535336188319500e-4f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  return p * (v16f)((n + 127) << 23);
}

// One query row over its n keys for the G query heads of one key head (G <= 8, D a multiple of 16, D <= 256).
// q (G, D) float32; keys and values rows idx[s] (or s); scores room for G * padded n floats. Every sum runs in
// one fixed order whatever else the call holds, so a row's bits depend on its query and its keys alone.
// Not inlined: a pass's rows on the calling thread and a long prompt's on worker threads run one compiled body,
// so one contraction of products into fused multiply-adds.
template <typename T, int V>
__attribute__((noinline)) static void attend_row(const float* q, int64_t G, int64_t D, const T* k, const T* v,
                                                 int64_t kstride, int64_t vstride, const int64_t* idx, int64_t n,
                                                 float scaling, float* scores, T* out) {
  const int64_t width = (n + L - 1) / L * L;
  v16f qv[8 * 16];
  for (int64_t g = 0; g < G; ++g)
    for (int64_t j = 0; j < V; ++j) qv[g * V + j] = load(q + g * D + j * L) * scaling;
  for (int64_t s = 0; s < n; ++s) {
    const T* ks = k + (idx ? idx[s] : s) * kstride;
    v16f kv[16];
    for (int64_t j = 0; j < V; ++j) kv[j] = load(ks + j * L);
    for (int64_t g = 0; g < G; ++g) {
      v16f acc = qv[g * V] * kv[0];
      for (int64_t j = 1; j < V; ++j) acc += qv[g * V + j] * kv[j];
      scores[g * width + s] = hsum(acc);
    }
  }
  v16f o[8 * 16];
  float inv[8];
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * width;
    float m = sg[0];
    for (int64_t s = 1; s < n; ++s) m = sg[s] > m ? sg[s] : m;
    for (int64_t s = n; s < width; ++s) sg[s] = m;
    v16f sum = {};
    for (int64_t s = 0; s < width; s += L) {
      v16f e = vexp(load(sg + s) - m);
      store(sg + s, e);
      if (s + L <= n) sum += e;
    }
    float total = hsum(sum);
    for (int64_t s = n / L * L; s < n; ++s) total += sg[s];
    inv[g] = 1.f / total;
    for (int64_t j = 0; j < V; ++j) o[g * V + j] = v16f{};
  }
  for (int64_t s = 0; s < n; ++s) {
    const T* vs = v + (idx ? idx[s] : s) * vstride;
    v16f vv[16];
    for (int64_t j = 0; j < V; ++j) vv[j] = load(vs + j * L);
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * width + s];
      for (int64_t j = 0; j < V; ++j) o[g * V + j] += p * vv[j];
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t j = 0; j < V; ++j) {
      float tmp[L];
      store(tmp, o[g * V + j] * inv[g]);
      for (int l = 0; l < L; ++l) out[g * D + j * L + l] = static_cast<T>(tmp[l]);
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
  auto rows = [&](int64_t begin, int64_t end) {
    std::vector<float> q(G * D), scores(G * ((widest + L - 1) / L * L));
    for (int64_t r = begin; r < end; ++r) {
      const int64_t* idx = gathered ? ip + r * W : nullptr;
      for (int64_t h = 0; h < Hkv; ++h) {
        for (int64_t g = 0; g < G; ++g) {
          const T* qr = qp + (h * G + g) * qs1 + r * qs2;
          for (int64_t d = 0; d < D; ++d) q[g * D + d] = static_cast<float>(qr[d]);
        }
        auto row = D == 64 ? attend_row<T, 4> : D == 128 ? attend_row<T, 8> : D == 32 ? attend_row<T, 2>
                                                                                      : attend_row<T, 16>;
        row(q.data(), G, D, kp + h * ks1, vp + h * vs1, ks2, vs2, idx, cp[r], static_cast<float>(scaling),
            scores.data(), op + (r * H + h * G) * D);
      }
    }
  };
  // a decoding pass's few rows on the calling thread (handing them to another costs more than they do); a long
  // prompt's rows split between threads, which changes no row's bits
  if (R * widest * H * D < (int64_t{1} << 20))
    rows(0, R);
  else
    at::parallel_for(0, R, 1, rows);
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
