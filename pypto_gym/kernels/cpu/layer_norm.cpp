// layer_norm (defs/layer_norm.py): y = (x - mean) * rstd * gamma + beta, one row at a time, no intermediate tensor;
// add_layer_norm (defs/add_layer_norm.py) the same on x1 + x2, its rounded sum written as x_out.
//
// Three passes over a row that stays in L1 after the first: the sum (for the mean), the sum of squared deviations
// from it (a two-pass variance: no cancellation where the mean is large against the spread), the output. Sums are
// kept in fp32 vectors for a block of BLOCK elements, then folded into double accumulators, so the rounding of the
// mean and the variance stays below torch's own fp32 sums (whose order we cannot match bit for bit): outputs within an
// ulp or two of the golden. A NaN or inf in a row makes the whole row NaN, as torch's does.
#include "common.h"

namespace {

template <class X>
double row_sum(const typename X::T* x, int64_t D, float mean, bool deviations) {
  double total = 0.0;
  int64_t i = 0;
#ifdef PG_SIMD
  DAcc acc;
  const V vm = vset(mean);
  while (i + W <= D) {
    const int64_t end = std::min(D - D % W, i + BLOCK);
    V a = vset(0.f);
    for (; i + W <= end; i += W) {
      const V v = vload<X>(x + i);
      if (deviations) {
        const V d = vsub(v, vm);
        a = vfma(d, d, a);
      } else {
        a = vadd(a, v);
      }
    }
    acc.add(a);
  }
  total = acc.sum();
#endif
  for (; i < D; ++i) {
    const float v = X::load(x[i]);
    if (deviations) {
      const float d = v - mean;
      total += (double)d * d;
    } else {
      total += v;
    }
  }
  return total;
}

template <class X>
void norm_row(const typename X::T* xr, typename X::T* yr, int64_t D, const float* g, const float* b, double eps) {
  const float mean = (float)(row_sum<X>(xr, D, 0.f, false) / (double)D);
  const float var = (float)(row_sum<X>(xr, D, mean, true) / (double)D);
  const float rstd = 1.0f / std::sqrt(var + (float)eps);
  int64_t i = 0;
#ifdef PG_SIMD
  const V vm = vset(mean), vr = vset(rstd);
  for (; i + W <= D; i += W)
    vstore<X>(yr + i, vadd(vmul(vmul(vsub(vload<X>(xr + i), vm), vr), vgamma(g + i)), vgamma(b + i)));
#endif
  for (; i < D; ++i) yr[i] = X::store((X::load(xr[i]) - mean) * rstd * g[i] + b[i]);
}

template <class X>
void layer_norm_rows(const at::Tensor& x, const float* g, const float* b, at::Tensor& y, double eps) {
  using T = typename X::T;
  const int64_t D = x.size(-1), R = x.numel() / D;
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  T* yp = reinterpret_cast<T*>(y.data_ptr());
  at::parallel_for(0, R, grain_for(D), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) norm_row<X>(xp + row * D, yp + row * D, D, g, b, eps);
  });
}

// add_layer_norm: x_out = x1 + x2 rounded to the dtype (torch's add), written first; the row then stays in L1 for
// the norm, which reads the rounded sum as HF's block does
template <class X>
void add_layer_norm_rows(const at::Tensor& x1, const at::Tensor& x2, const float* g, const float* b, at::Tensor& y,
                         at::Tensor& x_out, double eps) {
  using T = typename X::T;
  const int64_t D = x1.size(-1), R = x1.numel() / D;
  const T *ap = reinterpret_cast<const T*>(x1.data_ptr()), *bp = reinterpret_cast<const T*>(x2.data_ptr());
  T *yp = reinterpret_cast<T*>(y.data_ptr()), *op = reinterpret_cast<T*>(x_out.data_ptr());
  at::parallel_for(0, R, grain_for(D), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T *ar = ap + row * D, *br = bp + row * D;
      T* orow = op + row * D;
      int64_t i = 0;
#ifdef PG_SIMD
      for (; i + W <= D; i += W) vstore<X>(orow + i, vadd(vload<X>(ar + i), vload<X>(br + i)));
#endif
      for (; i < D; ++i) orow[i] = X::store(X::load(ar[i]) + X::load(br[i]));
      norm_row<X>(orow, yp + row * D, D, g, b, eps);
    }
  });
}

// a per-channel vector as fp32 (`fill` where it is absent: 1 for gamma, 0 for beta)
std::unique_ptr<float[]> vector_f32(const c10::optional<at::Tensor>& t, int64_t D, float fill) {
  std::unique_ptr<float[]> out(new float[D]);
  if (!t.has_value()) {
    std::fill(out.get(), out.get() + D, fill);
    return out;
  }
  at::Tensor v = t->is_contiguous() ? *t : t->contiguous();
  dispatch_dtype(v.scalar_type(), [&](auto vt) {
    using G = decltype(vt);
    auto p = reinterpret_cast<const typename G::T*>(v.data_ptr());
    for (int64_t i = 0; i < D; ++i) out[i] = G::load(p[i]);
  });
  return out;
}

at::Tensor layer_norm_entry(const at::Tensor& x_in, const c10::optional<at::Tensor>& gamma,
                            const c10::optional<at::Tensor>& beta, double eps) {
  check_float("layer_norm", "x", x_in);
  const int64_t D = x_in.size(-1);
  check_vector("layer_norm", "gamma", gamma, D);
  check_vector("layer_norm", "beta", beta, D);
  if (gamma.has_value()) check_float("layer_norm", "gamma", *gamma);
  if (beta.has_value()) check_float("layer_norm", "beta", *beta);
  const at::Tensor x = x_in.is_contiguous() ? x_in : x_in.contiguous();
  at::Tensor y = at::empty(x.sizes(), x.options());
  if (x.numel() > 0) {
    auto g = vector_f32(gamma, D, 1.0f);
    auto b = vector_f32(beta, D, 0.0f);
    dispatch_dtype(x.scalar_type(), [&](auto xt) { layer_norm_rows<decltype(xt)>(x, g.get(), b.get(), y, eps); });
  }
  return y;
}

std::vector<at::Tensor> add_layer_norm_entry(const at::Tensor& x1_in, const at::Tensor& x2_in,
                                             const c10::optional<at::Tensor>& gamma,
                                             const c10::optional<at::Tensor>& beta, double eps) {
  check_float("add_layer_norm", "x1", x1_in);
  check_like("add_layer_norm", "x2", x2_in, x1_in, "x1");
  const int64_t D = x1_in.size(-1);
  check_vector("add_layer_norm", "gamma", gamma, D);
  check_vector("add_layer_norm", "beta", beta, D);
  if (gamma.has_value()) check_float("add_layer_norm", "gamma", *gamma);
  if (beta.has_value()) check_float("add_layer_norm", "beta", *beta);
  const at::Tensor x1 = x1_in.contiguous(), x2 = x2_in.contiguous();
  at::Tensor y = at::empty(x1.sizes(), x1.options()), x_out = at::empty(x1.sizes(), x1.options());
  if (x1.numel() > 0) {
    auto g = vector_f32(gamma, D, 1.0f);
    auto b = vector_f32(beta, D, 0.0f);
    dispatch_dtype(x1.scalar_type(), [&](auto xt) {
      add_layer_norm_rows<decltype(xt)>(x1, x2, g.get(), b.get(), y, x_out, eps);
    });
  }
  return {y, x_out};
}

}  // namespace

PG_KERNELS(layer_norm) {
  m.def("layer_norm", &layer_norm_entry, "layer_norm(x, gamma, beta, eps)");
  m.def("add_layer_norm", &add_layer_norm_entry, "add_layer_norm(x1, x2, gamma, beta, eps) -> (y, x_out)");
}
