// quant_matmul's epilogue (defs/quant_matmul.py): the int32 GEMM result dequantised in one pass.
#include "common.h"

namespace {

// ---- W8A8 epilogue: y = T((float(acc) * x_scale[row]) * w_scale[col] (+ float(bias[col]))), one pass.
// The order and roundings of the golden (defs/quant_matmul.py); contraction into FMA is off so that the
// multiply and the bias add round separately, as torch's element-wise ops do.
template <class O, class B>
__attribute__((optimize("fp-contract=off"))) void dequant_impl(const int32_t* acc, const float* xs, const float* ws,
                                                               const typename B::T* bias, typename O::T* out,
                                                               int64_t M, int64_t N) {
  at::parallel_for(0, M, grain_for(N), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int32_t* a = acc + r * N;
      typename O::T* o = out + r * N;
      const float x = xs[r];
      if (bias) {
        for (int64_t i = 0; i < N; ++i) {
          const float v = ((float)a[i] * x) * ws[i];
          o[i] = O::store(v + B::load(bias[i]));
        }
      } else {
        for (int64_t i = 0; i < N; ++i) o[i] = O::store(((float)a[i] * x) * ws[i]);
      }
    }
  });
}

at::Tensor dequant_entry(const at::Tensor& acc_in, const at::Tensor& xs_in, const at::Tensor& ws_in,
                         const c10::optional<at::Tensor>& bias_in, at::ScalarType out_t) {
  TORCH_CHECK(acc_in.dim() == 2 && acc_in.scalar_type() == at::kInt, "dequant: acc must be int32 [M, N]");
  const int64_t M = acc_in.size(0), N = acc_in.size(1);
  at::Tensor acc = acc_in.contiguous(), xs = xs_in.reshape({M}).contiguous(), ws = ws_in.reshape({N}).contiguous();
  TORCH_CHECK(xs.scalar_type() == at::kFloat && ws.scalar_type() == at::kFloat, "dequant: scales must be float32");
  at::Tensor bias;
  if (bias_in.has_value()) {
    bias = bias_in->reshape({N}).contiguous();
    TORCH_CHECK(bias.numel() == N, "dequant: bias must have N elements");
  }
  at::Tensor out = at::empty({M, N}, acc.options().dtype(out_t));
  if (M * N == 0) return out;
  dispatch_dtype(out_t, [&](auto ot) {
    using O = decltype(ot);
    auto op = reinterpret_cast<typename O::T*>(out.data_ptr());
    if (!bias.defined()) {
      dequant_impl<O, F32>(acc.data_ptr<int32_t>(), xs.data_ptr<float>(), ws.data_ptr<float>(), nullptr, op, M, N);
      return;
    }
    dispatch_dtype(bias.scalar_type(), [&](auto bt) {
      using B = decltype(bt);
      dequant_impl<O, B>(acc.data_ptr<int32_t>(), xs.data_ptr<float>(), ws.data_ptr<float>(),
                         reinterpret_cast<const typename B::T*>(bias.data_ptr()), op, M, N);
    });
  });
  return out;
}

}  // namespace

PG_KERNELS(quant_matmul) {
  m.def("dequant", &dequant_entry, "W8A8 epilogue: (acc * x_scale) * w_scale (+ bias), as out dtype");
}
