/*
 * Matmul with bfloat16 weights on CPUs without bf16 arithmetic (no AVX512-BF16 / AMX), where
 * torch's bf16 matmuls fall back to slow emulation (10 GFLOP/s against 60 for float32 on a
 * 2-core AVX2 EPYC):
 *
 *   out[m, n] = round(sum_k A[m, k] * W[n, k] + bias[n])     (out: bf16 or float32)
 *
 * Every product and sum is float32 (a product of two bf16 values is exact in float32), with one
 * rounding per output, as oneDNN's bf16 GEMM does; only the summation order differs.
 *
 * Layouts (element offsets):
 *   A     [M, K]   a[m * lda + k], bf16 (a_dtype 1) or float32 (0)
 *   wp    [P, K, 16] bf16, P = ceil(N / 16): the weight [N, K] in panels of 16 output columns,
 *         k-major, padded with zero columns; inside a panel the columns are stored in the order
 *         0-3, 8-11, 4-7, 12-15 so that AVX2's unpacklo / unpackhi of one 256-bit load against
 *         zero give float32 columns 0-7 and 8-15 (kernels/cpu_kernels.py: pack_bf16_weight).
 *   bias  [N] bf16 or NULL
 *   out   [M, N]   out[m * ldo + n], bf16 (out_dtype 1) or float32 (0)
 *
 * Blocking (the GotoBLAS / BLIS scheme: Goto & van de Geijn 2008, Van Zee & van de Geijn
 * 2015): each OpenMP thread owns a contiguous range of panels. Rows are taken in chunks of
 * about 96 KiB of float32 A, which each thread converts into its own buffer (kept in L2);
 * for each of its panel groups it runs register tiles of MR rows x NR panels (6 x 1, 2 x 2 or
 * 1 x 4: 12, 8 or 8 accumulators of 8 floats) over the whole K, so a panel group is read from
 * memory once per chunk and from cache for every tile. One row (decode at batch 1) streams the
 * weights once: the bf16 layout halves the bytes of a float32 GEMV.
 * Built and loaded by kernels/cpu_kernels.py (gcc -O3 -march=native -fopenmp); called through
 * ctypes with the GIL released. Without AVX2 + FMA a portable C tile of the same shape is used.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bf16.h"
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDLLM_AVX2 1
#endif

#define PANEL 16
#ifndef PF_K
#define PF_K 16 /* prefetch distance in k (16 x 32 bytes); one row, 30 SmolLM2 layers: 18.1 -> 19.2 GB/s */
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

int pagedllm_gemm_bf16w(int a_dtype, const void* a, int64_t lda, const uint16_t* wp, const uint16_t* bias,
                        int out_dtype, void* out, int64_t ldo, int64_t M, int64_t N, int64_t K, int num_threads) {
  if (M < 0 || N < 1 || K < 1 || lda < K || ldo < N || (a_dtype != 0 && a_dtype != 1) ||
      (out_dtype != 0 && out_dtype != 1))
    return 1;
  if (M == 0) return 0;
  const int64_t P = (N + PANEL - 1) / PANEL;
  int64_t chunk = CHUNK_FLOATS / K;
  chunk = chunk < 6 ? 6 : chunk / 6 * 6;
  if (chunk > M) chunk = M;
  int failed = 0;
  if (num_threads < 1) num_threads = 1;
  if (num_threads > P) num_threads = (int)P;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1) reduction(| : failed)
  {
    int t = 0, nt = 1;
#ifdef _OPENMP
    t = omp_get_thread_num();
    nt = omp_get_num_threads();
#endif
    const int64_t p0 = P * t / nt, p1 = P * (t + 1) / nt;
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
