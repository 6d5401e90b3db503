// swiglu_dynamic_quant and dequant_swiglu_quant (defs/swiglu_quant.py): silu(gate) * up, the smooth scale and
// per-row symmetric quantisation in one pass per row: the row's activations live only in a per-thread fp32
// scratch row.
#include "common.h"

namespace {

// n = swiglu(gate, up) (HF rounding or fp32) * smooth, as fp32, into `n`
template <class X, bool HF>
void swiglu_row_f32(const typename X::T* g, const typename X::T* u, const float* smooth, float* n, int64_t I) {
  int64_t i = 0;
#ifdef PG_SIMD
  for (; i + W <= I; i += W) {
    V s = vsilu(vload<X>(g + i));
    if (HF) s = vround<X>(s);
    V p = vmul(s, vload<X>(u + i));
    if (HF) p = vround<X>(p);
    vstore<F32>(n + i, smooth ? vmul(p, vgamma(smooth + i)) : p);
  }
#endif
  for (; i < I; ++i) {
    float s = silu1(X::load(g[i]));
    if (HF) s = round_to<X>(s);
    float p = s * X::load(u[i]);
    if (HF) p = round_to<X>(p);
    n[i] = smooth ? p * smooth[i] : p;
  }
}

std::vector<at::Tensor> swiglu_quant_entry(const at::Tensor& gate_in, const at::Tensor& up_in,
                                           const c10::optional<at::Tensor>& smooth_in, int64_t mode, double qmax,
                                           double qmin) {
  TORCH_CHECK(gate_in.dim() >= 1, "swiglu_dynamic_quant: gate has no dims");
  check_like("swiglu_dynamic_quant", "up", up_in, gate_in, "gate");
  const int64_t I = gate_in.size(-1);
  auto row_shape = gate_in.sizes().vec();
  row_shape.pop_back();
  at::Tensor y =
      at::empty(gate_in.sizes(), gate_in.options().dtype(at::kChar).memory_format(at::MemoryFormat::Contiguous));
  at::Tensor scale = at::empty(row_shape, gate_in.options().dtype(at::kFloat));
  if (y.numel() == 0) return {y, scale};
  auto as_rows = [&](const at::Tensor& t) {  // the two halves of a merged gate_up GEMM are strided views
    at::Tensor r = t.reshape({-1, I});
    return r.stride(1) == 1 ? r : r.contiguous();
  };
  const at::Tensor g = as_rows(gate_in), u = as_rows(up_in);
  at::Tensor smooth;
  if (smooth_in.has_value()) smooth = smooth_in->reshape({I}).to(at::kFloat).contiguous();
  const float* sp = smooth.defined() ? smooth.data_ptr<float>() : nullptr;
  const int64_t R = g.size(0), gs = g.stride(0), us = u.stride(0);
  int8_t* yp = y.data_ptr<int8_t>();
  float* scp = scale.data_ptr<float>();
  dispatch_dtype(g.scalar_type(), [&](auto xt) {
    using X = decltype(xt);
    using T = typename X::T;
    const T* gp = reinterpret_cast<const T*>(g.data_ptr());
    const T* upp = reinterpret_cast<const T*>(u.data_ptr());
    at::parallel_for(0, R, grain_for(I), [&](int64_t begin, int64_t end) {
      std::unique_ptr<float[]> n(new float[I]);
      for (int64_t r = begin; r < end; ++r) {
        if (mode == HF)
          swiglu_row_f32<X, true>(gp + r * gs, upp + r * us, sp, n.get(), I);
        else
          swiglu_row_f32<X, false>(gp + r * gs, upp + r * us, sp, n.get(), I);
        scp[r] = quantize_row(n.get(), I, (float)qmax, (float)qmin, yp + r * I);
      }
    });
  });
  return {y, scale};
}

// dequant_swiglu_quant: an int32 GEMM output [R, 2H] dequantised (acc * weight_scale * activation_scale, + bias),
// silu of one half times the other, times the smooth scale, quantised per row: one pass per row, as
// swiglu_quant above (the row lives in the per-thread fp32 scratch row)
template <bool LEFT>
void dequant_swiglu_row(const int32_t* acc, const float* ws, float as, const float* bias, const float* qs, float* n,
                        int64_t H) {
  const int32_t* ga = LEFT ? acc : acc + H;  // the half that is activated
  const int32_t* ua = LEFT ? acc + H : acc;
  const float* gw = LEFT ? ws : ws + H;
  const float* uw = LEFT ? ws + H : ws;
  const float* gb = bias ? (LEFT ? bias : bias + H) : nullptr;
  const float* ub = bias ? (LEFT ? bias + H : bias) : nullptr;
  int64_t i = 0;
#ifdef PG_SIMD
  const V va = vset(as);
  for (; i + W <= H; i += W) {
    V g = vmul(vmul(vload_i32(ga + i), vgamma(gw + i)), va);
    V u = vmul(vmul(vload_i32(ua + i), vgamma(uw + i)), va);
    if (bias) {
      g = vadd(g, vgamma(gb + i));
      u = vadd(u, vgamma(ub + i));
    }
    V p = vmul(vsilu(g), u);
    vstore<F32>(n + i, qs ? vmul(p, vgamma(qs + i)) : p);
  }
#endif
  for (; i < H; ++i) {
    float g = (float)ga[i] * gw[i] * as, u = (float)ua[i] * uw[i] * as;
    if (bias) {
      g += gb[i];
      u += ub[i];
    }
    const float p = silu1(g) * u;
    n[i] = qs ? p * qs[i] : p;
  }
}

std::vector<at::Tensor> dequant_swiglu_quant_entry(const at::Tensor& x_in, const at::Tensor& weight_scale,
                                                   const at::Tensor& activation_scale,
                                                   const c10::optional<at::Tensor>& bias_in,
                                                   const c10::optional<at::Tensor>& quant_scale_in, bool activate_left,
                                                   double qmax, double qmin) {
  TORCH_CHECK(x_in.dim() >= 1 && x_in.scalar_type() == at::kInt && x_in.size(-1) % 2 == 0,
              "dequant_swiglu_quant: x must be int32 [..., N] with N even, got ", x_in.sizes(), " ", x_in.scalar_type());
  const int64_t N = x_in.size(-1), H = N / 2;
  TORCH_CHECK(activation_scale.numel() == x_in.numel() / std::max<int64_t>(N, 1), "dequant_swiglu_quant: ",
              "activation_scale has ", activation_scale.numel(), " elements; expected one per row of x");
  auto row_shape = x_in.sizes().vec();
  row_shape.pop_back();
  auto out_shape = row_shape;
  out_shape.push_back(H);
  at::Tensor y = at::empty(out_shape, x_in.options().dtype(at::kChar));
  at::Tensor scale = at::empty(row_shape, x_in.options().dtype(at::kFloat));
  if (y.numel() == 0) return {y, scale};
  const at::Tensor x = x_in.reshape({-1, N}).contiguous();
  const at::Tensor ws = weight_scale.reshape({N}).to(at::kFloat).contiguous();
  const at::Tensor as = activation_scale.reshape({-1}).to(at::kFloat).contiguous();
  at::Tensor bias, qs;
  if (bias_in.has_value()) bias = bias_in->reshape({N}).to(at::kFloat).contiguous();
  if (quant_scale_in.has_value()) qs = quant_scale_in->reshape({H}).to(at::kFloat).contiguous();
  const int32_t* xp = x.data_ptr<int32_t>();
  const float* wsp = ws.data_ptr<float>();
  const float* asp = as.data_ptr<float>();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  const float* qsp = qs.defined() ? qs.data_ptr<float>() : nullptr;
  int8_t* yp = y.data_ptr<int8_t>();
  float* scp = scale.data_ptr<float>();
  const int64_t R = x.size(0);
  at::parallel_for(0, R, grain_for(N), [&](int64_t begin, int64_t end) {
    std::unique_ptr<float[]> n(new float[H]);
    for (int64_t r = begin; r < end; ++r) {
      if (activate_left)
        dequant_swiglu_row<true>(xp + r * N, wsp, asp[r], bp, qsp, n.get(), H);
      else
        dequant_swiglu_row<false>(xp + r * N, wsp, asp[r], bp, qsp, n.get(), H);
      scp[r] = quantize_row(n.get(), H, (float)qmax, (float)qmin, yp + r * H);
    }
  });
  return {y, scale};
}

}  // namespace

PG_KERNELS(swiglu_quant) {
  m.def("swiglu_quant", &swiglu_quant_entry, "swiglu_quant(gate, up, smooth, mode, qmax, qmin) -> (y int8, scale)");
  m.def("dequant_swiglu_quant", &dequant_swiglu_quant_entry,
        "dequant_swiglu_quant(x int32, weight_scale, activation_scale, bias, quant_scale, left, qmax, qmin)");
}
