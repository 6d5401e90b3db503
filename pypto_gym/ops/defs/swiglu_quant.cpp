// swiglu_dynamic_quant (defs/swiglu_quant.py): silu(gate) * up, the smooth scale and per-row symmetric
// quantisation in one pass per row: the row's activations live only in a per-thread fp32 scratch row.
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
  TORCH_CHECK(gate_in.sizes() == up_in.sizes() && gate_in.scalar_type() == up_in.scalar_type(),
              "swiglu_dynamic_quant: gate and up must have one shape and dtype");
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

}  // namespace

PG_KERNELS(swiglu_quant) {
  m.def("swiglu_quant", &swiglu_quant_entry, "swiglu_quant(gate, up, smooth, mode, qmax, qmin) -> (y int8, scale)");
}
