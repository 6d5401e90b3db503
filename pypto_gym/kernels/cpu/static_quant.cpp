// static_quant (defs/static_quant.py): x (times the smooth scale, read as fp32 as dynamic_quant reads it) quantised
// under one static scale and offset, one pass per row (common.h's smoothed_rows; the rule is common.h's
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
  int8_t* yp = y.data_ptr<int8_t>();
  smoothed_rows(x, smooth.defined() ? smooth.data_ptr<float>() : nullptr, [&](int64_t r, const float* n, int64_t d) {
    quantize_row_static(n, d, (float)scale, (float)offset, yp + r * d);
  });
  return y;
}

}  // namespace

PG_KERNELS(static_quant) {
  m.def("static_quant", &static_quant_entry, "static_quant(x, smooth, scale, offset) -> y int8");
}
