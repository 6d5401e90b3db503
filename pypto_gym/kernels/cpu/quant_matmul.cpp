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

// ---- static W8A8 epilogue: y = T(float(acc + quant_bias[col]) * deq_scale[col]): the integer sum in int64
// (exact), one conversion (round to nearest even, as the golden's float64 -> float32), one multiply.
template <class O>
void dequant_static_impl(const int32_t* acc, const float* ds, const int32_t* qb, typename O::T* out, int64_t M,
                         int64_t N) {
  at::parallel_for(0, M, grain_for(N), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int32_t* a = acc + r * N;
      typename O::T* o = out + r * N;
      for (int64_t i = 0; i < N; ++i) {
        const int64_t v = (int64_t)a[i] + (qb ? (int64_t)qb[i] : 0);
        o[i] = O::store((float)v * ds[i]);
      }
    }
  });
}

at::Tensor dequant_static_entry(const at::Tensor& acc_in, const at::Tensor& ds_in,
                                const c10::optional<at::Tensor>& qb_in, at::ScalarType out_t) {
  TORCH_CHECK(acc_in.dim() == 2 && acc_in.scalar_type() == at::kInt, "dequant_static: acc must be int32 [M, N]");
  const int64_t M = acc_in.size(0), N = acc_in.size(1);
  at::Tensor acc = acc_in.contiguous(), ds = ds_in.reshape({N}).contiguous(), qb;
  TORCH_CHECK(ds.scalar_type() == at::kFloat, "dequant_static: deq_scale must be float32");
  if (qb_in.has_value()) {
    qb = qb_in->reshape({N}).contiguous();
    TORCH_CHECK(qb.scalar_type() == at::kInt, "dequant_static: quant_bias must be int32");
  }
  at::Tensor out = at::empty({M, N}, acc.options().dtype(out_t));
  if (M * N == 0) return out;
  dispatch_dtype(out_t, [&](auto ot) {
    using O = decltype(ot);
    dequant_static_impl<O>(acc.data_ptr<int32_t>(), ds.data_ptr<float>(),
                           qb.defined() ? qb.data_ptr<int32_t>() : nullptr,
                           reinterpret_cast<typename O::T*>(out.data_ptr()), M, N);
  });
  return out;
}

// ---- int8 x int8 -> int32 GEMM for CPUs without int8 dot products (no VNNI / AMX), where torch._int_mm has no
// fast path: out[m][n] = sum_k x[m][k] * w[n][k], exact. Both operands are widened to int16 and multiplied by
// vpmaddwd (int16 pairs -> int32: a pair of int8 products is at most 2 * 128 * 128, no saturation, unlike
// vpmaddubsw's int16 sums), accumulated in int32 (K <= MAX_K keeps it in range). The rows of x are widened once
// per call; a register tile of MR rows of x by NR rows of w reuses each load MR or NR times.
#if defined(PG_SIMD512)
using IV = __m512i;
constexpr int64_t IL = 32;  // int8 lanes per step
constexpr int NR = 4;
inline IV iload_w(const int8_t* p) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)p)); }
inline IV iload_x(const int16_t* p) { return _mm512_loadu_si512((const void*)p); }
inline IV imadd(IV acc, IV a, IV b) { return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b)); }
inline IV izero() { return _mm512_setzero_si512(); }
inline int32_t ihsum(IV v) { return _mm512_reduce_add_epi32(v); }
#elif defined(PG_SIMD)
using IV = __m256i;
constexpr int64_t IL = 16;
constexpr int NR = 2;
inline IV iload_w(const int8_t* p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)p)); }
inline IV iload_x(const int16_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
inline IV imadd(IV acc, IV a, IV b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
inline IV izero() { return _mm256_setzero_si256(); }
inline int32_t ihsum(IV v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}
#endif
constexpr int MR = 4;
constexpr int64_t M_TILE = 64;  // rows of x kept hot (64 x K int16) while a thread's weight rows stream past

// One MRxNR (or smaller, at the edges) tile: x16 rows (stride ldx), w rows (stride K), out rows (stride N).
template <int R, int C>
inline void int8_tile(const int16_t* x16, int64_t ldx, const int8_t* w, int64_t K, int32_t* out, int64_t N) {
  int64_t k = 0;
#if defined(PG_SIMD)
  IV acc[R][C];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) acc[i][j] = izero();
  for (; k + IL <= K; k += IL) {
    IV wv[C];
    for (int j = 0; j < C; ++j) wv[j] = iload_w(w + j * K + k);
    for (int i = 0; i < R; ++i) {
      const IV xv = iload_x(x16 + i * ldx + k);
      for (int j = 0; j < C; ++j) acc[i][j] = imadd(acc[i][j], xv, wv[j]);
    }
  }
#endif
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) {
#if defined(PG_SIMD)
      int32_t s = ihsum(acc[i][j]);
#else
      int32_t s = 0;
#endif
      for (int64_t t = k; t < K; ++t) s += (int32_t)x16[i * ldx + t] * (int32_t)w[j * K + t];
      out[i * N + j] = s;
    }
}

template <int R>
inline void int8_tile_rows(int c, const int16_t* x16, int64_t ldx, const int8_t* w, int64_t K, int32_t* out,
                           int64_t N) {
  switch (c) {  // the last columns of a thread's range, narrower than NR
    case 1: int8_tile<R, 1>(x16, ldx, w, K, out, N); break;
    case 2: int8_tile<R, 2>(x16, ldx, w, K, out, N); break;
#if !defined(PG_SIMD) || defined(PG_SIMD512)
    case 3: int8_tile<R, 3>(x16, ldx, w, K, out, N); break;
    case 4: int8_tile<R, 4>(x16, ldx, w, K, out, N); break;
#endif
  }
}

at::Tensor int8_gemm_entry(const at::Tensor& x_in, const at::Tensor& w_in) {
  TORCH_CHECK(x_in.dim() == 2 && w_in.dim() == 2 && x_in.size(1) == w_in.size(1), "int8_gemm: x [M, K], w [N, K]");
  TORCH_CHECK(x_in.scalar_type() == at::kChar && w_in.scalar_type() == at::kChar, "int8_gemm: int8 operands");
  const int64_t M = x_in.size(0), K = x_in.size(1), N = w_in.size(0);
  at::Tensor out = at::empty({M, N}, x_in.options().dtype(at::kInt));
  if (M * N == 0) return out;
  if (K == 0) return out.zero_();
  at::Tensor w = w_in.contiguous();
  at::Tensor x16 = x_in.to(at::kShort).contiguous();  // widened once; every tile reads it
  const int16_t* xp = x16.data_ptr<int16_t>();
  const int8_t* wp = w.data_ptr<int8_t>();
  int32_t* op = out.data_ptr<int32_t>();
#if defined(PG_SIMD)
  constexpr int C = NR;
#else
  constexpr int C = 4;
#endif
  const int64_t blocks = (N + C - 1) / C;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(M * K * C, 1));  // ~256k MACs
  at::parallel_for(0, blocks, grain, [&](int64_t b, int64_t e) {
    for (int64_t m0 = 0; m0 < M; m0 += M_TILE) {
      const int64_t m1 = std::min(M, m0 + M_TILE);
      for (int64_t nb = b; nb < e; ++nb) {
        const int64_t n0 = nb * C;
        const int c = (int)std::min<int64_t>(C, N - n0);
        int64_t m = m0;
        for (; m + MR <= m1; m += MR) {
          if (c == C)
            int8_tile<MR, C>(xp + m * K, K, wp + n0 * K, K, op + m * N + n0, N);
          else
            int8_tile_rows<MR>(c, xp + m * K, K, wp + n0 * K, K, op + m * N + n0, N);
        }
        for (; m < m1; ++m) int8_tile_rows<1>(c, xp + m * K, K, wp + n0 * K, K, op + m * N + n0, N);
      }
    }
  });
  return out;
}

}  // namespace

PG_KERNELS(quant_matmul) {
  m.def("dequant", &dequant_entry, "W8A8 epilogue: (acc * x_scale) * w_scale (+ bias), as out dtype");
  m.def("dequant_static", &dequant_static_entry, "static W8A8 epilogue: float(acc + quant_bias) * deq_scale");
  m.def("int8_gemm", &int8_gemm_entry, "x int8 [M, K] @ w int8 [N, K]^T -> int32 [M, N], exact (int16 madd)");
}
