// swiglu and silu_and_mul (defs/swiglu.py): y = silu(gate) * up in one pass over both inputs, no intermediate tensor.
// hf mode rounds silu's result to the input dtype before the multiply (as HF's `act_fn(gate) * up` does),
// fp32 mode rounds once. silu's exp is a polynomial (common.h): within an ulp or two of torch's fp32
// exp, so bf16/fp16 outputs are within 1 ulp of the golden.
#include "common.h"

namespace {

template <class X, bool HF>
void swiglu_row(const typename X::T* g, const typename X::T* u, typename X::T* y, int64_t n) {
  int64_t i = 0;
#ifdef PG_SIMD
  for (; i + W <= n; i += W) {
    V s = vsilu(vload<X>(g + i));
    if (HF) s = vround<X>(s);
    vstore<X>(y + i, vmul(s, vload<X>(u + i)));
  }
#endif
  for (; i < n; ++i) {
    float s = silu1(X::load(g[i]));
    if (HF) s = round_to<X>(s);
    y[i] = X::store(s * X::load(u[i]));
  }
}

// gate and up as [R, I] rows with their own row strides (two halves of one merged GEMM output are views)
at::Tensor swiglu_entry(const at::Tensor& gate_in, const at::Tensor& up_in, int64_t mode) {
  TORCH_CHECK(gate_in.sizes() == up_in.sizes() && gate_in.scalar_type() == up_in.scalar_type(),
              "swiglu: gate and up must have one shape and dtype");
  const int64_t I = gate_in.size(-1);
  at::Tensor y = at::empty(gate_in.sizes(), gate_in.options().memory_format(at::MemoryFormat::Contiguous));
  if (y.numel() == 0) return y;
  auto as_rows = [&](const at::Tensor& t) {
    at::Tensor r = t.reshape({-1, I});
    return r.stride(1) == 1 ? r : r.contiguous();
  };
  const at::Tensor g = as_rows(gate_in), u = as_rows(up_in);
  const int64_t R = g.size(0), gs = g.stride(0), us = u.stride(0);
  dispatch_dtype(g.scalar_type(), [&](auto xt) {
    using X = decltype(xt);
    using T = typename X::T;
    const T* gp = reinterpret_cast<const T*>(g.data_ptr());
    const T* up = reinterpret_cast<const T*>(u.data_ptr());
    T* yp = reinterpret_cast<T*>(y.data_ptr());
    at::parallel_for(0, R, grain_for(I), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        if (mode == HF)
          swiglu_row<X, true>(gp + r * gs, up + r * us, yp + r * I, I);
        else
          swiglu_row<X, false>(gp + r * gs, up + r * us, yp + r * I, I);
      }
    });
  });
  return y;
}

// silu_and_mul: the halves of one merged [..., 2I] tensor, made here (a view each) rather than by the caller: two
// Python slices cost more than a small model's whole activation.
at::Tensor silu_and_mul_entry(const at::Tensor& x, int64_t mode) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0, "silu_and_mul: x's last dim must be even");
  const int64_t I = x.size(-1) / 2;
  return swiglu_entry(x.narrow(-1, 0, I), x.narrow(-1, I, I), mode);
}

}  // namespace

PG_KERNELS(swiglu) {
  m.def("swiglu", &swiglu_entry, "swiglu(gate, up, mode) -> silu(gate) * up");
  m.def("silu_and_mul", &silu_and_mul_entry, "silu_and_mul(x, mode) -> silu(x[..., :I]) * x[..., I:]");
}
