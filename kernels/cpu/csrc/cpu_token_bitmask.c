/*
 * A structured output's token bitmask applied to float32 logits (services/executor/sampler.py):
 *
 *   logits[rows[r], t] = -inf   where bit (t % 32) of mask[r, t / 32] is 0, for t < vocab
 *
 * Layouts: logits [N, ld] float32 (rows[r] < N, unchecked here: the wrapper checks), mask [R,
 * words] int32, words * 32 >= vocab (refused otherwise: the wrapper sends a narrower mask to the
 * torch path, which forbids the tokens past it; mask bits past vocab are ignored). The bit order is xgrammar's (token t is bit t % 32 of word t / 32, low bit first).
 * A word of all ones (everything allowed, most words of an open string) is skipped. Rows are
 * split over num_threads OpenMP threads (num_threads <= 1: the calling thread).
 */
#include <math.h>
#include <stdint.h>

#include "pagedllm_abi.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif

int pagedllm_apply_token_bitmask(float* logits, int64_t ld, const int32_t* mask, int64_t words,
                                 const int64_t* rows, int64_t R, int64_t vocab, int num_threads) {
  if (R < 0 || vocab < 0 || words * 32 < vocab || ld < vocab) return 1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && R > 1)
  for (int64_t r = 0; r < R; ++r) {
    float* row = logits + rows[r] * ld;
    const uint32_t* m = (const uint32_t*)mask + r * words;
    int64_t w = 0;
#ifdef __AVX512F__
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    for (; (w + 1) * 32 <= vocab; ++w) { /* whole words: two masked blends of 16 lanes */
      const uint32_t bits = m[w];
      if (bits == 0xffffffffu) continue;
      float* p = row + w * 32;
      _mm512_storeu_ps(p, _mm512_mask_blend_ps((__mmask16)(bits & 0xffffu), ninf, _mm512_loadu_ps(p)));
      _mm512_storeu_ps(p + 16, _mm512_mask_blend_ps((__mmask16)(bits >> 16), ninf, _mm512_loadu_ps(p + 16)));
    }
#endif
    for (; w * 32 < vocab; ++w) {
      const uint32_t bits = m[w];
      if (bits == 0xffffffffu) continue;
      const int64_t end = (w + 1) * 32 < vocab ? 32 : vocab - w * 32;
      for (int64_t j = 0; j < end; ++j) row[w * 32 + j] = ((bits >> j) & 1u) ? row[w * 32 + j] : -INFINITY;
    }
  }
  return 0;
}
