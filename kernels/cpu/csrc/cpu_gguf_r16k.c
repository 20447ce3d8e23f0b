/*
 * GGUF Q4_K / Q5_K / Q6_K weights with their rows interleaved by 16 (type | GGUF_R16, packed by
 * services/executor/layers/gguf_r16.py) times int8-quantized bf16 activations: the activation
 * quantization of cpu_gguf_q8.c (gguf_q8_quantize_block: per 32-element block qa, d_a, s_a =
 * sum qa). The file's super-block layouts are in cpu_gguf_gemm.c's header.
 *
 * Layout of W [N, K] (N a multiple of 16, ns = K / 256 super-blocks per row, bpb = 144 / 176 /
 * 210 bytes per super-block: the file's size exactly): rows 16 g .. 16 g + 15 form group g; its
 * super-block s lies at byte (g ns + s) 16 bpb and holds
 *   the 16 rows' fp16 fields, row r at byte 2 r of each: Q4_K / Q5_K 16 d then 16 dmin (64 bytes),
 *   Q6_K 16 d (32 bytes);
 *   then the rest of each row's super-block in the file's order (Q4_K / Q5_K: bytes 4 .. bpb - 1,
 *   Q6_K: bytes 0 .. 207) cut into 4-byte chunks: chunk c is a 64-byte vector whose lane r holds
 *   row r's chunk c. So, with p = 0..7 the lane's elements 4 p .. 4 p + 3 of a sub-block:
 *   Q4_K: c 0-2 the 12 scale bytes; c 3 + 8 i + p the nibble bytes 32 i + 4 p .. (sub-blocks 2 i low, 2 i + 1 high)
 *   Q5_K: c 0-2 the scales; c 3 + p the qh bytes 4 p ..; c 11 + 8 i + p the nibbles as Q4_K's
 *   Q6_K: c 0-31 the ql bytes 4 c ..; c 32 + 8 h + p the qh bytes 32 h + 4 p ..; c 48-51 the 16 int8 scales
 * A lane's 4 bytes are one row's, so the 6-bit scales and mins decode by 32-bit shifts within the
 * lanes (byte t of a lane is its bits 8 t .. 8 t + 7), and every quant is an unsigned byte for
 * vpdpbusd (unsigned weight bytes times the activation's 4 signed bytes broadcast to all lanes,
 * summed in fours into int32 lanes): one sub-block of 16 rows into one vector, no horizontal sum;
 * a sub-block's unpacked quants serve a tile of up to MT activation rows.
 *
 * Per 32-element sub-block j of super-block s (activation block b = 8 s + j), for each row of a
 * group (integer sums exact in int32):
 *   Q4_K / Q5_K: dot = sum_e q[e] qa[e]                       (q 0..15 / 0..31)
 *                acc += float(dot) * fl(fl(d sc_j) d_a)       (d sc_j exact: an fp16 times 6 bits)
 *                acc -= fl(dmin m_j) * fl(d_a s_a)            (dmin m_j exact)
 *   Q6_K:        dot_h = sum over the 16 e of half h q[e] qa[e] - 32 sum qa   (h = 0, 1; q 0..63)
 *                isum = sc[2 j] dot_0 + sc[2 j + 1] dot_1    (|isum| < 2^24: exact in float32)
 *                acc += float(isum) * fl(d d_a)
 * every "acc +=" / "acc -=" one fused multiply-add, in the order of s, then j, into one float32
 * accumulator per output; out = acc, or acc rounded once to bf16. So the result differs from the
 * exact sum of the quantized operands by float32 rounding only. The 6-bit scales and mins stay
 * packed as in the file, so the layout keeps the file's 144 / 176 / 210 bytes per row and
 * super-block. Compiled only where the build has VNNI (GGUF_INT8_DOT in cpu_gguf_q8.h);
 * elsewhere, and for float32 activations, cpu_gguf_gemm.c's float32 path serves each group's
 * super-blocks unpacked to the file's rows (gguf_r16k_unpack).
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

#define QK 32   /* elements per activation block (a sub-block) */
#define QKK 256 /* elements per super-block */
#define RG 16   /* rows per group */
#define MT 8    /* activation rows per tile */

int gguf_r16k_supports(int qtype) { return qtype == GGUF_Q4_K || qtype == GGUF_Q5_K || qtype == GGUF_Q6_K; }

static int sb_bytes(int qtype) { return qtype == GGUF_Q4_K ? 144 : qtype == GGUF_Q5_K ? 176 : 210; }

void gguf_r16k_unpack(int qtype, const uint8_t* group, int64_t ns, uint8_t* rows) {
  const int bpb = sb_bytes(qtype), halves = qtype == GGUF_Q6_K ? 1 : 2;
  const int half_at = qtype == GGUF_Q6_K ? 208 : 0, rest_at = qtype == GGUF_Q6_K ? 0 : 4;
  const int chunks = (bpb - 2 * halves) / 4;
  for (int64_t s = 0; s < ns; ++s) {
    const uint8_t* sb = group + s * RG * bpb;
    const uint8_t* cv = sb + 32 * halves; /* chunk 0 */
    for (int r = 0; r < RG; ++r) {
      uint8_t* dst = rows + (r * ns + s) * bpb;
      for (int h = 0; h < halves; ++h) memcpy(dst + half_at + 2 * h, sb + 32 * h + 2 * r, 2);
      for (int c = 0; c < chunks; ++c) memcpy(dst + rest_at + 4 * c, cv + 64 * c + 4 * r, 4);
    }
  }
}

#if GGUF_INT8_DOT
/* The int8 activations: M rows of nb 32-element blocks. */
typedef struct {
  int64_t nb;
  int8_t* q;    /* [M, nb * 32] qa */
  float* d;     /* [M, nb] d_a */
  float* ds;    /* [M, nb] fl(d_a s_a) (Q4_K, Q5_K) */
  int32_t* hs;  /* [M, nb, 2] 32 * the sum of qa over elements 0-15 and 16-31 (Q6_K) */
} act_k;

/* Activation block c (row c / nb, block c % nb; 32 bf16 at x) -> A. */
static void quantize_block(const uint16_t* x, act_k* A, int64_t c) {
  int8_t* q = A->q + c * QK;
  int32_t s, lo = 0;
  gguf_q8_quantize_block(x, q, &A->d[c], &s);
  A->ds[c] = A->d[c] * (float)s;
  for (int e = 0; e < QK / 2; ++e) lo += q[e];
  A->hs[2 * c] = 32 * lo;
  A->hs[2 * c + 1] = 32 * (s - lo);
}

static inline __m512i bcast4(const int8_t* p) { /* the 4 bytes at p in every lane ({1to16}) */
  int32_t v;
  memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

static inline __m512i load(const uint8_t* p) { return _mm512_loadu_si512((const void*)p); }

/* v shifted right (n > 0) or left (n < 0) by |n| bits in each 16-bit lane; n a constant after inlining. */
static inline __attribute__((always_inline)) __m512i shift16(__m512i v, int n) {
  return n > 0 ? _mm512_srli_epi16(v, n) : n < 0 ? _mm512_slli_epi16(v, -n) : v;
}

/* Q4_K / Q5_K sub-block j of the group super-block sb: wv[p] lane r = row r's quants 4 p .. 4 p + 3;
 * *dsc, *dm = d sc_j and dmin m_j of the 16 rows. j is a constant after inlining (the shifts immediates). */
static inline __attribute__((always_inline)) void q45_sub_block(const int qt, const uint8_t* sb, const int j,
                                                                __m512i* wv, __m512* dsc, __m512* dm) {
  const uint8_t* cv = sb + 64; /* chunk 0 */
  const __m512i s0 = load(cv), s1 = load(cv + 64), s2 = load(cv + 128);
  __m512i sc, mn;
  if (j < 4) { /* byte j of s0 / s1 */
    sc = _mm512_and_si512(_mm512_srli_epi32(s0, 8 * j), _mm512_set1_epi32(63));
    mn = _mm512_and_si512(_mm512_srli_epi32(s1, 8 * j), _mm512_set1_epi32(63));
  } else { /* low 4 bits from byte j - 4 of s2, high 2 from the top of byte j - 4 of s0 / s1 */
    const int t = 8 * (j - 4);
    const __m512i m15 = _mm512_set1_epi32(15), m48 = _mm512_set1_epi32(48);
    sc = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(s2, t), m15),
                         _mm512_and_si512(_mm512_srli_epi32(s0, t + 2), m48));
    mn = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(s2, t + 4), m15),
                         _mm512_and_si512(_mm512_srli_epi32(s1, t + 2), m48));
  }
  *dsc = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)sb)), _mm512_cvtepi32_ps(sc));
  *dm = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sb + 32))), _mm512_cvtepi32_ps(mn));
  const uint8_t* qs = cv + 64 * (qt == GGUF_Q5_K ? 11 : 3) + 512 * (j / 2);
  const __m512i low = _mm512_set1_epi8(15), bit4 = _mm512_set1_epi8(16);
#pragma GCC unroll 8
  for (int p = 0; p < 8; ++p) {
    __m512i v = _mm512_and_si512(shift16(load(qs + 64 * p), 4 * (j % 2)), low);
    if (qt == GGUF_Q5_K) { /* bit j of the qh byte -> bit 4 (16-bit shifts: each byte's bits stay its own) */
      v = _mm512_or_si512(v, _mm512_and_si512(shift16(load(cv + 64 * (3 + p)), j - 4), bit4));
    }
    wv[p] = v;
  }
}

/* Q6_K sub-block j of the group super-block sb: wv[p] as above (q 0..63); *sc0, *sc1 = the int8
 * scales of elements 0-15 and 16-31 of the 16 rows, as int32. j a constant after inlining. */
static inline __attribute__((always_inline)) void q6_sub_block(const uint8_t* sb, const int j, __m512i* wv,
                                                               __m512i* sc0, __m512i* sc1) {
  const uint8_t* cv = sb + 32; /* chunk 0 */
  const int h = j / 4, s = j % 4;
  const uint8_t* ql = cv + 64 * (16 * h + 8 * (s % 2));
  const uint8_t* qh = cv + 64 * (32 + 8 * h);
  const __m512i v = load(cv + 64 * (48 + j / 2)); /* sc[4 (j / 2) .. + 3]: ours are bytes 2 (j % 2), + 1 */
  *sc0 = _mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 16 * (j % 2)), 24);
  *sc1 = _mm512_srai_epi32(_mm512_slli_epi32(v, 16 - 16 * (j % 2)), 24);
  const __m512i low = _mm512_set1_epi8(15), top = _mm512_set1_epi8(48);
#pragma GCC unroll 8
  for (int p = 0; p < 8; ++p) { /* bits 2 s, 2 s + 1 of the qh byte -> bits 4, 5 */
    const __m512i lo4 = _mm512_and_si512(shift16(load(ql + 64 * p), 4 * (s / 2)), low);
    wv[p] = _mm512_or_si512(lo4, _mm512_and_si512(shift16(load(qh + 64 * p), 2 * s - 4), top));
  }
}

/* out[m0 + i, n0 .. n0 + 15] for i < mt: the group at wg (ns super-blocks) times activation rows m0 .. m0 + mt - 1. */
static inline __attribute__((always_inline)) void group_tile(const int qt, const int mt1, const uint8_t* wg,
                                                             int64_t ns, const act_k* A, int64_t m0, int mt,
                                                             int out_dtype, void* out, int64_t ldo, int64_t n0) {
  if (mt1) mt = 1;
  const int64_t nb = A->nb, step = (int64_t)RG * sb_bytes(qt);
  __m512 acc[MT];
#pragma GCC unroll 8
  for (int i = 0; i < MT; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t s = 0; s < ns; ++s) {
    const uint8_t* sb = wg + s * step;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)sb)); /* Q6_K's d */
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      __m512i wv[8], sc0, sc1;
      __m512 dsc, dm;
      if (qt == GGUF_Q6_K)
        q6_sub_block(sb, j, wv, &sc0, &sc1);
      else
        q45_sub_block(qt, sb, j, wv, &dsc, &dm);
#pragma GCC unroll 8
      for (int i = 0; i < MT; ++i) {
        if (i >= mt) break;
        const int64_t ab = (m0 + i) * nb + 8 * s + j;
        const int8_t* aq = A->q + ab * QK;
        const __m512 da = _mm512_set1_ps(A->d[ab]);
        __m512i lo = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[0], bcast4(aq));
        __m512i hi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[4], bcast4(aq + 16));
#pragma GCC unroll 3
        for (int p = 1; p < 4; ++p) {
          lo = _mm512_dpbusd_epi32(lo, wv[p], bcast4(aq + 4 * p));
          hi = _mm512_dpbusd_epi32(hi, wv[p + 4], bcast4(aq + 16 + 4 * p));
        }
        if (qt == GGUF_Q6_K) {
          lo = _mm512_sub_epi32(lo, _mm512_set1_epi32(A->hs[2 * ab]));
          hi = _mm512_sub_epi32(hi, _mm512_set1_epi32(A->hs[2 * ab + 1]));
          const __m512i isum = _mm512_add_epi32(_mm512_mullo_epi32(sc0, lo), _mm512_mullo_epi32(sc1, hi));
          acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, da), acc[i]);
        } else {
          acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(lo, hi)), _mm512_mul_ps(dsc, da), acc[i]);
          acc[i] = _mm512_fnmadd_ps(dm, _mm512_set1_ps(A->ds[ab]), acc[i]);
        }
      }
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

static void group_rows(int qt, const uint8_t* wg, int64_t ns, const act_k* A, int64_t M, int out_dtype, void* out,
                       int64_t ldo, int64_t n0) {
  for (int64_t m0 = 0; m0 < M; m0 += MT) {
    const int mt = (int)(M - m0 < MT ? M - m0 : MT);
    switch (qt * 2 + (mt == 1)) { /* the type (and a single row) constant inside each copy */
      case GGUF_Q4_K * 2: group_tile(GGUF_Q4_K, 0, wg, ns, A, m0, mt, out_dtype, out, ldo, n0); break;
      case GGUF_Q4_K * 2 + 1: group_tile(GGUF_Q4_K, 1, wg, ns, A, m0, mt, out_dtype, out, ldo, n0); break;
      case GGUF_Q5_K * 2: group_tile(GGUF_Q5_K, 0, wg, ns, A, m0, mt, out_dtype, out, ldo, n0); break;
      case GGUF_Q5_K * 2 + 1: group_tile(GGUF_Q5_K, 1, wg, ns, A, m0, mt, out_dtype, out, ldo, n0); break;
      case GGUF_Q6_K * 2: group_tile(GGUF_Q6_K, 0, wg, ns, A, m0, mt, out_dtype, out, ldo, n0); break;
      default: group_tile(GGUF_Q6_K, 1, wg, ns, A, m0, mt, out_dtype, out, ldo, n0); break;
    }
  }
}

int gguf_gemm_r16k_q8a(int qtype, const uint8_t* w, const uint16_t* a, int64_t lda, int out_dtype, void* out,
                       int64_t ldo, int64_t M, int64_t N, int64_t K, int num_threads) {
  if (!gguf_r16k_supports(qtype) || K % QKK != 0 || N % RG != 0 || M < 0 || N < 0) return 1;
  const int64_t nb = K / QK, ns = K / QKK, groups = N / RG, gbytes = ns * RG * sb_bytes(qtype);
  const int nt = num_threads > 1 && (groups > 1 || M > 1) ? num_threads : 1;
  const size_t cells = (size_t)(M > 0 ? M : 1) * (size_t)nb;
  act_k A = {.nb = nb, .q = (int8_t*)malloc(cells * QK), .d = (float*)malloc(cells * sizeof(float)),
             .ds = (float*)malloc(cells * sizeof(float)), .hs = (int32_t*)malloc(2 * cells * sizeof(int32_t))};
  int status = 0;
  if (!A.q || !A.d || !A.ds || !A.hs) {
    status = 3;
    goto done;
  }
#pragma omp parallel num_threads(nt)
  {
#pragma omp for schedule(static)
    for (int64_t c = 0; c < M * nb; ++c) quantize_block(a + (c / nb) * lda + (c % nb) * QK, &A, c);
    /* the implicit barrier: every row is quantized before any is read */
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; ++g) group_rows(qtype, w + g * gbytes, ns, &A, M, out_dtype, out, ldo, g * RG);
  }
done:
  free(A.q);
  free(A.d);
  free(A.ds);
  free(A.hs);
  return status;
}
#endif /* GGUF_INT8_DOT */
