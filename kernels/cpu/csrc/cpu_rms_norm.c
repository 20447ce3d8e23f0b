/*
 * Fused residual add + RMSNorm for bfloat16 rows on the CPU (vLLM's fused_add_rms_norm):
 *   if delta: h[r] = bf16(h[r] + delta[r])          (written back: the residual stream)
 *   out[r] = bf16(h[r] * rsqrt(mean(h[r]^2) + eps) * w)
 * Sums and products in float32, one rounding to bfloat16 per output (round to nearest even),
 * as torch's bf16 add and F.rms_norm do. RMSNorm: Zhang & Sennrich 2019.
 * Layouts: h, delta, out [rows, n] dense bfloat16; w [n]. Rows are split over num_threads
 * OpenMP threads; num_threads <= 1 runs on the calling thread with no parallel region (a
 * region per small call costs more than the work).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_bf16.h"
#include "pagedllm_abi.h"

static inline void norm_row(uint16_t* h, const uint16_t* delta, const uint16_t* w, uint16_t* out, int64_t n,
                            float eps) {
  float ss = 0.f;
  if (delta) {
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t v = f32_to_bf16(bf16_to_f32(h[i]) + bf16_to_f32(delta[i]));
      h[i] = v;
      const float f = bf16_to_f32(v);
      ss += f * f;
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const float f = bf16_to_f32(h[i]);
      ss += f * f;
    }
  }
  const float inv = 1.f / sqrtf(ss / (float)n + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = f32_to_bf16(bf16_to_f32(h[i]) * inv * bf16_to_f32(w[i]));
}

int pagedllm_add_rms_norm_bf16(uint16_t* h, const uint16_t* delta, const uint16_t* w, uint16_t* out, int64_t rows,
                               int64_t n, float eps, int num_threads) {
  if (rows < 0 || n < 1) return 1;
  if (num_threads <= 1) {
    for (int64_t r = 0; r < rows; ++r) norm_row(h + r * n, delta ? delta + r * n : 0, w, out + r * n, n, eps);
    return 0;
  }
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t r = 0; r < rows; ++r) norm_row(h + r * n, delta ? delta + r * n : 0, w, out + r * n, n, eps);
  return 0;
}
