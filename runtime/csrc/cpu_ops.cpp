// The compiled CPU steps' own ops (runtime/cpu_ops.py builds and loads them; docs/models.md, "Compiled CPU steps",
// "The attention op", "The experts op" and "MTP head").
//
// strata::window_attention: a window's attention for the compiled target step. Every line (a query head of a
// window row) gets the same arithmetic whatever the other lines hold: its scores q . k_j for keys 0..p (p: its
// row's position), each a fixed sum (the head's 16-value slices multiplied and added in slice order, then the 16
// lanes by a fixed tree); their maximum; exp(score - max) in 16-lane vectors whose lanes are fixed by key position,
// summed lane-wise in key order and then by a fixed tree; and its values summed one key after another in key order,
// times 1 / that sum. So a row's bits depend on its query, its position and the cache, never on the window's width
// or the rows beside it: the compiled step's lossless promise. Built with -ffp-contract=off, so the compiler fuses
// no product into a sum in one loop and not in another (the fused multiply-adds below are explicit and the same
// everywhere).
//
// strata::moe_rows: the target step's routed experts, each row's own k experts in top-k order with a fixed order of
// operations of its own (the same promise, without every expert computed for every row), over float32 or bf16
// weights. strata::rows16: the target step's dense products from bf16 weights in fp32 arithmetic, a row's sums in
// a fixed order of its own (the same promise).
//
// strata::int8_head: the MTP chain's vocabulary product from int8 rows, its input quantized to int16, in exact
// integer sums (a draft needs no particular bits; the integers make every code path give the same ones); the same
// product serves the chain's fc, q/k/v and o_proj. strata::int8_head_top adds each row's greedy token and its
// probability; strata::moe_rows8 is the chain's routed experts from int8 rows by the same product.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
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

// a * b + c: one rounding where the CPU fuses it, else two; the same in every loop of a build (the compiler fuses
// nothing by itself: -ffp-contract=off)
inline vf fmadd(vf a, vf b, vf c) {
#if defined(__AVX512F__)
  return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
  return a * b + c;
#endif
}

// a fixed tree: lanes 0..7 + 8..15, then 0..3 + 4..7, ...
inline float hsum(vf v) {
  float a[LANES];
  std::memcpy(a, &v, sizeof(a));
  for (int w = LANES / 2; w > 0; w /= 2)
    for (int i = 0; i < w; ++i) a[i] = a[i] + a[i + w];
  return a[0];
}

// 16 bf16 values as floats (a bf16 is a float's top half: exact)
inline vf load_bf16(const uint16_t* p) {
#if defined(__AVX512F__)
  return (vf)_mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
#else
  vi b;
  for (int i = 0; i < LANES; ++i) b[i] = static_cast<int32_t>(static_cast<uint32_t>(p[i]) << 16);
  return floats(b);
#endif
}

// exp(x) (Cephes' single-precision polynomial, x clamped to [-87.3, 88]), the same operations on every lane
inline vf vexp(vf x) {
  const vf lo = splat(-87.33654f), hi = splat(88.f);
  x = select(x < lo, lo, x);
  x = select(x > hi, hi, x);
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

#if defined(__clang__)
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUF(a, b, ...) __builtin_shuffle(a, b, vi{__VA_ARGS__})
#endif

// four levels of pairwise sums: 16 vectors of 16 partial sums (one per key or output) -> one vector, lane k holding
// vector k's sum; every vector's lanes are summed by the same fixed tree (`add` sums two vectors lane by lane)
template <class Add>
inline vf tree16(vf* a, Add add) {
  vf b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)
    b[i] = add(SHUF(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23),
               SHUF(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31));
  for (int i = 0; i < 4; ++i)
    c[i] = add(SHUF(b[2 * i], b[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27),
               SHUF(b[2 * i], b[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31));
  for (int i = 0; i < 2; ++i)
    d[i] = add(SHUF(c[2 * i], c[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29),
               SHUF(c[2 * i], c[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31));
  return add(SHUF(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30),
             SHUF(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31));
}

inline vf reduce16(vf* a) { return tree16(a, [](vf x, vf y) { return x + y; }); }

// the same on int32 lanes carried in float vectors (the bits moved by the same shuffles, summed as integers)
inline vf reduce16i(vf* a) { return tree16(a, [](vf x, vf y) { return floats(bits(x) + bits(y)); }); }

// 16 values as floats from float or bf16 (uint16_t) storage (a bf16 value is a float's top half: exact)
template <class T>
inline vf load_w(const T* p) {
  if constexpr (std::is_same_v<T, float>) return loadu(p);
  else return load_bf16(p);
}

// one KV head's scores: s[l][j] = q_l . k_j for keys 0..n-1 (rounded up to 16), each a fixed sum: the head's 16-value
// slices multiplied and added in slice order, then the slice's lanes by reduce16's tree. The keys stream through
// once in blocks of 16, every line of the head reading a block from L1.
template <int D, class T>
void head_scores(const float* Q, const T* K, int64_t kr, int64_t n, int64_t slots, int64_t L, float* S,
                 int64_t np) {
  T tail[LANES * D * LANES];
  for (int64_t j0 = 0; j0 < n; j0 += LANES) {
    const T* kb = K + j0 * kr;
    int64_t stride = kr;
    if (j0 + LANES > slots) {                    // the cache's last keys: a zero-padded copy
      std::memset(tail, 0, sizeof(tail));
      for (int64_t j = j0; j < slots; ++j) std::memcpy(tail + (j - j0) * D * LANES, K + j * kr, D * LANES * sizeof(T));
      kb = tail;
      stride = D * LANES;
    } else if (j0 + 2 * LANES <= slots) {
      for (int j = 0; j < LANES; ++j)
        for (int d = 0; d < D; ++d) __builtin_prefetch(kb + (LANES + j) * kr + d * LANES);
    }
    for (int64_t l = 0; l < L; ++l) {
      const float* q = Q + l * D * LANES;
      vf qv[D];
      for (int d = 0; d < D; ++d) qv[d] = loadu(q + d * LANES);
      vf acc[LANES];
      for (int j = 0; j < LANES; ++j) {
        const T* k = kb + j * stride;
        vf a = qv[0] * load_w(k);
        for (int d = 1; d < D; ++d) a = fmadd(qv[d], load_w(k + d * LANES), a);
        acc[j] = a;
      }
      storeu(S + l * np + j0, reduce16(acc));
    }
  }
}

// G lines' outputs (each line's probabilities in pr, row stride np, 1 / their sum in inv): the keys all G lines
// see go once, each value row loaded once for all of them, then each line's own further keys; a line's sum is the
// same fused multiply-adds in key order whatever G is
template <int D, int G, class T>
inline void values_group(const T* V, int64_t vr, const int64_t* n, float* O, const float* pr, int64_t np,
                         const float* inv) {
  vf o[G][D];
  int64_t lo = n[0];
  for (int i = 0; i < G; ++i) {
    lo = std::min(lo, n[i]);
    for (int d = 0; d < D; ++d) o[i][d] = splat(0.f);
  }
  int64_t j = 0;
  for (; j < lo; ++j) {
    const T* vj = V + j * vr;
    if (j + 16 < lo)
      for (int d = 0; d < D; ++d) __builtin_prefetch(vj + 16 * vr + d * LANES);
    vf pj[G];
    for (int i = 0; i < G; ++i) pj[i] = splat(pr[i * np + j]);
    for (int d = 0; d < D; ++d) {
      const vf v = load_w(vj + d * LANES);
      for (int i = 0; i < G; ++i) o[i][d] = fmadd(pj[i], v, o[i][d]);
    }
  }
  for (int i = 0; i < G; ++i) {
    const float* p = pr + i * np;
    for (int64_t jj = j; jj < n[i]; ++jj) {
      const T* vj = V + jj * vr;
      const vf pj = splat(p[jj]);
      for (int d = 0; d < D; ++d) o[i][d] = fmadd(pj, load_w(vj + d * LANES), o[i][d]);
    }
    float* ov = O + i * D * LANES;
    for (int d = 0; d < D; ++d) storeu(ov + d * LANES, o[i][d] * splat(inv[i]));
  }
}

// one KV head: each line's probabilities into pr (row stride np), 1 / their sum into inv, then its output row
template <int D, class T>
void head(const float* S, int64_t sl, int64_t N, const T* V, int64_t vr, const int64_t* n, int64_t L,
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
  // the values: up to G lines share each value row's loads; a line's sum runs over its keys in order either way
  constexpr int G = D <= 4 ? 4 : 2;
  for (int64_t l0 = 0; l0 < L; l0 += G) {
    switch (std::min<int64_t>(G, L - l0)) {
      case 1: values_group<D, 1>(V, vr, n + l0, O + l0 * D * LANES, pr + l0 * np, np, inv + l0); break;
      case 2: values_group<D, 2>(V, vr, n + l0, O + l0 * D * LANES, pr + l0 * np, np, inv + l0); break;
      case 3:
        if constexpr (G > 3) values_group<D, 3>(V, vr, n + l0, O + l0 * D * LANES, pr + l0 * np, np, inv + l0);
        break;
      default:
        if constexpr (G > 3) values_group<D, G>(V, vr, n + l0, O + l0 * D * LANES, pr + l0 * np, np, inv + l0);
        break;
    }
  }
}

// every KV head of every line: scores, softmax and values, the cache's keys and values in float or bf16 (T)
template <class T>
void attend(const float* Q, const T* K, const T* V, int64_t ks, int64_t kr, int64_t vs, int64_t vr,
            const std::vector<int64_t>& n, int64_t nmax, int64_t slots, int64_t nkv, int64_t L, int64_t hd,
            float* O) {
  const int64_t np = (nmax + LANES - 1) / LANES * LANES;
  at::parallel_for(0, nkv, 1, [&](int64_t b, int64_t e) {
    std::vector<float> sc(L * np), inv(L);
    for (int64_t h = b; h < e; ++h) {
      const float* Qh = Q + h * L * hd;
      const T* Kh = K + h * ks;
      const T* Vh = V + h * vs;
      float* Oh = O + h * L * hd;
      switch (hd) {
        case 64:
          head_scores<4>(Qh, Kh, kr, nmax, slots, L, sc.data(), np);
          head<4>(sc.data(), np, np, Vh, vr, n.data(), L, Oh, sc.data(), np, inv.data());
          break;
        case 128:
          head_scores<8>(Qh, Kh, kr, nmax, slots, L, sc.data(), np);
          head<8>(sc.data(), np, np, Vh, vr, n.data(), L, Oh, sc.data(), np, inv.data());
          break;
        default:
          head_scores<16>(Qh, Kh, kr, nmax, slots, L, sc.data(), np);
          head<16>(sc.data(), np, np, Vh, vr, n.data(), L, Oh, sc.data(), np, inv.data());
          break;
      }
    }
  });
}

// q [kv heads, lines, hd] (lines row-major: row r's query heads at r * grp ..), kc and vc [kv heads, slots, hd] the
// cache in float32 or bf16 (both alike; a bf16 cache's values are read as the floats they are, so a row's bits are
// those of the float copy of that cache), seen [rows] each row's position: out [kv heads, lines, hd], each line
// attending over keys 0..its position
at::Tensor window_attention(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& seen,
                            int64_t grp) {
  TORCH_CHECK(q.dim() == 3 && kc.dim() == 3 && vc.dim() == 3 && seen.dim() == 1 && q.size(0) == kc.size(0) &&
              kc.sizes() == vc.sizes() && q.size(2) == kc.size(2), "window_attention: shapes do not match");
  TORCH_CHECK(q.scalar_type() == at::kFloat && (kc.scalar_type() == at::kFloat || kc.scalar_type() == at::kBFloat16) &&
              vc.scalar_type() == kc.scalar_type() && seen.scalar_type() == at::kLong,
              "window_attention takes float32 queries, a float32 or bf16 cache and int64 positions");
  TORCH_CHECK(q.is_contiguous() && kc.stride(2) == 1 && vc.stride(2) == 1 && seen.is_contiguous() && grp > 0 &&
              seen.size(0) * grp == q.size(1), "window_attention: unexpected layout");
  const int64_t nkv = q.size(0), L = q.size(1), hd = q.size(2), slots = kc.size(1);
  TORCH_CHECK(hd == 64 || hd == 128 || hd == 256, "window_attention: head size ", hd, " is not 64, 128 or 256");
  at::Tensor out = at::empty({nkv, L, hd}, q.options());
  const int64_t* P = seen.data_ptr<int64_t>();
  std::vector<int64_t> n(L);
  int64_t nmax = 1;
  for (int64_t l = 0; l < L; ++l) {
    n[l] = P[l / grp] + 1;
    TORCH_CHECK(n[l] >= 1 && n[l] <= slots, "window_attention: a position is outside the cache");
    nmax = std::max(nmax, n[l]);
  }
  const int64_t ks = kc.stride(0), kr = kc.stride(1), vs = vc.stride(0), vr = vc.stride(1);
  if (kc.scalar_type() == at::kFloat)
    attend<float>(q.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(), ks, kr, vs, vr, n, nmax, slots,
                  nkv, L, hd, out.data_ptr<float>());
  else
    attend<uint16_t>(q.data_ptr<float>(), reinterpret_cast<const uint16_t*>(kc.data_ptr<at::BFloat16>()),
                     reinterpret_cast<const uint16_t*>(vc.data_ptr<at::BFloat16>()), ks, kr, vs, vr, n, nmax, slots,
                     nkv, L, hd, out.data_ptr<float>());
  return out;
}

// ---- the routed experts of a window's rows ------------------------------------------------------------------------

// moe_rows's loops for float or bf16 (uint16_t) weights: the same arithmetic on the weights' float values
template <class T>
void moe_rows_impl(const float* X, const T* GU, const T* DN, const float* WT, const int64_t* ID, float* O, int64_t W,
                   int64_t H, int64_t k, int64_t inter, int64_t lg, int64_t ld) {
  const int64_t G = 2 * inter / LANES, D = H / LANES;
  at::parallel_for(0, W, 1, [&](int64_t b, int64_t e) {
    std::vector<vf> g(G), y(D);
    for (int64_t r = b; r < e; ++r) {
      const float* x = X + r * H;
      float* o = O + r * H;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t ex = ID[r * k + j];
        const T* gw = GU + ex * 2 * inter;
        for (int64_t t = 0; t < G; ++t) g[t] = splat(x[0]) * load_w(gw + t * LANES);
        for (int64_t c = 1; c < H; ++c) {
          const vf xc = splat(x[c]);
          const T* row = gw + c * lg;
          for (int64_t t = 0; t < G; ++t) g[t] = fmadd(xc, load_w(row + t * LANES), g[t]);
        }
        const vf wj = splat(WT[r * k + j]);
        float act[4096];
        for (int64_t t = 0; t < G / 2; ++t)            // silu(gate) * up * weight
          storeu(act + t * LANES, g[t] / (splat(1.f) + vexp(splat(0.f) - g[t])) * g[G / 2 + t] * wj);
        const T* dw = DN + ex * inter * ld;
        for (int64_t t = 0; t < D; ++t) y[t] = splat(act[0]) * load_w(dw + t * LANES);
        for (int64_t i = 1; i < inter; ++i) {
          const vf ai = splat(act[i]);
          const T* row = dw + i * ld;
          for (int64_t t = 0; t < D; ++t) y[t] = fmadd(ai, load_w(row + t * LANES), y[t]);
        }
        for (int64_t t = 0; t < D; ++t) storeu(o + t * LANES, j == 0 ? y[t] : loadu(o + t * LANES) + y[t]);
      }
    }
  });
}

// h [W, H] the rows' normed inputs, gu [H, E * 2I] (expert e's gate columns then its up columns from e*2I), dn
// [E * I, H] (expert e's down rows from e*I), idx [W, k] and wt [W, k] the rows' experts and routing weights:
// out [W, H] = for each row, in top-k order, the sum of down_e(silu(gate_e h) * up_e h * weight). The weights are
// in the layout the packages hold them in, float32 or bf16 (rows of outputs: each product is a sum of scaled rows,
// one input value after another in order, 16 outputs a vector). A row's arithmetic is fixed by its own inputs,
// whatever rows share the call: the compiled wide step's lossless promise, without computing every expert for every
// row.
at::Tensor moe_rows(const at::Tensor& h, const at::Tensor& gu, const at::Tensor& dn, const at::Tensor& idx,
                    const at::Tensor& wt, int64_t inter) {
  TORCH_CHECK(h.dim() == 2 && gu.dim() == 2 && dn.dim() == 2 && idx.dim() == 2 && wt.sizes() == idx.sizes() &&
              idx.size(0) == h.size(0) && gu.size(0) == h.size(1) && dn.size(1) == h.size(1) && inter > 0 &&
              gu.size(1) % (2 * inter) == 0 && dn.size(0) * 2 == gu.size(1), "moe_rows: shapes do not match");
  TORCH_CHECK(h.scalar_type() == at::kFloat && wt.scalar_type() == at::kFloat && idx.scalar_type() == at::kLong &&
              (gu.scalar_type() == at::kFloat || gu.scalar_type() == at::kBFloat16) &&
              dn.scalar_type() == gu.scalar_type(), "moe_rows takes float32 rows and weights in float32 or bf16 "
              "(both alike) and int64 expert ids");
  TORCH_CHECK(h.is_contiguous() && gu.stride(1) == 1 && dn.stride(1) == 1 && idx.is_contiguous() &&
              wt.is_contiguous(), "moe_rows: unexpected layout");
  const int64_t W = h.size(0), H = h.size(1), k = idx.size(1), E = gu.size(1) / (2 * inter);
  TORCH_CHECK(H % LANES == 0 && inter % LANES == 0 && inter <= 4096, "moe_rows: the widths must be multiples of 16 "
              "(the experts' at most 4096)");
  const int64_t* ID = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < W * k; ++i) TORCH_CHECK(ID[i] >= 0 && ID[i] < E, "moe_rows: an expert id is out of range");
  at::Tensor out = at::empty({W, H}, h.options());
  const float* X = h.data_ptr<float>();
  const float* WT = wt.data_ptr<float>();
  float* O = out.data_ptr<float>();
  const int64_t lg = gu.stride(0), ld = dn.stride(0);
  if (gu.scalar_type() == at::kFloat)
    moe_rows_impl<float>(X, gu.data_ptr<float>(), dn.data_ptr<float>(), WT, ID, O, W, H, k, inter, lg, ld);
  else
    moe_rows_impl<uint16_t>(X, reinterpret_cast<const uint16_t*>(gu.data_ptr<at::BFloat16>()),
                            reinterpret_cast<const uint16_t*>(dn.data_ptr<at::BFloat16>()), WT, ID, O, W, H, k,
                            inter, lg, ld);
  return out;
}

// ---- products with bf16 weights in fp32 arithmetic -------------------------------------------------------------------

// one k's 64 weights of a block as four vectors of floats, outputs 0-15, 16-31, 32-47, 48-63: each 32 are stored
// interleaved (stored position 2i holds output i, 2i + 1 output 16 + i; runtime/cpu_ops.py `blocks16`), so a
// 32-bit lane's low half is one vector's value and its high half the next's: two bit operations convert 32
inline void load64_bf16(const uint16_t* p, vf* w) {
#if defined(__AVX512F__)
  const __m512i lo = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int c = 0; c < 2; ++c) {
    const __m512i v = _mm512_loadu_si512(p + 32 * c);
    w[2 * c] = (vf)_mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    w[2 * c + 1] = (vf)_mm512_castsi512_ps(_mm512_and_si512(v, lo));
  }
#else
  for (int c = 0; c < 2; ++c) {
    vi a, b;
    for (int i = 0; i < LANES; ++i) {
      a[i] = static_cast<int32_t>(static_cast<uint32_t>(p[32 * c + 2 * i]) << 16);
      b[i] = static_cast<int32_t>(static_cast<uint32_t>(p[32 * c + 2 * i + 1]) << 16);
    }
    w[2 * c] = floats(a);
    w[2 * c + 1] = floats(b);
  }
#endif
}

// G rows (1..6, a compile-time count: the 4 G accumulators and the block row's 4 vectors stay in registers) over
// one block of 64 outputs
template <int G>
inline void rows16_block(const float* X, int64_t K, const uint16_t* blk, float* O, int64_t N) {
  vf acc[G][4];
  {
    vf wv[4];
    load64_bf16(blk, wv);
    for (int i = 0; i < G; ++i) {
      const vf xs = splat(X[i * K]);
      for (int t = 0; t < 4; ++t) acc[i][t] = xs * wv[t];
    }
  }
  for (int64_t k = 1; k < K; ++k) {
    const uint16_t* row = blk + k * 64;
    if (k + 8 < K) __builtin_prefetch(row + 8 * 64);
    vf wv[4];
    load64_bf16(row, wv);
    for (int i = 0; i < G; ++i) {
      const vf xs = splat(X[i * K + k]);
      for (int t = 0; t < 4; ++t) acc[i][t] = fmadd(xs, wv[t], acc[i][t]);
    }
  }
  for (int i = 0; i < G; ++i)
    for (int t = 0; t < 4; ++t) storeu(O + i * N + t * LANES, acc[i][t]);
}

// x [W, K] float, w [N / 64, K, 64] bf16 (x @ w's columns in blocks of 64, each block's K rows contiguous, each
// row's 64 values interleaved by 32 as `load64_bf16` reads them):
// out [W, N] = x @ w in fp32, each output the sum over k in order of x[r, k] * w[k, n] (the first a product, then
// fused multiply-adds), whatever rows share the call: a row's bits are its own (the compiled target step's
// promise). Rows go up to six at a time over a block, sharing its loads.
at::Tensor rows16(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && w.size(2) == 64 && w.size(1) == x.size(1) && x.size(1) >= 1,
              "rows16: shapes do not match");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kBFloat16, "rows16 takes float rows and "
              "bf16 weights");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "rows16: unexpected layout");
  const int64_t W = x.size(0), K = x.size(1), NB = w.size(0), N = NB * 64;
  at::Tensor out = at::empty({W, N}, x.options());
  const float* X = x.data_ptr<float>();
  const uint16_t* Wt = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  float* O = out.data_ptr<float>();
  at::parallel_for(0, NB, 8, [&](int64_t b, int64_t e) {
    for (int64_t nb = b; nb < e; ++nb) {
      const uint16_t* blk = Wt + nb * K * 64;
      for (int64_t r0 = 0; r0 < W;) {
        const int64_t left = W - r0;
        const int64_t g = left <= 6 ? left : left < 10 ? (left + 1) / 2 : 6;     // 7 -> 4 + 3, 9 -> 5 + 4, ...
        const float* xr = X + r0 * K;
        float* o = O + r0 * N + nb * 64;
        switch (g) {
          case 1: rows16_block<1>(xr, K, blk, o, N); break;
          case 2: rows16_block<2>(xr, K, blk, o, N); break;
          case 3: rows16_block<3>(xr, K, blk, o, N); break;
          case 4: rows16_block<4>(xr, K, blk, o, N); break;
          case 5: rows16_block<5>(xr, K, blk, o, N); break;
          default: rows16_block<6>(xr, K, blk, o, N); break;
        }
        r0 += g;
      }
    }
  });
  return out;
}

// ---- int8 products (the MTP chain's) ------------------------------------------------------------------------------

// x[0..H) to int16: its largest magnitude to Q (see int8_head); returns x's scale
inline float quantize16(const float* x, int64_t H, int16_t* xq) {
  const float Q = static_cast<float>(std::min<int64_t>(32767, ((int64_t(1) << 31) - 1) / (127 * H)));
  float amax = 0.f;
  for (int64_t h = 0; h < H; ++h) amax = std::max(amax, std::fabs(x[h]));
  const float sx = amax > 0.f ? amax / Q : 1.f;
  for (int64_t h = 0; h < H; ++h) xq[h] = static_cast<int16_t>(std::nearbyint(x[h] / sx));
  return sx;
}

// out[v] = (xq . w_v) * S[v] * sx for rows v in [b, e) of W [.., H] int8 (H a multiple of 32)
inline void int8_rows(const int16_t* xq, float sx, const int8_t* Wt, const float* S, int64_t H, int64_t b, int64_t e,
                      float* out) {
  int64_t v = b;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  for (; v + LANES <= e; v += LANES) {          // 16 rows at a time, their lane sums by one tree
    vf a[LANES];
    for (int i = 0; i < LANES; ++i) {
      const int8_t* wv = Wt + (v + i) * H;
      __m512i acc = _mm512_setzero_si512();
      for (int64_t h = 0; h < H; h += 32) {
        const __m512i w16 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wv + h)));
        acc = _mm512_dpwssd_epi32(acc, w16, _mm512_loadu_si512(xq + h));
      }
      a[i] = (vf)_mm512_castsi512_ps(acc);
    }
    int32_t t[LANES];
    const vf r16 = reduce16i(a);
    std::memcpy(t, &r16, sizeof(t));
    for (int i = 0; i < LANES; ++i) out[v + i] = static_cast<float>(t[i]) * (S[v + i] * sx);
  }
#endif
  for (; v < e; ++v) {
    const int8_t* wv = Wt + v * H;
    int32_t dot = 0;
    for (int64_t h = 0; h < H; ++h) dot += static_cast<int32_t>(xq[h]) * static_cast<int32_t>(wv[h]);
    out[v] = static_cast<float>(dot) * (S[v] * sx);
  }
}

void check_int8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, const char* name) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && scale.dim() == 1 && x.size(1) == w.size(1) &&
              scale.size(0) == w.size(0), name, ": shapes do not match");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kChar, name, " takes float rows and int8 "
              "weights");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && w.size(1) % 64 == 0 && w.size(1) <= 65536,
              name, ": the rows must be contiguous and a multiple of 64 wide (at most 65536)");
}

// x [n, H] float, w [V, H] int8 rows, scale [V] (bf16 or float): out [n, V] = (x quantized to int16 per row) . w_v,
// in exact int32 sums, times scale_v and x's scale. x's largest magnitude goes to Q = min(32767, (2^31 - 1) /
// (127 H)), so no sum can overflow; 15 bits keep the product within about 1e-4 of the float one (8-bit inputs had
// lowered the pack's prose acceptance). With AVX512-VNNI the products take vpdpwssd (pairs of int16 products
// into int32 lanes); elsewhere a plain loop over the same integers, so every path gives the same bits.
at::Tensor int8_head(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  check_int8(x, w, scale, "int8_head");
  const int64_t n = x.size(0), H = x.size(1), V = w.size(0);
  const at::Tensor sc = scale.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({n, V}, x.options());
  std::vector<int16_t> xq(H);
  for (int64_t r = 0; r < n; ++r) {
    const float sx = quantize16(x.data_ptr<float>() + r * H, H, xq.data());
    float* orow = out.data_ptr<float>() + r * V;
    at::parallel_for(0, V, 256, [&](int64_t b, int64_t e) {
      int8_rows(xq.data(), sx, w.data_ptr<int8_t>(), sc.data_ptr<float>(), H, b, e, orow);
    });
  }
  return out;
}

// int8_head and, per row, its greedy token (the first of equal maxima) and that token's probability at temperature 1
// (1 / the sum of exp(logit - max), Cephes' exp in 16-lane vectors): the MTP chain's draft and its floor statistic
// while the logits are still in cache
std::tuple<at::Tensor, at::Tensor, at::Tensor> int8_head_top(const at::Tensor& x, const at::Tensor& w,
                                                             const at::Tensor& scale) {
  at::Tensor out = int8_head(x, w, scale);
  const int64_t n = out.size(0), V = out.size(1);
  at::Tensor tok = at::empty({n}, x.options().dtype(at::kLong));
  at::Tensor conf = at::empty({n}, x.options());
  for (int64_t r = 0; r < n; ++r) {
    const float* l = out.data_ptr<float>() + r * V;
    int64_t best = 0;
    for (int64_t v = 1; v < V; ++v) best = l[v] > l[best] ? v : best;
    const vf m = splat(l[best]);
    vf sum = splat(0.f);
    int64_t v = 0;
    for (; v + LANES <= V; v += LANES) sum += vexp(loadu(l + v) - m);
    float rest = 0.f;
    for (; v < V; ++v) rest += std::exp(l[v] - l[best]);
    tok.data_ptr<int64_t>()[r] = best;
    conf.data_ptr<float>()[r] = 1.f / (hsum(sum) + rest);
  }
  return {out, tok, conf};
}

// The MTP chain's routed experts from int8 rows: h [W, H] float, gu [E * 2I, H] int8 (expert e's gate rows then its
// up rows from e * 2I) and gus [E * 2I] their scales, dn [E * H, I] int8 (expert e's output rows over its I inputs
// from e * H) and dns [E * H], idx and wt [W, k]: out [W, H] = for each row, the sum over its k experts of
// down_e(silu(gate_e h) * up_e h * weight), each product an int8_head one (the input to int16, exact integer sums).
// Drafts need no particular bits; a quarter of the float experts' bytes.
at::Tensor moe_rows8(const at::Tensor& h, const at::Tensor& gu, const at::Tensor& gus, const at::Tensor& dn,
                     const at::Tensor& dns, const at::Tensor& idx, const at::Tensor& wt, int64_t inter) {
  TORCH_CHECK(h.dim() == 2 && gu.dim() == 2 && dn.dim() == 2 && idx.dim() == 2 && wt.sizes() == idx.sizes() &&
              idx.size(0) == h.size(0) && gu.size(1) == h.size(1) && dn.size(1) == inter && inter > 0 &&
              gu.size(0) % (2 * inter) == 0 && dn.size(0) == gu.size(0) / (2 * inter) * h.size(1) &&
              gus.numel() == gu.size(0) && dns.numel() == dn.size(0), "moe_rows8: shapes do not match");
  TORCH_CHECK(h.scalar_type() == at::kFloat && gu.scalar_type() == at::kChar && dn.scalar_type() == at::kChar &&
              gus.scalar_type() == at::kFloat && dns.scalar_type() == at::kFloat && wt.scalar_type() == at::kFloat &&
              idx.scalar_type() == at::kLong, "moe_rows8 takes float rows, int8 weights with float32 scales and "
              "int64 expert ids");
  TORCH_CHECK(h.is_contiguous() && gu.is_contiguous() && dn.is_contiguous() && gus.is_contiguous() &&
              dns.is_contiguous() && idx.is_contiguous() && wt.is_contiguous(), "moe_rows8: unexpected layout");
  const int64_t W = h.size(0), H = h.size(1), k = idx.size(1), E = gu.size(0) / (2 * inter);
  TORCH_CHECK(H % 32 == 0 && inter % 32 == 0, "moe_rows8: the widths must be multiples of 32");
  const int64_t* ID = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < W * k; ++i) TORCH_CHECK(ID[i] >= 0 && ID[i] < E, "moe_rows8: an expert id is out of range");
  at::Tensor out = at::empty({W, H}, h.options());
  std::memset(out.data_ptr<float>(), 0, sizeof(float) * W * H);
  std::vector<int16_t> xq(H), aq(inter);
  std::vector<float> g(2 * inter), y(H);
  for (int64_t r = 0; r < W; ++r) {
    float* o = out.data_ptr<float>() + r * H;
    const float sx = quantize16(h.data_ptr<float>() + r * H, H, xq.data());
    for (int64_t j = 0; j < k; ++j) {
      const int64_t ex = ID[r * k + j];
      int8_rows(xq.data(), sx, gu.data_ptr<int8_t>() + ex * 2 * inter * H, gus.data_ptr<float>() + ex * 2 * inter, H,
                0, 2 * inter, g.data());
      const float wj = wt.data_ptr<float>()[r * k + j];
      for (int64_t i = 0; i < inter; ++i) g[i] = g[i] / (1.f + std::exp(-g[i])) * g[inter + i] * wj;
      const float sa = quantize16(g.data(), inter, aq.data());
      int8_rows(aq.data(), sa, dn.data_ptr<int8_t>() + ex * H * inter, dns.data_ptr<float>() + ex * H, inter, 0, H,
                y.data());
      for (int64_t t = 0; t < H; ++t) o[t] += y[t];
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(strata, m) {
  m.def("window_attention(Tensor q, Tensor kc, Tensor vc, Tensor seen, int grp) -> Tensor");
  m.def("int8_head(Tensor x, Tensor w, Tensor scale) -> Tensor");
  m.def("moe_rows(Tensor h, Tensor gu, Tensor dn, Tensor idx, Tensor wt, int inter) -> Tensor");
  m.def("int8_head_top(Tensor x, Tensor w, Tensor scale) -> (Tensor, Tensor, Tensor)");
  m.def("rows16(Tensor x, Tensor w) -> Tensor");
  m.def("moe_rows8(Tensor h, Tensor gu, Tensor gus, Tensor dn, Tensor dns, Tensor idx, Tensor wt, int inter) -> "
        "Tensor");
}
TORCH_LIBRARY_IMPL(strata, CPU, m) {
  m.impl("window_attention", &window_attention);
  m.impl("int8_head", &int8_head);
  m.impl("moe_rows", &moe_rows);
  m.impl("int8_head_top", &int8_head_top);
  m.impl("rows16", &rows16);
  m.impl("moe_rows8", &moe_rows8);
}
