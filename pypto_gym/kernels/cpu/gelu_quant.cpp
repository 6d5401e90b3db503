// gelu_dynamic_quant and gelu_quant (defs/gelu_quant.py): GELU in fp32 rounded once to x's dtype (the tensor the
// module's fc2 would read), times the smooth scale, quantised per row (dynamic) or under one static scale and offset,
// in one pass per row: the activation lives only in a per-thread fp32 scratch row.
//
// The GELU is torch's CPU formula (ATen's GeluKernelImpl), so the rounding to bf16/fp16 lands where torch's does but
// at rare ulp-boundary values: erf form x * 0.5 * (1 + erf(x / sqrt 2)), erf by Abramowitz-Stegun 7.1.26 with exp (the
// polynomial ATen's Vectorized<float>::erf uses, |error| < 1.5e-7); tanh form 0.5 * x * (1 + tanh(b * (x + k x^3))),
// tanh(u) = sign(u) (1 - 2 / (exp(2|u|) + 1)). The scalar tail is ATen's scalar path (std::erf, std::tanh). NaN
// stays NaN (the row's scale NaN, codes 0, as the golden's), an infinite x gives torch's value.
#include "common.h"

namespace {

constexpr float kAlpha = (float)M_SQRT1_2;               // erf form: x / sqrt 2
constexpr float kBeta = (float)(M_SQRT2 * M_2_SQRTPI * 0.5);  // tanh form: sqrt(2 / pi)
constexpr float kKappa = 0.044715f;

template <bool TANH>
inline float gelu1(float x) {
  if (TANH) {
    const float inner = kBeta * (x + kKappa * (x * x * x));
    return 0.5f * x * (1.0f + std::tanh(inner));
  }
  return x * 0.5f * (1.0f + std::erf(x * kAlpha));
}

#ifdef PG_SIMD
inline V verf(V z) {  // Abramowitz-Stegun 7.1.26: 1 - (p1 t + ... + p5 t^5) exp(-z^2), t = 1 / (1 + p |z|)
  const V a = vabs(z), one = vset(1.0f);
  const V t = vdiv(one, vfma(vset(0.3275911f), a, one));
  V r = vfma(vset(1.061405429f), t, vset(-1.453152027f));
  r = vfma(r, t, vset(1.421413741f));
  r = vfma(r, t, vset(-0.284496736f));
  r = vfma(r, t, vset(0.254829592f));
  const V e = vexp(vsub(vset(0.0f), vmul(z, z)));
  return vcopysign(vsub(one, vmul(vmul(e, t), r)), z);
}

inline V vtanh(V u) {
  const V one = vset(1.0f), e = vexp(vmul(vset(2.0f), vabs(u)));
  return vcopysign(vsub(one, vdiv(vset(2.0f), vadd(e, one))), u);
}

template <bool TANH>
inline V vgelu(V x) {
  const V half = vset(0.5f), one = vset(1.0f);
  if (TANH) {
    const V inner = vmul(vset(kBeta), vadd(x, vmul(vset(kKappa), vmul(vmul(x, x), x))));
    return vmul(vmul(half, x), vadd(one, vtanh(inner)));
  }
  return vmul(vmul(x, half), vadd(one, verf(vmul(x, vset(kAlpha)))));
}
#endif

// n = f32(gelu(x) rounded to X) * smooth, into `n`
template <class X, bool TANH>
void gelu_row_f32(const typename X::T* x, const float* smooth, float* n, int64_t D) {
  int64_t i = 0;
#ifdef PG_SIMD
  for (; i + W <= D; i += W) {
    const V a = vround<X>(vgelu<TANH>(vload<X>(x + i)));
    vstore<F32>(n + i, smooth ? vmul(a, vgamma(smooth + i)) : a);
  }
#endif
  for (; i < D; ++i) {
    const float a = round_to<X>(gelu1<TANH>(X::load(x[i])));
    n[i] = smooth ? a * smooth[i] : a;
  }
}

// each row's activation handed to emit(row, values, D): what both entries quantise
template <class Emit>
void gelu_rows(const char* op, const at::Tensor& x_in, const c10::optional<at::Tensor>& smooth_in, bool tanh_form,
               Emit emit) {
  TORCH_CHECK(x_in.dim() >= 1, op, ": x has no dims");
  check_float(op, "x", x_in);
  const int64_t D = x_in.size(-1);
  check_vector(op, "smooth_scales", smooth_in, D);
  const at::Tensor x = x_in.contiguous();
  at::Tensor smooth;
  if (smooth_in.has_value()) smooth = smooth_in->reshape({D}).to(at::kFloat).contiguous();
  const float* sp = smooth.defined() ? smooth.data_ptr<float>() : nullptr;
  scratch_rows(x, [&](auto xt, const auto* xr, float* n, int64_t d) {
    if (tanh_form)
      gelu_row_f32<decltype(xt), true>(xr, sp, n, d);
    else
      gelu_row_f32<decltype(xt), false>(xr, sp, n, d);
  }, emit);
}

std::vector<at::Tensor> gelu_dynamic_quant_entry(const at::Tensor& x, const c10::optional<at::Tensor>& smooth,
                                                 bool tanh_form, double qmax, double qmin) {
  auto row_shape = x.sizes().vec();
  if (!row_shape.empty()) row_shape.pop_back();
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(at::kChar).memory_format(at::MemoryFormat::Contiguous));
  at::Tensor scale = at::empty(row_shape, x.options().dtype(at::kFloat));
  if (y.numel() == 0) return {y, scale};
  int8_t* yp = y.data_ptr<int8_t>();
  float* scp = scale.data_ptr<float>();
  gelu_rows("gelu_dynamic_quant", x, smooth, tanh_form, [&](int64_t r, const float* n, int64_t d) {
    scp[r] = quantize_row(n, d, (float)qmax, (float)qmin, yp + r * d);
  });
  return {y, scale};
}

at::Tensor gelu_quant_entry(const at::Tensor& x, const c10::optional<at::Tensor>& smooth, bool tanh_form,
                            double scale, double offset) {
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(at::kChar).memory_format(at::MemoryFormat::Contiguous));
  if (y.numel() == 0) return y;
  int8_t* yp = y.data_ptr<int8_t>();
  gelu_rows("gelu_quant", x, smooth, tanh_form, [&](int64_t r, const float* n, int64_t d) {
    quantize_row_static(n, d, (float)scale, (float)offset, yp + r * d);
  });
  return y;
}

}  // namespace

PG_KERNELS(gelu_quant) {
  m.def("gelu_dynamic_quant", &gelu_dynamic_quant_entry,
        "gelu_dynamic_quant(x, smooth, tanh_form, qmax, qmin) -> (y int8, scale)");
  m.def("gelu_quant", &gelu_quant_entry, "gelu_quant(x, smooth, tanh_form, scale, offset) -> y int8");
}
