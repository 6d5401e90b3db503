// rope and qk_norm_rope (defs/rope.py): q and k rotated in one pass, position by position.
//
// Python hands over q, k and the outputs as [O, H, I, D] views (any strides, last dim contiguous) and
// cos/sin as [P, Oc, I, E] (P = 3 MRoPE planes, or 1). For each position (o, i) the cos/sin row is
// gathered once (MRoPE: column chunk c of the section list, repeated for both halves, from plane c % 3)
// into fp32, then every head of q and of k is rotated with it while it is in L1. The math is the golden's,
// operation by operation: hf rounds each product and the sum to the output dtype (HF's text function),
// fp32 rounds once (its vision function); products are exact in fp32 for fp16/bf16 inputs, and the build
// does not contract a*b+c into an FMA (cpu.py), so both modes are bit-identical to the golden.
// qk_norm_rope normalises each head vector first (the norm's sum of squares differs from torch's in
// order only: within an ulp of the golden).
#include "common.h"

namespace {

// y = x*c + rotate_half(x)*s over the first E columns, the rest copied; X: x's dtype, O: y's.
template <class X, class O, bool HF>
void rotate_head(const typename X::T* x, const float* c, const float* s, typename O::T* y, int64_t E, int64_t D) {
  const int64_t h = E / 2;
  int64_t j = 0;
#ifdef PG_SIMD
  for (; j + W <= h; j += W) {
    const V x1 = vload<X>(x + j), x2 = vload<X>(x + h + j);
    V a = vmul(x1, vgamma(c + j)), b = vmul(x2, vgamma(s + j));
    V a2 = vmul(x2, vgamma(c + h + j)), b2 = vmul(x1, vgamma(s + h + j));
    if (HF) {
      a = vround<O>(a), b = vround<O>(b), a2 = vround<O>(a2), b2 = vround<O>(b2);
    }
    vstore<O>(y + j, vsub(a, b));  // x1*c + (-x2)*s: the negation is exact
    vstore<O>(y + h + j, vadd(a2, b2));
  }
#endif
  for (; j < h; ++j) {
    const float x1 = X::load(x[j]), x2 = X::load(x[h + j]);
    float a = x1 * c[j], b = x2 * s[j], a2 = x2 * c[h + j], b2 = x1 * s[h + j];
    if (HF) {
      a = round_to<O>(a), b = round_to<O>(b), a2 = round_to<O>(a2), b2 = round_to<O>(b2);
    }
    y[j] = O::store(a - b);
    y[h + j] = O::store(a2 + b2);
  }
  for (int64_t t = E; t < D; ++t) y[t] = O::store(X::load(x[t]));
}

// One [O, H, I, D] tensor's element pointers.
struct Heads {
  char* base;
  int64_t s0, s1, s2, H, itemsize;
  explicit Heads(const at::Tensor& t)
      : base((char*)t.data_ptr()), s0(t.stride(0)), s1(t.stride(1)), s2(t.stride(2)), H(t.size(1)),
        itemsize(t.element_size()) {
    TORCH_CHECK(t.dim() == 4 && (t.size(3) <= 1 || t.stride(3) == 1), "rope: [O, H, I, D] with contiguous D expected");
  }
  template <class T>
  T* at(int64_t o, int64_t h, int64_t i) const {
    return reinterpret_cast<T*>(base + (o * s0 + h * s1 + i * s2) * itemsize);
  }
};

// The cos (or sin) row of one position, merged from its planes into fp32.
struct Angles {
  const at::Tensor& t;  // [P, Oc, I, E]
  std::vector<int64_t> chunk_plane, chunk_end;
  Angles(const at::Tensor& t_, const std::vector<int64_t>& sections) : t(t_) {
    const int64_t E = t.size(3);
    if (sections.empty()) {
      chunk_plane = {0}, chunk_end = {E};
      return;
    }
    int64_t end = 0;
    for (int64_t c = 0; c < 2 * (int64_t)sections.size(); ++c) {
      end += sections[c % sections.size()];
      chunk_plane.push_back(c % 3), chunk_end.push_back(end);
    }
  }
  void row(int64_t o, int64_t i, float* out) const {
    const int64_t oc = t.size(1) == 1 ? 0 : o;
    dispatch_dtype(t.scalar_type(), [&](auto ct) {
      using C = decltype(ct);
      using T = typename C::T;
      const T* base = reinterpret_cast<const T*>(t.data_ptr());
      int64_t j = 0;
      for (size_t c = 0; c < chunk_end.size(); ++c) {
        const T* r = base + chunk_plane[c] * t.stride(0) + oc * t.stride(1) + i * t.stride(2);
        for (; j < chunk_end[c]; ++j) out[j] = C::load(r[j]);
      }
    });
  }
};

// Calls f(in, out, o, h, i, cos row, sin row, is_q, scratch) for every head of q and of k at every
// position, the position's cos/sin rows merged into fp32 (scratch: D floats); positions are split
// across threads.
template <class F>
void each_head(const at::Tensor& q, const at::Tensor& k, const at::Tensor& oq, const at::Tensor& ok,
               const at::Tensor& cos, const at::Tensor& sin, const std::vector<int64_t>& sections, F&& f) {
  const Heads hq(q), hk(k), hoq(oq), hok(ok);
  const Angles ac(cos, sections), as(sin, sections);
  const int64_t O = q.size(0), I = q.size(2), D = q.size(3), E = cos.size(3);
  const int64_t work = (hq.H + hk.H) * D;
  at::parallel_for(0, O * I, std::max<int64_t>(1, 32768 / std::max<int64_t>(work, 1)), [&](int64_t b, int64_t e) {
    std::vector<float> buf(2 * E + D);
    float *c = buf.data(), *s = c + E, *scratch = s + E;
    for (int64_t p = b; p < e; ++p) {
      const int64_t o = p / I, i = p % I;
      ac.row(o, i, c);
      as.row(o, i, s);
      for (int64_t h = 0; h < hq.H; ++h) f(hq, hoq, o, h, i, c, s, true, scratch);
      for (int64_t h = 0; h < hk.H; ++h) f(hk, hok, o, h, i, c, s, false, scratch);
    }
  });
}

void check_outputs(const at::Tensor& q, const at::Tensor& oq, const at::Tensor& ok) {
  TORCH_CHECK(oq.scalar_type() == ok.scalar_type(), "rope: q and k outputs must share a dtype");
  TORCH_CHECK(oq.scalar_type() == q.scalar_type() || oq.scalar_type() == at::kFloat,
              "rope: outputs in q's dtype or float32");
}

// Writes oq, ok (views of the op's outputs).
void rope_entry(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin,
                const at::Tensor& oq, const at::Tensor& ok, const std::vector<int64_t>& sections, int64_t mode) {
  check_outputs(q, oq, ok);
  if (q.numel() + k.numel() == 0) return;
  const int64_t E = cos.size(3), D = q.size(3);
  const bool to_float = oq.scalar_type() == at::kFloat;
  dispatch_dtype(q.scalar_type(), [&](auto xt) {
    using X = decltype(xt);
    using T = typename X::T;
    auto run = [&](auto ot, auto hf) {
      using O = decltype(ot);
      each_head(q, k, oq, ok, cos, sin, sections,
                [&](const Heads& in, const Heads& out, int64_t o, int64_t h, int64_t i, const float* c, const float* s,
                    bool, float*) {
                  rotate_head<X, O, decltype(hf)::value>(in.at<T>(o, h, i), c, s, out.at<typename O::T>(o, h, i), E, D);
                });
    };
    if (to_float)
      run(F32{}, std::true_type{});  // hf with fp32 cos: every step in fp32, as promotion makes it
    else if (mode == HF)
      run(X{}, std::true_type{});
    else
      run(X{}, std::false_type{});
  });
}

// qk_norm_rope: the head vector normalised into fp32 (hf: rounded to x's dtype after x*r and after the
// weight, as HF's RMSNorm), then rotated from there.
void qk_norm_rope_entry(const at::Tensor& q, const at::Tensor& k, const at::Tensor& qw, const at::Tensor& kw,
                        const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& oq, const at::Tensor& ok,
                        const std::vector<int64_t>& sections, double q_eps, double k_eps, int64_t mode) {
  check_outputs(q, oq, ok);
  TORCH_CHECK(qw.scalar_type() == q.scalar_type() && kw.scalar_type() == q.scalar_type() && qw.is_contiguous() &&
                  kw.is_contiguous(), "qk_norm_rope: contiguous weights in q's dtype expected");
  if (q.numel() + k.numel() == 0) return;
  const int64_t E = cos.size(3), D = q.size(3);
  const bool to_float = oq.scalar_type() == at::kFloat;
  const bool hf = mode == HF;
  dispatch_dtype(q.scalar_type(), [&](auto xt) {
    using X = decltype(xt);
    using T = typename X::T;
    const T* gq = reinterpret_cast<const T*>(qw.data_ptr());
    const T* gk = reinterpret_cast<const T*>(kw.data_ptr());
    auto run = [&](auto ot, auto hfc) {
      using O = decltype(ot);
      each_head(q, k, oq, ok, cos, sin, sections,
                [&](const Heads& in, const Heads& out, int64_t o, int64_t h, int64_t i, const float* c, const float* s,
                    bool is_q, float* n) {
                  const T* g = is_q ? gq : gk;
                  const float eps = (float)(is_q ? q_eps : k_eps);
                  const T* x = in.at<T>(o, h, i);
                  double ss = 0.0;
                  for (int64_t t = 0; t < D; ++t) {
                    const double v = X::load(x[t]);
                    ss += v * v;
                  }
                  const float r = 1.0f / std::sqrt((float)(ss / D) + eps);
                  for (int64_t t = 0; t < D; ++t) {
                    const float v = X::load(x[t]) * r;
                    n[t] = hf ? round_to<X>(X::load(g[t]) * round_to<X>(v)) : v * X::load(g[t]);
                  }
                  rotate_head<F32, O, decltype(hfc)::value>(n, c, s, out.at<typename O::T>(o, h, i), E, D);
                });
    };
    if (to_float)
      run(F32{}, std::true_type{});
    else if (hf)
      run(X{}, std::true_type{});
    else
      run(X{}, std::false_type{});
  });
}

}  // namespace

PG_KERNELS(rope) {
  m.def("rope", &rope_entry, "rope(q4, k4, cos4, sin4, out_q4, out_k4, sections, mode): writes the outputs");
  m.def("qk_norm_rope", &qk_norm_rope_entry,
        "qk_norm_rope(q4, k4, q_weight, k_weight, cos4, sin4, out_q4, out_k4, sections, q_eps, k_eps, mode)");
}
