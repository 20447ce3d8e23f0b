/*
 * Weight-only int4 group-quantized matmul on the CPU (GPTQ, AWQ and compressed-tensors W4A16
 * after services/executor/layers/quantization/int4.py repacks them):
 *   out[m, n] = sum_g ( scales[n, g] * dot(q[n, group g], x[m, group g]) - szeros[n, g] * sum(x[m, group g]) )
 * which is x @ W^T for W[n, k] = q[n, k] * scales[n, g] - szeros[n, g] (g = k / G).
 * Layouts: x [M, K] float32 or bfloat16 (row stride ldx, unit stride along K); qw [N, K/2] uint8,
 * per 32 input columns 16 bytes, byte j holding column j in its low nibble and column j + 16 in
 * its high one; scales, szeros [N, K/G] float32; out [M, N] dense, x's dtype (one rounding).
 * K and G multiples of 32, G dividing K. Sums in float32. OpenMP over output columns (blocks of
 * NB), num_threads <= 1 runs on the calling thread. Returns 0, 1 on bad sizes, 3 out of memory.
 */
#include <stdint.h>
#include <stdlib.h>

#include "cpu_bf16.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include "pagedllm_abi.h"

#define MB 8  /* rows of x per register tile */

/* Rows [m0, m0 + mb) of the output column n. */
static void column_rows(const float* xf, const float* xs, const uint8_t* qn, const float* sn, const float* zn,
                        float* acc, int64_t m0, int64_t mb, int64_t K, int64_t G) {
  const int64_t ngroups = K / G;
  for (int64_t r = 0; r < mb; ++r) acc[r] = 0.f;
  for (int64_t g = 0; g < ngroups; ++g) {
    float dots[MB];
#ifdef __AVX512F__
    __m512 vacc[MB];
    for (int64_t r = 0; r < mb; ++r) vacc[r] = _mm512_setzero_ps();
    for (int64_t b = g * G; b < (g + 1) * G; b += 32) {
      const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(qn + b / 2)));
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
      for (int64_t r = 0; r < mb; ++r) {
        const float* xr = xf + (m0 + r) * K + b;
        vacc[r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xr), vacc[r]);
        vacc[r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xr + 16), vacc[r]);
      }
    }
    for (int64_t r = 0; r < mb; ++r) dots[r] = _mm512_reduce_add_ps(vacc[r]);
#else
    for (int64_t r = 0; r < mb; ++r) dots[r] = 0.f;
    for (int64_t b = g * G; b < (g + 1) * G; b += 32) {
      for (int64_t j = 0; j < 16; ++j) {
        const uint8_t byte = qn[b / 2 + j];
        for (int64_t r = 0; r < mb; ++r) {
          const float* xr = xf + (m0 + r) * K + b;
          dots[r] += (float)(byte & 15) * xr[j] + (float)(byte >> 4) * xr[j + 16];
        }
      }
    }
#endif
    for (int64_t r = 0; r < mb; ++r) acc[r] += sn[g] * dots[r] - zn[g] * xs[(m0 + r) * ngroups + g];
  }
}

int pagedllm_gemm_w4(int dtype, const void* x, int64_t ldx, const uint8_t* qw, const float* scales,
                     const float* szeros, void* out, int64_t M, int64_t N, int64_t K, int64_t G, int num_threads) {
  if (M < 0 || N < 1 || K < 32 || G < 32 || K % 32 || G % 32 || K % G || (dtype != 0 && dtype != 1)) return 1;
  if (M == 0) return 0;
  const int64_t ngroups = K / G;
  /* x in float32, dense, and each row's sum over each group */
  float* xf = (float*)malloc(sizeof(float) * (size_t)(M * K));
  float* xs = (float*)malloc(sizeof(float) * (size_t)(M * ngroups));
  if (!xf || !xs) {
    free(xf);
    free(xs);
    return 3;
  }
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; ++k)
      xf[m * K + k] = dtype == 0 ? ((const float*)x)[m * ldx + k] : bf16_to_f32(((const uint16_t*)x)[m * ldx + k]);
    for (int64_t g = 0; g < ngroups; ++g) {
      float s = 0.f;
      for (int64_t k = g * G; k < (g + 1) * G; ++k) s += xf[m * K + k];
      xs[m * ngroups + g] = s;
    }
  }
#pragma omp parallel for schedule(static) num_threads(num_threads > 1 ? num_threads : 1) if (num_threads > 1)
  for (int64_t n = 0; n < N; ++n) {
    float acc[MB];
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
      const int64_t mb = M - m0 < MB ? M - m0 : MB;
      column_rows(xf, xs, qw + n * (K / 2), scales + n * ngroups, szeros + n * ngroups, acc, m0, mb, K, G);
      for (int64_t r = 0; r < mb; ++r) {
        if (dtype == 0)
          ((float*)out)[(m0 + r) * N + n] = acc[r];
        else
          ((uint16_t*)out)[(m0 + r) * N + n] = f32_to_bf16(acc[r]);
      }
    }
  }
  free(xf);
  free(xs);
  return 0;
}
