// Fused CPU kernels for the pypto_gym RMSNorm op family.
//
// One pass over each row for the statistics and one for the output, rows split across threads
// with at::parallel_for. Element loops are written over raw storage types with inline
// conversions so GCC vectorises them (-O3 -march=native); the reductions carry `omp simd`
// so they may be reassociated without -ffast-math (which would break NaN propagation).
// The math mirrors pypto_gym/ops/reference.py; see SPEC sections 2.1-2.4.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

struct F32 {
  using T = float;
  static inline float load(float v) { return v; }
  static inline float store(float f) { return f; }
};
struct F16 {
  using T = _Float16;
  static inline float load(_Float16 v) { return (float)v; }
  static inline _Float16 store(float f) { return (_Float16)f; }
};
struct BF16 {
  using T = uint16_t;
  static inline float load(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  static inline uint16_t store(float f) {  // round to nearest even, quiet NaN as c10 does
    uint32_t u;
    std::memcpy(&u, &f, 4);
    uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (u & 0x7FFFFFFFu) > 0x7F800000u ? (uint16_t)0x7FC0u : (uint16_t)rounded;
  }
};


#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// bf16 rows with AVX512-BF16: vcvtne2ps2bf16 packs 32 floats with round-to-nearest-even in one
// instruction, several times cheaper than the integer rounding the generic loop compiles to.
// (It flushes bf16 denormal outputs to zero; RMSNorm outputs are O(1), so this never shows.)
#define PYPTO_GYM_BF16_FAST 1
inline __m512 bf16x16_to_f32(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
// Lane orders. A block of 32 bf16 is widened with unpacklo/hi_epi16 (one instruction per 16
// floats, against two for a zero-extend + shift), which leaves the floats in a lane-local order;
// gamma is permuted once per call into the same order and one vpermw restores the natural order
// at the store. P is the order after one widening (fp32 mode); in hf mode the products are
// rounded to bf16 with one vcvtne2ps2bf16 and widened again, giving order Q.
struct Bf16Blocks {
  int lo[16], hi[16];  // element (0..31) held by lane j of the low / high float vector
  uint16_t store_index[32];
  explicit Bf16Blocks(bool twice) {
    int p[32];  // slot -> element after the first widening and packing
    for (int k = 0; k < 4; ++k)
      for (int t = 0; t < 4; ++t) {
        lo[4 * k + t] = 8 * k + t;
        hi[4 * k + t] = 8 * k + 4 + t;
      }
    if (twice) {
      for (int j = 0; j < 16; ++j) p[j] = lo[j], p[16 + j] = hi[j];
      for (int k = 0; k < 4; ++k)
        for (int t = 0; t < 4; ++t) {
          lo[4 * k + t] = p[8 * k + t];
          hi[4 * k + t] = p[8 * k + 4 + t];
        }
    }
    for (int j = 0; j < 16; ++j) store_index[lo[j]] = j, store_index[hi[j]] = 16 + j;
  }
  std::vector<float> permute(const float* g, int64_t D) const {  // gamma in lane order, whole blocks
    std::vector<float> out(D - D % 32);
    for (int64_t b = 0; b + 32 <= D; b += 32)
      for (int j = 0; j < 16; ++j) out[b + j] = g[b + lo[j]], out[b + 16 + j] = g[b + hi[j]];
    return out;
  }
};

// y = bf16(g * bf16(x * r)) (hf) or bf16(x * r * g) (fp32); gq is gamma in the blocks' lane order.
inline int64_t bf16_norm_row_fast(const uint16_t* x, const float* gq, uint16_t* y, int64_t D, float r, bool hf,
                                  const Bf16Blocks& blocks) {
  const __m512 vr = _mm512_set1_ps(r);
  const __m512i z = _mm512_setzero_si512();
  const __m512i idx = _mm512_loadu_si512((const void*)blocks.store_index);
  int64_t i = 0;
  for (; i + 32 <= D; i += 32) {
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
  }
  return i;
}
// o = bf16(a + b), 32 at a time; returns elements done.
inline int64_t bf16_add_row_fast(const uint16_t* a, const uint16_t* b, uint16_t* o, int64_t D) {
  int64_t i = 0;
  for (; i + 32 <= D; i += 32) {
    __m512 s0 = _mm512_add_ps(bf16x16_to_f32(a + i), bf16x16_to_f32(b + i));
    __m512 s1 = _mm512_add_ps(bf16x16_to_f32(a + i + 16), bf16x16_to_f32(b + i + 16));
    _mm512_storeu_si512((void*)(o + i), (__m512i)_mm512_cvtne2ps_pbh(s1, s0));
  }
  return i;
}
#endif

inline int64_t grain_for(int64_t D) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(D, 1)); }

template <class X>
inline float sum_squares(const typename X::T* x, int64_t D) {
  float acc = 0.f;
  int64_t i = 0;
#ifdef PYPTO_GYM_BF16_FAST
  if constexpr (std::is_same_v<X, BF16>) {  // bf16*bf16 is exact in f32: vdpbf16ps sums 32 squares a step
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    for (; i + 64 <= D; i += 64) {
      __m512bh v0 = (__m512bh)_mm512_loadu_si512((const void*)(x + i));
      __m512bh v1 = (__m512bh)_mm512_loadu_si512((const void*)(x + i + 32));
      a0 = _mm512_dpbf16_ps(a0, v0, v0);
      a1 = _mm512_dpbf16_ps(a1, v1, v1);
    }
    acc = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
  }
#endif
#pragma omp simd reduction(+ : acc)
  for (int64_t j = i; j < D; ++j) {
    float v = X::load(x[j]);
    acc += v * v;
  }
  return acc;
}

#ifdef PYPTO_GYM_BF16_FAST
struct FastGamma {
  Bf16Blocks blocks;
  std::vector<float> gq;
  FastGamma(const float* g, int64_t D, bool hf) : blocks(hf), gq(blocks.permute(g, D)) {}
};
#else
struct FastGamma {
  FastGamma(const float*, int64_t, bool) {}
};
#endif

// y = O(gamma * T(x * r))  (hf)   or   y = O(x * r * gamma)  (fp32, O = T);  O = T when gamma's
// dtype is T, else f32. gamma arrives converted to f32 once per call; no gamma arrives as ones
// (1 * v == v exactly), so there is one code path.
template <class X, class O>
void norm_row(const typename X::T* x, const float* g, typename O::T* y, int64_t D, float r, bool fp32_mode,
              const FastGamma* fast) {
  int64_t i = 0;
#ifdef PYPTO_GYM_BF16_FAST
  if constexpr (std::is_same_v<X, BF16> && std::is_same_v<O, BF16>) {
    if (fast) i = bf16_norm_row_fast(x, fast->gq.data(), y, D, r, !fp32_mode, fast->blocks);
  }
#endif
  if (fp32_mode) {
    for (; i < D; ++i) y[i] = O::store(X::load(x[i]) * r * g[i]);
  } else {
    for (; i < D; ++i) y[i] = O::store(g[i] * X::load(X::store(X::load(x[i]) * r)));
  }
}

template <class X>
void add_row(const typename X::T* a, const typename X::T* b, typename X::T* o, int64_t D) {
  int64_t i = 0;
#ifdef PYPTO_GYM_BF16_FAST
  if constexpr (std::is_same_v<X, BF16>) i = bf16_add_row_fast(a, b, o, D);
#endif
  for (; i < D; ++i) o[i] = X::store(X::load(a[i]) + X::load(b[i]));
}

template <class X, class O>
void rms_norm_impl(const at::Tensor& x, const at::Tensor* x2, const float* gp, at::Tensor& y, at::Tensor* xo,
                   double eps, bool fp32_mode, const FastGamma* fast) {
  const int64_t D = x.size(-1), R = x.numel() / std::max<int64_t>(D, 1);
  auto xp = reinterpret_cast<const typename X::T*>(x.data_ptr());
  auto x2p = x2 ? reinterpret_cast<const typename X::T*>(x2->data_ptr()) : nullptr;
  auto yp = reinterpret_cast<typename O::T*>(y.data_ptr());
  auto xop = xo ? reinterpret_cast<typename X::T*>(xo->data_ptr()) : nullptr;
  const float feps = (float)eps;
  at::parallel_for(0, R, grain_for(D), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const typename X::T* xr = xp + row * D;
      if (x2p) {  // residual add, rounded to the input dtype exactly as torch.add does
        add_row<X>(xr, x2p + row * D, xop + row * D, D);
        xr = xop + row * D;
      }
      float var = sum_squares<X>(xr, D) / (float)D;
      float r = 1.0f / std::sqrt(var + feps);
      norm_row<X, O>(xr, gp, yp + row * D, D, r, fp32_mode, fast);
    }
  });
}

template <class G>
std::vector<float> gamma_f32(const at::Tensor& g) {
  auto p = reinterpret_cast<const typename G::T*>(g.data_ptr());
  std::vector<float> out(g.numel());
  for (int64_t i = 0; i < g.numel(); ++i) out[i] = G::load(p[i]);
  return out;
}

at::ScalarType out_type(at::ScalarType xt, const c10::optional<at::Tensor>& g, bool fp32_mode) {
  if (!g.has_value() || fp32_mode) return xt;
  return at::promote_types(xt, g->scalar_type());
}

template <class F>
void dispatch_x(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat: f(F32{}); break;
    case at::kHalf: f(F16{}); break;
    case at::kBFloat16: f(BF16{}); break;
    default: TORCH_CHECK(false, "pypto_gym cpu kernel: unsupported dtype ", t);
  }
}

std::vector<at::Tensor> norm_entry(const at::Tensor& x_in, const c10::optional<at::Tensor>& x2_in,
                                   const c10::optional<at::Tensor>& gamma, double eps, bool fp32_mode) {
  const int64_t D = x_in.size(-1);
  at::Tensor x = x_in.contiguous();
  at::Tensor x2, xo;
  if (x2_in.has_value()) {
    x2 = x2_in->contiguous();
    xo = at::empty(x.sizes(), x.options());
  }
  at::Tensor g;
  if (gamma.has_value()) g = gamma->reshape({D}).contiguous();
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(out_type(x.scalar_type(), gamma, fp32_mode)));
  if (x.numel() > 0) {
    std::vector<float> gf(D, 1.0f);
    if (g.defined()) dispatch_x(g.scalar_type(), [&](auto gt) { gf = gamma_f32<decltype(gt)>(g); });
    const float* gp = gf.data();
    std::unique_ptr<FastGamma> fast;  // bf16 in and out: gamma in the fast path's lane order
    if (x.scalar_type() == at::kBFloat16 && y.scalar_type() == at::kBFloat16 && D >= 32)
      fast = std::make_unique<FastGamma>(gp, D, !fp32_mode);
    dispatch_x(x.scalar_type(), [&](auto xt) {
      using X = decltype(xt);
      at::Tensor* x2p = x2.defined() ? &x2 : nullptr;
      at::Tensor* xop = xo.defined() ? &xo : nullptr;
      if (y.scalar_type() == x.scalar_type())
        rms_norm_impl<X, X>(x, x2p, gp, y, xop, eps, fp32_mode, fast.get());
      else
        rms_norm_impl<X, F32>(x, x2p, gp, y, xop, eps, fp32_mode, nullptr);
    });
  }
  if (xo.defined()) return {y, xo};
  return {y};
}

// ---- dynamic quantisation: n = x / rms(x) * gamma (+ beta); branch k: n * smooth_k; per-row scale.
template <class X>
void quant_impl(const at::Tensor& x, const at::Tensor* x2, at::Tensor* xo, const at::Tensor& g,
                const at::Tensor* beta, const at::Tensor* s1, const at::Tensor* s2, double eps, float qmax,
                float qmin, at::Tensor& y1, at::Tensor* y2, at::Tensor& sc1, at::Tensor* sc2) {
  using T = typename X::T;
  const int64_t D = x.size(-1), R = x.numel() / std::max<int64_t>(D, 1);
  auto xp = reinterpret_cast<const T*>(x.data_ptr());
  auto x2p = x2 ? reinterpret_cast<const T*>(x2->data_ptr()) : nullptr;
  auto xop = xo ? reinterpret_cast<T*>(xo->data_ptr()) : nullptr;
  auto gp = reinterpret_cast<const T*>(g.data_ptr());
  auto bp = beta ? reinterpret_cast<const T*>(beta->data_ptr()) : nullptr;
  const T* sp[2] = {s1 ? reinterpret_cast<const T*>(s1->data_ptr()) : nullptr,
                    s2 ? reinterpret_cast<const T*>(s2->data_ptr()) : nullptr};
  int8_t* yp[2] = {y1.data_ptr<int8_t>(), y2 ? y2->data_ptr<int8_t>() : nullptr};
  float* scp[2] = {sc1.data_ptr<float>(), sc2 ? sc2->data_ptr<float>() : nullptr};
  const int branches = y2 ? 2 : 1;
  const float feps = (float)eps;
  at::parallel_for(0, R, grain_for(D), [&](int64_t begin, int64_t end) {
    std::vector<float> n(D), m(D);
    for (int64_t row = begin; row < end; ++row) {
      const T* xr = xp + row * D;
      if (x2p) {
        add_row<X>(xr, x2p + row * D, xop + row * D, D);
        xr = xop + row * D;
      }
      float rms = std::sqrt(sum_squares<X>(xr, D) / (float)D + feps);
      if (bp) {
        for (int64_t i = 0; i < D; ++i) n[i] = X::load(xr[i]) / rms * X::load(gp[i]) + X::load(bp[i]);
      } else {
        for (int64_t i = 0; i < D; ++i) n[i] = X::load(xr[i]) / rms * X::load(gp[i]);
      }
      for (int b = 0; b < branches; ++b) {
        const float* src = n.data();
        if (sp[b]) {
          for (int64_t i = 0; i < D; ++i) m[i] = n[i] * X::load(sp[b][i]);
          src = m.data();
        }
        float amax = 0.f;
        bool nan = false;
        for (int64_t i = 0; i < D; ++i) {
          float a = std::fabs(src[i]);
          nan |= std::isnan(a);
          amax = a > amax ? a : amax;
        }
        if (nan) amax = NAN;
        float scale = amax / qmax;
        scp[b][row] = scale;
        int8_t* yr = yp[b] + row * D;
        if (scale == 0.f) {
          std::memset(yr, 0, D);
        } else {
          for (int64_t i = 0; i < D; ++i) {
            float q = std::nearbyint(src[i] / scale);  // half to even under the default FE mode
            q = q > qmax ? qmax : (q < qmin ? qmin : q);
            yr[i] = (int8_t)(std::isnan(q) ? 0.f : q);
          }
        }
      }
    }
  });
}

std::vector<c10::optional<at::Tensor>> quant_entry(const at::Tensor& x_in, const c10::optional<at::Tensor>& x2_in,
                                                   const at::Tensor& gamma, const c10::optional<at::Tensor>& s1_in,
                                                   const c10::optional<at::Tensor>& s2_in,
                                                   const c10::optional<at::Tensor>& beta_in, double eps, double qmax,
                                                   double qmin) {
  const int64_t D = x_in.size(-1);
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
    dispatch_x(x.scalar_type(), [&](auto xt) {
      quant_impl<decltype(xt)>(x, x2.defined() ? &x2 : nullptr, xo.defined() ? &xo : nullptr, g,
                               beta.defined() ? &beta : nullptr, s1.defined() ? &s1 : nullptr,
                               s2.defined() ? &s2 : nullptr, eps, (float)qmax, (float)qmin, y1,
                               y2.defined() ? &y2 : nullptr, sc1, sc2.defined() ? &sc2 : nullptr);
    });
  }
  auto opt = [](const at::Tensor& t) { return t.defined() ? c10::optional<at::Tensor>(t) : c10::nullopt; };
  return {y1, opt(y2), opt(xo), sc1, opt(sc2)};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("norm", &norm_entry, "rms_norm / add_rms_norm (x2 given)");
  m.def("quant", &quant_entry, "rms_norm_dynamic_quant / add_rms_norm_dynamic_quant (x2 given)");
}
