// rms_norm and add_rms_norm (defs/rms_norm.py): one pass per row, no intermediate tensor.
//
// Each row is read twice: once for the sum of squares, once for the output (the row is in L1 by
// then), while the next row is prefetched. Sums of squares are blocked: a few hundred squares per
// float lane, then each block is folded into double accumulators, so the rounding error of the
// variance stays below torch's own (whose order we cannot match bit for bit anyway). Outputs differ
// from the golden only where the variance differs in its last bit (at most 1 ulp of the output dtype).
#include "common.h"

namespace {

#if defined(__AVX512BF16__) && defined(PG_SIMD512)
// bf16 in, bf16 out, 32 elements a step. Widening with unpacklo/hi_epi16 (one instruction per 16
// floats instead of a zero-extend and a shift) leaves the floats in a lane-local order; gamma is
// permuted into that order once per call, and one vpermw restores the natural order at the store.
// In hf mode the products are rounded to bf16 with one vcvtne2ps2bf16 and widened again, which
// permutes once more (order Q instead of P). The next row's squares: vdpbf16ps, 32 a step
// (bf16*bf16 is exact in fp32). About a third fewer instructions than the generic path.
#define PG_BF16_BLOCKS 1
struct Bf16Blocks {
  int lo[16], hi[16];  // element (0..31) held by lane j of the low / high float vector
  uint16_t store_index[32];
  explicit Bf16Blocks(bool twice) {
    int p[32];  // slot -> element after one widening and packing
    for (int k = 0; k < 4; ++k)
      for (int t = 0; t < 4; ++t) lo[4 * k + t] = 8 * k + t, hi[4 * k + t] = 8 * k + 4 + t;
    if (twice) {
      for (int j = 0; j < 16; ++j) p[j] = lo[j], p[16 + j] = hi[j];
      for (int k = 0; k < 4; ++k)
        for (int t = 0; t < 4; ++t) lo[4 * k + t] = p[8 * k + t], hi[4 * k + t] = p[8 * k + 4 + t];
    }
    for (int j = 0; j < 16; ++j) store_index[lo[j]] = j, store_index[hi[j]] = 16 + j;
  }
  void permute(const float* g, float* out, int64_t D) const {  // gamma in lane order, whole blocks of 32
    for (int64_t b = 0; b + 32 <= D; b += 32)
      for (int j = 0; j < 16; ++j) out[b + j] = g[b + lo[j]], out[b + 16 + j] = g[b + hi[j]];
  }
};

// Whole blocks of 32; returns the number of elements done. gq: gamma in the blocks' lane order.
inline int64_t bf16_row_blocks(const uint16_t* x, const float* gq, uint16_t* y, int64_t D, float r, bool hf,
                               const uint16_t* next, DAcc& acc) {
  static const Bf16Blocks once(false), twice(true);
  const Bf16Blocks& blocks = hf ? twice : once;
  const __m512 vr = _mm512_set1_ps(r);
  const __m512i z = _mm512_setzero_si512();
  const __m512i idx = _mm512_loadu_si512((const void*)blocks.store_index);
  auto step = [&](int64_t i) {
    __m512i v = _mm512_loadu_si512((const void*)(x + i));
    __m512 lo = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(z, v)), vr);
    __m512 hi = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(z, v)), vr);
    if (hf) {  // HF casts x * r to bf16 before the weight
      __m512i p = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
      lo = _mm512_castsi512_ps(_mm512_unpacklo_epi16(z, p));
      hi = _mm512_castsi512_ps(_mm512_unpackhi_epi16(z, p));
    }
    __m512i o = (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, _mm512_loadu_ps(gq + i + 16)),
                                             _mm512_mul_ps(lo, _mm512_loadu_ps(gq + i)));
    _mm512_storeu_si512((void*)(y + i), _mm512_permutexvar_epi16(idx, o));
  };
  auto square = [&](__m512 a, int64_t i) {
    __m512bh n = (__m512bh)_mm512_loadu_si512((const void*)(next + i));
    return _mm512_dpbf16_ps(a, n, n);
  };
  int64_t i = 0;
  while (i + 32 <= D) {
    const int64_t end = std::min(D - D % 32, i + BLOCK);
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    if (next) {
      for (; i + 64 <= end; i += 64) {
        step(i);
        step(i + 32);
        a0 = square(a0, i);
        a1 = square(a1, i + 32);
      }
      for (; i + 32 <= end; i += 32) {
        step(i);
        a0 = square(a0, i);
      }
      acc.add(_mm512_add_ps(a0, a1));
    } else {
      for (; i + 32 <= end; i += 32) step(i);
    }
  }
  return i;
}
#endif

// One row of output, and the sum of squares of `next` (the following row, or null) in the same pass.
// hf:   y = O(g * R(x * r))        fp32: y = R((x * r) * g)        (O: output dtype, R: the inputs' dtype,
// X's own, or bf16/fp16 when x is the fp32 sum of two such rows: add_rms_norm's fp32_sum)
// gq: gamma in the bf16 block order (bf16 in and out on AVX512-BF16), else null.
// FINITE: the row and gamma are finite, so no NaN can appear and the roundings skip their NaN checks.
template <class X, class O, bool FINITE, class R = X>
double norm_row(const typename X::T* x, const float* g, typename O::T* y, int64_t D, float r, bool hf,
                const typename X::T* next, const float* gq) {
  double total = 0.0;
  int64_t i = 0;
#ifdef PG_SIMD
  DAcc acc;
#ifdef PG_BF16_BLOCKS
  if constexpr (std::is_same_v<X, BF16> && std::is_same_v<O, BF16>) {
    if (gq) i = bf16_row_blocks(x, gq, y, D, r, hf, next, acc);
  }
#endif
  const V vr = vset(r);
  auto out = [&](int64_t j) {
    return hf ? vmul(vgamma(g + j), vround_t<R, FINITE>(vmul(vload<X>(x + j), vr)))
              : vmul(vmul(vload<X>(x + j), vr), vgamma(g + j));
  };
  while (i + W <= D) {
    const int64_t end = std::min(D - D % W, i + BLOCK);
    V a0 = vset(0.f), a1 = vset(0.f);
    for (; i + 2 * W <= end; i += 2 * W) {
      vstore2_t<O, FINITE>(y + i, out(i), out(i + W));
      if (next) {
        V n0 = vload<X>(next + i), n1 = vload<X>(next + i + W);
        a0 = vfma(n0, n0, a0);
        a1 = vfma(n1, n1, a1);
      }
    }
    for (; i + W <= end; i += W) {
      vstore<O>(y + i, out(i));
      if (next) {
        V n0 = vload<X>(next + i);
        a0 = vfma(n0, n0, a0);
      }
    }
    if (next) acc.add(vadd(a0, a1));
  }
  total = acc.sum();
#endif
  for (; i < D; ++i) {
    y[i] = hf ? O::store(g[i] * round_to<R>(X::load(x[i]) * r)) : O::store(X::load(x[i]) * r * g[i]);
    if (next) {
      const double v = X::load(next[i]);
      total += v * v;
    }
  }
  return total;
}


// cast_mode "none": every step rounded to the input dtype T (the golden _rms_norm_no_cast, defs/rms_norm.py):
// var = T(sum(T(x^2)) / D); r = T(1 / sqrt(T(var + eps))); y = T(T(g) * T(x * r)).
template <class X>
float no_cast_rsqrt(const typename X::T* x, int64_t D, float eps) {
  double s = 0.0;
  for (int64_t i = 0; i < D; ++i) {
    const float v = X::load(x[i]);
    s += round_to<X>(v * v);
  }
  const float var = round_to<X>((float)(s / (double)D));
  return round_to<X>(1.0f / std::sqrt(round_to<X>(var + eps)));
}

// add_rms_norm's fp32_sum: s = f32(a) + f32(b) kept in fp32 for the norm, its rounding written as the
// residual; returns the sum of squares of s.
template <class X>
double add_row_f32(const typename X::T* a, const typename X::T* b, typename X::T* o, float* s, int64_t D) {
  double total = 0.0;
  int64_t i = 0;
#ifdef PG_SIMD
  DAcc acc;
  while (i + W <= D) {
    const int64_t end = std::min(D - D % W, i + BLOCK);
    V a0 = vset(0.f);
    for (; i + W <= end; i += W) {
      const V v = vadd(vload<X>(a + i), vload<X>(b + i));
      vstore<F32>(s + i, v);
      vstore<X>(o + i, v);
      a0 = vfma(v, v, a0);
    }
    acc.add(a0);
  }
  total = acc.sum();
#endif
  for (; i < D; ++i) {
    s[i] = X::load(a[i]) + X::load(b[i]);
    o[i] = X::store(s[i]);
    total += (double)s[i] * s[i];
  }
  return total;
}

template <class X, class O>
void norm_rows(const at::Tensor& x, const at::Tensor* x2, at::Tensor* xo, const float* g, at::Tensor& y, double eps,
               int64_t mode, bool fp32_sum) {
  using T = typename X::T;
  const int64_t D = x.size(-1), R = x.numel() / D;
  const float* gq = nullptr;  // gamma in bf16 block order, where that path applies (not worth it for one row)
#ifdef PG_BF16_BLOCKS
  std::unique_ptr<float[]> gq_buf;
  if constexpr (std::is_same_v<X, BF16> && std::is_same_v<O, BF16>) {
    if (D >= 32 && R >= 4) {
      gq_buf.reset(new float[D - D % 32]);
      Bf16Blocks(mode != FP32).permute(g, gq_buf.get(), D);
      gq = gq_buf.get();
    }
  }
#endif
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  const T* x2p = x2 ? reinterpret_cast<const T*>(x2->data_ptr()) : nullptr;
  T* xop = xo ? reinterpret_cast<T*>(xo->data_ptr()) : nullptr;
  auto yp = reinterpret_cast<typename O::T*>(y.data_ptr());
  const float feps = (float)eps;
  const bool hf = mode != FP32;  // "none" writes like hf, with r and gamma already in T
  const bool g_finite = std::all_of(g, g + D, [](float v) { return std::isfinite(v); });
  if (fp32_sum && x2p && !std::is_same_v<X, F32>) {  // the norm reads the fp32 sum (one row of it per thread)
    at::parallel_for(0, R, grain_for(D), [&](int64_t begin, int64_t end) {
      std::vector<float> sum(D);
      for (int64_t row = begin; row < end; ++row) {
        const double squares = add_row_f32<X>(xp + row * D, x2p + row * D, xop + row * D, sum.data(), D);
        const float r = 1.0f / std::sqrt((float)(squares / (double)D) + feps);
        norm_row<F32, O, false, X>(sum.data(), g, yp + row * D, D, r, hf, nullptr, nullptr);
      }
    });
    return;
  }
  at::parallel_for(0, R, grain_for(D), [&](int64_t begin, int64_t end) {
    double squares = 0.0;  // of the current row, summed while the previous row was written
    for (int64_t row = begin; row < end; ++row) {
      const T* xr = xp + row * D;
      if (x2p) {
        squares = add_row<X>(xr, x2p + row * D, xop + row * D, D);
        xr = xop + row * D;
      } else if (row == begin && mode != NONE) {
        squares = sum_squares<X>(xr, D);
      }
      const float r = mode == NONE ? no_cast_rsqrt<X>(xr, D, feps)
                                   : 1.0f / std::sqrt((float)(squares / (double)D) + feps);
      const T* next = (!x2p && mode != NONE && row + 1 < end) ? xp + (row + 1) * D : nullptr;
      if (g_finite && std::isfinite(squares) && std::isfinite(r) && r > 0.f)  // no NaN can appear in this row
        squares = norm_row<X, O, true>(xr, g, yp + row * D, D, r, hf, next, gq);
      else
        squares = norm_row<X, O, false>(xr, g, yp + row * D, D, r, hf, next, gq);
    }
  });
}

// gamma as fp32, once per call (ones without gamma: 1 * v == v exactly); in "none" mode rounded to T first
template <class X>
std::unique_ptr<float[]> gamma_f32(const c10::optional<at::Tensor>& gamma, int64_t D, int64_t mode) {
  std::unique_ptr<float[]> out(new float[D]);
  if (!gamma.has_value()) {
    std::fill(out.get(), out.get() + D, 1.0f);
    return out;
  }
  at::Tensor g = gamma->is_contiguous() ? *gamma : gamma->contiguous();
  dispatch_dtype(g.scalar_type(), [&](auto gt) {
    using G = decltype(gt);
    auto p = reinterpret_cast<const typename G::T*>(g.data_ptr());
    for (int64_t i = 0; i < D; ++i) out[i] = mode == NONE ? round_to<X>(G::load(p[i])) : G::load(p[i]);
  });
  return out;
}

// rms_norm (x2 undefined) and add_rms_norm (x2 given, returns x_out too)
std::tuple<at::Tensor, at::Tensor> norm_entry(const at::Tensor& x_in, const c10::optional<at::Tensor>& x2_in,
                                              const c10::optional<at::Tensor>& gamma, double eps, int64_t mode,
                                              bool fp32_sum) {
  const int64_t D = x_in.size(-1);
  // cheap here, and they keep memory safe whatever the caller checked: gamma has D elements on x's device
  TORCH_CHECK(!gamma.has_value() || (gamma->numel() == D && gamma->device() == x_in.device()),
              "gamma: expected ", D, " elements on ", x_in.device(), ", got shape ", gamma->sizes(), " on ",
              gamma->device());
  TORCH_CHECK(!x2_in.has_value() || (x2_in->sizes() == x_in.sizes() && x2_in->scalar_type() == x_in.scalar_type()),
              "x2: expected the shape and dtype of x1");
  const at::Tensor x = x_in.is_contiguous() ? x_in : x_in.contiguous();
  at::Tensor x2, xo;
  if (x2_in.has_value()) {
    x2 = x2_in->is_contiguous() ? *x2_in : x2_in->contiguous();
    xo = at::empty(x.sizes(), x.options());
  }
  // output dtype (SPEC 2.1): hf promotes with gamma's dtype as HF's `weight * h` does; else x's dtype
  at::ScalarType out_t = x.scalar_type();
  if (gamma.has_value() && mode == HF) out_t = at::promote_types(out_t, gamma->scalar_type());
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(out_t));
  if (x.numel() > 0) {
    dispatch_dtype(x.scalar_type(), [&](auto xt) {
      using X = decltype(xt);
      auto g = gamma_f32<X>(gamma, D, mode);
      at::Tensor* x2p = x2.defined() ? &x2 : nullptr;
      at::Tensor* xop = xo.defined() ? &xo : nullptr;
      if (out_t == x.scalar_type())
        norm_rows<X, X>(x, x2p, xop, g.get(), y, eps, mode, fp32_sum);
      else
        norm_rows<X, F32>(x, x2p, xop, g.get(), y, eps, mode, fp32_sum);
    });
  }
  return {y, xo};
}

at::Tensor rms_norm_entry(const at::Tensor& x, const c10::optional<at::Tensor>& gamma, double eps, int64_t mode) {
  return std::get<0>(norm_entry(x, c10::nullopt, gamma, eps, mode, false));
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_entry(const at::Tensor& x1, const at::Tensor& x2,
                                                      const c10::optional<at::Tensor>& gamma, double eps,
                                                      int64_t mode, bool fp32_sum) {
  return norm_entry(x1, x2, gamma, eps, mode, fp32_sum);
}

}  // namespace

PG_KERNELS(rms_norm) {
  m.def("rms_norm", &rms_norm_entry, "rms_norm(x, gamma, eps, mode)");
  m.def("add_rms_norm", &add_rms_norm_entry, "add_rms_norm(x1, x2, gamma, eps, mode, fp32_sum) -> (y, x_out)");
}
