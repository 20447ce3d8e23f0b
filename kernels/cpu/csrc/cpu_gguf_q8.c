/*
 * The int8-activation path of pagedllm_gemm_gguf (cpu_gguf_gemm.c) for bf16 activations and
 * Q4_0 / Q4_1 / Q8_0 weights (block layouts in cpu_gguf_gemm.c's header):
 *
 *   out[m, n] = sum over blocks b of 32 k:  d_w[n, b] * d_a[m, b] * dot(qw[n, b], qa[m, b])
 *                                         (+ m_w[n, b] * d_a[m, b] * s_a[m, b] for Q4_1)
 *
 * as llama.cpp does with its Q8_0 / Q8_1 activation blocks. Each activation row is quantized
 * once per call, per 32-element block: amax = max |x| (x the bf16 value widened exactly),
 * d_a = amax * fl(1/127), qa = round-half-even(x * fl(127 / amax)) in [-127, 127] (0 where
 * amax = 0), s_a = sum(qa); all float32 operations, one rounding each, so a torch reference
 * doing the same (tests/kernels/test_gguf_gemm.py) gets the same int8 blocks bit for bit. The
 * integer dot products are exact: qw are the weight's nibbles 0..15 (Q4_0's -8 subtracted
 * exactly from the nibbles) or its int8 (Q8_0). Each block's integer sum is then scaled in float32
 * (d_w * d_a rounded once, then a fused multiply-add into float32 accumulators), so the result
 * differs from the exact sum of the quantized operands by float32 rounding only, and from the
 * float32 path by the activations' int8 quantization (|error| <= d_a / 2 per element).
 *
 * With AVX-512 VNNI (vpdpbusd, unsigned bytes times signed bytes summed in fours into int32 lanes):
 * a 512-bit vector holds two blocks, 8 int32 lanes each. Q4_1 multiplies the weight's nibbles
 * (unsigned) by qa (signed); Q8_0 and Q4_0 multiply qa + 128 (unsigned: stored as qa XOR 0x80)
 * by the weight's int8 or nibble - 8 (signed), starting from -128 sum(qw), computed once per
 * weight block pair. A weight block pair is unpacked once per tile of up to MTQ
 * activation rows. Compiled only where the build has VNNI (GGUF_INT8_DOT in cpu_gguf_q8.h).
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

#define QK 32   /* elements per block */
#define LANES 8 /* int32 lanes of a block in a 512-bit vector (two blocks per vector) */
#define MTQ 16  /* activation rows per tile */

int gguf_q8a_supports(int qtype) { return qtype == GGUF_Q4_0 || qtype == GGUF_Q4_1 || qtype == GGUF_Q8_0; }

#if GGUF_INT8_DOT
/* The quantized activations: rows of nbp blocks (nb rounded up to even; the padding block is
 * zeros with d = 0, so it adds nothing). */
typedef struct {
  int64_t nbp;
  int8_t* q;      /* [M, nbp * 32] qa (Q4_0 / Q8_0: qa XOR 0x80, i.e. qa + 128 as uint8) */
  float* d;       /* [M, nbp * LANES] d_a of each block, repeated in its 8 lanes */
  float* s;       /* Q4_1: [M, nbp] d_a * s_a of each block */
} act_q8;

static inline float half(const uint8_t* p) { return _cvtsh_ss(load_u16(p)); } /* fp16 at p -> float */

void gguf_q8_quantize_block(const uint16_t* x, int8_t* q, float* d, int32_t* s) {
  const __m512 x0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)x)), 16));
  const __m512 x1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(x + 16))), 16));
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
  const __m512 id = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, id)), i1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, id));
  const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
  _mm_storeu_si128((__m128i*)q, _mm512_cvtepi32_epi8(i0));
  _mm_storeu_si128((__m128i*)(q + 16), _mm512_cvtepi32_epi8(i1));
  *d = amax * (1.0f / 127.0f);
  *s = sum;
}

/* Block b of activation row m (32 bf16 at x) -> A's int8 quants, scale and sums. */
static void quantize_block(int qtype, const uint16_t* x, act_q8* A, int64_t m, int64_t b) {
  int8_t* q = A->q + m * A->nbp * QK + b * QK;
  const int64_t l = m * A->nbp * LANES + b * LANES;
  float d;
  int32_t sum;
  gguf_q8_quantize_block(x, q, &d, &sum);
  if (qtype != GGUF_Q4_1) /* qa + 128 as uint8 */
    for (int e = 0; e < QK; ++e) q[e] = (int8_t)((uint8_t)q[e] ^ 0x80);
  for (int j = 0; j < LANES; ++j) A->d[l + j] = d;
  if (A->s) A->s[m * A->nbp + b] = d * (float)sum;
}

/* 16 bytes of Q4 nibbles (element j low nibble of byte j, j + 16 high) -> 32 bytes 0..15 in order. */
static inline __m256i nibbles(const uint8_t* p) {
  const __m128i q = _mm_loadu_si128((const __m128i*)p), mask = _mm_set1_epi8(15);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), mask), _mm_and_si128(q, mask));
}

/* sums[i] = dot(W row wr, A row m0 + i) for i < mt; qt and (for mt == 1) mt1 constant after inlining.
 * mws [nb]: scratch for Q4_1's m_w of the row's blocks. */
static inline __attribute__((always_inline)) void tile_vnni(const int qt, const int mt1, const uint8_t* wr, int bpb,
                                                            int64_t nb, const act_q8* A, int64_t m0, int mt,
                                                            float* mws, float* sums) {
  if (mt1) mt = 1;
  const int64_t ka = A->nbp * QK, kl = A->nbp * LANES;
  const int off = qt == GGUF_Q4_1 ? 4 : 2; /* quants after d (and m) */
  __m512 acc[MTQ];
#pragma GCC unroll 16
  for (int i = 0; i < MTQ; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; b += 2) {
    const uint8_t* b0 = wr + b * bpb;
    const uint8_t* b1 = b0 + bpb;
    const int two = b + 1 < nb; /* an odd last block: the pair's second half is zeros */
    const __m512 dw = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(half(b0)), _mm512_set1_ps(two ? half(b1) : 0.f));
    __m512i wv, init = _mm512_setzero_si512();
    if (qt == GGUF_Q8_0) {
      wv = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(b0 + off))),
                              two ? _mm256_loadu_si256((const __m256i*)(b1 + off)) : _mm256_setzero_si256(), 1);
    } else {
      wv = _mm512_inserti64x4(_mm512_castsi256_si512(nibbles(b0 + off)), two ? nibbles(b1 + off) : _mm256_setzero_si256(), 1);
      if (qt == GGUF_Q4_0) /* signed q - 8; the padding half of an odd pair stays 0 */
        wv = _mm512_mask_sub_epi8(wv, two ? ~0ull : 0xFFFFFFFFull, wv, _mm512_set1_epi8(8));
      if (qt == GGUF_Q4_1) {
        mws[b] = half(b0 + 2);
        if (two) mws[b + 1] = half(b1 + 2);
      }
    }
    if (qt != GGUF_Q4_1) /* -128 sum(qw) per block over its lanes: (qa + 128) . qw less this is qa . qw */
      init = _mm512_sub_epi32(init, _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8((char)0x80), wv));
#pragma GCC unroll 16
    for (int i = 0; i < MTQ; ++i) {
      if (i >= mt) break;
      const int64_t m = m0 + i;
      const __m512i av = _mm512_loadu_si512((const void*)(A->q + m * ka + b * QK)); /* [64] int8 */
      __m512i dot;
      if (qt == GGUF_Q4_1)
        dot = _mm512_dpbusd_epi32(init, wv, av);
      else
        dot = _mm512_dpbusd_epi32(init, av, wv);
      const __m512 scale = _mm512_mul_ps(dw, _mm512_loadu_ps(A->d + m * kl + b * LANES)); /* d_w d_a per lane */
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[i]);
    }
  }
  if (qt == GGUF_Q4_1) /* + sum over blocks of m_w (d_a s_a): 16 blocks per vector */
    for (int64_t b = 0; b < nb; b += 16) {
      const __mmask16 k = nb - b >= 16 ? 0xFFFF : (__mmask16)((1u << (nb - b)) - 1u);
      const __m512 mv = _mm512_maskz_loadu_ps(k, mws + b);
#pragma GCC unroll 16
      for (int i = 0; i < MTQ; ++i) {
        if (i >= mt) break;
        acc[i] = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(k, A->s + (m0 + i) * A->nbp + b), acc[i]);
      }
    }
#pragma GCC unroll 16
  for (int i = 0; i < MTQ; ++i) {
    if (i >= mt) break;
    sums[i] = _mm512_reduce_add_ps(acc[i]);
  }
}

/* sums[i] = dot(W row wr, A row m0 + i) for i < mt; mws [nb] scratch. */
static void row_tile(int qtype, int bpb, const uint8_t* wr, int64_t nb, const act_q8* A, int64_t m0, int mt,
                     float* mws, float* sums) {
  switch (qtype * 2 + (mt == 1)) {
    case GGUF_Q4_0 * 2: tile_vnni(GGUF_Q4_0, 0, wr, bpb, nb, A, m0, mt, mws, sums); return;
    case GGUF_Q4_0 * 2 + 1: tile_vnni(GGUF_Q4_0, 1, wr, bpb, nb, A, m0, mt, mws, sums); return;
    case GGUF_Q4_1 * 2: tile_vnni(GGUF_Q4_1, 0, wr, bpb, nb, A, m0, mt, mws, sums); return;
    case GGUF_Q4_1 * 2 + 1: tile_vnni(GGUF_Q4_1, 1, wr, bpb, nb, A, m0, mt, mws, sums); return;
    case GGUF_Q8_0 * 2: tile_vnni(GGUF_Q8_0, 0, wr, bpb, nb, A, m0, mt, mws, sums); return;
    default: tile_vnni(GGUF_Q8_0, 1, wr, bpb, nb, A, m0, mt, mws, sums); return;
  }
}

int gguf_gemm_q8a(int qtype, const uint8_t* w, const uint16_t* a, int64_t lda, int out_dtype, void* out, int64_t ldo,
                  int64_t M, int64_t N, int64_t K, int num_threads) {
  if (!gguf_q8a_supports(qtype) || K % QK != 0 || M < 0 || N < 0) return 1;
  const int bpb = qtype == GGUF_Q4_0 ? 18 : qtype == GGUF_Q4_1 ? 20 : 34;
  const int64_t nb = K / QK;
  act_q8 A = {.nbp = (nb + 1) / 2 * 2};
  const size_t rows = (size_t)(M > 0 ? M : 1), lanes = rows * (size_t)(A.nbp * LANES);
  A.q = (int8_t*)calloc(rows * (size_t)(A.nbp * QK), 1);
  A.d = (float*)calloc(lanes, sizeof(float));
  if (qtype == GGUF_Q4_1) A.s = (float*)calloc(rows * (size_t)A.nbp, sizeof(float));
  int status = 0;
  if (!A.q || !A.d || (qtype == GGUF_Q4_1 && !A.s)) {
    status = 3;
    goto done;
  }
  if (qtype != GGUF_Q4_1 && nb % 2) /* the padding block: qa = 0 is stored as 0x80 */
    for (int64_t m = 0; m < M; ++m) memset(A.q + m * A.nbp * QK + nb * QK, 0x80, QK);
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && (N > 1 || M > 1))
  {
    float mws[qtype == GGUF_Q4_1 ? A.nbp : 1]; /* per thread: K / 32 floats on the stack */
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t b = 0; b < nb; ++b) quantize_block(qtype, a + m * lda + b * QK, &A, m, b);
    /* the implicit barrier: every row is quantized before any is read */
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const uint8_t* wr = w + n * nb * bpb;
      float sums[MTQ];
      for (int64_t m0 = 0; m0 < M; m0 += MTQ) {
        const int mt = (int)(M - m0 < MTQ ? M - m0 : MTQ);
        row_tile(qtype, bpb, wr, nb, &A, m0, mt, mws, sums);
        for (int i = 0; i < mt; ++i) {
          if (out_dtype == 0)
            ((float*)out)[(m0 + i) * ldo + n] = sums[i];
          else
            ((uint16_t*)out)[(m0 + i) * ldo + n] = f32_to_bf16(sums[i]);
        }
      }
    }
  }
done:
  free(A.q);
  free(A.d);
  free(A.s);
  return status;
}
#endif /* GGUF_INT8_DOT */
