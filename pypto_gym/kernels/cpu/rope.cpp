// rope and qk_norm_rope (defs/rope.py): q and k rotated in one pass, position by position.
//
// q, k and the outputs are read as [O, H, I, D] (any strides, last dim contiguous) and cos/sin as
// [P, Oc, I, E] (P = 3 MRoPE planes, or 1), by the strides Python's Layout computes once per kind of
// call (Geometry): the tensors are read where they are, no view made per call. For each position (o, i) the cos/sin row is
// gathered once (MRoPE: column chunk c of the section list, repeated for both halves, from plane c % 3)
// into fp32, then every head of q and of k is rotated with it while it is in L1. The math is the golden's,
// operation by operation: hf rounds each product and the sum to the output dtype (HF's text function),
// fp32 rounds once (its vision function); products are exact in fp32 for fp16/bf16 inputs, and the build
// does not contract a*b+c into an FMA (cpu.py), so both modes are bit-identical to the golden.
// qk_norm_rope normalises each head vector first (the norm's sum of squares differs from torch's in
// order only: within an ulp of the golden).
#include "common.h"

namespace {

// y = x*c + rotate_half(x)*s over the first E columns, the rest copied; X: x's dtype, O: y's. HALF: c and s are
// given for the first half only, the second half's being the same (vLLM's half-width cache: loaded once, one
// buffer half the size; for a head of 32 this was a fifth of the time).
template <class X, class O, bool HF, bool HALF = false>
__attribute__((always_inline)) inline void rotate_head(const typename X::T* x, const float* c, const float* s,
                                                       typename O::T* y, int64_t E, int64_t D) {
  const int64_t h = E / 2;
  const float *c2 = HALF ? c : c + h, *s2 = HALF ? s : s + h;
  int64_t j = 0;
#ifdef PG_SIMD
  for (; j + W <= h; j += W) {
    const V x1 = vload<X>(x + j), x2 = vload<X>(x + h + j);
    const V cj = vgamma(c + j), sj = vgamma(s + j);
    V a = vmul(x1, cj), b = vmul(x2, sj);
    V a2 = vmul(x2, HALF ? cj : vgamma(c2 + j)), b2 = vmul(x1, HALF ? sj : vgamma(s2 + j));
    if (HF) {
      a = vround<O>(a), b = vround<O>(b), a2 = vround<O>(a2), b2 = vround<O>(b2);
    }
    vstore<O>(y + j, vsub(a, b));  // x1*c + (-x2)*s: the negation is exact
    vstore<O>(y + h + j, vadd(a2, b2));
  }
#endif
  for (; j < h; ++j) {
    const float x1 = X::load(x[j]), x2 = X::load(x[h + j]);
    float a = x1 * c[j], b = x2 * s[j], a2 = x2 * c2[j], b2 = x1 * s2[j];
    if (HF) {
      a = round_to<O>(a), b = round_to<O>(b), a2 = round_to<O>(a2), b2 = round_to<O>(b2);
    }
    y[j] = O::store(a - b);
    y[h + j] = O::store(a2 + b2);
  }
  for (int64_t t = E; t < D; ++t) y[t] = O::store(X::load(x[t]));
}

// The layout, as Python's Layout.geometry writes it: O, I, D, E, P, Oc; then H and the (o, h, i) strides
// of q, k and the two outputs; then the (plane, o, i) strides of cos and sin. D and E are contiguous.
struct Geometry {
  const int64_t* g;
  explicit Geometry(const at::Tensor& t) : g(t.data_ptr<int64_t>()) {
    TORCH_CHECK(t.scalar_type() == at::kLong && t.numel() == 28, "rope: geometry of 28 int64 expected");
  }
  int64_t O() const { return g[0]; }
  int64_t I() const { return g[1]; }
  int64_t D() const { return g[2]; }
  int64_t E() const { return g[3]; }
  int64_t P() const { return g[4]; }
  int64_t Oc() const { return g[5]; }
  const int64_t* heads(int which) const { return g + 6 + 4 * which; }  // q, k, out_q, out_k
  const int64_t* angles(int which) const { return g + 22 + 3 * which; }  // cos, sin

  // Every element the layout reaches lies inside its tensor's storage, and the sections cover the angles' E / 2
  // columns: the geometry comes from Python, and a kernel must not trust it with memory (common.h's check_reach).
  void check(const at::Tensor& q, const at::Tensor& k, const at::Tensor& oq, const at::Tensor& ok,
             const at::Tensor& cos, const at::Tensor& sin, const std::vector<int64_t>& sections) const {
    TORCH_CHECK(O() > 0 && I() > 0 && D() > 0 && E() > 0 && E() % 2 == 0 && E() <= D() && Oc() >= 1 && Oc() <= O(),
                "rope: geometry O ", O(), ", I ", I(), ", D ", D(), ", E ", E(), ", Oc ", Oc(), " is not a layout");
    const at::Tensor* tensors[4] = {&q, &k, &oq, &ok};
    const char* names[4] = {"q", "k", "out_q", "out_k"};
    for (int w = 0; w < 4; ++w) {
      const int64_t* h = heads(w);
      TORCH_CHECK(h[0] >= 1 && h[1] >= 0 && h[2] >= 0 && h[3] >= 0, "rope: ", names[w], "'s layout is not a layout");
      check_reach("rope", names[w], *tensors[w], (O() - 1) * h[1] + (h[0] - 1) * h[2] + (I() - 1) * h[3] + D() - 1);
    }
    int64_t half = 0;
    for (int64_t n : sections) {
      TORCH_CHECK(n >= 0, "rope: a negative section");
      half += n;
    }
    TORCH_CHECK(sections.empty() || 2 * half == E(), "rope: sections cover ", 2 * half, " columns of ", E());
    const int64_t planes = sections.empty() ? 1 : std::min<int64_t>(3, 2 * (int64_t)sections.size());
    const at::Tensor* angle[2] = {&cos, &sin};
    for (int w = 0; w < 2; ++w) {
      const int64_t* a = angles(w);
      TORCH_CHECK(a[0] >= 0 && a[1] >= 0 && a[2] >= 0, "rope: the angles' layout is not a layout");
      check_reach("rope", w ? "sin" : "cos", *angle[w], (planes - 1) * a[0] + (Oc() - 1) * a[1] + (I() - 1) * a[2] +
                                                            E() - 1);
    }
  }
};

// One [O, H, I, D] tensor's rows.
struct Heads {
  char* base;
  int64_t H, so, sh, si, itemsize;
  Heads(const at::Tensor& t, const int64_t* g)
      : base((char*)t.data_ptr()), H(g[0]), so(g[1]), sh(g[2]), si(g[3]), itemsize(t.element_size()) {}
  template <class T>
  T* at(int64_t o, int64_t h, int64_t i) const {
    return reinterpret_cast<T*>(base + (o * so + h * sh + i * si) * itemsize);
  }
};

// The cos (or sin) row of one position, merged from its planes into fp32.
struct Angles {
  const at::Tensor& t;
  int64_t sp, so, si, Oc;
  std::vector<int64_t> chunk_plane, chunk_end;
  Angles(const at::Tensor& t_, const int64_t* g, int64_t Oc_, int64_t E, const std::vector<int64_t>& sections)
      : t(t_), sp(g[0]), so(g[1]), si(g[2]), Oc(Oc_) {
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
    const int64_t oc = Oc == 1 ? 0 : o;
    dispatch_dtype(t.scalar_type(), [&](auto ct) {
      using C = decltype(ct);
      using T = typename C::T;
      const T* base = reinterpret_cast<const T*>(t.data_ptr());
      int64_t j = 0;
      for (size_t c = 0; c < chunk_end.size(); ++c) {
        const T* r = base + chunk_plane[c] * sp + oc * so + i * si;
        for (; j < chunk_end[c]; ++j) out[j] = C::load(r[j]);
      }
    });
  }
};

// Calls f(in, out, o, h, i, cos row, sin row, is_q, scratch) for every head of q and of k at every
// position, the position's cos/sin rows merged into fp32 (scratch: D floats); positions are split
// across threads.
template <class F>
void each_head(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin,
               const at::Tensor& oq, const at::Tensor& ok, const Geometry& geo, const std::vector<int64_t>& sections,
               F&& f) {
  const Heads hq(q, geo.heads(0)), hk(k, geo.heads(1)), hoq(oq, geo.heads(2)), hok(ok, geo.heads(3));
  const int64_t O = geo.O(), I = geo.I(), D = geo.D(), E = geo.E();
  const Angles ac(cos, geo.angles(0), geo.Oc(), E, sections), as(sin, geo.angles(1), geo.Oc(), E, sections);
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

// The outputs: those given (views a Layout made), else new tensors laid out like q and k (rope.like).
std::tuple<at::Tensor, at::Tensor> outputs(const at::Tensor& q, const at::Tensor& k, at::ScalarType dq,
                                           at::ScalarType dk, const c10::optional<at::Tensor>& oq,
                                           const c10::optional<at::Tensor>& ok) {
  at::Tensor a = oq.has_value() ? *oq : at::empty_like(q, q.options().dtype(dq));
  at::Tensor b = ok.has_value() ? *ok : at::empty_like(k, k.options().dtype(dk));
  TORCH_CHECK(a.scalar_type() == b.scalar_type() && (a.scalar_type() == q.scalar_type() || a.scalar_type() == at::kFloat),
              "rope: outputs share one dtype, q's or float32");
  return {a, b};
}

std::tuple<at::Tensor, at::Tensor> rope_entry(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                              const at::Tensor& sin, const at::Tensor& geometry,
                                              const std::vector<int64_t>& sections, int64_t mode, at::ScalarType dq,
                                              at::ScalarType dk, const c10::optional<at::Tensor>& out_q,
                                              const c10::optional<at::Tensor>& out_k) {
  auto [oq, ok] = outputs(q, k, dq, dk, out_q, out_k);
  if (q.numel() == 0 || k.numel() == 0) return {oq, ok};
  const Geometry geo(geometry);
  geo.check(q, k, oq, ok, cos, sin, sections);
  const int64_t E = geo.E(), D = geo.D();
  const bool to_float = oq.scalar_type() == at::kFloat && q.scalar_type() != at::kFloat;
  dispatch_dtype(q.scalar_type(), [&](auto xt) {
    using X = decltype(xt);
    using T = typename X::T;
    auto run = [&](auto ot, auto hf) {
      using O = decltype(ot);
      each_head(q, k, cos, sin, oq, ok, geo, sections,
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
  return {oq, ok};
}

// rotary_embedding (vLLM's form): each token's cos and sin read from the [M, E] cache (cos half | sin half) at its
// position (MRoPE: column chunk c of the half from positions' row c; interleaved MRoPE: column j from row 1 or 2
// where j % 3 is 1 or 2 within 3 x that row's section, row 0 elsewhere), rounded to the query dtype in hf mode (vLLM's
// cos.to(x.dtype)), kept half-width (both halves of a head rotate with the same angles); then every head of q and
// k rotated. q, k and the outputs are read and written where they are when [T, H * D] or [T, H, D] with any token
// (and head) stride and D contiguous (vLLM's views of its qkv projection), through a contiguous stand-in
// otherwise; an output may be its input itself: rotate_head reads both halves of a block before writing them (in
// place, as vLLM's kernel). The layouts are sorted out here rather than in Python: at one decode token that Python was a third of
// the call.
bool token_heads_fit(const at::Tensor& t, int64_t D) {
  return (t.dim() == 2 || t.dim() == 3) && t.stride(-1) == 1 && (t.dim() == 3 ? t.size(2) == D : t.size(1) % D == 0);
}

at::Tensor token_heads(const at::Tensor& t, int64_t T, int64_t D) {  // t itself, or a contiguous [T, H, D] copy
  return token_heads_fit(t, D) ? t : t.reshape({T, -1, D}).contiguous();
}

struct TokenHeads {  // one [T, H, D] or [T, H * D] tensor: where head h of token t starts
  char* base;
  int64_t H, st, sh, itemsize;
  TokenHeads(const at::Tensor& t, int64_t D) : base((char*)t.data_ptr()), itemsize(t.element_size()) {
    H = t.dim() == 3 ? t.size(1) : t.size(1) / D;
    st = t.stride(0);
    sh = t.dim() == 3 ? t.stride(1) : D;
  }
  template <class T>
  T* at(int64_t t, int64_t h) const { return reinterpret_cast<T*>(base + (t * st + h * sh) * itemsize); }
};

void rotary_embedding_entry(const at::Tensor& positions_in, const at::Tensor& q_in, const at::Tensor& k_in,
                            const at::Tensor& cache_in, int64_t D, const std::vector<int64_t>& sections,
                            bool interleaved, int64_t mode, const at::Tensor& oq_out, const at::Tensor& ok_out) {
  const at::Tensor positions = positions_in.scalar_type() == at::kLong ? positions_in.contiguous()  // no dispatch
                                                                         : positions_in.to(at::kLong).contiguous();
  const at::Tensor cache = cache_in.contiguous();
  TORCH_CHECK(positions.dim() == 1 || positions.dim() == 2, "rotary_embedding: positions as [T] or [planes, T]");
  TORCH_CHECK(cache.dim() == 2, "rotary_embedding: cos_sin_cache as [M, E]");
  const int64_t T = positions.size(-1), M = cache.size(0), E = cache.size(1), half = E / 2;
  TORCH_CHECK(q_in.size(0) == T && k_in.size(0) == T && E <= D && E % 2 == 0 && D > 0 &&
                  oq_out.sizes() == q_in.sizes() && ok_out.sizes() == k_in.sizes() &&
                  oq_out.scalar_type() == q_in.scalar_type() && ok_out.scalar_type() == q_in.scalar_type() &&
                  k_in.scalar_type() == q_in.scalar_type(),
              "rotary_embedding: q, k and the outputs of one dtype and T tokens, E even and <= D");
  const at::Tensor q = token_heads(q_in, T, D), k = token_heads(k_in, T, D);
  const at::Tensor oq = token_heads(oq_out, T, D), ok = token_heads(ok_out, T, D);
  const TokenHeads hq(q, D), hk(k, D), hoq(oq, D), hok(ok, D);
  std::vector<int64_t> plane(half, 0);  // the positions row each column of the half reads
  if (!sections.empty()) {
    TORCH_CHECK(positions.dim() == 2 && (int64_t)sections.size() == positions.size(0),
                "rotary_embedding: one positions row per section");
    if (interleaved) {  // Qwen3-VL's: vLLM's apply_interleaved_rope, column by column
      TORCH_CHECK(sections.size() == 3, "rotary_embedding: interleaved MRoPE takes 3 sections");
      for (int64_t j = 0; j < half; ++j)
        plane[j] = (j % 3 == 1 && j < 3 * sections[1]) ? 1 : (j % 3 == 2 && j < 3 * sections[2]) ? 2 : 0;
    } else {
      int64_t j = 0;
      for (size_t c = 0; c < sections.size(); ++c)
        for (int64_t n = 0; n < sections[c] && j < half; ++n) plane[j++] = (int64_t)c;
      TORCH_CHECK(j == half, "rotary_embedding: sections must cover E / 2 columns");
    }
  }
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t i = 0; i < positions.numel(); ++i)  // before anything is written: the outputs may be the inputs
    TORCH_CHECK(pos[i] >= 0 && pos[i] < M, "positions: value ", pos[i], " outside the cache's ", M, " rows");
  if (T == 0) return;
  dispatch_dtype(q.scalar_type(), [&](auto xt) {
    using X = decltype(xt);
    using T_ = typename X::T;
    dispatch_dtype(cache.scalar_type(), [&](auto ct) {
      using C = decltype(ct);
      const auto* cp = reinterpret_cast<const typename C::T*>(cache.data_ptr());
      auto run = [&](auto hf) {
        constexpr bool HF = decltype(hf)::value;
        // one chunk under 8K elements (a thread's wake-up costs more), else one even chunk per thread: chunks of a
        // fixed size left one thread with two of three at a few hundred tokens of a small model, and a 32K threshold
        // kept up to 170 tokens of a head-32 model on one thread, 0.96x vLLM's op (which parallelises at any size)
        const int64_t work = T * (hq.H + hk.H) * D, threads = at::get_num_threads();
        at::parallel_for(0, T, work < 8192 ? T : std::max<int64_t>(1, (T + threads - 1) / threads),
                         [&](int64_t b, int64_t e) {
          // local copies: a vector store may alias anything (__m512i is may_alias), so values read through the
          // captured references were reloaded after every store (a third of the time at a head of 32)
          const TokenHeads q_ = hq, k_ = hk, oq_ = hoq, ok_ = hok;
          const int64_t E_ = E, D_ = D, half_ = half;
          const typename C::T* const cp_ = cp;
          const int64_t* const pos_ = pos;
          std::vector<float> buf(E_);  // the half-width cos and sin of one token, in fp32
          float *const c = buf.data(), *const s = c + half_;
          for (int64_t t = b; t < e; ++t) {
            int64_t j = 0;
#ifdef PG_SIMD
            if (sections.empty()) {  // one row: its halves by vectors (a scalar loop here was a fifth of the time)
              const typename C::T* row = cp_ + pos_[t] * E_;
              for (; j + W <= half_; j += W) {
                V cj = vload<C>(row + j), sj = vload<C>(row + half_ + j);
                if (HF) cj = vround<X>(cj), sj = vround<X>(sj);
                vstore<F32>(c + j, cj), vstore<F32>(s + j, sj);
              }
            }
#endif
            for (; j < half_; ++j) {
              const typename C::T* row = cp_ + pos_[plane[j] * T + t] * E_;
              float cj = C::load(row[j]), sj = C::load(row[half_ + j]);
              if (HF) cj = round_to<X>(cj), sj = round_to<X>(sj);
              c[j] = cj, s[j] = sj;
            }
            for (int64_t h = 0; h < q_.H; ++h)
              rotate_head<X, X, HF, true>(q_.at<const T_>(t, h), c, s, oq_.at<T_>(t, h), E_, D_);
            for (int64_t h = 0; h < k_.H; ++h)
              rotate_head<X, X, HF, true>(k_.at<const T_>(t, h), c, s, ok_.at<T_>(t, h), E_, D_);
          }
        });
      };
      if (mode == HF)
        run(std::true_type{});
      else
        run(std::false_type{});
    });
  });
  for (const auto& [o, w] : {std::pair{oq_out, oq}, std::pair{ok_out, ok}})
    if (!w.is_same(o) && !w.is_alias_of(o)) o.copy_(w.reshape(o.sizes()));  // a stand-in's result where it belongs
}

// One head vector normalised into fp32 n: hf rounds x*r and then the weight's product to x's dtype (HF's
// RMSNorm), fp32 keeps x*r*g unrounded. The sum of squares is common.h's (fp32 lanes folded into fp64).
template <class X>
void head_norm(const typename X::T* x, const typename X::T* g, float* n, int64_t D, float eps, bool hf) {
  const float r = 1.0f / std::sqrt((float)(sum_squares<X>(x, D) / D) + eps);
  int64_t t = 0;
#ifdef PG_SIMD
  const V vr = vset(r);
  for (; t + W <= D; t += W) {
    const V v = vmul(vload<X>(x + t), vr), gv = vload<X>(g + t);
    vstore<F32>(n + t, hf ? vround<X>(vmul(gv, vround<X>(v))) : vmul(v, gv));
  }
#endif
  for (; t < D; ++t) {
    const float v = X::load(x[t]) * r;
    n[t] = hf ? round_to<X>(X::load(g[t]) * round_to<X>(v)) : v * X::load(g[t]);
  }
}

// qk_norm_rope: the head vector normalised into fp32 (hf: rounded to x's dtype after x*r and after the
// weight, as HF's RMSNorm), then rotated from there.
std::tuple<at::Tensor, at::Tensor> qk_norm_rope_entry(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& geometry,
    const std::vector<int64_t>& sections, int64_t mode, at::ScalarType dq, at::ScalarType dk, const at::Tensor& qw,
    const at::Tensor& kw, double q_eps, double k_eps, const c10::optional<at::Tensor>& out_q,
    const c10::optional<at::Tensor>& out_k) {
  auto [oq, ok] = outputs(q, k, dq, dk, out_q, out_k);
  TORCH_CHECK(qw.scalar_type() == q.scalar_type() && kw.scalar_type() == q.scalar_type() && qw.is_contiguous() &&
                  kw.is_contiguous(), "qk_norm_rope: contiguous weights in q's dtype expected");
  if (q.numel() == 0 || k.numel() == 0) return {oq, ok};
  const Geometry geo(geometry);
  geo.check(q, k, oq, ok, cos, sin, sections);
  check_vector("qk_norm_rope", "q_weight", qw, geo.D());
  check_vector("qk_norm_rope", "k_weight", kw, geo.D());
  const int64_t E = geo.E(), D = geo.D();
  const bool to_float = oq.scalar_type() == at::kFloat && q.scalar_type() != at::kFloat;
  const bool hf = mode == HF;
  dispatch_dtype(q.scalar_type(), [&](auto xt) {
    using X = decltype(xt);
    using T = typename X::T;
    const T* gq = reinterpret_cast<const T*>(qw.data_ptr());
    const T* gk = reinterpret_cast<const T*>(kw.data_ptr());
    auto run = [&](auto ot, auto hfc) {
      using O = decltype(ot);
      each_head(q, k, cos, sin, oq, ok, geo, sections,
                [&](const Heads& in, const Heads& out, int64_t o, int64_t h, int64_t i, const float* c, const float* s,
                    bool is_q, float* n) {
                  const T* g = is_q ? gq : gk;
                  const float eps = (float)(is_q ? q_eps : k_eps);
                  head_norm<X>(in.at<T>(o, h, i), g, n, D, eps, hf);
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
  return {oq, ok};
}

}  // namespace

PG_KERNELS(rope) {
  m.def("rope", &rope_entry, "rope(q, k, cos, sin, geometry, sections, mode, dtype_q, dtype_k, out_q, out_k) -> "
        "(q_embed, k_embed): into out_q/out_k, or new tensors laid out like q and k when they are None");
  m.def("qk_norm_rope", &qk_norm_rope_entry,
        "qk_norm_rope(q, k, cos, sin, geometry, sections, mode, dtype_q, dtype_k, q_weight, k_weight, q_eps, k_eps, "
        "out_q, out_k) -> (q_embed, k_embed)");
  m.def("rotary_embedding", &rotary_embedding_entry,
        "rotary_embedding(positions, q, k, cos_sin_cache, head_size, sections, interleaved, mode, out_q, out_k): "
        "writes out_q/out_k "
        "(which may be q and k)");
}
