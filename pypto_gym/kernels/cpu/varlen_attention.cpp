// varlen_attention (defs/varlen_attention.py): softmax(q k^T * scale) v inside each window of cu_seqlens, every
// window and head in one call, threads over (window, head).
//
// A task packs its window's keys (transposed) and values once in thread-local buffers: fp32, or on AVX-512 BF16
// bf16 pairs for vdpbf16ps (gemm_dp; the keys transposed 16 x 16 in registers); fp32 inputs' query and value
// rows, and bf16 query rows on vdpbf16ps, are read where they are. Per block of 64 query rows it runs both
// products with one register-blocked kernel (C += A B, B's rows a multiple of the vector width): S = Q K^T, then
// an online softmax over key blocks (a window of up to 256 keys is one block; a full-attention block's thousands
// of keys are many, as in torch's flash attention), O += P V, O times 1 / l at the end, rounded once (a one-block
// window in fp32, or in bf16 on vdpbf16ps: P V times 1 / l written as the output by the product). As torch's CPU
// flash attention (which HF's per-window sdpa calls run) does: scores scaled after the product, exp of
// (s * scale - row max), the row sum from the fp32 exps, and in hf mode on 16-bit inputs the exps rounded to the
// input dtype before P V (fp32 mode keeps them fp32; on bf16 they are written as the pairs P V reads).
// Accumulation orders differ from torch's GEMMs, so outputs are within the precision rule, not bit-identical. On
// the avx512amx level the same bf16 products run as AMX tile dot products (gemm_amx): the same operands,
// zero-padded to whole tiles.
#include <array>
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
constexpr int64_t MAX_BLOCK_K = 256;  // keys per online-softmax step (see attention_tasks)

inline int64_t padded(int64_t n) { return (n + LANES - 1) / LANES * LANES; }

#ifdef PG_SIMD
// C[R][NC*W] (+)= A[R][K] B[K][NC*W]: R x NC accumulators in registers, A broadcast, B rows loaded once per k; with
// ROW_SCALE C's row r is written times row_scale[r]
template <int R, int NC, bool ACC, bool ROW_SCALE>
inline void micro(const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc, int64_t K,
                  const float* row_scale) {
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
    for (int c = 0; c < NC; ++c)
      vstore<F32>(C + r * ldc + c * W, ROW_SCALE ? vmul(acc[r][c], vset(row_scale[r])) : acc[r][c]);
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

// C[M][N] (+)= A[M][K] B[K][N], row-major with leading dims; N a multiple of LANES; with ROW_SCALE C = (A B) times
// row_scale[i] per row (ACC false)
template <bool ACC, bool ROW_SCALE = false>
void gemm(const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc, int64_t M, int64_t N,
          int64_t K, const float* row_scale = nullptr) {
#ifdef PG_SIMD
  // 4 rows x up to 5 vectors of accumulators on AVX-512 (32 registers: an 80-wide head in one pass), 4 x 3 on
  // AVX2 (12 of its 16)
  blocked<W == 16 ? 5 : 3>(M, N, [&](auto rows, int nc, int64_t i, int64_t n0) {
    with_cols(nc, [&](auto cols) {
      micro<decltype(rows)::value, decltype(cols)::value, ACC, ROW_SCALE>(
          A + i * lda, lda, B + n0, ldb, C + i * ldc + n0, ldc, K, ROW_SCALE ? row_scale + i : nullptr);
    });
  });
#else
  for (int64_t i = 0; i < M; ++i)
    for (int64_t n = 0; n < N; ++n) {
      float acc = ACC ? C[i * ldc + n] : 0.0f;
      for (int64_t k = 0; k < K; ++k) acc += A[i * lda + k] * B[k * ldb + n];
      C[i * ldc + n] = ROW_SCALE ? acc * row_scale[i] : acc;
    }
#endif
}

#if defined(__AVX512BF16__) && defined(PG_SIMD512)
// bf16 inputs on AVX-512 BF16: the products of bf16 values are exact in fp32, so a product whose operands are bf16
// values (q k^T always; p v when the exps are rounded to bf16, hf mode) runs as vdpbf16ps, two products a lane
// per instruction, on operands packed as pairs along K (one uint32: the even index low, the odd one high).
// Subnormal bf16 operands count as zero there (far below any score or value that matters).
#define PG_ATTENTION_DP 1
// C is fp32, or (Y = uint16_t) bf16 rows written times row_scale[r]
template <int R, int NC, bool ACC, class Y>
inline void micro_dp(const uint32_t* A, int64_t lda, const uint32_t* B, int64_t ldb, Y* C, int64_t ldc, int64_t K2,
                     float* row_max, int64_t valid, const float* row_scale) {
  constexpr bool BF16_OUT = std::is_same<Y, uint16_t>::value;
  __m512 acc[R][NC];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c)
      if constexpr (ACC && !BF16_OUT)
        acc[r][c] = _mm512_loadu_ps(C + r * ldc + c * W);
      else
        acc[r][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K2; ++k) {
    __m512bh b[NC];
    for (int c = 0; c < NC; ++c) b[c] = (__m512bh)_mm512_loadu_si512(B + k * ldb + c * W);
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32((int)A[r * lda + k]);
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a, b[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c)
      if constexpr (BF16_OUT)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(C + r * ldc + c * W),
                            bf16_pack(_mm512_mul_ps(acc[r][c], _mm512_set1_ps(row_scale[r]))));
      else
        _mm512_storeu_ps(C + r * ldc + c * W, acc[r][c]);
  if (row_max) {  // each row's max over its first `valid` columns, folded into row_max[r]: read from the registers
    for (int r = 0; r < R; ++r) {
      __m512 mx = _mm512_set1_ps(-INFINITY);
      for (int c = 0; c < NC && c * W < valid; ++c) {
        const int64_t n = valid - c * W;
        mx = _mm512_mask_max_ps(mx, n >= W ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1), acc[r][c], mx);
      }
      row_max[r] = std::max(row_max[r], _mm512_reduce_max_ps(mx));
    }
  }
}

// C[M][N] (+)= A B with A [M][K2] and B [K2][N] bf16 pairs (K = 2 K2), N a multiple of 16; with row_max, each
// row's max over C's first `valid` columns folded into row_max[i] (S's row maxes for the softmax without a pass
// over S: ~5 % of the page's time on Zen 5). With Y = uint16_t, C = bf16(A B times row_scale[i]) (ACC false).
template <bool ACC, class Y = float>
void gemm_dp(const uint32_t* A, int64_t lda, const uint32_t* B, int64_t ldb, Y* C, int64_t ldc, int64_t M, int64_t N,
             int64_t K2, float* row_max = nullptr, int64_t valid = 0, const float* row_scale = nullptr) {
  blocked<5>(M, N, [&](auto rows, int nc, int64_t i, int64_t n0) {
    with_cols(nc, [&](auto cols) {
      micro_dp<decltype(rows)::value, decltype(cols)::value, ACC>(A + i * lda, lda, B + n0, ldb, C + i * ldc + n0,
                                                                   ldc, K2, row_max ? row_max + i : nullptr,
                                                                   valid - n0, row_scale ? row_scale + i : nullptr);
    });
  });
}
#endif

#if defined(PG_ATTENTION_DP) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
// AMX (the avx512amx level; hardware.amx_permitted has asked Linux for the tile state): a tile is 16 rows of 64
// bytes, so one tdpbf16ps multiplies 16 rows of 16 bf16 pairs (A) by 16 pair rows of 16 columns (B, the same
// pair layout gemm_dp reads) into a 16 x 16 fp32 tile: 16x the products of one vdpbf16ps. Tiles 0-3 hold a
// 32 x 32 block of C, 4-5 two row tiles of A, 6-7 two column tiles of B. Products and sums are those of gemm_dp
// (bf16 operands, exact products, fp32 sums; subnormal operands as zero), in another order.
#define PG_ATTENTION_AMX 1
constexpr int64_t TILE = 16;

struct alignas(64) TileConfig {  // ldtilecfg's 64-byte layout, palette 1
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// each thread configures its tiles before its first tile instruction (the state is per thread, and oneDNN's own
// configuration may be loaded between two of our calls) and releases them when done
__attribute__((target("amx-tile"))) inline void tiles_on() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = TILE;
  _tile_loadconfig(&config);
}
__attribute__((target("amx-tile"))) inline void tiles_off() { _tile_release(); }

// C[M][N] (+)= A[M][K2] B[K2][N] (bf16 pairs), M a multiple of 32, N of 16, K2 of 16; leading dims in elements
template <bool ACC>
__attribute__((target("amx-tile,amx-bf16"))) void gemm_amx(const uint32_t* A, int64_t lda, const uint32_t* B,
                                                           int64_t ldb, float* C, int64_t ldc, int64_t M, int64_t N,
                                                           int64_t K2) {
  asm volatile("" ::: "memory");  // tile loads are asm the compiler cannot see read A and B: stores land first
  const int64_t sa = lda * 4, sb = ldb * 4, sc = ldc * 4;
  for (int64_t i = 0; i < M; i += 2 * TILE) {
    float *c0 = C + i * ldc, *c1 = c0 + TILE * ldc;
    const uint32_t *a0 = A + i * lda, *a1 = a0 + TILE * lda;
    int64_t n = 0;
    for (; n + 2 * TILE <= N; n += 2 * TILE) {
      if (ACC) {
        _tile_loadd(0, c0 + n, sc); _tile_loadd(1, c0 + n + TILE, sc);
        _tile_loadd(2, c1 + n, sc); _tile_loadd(3, c1 + n + TILE, sc);
      } else {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      }
      for (int64_t k = 0; k < K2; k += TILE) {
        _tile_loadd(4, a0 + k, sa); _tile_loadd(5, a1 + k, sa);
        _tile_loadd(6, B + k * ldb + n, sb); _tile_loadd(7, B + k * ldb + n + TILE, sb);
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(0, c0 + n, sc); _tile_stored(1, c0 + n + TILE, sc);
      _tile_stored(2, c1 + n, sc); _tile_stored(3, c1 + n + TILE, sc);
    }
    if (n < N) {  // a last column of tiles (N = 80: 32 + 32 + 16)
      if (ACC) {
        _tile_loadd(0, c0 + n, sc); _tile_loadd(2, c1 + n, sc);
      } else {
        _tile_zero(0); _tile_zero(2);
      }
      for (int64_t k = 0; k < K2; k += TILE) {
        _tile_loadd(4, a0 + k, sa); _tile_loadd(5, a1 + k, sa); _tile_loadd(6, B + k * ldb + n, sb);
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(2, 5, 6);
      }
      _tile_stored(0, c0 + n, sc); _tile_stored(2, c1 + n, sc);
    }
  }
}
#endif

#ifdef PG_ATTENTION_AMX
constexpr int64_t KEY_PAD = 2 * TILE;  // keys (columns of S, pair rows of V) and query rows in whole tile pairs
#else
constexpr int64_t KEY_PAD = LANES;
#endif
inline int64_t key_padded(int64_t n) { return (n + KEY_PAD - 1) / KEY_PAD * KEY_PAD; }

inline uint32_t bf16_pair(uint16_t even, uint16_t odd) { return (uint32_t)even | ((uint32_t)odd << 16); }

// one row of raw scores -> the exps of (s * scale - max) in e[0:n_padded] (zeros past n): fp32 (rounded to X in
// hf mode), or as bf16 (E = uint16_t: the pairs P V reads, hf mode on bf16 inputs); returns the fp32 sum of the
// unrounded exps. The scores are scaled as torch's flash attention does (the product, then times the scale).
template <class X, bool ROUND_P, class E>
float exp_row(const float* s, int64_t n, int64_t n_padded, float scale, float max, E* e) {
  constexpr bool BITS = std::is_same<E, uint16_t>::value;
  float sum = 0.0f;
  int64_t j = 0;
#ifdef PG_SIMD
  V acc = vset(0.0f);
  for (; j + W <= n; j += W) {
    V p = vexp(vsub(vmul(vload<F32>(s + j), vset(scale)), vset(max)));
    acc = vadd(acc, p);
#ifdef PG_ATTENTION_DP
    if constexpr (BITS)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(e + j), bf16_pack(p));
    else
#endif
      vstore<F32>(reinterpret_cast<float*>(e + j), ROUND_P ? vround<X>(p) : p);
  }
#ifdef PG_SIMD512
  sum = _mm512_reduce_add_ps(acc);  // a tree: 4 dependent adds, not 16
#else
  alignas(64) float lanes[W];
  vstore<F32>(lanes, acc);
  for (int64_t l = 0; l < W; ++l) sum += lanes[l];
#endif
#endif
  for (; j < n; ++j) {
    const float p = std::exp(s[j] * scale - max);
    sum += p;
    if constexpr (BITS)
      e[j] = BF16::store(p);
    else
      e[j] = ROUND_P ? round_to<X>(p) : p;
  }
  for (; j < n_padded; ++j) e[j] = 0;
  return sum;
}

// the max of s[0:n] times scale (> 0): the max of the scaled scores, rounding being monotonic
inline float scaled_max(const float* s, int64_t n, float scale) {
  float row_max = -INFINITY;
  int64_t j = 0;
#ifdef PG_SIMD
  if (n >= W) {  // four chains of maxes: with one, each max waited on the last (a sixth of a long window's time)
    V m0 = vset(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
    for (; j + 4 * W <= n; j += 4 * W) {
      m0 = vmaxf(m0, vload<F32>(s + j));
      m1 = vmaxf(m1, vload<F32>(s + j + W));
      m2 = vmaxf(m2, vload<F32>(s + j + 2 * W));
      m3 = vmaxf(m3, vload<F32>(s + j + 3 * W));
    }
    for (; j + W <= n; j += W) m0 = vmaxf(m0, vload<F32>(s + j));
    row_max = vhmax(vmaxf(vmaxf(m0, m1), vmaxf(m2, m3)));
  }
#endif
  for (; j < n; ++j) row_max = std::max(row_max, s[j]);
  return row_max * scale;
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

#ifdef PG_SIMD512
// r[i][j] -> r[j][i] for 16 x 16 32-bit values: pairs within 128-bit lanes (epi32, then epi64 unpacks: r[4g + c]
// lane L holds column 4L + c of rows 4g..4g+3), then the 128-bit lanes of r[c], r[4 + c], r[8 + c], r[12 + c]
// transposed as a 4 x 4 (two shuffle_i32x4 rounds)
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int g = 0; g < 4; ++g) {
    r[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    r[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    r[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    r[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i x0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), x1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
    const __m512i y0 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44),
                  y1 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
    t[c] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    t[4 + c] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
    t[8 + c] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    t[12 + c] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// out[c * ld + j] = rows[j * stride + c] for j < Lw (a multiple of 16; rows from `valid` on are zero) and c < cols:
// a window's keys (as bf16 pairs) transposed, 16 x 16 32-bit values in registers at a time
inline void transpose_rows(const uint32_t* rows, int64_t stride, int64_t valid, int64_t cols, int64_t Lw, uint32_t* out,
                           int64_t ld) {
  for (int64_t j0 = 0; j0 < Lw; j0 += 16)
    for (int64_t c0 = 0; c0 < cols; c0 += 16) {
      const int64_t nc = std::min<int64_t>(16, cols - c0);
      const __mmask16 live = (__mmask16)((1u << nc) - 1);
      __m512i r[16];
      for (int64_t i = 0; i < 16; ++i)
        r[i] = j0 + i < valid ? _mm512_maskz_loadu_epi32(live, rows + (j0 + i) * stride + c0) : _mm512_setzero_si512();
      transpose16(r);
      for (int64_t i = 0; i < nc; ++i) _mm512_storeu_si512(out + (c0 + i) * ld + j0, r[i]);
    }
}
#endif

#ifdef PG_ATTENTION_DP
// a window's keys as bf16 pairs along D, transposed [D2][Lp], and (with PAIR_V) its values as pairs along the keys
// [Lp/2][Dp]; zeros past the window and past D
template <class T, bool PAIR_V>
void pack_pairs(const T* kp, const T* vp, const Task& task, int64_t kt, int64_t kh, int64_t vt, int64_t vh, int64_t D,
                int64_t Dp, int64_t L, int64_t Lw, int64_t Lp, std::vector<uint32_t>& KTp, std::vector<uint32_t>& Vp) {
  const int64_t D2 = (D + 1) / 2;  // pair rows past D2 (tile padding) stay zero
  auto row = [&](const T* base, int64_t t_stride, int64_t h_stride, int64_t j) {
    return j < L ? reinterpret_cast<const uint16_t*>(base + (task.start + j) * t_stride + task.head * h_stride)
                 : nullptr;
  };
  if (D % 2 == 0 && kt % 2 == 0) {  // an even row is its pairs already (little-endian: the even element low)
    transpose_rows(reinterpret_cast<const uint32_t*>(kp + task.start * kt + task.head * kh), kt / 2, L, D2, Lw,
                   KTp.data(), Lp);
  } else {
    for (int64_t j = 0; j < Lw; ++j) {
      const uint16_t* k = row(kp, kt, kh, j);
      for (int64_t p = 0; p < D2; ++p)
        KTp[p * Lp + j] = k ? bf16_pair(k[2 * p], 2 * p + 1 < D ? k[2 * p + 1] : 0) : 0;
    }
  }
  if constexpr (PAIR_V) {
    for (int64_t j = 0; j < Lw; j += 2) {
      const uint16_t *v0 = row(vp, vt, vh, j), *v1 = row(vp, vt, vh, j + 1);
      uint32_t* out = Vp.data() + j / 2 * Dp;
      int64_t n = 0;
      for (; n + 16 <= D; n += 16) {  // rows j and j + 1 interleaved: 16 values of each widened, one shifted up
        auto widen = [&](const uint16_t* r) {
          return r ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + n)))
                   : _mm512_setzero_si512();
        };
        _mm512_storeu_si512(out + n, _mm512_or_si512(widen(v0), _mm512_slli_epi32(widen(v1), 16)));
      }
      for (; n < Dp; ++n) out[n] = n < D ? bf16_pair(v0 ? v0[n] : 0, v1 ? v1[n] : 0) : 0;
    }
  }
}
#endif

// The next task's rows of q, k, v (read) and y (written), prefetched into L2 a few rows at a time between the
// current task's query rows. A task's rows are D values a token (H D values) apart, too far apart for the hardware
// prefetchers, and its loads missed L2 row by row: on the page, tasks whose inputs came from L3 took 1.7x (bf16)
// and 1.75x (fp32) the time of L2-resident ones (perf on AMX). All of a task's prefetches at once only stalled on
// the fill buffers in place of the loads.
template <class T>
struct NextTask {
  std::array<const T*, 4> row0;  // q, k, v, y at the next task's first row
  std::array<int64_t, 4> stride;  // a token's
  int64_t bytes, rows = 0, row = 0, b = 0;  // the cursor: row and byte
  int64_t lines() const { return rows * ((bytes + 63) / 64 + 1); }
  void step(int64_t n) {  // the next n lines of each tensor
    for (; n > 0 && row < rows; --n) {
      for (int s = 0; s < 4; ++s)  // every line of the row, its last one too where it starts mid-line
        __builtin_prefetch(reinterpret_cast<const char*>(row0[s] + row * stride[s]) + std::min(b, bytes - 1), s == 3, 2);
      if ((b += 64) >= bytes + 63) b = 0, ++row;
    }
  }
};

template <class X, bool ROUND_P>
void attention_tasks(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& y,
                     const std::vector<Task>& tasks, int64_t longest, float scale) {
  using T = typename X::T;
  const int64_t D = q.size(2), Dp = padded(D), Lp = key_padded(longest);
  // keys per online-softmax step: a whole window up to MAX_BLOCK_K; a full-attention window of the page (3744 keys)
  // in steps of 256: a step's max, rescale of O and tile calls over 4x the keys of a 64-key step (measured on AMX:
  // 158 -> ~110 ms, torch's flash sdpa ~105; 512-key steps ~130: S and P outgrow the L2 share)
  const int64_t block_k = std::min(MAX_BLOCK_K, std::max<int64_t>(64, Lp)), Kp = padded(block_k);
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
  // fp32 inputs are read where they are: q rows as the first product's A, value rows (D a whole number of vectors)
  // as the second's B (copied they were a fifth of an fp32 task's time beside its products; perf on AMX)
  constexpr bool F32_IN = std::is_same<X, F32>::value;
  const bool v_in_place = F32_IN && D == Dp;
  // On vdpbf16ps (not on AMX tiles, which read K in whole tiles, past D2, and store S as tiles): bf16 query rows
  // of even length starting at 4-byte boundaries are their pairs already, read in place as the first product's A
  // (not copied: ~4 % of the page's time on Zen 5), and S's row maxes come from the product's registers.
#if defined(PG_ATTENTION_DP) && !defined(PG_ATTENTION_AMX)
  constexpr bool DP_VECTORS = DP_QK;
#else
  constexpr bool DP_VECTORS = false;
#endif
  const bool q_in_place = DP_VECTORS && D % 2 == 0 && qt % 2 == 0 && qh % 2 == 0 &&
                          reinterpret_cast<uintptr_t>(qp) % 4 == 0;
#ifdef PG_ATTENTION_AMX
  const int64_t D2k = (D2 + TILE - 1) / TILE * TILE;  // the pairs' K in whole tiles (zeros past D2)
  // S = Q K^T and O += P V on tiles, rows in whole tile pairs (rows past a block's queries are computed, not read)
  auto qk = [&](const uint32_t* A, int64_t lda, const uint32_t* B, float* C, int64_t M, int64_t N, float* /*row_max*/,
                int64_t /*valid*/) {
    gemm_amx<false>(A, lda, B, Lp, C, Kp, key_padded(M), N, D2k);
  };
  auto pv = [&](const uint32_t* A, const uint32_t* B, float* C, int64_t M, int64_t K2, bool acc) {
    acc ? gemm_amx<true>(A, Kp / 2, B, Dp, C, Dp, key_padded(M), Dp, K2)
        : gemm_amx<false>(A, Kp / 2, B, Dp, C, Dp, key_padded(M), Dp, K2);
  };
#elif defined(PG_ATTENTION_DP)
  const int64_t D2k = D2;
  auto qk = [&](const uint32_t* A, int64_t lda, const uint32_t* B, float* C, int64_t M, int64_t N, float* row_max,
                int64_t valid) {
    gemm_dp<false>(A, lda, B, Lp, C, Kp, M, N, D2k, row_max, valid);
  };
  auto pv = [&](const uint32_t* A, const uint32_t* B, float* C, int64_t M, int64_t K2, bool acc) {
    acc ? gemm_dp<true>(A, Kp / 2, B, Dp, C, Dp, M, Dp, K2) : gemm_dp<false>(A, Kp / 2, B, Dp, C, Dp, M, Dp, K2);
  };
#else
  const int64_t D2k = D2;
#endif
  at::parallel_for(0, (int64_t)tasks.size(), 1, [&](int64_t begin, int64_t end) {
#ifdef PG_ATTENTION_AMX
    if constexpr (DP_QK) tiles_on();
#endif
    // the window's keys transposed [D][Lp] and values [Lp][Dp], packed once (as bf16 pairs for vdpbf16ps: keys
    // [D2][Lp], values [Lp/2][Dp]); a block of queries (and its exps) and its state
    std::vector<float> KT(DP_QK ? 0 : D * Lp), Vw(DP_PV || v_in_place ? 0 : Lp * Dp),
        Q(DP_QK || F32_IN ? 0 : BLOCK_Q * D), S(BLOCK_Q * Kp), O(BLOCK_Q * Dp), m(BLOCK_Q), l(BLOCK_Q),
        s_max(DP_VECTORS ? BLOCK_Q : 0);
    std::vector<uint32_t> KTp(DP_QK ? D2k * Lp : 0), Vp(DP_PV ? Lp / 2 * Dp : 0), Qp(DP_QK ? BLOCK_Q * D2k : 0),
        Pp(DP_PV ? BLOCK_Q * Kp / 2 : 0);
    for (int64_t t = begin; t < end; ++t) {
      const Task& task = tasks[t];
      const int64_t h = task.head, L = task.end - task.start, Lw = key_padded(L);
      NextTask<T> next{{}, {qt, kt, vt, yt}, D * (int64_t)sizeof(T)};
      if (t + 1 < end) {
        const Task& n = tasks[t + 1];
        next.row0 = {qp + n.start * qt + n.head * qh, kp + n.start * kt + n.head * kh, vp + n.start * vt + n.head * vh,
                     yp + n.start * yt + n.head * yh};
        next.rows = n.end - n.start;
      }
      // fp32 windows of one key step: the second product writes the output rows, times 1 / l (no pass over O)
      // (and bf16 windows of one step on vdpbf16ps, heads of whole vectors: P V times 1 / l rounded to bf16)
      const bool out_in_product = (v_in_place || (DP_VECTORS && DP_PV && D == Dp)) && L <= block_k;
      const int64_t passes = out_in_product ? 1 : 2;  // the next task's lines once or twice per query row
      const int64_t next_per_row = (next.lines() + passes * L - 1) / (passes * L);
#ifdef PG_ATTENTION_DP
      if constexpr (DP_QK) pack_pairs<T, DP_PV>(kp, vp, task, kt, kh, vt, vh, D, Dp, L, Lw, Lp, KTp, Vp);
#endif
#ifdef PG_SIMD512
      // fp32 keys transposed 16 x 16 in registers (element by element: a tenth of an fp32 task, perf on AMX)
      constexpr bool KEYS_32 = std::is_same<X, F32>::value;
      if constexpr (KEYS_32)
        transpose_rows(reinterpret_cast<const uint32_t*>(kp + task.start * kt + h * kh), kt, L, D, Lw,
                       reinterpret_cast<uint32_t*>(KT.data()), Lp);
#else
      constexpr bool KEYS_32 = false;
#endif
      for (int64_t j = 0; j < Lw && !DP_QK && !(KEYS_32 && v_in_place); ++j) {
        float* vw = Vw.data() + j * Dp;
        if (j >= L) {
          if (!v_in_place) std::fill(vw, vw + Dp, 0.0f);
          for (int64_t d = 0; d < D && !KEYS_32; ++d) KT[d * Lp + j] = 0.0f;
          continue;
        }
        const T* krow = kp + (task.start + j) * kt + h * kh;
        for (int64_t d = 0; d < D && !KEYS_32; ++d) KT[d * Lp + j] = X::load(krow[d]);
        if (v_in_place) continue;
        to_f32<X>(vp + (task.start + j) * vt + h * vh, vw, D);
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
        for (int64_t i = 0; i < nq && !F32_IN && !q_in_place; ++i) {
          const T* qrow = qp + (task.start + q0 + i) * qt + h * qh;
          if constexpr (DP_QK) {
            const uint16_t* bits = reinterpret_cast<const uint16_t*>(qrow);
            if (D % 2 == 0)  // an even row is its pairs
              std::memcpy(Qp.data() + i * D2k, bits, D * sizeof(uint16_t));
            else
              for (int64_t p = 0; p < D2; ++p)
                Qp[i * D2k + p] = bf16_pair(bits[2 * p], 2 * p + 1 < D ? bits[2 * p + 1] : 0);
          } else {
            to_f32<X>(qrow, Q.data() + i * D, D);
          }
        }
        std::fill(m.begin(), m.end(), -INFINITY);
        for (int64_t k0 = 0; k0 < L; k0 += block_k) {
          const int64_t nk = std::min(block_k, L - k0), nkp = key_padded(nk);
#ifdef PG_ATTENTION_DP
          if constexpr (DP_QK) {
            if (DP_VECTORS) std::fill(s_max.begin(), s_max.end(), -INFINITY);
            float* row_max = DP_VECTORS ? s_max.data() : nullptr;
            q_in_place ? qk(reinterpret_cast<const uint32_t*>(qp + (task.start + q0) * qt + h * qh), qt / 2,
                            KTp.data() + k0, S.data(), nq, nkp, row_max, nk)
                       : qk(Qp.data(), D2k, KTp.data() + k0, S.data(), nq, nkp, row_max, nk);
          } else
#endif
            F32_IN ? gemm<false>(reinterpret_cast<const float*>(qp + (task.start + q0) * qt + h * qh), qt,
                                 KT.data() + k0, Lp, S.data(), Kp, nq, nkp, D)
                   : gemm<false>(Q.data(), D, KT.data() + k0, Lp, S.data(), Kp, nq, nkp, D);
          for (int64_t i = 0; i < nq; ++i) {
            if (k0 == 0) next.step(next_per_row);
            float* s = S.data() + i * Kp;
            const float m_new = std::max(m[i], DP_VECTORS ? s_max[i] * scale : scaled_max(s, nk, scale));
            // the exps in place, or as bf16 pairs along the keys for vdpbf16ps / tiles (hf mode on bf16 inputs)
            auto exps = [&] {
              if constexpr (DP_PV)
                return exp_row<X, ROUND_P>(s, nk, nkp, scale, m_new,
                                           reinterpret_cast<uint16_t*>(Pp.data() + i * (Kp / 2)));
              else
                return exp_row<X, ROUND_P>(s, nk, nkp, scale, m_new, s);
            };
            if (k0 == 0) {  // the first block: l starts here and P V writes O, nothing to rescale
              l[i] = exps();
            } else {
              const float alpha = m_new == m[i] ? 1.0f : std::exp(m[i] - m_new);
              l[i] = l[i] * alpha + exps();
              if (alpha != 1.0f)
                for (int64_t d = 0; d < Dp; ++d) O[i * Dp + d] *= alpha;
            }
            m[i] = m_new;
          }
#ifdef PG_ATTENTION_DP
          if constexpr (DP_PV) {
            if (out_in_product) {  // y = bf16((P V) times 1 / l), as the loop below
              for (int64_t i = 0; i < nq; ++i) l[i] = 1.0f / l[i];
              gemm_dp<false>(Pp.data(), Kp / 2, Vp.data(), Dp,
                             reinterpret_cast<uint16_t*>(yp + (task.start + q0) * yt + h * yh), yt, nq, Dp, nkp / 2,
                             nullptr, 0, l.data());
            } else {
              pv(Pp.data(), Vp.data() + k0 / 2 * Dp, O.data(), nq, nkp / 2, k0 > 0);  // the first block sets O
            }
          } else
#endif
          {
            // in place: the window's value rows (the exps' columns from nk on are zeros: K = nk, no padded rows)
            const float* B = v_in_place ? reinterpret_cast<const float*>(vp + (task.start + k0) * vt + h * vh)
                                        : Vw.data() + k0 * Dp;
            const int64_t ldb = v_in_place ? vt : Dp, K = v_in_place ? nk : nkp;
            if (out_in_product) {  // y = (P V) times 1 / l, as the loop below
              for (int64_t i = 0; i < nq; ++i) l[i] = 1.0f / l[i];
              gemm<false, true>(S.data(), Kp, B, ldb, reinterpret_cast<float*>(yp + (task.start + q0) * yt + h * yh),
                                yt, nq, Dp, K, l.data());
            } else {
              k0 > 0 ? gemm<true>(S.data(), Kp, B, ldb, O.data(), Dp, nq, Dp, K)
                     : gemm<false>(S.data(), Kp, B, ldb, O.data(), Dp, nq, Dp, K);
            }
          }
        }
        for (int64_t i = 0; i < nq && !out_in_product; ++i) {
          next.step(next_per_row);
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
#ifdef PG_ATTENTION_AMX
    if constexpr (DP_QK) tiles_off();
#endif
  });
}

// q, k, v [T, H, D] (any token and head strides, D contiguous); cu_seqlens the window bounds, 0 ... T
at::Tensor varlen_attention_entry(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                                  const std::vector<int64_t>& cu_seqlens, double scale, int64_t mode) {
  auto last_dim_dense = [](const at::Tensor& t) { return t.stride(2) == 1 ? t : t.contiguous(); };
  const at::Tensor q = last_dim_dense(q_in), k = last_dim_dense(k_in), v = last_dim_dense(v_in);
  TORCH_CHECK(q.dim() == 3, "varlen_attention: q has shape ", q.sizes(), "; expected [T, H, D]");
  check_float("varlen_attention", "q", q);
  check_like("varlen_attention", "k", k, q, "q");
  check_like("varlen_attention", "v", v, q, "q");
  // the bounds index q, k, v and y: rising from 0 to T (a bound past T read and wrote rows past the buffers)
  const int64_t T = q.size(0);
  bool rising = !cu_seqlens.empty() && cu_seqlens.front() == 0 && cu_seqlens.back() == T;
  for (size_t w = 0; rising && w + 1 < cu_seqlens.size(); ++w) rising = cu_seqlens[w] <= cu_seqlens[w + 1];
  TORCH_CHECK(rising, "varlen_attention: cu_seqlens must rise from 0 to T = ", T, ", got ", cu_seqlens.size(),
              " bounds from ", cu_seqlens.empty() ? -1 : cu_seqlens.front(), " to ",
              cu_seqlens.empty() ? -1 : cu_seqlens.back());
  TORCH_CHECK(mode == HF || mode == FP32, "varlen_attention: mode ", mode, "; expected 0 (hf) or 1 (fp32)");
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
