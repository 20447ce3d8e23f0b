/*
 * Matmul with GGUF-quantized weights kept as their raw blocks (services/executor/layers/gguf.py):
 *
 *   out[m, n] = sum_k A[m, k] * W[n, k]          (out: bf16 rounded once, or float32)
 *
 * W [N, K] is N rows of blocks of consecutive k (32 or, for the K-quants, 256), in ggml's layouts:
 *   Q4_0 (type 2, 18 bytes): fp16 d, 16 bytes q (k = j: low nibble of byte j, k = j + 16: its
 *        high nibble);                           w = d * (q - 8)
 *   Q4_1 (type 3, 20 bytes): fp16 d, fp16 m, 16 bytes q as Q4_0;   w = d * q + m
 *   Q8_0 (type 8, 34 bytes): fp16 d, 32 int8 q;                    w = d * q
 * and, in super-blocks of 256 k (8 sub-blocks of 32; gguf-py's quants.py is the reference):
 *   Q4_K (type 12, 144 bytes): fp16 d, fp16 dmin, 12 bytes of 6-bit scales sc[8] and mins m[8]
 *        (j < 4: sc = s[j] & 63, m = s[j + 4] & 63; j >= 4: sc = s[j + 4] & 15 | s[j - 4] >> 6 << 4,
 *        m = s[j + 4] >> 4 | s[j] >> 6 << 4), 128 bytes q (sub-block j: bytes 32 (j / 2) .. + 31,
 *        low nibbles for even j, high for odd);   w = d sc[j] * q - dmin m[j]
 *   Q5_K (type 13, 176 bytes): as Q4_K, with 32 bytes qh before the 128 bytes of low nibbles:
 *        bit j of qh[e] is bit 4 of element e of sub-block j
 *   Q6_K (type 14, 210 bytes): 128 bytes ql, 64 bytes qh, 16 int8 scales, fp16 d; element
 *        i = 128 g + 32 s + e (e < 32): low 4 bits ql[64 g + 32 (s % 2) + e] >> 4 (s / 2), high
 *        2 bits qh[32 g + e] >> 2 s;              w = d scales[i / 16] * (q - 32)
 *
 * Where the build has int8 dot products (GGUF_INT8_DOT: AVX512-VNNI), bf16 activations with Q4_0,
 * Q4_1 or Q8_0 weights take the int8-activation path of cpu_gguf_q8.c (as llama.cpp: the
 * activations quantized to int8 per 32-element block, integer dot products; its header states the
 * numerics), and weights of any type in the 16-row interleaved layout (type | GGUF_R16) the int8
 * path of cpu_gguf_r16.c (Q4_0, Q4_1, Q8_0) or cpu_gguf_r16k.c (Q4_K, Q5_K, Q6_K). Interleaved
 * weights otherwise (float32 activations, or a build without VNNI) take the path below on each
 * group's 16 rows unpacked to the file's layout. Everything else takes the float32 path below:
 * each OpenMP thread owns a contiguous range of output rows n. For each row, the activation rows
 * are taken in tiles of up to MT: every 32 elements of the weight row are dequantized once per
 * tile into two vectors of 16 floats (AVX-512) and multiplied into MT float32 accumulators, so a
 * block's dequantization is shared by the tile's rows; the weights are read at their quantized
 * size (20 bytes per 32 weights for Q4_1 against 64 in bf16). A bf16 A (the K-quants; any type
 * without VNNI) is first widened to float32 (once per call). Without AVX-512 a portable C loop
 * of the same order serves. Float32 sums; the summation order (and the dequantization's fused
 * multiply-adds) differ from torch's dequantize-then-matmul by float32 rounding.
 * Built and loaded by kernels/cpu/native.py, called through kernels/cpu/quant_ops.py: gemm_gguf.
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
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__F16C__)
#include <immintrin.h>
#define GGUF_AVX512 1
#endif

#define QK 32  /* elements per block (a K-quant's sub-block) */
#define QKK 256 /* elements per K-quant super-block */
#define MT 8  /* activation rows per tile */

static int block_bytes(int qtype) {
  switch (qtype) {
    case GGUF_Q4_0: return 18;
    case GGUF_Q4_1: return 20;
    case GGUF_Q8_0: return 34;
    case GGUF_Q4_K: return 144;
    case GGUF_Q5_K: return 176;
    case GGUF_Q6_K: return 210;
    default: return 0;
  }
}

static int block_elems(int qtype) { return qtype >= GGUF_Q4_K ? QKK : QK; }

/* Q4_K / Q5_K: the 6-bit scale and min of sub-block j from the 12 scale bytes s. */
static inline void k_scale_min(const uint8_t* s, int j, int* sc, int* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

/* Sub-block j (32 elements) of a K-quant super-block b: the scale of elements 0-15 (*dlo) and
 * 16-31 (*dhi), the offset subtracted (*dm, Q4_K / Q5_K), and the 32 quants (Q6_K: minus 32). */
static inline void k_sub_block(int qtype, const uint8_t* b, int j, float* dlo, float* dhi, float* dm, int8_t* q) {
  if (qtype == GGUF_Q6_K) {
    const float d = fp16_at(b + 208);
    const int8_t* sc = (const int8_t*)(b + 192);
    const uint8_t* ql = b + 64 * (j / 4) + 32 * (j % 2);
    const uint8_t* qh = b + 128 + 32 * (j / 4);
    const int shl = 4 * ((j % 4) / 2), shh = 2 * (j % 4);
    *dlo = d * (float)sc[2 * j];
    *dhi = d * (float)sc[2 * j + 1];
    *dm = 0.f;
    for (int e = 0; e < QK; ++e) q[e] = (int8_t)((((ql[e] >> shl) & 15) | (((qh[e] >> shh) & 3) << 4)) - 32);
    return;
  }
  int sc, m;
  k_scale_min(b + 4, j, &sc, &m);
  *dlo = *dhi = fp16_at(b) * (float)sc;
  *dm = fp16_at(b + 2) * (float)m;
  const uint8_t* qs = b + (qtype == GGUF_Q5_K ? 48 : 16) + 32 * (j / 2);
  const int sh = 4 * (j % 2);
  for (int e = 0; e < QK; ++e) q[e] = (int8_t)((qs[e] >> sh) & 15);
  if (qtype == GGUF_Q5_K)
    for (int e = 0; e < QK; ++e) q[e] |= (int8_t)(((b[16 + e] >> j) & 1) << 4);
}

/* Sub-block j of one block -> w[32] (portable; j = 0 but for the K-quants). */
static inline void dequant_block(int qtype, const uint8_t* b, int j, float* w) {
  if (qtype >= GGUF_Q4_K) {
    float dlo, dhi, dm;
    int8_t q[QK];
    k_sub_block(qtype, b, j, &dlo, &dhi, &dm, q);
    for (int e = 0; e < QK; ++e) w[e] = (e < QK / 2 ? dlo : dhi) * (float)q[e] - dm;
    return;
  }
  const float d = fp16_at(b);
  if (qtype == GGUF_Q8_0) {
    for (int j = 0; j < QK; ++j) w[j] = d * (float)(int8_t)b[2 + j];
  } else if (qtype == GGUF_Q4_1) {
    const float m = fp16_at(b + 2);
    for (int j = 0; j < QK / 2; ++j) {
      w[j] = d * (float)(b[4 + j] & 15) + m;
      w[j + QK / 2] = d * (float)(b[4 + j] >> 4) + m;
    }
  } else {
    for (int j = 0; j < QK / 2; ++j) {
      w[j] = d * (float)((b[2 + j] & 15) - 8);
      w[j + QK / 2] = d * (float)((b[2 + j] >> 4) - 8);
    }
  }
}

#ifdef GGUF_AVX512
/* Sub-block j of a K-quant super-block b -> elements 0-15 in *lo, 16-31 in *hi. */
static inline void dequant_k_avx512(int qtype, const uint8_t* b, int j, __m512* lo, __m512* hi) {
  const __m128i mask = _mm_set1_epi8(15);
  __m128i q0, q1;
  float dlo, dhi, dm = 0.f;
  if (qtype == GGUF_Q6_K) {
    const float d = _cvtsh_ss(load_u16(b + 208));
    const int8_t* sc = (const int8_t*)(b + 192);
    const uint8_t* ql = b + 64 * (j / 4) + 32 * (j % 2);
    const uint8_t* qh = b + 128 + 32 * (j / 4);
    const __m128i shl = _mm_cvtsi32_si128(4 * ((j % 4) / 2)), shh = _mm_cvtsi32_si128(2 * (j % 4));
    const __m128i three = _mm_set1_epi8(3);
    q0 = _mm_or_si128(_mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i*)ql), shl), mask),
                      _mm_slli_epi16(_mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i*)qh), shh), three), 4));
    q1 = _mm_or_si128(_mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i*)(ql + 16)), shl), mask),
                      _mm_slli_epi16(_mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i*)(qh + 16)), shh), three), 4));
    const __m128i off = _mm_set1_epi8(32);
    q0 = _mm_sub_epi8(q0, off); /* -32 .. 31 */
    q1 = _mm_sub_epi8(q1, off);
    dlo = d * (float)sc[2 * j];
    dhi = d * (float)sc[2 * j + 1];
    *lo = _mm512_mul_ps(_mm512_set1_ps(dlo), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)));
    *hi = _mm512_mul_ps(_mm512_set1_ps(dhi), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)));
    return;
  }
  int sc, m;
  k_scale_min(b + 4, j, &sc, &m);
  dlo = _cvtsh_ss(load_u16(b)) * (float)sc;
  dm = _cvtsh_ss(load_u16(b + 2)) * (float)m;
  const uint8_t* qs = b + (qtype == GGUF_Q5_K ? 48 : 16) + 32 * (j / 2);
  const __m128i sh = _mm_cvtsi32_si128(4 * (j % 2));
  q0 = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i*)qs), sh), mask);
  q1 = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i*)(qs + 16)), sh), mask);
  if (qtype == GGUF_Q5_K) {
    const __m128i hj = _mm_cvtsi32_si128(j), one = _mm_set1_epi8(1);
    q0 = _mm_or_si128(q0, _mm_slli_epi16(_mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i*)(b + 16)), hj), one), 4));
    q1 = _mm_or_si128(q1, _mm_slli_epi16(_mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i*)(b + 32)), hj), one), 4));
  }
  const __m512 d = _mm512_set1_ps(dlo), vm = _mm512_set1_ps(dm);
  *lo = _mm512_sub_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q0))), vm);
  *hi = _mm512_sub_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q1))), vm);
}

/* Sub-block j of one block -> elements 0-15 in *lo, 16-31 in *hi (j = 0 but for the K-quants). */
static inline void dequant_block_avx512(int qtype, const uint8_t* b, int j, __m512* lo, __m512* hi) {
  if (qtype >= GGUF_Q4_K) {
    dequant_k_avx512(qtype, b, j, lo, hi);
    return;
  }
  const __m512 d = _mm512_set1_ps(_cvtsh_ss(load_u16(b)));
  if (qtype == GGUF_Q8_0) {
    const __m128i q0 = _mm_loadu_si128((const __m128i*)(b + 2));
    const __m128i q1 = _mm_loadu_si128((const __m128i*)(b + 18));
    *lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)));
    *hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)));
    return;
  }
  const __m128i mask = _mm_set1_epi8(15);
  const __m128i q = _mm_loadu_si128((const __m128i*)(b + (qtype == GGUF_Q4_1 ? 4 : 2)));
  const __m512 fl = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, mask)));
  const __m512 fh = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), mask)));
  if (qtype == GGUF_Q4_1) {
    const __m512 m = _mm512_set1_ps(_cvtsh_ss(load_u16(b + 2)));
    *lo = _mm512_fmadd_ps(d, fl, m);
    *hi = _mm512_fmadd_ps(d, fh, m);
  } else {
    const __m512 eight = _mm512_set1_ps(8.f);
    *lo = _mm512_mul_ps(d, _mm512_sub_ps(fl, eight));
    *hi = _mm512_mul_ps(d, _mm512_sub_ps(fh, eight));
  }
}
#endif

/* sums[i] = dot(W row wr, A row m0 + i) for i < mt. */
static void row_tile(int qtype, int bpb, const uint8_t* wr, int64_t nb, const float* a, int64_t lda, int64_t m0,
                     int mt, float* sums) {
  const int subs = block_elems(qtype) / QK; /* 32-element sub-blocks per block */
#ifdef GGUF_AVX512
  __m512 acc[MT];
  for (int i = 0; i < MT; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t blk = 0; blk < nb; ++blk) {
    for (int j = 0; j < subs; ++j) {
      __m512 lo, hi;
      dequant_block_avx512(qtype, wr + blk * bpb, j, &lo, &hi);
      const float* ab = a + m0 * lda + (blk * subs + j) * QK;
      for (int i = 0; i < mt; ++i) {
        acc[i] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(ab + i * lda), acc[i]);
        acc[i] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(ab + i * lda + 16), acc[i]);
      }
    }
  }
  for (int i = 0; i < mt; ++i) sums[i] = _mm512_reduce_add_ps(acc[i]);
#else
  float w[QK];
  for (int i = 0; i < mt; ++i) sums[i] = 0.f;
  for (int64_t blk = 0; blk < nb; ++blk) {
    for (int j = 0; j < subs; ++j) {
      dequant_block(qtype, wr + blk * bpb, j, w);
      const float* ab = a + m0 * lda + (blk * subs + j) * QK;
      for (int i = 0; i < mt; ++i) {
        float s = 0.f;
        for (int e = 0; e < QK; ++e) s += w[e] * ab[i * lda + e];
        sums[i] += s;
      }
    }
  }
#endif
}

/* out[:, n] = A . W row n (its blocks at wr), float32 A. */
static void raw_row(int qtype, int bpb, const uint8_t* wr, int64_t nb, const float* af, int64_t lda, int64_t M,
                    int out_dtype, void* out, int64_t ldo, int64_t n) {
  float sums[MT];
  for (int64_t m0 = 0; m0 < M; m0 += MT) {
    const int mt = (int)(M - m0 < MT ? M - m0 : MT);
    row_tile(qtype, bpb, wr, nb, af, lda, m0, mt, sums);
    for (int i = 0; i < mt; ++i) {
      if (out_dtype == 0)
        ((float*)out)[(m0 + i) * ldo + n] = sums[i];
      else
        ((uint16_t*)out)[(m0 + i) * ldo + n] = f32_to_bf16(sums[i]);
    }
  }
}

int pagedllm_gguf_int8_dot(void) { return GGUF_INT8_DOT; }

int pagedllm_gemm_gguf(int qtype, const uint8_t* w, int a_dtype, const void* a, int64_t lda, int out_dtype,
                       void* out, int64_t ldo, int64_t M, int64_t N, int64_t K, int num_threads) {
  const int r16 = (qtype & GGUF_R16) != 0;
  if (r16) {
    qtype &= ~GGUF_R16;
    if (!(gguf_r16_supports(qtype) || gguf_r16k_supports(qtype)) || N % 16) return 1;
  }
  const int bpb = block_bytes(qtype);
  if (bpb == 0 || K % block_elems(qtype) != 0 || M < 0 || N < 0) return 1;
#if GGUF_INT8_DOT
  if (a_dtype == 1 && r16 && gguf_r16k_supports(qtype)) /* bf16 A, interleaved K-quant rows: cpu_gguf_r16k.c */
    return gguf_gemm_r16k_q8a(qtype, w, (const uint16_t*)a, lda, out_dtype, out, ldo, M, N, K, num_threads);
  if (a_dtype == 1 && r16) /* bf16 A, interleaved rows: cpu_gguf_r16.c */
    return gguf_gemm_r16_q8a(qtype, w, (const uint16_t*)a, lda, out_dtype, out, ldo, M, N, K, num_threads);
  if (a_dtype == 1 && gguf_q8a_supports(qtype)) /* bf16 A: int8 activations (cpu_gguf_q8.c) */
    return gguf_gemm_q8a(qtype, w, (const uint16_t*)a, lda, out_dtype, out, ldo, M, N, K, num_threads);
#endif
  const int64_t nb = K / block_elems(qtype);
  const float* af = (const float*)a;
  float* widened = NULL;
  if (a_dtype == 1) { /* bf16 A: widened once */
    widened = (float*)malloc((size_t)(M * K > 0 ? M * K : 1) * sizeof(float));
    if (!widened) return 3;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && M * K > 65536)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) widened[m * K + k] = bf16_to_f32(((const uint16_t*)a)[m * lda + k]);
    af = widened;
    lda = K;
  }
  int status = 0;
  if (r16) { /* float32 A (or bf16 widened without VNNI): each group of 16 rows unpacked to the file's blocks */
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && N > 16)
    {
      uint8_t* raw = (uint8_t*)malloc((size_t)(16 * nb * bpb));
      if (!raw) {
#pragma omp atomic write
        status = 3;
      }
#pragma omp for schedule(static)
      for (int64_t g = 0; g < N / 16; ++g) {
        if (!raw) continue;
        (gguf_r16k_supports(qtype) ? gguf_r16k_unpack : gguf_r16_unpack)(qtype, w + g * 16 * nb * bpb, nb, raw);
        for (int r = 0; r < 16; ++r) raw_row(qtype, bpb, raw + r * nb * bpb, nb, af, lda, M, out_dtype, out, ldo, 16 * g + r);
      }
      free(raw);
    }
  } else {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && N > 1)
    for (int64_t n = 0; n < N; ++n) raw_row(qtype, bpb, w + n * nb * bpb, nb, af, lda, M, out_dtype, out, ldo, n);
  }
  free(widened);
  return status;
}
