// static_quant (defs/static_quant.py): x (times the smooth scale, read as fp32 as dynamic_quant reads it) quantised
// under one static scale and offset, one pass per row through a per-thread fp32 scratch row (the rule is common.h's
// quantize_row_static, shared with the static norm ops).
#include "common.h"

namespace {

at::Tensor static_quant_entry(const at::Tensor& x_in, const c10::optional<at::Tensor>& smooth_in, double scale,
                              double offset) {
  const int64_t D = x_in.size(-1);
  at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(at::kChar));
  if (x.numel() == 0) return y;
  at::Tensor smooth;
  if (smooth_in.has_value()) smooth = smooth_in->reshape({D}).to(at::kFloat).contiguous();
  const int64_t R = x.numel() / D;
  int8_t* yp = y.data_ptr<int8_t>();
  dispatch_dtype(x.scalar_type(), [&](auto xt) {
    using X = decltype(xt);
    using T = typename X::T;
    const T* xp = reinterpret_cast<const T*>(x.data_ptr());
    const float* sp = smooth.defined() ? smooth.data_ptr<float>() : nullptr;
    at::parallel_for(0, R, grain_for(D), [&](int64_t begin, int64_t end) {
      std::unique_ptr<float[]> n(new float[D]);
      for (int64_t r = begin; r < end; ++r) {
        const T* xr = xp + r * D;
        int64_t i = 0;
#ifdef PG_SIMD
        for (; i + W <= D; i += W) {
          const V v = vload<X>(xr + i);
          vstore<F32>(n.get() + i, sp ? vmul(v, vload<F32>(sp + i)) : v);
        }
#endif
        for (; i < D; ++i) n[i] = sp ? X::load(xr[i]) * sp[i] : X::load(xr[i]);
        quantize_row_static(n.get(), D, (float)scale, (float)offset, yp + r * D);
      }
    });
  });
  return y;
}

}  // namespace

PG_KERNELS(static_quant) {
  m.def("static_quant", &static_quant_entry, "static_quant(x, smooth, scale, offset) -> y int8");
}
