// dynamic_quant (defs/dynamic_quant.py): x (times the smooth scale) quantised per row, in one pass per row
// through a per-thread fp32 scratch row. The smooth scale may have any float dtype (the golden multiplies
// f32(smooth)): it is read as fp32, converted once per call (D values), never as x's dtype.
#include "common.h"

namespace {

std::vector<at::Tensor> dynamic_quant_entry(const at::Tensor& x_in, const c10::optional<at::Tensor>& smooth_in,
                                            double qmax, double qmin) {
  const int64_t D = x_in.size(-1);
  auto row_shape = x_in.sizes().vec();
  row_shape.pop_back();
  at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(at::kChar));
  at::Tensor scale = at::empty(row_shape, x.options().dtype(at::kFloat));
  if (x.numel() == 0) return {y, scale};
  at::Tensor smooth;
  if (smooth_in.has_value()) smooth = smooth_in->reshape({D}).to(at::kFloat).contiguous();
  int8_t* yp = y.data_ptr<int8_t>();
  float* scp = scale.data_ptr<float>();
  smoothed_rows(x, smooth.defined() ? smooth.data_ptr<float>() : nullptr, [&](int64_t r, const float* n, int64_t d) {
    scp[r] = quantize_row(n, d, (float)qmax, (float)qmin, yp + r * d);
  });
  return {y, scale};
}

}  // namespace

PG_KERNELS(dynamic_quant) {
  m.def("dynamic_quant", &dynamic_quant_entry, "dynamic_quant(x, smooth, qmax, qmin) -> (y int8, scale)");
}
