// The shared layer of pypto-gym's fused CPU kernels (kernels/cpu/<op>.cpp, beside each op's Python glue).
//
// The cpu backend compiles every op's source as one translation unit per instruction-set level
// (backend.py picks the level the CPU runs):
//   avx512amx:  avx512bf16 + AMX tiles (the bf16 GEMMs),
//   avx512bf16: AVX-512 + the BF16 extension (vdpbf16ps sums, vcvtneps2bf16 rounding, subnormals by integers),
//   avx512:     AVX-512F/BW/DQ, bf16 rounding by integer arithmetic,
//   avx2:       AVX2 + FMA + F16C, 8 floats a step,
//   generic:    plain C++ (any other CPU).
// This header holds what every kernel needs: the storage dtypes and their round-to-nearest-even
// conversions, the SIMD layer (a vector V of W floats with loads, stores and roundings per dtype),
// the row primitives the norm kernels share (blocked sums of squares, the residual add), dtype
// dispatch and the registration of each op's Python bindings (PG_KERNELS). Element-wise math in
// the kernels follows each op's golden (its definition's torch function) operation by operation,
// rounding where torch rounds.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <type_traits>
#include <vector>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

// Each op's source registers its bindings with PG_KERNELS(name) { m.def(...); }; module.cpp runs them all.
inline std::vector<void (*)(pybind11::module_&)>& pg_registrars() {
  static std::vector<void (*)(pybind11::module_&)> all;
  return all;
}
#define PG_KERNELS(name)                                                        \
  static void pg_register_##name(pybind11::module_& m);                         \
  static const int pg_registered_##name = (pg_registrars().push_back(&pg_register_##name), 0); \
  static void pg_register_##name(pybind11::module_& m)

namespace {

enum Mode : int64_t { HF = 0, FP32 = 1, NONE = 2 };  // the norm ops' cast modes

// ---- storage dtypes: scalar conversions (round to nearest even, NaN stays NaN) ---------------------
struct F32 {
  using T = float;
  static inline float load(float v) { return v; }
  static inline float store(float f) { return f; }
};
struct F16 {
  using T = uint16_t;
  static inline float load(uint16_t v) { return c10::detail::fp16_ieee_to_fp32_value(v); }
  static inline uint16_t store(float f) { return c10::detail::fp16_ieee_from_fp32_value(f); }
};
struct BF16 {
  using T = uint16_t;
  static inline float load(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  static inline uint16_t store(float f) {  // as c10::BFloat16: round to nearest even, NaN -> 0x7FC0
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
};
template <class X>
inline float round_to(float f) { return X::load(X::store(f)); }

// ---- SIMD layer: a vector V of W floats, loads/stores per storage dtype ---------------------------
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define PG_SIMD 1
#define PG_SIMD512 1
constexpr int64_t W = 16;
using V = __m512;
inline V vset(float f) { return _mm512_set1_ps(f); }
inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V vgamma(const float* p) { return _mm512_loadu_ps(p); }
inline V vsub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V vdiv(V a, V b) { return _mm512_div_ps(a, b); }
// vmaxf / vminf / vhmax are MAXPS / MINPS: a NaN in `a` is dropped (the second operand is returned). Their callers
// keep NaN out (clamps of rinted codes) or track it themselves (quantize_row's nan bits; an attention row's NaN
// reaches its sum through vexp).
inline V vmaxf(V a, V b) { return _mm512_max_ps(a, b); }
inline V vabs(V a) { return _mm512_abs_ps(a); }
inline V vcopysign(V mag, V sgn) {  // |mag| with sgn's sign bit
  const V m = _mm512_set1_ps(-0.0f);
  return _mm512_or_ps(_mm512_andnot_ps(m, mag), _mm512_and_ps(m, sgn));
}
inline float vhmax(V a) { return _mm512_reduce_max_ps(a); }
// quantisation: round half to even, NaN lanes to 0, bits of the NaN lanes, saturating int32 -> int8 store
inline V vminf(V a, V b) { return _mm512_min_ps(a, b); }
inline V vload_i32(const int32_t* p) { return _mm512_cvtepi32_ps(_mm512_loadu_si512((const void*)p)); }
inline V vrint(V a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline V vnan_to_zero(V a) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a, a, _CMP_ORD_Q), a); }
inline int vnan_bits(V a) { return (int)_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
inline void vstore_i8(int8_t* p, V q) { _mm_storeu_si128((__m128i*)p, _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(q))); }
// exp(x): Cephes' polynomial after x = n ln2 + r, scaled by 2^n with vscalefps (which gives +inf past
// 88.7228 as expf does, and 0 far below); below -87.3 the argument is clamped (for silu, 1 + that == 1).
// NaN stays NaN and +inf gives +inf, as expf: MAXPS returns its second operand when either is NaN, so the
// argument goes second (a clamp written max(x, c) turned exp(NaN) into exp(-87.3) and dropped a NaN key's NaN from
// an attention row's sum), and r = x - n ln2 is inf - inf at +inf, so that lane is set apart.
inline V vexp(V x_in) {
  const __mmask16 over = _mm512_cmp_ps_mask(x_in, _mm512_set1_ps(88.72283935546875f), _CMP_GT_OQ);
  V x = _mm512_max_ps(_mm512_set1_ps(-87.3f), x_in);
  V fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  V r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), r);
  V y = _mm512_set1_ps(1.9875691500E-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507E-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073E-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894E-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459E-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201E-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_mask_mov_ps(_mm512_scalef_ps(y, fx), over, _mm512_set1_ps(INFINITY));
}
struct DAcc {  // 16 double lanes
  __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
  inline void add(V v) {
    lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
    hi = _mm512_add_pd(hi, _mm512_cvtps_pd(_mm512_extractf32x8_ps(v, 1)));
  }
  inline double sum() const { return _mm512_reduce_add_pd(_mm512_add_pd(lo, hi)); }
};
inline V widen16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
inline __m512i bf16_rne(V v) {  // v rounded to bf16 (round to nearest even), bits still in the high half
  __m512i u = _mm512_castps_si512(v);
  return _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)),
                          _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)));
}
inline __m256i bf16_pack(V v) {
#if defined(__AVX512BF16__)
  // vcvtneps2bf16 treats subnormal inputs as zero whatever MXCSR says; torch rounds them. Such a lane comes out
  // +-0, so the (rare) zero lanes are redone by the integer rounding, exact for zeros and subnormals alike (and
  // never NaN there): a bf16 subnormal survives as in torch. Testing the 16-bit result is one instruction where
  // testing the float input took four, a quarter of a rope kernel's time.
  const __m256i fast = (__m256i)_mm512_cvtneps_pbh(v);
  const __mmask16 zero = _mm256_testn_epi16_mask(fast, _mm256_set1_epi16(0x7FFF));
  if (!zero) return fast;
  return _mm256_mask_mov_epi16(fast, zero, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_rne(v), 16)));
#else
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  __m512i r = _mm512_mask_mov_epi32(_mm512_srli_epi32(bf16_rne(v), 16), nan, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
#endif
}
template <class X> inline V vload(const typename X::T* p);
template <> inline V vload<F32>(const float* p) { return _mm512_loadu_ps(p); }
template <> inline V vload<BF16>(const uint16_t* p) { return widen16(_mm256_loadu_si256((const __m256i*)p)); }
template <> inline V vload<F16>(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
template <class X> inline void vstore(typename X::T* p, V v);
template <> inline void vstore<F32>(float* p, V v) { _mm512_storeu_ps(p, v); }
template <> inline void vstore<BF16>(uint16_t* p, V v) { _mm256_storeu_si256((__m256i*)p, bf16_pack(v)); }
template <> inline void vstore<F16>(uint16_t* p, V v) {
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
template <class X> inline V vround(V v);  // v rounded to X's precision, still as floats
template <> inline V vround<F32>(V v) { return v; }
template <> inline V vround<BF16>(V v) { return widen16(bf16_pack(v)); }
template <> inline V vround<F16>(V v) {
  return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
// FINITE: the caller knows no NaN can occur (finite row and gamma), so the integer rounding needs no NaN blend
template <class X, bool FINITE> inline V vround_t(V v) { return vround<X>(v); }
template <class X, bool FINITE> inline void vstore2_t(typename X::T* p, V a, V b) {
  vstore<X>(p, a);
  vstore<X>(p + W, b);
}
#if !defined(__AVX512BF16__)
template <> inline V vround_t<BF16, true>(V v) {
  return _mm512_castsi512_ps(_mm512_and_si512(bf16_rne(v), _mm512_set1_epi32((int)0xFFFF0000u)));
}
template <> inline void vstore2_t<BF16, true>(uint16_t* p, V a, V b) {
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_rne(a), 16)));
  _mm256_storeu_si256((__m256i*)(p + W), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_rne(b), 16)));
}
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PG_SIMD 1
constexpr int64_t W = 8;
using V = __m256;
inline V vset(float f) { return _mm256_set1_ps(f); }
inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V vgamma(const float* p) { return _mm256_loadu_ps(p); }
inline V vsub(V a, V b) { return _mm256_sub_ps(a, b); }
inline V vdiv(V a, V b) { return _mm256_div_ps(a, b); }
inline V vmaxf(V a, V b) { return _mm256_max_ps(a, b); }
inline V vabs(V a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
inline V vcopysign(V mag, V sgn) {  // |mag| with sgn's sign bit
  const V m = _mm256_set1_ps(-0.0f);
  return _mm256_or_ps(_mm256_andnot_ps(m, mag), _mm256_and_ps(m, sgn));
}
inline float vhmax(V a) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}
inline V vminf(V a, V b) { return _mm256_min_ps(a, b); }
inline V vload_i32(const int32_t* p) { return _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i*)p)); }
inline V vrint(V a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline V vnan_to_zero(V a) { return _mm256_and_ps(a, _mm256_cmp_ps(a, a, _CMP_ORD_Q)); }
inline int vnan_bits(V a) { return _mm256_movemask_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)); }
inline void vstore_i8(int8_t* p, V q) {  // int32 -> int16 -> int8, saturating, in order
  __m256i i = _mm256_cvtps_epi32(q);
  __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
  _mm_storel_epi64((__m128i*)p, _mm_packs_epi16(w, w));
}
// exp(x): as the AVX-512 version (Cephes' polynomial, 2^(n-1) * 2, +inf above 88.7228, clamped below -87.3, NaN
// kept: the argument second in MAXPS)
inline V vexp(V x) {
  const V over = _mm256_cmp_ps(x, _mm256_set1_ps(88.72283935546875f), _CMP_GT_OQ);
  x = _mm256_max_ps(_mm256_set1_ps(-87.3f), x);
  V fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  V r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), r);
  V y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  __m256i n = _mm256_cvtps_epi32(_mm256_sub_ps(fx, _mm256_set1_ps(1.0f)));
  V p2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
  y = _mm256_mul_ps(_mm256_mul_ps(y, p2), _mm256_set1_ps(2.0f));
  return _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), over);
}
struct DAcc {  // 8 double lanes
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  inline void add(V v) {
    lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
    hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
  }
  inline double sum() const {
    alignas(32) double t[4];
    _mm256_store_pd(t, _mm256_add_pd(lo, hi));
    return (t[0] + t[1]) + (t[2] + t[3]);
  }
};
inline V widen8(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
inline __m256i bf16_rne(V v) {  // v rounded to bf16 (round to nearest even), bits still in the high half
  __m256i u = _mm256_castps_si256(v);
  return _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)),
                          _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)));
}
inline __m128i bf16_pack(V v) {  // round to nearest even by integer arithmetic, NaN -> 0x7FC0
  __m256i r = _mm256_srli_epi32(bf16_rne(v), 16);
  __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  __m256i p = _mm256_packus_epi32(r, r);  // per 128-bit lane: [a0..a3 a0..a3 | b0..b3 b0..b3]
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(p, 0x08));
}
template <class X> inline V vload(const typename X::T* p);
template <> inline V vload<F32>(const float* p) { return _mm256_loadu_ps(p); }
template <> inline V vload<BF16>(const uint16_t* p) { return widen8(_mm_loadu_si128((const __m128i*)p)); }
template <> inline V vload<F16>(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
template <class X> inline void vstore(typename X::T* p, V v);
template <> inline void vstore<F32>(float* p, V v) { _mm256_storeu_ps(p, v); }
template <> inline void vstore<BF16>(uint16_t* p, V v) { _mm_storeu_si128((__m128i*)p, bf16_pack(v)); }
template <> inline void vstore<F16>(uint16_t* p, V v) {
  _mm_storeu_si128((__m128i*)p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
template <class X> inline V vround(V v);
template <> inline V vround<F32>(V v) { return v; }
template <> inline V vround<BF16>(V v) {  // keep the rounded high half in place: no pack/unpack
  V rounded = _mm256_castsi256_ps(_mm256_and_si256(bf16_rne(v), _mm256_set1_epi32((int)0xFFFF0000u)));
  return _mm256_blendv_ps(rounded, v, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}
template <> inline V vround<F16>(V v) {
  return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
// FINITE: the caller knows no NaN can occur (finite row and gamma), so the integer rounding needs no
// NaN blend, and pairs of vectors share one pack and one permute
template <class X, bool FINITE> inline V vround_t(V v) { return vround<X>(v); }
template <> inline V vround_t<BF16, true>(V v) {
  return _mm256_castsi256_ps(_mm256_and_si256(bf16_rne(v), _mm256_set1_epi32((int)0xFFFF0000u)));
}
template <class X, bool FINITE> inline void vstore2_t(typename X::T* p, V a, V b) {
  vstore<X>(p, a);
  vstore<X>(p + W, b);
}
template <> inline void vstore2_t<BF16, true>(uint16_t* p, V a, V b) {
  __m256i packed = _mm256_packus_epi32(_mm256_srli_epi32(bf16_rne(a), 16), _mm256_srli_epi32(bf16_rne(b), 16));
  _mm256_storeu_si256((__m256i*)p, _mm256_permute4x64_epi64(packed, 0xD8));  // lanes back in order
}
#else
constexpr int64_t W = 0;  // no vector path: every loop below is its scalar tail
#endif

inline void prefetch(const void* p) {
#if defined(__GNUC__)
  __builtin_prefetch(p, 0, 3);
#endif
}

// ---- rows -----------------------------------------------------------------------------------------
// Row i's output and row i+1's sum of squares are computed in the same loop: one read stream and
// one write stream per row, as in a copy. Sums are blocked: fp32 lanes for up to BLOCK elements,
// then folded into fp64 (DAcc), so their rounding error stays below torch's.
constexpr int64_t BLOCK = 512;

template <class X>
double sum_squares(const typename X::T* x, int64_t D) {  // the first row of a chunk
  double total = 0.0;
  int64_t i = 0;
#ifdef PG_SIMD
  DAcc acc;
  while (i + 2 * W <= D) {
    const int64_t end = std::min(D - D % (2 * W), i + BLOCK);
    V a0 = vset(0.f), a1 = vset(0.f);
    for (; i + 2 * W <= end; i += 2 * W) {
      V v0 = vload<X>(x + i), v1 = vload<X>(x + i + W);
      a0 = vfma(v0, v0, a0);
      a1 = vfma(v1, v1, a1);
    }
    acc.add(vadd(a0, a1));
  }
  total = acc.sum();
#endif
  for (; i < D; ++i) {
    const double v = X::load(x[i]);
    total += v * v;
  }
  return total;
}

#ifdef PG_SIMD
// Store T(a), T(b) at p, p + W and replace a, b by those rounded values (what a reader of p sees).
// FINITE: no NaN among a, b, so the integer bf16 rounding skips its NaN blend (and AVX2 packs the pair once).
template <class X> inline V vstore_rounded(typename X::T* p, V v);  // store T(v); return T(v) as floats
template <> inline V vstore_rounded<F32>(float* p, V v) { vstore<F32>(p, v); return v; }
template <> inline V vstore_rounded<F16>(uint16_t* p, V v) { V r = vround<F16>(v); vstore<F16>(p, r); return r; }
#ifdef PG_SIMD512
template <> inline V vstore_rounded<BF16>(uint16_t* p, V v) {
  __m256i h = bf16_pack(v);
  _mm256_storeu_si256((__m256i*)p, h);
  return widen16(h);
}
#else
template <> inline V vstore_rounded<BF16>(uint16_t* p, V v) {
  __m128i h = bf16_pack(v);
  _mm_storeu_si128((__m128i*)p, h);
  return widen8(h);
}
#endif
template <class X, bool FINITE>
inline void vstore2_rounded(typename X::T* p, V& a, V& b) {
  a = vstore_rounded<X>(p, a);
  b = vstore_rounded<X>(p + W, b);
}
#if !defined(__AVX512BF16__)
template <>
inline void vstore2_rounded<BF16, true>(uint16_t* p, V& a, V& b) {
  vstore2_t<BF16, true>(p, a, b);
  a = vround_t<BF16, true>(a);
  b = vround_t<BF16, true>(b);
}
#endif
#ifdef PG_SIMD512
inline bool any_nan(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q) != 0; }
#else
inline bool any_nan(V a, V b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_UNORD_Q)) != 0; }
#endif
#endif

// o = T(a + b), rounded exactly as torch.add; returns the sum of squares of o (what the norm reads).
// FINITE: assumes no NaN appears (fast roundings) and reports through *nan if one did.
template <class X, bool FINITE>
double add_row_t(const typename X::T* a, const typename X::T* b, typename X::T* o, int64_t D, bool* nan) {
  double total = 0.0;
  int64_t i = 0;
#ifdef PG_SIMD
  DAcc acc;
  bool saw_nan = false;
  while (i + 2 * W <= D) {
    const int64_t end = std::min(D - D % (2 * W), i + BLOCK);
    V s0 = vset(0.f), s1 = vset(0.f);
    for (; i + 2 * W <= end; i += 2 * W) {
      V v0 = vadd(vload<X>(a + i), vload<X>(b + i)), v1 = vadd(vload<X>(a + i + W), vload<X>(b + i + W));
      if (FINITE) saw_nan |= any_nan(v0, v1);
      vstore2_rounded<X, FINITE>(o + i, v0, v1);
      s0 = vfma(v0, v0, s0);
      s1 = vfma(v1, v1, s1);
    }
    acc.add(vadd(s0, s1));
  }
  total = acc.sum();
  if (FINITE && saw_nan) {
    *nan = true;
    return 0.0;
  }
#endif
  for (; i < D; ++i) {
    o[i] = X::store(X::load(a[i]) + X::load(b[i]));
    const double v = X::load(o[i]);
    total += v * v;
  }
  return total;
}

template <class X>
double add_row(const typename X::T* a, const typename X::T* b, typename X::T* o, int64_t D) {
  bool nan = false;
  const double total = add_row_t<X, true>(a, b, o, D, &nan);
  return nan ? add_row_t<X, false>(a, b, o, D, nullptr) : total;  // a NaN row: again, NaN-safe
}


// Per-row symmetric quantisation (the golden's quantize_rows): scale = max|v| / qmax, codes =
// clamp(rint(v / scale)), half to even; a zero row gets scale 0 and a NaN row scale NaN, both codes 0.
inline float quantize_row(const float* v, int64_t n, float qmax, float qmin, int8_t* out) {
  float amax = 0.f;
  int nan = 0;
  int64_t i = 0;
#ifdef PG_SIMD
  V m = vset(0.f);
  for (; i + W <= n; i += W) {
    const V a = vabs(vgamma(v + i));
    nan |= vnan_bits(a);
    m = vmaxf(m, a);
  }
  amax = vhmax(m);
#endif
  for (; i < n; ++i) {
    const float a = std::fabs(v[i]);
    nan |= std::isnan(a);
    amax = a > amax ? a : amax;
  }
  const float scale = nan ? NAN : amax / qmax;
  if (!(scale != 0.f) || nan) {
    std::memset(out, 0, n);
    return scale;
  }
  i = 0;
#ifdef PG_SIMD
  const V vs = vset(scale), hi = vset(qmax), lo = vset(qmin);
  for (; i + W <= n; i += W)  // v / scale as the golden divides (an infinite v over an infinite scale: NaN -> 0)
    vstore_i8(out + i, vminf(vmaxf(vnan_to_zero(vrint(vdiv(vgamma(v + i), vs))), lo), hi));
#endif
  for (; i < n; ++i) {
    float q = std::nearbyint(v[i] / scale);  // half to even under the default rounding mode
    q = q != q ? 0.f : q;
    out[i] = (int8_t)(q > qmax ? qmax : (q < qmin ? qmin : q));
  }
  return scale;
}

// Static per-tensor quantisation (the golden's quantize_static): codes = clamp(rint(v / scale + offset)), the
// division and the add rounding separately in fp32, half to even, NaN -> 0.
__attribute__((optimize("fp-contract=off"))) inline void quantize_row_static(const float* v, int64_t n, float scale,
                                                                            float offset, int8_t* out) {
  int64_t i = 0;
#ifdef PG_SIMD
  const V vs = vset(scale), vo = vset(offset), hi = vset(127.f), lo = vset(-128.f);
  for (; i + W <= n; i += W)
    vstore_i8(out + i, vminf(vmaxf(vnan_to_zero(vrint(vadd(vdiv(vgamma(v + i), vs), vo))), lo), hi));
#endif
  for (; i < n; ++i) {
    float q = std::nearbyint(v[i] / scale + offset);
    q = q != q ? 0.f : q;
    out[i] = (int8_t)(q > 127.f ? 127.f : (q < -128.f ? -128.f : q));
  }
}

// silu(g) = g / (1 + exp(-g)), in fp32, as torch's CPU kernel writes it (one value; W values: vsilu)
inline float silu1(float g) { return g / (1.0f + std::exp(-g)); }
#ifdef PG_SIMD
inline V vsilu(V g) { return vdiv(g, vadd(vset(1.0f), vexp(vsub(vset(0.0f), g)))); }
#endif

inline int64_t grain_for(int64_t D) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(D, 1)); }

// ---- argument checks every entry point makes of what it indexes with, whatever its Python caller checked (memory
// safety must not depend on the Python layer: torch.ops.pypto_gym.* and compiled graphs reach the kernels too)
inline void check_like(const char* op, const char* name, const at::Tensor& t, const at::Tensor& x,
                       const char* x_name) {
  TORCH_CHECK(t.sizes() == x.sizes() && t.scalar_type() == x.scalar_type() && t.device() == x.device(), op, ": ", name,
              " has shape ", t.sizes(), " and dtype ", t.scalar_type(), "; expected ", x_name, "'s ", x.sizes(), " and ",
              x.scalar_type());
}
// a per-channel vector of D elements (any singleton dims), of `dtype` when the kernel reads it as x's storage type
inline void check_vector(const char* op, const char* name, const c10::optional<at::Tensor>& t, int64_t D,
                         c10::optional<at::ScalarType> dtype = c10::nullopt) {
  if (!t.has_value()) return;
  TORCH_CHECK(t->numel() == D, op, ": ", name, " has ", t->numel(), " elements (shape ", t->sizes(), "); expected ", D);
  TORCH_CHECK(!dtype.has_value() || t->scalar_type() == *dtype, op, ": ", name, " has dtype ", t->scalar_type(),
              "; expected ", *dtype);
}
// the elements a kernel reaches from t's data pointer, offsets 0 .. last, lie inside t's storage
inline void check_reach(const char* op, const char* name, const at::Tensor& t, int64_t last) {
  const int64_t room = (int64_t)(t.storage().nbytes() / t.element_size()) - t.storage_offset();
  TORCH_CHECK(last < room, op, ": ", name, "'s layout reaches element ", last, " of a storage holding ", room);
}
inline void check_float(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16,
              op, ": ", name, " has dtype ", t.scalar_type(), "; expected float32, float16 or bfloat16");
}

template <class F>
void dispatch_dtype(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat: f(F32{}); break;
    case at::kHalf: f(F16{}); break;
    case at::kBFloat16: f(BF16{}); break;
    default: TORCH_CHECK(false, "pypto_gym cpu kernel: unsupported dtype ", t);
  }
}


// Each row of a contiguous x turned into fp32 values by fill(X{}, row, values, D) in a per-thread scratch row, then
// handed to emit(row index, values, D): what the quant ops quantise (a linear's input, smoothed; a GELU's output).
template <class Fill, class Emit>
void scratch_rows(const at::Tensor& x, Fill fill, Emit emit) {
  const int64_t D = x.size(-1), R = x.numel() / D;
  dispatch_dtype(x.scalar_type(), [&](auto xt) {
    using T = typename decltype(xt)::T;
    const T* xp = reinterpret_cast<const T*>(x.data_ptr());
    at::parallel_for(0, R, grain_for(D), [&](int64_t begin, int64_t end) {
      std::unique_ptr<float[]> n(new float[D]);
      for (int64_t r = begin; r < end; ++r) {
        fill(xt, xp + r * D, n.get(), D);
        emit(r, n.get(), D);
      }
    });
  });
}

// x as fp32, times the fp32 smooth scale per channel if given (dynamic_quant per row, static_quant under one scale)
template <class Emit>
void smoothed_rows(const at::Tensor& x, const float* sp, Emit emit) {
  scratch_rows(x, [&](auto xt, const auto* xr, float* n, int64_t D) {
    using X = decltype(xt);
    int64_t i = 0;
#ifdef PG_SIMD
    for (; i + W <= D; i += W) {
      const V v = vload<X>(xr + i);
      vstore<F32>(n + i, sp ? vmul(v, vload<F32>(sp + i)) : v);
    }
#endif
    for (; i < D; ++i) n[i] = sp ? X::load(xr[i]) * sp[i] : X::load(xr[i]);
  }, emit);
}

}  // namespace
