// strata::window_values: the softmax and value sum of a window's attention on a CPU, for the compiled target step
// (runtime/cpu_attention.py builds it; docs/models.md, "Compiled CPU steps").
//
// Every line (a query head of a window row) gets the same arithmetic whatever the other lines hold: its scores'
// maximum over keys 0..p (p: its row's position), exp(score - max) in 16-lane vectors whose lanes are fixed by key
// position, their sum reduced lane-wise in key order and then by a fixed tree, and its values summed one key after
// another in key order. So a row's bits depend on its query, its position and the cache, never on the window's
// width, the rows beside it or how many keys the scores were computed for: the compiled step's lossless promise.
// Built with -ffp-contract=off, so no product is fused into a sum in one loop and not in another.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int LANES = 16;
typedef float vf __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(LANES * sizeof(int32_t))));

inline vf splat(float x) { return vf{} + x; }
inline vi splat_i(int64_t x) { return vi{} + static_cast<int32_t>(x); }
inline vf loadu(const float* p) { vf v; std::memcpy(&v, p, sizeof(v)); return v; }
inline void storeu(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }
inline vi bits(vf v) { vi b; std::memcpy(&b, &v, sizeof(b)); return b; }
inline vf floats(vi b) { vf v; std::memcpy(&v, &b, sizeof(v)); return v; }
inline vf select(vi mask, vf a, vf b) { return floats((mask & bits(a)) | (~mask & bits(b))); }

// a fixed tree: lanes 0..7 + 8..15, then 0..3 + 4..7, ...
inline float hsum(vf v) {
  float a[LANES];
  std::memcpy(a, &v, sizeof(a));
  for (int w = LANES / 2; w > 0; w /= 2)
    for (int i = 0; i < w; ++i) a[i] = a[i] + a[i + w];
  return a[0];
}

// exp(x) for x <= 0 (Cephes' single-precision polynomial), the same operations on every lane
inline vf vexp(vf x) {
  const vf lo = splat(-87.33654f);
  x = select(x < lo, lo, x);
  const vf magic = splat(12582912.f);             // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const vf r = (x * splat(1.44269504088896341f) + magic) - magic;
  x = x - r * splat(0.693359375f) - r * splat(-2.12194440e-4f);
  vf y = splat(1.9875691500e-4f);
  y = y * x + splat(1.3981999507e-3f);
  y = y * x + splat(8.3334519073e-3f);
  y = y * x + splat(4.1665795894e-2f);
  y = y * x + splat(1.6666665459e-1f);
  y = y * x + splat(5.0000001201e-1f);
  y = y * x * x + x + splat(1.f);
  return floats(bits(y) + (__builtin_convertvector(r, vi) << 23));
}

// one KV head: each line's probabilities into pr (row stride np), 1 / their sum into inv, then its output row
template <int D>
void head(const float* S, int64_t sl, int64_t N, const float* V, int64_t vr, const int64_t* n, int64_t L,
          float* O, float* pr, int64_t np, float* inv) {
  vi iota;
  for (int i = 0; i < LANES; ++i) iota[i] = i;
  float tail[LANES];
  for (int64_t l = 0; l < L; ++l) {
    const float* s = S + l * sl;
    float* p = pr + l * np;
    const int64_t nl = n[l];
    auto load = [&](int64_t j) {                   // scores j..j+15 (those past the scores' end read as 0)
      if (j + LANES <= N) return loadu(s + j);
      for (int i = 0; i < LANES; ++i) tail[i] = j + i < N ? s[j + i] : 0.f;
      return loadu(tail);
    };
    vf mv = splat(-INFINITY);
    for (int64_t j = 0; j < nl; j += LANES) {
      const vf x = load(j);
      mv = select((iota + splat_i(j) < splat_i(nl)) & (x > mv), x, mv);
    }
    float m = mv[0];
    for (int i = 1; i < LANES; ++i) m = mv[i] > m ? mv[i] : m;
    vf sum = splat(0.f);
    for (int64_t j = 0; j < nl; j += LANES) {
      const vf x = select(iota + splat_i(j) < splat_i(nl), vexp(load(j) - splat(m)), splat(0.f));
      storeu(p + j, x);
      sum += x;
    }
    inv[l] = 1.f / hsum(sum);
  }
  // the values: G lines share each value row's loads; a line's sum runs over its keys in order either way
  constexpr int G = D <= 4 ? 4 : 2;
  for (int64_t l0 = 0; l0 < L; l0 += G) {
    const int64_t g = std::min<int64_t>(G, L - l0);
    vf o[G][D];
    int64_t lo = n[l0];
    for (int64_t i = 0; i < g; ++i) {
      lo = std::min(lo, n[l0 + i]);
      for (int d = 0; d < D; ++d) o[i][d] = splat(0.f);
    }
    int64_t j = 0;
    if (g == G) {
      for (; j < lo; ++j) {
        const float* vj = V + j * vr;
        vf pj[G];
        for (int i = 0; i < G; ++i) pj[i] = splat(pr[(l0 + i) * np + j]);
        for (int d = 0; d < D; ++d) {
          const vf v = loadu(vj + d * LANES);
          for (int i = 0; i < G; ++i) o[i][d] = o[i][d] + pj[i] * v;
        }
      }
    }
    for (int64_t i = 0; i < g; ++i) {
      const float* p = pr + (l0 + i) * np;
      for (int64_t jj = j; jj < n[l0 + i]; ++jj) {
        const float* vj = V + jj * vr;
        const vf pj = splat(p[jj]);
        for (int d = 0; d < D; ++d) o[i][d] = o[i][d] + pj * loadu(vj + d * LANES);
      }
      float* ov = O + (l0 + i) * D * LANES;
      for (int d = 0; d < D; ++d) storeu(ov + d * LANES, o[i][d] * splat(inv[l0 + i]));
    }
  }
}

// sc [kv heads, lines, N] scores (lines row-major: row r's query heads at r * grp ..), vc [kv heads, slots, hd] the
// cache, seen [rows] each row's position: out [kv heads, lines, hd]
at::Tensor window_values(const at::Tensor& sc, const at::Tensor& vc, const at::Tensor& seen, int64_t grp) {
  TORCH_CHECK(sc.dim() == 3 && vc.dim() == 3 && seen.dim() == 1 && sc.size(0) == vc.size(0),
              "window_values: shapes do not match");
  TORCH_CHECK(sc.scalar_type() == at::kFloat && vc.scalar_type() == at::kFloat && seen.scalar_type() == at::kLong,
              "window_values takes float32 scores and values and int64 positions");
  TORCH_CHECK(sc.stride(2) == 1 && vc.stride(2) == 1 && seen.is_contiguous() && grp > 0 &&
              seen.size(0) * grp == sc.size(1), "window_values: unexpected layout");
  TORCH_CHECK(vc.size(2) == 64 || vc.size(2) == 128 || vc.size(2) == 256, "window_values: head size ", vc.size(2),
              " is not 64, 128 or 256");
  const int64_t nkv = sc.size(0), L = sc.size(1), N = sc.size(2), hd = vc.size(2), slots = vc.size(1);
  at::Tensor out = at::empty({nkv, L, hd}, sc.options());
  const float* S = sc.data_ptr<float>();
  const float* V = vc.data_ptr<float>();
  const int64_t* P = seen.data_ptr<int64_t>();
  float* O = out.data_ptr<float>();
  const int64_t ss = sc.stride(0), sl = sc.stride(1), vs = vc.stride(0), vr = vc.stride(1);
  std::vector<int64_t> n(L);
  for (int64_t l = 0; l < L; ++l) {
    n[l] = P[l / grp] + 1;
    TORCH_CHECK(n[l] >= 1 && n[l] <= N && n[l] <= slots, "window_values: a position is outside the scores");
  }
  const int64_t np = (N + LANES - 1) / LANES * LANES;
  at::parallel_for(0, nkv, 1, [&](int64_t b, int64_t e) {
    std::vector<float> pr(L * np), inv(L);
    for (int64_t h = b; h < e; ++h) {
      const float* Sh = S + h * ss;
      const float* Vh = V + h * vs;
      float* Oh = O + h * L * hd;
      switch (hd) {
        case 64: head<4>(Sh, sl, N, Vh, vr, n.data(), L, Oh, pr.data(), np, inv.data()); break;
        case 128: head<8>(Sh, sl, N, Vh, vr, n.data(), L, Oh, pr.data(), np, inv.data()); break;
        case 256: head<16>(Sh, sl, N, Vh, vr, n.data(), L, Oh, pr.data(), np, inv.data()); break;
        default: break;                                        // checked above
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(strata, m) { m.def("window_values(Tensor sc, Tensor vc, Tensor seen, int grp) -> Tensor"); }
TORCH_LIBRARY_IMPL(strata, CPU, m) { m.impl("window_values", &window_values); }
