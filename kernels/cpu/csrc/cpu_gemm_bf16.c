/*
 * Matmul with bfloat16 weights on the CPU, for bf16 models:
 *
 *   out[m, n] = round(sum_k A[m, k] * W[n, k] + bias[n])     (out: bf16 or float32)
 *
 * Two builds of the same blocking, chosen when the library is compiled for the machine:
 * - CPUs with AVX512-BF16 (Zen 4, Cooper Lake, Sapphire Rapids): vdpbf16ps register tiles on
 *   the "pairs" weight layout (below); faster than oneDNN at SmolLM2's shapes, several times
 *   at one row (benchmarks/cpu_gemm.py).
 * - other x86 CPUs: float32 AVX2 + FMA tiles on the weights widened in registers, where torch's
 *   bf16 matmuls fall back to slow emulation; without AVX2, portable C tiles.
 * Measurements: benchmarks/RESULTS.md, "Figures moved out of the code".
 *
 * Every product and sum is float32 (a product of two bf16 values is exact in float32), with one
 * rounding per output, as oneDNN's bf16 GEMM does; only the summation order differs (and the
 * dot-product tiles treat bf16 denormals as zero). A float32 A is used as is by the FMA tiles;
 * the dot-product tiles split it into bf16 high and low halves (exact to about 2^-17).
 *
 * Layouts (element offsets):
 *   A     [M, K]   a[m * lda + k], bf16 (a_dtype 1) or float32 (0)
 *   wp    [P, K, 16] bf16, P = ceil(N / 16): the weight [N, K] in panels of 16 output columns,
 *         k-major, padded with zero columns; inside a panel the columns are stored in the order
 *         0-3, 8-11, 4-7, 12-15 so that AVX2's unpacklo / unpackhi of one 256-bit load against
 *         zero give float32 columns 0-7 and 8-15 (kernels/cpu/ops.py: pack_bf16_weight);
 *         with AVX512-BF16 instead [P, ceil(K / 2), 16, 2], k-pairs side by side (see gemm_dp).
 *   bias  [N] bf16 or NULL
 *   out   [M, N]   out[m * ldo + n], bf16 (out_dtype 1) or float32 (0)
 *
 * Blocking (the GotoBLAS / BLIS scheme: Goto & van de Geijn 2008, Van Zee & van de Geijn
 * 2015): each OpenMP thread owns a contiguous range of panels. Rows are taken in chunks of
 * about 96 KiB of float32 A, which each thread converts into its own buffer (kept in L2;
 * 256 KiB of bf16 A for the dot-product tiles, read in place when K is even); for each of its panel groups it
 * runs register tiles of MR rows x NR panels (6 x 1, 2 x 2 or 1 x 4: 12, 8 or 8 accumulators of
 * 8 floats; 6 x 4 accumulators of 16 floats with AVX512-BF16) over the whole K, so a panel group is read from
 * memory once per chunk and from cache for every tile. One row (decode at batch 1) streams the
 * weights once: the bf16 layout halves the bytes of a float32 GEMV.
 * Built and loaded by kernels/cpu/native.py (gcc -O3 -march=native -fopenmp); called through
 * ctypes with the GIL released. Without AVX2 + FMA a portable C tile of the same shape is used.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bf16.h"
#include "pagedllm_abi.h"
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDLLM_AVX2 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
#define PAGEDLLM_DPBF16 1
#endif

#ifndef PF_K
#define PF_K 16 /* prefetch distance in k (16 x 32 bytes): a few % more weight bandwidth at one row */
#endif
#define CHUNK_FLOATS (96 * 1024 / 4) /* float32 elements of A per row chunk */

/* Storage position of column c (0..15) inside a panel. */
static inline int panel_slot(int c) { return (c & 3) | ((c & 4) << 1) | ((c & 8) >> 1); }

static inline void store_row(int out_dtype, void* out, int64_t ldo, int64_t m, int64_t n0, int64_t ncols,
                             const float* vals, const uint16_t* bias) {
  if (out_dtype == 0) {
    float* o = (float*)out + m * ldo + n0;
    for (int64_t c = 0; c < ncols; ++c) o[c] = vals[c] + (bias ? bf16_to_f32(bias[n0 + c]) : 0.f);
  } else {
    uint16_t* o = (uint16_t*)out + m * ldo + n0;
    for (int64_t c = 0; c < ncols; ++c) o[c] = f32_to_bf16(vals[c] + (bias ? bf16_to_f32(bias[n0 + c]) : 0.f));
  }
}

#ifdef PAGEDLLM_AVX2
/* 8 float32 -> 8 bf16 (round to nearest even, NaN kept quiet) into dst. */
static inline void store_bf16x8(uint16_t* dst, __m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(64)), nan);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08); /* words 0-7 low */
  _mm_storeu_si128((__m128i*)dst, _mm256_castsi256_si128(packed));
}

/* acc[MR][2 NR] += A[MR rows, 0..K) x (NR panels); then bias, rounding and store. */
static inline __attribute__((always_inline)) void tile(const int MR, const int NR, const float* a, int64_t lda,
                                                        const uint16_t* w, int64_t K, int64_t n0, int64_t N,
                                                        const uint16_t* bias, int out_dtype, void* out, int64_t ldo,
                                                        int64_t m0) {
  __m256 acc[6][8];
  const int64_t panel_stride = K * PANEL;
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < 2 * NR; ++j) acc[r][j] = _mm256_setzero_ps();
  const __m256i zero = _mm256_setzero_si256();
  for (int64_t k = 0; k < K; ++k) {
    __m256 wv[8];
    if (MR <= 2 && (k & 1) == 0) /* few rows: the weights stream from DRAM; prefetch ahead */
#pragma GCC unroll 4
      for (int p = 0; p < NR; ++p) _mm_prefetch((const char*)(w + p * panel_stride + (k + PF_K) * PANEL), _MM_HINT_T0);
#pragma GCC unroll 4
    for (int p = 0; p < NR; ++p) {
      const __m256i raw = _mm256_loadu_si256((const __m256i*)(w + p * panel_stride + k * PANEL));
      wv[2 * p] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, raw));     /* columns 0-7 */
      wv[2 * p + 1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, raw)); /* columns 8-15 */
    }
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      const __m256 av = _mm256_broadcast_ss(a + r * lda + k);
#pragma GCC unroll 8
      for (int j = 0; j < 2 * NR; ++j) acc[r][j] = _mm256_fmadd_ps(av, wv[j], acc[r][j]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 8
    for (int j = 0; j < 2 * NR; ++j) {
      const int64_t n = n0 + j * 8;
      if (n + 8 <= N) {
        __m256 v = acc[r][j];
        if (bias) {
          const __m128i b = _mm_loadu_si128((const __m128i*)(bias + n));
          v = _mm256_add_ps(v, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16)));
        }
        if (out_dtype == 0)
          _mm256_storeu_ps((float*)out + (m0 + r) * ldo + n, v);
        else
          store_bf16x8((uint16_t*)out + (m0 + r) * ldo + n, v);
      } else if (n < N) {
        float vals[8];
        _mm256_storeu_ps(vals, acc[r][j]);
        store_row(out_dtype, out, ldo, m0 + r, n, N - n, vals, bias);
      }
    }
  }
}

/* One function per tile shape, so each gets its own register allocation (inlined into one
   caller, GCC spilled the accumulators to the stack: half the FMA rate). */
#define TILE_FN(MR, NR)                                                                                \
  static __attribute__((noinline)) void tile_##MR##x##NR(const float* a, int64_t lda, const uint16_t* w, \
                                                         int64_t K, int64_t n0, int64_t N,            \
                                                         const uint16_t* bias, int out_dtype, void* out, \
                                                         int64_t ldo, int64_t m0) {                   \
    tile(MR, NR, a, lda, w, K, n0, N, bias, out_dtype, out, ldo, m0);                                 \
  }
TILE_FN(6, 1)
TILE_FN(5, 1)
TILE_FN(4, 1)
TILE_FN(3, 1)
TILE_FN(2, 2)
TILE_FN(2, 1)
TILE_FN(1, 4)
TILE_FN(1, 3)
TILE_FN(1, 2)
TILE_FN(1, 1)
#endif

#ifdef PAGEDLLM_DPBF16
/* ---- AVX512-BF16 (Zen 4, Cooper Lake and later): the "pairs" layout ------------------------
 * wp [P, ceil(K / 2), 16, 2] bf16: panel p, k-pair j holds W[16 p + c, 2 j] and W[16 p + c, 2 j + 1]
 * side by side for c = 0..15 (64 bytes, one zmm), the odd k of an odd K padded with zero.
 * vdpbf16ps multiplies such a vector by one broadcast pair of A and adds both products into 16
 * float32 accumulators: per k-pair a tile of MR rows x NR panels costs NR loads, MR broadcasts
 * and MR x NR dot instructions (6 x 4 tiles: 24 accumulators of the 32 zmm registers). The
 * instruction treats bf16 denormals as zero (DAZ) and flushes denormal results (FTZ); products
 * are exact and each of the two additions rounds to nearest even, as an FMA chain does. */

static inline __m512bh pair_of(const uint16_t* p) { /* A[k], A[k + 1] broadcast to 16 lanes */
  int32_t v;
  memcpy(&v, p, 4);
  return (__m512bh)_mm512_set1_epi32(v);
}

/* acc[MR][NR] = A[MR rows] x (NR panels) over all k-pairs, then a second pass over a_lo when
   given (the low halves of a float32 A); then bias, rounding and store. a: row stride lda, 2 KP
   readable columns (an odd K padded with zero by the caller). */
static inline __attribute__((always_inline)) void dtile(const int MR, const int NR, const uint16_t* a,
                                                         const uint16_t* a_lo, int64_t lda, const uint16_t* w,
                                                         int64_t KP, int64_t n0, int64_t N, const uint16_t* bias,
                                                         int out_dtype, void* out, int64_t ldo, int64_t m0) {
  __m512 acc[6][4];
  const int64_t panel_stride = KP * 2 * PANEL;
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int p = 0; p < NR; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int pass = 0; pass < 2; ++pass) {
    const uint16_t* ap = pass ? a_lo : a;
    if (!ap) break;
    for (int64_t j = 0; j < KP; ++j) {
      __m512bh wv[4];
      if (MR <= 2) /* few rows: the weights stream from DRAM; prefetch ahead */
#pragma GCC unroll 4
        for (int p = 0; p < NR; ++p)
          _mm_prefetch((const char*)(w + p * panel_stride + (j + PF_K / 2) * 2 * PANEL), _MM_HINT_T0);
#pragma GCC unroll 4
      for (int p = 0; p < NR; ++p) wv[p] = (__m512bh)_mm512_loadu_si512(w + p * panel_stride + j * 2 * PANEL);
#pragma GCC unroll 6
      for (int r = 0; r < MR; ++r) {
        const __m512bh av = pair_of(ap + r * lda + 2 * j);
#pragma GCC unroll 4
        for (int p = 0; p < NR; ++p) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], av, wv[p]);
      }
    }
  }
#pragma GCC unroll 4
  for (int p = 0; p < NR; ++p) {
    const int64_t n = n0 + p * PANEL;
    if (n >= N) break;
    const __mmask16 mask = N - n >= PANEL ? (__mmask16)0xffff : (__mmask16)((1u << (N - n)) - 1);
    __m512 b = _mm512_setzero_ps();
    if (bias)
      b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias + n)), 16));
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      const __m512 v = bias ? _mm512_add_ps(acc[r][p], b) : acc[r][p];
      if (out_dtype == 0)
        _mm512_mask_storeu_ps((float*)out + (m0 + r) * ldo + n, mask, v);
      else
        _mm256_mask_storeu_epi16((uint16_t*)out + (m0 + r) * ldo + n, mask, bf16x16(v));
    }
  }
}

typedef void (*dtile_fn)(const uint16_t*, const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t, int64_t,
                         const uint16_t*, int, void*, int64_t, int64_t);
#define DTILE_FN(MR, NR)                                                                                    \
  static __attribute__((noinline)) void dtile_##MR##x##NR(const uint16_t* a, const uint16_t* a_lo, int64_t lda, \
                                                          const uint16_t* w, int64_t KP, int64_t n0, int64_t N, \
                                                          const uint16_t* bias, int out_dtype, void* out,      \
                                                          int64_t ldo, int64_t m0) {                            \
    dtile(MR, NR, a, a_lo, lda, w, KP, n0, N, bias, out_dtype, out, ldo, m0);                                   \
  }
#define DTILE_ROW(MR) DTILE_FN(MR, 1) DTILE_FN(MR, 2) DTILE_FN(MR, 3) DTILE_FN(MR, 4)
DTILE_ROW(1)
DTILE_ROW(2)
DTILE_ROW(3)
DTILE_ROW(4)
DTILE_ROW(5)
DTILE_ROW(6)
#define DTILE_PTRS(MR) {dtile_##MR##x1, dtile_##MR##x2, dtile_##MR##x3, dtile_##MR##x4}
static const dtile_fn dtiles[6][4] = {DTILE_PTRS(1), DTILE_PTRS(2), DTILE_PTRS(3),
                                      DTILE_PTRS(4), DTILE_PTRS(5), DTILE_PTRS(6)};

/* Rows m0 .. m0 + rows (bf16, row stride lda; a_lo: low halves or NULL) against panels p0 .. p1:
   for each group of up to 4 panels, every row tile, so the group stays in cache. */
static void run_panels_dp(const uint16_t* a, const uint16_t* a_lo, int64_t lda, int64_t rows, int64_t m0,
                          const uint16_t* wp, int64_t KP, int64_t N, int64_t p0, int64_t p1, const uint16_t* bias,
                          int out_dtype, void* out, int64_t ldo) {
  for (int64_t p = p0; p < p1; p += 4) {
    const int nr = (int)(p1 - p < 4 ? p1 - p : 4);
    const uint16_t* w = wp + p * KP * 2 * PANEL;
    for (int64_t r = 0; r < rows;) {
      const int mr = (int)(rows - r >= 6 ? 6 : rows - r);
      dtiles[mr - 1][nr - 1](a + r * lda, a_lo ? a_lo + r * lda : 0, lda, w, KP, p * PANEL, N, bias, out_dtype,
                             out, ldo, m0 + r);
      r += mr;
    }
  }
}
#endif

/* Portable tile: same shape and order of sums per output, plain C. */
static void tile_generic(int MR, int NR, const float* a, int64_t lda, const uint16_t* w, int64_t K, int64_t n0,
                         int64_t N, const uint16_t* bias, int out_dtype, void* out, int64_t ldo, int64_t m0) {
  float acc[6][4 * PANEL];
  memset(acc, 0, sizeof acc);
  for (int p = 0; p < NR; ++p) {
    const uint16_t* wpanel = w + p * K * PANEL;
    for (int64_t k = 0; k < K; ++k) {
      float wf[PANEL];
      for (int c = 0; c < PANEL; ++c) wf[c] = bf16_to_f32(wpanel[k * PANEL + panel_slot(c)]);
      for (int r = 0; r < MR; ++r) {
        const float av = a[r * lda + k];
        for (int c = 0; c < PANEL; ++c) acc[r][p * PANEL + c] += av * wf[c];
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    const int64_t ncols = N - n0 < NR * PANEL ? N - n0 : NR * PANEL;
    if (ncols > 0) store_row(out_dtype, out, ldo, m0 + r, n0, ncols, acc[r], bias);
  }
}

/* Rows m0 .. m0 + rows of the chunk (float32, row stride K) against panels p0 .. p1. */
static void run_panels(const float* a, int64_t rows, int64_t m0, const uint16_t* wp, int64_t K, int64_t N,
                       int64_t p0, int64_t p1, const uint16_t* bias, int out_dtype, void* out, int64_t ldo) {
  const int nr_max = rows >= 3 ? 1 : rows == 2 ? 2 : 4;
  for (int64_t p = p0; p < p1;) {
    const int nr = (int)(p1 - p < nr_max ? p1 - p : nr_max);
    const uint16_t* w = wp + p * K * PANEL;
    const int64_t n0 = p * PANEL;
    for (int64_t r = 0; r < rows;) {
      const int mr = (int)(rows - r >= 6 ? 6 : rows - r);
      const float* ar = a + r * K;
#ifdef PAGEDLLM_AVX2
      switch (mr * 8 + nr) {
        case 6 * 8 + 1: tile_6x1(ar, K, w, K, n0, N, bias, out_dtype, out, ldo, m0 + r); break;
        case 5 * 8 + 1: tile_5x1(ar, K, w, K, n0, N, bias, out_dtype, out, ldo, m0 + r); break;
        case 4 * 8 + 1: tile_4x1(ar, K, w, K, n0, N, bias, out_dtype, out, ldo, m0 + r); break;
        case 3 * 8 + 1: tile_3x1(ar, K, w, K, n0, N, bias, out_dtype, out, ldo, m0 + r); break;
        case 2 * 8 + 2: tile_2x2(ar, K, w, K, n0, N, bias, out_dtype, out, ldo, m0 + r); break;
        case 2 * 8 + 1: tile_2x1(ar, K, w, K, n0, N, bias, out_dtype, out, ldo, m0 + r); break;
        case 1 * 8 + 4: tile_1x4(ar, K, w, K, n0, N, bias, out_dtype, out, ldo, m0 + r); break;
        case 1 * 8 + 3: tile_1x3(ar, K, w, K, n0, N, bias, out_dtype, out, ldo, m0 + r); break;
        case 1 * 8 + 2: tile_1x2(ar, K, w, K, n0, N, bias, out_dtype, out, ldo, m0 + r); break;
        case 1 * 8 + 1: tile_1x1(ar, K, w, K, n0, N, bias, out_dtype, out, ldo, m0 + r); break;
        default: abort(); /* unreachable: run_panels only makes the shapes above */
      }
      /* chunks of >= 3 rows use one panel per tile, chunks of 1 or 2 rows up to 4 or 2:
         the cases above are every (mr, nr) reached */
#else
      tile_generic(mr, nr, ar, K, w, K, n0, N, bias, out_dtype, out, ldo, m0 + r);
#endif
      r += mr;
    }
    p += nr;
  }
}

/* The calling thread's float32 A buffer of at least n floats (grown, never shrunk), held under
   a pthread key whose destructor frees it when the thread ends: OpenMP retires and recreates
   pool threads when team sizes change, and a plain __thread pointer would leak each buffer. */
typedef struct {
  float* data;
  int64_t cap;
} thread_buf;
static pthread_key_t buf_key;
static pthread_once_t buf_once = PTHREAD_ONCE_INIT;
static void buf_free(void* p) {
  free(((thread_buf*)p)->data);
  free(p);
}
static void buf_key_init(void) { pthread_key_create(&buf_key, buf_free); }

static float* thread_buffer(int64_t n) {
  pthread_once(&buf_once, buf_key_init);
  thread_buf* b = (thread_buf*)pthread_getspecific(buf_key);
  if (!b) {
    b = (thread_buf*)calloc(1, sizeof *b);
    if (!b || pthread_setspecific(buf_key, b)) {
      free(b);
      return 0;
    }
  }
  if (n > b->cap) {
    free(b->data);
    b->data = (float*)aligned_alloc(64, (size_t)((n + 15) / 16 * 16) * sizeof(float));
    b->cap = b->data ? n : 0;
  }
  return b->data;
}

/* The calling OpenMP thread's share of P panels: [p0, p1). */
static inline void my_panels(int64_t P, int64_t* p0, int64_t* p1) {
  int t = 0, nt = 1;
#ifdef _OPENMP
  t = omp_get_thread_num();
  nt = omp_get_num_threads();
#endif
  *p0 = P * t / nt;
  *p1 = P * (t + 1) / nt;
}

/* Rows per chunk: about `rows` (what fits the chunk's bytes), a multiple of the 6-row tile, at most M. */
static inline int64_t row_chunk(int64_t rows, int64_t M) {
  rows = rows < 6 ? 6 : rows / 6 * 6;
  return rows > M ? M : rows;
}

/* The weight layout this build's GEMM reads: 0 = the AVX2 / portable panels [P, K, 16] with
   permuted columns, 1 = the AVX512-BF16 pairs [P, ceil(K / 2), 16, 2]. */
int pagedllm_gemm_bf16_layout(void) {
#ifdef PAGEDLLM_DPBF16
  return 1;
#else
  return 0;
#endif
}

#ifdef PAGEDLLM_DPBF16
#define CHUNK_BYTES_DP (256 * 1024) /* bf16 A per row chunk (L2: 1 MiB per Zen 4 core) */

/* a = hi + lo in bf16 (to about 2^-17 relative). inf and NaN keep lo = 0 (inf - inf would be
   NaN); a finite value that rounds to inf takes the truncated hi, so hi + lo stays finite. The
   tests are on the bits: the library is compiled with -ffast-math, where isfinite() is folded. */
static inline void split_bf16(float a, uint16_t* hi, uint16_t* lo) {
  uint32_t u;
  memcpy(&u, &a, 4);
  uint16_t h = f32_to_bf16(a);
  if ((u & 0x7f800000u) == 0x7f800000u) { /* inf or NaN */
    *hi = h;
    *lo = 0;
    return;
  }
  if ((h & 0x7f80u) == 0x7f80u) h = (uint16_t)(u >> 16); /* rounded up to inf: truncate */
  *hi = h;
  *lo = f32_to_bf16(a - bf16_to_f32(h));
}

/* The pairs-layout GEMM: bf16 A with an even K is read in place; an odd K is copied with a
   zero column appended; a float32 A is split into bf16 high and low halves (a = hi + lo to
   about 2^-17 relative), each multiplied in turn into the same accumulators. */
static int gemm_dp(int a_dtype, const void* a, int64_t lda, const uint16_t* wp, const uint16_t* bias, int out_dtype,
                   void* out, int64_t ldo, int64_t M, int64_t N, int64_t K, int num_threads) {
  const int64_t P = (N + PANEL - 1) / PANEL, KP = (K + 1) / 2, lda2 = 2 * KP;
  const int direct = a_dtype == 1 && K % 2 == 0;
  const int halves = a_dtype == 0 ? 2 : 1;
  const int64_t chunk = row_chunk(CHUNK_BYTES_DP / (2 * lda2 * halves), M);
  int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1) reduction(| : failed)
  {
    int64_t p0, p1;
    my_panels(P, &p0, &p1);
    uint16_t* buf = direct ? 0 : (uint16_t*)thread_buffer((chunk * lda2 * halves + 1) / 2);
    if (!direct && !buf) {
      failed = 1;
    } else {
      for (int64_t m0 = 0; m0 < M; m0 += chunk) {
        const int64_t rows = M - m0 < chunk ? M - m0 : chunk;
        if (direct) {
          run_panels_dp((const uint16_t*)a + m0 * lda, 0, lda, rows, m0, wp, KP, N, p0, p1, bias, out_dtype, out,
                        ldo);
          continue;
        }
        uint16_t* lo = halves == 2 ? buf + rows * lda2 : 0;
        for (int64_t r = 0; r < rows; ++r) {
          uint16_t* dst = buf + r * lda2;
          if (a_dtype == 1) {
            memcpy(dst, (const uint16_t*)a + (m0 + r) * lda, (size_t)K * 2);
          } else {
            const float* src = (const float*)a + (m0 + r) * lda;
            for (int64_t k = 0; k < K; ++k) split_bf16(src[k], dst + k, lo + r * lda2 + k);
            if (K < lda2) lo[r * lda2 + K] = 0;
          }
          if (K < lda2) dst[K] = 0;
        }
        run_panels_dp(buf, lo, lda2, rows, m0, wp, KP, N, p0, p1, bias, out_dtype, out, ldo);
      }
    }
  }
  return failed ? 2 : 0;
}
#endif

/* The FMA-layout GEMM (AVX2 or portable tiles): A converted to float32 row chunks per thread. */
static int gemm_fma(int a_dtype, const void* a, int64_t lda, const uint16_t* wp, const uint16_t* bias, int out_dtype,
                    void* out, int64_t ldo, int64_t M, int64_t N, int64_t K, int num_threads) {
  const int64_t P = (N + PANEL - 1) / PANEL;
  const int64_t chunk = row_chunk(CHUNK_FLOATS / K, M);
  int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1) reduction(| : failed)
  {
    int64_t p0, p1;
    my_panels(P, &p0, &p1);
    float* buf = thread_buffer(chunk * K);
    if (!buf) {
      failed = 1;
    } else {
      for (int64_t m0 = 0; m0 < M; m0 += chunk) {
        const int64_t rows = M - m0 < chunk ? M - m0 : chunk;
        for (int64_t r = 0; r < rows; ++r) {
          float* dst = buf + r * K;
          if (a_dtype == 0) {
            memcpy(dst, (const float*)a + (m0 + r) * lda, (size_t)K * sizeof(float));
          } else {
            const uint16_t* src = (const uint16_t*)a + (m0 + r) * lda;
            for (int64_t k = 0; k < K; ++k) dst[k] = bf16_to_f32(src[k]);
          }
        }
        run_panels(buf, rows, m0, wp, K, N, p0, p1, bias, out_dtype, out, ldo);
      }
    }
  }
  return failed ? 2 : 0;
}

int pagedllm_gemm_bf16w(int a_dtype, const void* a, int64_t lda, const uint16_t* wp, const uint16_t* bias,
                        int out_dtype, void* out, int64_t ldo, int64_t M, int64_t N, int64_t K, int num_threads) {
  if (M < 0 || N < 1 || K < 1 || lda < K || ldo < N || (a_dtype != 0 && a_dtype != 1) ||
      (out_dtype != 0 && out_dtype != 1))
    return 1;
  if (M == 0) return 0;
  const int64_t P = (N + PANEL - 1) / PANEL;
  if (num_threads < 1) num_threads = 1;
  if (num_threads > P) num_threads = (int)P;
#ifdef PAGEDLLM_DPBF16
  return gemm_dp(a_dtype, a, lda, wp, bias, out_dtype, out, ldo, M, N, K, num_threads);
#else
  return gemm_fma(a_dtype, a, lda, wp, bias, out_dtype, out, ldo, M, N, K, num_threads);
#endif
}
