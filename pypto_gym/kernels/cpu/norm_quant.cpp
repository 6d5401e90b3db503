// rms_norm_dynamic_quant, add_rms_norm_dynamic_quant, rms_norm_quant and add_rms_norm_quant (defs/norm_quant.py):
// the norm, the optional beta and smooth scales, and the quantisation (per row, or static) in one pass per row.
#include "common.h"

namespace {

// ---- n = x / rms(x) * gamma (+ beta) per row (of x, or of x_out = x + x2 written on the way); branch k of
// the row handed to emit(k, row, values): n * smooth_k, or n itself without a smooth scale. The dynamic ops emit
// per-row scales and codes, the static ones codes under one fixed scale.
template <class X, class Emit>
void norm_rows(const at::Tensor& x, const at::Tensor* x2, at::Tensor* xo, const at::Tensor& g, const at::Tensor* beta,
               const at::Tensor* s1, const at::Tensor* s2, int branches, double eps, Emit emit) {
  using T = typename X::T;
  const int64_t D = x.size(-1), R = x.numel() / D;
  auto xp = reinterpret_cast<const T*>(x.data_ptr());
  auto x2p = x2 ? reinterpret_cast<const T*>(x2->data_ptr()) : nullptr;
  auto xop = xo ? reinterpret_cast<T*>(xo->data_ptr()) : nullptr;
  auto gp = reinterpret_cast<const T*>(g.data_ptr());
  auto bp = beta ? reinterpret_cast<const T*>(beta->data_ptr()) : nullptr;
  const T* sp[2] = {s1 ? reinterpret_cast<const T*>(s1->data_ptr()) : nullptr,
                    s2 ? reinterpret_cast<const T*>(s2->data_ptr()) : nullptr};
  const float feps = (float)eps;
  at::parallel_for(0, R, grain_for(D), [&](int64_t begin, int64_t end) {
    std::unique_ptr<float[]> n(new float[D]), m(new float[D]);
    for (int64_t row = begin; row < end; ++row) {
      const T* xr = xp + row * D;
      double squares;
      if (x2p) {
        squares = add_row<X>(xr, x2p + row * D, xop + row * D, D);
        xr = xop + row * D;
      } else {
        squares = sum_squares<X>(xr, D);
      }
      const float rms = std::sqrt((float)(squares / (double)D) + feps);
      for (int64_t i = 0; i < D; ++i) n[i] = X::load(xr[i]) / rms * X::load(gp[i]) + (bp ? X::load(bp[i]) : 0.f);
      for (int b = 0; b < branches; ++b) {
        const float* src = n.get();
        if (sp[b]) {
          for (int64_t i = 0; i < D; ++i) m[i] = n[i] * X::load(sp[b][i]);
          src = m.get();
        }
        emit(b, row, src);
      }
    }
  });
}

// x a float tensor; x2 (the add forms) of x's shape and dtype; gamma and the optional vectors D elements of x's dtype
// (norm_rows reads them as x's storage type)
void check_operands(const char* op, const at::Tensor& x, const c10::optional<at::Tensor>& x2, const at::Tensor& gamma,
                    std::initializer_list<std::pair<const char*, const c10::optional<at::Tensor>*>> vectors) {
  check_float(op, "x", x);
  if (x2.has_value()) check_like(op, "x2", *x2, x, "x1");
  check_vector(op, "gamma", gamma, x.size(-1), x.scalar_type());
  for (const auto& [name, t] : vectors) check_vector(op, name, *t, x.size(-1), x.scalar_type());
}

std::vector<c10::optional<at::Tensor>> quant_entry(const at::Tensor& x_in, const c10::optional<at::Tensor>& x2_in,
                                                   const at::Tensor& gamma, const c10::optional<at::Tensor>& s1_in,
                                                   const c10::optional<at::Tensor>& s2_in,
                                                   const c10::optional<at::Tensor>& beta_in, double eps, double qmax,
                                                   double qmin) {
  TORCH_CHECK(x_in.dim() >= 1, "add_rms_norm_dynamic_quant: x has no dims");
  const int64_t D = x_in.size(-1);
  check_operands("add_rms_norm_dynamic_quant", x_in, x2_in, gamma, {{"smooth_scale1", &s1_in}, {"smooth_scale2", &s2_in},
                                                                    {"beta", &beta_in}});
  auto rows = x_in.sizes().vec();
  rows.pop_back();
  at::Tensor x = x_in.contiguous(), g = gamma.reshape({D}).contiguous();
  at::Tensor x2, xo, s1, s2, beta;
  if (x2_in.has_value()) {
    x2 = x2_in->contiguous();
    xo = at::empty(x.sizes(), x.options());
  }
  if (s1_in.has_value()) s1 = s1_in->reshape({D}).contiguous();
  if (s2_in.has_value()) s2 = s2_in->reshape({D}).contiguous();
  if (beta_in.has_value()) beta = beta_in->reshape({D}).contiguous();
  auto i8 = x.options().dtype(at::kChar);
  auto f32 = x.options().dtype(at::kFloat);
  at::Tensor y1 = at::empty(x.sizes(), i8), sc1 = at::empty(rows, f32), y2, sc2;
  if (s2.defined()) {
    y2 = at::empty(x.sizes(), i8);
    sc2 = at::empty(rows, f32);
  }
  if (x.numel() > 0) {
    int8_t* yp[2] = {y1.data_ptr<int8_t>(), y2.defined() ? y2.data_ptr<int8_t>() : nullptr};
    float* scp[2] = {sc1.data_ptr<float>(), sc2.defined() ? sc2.data_ptr<float>() : nullptr};
    auto emit = [&](int b, int64_t row, const float* v) {
      scp[b][row] = quantize_row(v, D, (float)qmax, (float)qmin, yp[b] + row * D);
    };
    dispatch_dtype(x.scalar_type(), [&](auto xt) {
      norm_rows<decltype(xt)>(x, x2.defined() ? &x2 : nullptr, xo.defined() ? &xo : nullptr, g,
                              beta.defined() ? &beta : nullptr, s1.defined() ? &s1 : nullptr,
                              s2.defined() ? &s2 : nullptr, y2.defined() ? 2 : 1, eps, emit);
    });
  }
  auto opt = [](const at::Tensor& t) { return t.defined() ? c10::optional<at::Tensor>(t) : c10::nullopt; };
  return {y1, opt(y2), opt(xo), sc1, opt(sc2)};
}
// rms_norm_quant / add_rms_norm_quant (x2 given): codes under one static scale and offset (fp32 scalars read
// once per call), and x_out for the add form.
std::vector<c10::optional<at::Tensor>> quant_static_entry(const at::Tensor& x_in,
                                                          const c10::optional<at::Tensor>& x2_in,
                                                          const at::Tensor& gamma,
                                                          const c10::optional<at::Tensor>& beta_in, double eps,
                                                          double scale, double offset) {
  TORCH_CHECK(x_in.dim() >= 1, "add_rms_norm_quant: x has no dims");
  const int64_t D = x_in.size(-1);
  check_operands("add_rms_norm_quant", x_in, x2_in, gamma, {{"beta", &beta_in}});
  at::Tensor x = x_in.contiguous(), g = gamma.reshape({D}).contiguous(), x2, xo, beta;
  if (x2_in.has_value()) {
    x2 = x2_in->contiguous();
    xo = at::empty(x.sizes(), x.options());
  }
  if (beta_in.has_value()) beta = beta_in->reshape({D}).contiguous();
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(at::kChar));
  if (x.numel() > 0) {
    int8_t* yp = y.data_ptr<int8_t>();
    auto emit = [&](int, int64_t row, const float* v) {
      quantize_row_static(v, D, (float)scale, (float)offset, yp + row * D);
    };
    dispatch_dtype(x.scalar_type(), [&](auto xt) {
      norm_rows<decltype(xt)>(x, x2.defined() ? &x2 : nullptr, xo.defined() ? &xo : nullptr, g,
                              beta.defined() ? &beta : nullptr, nullptr, nullptr, 1, eps, emit);
    });
  }
  return {y, xo.defined() ? c10::optional<at::Tensor>(xo) : c10::nullopt};
}
}  // namespace

PG_KERNELS(norm_quant) {
  m.def("quant", &quant_entry, "rms_norm_dynamic_quant / add_rms_norm_dynamic_quant (x2 given)");
  m.def("quant_static", &quant_static_entry, "rms_norm_quant / add_rms_norm_quant (x2 given)");
}
