// varlen_attention (defs/varlen_attention.py): softmax(q k^T * scale) v inside each window of cu_seqlens, every
// window and head in one call, threads over (window, head).
//
// A task packs its window's keys (transposed) and values as fp32 in thread-local buffers once (bf16 pairs for
// vdpbf16ps on AVX-512 BF16: see gemm_dp), then per block of 64 query rows runs both products with one
// register-blocked kernel (C += A B, B's rows a multiple of the vector width): S = Q K^T, then an online softmax
// over key blocks of 64 (a window of up to 64 is one block; a full-attention block's thousands of keys are many,
// as in torch's flash attention), O += P V, O times 1 / l at the end, rounded once. As torch's CPU flash attention
// (which HF's per-window sdpa calls run) does: scores scaled after the product, exp of (s - row max), the row sum
// from the fp32 exps, and in hf mode on 16-bit inputs the exps rounded to the input dtype before P V (fp32 mode
// keeps them fp32). Accumulation orders differ from torch's GEMMs, so outputs are within the precision rule, not
// bit-identical.
#include <cstring>
#include <type_traits>

#include "common.h"

namespace {

#ifdef PG_SIMD
constexpr int64_t LANES = W;
#else
constexpr int64_t LANES = 1;
#endif
constexpr int64_t BLOCK_Q = 64;  // query rows per task
constexpr int64_t BLOCK_K = 64;  // keys per online-softmax step

inline int64_t padded(int64_t n) { return (n + LANES - 1) / LANES * LANES; }

#ifdef PG_SIMD
// C[R][NC*W] (+)= A[R][K] B[K][NC*W]: R x NC accumulators in registers, A broadcast, B rows loaded once per k
template <int R, int NC, bool ACC>
inline void micro(const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc, int64_t K) {
  V acc[R][NC];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = ACC ? vload<F32>(C + r * ldc + c * W) : vset(0.0f);
  for (int64_t k = 0; k < K; ++k) {
    V b[NC];
    for (int c = 0; c < NC; ++c) b[c] = vload<F32>(B + k * ldb + c * W);
    for (int r = 0; r < R; ++r) {
      const V a = vset(A[r * lda + k]);
      for (int c = 0; c < NC; ++c) acc[r][c] = vfma(a, b[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) vstore<F32>(C + r * ldc + c * W, acc[r][c]);
}

// f(std::integral_constant<int, NC>{}) for nc in 1..5: a micro-kernel's accumulator count is a compile-time constant
template <class F>
inline void with_cols(int nc, F&& f) {
  switch (nc) {
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    default: f(std::integral_constant<int, 1>{}); break;
  }
}

// The loop both products share: rows in blocks of 4 (the rest one by one); a row's N / W vectors split evenly over
// passes of at most COLS (10 vectors of 3 at most: 3, 3, 2, 2, not 3, 3, 3, 1, whose last pass has too few
// accumulators to hide the FMA latency). tile(rows, nc, i, n0) runs one block, rows a compile-time constant.
template <int COLS, class Tile>
inline void blocked(int64_t M, int64_t N, Tile&& tile) {
  const int64_t vectors = N / W;
  for (int64_t n0 = 0, done = 0, passes = (vectors + COLS - 1) / COLS; done < vectors; --passes) {
    const int nc = (int)((vectors - done + passes - 1) / passes);
    int64_t i = 0;
    for (; i + 4 <= M; i += 4) tile(std::integral_constant<int, 4>{}, nc, i, n0);
    for (; i < M; ++i) tile(std::integral_constant<int, 1>{}, nc, i, n0);
    done += nc;
    n0 += nc * W;
  }
}
#endif

// C[M][N] (+)= A[M][K] B[K][N], row-major with leading dims; N a multiple of LANES
template <bool ACC>
void gemm(const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc, int64_t M, int64_t N,
          int64_t K) {
#ifdef PG_SIMD
  // 4 rows x up to 5 vectors of accumulators on AVX-512 (32 registers: an 80-wide head in one pass), 4 x 3 on
  // AVX2 (12 of its 16)
  blocked<W == 16 ? 5 : 3>(M, N, [&](auto rows, int nc, int64_t i, int64_t n0) {
    with_cols(nc, [&](auto cols) {
      micro<decltype(rows)::value, decltype(cols)::value, ACC>(A + i * lda, lda, B + n0, ldb, C + i * ldc + n0, ldc,
                                                                K);
    });
  });
#else
  for (int64_t i = 0; i < M; ++i)
    for (int64_t n = 0; n < N; ++n) {
      float acc = ACC ? C[i * ldc + n] : 0.0f;
      for (int64_t k = 0; k < K; ++k) acc += A[i * lda + k] * B[k * ldb + n];
      C[i * ldc + n] = acc;
    }
#endif
}

#if defined(__AVX512BF16__) && defined(PG_SIMD512)
// bf16 inputs on AVX-512 BF16: the products of bf16 values are exact in fp32, so a product whose operands are bf16
// values (q k^T always; p v when the exps are rounded to bf16, hf mode) runs as vdpbf16ps, two products a lane
// per instruction, on operands packed as pairs along K (one uint32: the even index low, the odd one high).
// Subnormal bf16 operands count as zero there (far below any score or value that matters).
#define PG_ATTENTION_DP 1
template <int R, int NC, bool ACC>
inline void micro_dp(const uint32_t* A, int64_t lda, const uint32_t* B, int64_t ldb, float* C, int64_t ldc,
                     int64_t K2) {
  __m512 acc[R][NC];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = ACC ? _mm512_loadu_ps(C + r * ldc + c * W) : _mm512_setzero_ps();
  for (int64_t k = 0; k < K2; ++k) {
    __m512bh b[NC];
    for (int c = 0; c < NC; ++c) b[c] = (__m512bh)_mm512_loadu_si512(B + k * ldb + c * W);
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32((int)A[r * lda + k]);
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a, b[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(C + r * ldc + c * W, acc[r][c]);
}

// C[M][N] (+)= A B with A [M][K2] and B [K2][N] bf16 pairs (K = 2 K2), N a multiple of 16
template <bool ACC>
void gemm_dp(const uint32_t* A, int64_t lda, const uint32_t* B, int64_t ldb, float* C, int64_t ldc, int64_t M,
             int64_t N, int64_t K2) {
  blocked<5>(M, N, [&](auto rows, int nc, int64_t i, int64_t n0) {
    with_cols(nc, [&](auto cols) {
      micro_dp<decltype(rows)::value, decltype(cols)::value, ACC>(A + i * lda, lda, B + n0, ldb, C + i * ldc + n0,
                                                                   ldc, K2);
    });
  });
}
#endif

inline uint32_t bf16_pair(uint16_t even, uint16_t odd) { return (uint32_t)even | ((uint32_t)odd << 16); }
inline uint16_t bf16_bits(float f) {  // f holds a bf16 value (exact): its upper half
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return (uint16_t)(u >> 16);
}

// one row of scores -> probabilities in place (exps rounded to X in hf mode); returns the fp32 sum of the exps
template <class X, bool ROUND_P>
float exp_row(float* s, int64_t n, int64_t n_padded, float max) {
  float sum = 0.0f;
  int64_t j = 0;
#ifdef PG_SIMD
  V acc = vset(0.0f);
  for (; j + W <= n; j += W) {
    V p = vexp(vsub(vload<F32>(s + j), vset(max)));
    acc = vadd(acc, p);
    vstore<F32>(s + j, ROUND_P ? vround<X>(p) : p);
  }
  alignas(64) float lanes[W];
  vstore<F32>(lanes, acc);
  for (int64_t l = 0; l < W; ++l) sum += lanes[l];
#endif
  for (; j < n; ++j) {
    const float p = std::exp(s[j] - max);
    sum += p;
    s[j] = ROUND_P ? round_to<X>(p) : p;
  }
  for (; j < n_padded; ++j) s[j] = 0.0f;
  return sum;
}

// s[0:n] *= scale; returns the max
inline float scale_max(float* s, int64_t n, float scale) {
  float row_max = -INFINITY;
  int64_t j = 0;
#ifdef PG_SIMD
  if (n >= W) {
    V mx = vset(-INFINITY);
    for (; j + W <= n; j += W) {
      const V x = vmul(vload<F32>(s + j), vset(scale));
      vstore<F32>(s + j, x);
      mx = vmaxf(mx, x);
    }
    row_max = vhmax(mx);
  }
#endif
  for (; j < n; ++j) {
    s[j] *= scale;
    row_max = std::max(row_max, s[j]);
  }
  return row_max;
}

template <class X>
inline void to_f32(const typename X::T* src, float* dst, int64_t n) {
  int64_t d = 0;
#ifdef PG_SIMD
  for (; d + W <= n; d += W) vstore<F32>(dst + d, vload<X>(src + d));
#endif
  for (; d < n; ++d) dst[d] = X::load(src[d]);
}

struct Task {
  int64_t start, end, head;  // the window [start, end) and the head
};

// a window's keys as bf16 pairs along D, transposed [D2][Lp], and (with PAIR_V) its values as pairs along the keys
// [Lp/2][Dp]; zeros past the window and past D
template <class T, bool PAIR_V>
void pack_pairs(const T* kp, const T* vp, const Task& task, int64_t kt, int64_t kh, int64_t vt, int64_t vh, int64_t D,
                int64_t Dp, int64_t L, int64_t Lw, int64_t Lp, std::vector<uint32_t>& KTp, std::vector<uint32_t>& Vp) {
  const int64_t D2 = (D + 1) / 2;
  auto row = [&](const T* base, int64_t t_stride, int64_t h_stride, int64_t j) {
    return j < L ? reinterpret_cast<const uint16_t*>(base + (task.start + j) * t_stride + task.head * h_stride)
                 : nullptr;
  };
  for (int64_t j = 0; j < Lw; ++j) {
    const uint16_t* k = row(kp, kt, kh, j);
    for (int64_t p = 0; p < D2; ++p)
      KTp[p * Lp + j] = k ? bf16_pair(k[2 * p], 2 * p + 1 < D ? k[2 * p + 1] : 0) : 0;
  }
  if constexpr (PAIR_V) {
    for (int64_t j = 0; j < Lw; j += 2) {
      const uint16_t *v0 = row(vp, vt, vh, j), *v1 = row(vp, vt, vh, j + 1);
      uint32_t* out = Vp.data() + j / 2 * Dp;
      for (int64_t n = 0; n < Dp; ++n)
        out[n] = n < D ? bf16_pair(v0 ? v0[n] : 0, v1 ? v1[n] : 0) : 0;
    }
  }
}

template <class X, bool ROUND_P>
void attention_tasks(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& y,
                     const std::vector<Task>& tasks, int64_t longest, float scale) {
  using T = typename X::T;
  const int64_t D = q.size(2), Dp = padded(D), Kp = padded(BLOCK_K), Lp = padded(longest);
  const T* qp = reinterpret_cast<const T*>(q.data_ptr());
  const T* kp = reinterpret_cast<const T*>(k.data_ptr());
  const T* vp = reinterpret_cast<const T*>(v.data_ptr());
  T* yp = reinterpret_cast<T*>(y.data_ptr());
  const int64_t qt = q.stride(0), qh = q.stride(1), kt = k.stride(0), kh = k.stride(1), vt = v.stride(0),
                vh = v.stride(1), yt = y.stride(0), yh = y.stride(1);
#ifdef PG_ATTENTION_DP
  constexpr bool DP_QK = std::is_same<X, BF16>::value, DP_PV = DP_QK && ROUND_P;
#else
  constexpr bool DP_QK = false, DP_PV = false;
#endif
  const int64_t D2 = (D + 1) / 2;  // bf16 pairs along D
  at::parallel_for(0, (int64_t)tasks.size(), 1, [&](int64_t begin, int64_t end) {
    // the window's keys transposed [D][Lp] and values [Lp][Dp], packed once (as bf16 pairs for vdpbf16ps: keys
    // [D2][Lp], values [Lp/2][Dp]); a block of queries (and its exps) and its state
    std::vector<float> KT(DP_QK ? 0 : D * Lp), Vw(DP_PV ? 0 : Lp * Dp), Q(DP_QK ? 0 : BLOCK_Q * D),
        S(BLOCK_Q * Kp), O(BLOCK_Q * Dp), m(BLOCK_Q), l(BLOCK_Q);
    std::vector<uint32_t> KTp(DP_QK ? D2 * Lp : 0), Vp(DP_PV ? Lp / 2 * Dp : 0), Qp(DP_QK ? BLOCK_Q * D2 : 0),
        Pp(DP_PV ? BLOCK_Q * Kp / 2 : 0);
    for (int64_t t = begin; t < end; ++t) {
      const Task& task = tasks[t];
      const int64_t h = task.head, L = task.end - task.start, Lw = padded(L);
      if constexpr (DP_QK) pack_pairs<T, DP_PV>(kp, vp, task, kt, kh, vt, vh, D, Dp, L, Lw, Lp, KTp, Vp);
      for (int64_t j = 0; j < Lw && !DP_QK; ++j) {
        float* vw = Vw.data() + j * Dp;
        if (j >= L) {
          std::fill(vw, vw + Dp, 0.0f);
          for (int64_t d = 0; d < D; ++d) KT[d * Lp + j] = 0.0f;
          continue;
        }
        const T* krow = kp + (task.start + j) * kt + h * kh;
        const T* vrow = vp + (task.start + j) * vt + h * vh;
        for (int64_t d = 0; d < D; ++d) KT[d * Lp + j] = X::load(krow[d]);
        to_f32<X>(vrow, vw, D);
        std::fill(vw + D, vw + Dp, 0.0f);
      }
      if constexpr (DP_QK && !DP_PV) {  // fp32 mode: the values as fp32 rows (the exps stay fp32)
        for (int64_t j = 0; j < Lw; ++j) {
          float* vw = Vw.data() + j * Dp;
          if (j < L) to_f32<X>(vp + (task.start + j) * vt + h * vh, vw, D);
          std::fill(vw + (j < L ? D : 0), vw + Dp, 0.0f);
        }
      }
      for (int64_t q0 = 0; q0 < L; q0 += BLOCK_Q) {
        const int64_t nq = std::min(BLOCK_Q, L - q0);
        for (int64_t i = 0; i < nq; ++i) {
          const T* qrow = qp + (task.start + q0 + i) * qt + h * qh;
          if constexpr (DP_QK) {
            const uint16_t* bits = reinterpret_cast<const uint16_t*>(qrow);
            for (int64_t p = 0; p < D2; ++p)
              Qp[i * D2 + p] = bf16_pair(bits[2 * p], 2 * p + 1 < D ? bits[2 * p + 1] : 0);
          } else {
            to_f32<X>(qrow, Q.data() + i * D, D);
          }
        }
        std::fill(O.begin(), O.end(), 0.0f);
        std::fill(m.begin(), m.end(), -INFINITY);
        std::fill(l.begin(), l.end(), 0.0f);
        for (int64_t k0 = 0; k0 < L; k0 += BLOCK_K) {
          const int64_t nk = std::min(BLOCK_K, L - k0), nkp = padded(nk);
#ifdef PG_ATTENTION_DP
          if constexpr (DP_QK)
            gemm_dp<false>(Qp.data(), D2, KTp.data() + k0, Lp, S.data(), Kp, nq, nkp, D2);
          else
#endif
            gemm<false>(Q.data(), D, KT.data() + k0, Lp, S.data(), Kp, nq, nkp, D);
          for (int64_t i = 0; i < nq; ++i) {
            float* s = S.data() + i * Kp;
            const float m_new = std::max(m[i], scale_max(s, nk, scale));
            const float alpha = std::exp(m[i] - m_new);  // 0 at the first block (m = -inf)
            l[i] = l[i] * alpha + exp_row<X, ROUND_P>(s, nk, nkp, m_new);
            if (alpha != 1.0f)
              for (int64_t d = 0; d < Dp; ++d) O[i * Dp + d] *= alpha;
            m[i] = m_new;
          }
#ifdef PG_ATTENTION_DP
          if constexpr (DP_PV) {  // the exps are bf16 values: packed as pairs along the keys
            for (int64_t i = 0; i < nq; ++i)
              for (int64_t p = 0; p < nkp / 2; ++p)
                Pp[i * (Kp / 2) + p] = bf16_pair(bf16_bits(S[i * Kp + 2 * p]), bf16_bits(S[i * Kp + 2 * p + 1]));
            gemm_dp<true>(Pp.data(), Kp / 2, Vp.data() + k0 / 2 * Dp, Dp, O.data(), Dp, nq, Dp, nkp / 2);
          } else
#endif
            gemm<true>(S.data(), Kp, Vw.data() + k0 * Dp, Dp, O.data(), Dp, nq, Dp, nkp);
        }
        for (int64_t i = 0; i < nq; ++i) {
          T* out = yp + (task.start + q0 + i) * yt + h * yh;
          const float* o = O.data() + i * Dp;
          const float r = 1.0f / l[i];  // as torch's flash attention: times the reciprocal of the sum
          int64_t d = 0;
#ifdef PG_SIMD
          for (; d + W <= D; d += W) vstore<X>(out + d, vmul(vload<F32>(o + d), vset(r)));
#endif
          for (; d < D; ++d) out[d] = X::store(o[d] * r);
        }
      }
    }
  });
}

// q, k, v [T, H, D] (any token and head strides, D contiguous); cu_seqlens the window bounds, 0 ... T
at::Tensor varlen_attention_entry(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                                  const std::vector<int64_t>& cu_seqlens, double scale, int64_t mode) {
  auto last_dim_dense = [](const at::Tensor& t) { return t.stride(2) == 1 ? t : t.contiguous(); };
  const at::Tensor q = last_dim_dense(q_in), k = last_dim_dense(k_in), v = last_dim_dense(v_in);
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.sizes() == q.sizes(),
              "varlen_attention: q, k and v must be [T, H, D] of one shape");
  at::Tensor y = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t H = q.size(1);
  std::vector<Task> tasks;
  int64_t longest = 0;
  for (size_t w = 0; w + 1 < cu_seqlens.size(); ++w) {
    if (cu_seqlens[w + 1] == cu_seqlens[w]) continue;
    longest = std::max(longest, cu_seqlens[w + 1] - cu_seqlens[w]);
    for (int64_t h = 0; h < H; ++h) tasks.push_back({cu_seqlens[w], cu_seqlens[w + 1], h});
  }
  if (tasks.empty() || q.size(2) == 0) return y;
  dispatch_dtype(q.scalar_type(), [&](auto xt) {
    using X = decltype(xt);
    if (mode == HF && q.scalar_type() != at::kFloat)
      attention_tasks<X, true>(q, k, v, y, tasks, longest, (float)scale);
    else
      attention_tasks<X, false>(q, k, v, y, tasks, longest, (float)scale);
  });
  return y;
}

}  // namespace

PG_KERNELS(varlen_attention) {
  m.def("varlen_attention", &varlen_attention_entry,
        "varlen_attention(q, k, v, cu_seqlens, scale, mode) -> softmax(q k^T * scale) v per window");
}
