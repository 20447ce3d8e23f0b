/*
 * GGUF Q4_0 / Q4_1 / Q8_0 weights with their rows interleaved by 16 (type | GGUF_R16, packed by
 * services/executor/layers/gguf_r16.py) times int8-quantized bf16 activations (the per-block
 * quantization of cpu_gguf_q8.c, whose header states it: gguf_q8_quantize_block).
 *
 * Layout of W [N, K] (N a multiple of 16, nb = K / 32 blocks per row, bpb the type's block bytes,
 * so the size is the file's): rows 16 g .. 16 g + 15 form group g; its block b lies at byte
 * (g nb + b) 16 bpb and holds
 *   16 fp16 d (row r at byte 2 r), for Q4_1 then 16 fp16 m, then the quants as 64-byte vectors
 *   whose 4-byte lane r holds 4 consecutive k of row r:
 *   Q4_0 / Q4_1: 4 vectors, vector p lane r = the row's quant bytes 4 p .. 4 p + 3 as in the file
 *     (low nibbles: k = 4 p .. 4 p + 3; high nibbles: k = 16 + 4 p .. 16 + 4 p + 3);
 *   Q8_0: 8 vectors, vector j lane r = the row's int8 q[4 j .. 4 j + 3] + 128 (stored q XOR 0x80).
 * With AVX512-VNNI, vpdpbusd (unsigned weight bytes times 4 signed activation bytes broadcast to
 * every lane, summed in fours into int32 lanes) multiplies a block of 16 rows into the 16 lanes of
 * one vector, with no horizontal sum; each block's unpacked weights serve a tile of up to MT
 * activation rows. Per block, for the 16 rows r of a group (qa, d_a, s_a = sum qa: the
 * activation row's int8 block):
 *   dot[r] = sum_k u[r, k] qa[k]                 (u: the nibble 0..15, or q + 128; exact int32)
 *   Q4_0: dot -= 8 s_a;  Q8_0: dot -= 128 s_a    (exact: dot is then sum_k q[r, k] qa[k])
 *   acc[r] += (d_w[r] * d_a) * float(dot)        (the product rounded once, then a fused multiply-add)
 *   Q4_1: acc[r] += m_w[r] * (d_a s_a)
 * Blocks are added in order into one float32 accumulator per output, so the result differs from
 * the exact sum of the quantized operands by float32 rounding only, like cpu_gguf_q8.c's.
 * Compiled only where the build has VNNI (GGUF_INT8_DOT in cpu_gguf_q8.h); elsewhere, and for
 * float32 activations, cpu_gguf_gemm.c's float32 path serves each group unpacked to its 16 rows of
 * file blocks (gguf_r16_unpack).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bf16.h"
#include "cpu_gguf_q8.h"
#include "pagedllm_abi.h"
#ifdef _OPENMP
#include <omp.h>
#endif
#if GGUF_INT8_DOT
#include <immintrin.h>
#endif

#define QK 32 /* elements per block */
#define RG 16 /* rows per group */
#define MT 8  /* activation rows per tile */

int gguf_r16_supports(int qtype) { return qtype == GGUF_Q4_0 || qtype == GGUF_Q4_1 || qtype == GGUF_Q8_0; }

static int bytes_per_block(int qtype) { return qtype == GGUF_Q4_0 ? 18 : qtype == GGUF_Q4_1 ? 20 : 34; }

void gguf_r16_unpack(int qtype, const uint8_t* group, int64_t nb, uint8_t* rows) {
  const int bpb = bytes_per_block(qtype), q_off = qtype == GGUF_Q4_1 ? 4 : 2, scales = qtype == GGUF_Q4_1 ? 64 : 32;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = group + b * RG * bpb;
    const uint8_t* qs = blk + scales;
    for (int r = 0; r < RG; ++r) {
      uint8_t* dst = rows + (r * nb + b) * bpb;
      memcpy(dst, blk + 2 * r, 2);
      if (qtype == GGUF_Q4_1) memcpy(dst + 2, blk + 32 + 2 * r, 2);
      uint8_t* dq = dst + q_off;
      if (qtype == GGUF_Q8_0) {
        for (int j = 0; j < 8; ++j)
          for (int t = 0; t < 4; ++t) dq[4 * j + t] = qs[64 * j + 4 * r + t] ^ 0x80;
      } else {
        for (int p = 0; p < 4; ++p) memcpy(dq + 4 * p, qs + 64 * p + 4 * r, 4);
      }
    }
  }
}

#if GGUF_INT8_DOT
/* The int8 activations: M rows of nb blocks. */
typedef struct {
  int64_t nb;
  int8_t* q;   /* [M, nb * 32] */
  float* d;    /* [M, nb] d_a */
  int32_t* s;  /* [M, nb] s_a */
  float* ds;   /* [M, nb] d_a * s_a (Q4_1) */
} act_r16;

static inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

/* out[m0 + i, n0 .. n0 + 15] for i < mt: the group at wg times activation rows m0 .. m0 + mt - 1. */
static inline __attribute__((always_inline)) void group_tile(const int qt, const uint8_t* wg, const act_r16* A,
                                                             int64_t m0, int mt, int out_dtype, void* out,
                                                             int64_t ldo, int64_t n0) {
  const int64_t nb = A->nb, step = (int64_t)RG * (qt == GGUF_Q4_0 ? 18 : qt == GGUF_Q4_1 ? 20 : 34);
  const int scales = qt == GGUF_Q4_1 ? 64 : 32;
  __m512 acc[MT];
#pragma GCC unroll 8
  for (int i = 0; i < MT; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = wg + b * step;
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)blk));
    const __m512 mv = qt == GGUF_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + 32)))
                                      : _mm512_setzero_ps();
    const uint8_t* qs = blk + scales;
    __m512i wv[8];
    if (qt == GGUF_Q8_0) {
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) wv[j] = _mm512_loadu_si512((const void*)(qs + 64 * j));
    } else {
      const __m512i low = _mm512_set1_epi8(15);
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        const __m512i v = _mm512_loadu_si512((const void*)(qs + 64 * p));
        wv[p] = _mm512_and_si512(v, low);
        wv[p + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MT; ++i) {
      if (i >= mt) break;
      const int64_t ab = (m0 + i) * nb + b;
      const int8_t* aq = A->q + ab * QK;
      __m512i lo = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[0], bcast4(aq));
      __m512i hi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[4], bcast4(aq + 16));
#pragma GCC unroll 3
      for (int j = 1; j < 4; ++j) {
        lo = _mm512_dpbusd_epi32(lo, wv[j], bcast4(aq + 4 * j));
        hi = _mm512_dpbusd_epi32(hi, wv[j + 4], bcast4(aq + 16 + 4 * j));
      }
      __m512i dot = _mm512_add_epi32(lo, hi);
      if (qt != GGUF_Q4_1) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32((qt == GGUF_Q4_0 ? 8 : 128) * A->s[ab]));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dv, _mm512_set1_ps(A->d[ab])), acc[i]);
      if (qt == GGUF_Q4_1) acc[i] = _mm512_fmadd_ps(mv, _mm512_set1_ps(A->ds[ab]), acc[i]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MT; ++i) {
    if (i >= mt) break;
    if (out_dtype == 0)
      _mm512_storeu_ps((float*)out + (m0 + i) * ldo + n0, acc[i]);
    else
      _mm256_storeu_si256((__m256i*)((uint16_t*)out + (m0 + i) * ldo + n0), bf16x16(acc[i]));
  }
}

static void group_rows(int qt, const uint8_t* wg, const act_r16* A, int64_t M, int out_dtype, void* out,
                       int64_t ldo, int64_t n0) {
  for (int64_t m0 = 0; m0 < M; m0 += MT) {
    const int mt = (int)(M - m0 < MT ? M - m0 : MT);
    switch (qt) { /* the type constant inside each copy */
      case GGUF_Q4_0: group_tile(GGUF_Q4_0, wg, A, m0, mt, out_dtype, out, ldo, n0); break;
      case GGUF_Q4_1: group_tile(GGUF_Q4_1, wg, A, m0, mt, out_dtype, out, ldo, n0); break;
      default: group_tile(GGUF_Q8_0, wg, A, m0, mt, out_dtype, out, ldo, n0); break;
    }
  }
}

int gguf_gemm_r16_q8a(int qtype, const uint8_t* w, const uint16_t* a, int64_t lda, int out_dtype, void* out,
                      int64_t ldo, int64_t M, int64_t N, int64_t K, int num_threads) {
  if (!gguf_r16_supports(qtype) || K % QK != 0 || N % RG != 0 || M < 0 || N < 0) return 1;
  const int64_t nb = K / QK, groups = N / RG, gbytes = nb * RG * bytes_per_block(qtype);
  const int nt = num_threads > 1 && (groups > 1 || M > 1) ? num_threads : 1;
  const size_t rows = (size_t)(M > 0 ? M : 1), cells = rows * (size_t)nb;
  act_r16 A = {.nb = nb, .q = (int8_t*)malloc(cells * QK), .d = (float*)malloc(cells * sizeof(float)),
               .s = (int32_t*)malloc(cells * sizeof(int32_t)), .ds = (float*)malloc(cells * sizeof(float))};
  int status = 0;
  if (!A.q || !A.d || !A.s || !A.ds) {
    status = 3;
    goto done;
  }
#pragma omp parallel num_threads(nt)
  {
#pragma omp for schedule(static)
    for (int64_t c = 0; c < M * nb; ++c) {
      const int64_t m = c / nb, b = c % nb;
      gguf_q8_quantize_block(a + m * lda + b * QK, A.q + c * QK, &A.d[c], &A.s[c]);
      A.ds[c] = A.d[c] * (float)A.s[c];
    }
    /* the implicit barrier: every row is quantized before any is read */
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; ++g) group_rows(qtype, w + g * gbytes, &A, M, out_dtype, out, ldo, g * RG);
  }
done:
  free(A.q);
  free(A.d);
  free(A.s);
  free(A.ds);
  return status;
}
#endif /* GGUF_INT8_DOT */
