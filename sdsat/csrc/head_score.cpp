// One draft's candidate scores from the sampler head in one call (sdsat/head.py, SamplerHead.drafting's `score`),
// in the vectors of vectors.h. A draft pass drafts its k tokens in turn, each after the one before, so the head's
// per-draft work is a chain of a dozen small products and element-wise steps: as PyTorch ops each costs its setup
// many times over (an exact GELU of 256 floats alone tens of microseconds on some CPUs). The arithmetic is the same as
// `SamplerHead.scores` to float32 rounding; under sampling the draft's q is whatever these scores give, so the accept
// test stays exact either way.
#include <torch/extension.h>
#include <cmath>
#include <string>
#include <vector>

namespace {

static inline float gelu_exact(float x) { return 0.5f * x * (1.f + std::erf(x * 0.70710678118654752f)); }

// sum_i a[i] * b[i] over n floats, in four chains of vectors (one chain waits on each multiply-add before the
// next), then their lanes, then the tail
static inline float dot(const float* a, const float* b, int64_t n) {
  lf acc[4] = {};
  int64_t i = 0;
  for (; i + 4 * LW <= n; i += 4 * LW)
    for (int c = 0; c < 4; ++c) acc[c] = fmadd(loadv(a + i + c * LW), loadv(b + i + c * LW), acc[c]);
  for (; i + LW <= n; i += LW) acc[0] = fmadd(loadv(a + i), loadv(b + i), acc[0]);
  float s = lane_sum((acc[0] + acc[1]) + (acc[2] + acc[3]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// a contiguous float32 tensor of shape (n) or, with m, (n, m)
const float* f32(const torch::Tensor& t, int64_t n, const char* what, int64_t m = -1) {
  const bool shaped = m < 0 ? t.dim() == 1 && t.size(0) == n : t.dim() == 2 && t.size(0) == n && t.size(1) == m;
  TORCH_CHECK(t.is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() && shaped, "head_score: ", what,
              " must be a contiguous float32 tensor of shape (", n, m < 0 ? std::string() : ", " + std::to_string(m),
              ")");
  return t.data_ptr<float>();
}

}  // namespace

// Scores (K,) of one row's K candidates after the token `prev` whose input embedding is prev_embed (H,):
//   base + cand_out . (out_w gelu(from_h + inp_prev LN(prev_embed)) + out_b)
//        + count_w . log1p([seen, seen3])                                  (each list empty: that term counts 0)
//        + comb_out . gelu(comb_bias + comb_in features) + comb_out_b      (comb_out empty: no combiner)
// features per candidate: [z_gap, pair, log1p seen, log1p seen3, the MLP's term, the score so far less its max];
// comb_in is the combiner's first layer (C, 6).
torch::Tensor head_score(torch::Tensor base, torch::Tensor prev_embed, torch::Tensor norm_w, torch::Tensor norm_b,
                         double eps, torch::Tensor from_h, torch::Tensor inp_prev, torch::Tensor out_w,
                         torch::Tensor out_b, torch::Tensor cand_out, std::vector<int64_t> seen,
                         std::vector<int64_t> seen3, torch::Tensor count_w, torch::Tensor z_gap, torch::Tensor pair,
                         torch::Tensor comb_bias, torch::Tensor comb_in, torch::Tensor comb_out, double comb_out_b) {
  const int64_t K = base.numel(), H = prev_embed.numel(), W = from_h.numel(), C = comb_out.numel();
  TORCH_CHECK(K > 0 && H > 0 && W > 0, "head_score: no candidates, no hidden size or no MLP");
  TORCH_CHECK(prev_embed.is_cpu() && prev_embed.dim() == 1 &&
                  (prev_embed.scalar_type() == at::kFloat || prev_embed.scalar_type() == at::kBFloat16),
              "head_score: prev_embed must be a float32 or bfloat16 vector");
  TORCH_CHECK((seen.empty() || (int64_t)seen.size() == K) && (seen3.empty() || (int64_t)seen3.size() == K),
              "head_score: seen and seen3 hold one count per candidate, or none");
  const float* bs = f32(base, K, "base");
  const float* nw = f32(norm_w, H, "norm_w");
  const float* nb = f32(norm_b, H, "norm_b");
  const float* fh = f32(from_h, W, "from_h");
  const float* ip = f32(inp_prev, W, "inp_prev", H);
  const float* ow = f32(out_w, H, "out_w", W);
  const float* ob = f32(out_b, H, "out_b");
  const float* co = f32(cand_out, K, "cand_out", H);
  const float* cw = f32(count_w, 2, "count_w");

  // the token before, layer-normed (two passes over it: the mean, then the variance about it)
  std::vector<float> x(H), hidden(W), u(H);
  const auto pe = prev_embed.contiguous();
  if (pe.scalar_type() == at::kFloat) {
    const float* p = pe.data_ptr<float>();
    for (int64_t h = 0; h < H; ++h) x[h] = p[h];
  } else {
    const at::BFloat16* p = pe.data_ptr<at::BFloat16>();
    for (int64_t h = 0; h < H; ++h) x[h] = static_cast<float>(p[h]);
  }
  float mean = 0.f, var = 0.f;
  for (int64_t h = 0; h < H; ++h) mean += x[h];
  mean /= H;
  for (int64_t h = 0; h < H; ++h) var += (x[h] - mean) * (x[h] - mean);
  const float inv = 1.f / std::sqrt(var / H + static_cast<float>(eps));
  for (int64_t h = 0; h < H; ++h) x[h] = (x[h] - mean) * inv * nw[h] + nb[h];
  // the MLP: its hidden units, the correction u, and u read at the K candidates' output embeddings
  for (int64_t w = 0; w < W; ++w) hidden[w] = gelu_exact(fh[w] + dot(ip + w * H, x.data(), H));
  for (int64_t h = 0; h < H; ++h) u[h] = ob[h] + dot(ow + h * W, hidden.data(), W);
  auto out = torch::empty({1, K}, base.options());
  float* s = out.data_ptr<float>();
  std::vector<float> mlp(K), c1(K, 0.f), c2(K, 0.f);
  for (int64_t c = 0; c < K; ++c) {
    mlp[c] = dot(co + c * H, u.data(), H);
    if (!seen.empty()) c1[c] = std::log1p(static_cast<float>(seen[c]));
    if (!seen3.empty()) c2[c] = std::log1p(static_cast<float>(seen3[c]));
    s[c] = bs[c] + mlp[c] + c1[c] * cw[0] + c2[c] * cw[1];
  }
  if (C == 0) return out;
  const float* zg = f32(z_gap, K, "z_gap");
  const float* pr = f32(pair, K, "pair");
  const float* cb = f32(comb_bias, C, "comb_bias");
  const float* ci = f32(comb_in, C, "comb_in", 6);
  const float* cc = f32(comb_out, C, "comb_out");
  float best = s[0];
  for (int64_t c = 1; c < K; ++c) best = s[c] > best ? s[c] : best;
  std::vector<float> added(K);
  for (int64_t c = 0; c < K; ++c) {
    const float f[6] = {zg[c], pr[c], c1[c], c2[c], mlp[c], s[c] - best};
    float g = 0.f;
    for (int64_t j = 0; j < C; ++j) {
      float a = cb[j];
      for (int i = 0; i < 6; ++i) a += f[i] * ci[j * 6 + i];
      g += gelu_exact(a) * cc[j];
    }
    added[c] = g + static_cast<float>(comb_out_b);
  }
  for (int64_t c = 0; c < K; ++c) s[c] += added[c];
  return out;
}
