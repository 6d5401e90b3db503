// Fused CPU kernels for the pypto_gym RMSNorm op family (SPEC 2.1-2.4).
//
// One source, compiled once per instruction-set level (cpu.py picks the level the CPU runs):
//   avx512bf16: AVX-512 + the BF16 extension (vdpbf16ps sums, vcvtneps2bf16 rounding),
//   avx512:     AVX-512F/BW/DQ, bf16 rounding by integer arithmetic,
//   avx2:       AVX2 + FMA + F16C, 8 floats a step,
//   generic:    plain C++ (any other CPU).
// Each row is read twice: once for the sum of squares, once for the output (the row is in L1 by
// then), while the next row is prefetched. Sums of squares are blocked: a few hundred squares
// per float lane, then each block is folded into double accumulators, so the rounding error of
// the variance stays below torch's own (whose order we cannot match bit for bit anyway).
// Element-wise math follows pypto_gym/ops/reference.py operation by operation, rounding where
// torch rounds, so outputs differ from the reference only where the variance differs in its
// last bit (SPEC 2.1: at most 1 ulp of the output dtype).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

enum Mode : int64_t { HF = 0, FP32 = 1, NONE = 2 };  // SPEC 2.1 cast modes

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
struct DAcc {  // 16 double lanes
  __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
  inline void add(V v) {
    lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
    hi = _mm512_add_pd(hi, _mm512_cvtps_pd(_mm512_extractf32x8_ps(v, 1)));
  }
  inline double sum() const { return _mm512_reduce_add_pd(_mm512_add_pd(lo, hi)); }
};
inline V widen16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
#if !defined(__AVX512BF16__)
inline __m512i bf16_rne(V v) {  // v rounded to bf16 (round to nearest even), bits still in the high half
  __m512i u = _mm512_castps_si512(v);
  return _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)),
                          _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)));
}
#endif
inline __m256i bf16_pack(V v) {
#if defined(__AVX512BF16__)
  return (__m256i)_mm512_cvtneps_pbh(v);
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
// hf:   y = O(g * T(x * r))        fp32: y = T((x * r) * g)        (O: output dtype, T: input dtype)
// gq: gamma in the bf16 block order (bf16 in and out on AVX512-BF16), else null.
// FINITE: the row and gamma are finite, so no NaN can appear and the roundings skip their NaN checks.
template <class X, class O, bool FINITE>
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
    return hf ? vmul(vgamma(g + j), vround_t<X, FINITE>(vmul(vload<X>(x + j), vr)))
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
    y[i] = hf ? O::store(g[i] * round_to<X>(X::load(x[i]) * r)) : O::store(X::load(x[i]) * r * g[i]);
    if (next) {
      const double v = X::load(next[i]);
      total += v * v;
    }
  }
  return total;
}

inline int64_t grain_for(int64_t D) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(D, 1)); }

// cast_mode "none": every step rounded to the input dtype T (reference._rms_norm_no_cast):
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

template <class X, class O>
void norm_rows(const at::Tensor& x, const at::Tensor* x2, at::Tensor* xo, const float* g, at::Tensor& y, double eps,
               int64_t mode) {
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

template <class F>
void dispatch_dtype(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat: f(F32{}); break;
    case at::kHalf: f(F16{}); break;
    case at::kBFloat16: f(BF16{}); break;
    default: TORCH_CHECK(false, "pypto_gym cpu kernel: unsupported dtype ", t);
  }
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
                                              const c10::optional<at::Tensor>& gamma, double eps, int64_t mode) {
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
        norm_rows<X, X>(x, x2p, xop, g.get(), y, eps, mode);
      else
        norm_rows<X, F32>(x, x2p, xop, g.get(), y, eps, mode);
    });
  }
  return {y, xo};
}

at::Tensor rms_norm_entry(const at::Tensor& x, const c10::optional<at::Tensor>& gamma, double eps, int64_t mode) {
  return std::get<0>(norm_entry(x, c10::nullopt, gamma, eps, mode));
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_entry(const at::Tensor& x1, const at::Tensor& x2,
                                                      const c10::optional<at::Tensor>& gamma, double eps,
                                                      int64_t mode) {
  return norm_entry(x1, x2, gamma, eps, mode);
}

// ---- dynamic quantisation: n = x / rms(x) * gamma (+ beta); branch k: n * smooth_k; per-row scale.
template <class X>
void quant_impl(const at::Tensor& x, const at::Tensor* x2, at::Tensor* xo, const at::Tensor& g,
                const at::Tensor* beta, const at::Tensor* s1, const at::Tensor* s2, double eps, float qmax,
                float qmin, at::Tensor& y1, at::Tensor* y2, at::Tensor& sc1, at::Tensor* sc2) {
  using T = typename X::T;
  const int64_t D = x.size(-1), R = x.numel() / D;
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
    std::unique_ptr<float[]> n(new float[D]), m(new float[D]);
    for (int64_t row = begin; row < end; ++row) {
      const T* xr = xp + row * D;
      double squares;
      if (x2p) {
        squares = add_row<X>(xr, x2p + row * D, xop + row * D, D);
        xr = xop + row * D;
      } else {
        squares = sum_squares<X>(xr, D);
      }
      const float rms = std::sqrt((float)(squares / (double)D) + feps);
      for (int64_t i = 0; i < D; ++i) n[i] = X::load(xr[i]) / rms * X::load(gp[i]) + (bp ? X::load(bp[i]) : 0.f);
      for (int b = 0; b < branches; ++b) {
        const float* src = n.get();
        if (sp[b]) {
          for (int64_t i = 0; i < D; ++i) m[i] = n[i] * X::load(sp[b][i]);
          src = m.get();
        }
        float amax = 0.f;
        bool nan = false;
        for (int64_t i = 0; i < D; ++i) {
          const float a = std::fabs(src[i]);
          nan |= std::isnan(a);
          amax = a > amax ? a : amax;
        }
        const float scale = nan ? NAN : amax / qmax;
        scp[b][row] = scale;
        int8_t* yr = yp[b] + row * D;
        if (!(scale != 0.f) || nan) {  // a zero row (scale 0) or a NaN row: codes 0
          std::memset(yr, 0, D);
          continue;
        }
        for (int64_t i = 0; i < D; ++i) {
          float q = std::nearbyint(src[i] / scale);  // half to even under the default rounding mode
          yr[i] = (int8_t)(q > qmax ? qmax : (q < qmin ? qmin : q));
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
    dispatch_dtype(x.scalar_type(), [&](auto xt) {
      quant_impl<decltype(xt)>(x, x2.defined() ? &x2 : nullptr, xo.defined() ? &xo : nullptr, g,
                               beta.defined() ? &beta : nullptr, s1.defined() ? &s1 : nullptr,
                               s2.defined() ? &s2 : nullptr, eps, (float)qmax, (float)qmin, y1,
                               y2.defined() ? &y2 : nullptr, sc1, sc2.defined() ? &sc2 : nullptr);
    });
  }
  auto opt = [](const at::Tensor& t) { return t.defined() ? c10::optional<at::Tensor>(t) : c10::nullopt; };
  return {y1, opt(y2), opt(xo), sc1, opt(sc2)};
}

// ---- W8A8 epilogue: y = T((float(acc) * x_scale[row]) * w_scale[col] (+ float(bias[col]))), one pass.
// The order and roundings of reference.quant_matmul; contraction into FMA is off so that the
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

// Which vector path this build compiled (reported by the benchmarks; checked against the CPU by cpu.py).
std::string isa() {
#if defined(__AVX512BF16__) && defined(PG_SIMD)
  return "avx512bf16";
#elif defined(__AVX512F__) && defined(PG_SIMD)
  return "avx512";
#elif defined(PG_SIMD)
  return "avx2";
#else
  return "generic";
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm_entry, "rms_norm(x, gamma, eps, mode)");
  m.def("add_rms_norm", &add_rms_norm_entry, "add_rms_norm(x1, x2, gamma, eps, mode) -> (y, x_out)");
  m.def("quant", &quant_entry, "rms_norm_dynamic_quant / add_rms_norm_dynamic_quant (x2 given)");
  m.def("dequant", &dequant_entry, "W8A8 epilogue: (acc * x_scale) * w_scale (+ bias), as out dtype");
  m.def("isa", &isa, "the instruction-set level this build was compiled for");
}
